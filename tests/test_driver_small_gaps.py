"""The Vitals driver: a step that never ends keeps a bounded list of micro-batch sizes, and an
evaluation between two optimizers' steps of one batch leaves that batch one step."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import _MAX_WINDOW_MICRO_BATCHES, Vitals
from trainvitals.callbacks import NormMonitor, RuntimeMonitor, ThroughputMonitor
from trainvitals.callbacks.base import VitalsCallback

# ---------------------------------------------------------------- a step that never ends


def _skipping_scaler_loop(vitals: Vitals, model, opt, batches: int) -> None:
    """Micro-batches of 3 samples whose GradScaler (not given to attach) skips every step: the
    loss is infinite, so the scaler finds inf gradients and never calls opt.step()."""
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(batches):
        x = torch.randn(3, 4)
        vitals.batch(x, num_tokens=12)
        scaler.scale(model(x).sum() * float("inf")).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_a_step_no_optimizer_ends_keeps_no_more_sizes_than_a_window_has():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    vitals = Vitals([RuntimeMonitor(max_steps=10)], writer=writer, log_every_n_steps=1)
    vitals.attach(model, opt)
    bound = max(vitals.ctx.accumulate_grad_batches, _MAX_WINDOW_MICRO_BATCHES)
    _skipping_scaler_loop(vitals, model, opt, 5)
    assert vitals.step == 0  # the driver ends no step of its own accord
    x = torch.randn(3, 4)
    # ... nor does a loop that never steps the attached optimizer: up to the bound, a
    # checkpoint carries every micro-batch (an accumulation window that long may exist)
    for _ in range(bound - 5):
        vitals.batch(x, num_tokens=12)
    carried = vitals.state_dict()["micro_batches_in_step"]
    assert len(carried) == bound
    assert carried[0] == {"RuntimeMonitor": [3, 12]}
    with pytest.warns(RuntimeWarning, match="micro-batches without the end of an optimizer step"):
        vitals.batch(x, num_tokens=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        for _ in range(50):
            vitals.batch(x, num_tokens=12)
    assert vitals.ctx.micro_batches_in_step == bound + 51
    # not a step to checkpoint mid-window: none of its micro-batches is carried
    assert vitals.state_dict()["micro_batches_in_step"] == []
    assert len(vitals._step_batches) == 0
    # an optimizer step ends it; the next step's window is kept again
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    assert vitals.step == 1
    vitals.batch(torch.randn(2, 4), num_tokens=5)
    vitals.batch(torch.randn(4, 4), num_tokens=7)
    assert vitals.state_dict()["micro_batches_in_step"] == [
        {"RuntimeMonitor": [2, 5]},
        {"RuntimeMonitor": [4, 7]},
    ]
    vitals.close()
    # the never-ending step still counted all its micro-batches (samples 3 each)
    assert writer.key("time/batches") == {0: bound + 51}
    assert writer.key("time/samples") == {0: 3 * (bound + 51)}


def test_an_accumulation_window_longer_than_the_default_bound_is_kept_whole():
    # accumulate_grad_batches above the bound: a checkpoint inside that window keeps it all
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window = _MAX_WINDOW_MICRO_BATCHES + 10
    vitals = Vitals([ThroughputMonitor()], writer=RecordingWriter(), accumulate_grad_batches=window)
    vitals.attach(model, opt)
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(window - 1):
            vitals.batch(x)
    carried = vitals.state_dict()["micro_batches_in_step"]
    assert len(carried) == window - 1
    assert all(sizes == {"ThroughputMonitor": [3, None]} for sizes in carried)
    vitals.close()


# ---------------------------------------------------------------- validation inside a batch


class Events(VitalsCallback):
    """Records micro-batches, gradient hooks, step ends and validations with ``ctx.step``."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []

    def micro_batch_start(self, ctx, batch):
        self.events.append(("mb", ctx.step))

    def before_optimizer_step(self, ctx):
        self.events.append(("grads", ctx.step))

    def step_end(self, ctx):
        self.events.append(("end", ctx.step, ctx.micro_batches_in_step))

    def validation_start(self, ctx):
        self.events.append(("val", ctx.step))


# keys whose values depend on wall-clock time, not on what was counted
_TIMED = ("per_sec", "seconds", "hours", "mfu")


class _Gan(torch.nn.Module):
    """A generator and a discriminator; the forward is the generator's (one per batch, counted
    as the micro-batch by a loop that does not call ``vitals.batch()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.nn.Sequential(
            torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)
        )
        self.dis = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.gen(z)


def _gan_run(*, calls_batch: bool, validate: set[int], g_every: int = 1, batches: int = 6):
    """A plain-loop GAN: the discriminator steps every batch, the generator every ``g_every``
    batches after it. ``validate``: batches with an evaluation right after the discriminator's
    step: before the generator's, or, in a batch where the generator does not step, between
    that batch and the next. Returns (vitals, writer, events)."""
    torch.manual_seed(0)
    model = _Gan()
    opt_d = torch.optim.SGD(model.dis.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(model.gen.parameters(), lr=0.05)
    writer = RecordingWriter()
    events = Events()
    callbacks = [
        ThroughputMonitor(window_size=2),
        RuntimeMonitor(max_steps=10),
        NormMonitor(),
        events,
    ]
    vitals = Vitals(callbacks, writer=writer, log_every_n_steps=1)
    vitals.attach(model, [opt_d, opt_g])
    for b in range(batches):
        real, z = torch.randn(5, 4), torch.randn(5, 3)
        if calls_batch:
            vitals.batch(real)
        fake = model(z)
        opt_d.zero_grad()
        (model.dis(fake.detach()).mean() - model.dis(real).mean()).backward()
        opt_d.step()
        if b in validate:
            with vitals.validating(), torch.no_grad():
                model.eval()
                model.dis(model(torch.ones(7, 3)))  # (no draw from the training stream)
                model.train()
        if b % g_every == 0:
            opt_g.zero_grad()
            (-model.dis(fake).mean()).backward()
            opt_g.step()
    vitals.close()
    return vitals, writer, events.events


def _counted_rows(writer: RecordingWriter) -> dict[int, dict[str, float]]:
    return {
        step: {k: v for k, v in row.items() if not any(t in k for t in _TIMED)}
        for step, row in writer.rows.items()
    }


@pytest.mark.parametrize("calls_batch", [True, False], ids=["batch", "forwards"])
def test_validation_between_two_optimizers_steps_keeps_the_batch_one_step(calls_batch):
    plain_vitals, plain, plain_events = _gan_run(calls_batch=calls_batch, validate=set())
    vitals, writer, events = _gan_run(calls_batch=calls_batch, validate={2})
    assert plain_vitals.step == vitals.step == 6  # one step per batch
    # every callback's step-keyed values (those not read off a clock) are the plain run's
    assert sorted(writer.rows) == list(range(6))
    assert _counted_rows(writer) == _counted_rows(plain)
    assert writer.key("time/batches") == {s: s + 1.0 for s in range(6)}
    if calls_batch:
        assert writer.key("time/samples") == {s: 5.0 * (s + 1) for s in range(6)}
    assert [e for e in events if e[0] != "val"] == plain_events
    # batch 2's step goes on after the evaluation and ends after the generator's step
    i = events.index(("val", 2))
    assert events[i - 2 : i + 4] == [
        ("mb", 2), ("grads", 2), ("val", 2), ("grads", 2), ("end", 2, 1), ("mb", 3)
    ]  # fmt: skip


@pytest.mark.parametrize("calls_batch", [True, False], ids=["batch", "forwards"])
def test_validation_after_a_batch_in_which_only_some_optimizers_stepped(calls_batch):
    # The generator steps every 2nd batch: batch 1 ends with the discriminator's step, then
    # the evaluation comes, between batches 1 and 2. The step is not known to be over there
    # (the generator might step next): it ends before batch 2's first micro-batch, with the
    # counts and values of the run without the evaluation.
    _, plain, plain_events = _gan_run(calls_batch=calls_batch, validate=set(), g_every=2)
    vitals, writer, events = _gan_run(calls_batch=calls_batch, validate={1}, g_every=2)
    assert vitals.step == 6
    assert _counted_rows(writer) == _counted_rows(plain)
    assert writer.key("time/batches") == {s: s + 1.0 for s in range(6)}
    assert [e for e in events if e[0] != "val"] == plain_events
    i = events.index(("val", 1))
    assert events[i - 2 : i + 3] == [("mb", 1), ("grads", 1), ("val", 1), ("end", 1, 1), ("mb", 2)]


@pytest.mark.parametrize("calls_batch", [True, False], ids=["batch", "forwards"])
def test_validation_after_every_optimizer_stepped_ends_the_step_before_it(calls_batch):
    # The documented case: both optimizers stepped in batch 2, then the evaluation (between
    # batches, as Lightning validates once the batch ended): the step ends before it, and
    # ctx.step inside it is the next step's.
    torch.manual_seed(0)
    model = _Gan()
    opt_d = torch.optim.SGD(model.dis.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(model.gen.parameters(), lr=0.05)
    rec = Events()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [opt_d, opt_g])
    for b in range(3):
        real, z = torch.randn(5, 4), torch.randn(5, 3)
        if calls_batch:
            vitals.batch(real)
        fake = model(z)
        opt_d.zero_grad()
        (model.dis(fake.detach()).mean() - model.dis(real).mean()).backward()
        opt_d.step()
        opt_g.zero_grad()
        (-model.dis(fake).mean()).backward()
        opt_g.step()
        if b == 1:
            with vitals.validating():
                assert vitals.step == 2
    vitals.close()
    assert rec.events == [
        ("mb", 0), ("grads", 0), ("grads", 0), ("end", 0, 1),
        ("mb", 1), ("grads", 1), ("grads", 1), ("end", 1, 1), ("val", 2),
        ("mb", 2), ("grads", 2), ("grads", 2), ("end", 2, 1),
    ]  # fmt: skip
