"""The Vitals driver with several attached optimizers: a GAN written as a plain loop (each
optimizer after its own backward), a discriminator stepped more often than the generator, and
parameters split over two optimizers after one backward. The step is the batch; the gradient
hook runs before every attached optimizer's step(), with that optimizer's current gradients."""

from __future__ import annotations

import pytest
import torch

from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.base import VitalsCallback


class GradRecorder(VitalsCallback):
    """Copies every parameter's gradient at each ``before_optimizer_step`` and records which
    optimizer the driver says is stepping."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []
        self.seen: list[tuple[object, dict[int, torch.Tensor | None]]] = []

    def micro_batch_start(self, ctx, batch):
        self.events.append(("mb", ctx.step))

    def before_optimizer_step(self, ctx):
        stepping = ctx.stepping_optimizer
        grads = {
            id(p): (None if p.grad is None else p.grad.detach().clone())
            for p in ctx.model.parameters()
        }
        self.seen.append((stepping, grads))
        self.events.append(("grads", ctx.step))

    def step_end(self, ctx):
        self.events.append(("end", ctx.step, ctx.micro_batches_in_step))


def _gan():
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    discriminator = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )
    model = torch.nn.ModuleDict({"generator": generator, "discriminator": discriminator})
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.05)
    return model, generator, discriminator, opt_d, opt_g


def _snapshot(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    return {id(p): p.grad.detach().clone() for p in module.parameters()}


def _assert_current(seen_grads: dict, expected: dict[int, torch.Tensor]) -> None:
    for key, want in expected.items():
        got = seen_grads[key]
        assert got is not None
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _two_steps_per_batch(batches: int) -> list[tuple]:
    """The events of batches of one micro-batch each that step both optimizers."""
    return [
        e for s in range(batches) for e in (("mb", s), ("grads", s), ("grads", s), ("end", s, 1))
    ]


def _run_gan(vitals: Vitals, generator, discriminator, opt_d, opt_g, g_every: int, batches: int):
    """A plain-loop GAN: the discriminator steps every batch, the generator every ``g_every``.
    Returns (optimizer, gradients copied right before its step()) for every step() call."""
    stepped = []
    for i in range(batches):
        real = torch.randn(5, 4)
        z = torch.randn(5, 3)
        vitals.batch(real)
        opt_d.zero_grad()
        loss_d = discriminator(generator(z).detach()).mean() - discriminator(real).mean()
        loss_d.backward()
        stepped.append((opt_d, _snapshot(discriminator)))
        opt_d.step()
        if (i + 1) % g_every == 0:
            opt_g.zero_grad()
            # the generator's loss reaches the discriminator's parameters too (not frozen, as
            # in many GAN loops), so its gradients at this point are not the ones opt_d used
            loss_g = -discriminator(generator(z)).mean()
            loss_g.backward()
            stepped.append((opt_g, _snapshot(generator)))
            opt_g.step()
    return stepped


def test_gan_loop_shows_each_optimizers_current_gradients_and_ends_the_step_after_the_last():
    model, generator, discriminator, opt_d, opt_g = _gan()
    rec = GradRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [opt_d, opt_g])
    batches = 3
    # at opt_d's step the generator still holds the previous batch's gradients, and at
    # opt_g's step the discriminator holds the generator loss's: neither is what its optimizer uses
    stepped = _run_gan(vitals, generator, discriminator, opt_d, opt_g, 1, batches)
    vitals.close()
    assert len(rec.seen) == len(stepped) == 2 * batches
    for (stepping, grads), (optimizer, expected) in zip(rec.seen, stepped, strict=True):
        assert stepping is optimizer
        _assert_current(grads, expected)
    assert rec.events == _two_steps_per_batch(batches)
    assert vitals.step == batches


@pytest.mark.parametrize("ends_at", ["checkpoint", "close"])
def test_an_optimizer_that_skips_a_batch_ends_the_step_at_the_next_batch(ends_at):
    # WGAN-style schedule: the discriminator steps every batch, the generator every 2nd. The
    # last batch steps the discriminator only: a checkpoint (or close) after it counts it.
    model, generator, discriminator, opt_d, opt_g = _gan()
    rec = GradRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [opt_d, opt_g])
    stepped = _run_gan(vitals, generator, discriminator, opt_d, opt_g, 2, 5)
    if ends_at == "checkpoint":
        assert vitals.state_dict()["step"] == 5
        assert rec.events[-1] == ("end", 4, 1)
    vitals.close()
    assert vitals.step == 5
    assert [opt for opt, _ in stepped] == [opt_d, opt_d, opt_g, opt_d, opt_d, opt_g, opt_d]
    for (stepping, grads), (optimizer, expected) in zip(rec.seen, stepped, strict=True):
        assert stepping is optimizer
        _assert_current(grads, expected)
    assert rec.events == [
        ("mb", 0), ("grads", 0), ("end", 0, 1),  # ended by batch 1's start
        ("mb", 1), ("grads", 1), ("grads", 1), ("end", 1, 1),  # ended by opt_g's step
        ("mb", 2), ("grads", 2), ("end", 2, 1),
        ("mb", 3), ("grads", 3), ("grads", 3), ("end", 3, 1),
        ("mb", 4), ("grads", 4), ("end", 4, 1),  # ended by the checkpoint, else by close()
    ]  # fmt: skip


def test_parameters_split_over_two_optimizers_after_one_backward():
    # Muon + AdamW style: one backward, then each optimizer steps its share of the parameters.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.AdamW(model[1].parameters(), lr=0.1)
    rec = GradRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [first, second])
    expected = []
    for _ in range(2):
        x = torch.randn(3, 4)
        vitals.batch(x)
        model(x).pow(2).mean().backward()
        expected += [(first, _snapshot(model[0])), (second, _snapshot(model[1]))]
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
    vitals.close()
    for (stepping, grads), (optimizer, want) in zip(rec.seen, expected, strict=True):
        assert stepping is optimizer
        _assert_current(grads, want)
    assert rec.events == _two_steps_per_batch(2)


def test_clipping_one_network_shows_its_unclipped_gradients_before_its_step():
    model, generator, discriminator, opt_d, opt_g = _gan()
    rec = GradRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [opt_d, opt_g])
    expected = []
    for _ in range(2):
        real, z = torch.randn(5, 4) * 50, torch.randn(5, 3)
        vitals.batch(real)
        opt_d.zero_grad()
        (discriminator(generator(z).detach()).mean() - discriminator(real).mean()).backward()
        expected.append((opt_d, _snapshot(discriminator)))
        vitals.clip_grad_norm_(discriminator.parameters(), max_norm=1e-4)
        opt_d.step()
        opt_g.zero_grad()
        (-discriminator(generator(z)).mean()).backward()
        expected.append((opt_g, _snapshot(generator)))
        vitals.clip_grad_norm_(generator.parameters(), max_norm=1e-4)
        opt_g.step()
    vitals.close()
    assert (
        min(float(torch.stack([g.norm() for g in want.values()]).norm()) for _, want in expected)
        > 1e-2
    )  # so that clipped gradients (1e-4) could not pass
    assert len(rec.seen) == len(expected)
    for (stepping, grads), (optimizer, want) in zip(rec.seen, expected, strict=True):
        assert stepping is optimizer
        _assert_current(grads, want)
    assert rec.events == _two_steps_per_batch(2)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_gan_on_one_grad_scaler_shows_each_network_unscaled_at_its_scaler_step():
    # fp16 GAN on one scaler: scaler.step(opt_d) unscales the discriminator's gradients (the
    # generator's are still scaled: the previous batch's) and the driver shows them there, as
    # opt_d alone; scaler.step(opt_g) likewise for the generator. Never a scaled gradient, and
    # no warning.
    model, generator, discriminator, opt_d, opt_g = _gan()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    rec = GradRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [opt_d, opt_g], scaler=scaler)
    expected = []
    for _ in range(2):
        real, z = torch.randn(5, 4), torch.randn(5, 3)
        vitals.batch(real)
        opt_d.zero_grad()
        loss_d = discriminator(generator(z).detach()).mean() - discriminator(real).mean()
        scaler.scale(loss_d).backward()
        scale = scaler.get_scale()
        expected.append((opt_d, {k: g / scale for k, g in _snapshot(discriminator).items()}))
        scaler.step(opt_d)
        opt_g.zero_grad()
        scaler.scale(-discriminator(generator(z)).mean()).backward()
        expected.append((opt_g, {k: g / scale for k, g in _snapshot(generator).items()}))
        scaler.step(opt_g)
        scaler.update()
    vitals.close()
    assert [stepping for stepping, _ in rec.seen] == [opt_d, opt_g, opt_d, opt_g]
    for (_, grads), (_, want) in zip(rec.seen, expected, strict=True):
        for key, value in want.items():
            torch.testing.assert_close(grads[key], value, rtol=1e-6, atol=0)
    assert rec.events == _two_steps_per_batch(2)


def test_norm_monitor_in_a_gan_loop_measures_each_network_at_its_own_step():
    # NormMonitor reads ctx.stepping_optimizer: each network's gradients and weights as its
    # optimizer uses them, merged into one write per batch with per-optimizer keys.
    from trainvitals.callbacks.norm_monitor import NormMonitor

    model, generator, discriminator, opt_d, opt_g = _gan()
    writer = RecordingWriter()
    vitals = Vitals([NormMonitor()], writer=writer, log_every_n_steps=1)
    vitals.attach(model, [opt_d, opt_g])
    expected: list[dict[str, float]] = []
    for _ in range(3):
        real, z = torch.randn(5, 4), torch.randn(5, 3)
        vitals.batch(real)
        row: dict[str, float] = {}
        opt_d.zero_grad()
        (discriminator(generator(z).detach()).mean() - discriminator(real).mean()).backward()
        for i, net in ((0, discriminator), (1, generator)):
            if i == 1:
                opt_g.zero_grad()
                (-discriminator(generator(z)).mean()).backward()
            params = [p.detach().double() for p in net.parameters()]
            grads = [p.grad.detach().double() for p in net.parameters()]
            row[f"l2_norm/param/optimizer_{i}"] = float(sum((x * x).sum() for x in params))
            row[f"l2_norm/grad/optimizer_{i}"] = float(sum((g * g).sum() for g in grads))
            (opt_d if i == 0 else opt_g).step()
        expected.append(row)
    vitals.close()
    assert sorted(writer.rows) == [0, 1, 2]
    for step, want in enumerate(expected):
        got = writer.rows[step]
        for key, sq in want.items():
            assert got[key] == pytest.approx(sq**0.5, rel=1e-6)
        for kind in ("param", "grad"):
            total = want[f"l2_norm/{kind}/optimizer_0"] + want[f"l2_norm/{kind}/optimizer_1"]
            assert got[f"l2_norm/{kind}/global"] == pytest.approx(total**0.5, rel=1e-6)


@pytest.mark.parametrize("generator_every", [1, 2])
def test_two_optimizers_log_every_n_batches(generator_every):
    """The driver's step is the batch (both optimizers' step()s in it): ctx.step advances by 1
    per batch, step_increment and step_gap stay 1, so log_every_n_steps=3 logs the batches 0, 3,
    6, 9, decided alike at the batch's start and at its end; also when the generator steps
    every other batch only (such a step ends at the next batch)."""
    from trainvitals.callbacks.norm_monitor import NormMonitor

    class Decisions(VitalsCallback):
        def __init__(self) -> None:
            super().__init__()
            self.at_start: dict[int, bool] = {}
            self.at_end: dict[int, tuple[bool, int, int]] = {}

        def micro_batch_start(self, ctx, batch):
            self.at_start[ctx.step] = self.should_log(ctx)

        def step_end(self, ctx):
            self.at_end[ctx.step] = (self.should_log(ctx), ctx.step_increment, ctx.step_gap)

    model, generator, discriminator, opt_d, opt_g = _gan()
    writer = RecordingWriter()
    probe = Decisions()
    vitals = Vitals([NormMonitor(), probe], writer=writer, log_every_n_steps=3)
    vitals.attach(model, [opt_d, opt_g])
    batches = 10
    for b in range(batches):
        real, z = torch.randn(5, 4), torch.randn(5, 3)
        vitals.batch(real)
        opt_d.zero_grad()
        (discriminator(generator(z).detach()).mean() - discriminator(real).mean()).backward()
        opt_d.step()
        if b % generator_every == 0:
            opt_g.zero_grad()
            (-discriminator(generator(z)).mean()).backward()
            opt_g.step()
    vitals.close()
    expected = [b for b in range(batches) if b % 3 == 0]
    assert sorted(writer.rows) == expected
    assert probe.at_end == {b: (b in expected, 1, 1) for b in range(batches)}
    assert probe.at_start == {b: b in expected for b in range(batches)}


class StepRecorder(GradRecorder):
    """A :class:`GradRecorder` that also records validation and a failure, with ``ctx.step``."""

    def validation_start(self, ctx):
        self.events.append(("val", ctx.step))

    def exception_raised(self, ctx, exception):
        self.events.append(("failed", ctx.step))


def _wgan_batch(vitals: Vitals, generator, critic, opt_g, opt_c, order: str, k: int = 3):
    """One batch of a WGAN-style loop: the generator steps once and the critic ``k`` times,
    the generator first or last. Returns (optimizer, gradients right before its step()) for
    every step() call."""
    real, z = torch.randn(5, 4), torch.randn(5, 3)
    vitals.batch(real)
    stepped = []

    def step_generator() -> None:
        opt_g.zero_grad()
        (-critic(generator(z)).mean()).backward()
        stepped.append((opt_g, _snapshot(generator)))
        opt_g.step()

    if order == "generator_first":
        step_generator()
    for i in range(k):
        opt_c.zero_grad()
        # a different loss per critic step, so that each step()'s gradients differ
        (critic(generator(z).detach()).mean() - critic(real * (1 + i)).mean()).backward()
        stepped.append((opt_c, _snapshot(critic)))
        opt_c.step()
    if order == "critic_first":
        step_generator()
    return stepped


@pytest.mark.parametrize("order", ["generator_first", "critic_first"])
def test_an_optimizer_stepped_again_after_the_others_stays_in_its_batch_step(order):
    # WGAN-style: per batch the generator once and the critic 3 times. Generator first, every
    # optimizer has stepped at the critic's first step(): its 2nd and 3rd still belong to this
    # batch's step, which ends with the batch (here at validating(), state_dict(), close()).
    model, generator, critic, opt_c, opt_g = _gan()
    rec = StepRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [opt_g, opt_c])
    stepped = _wgan_batch(vitals, generator, critic, opt_g, opt_c, order)
    with vitals.validating():
        pass
    stepped += _wgan_batch(vitals, generator, critic, opt_g, opt_c, order)
    assert vitals.state_dict()["step"] == 2  # mid-run checkpoint: batch 1 counted
    stepped += _wgan_batch(vitals, generator, critic, opt_g, opt_c, order)
    vitals.close()  # ends the run's last batch
    assert vitals.step == 3
    assert len(rec.seen) == len(stepped) == 12
    for (stepping, grads), (optimizer, expected) in zip(rec.seen, stepped, strict=True):
        assert stepping is optimizer
        _assert_current(grads, expected)
    four = [("grads", s) for s in range(3) for _ in range(4)]
    assert rec.events == [
        ("mb", 0), *four[0:4], ("end", 0, 1), ("val", 1),  # ended by validating()
        ("mb", 1), *four[4:8], ("end", 1, 1),  # ended by state_dict()
        ("mb", 2), *four[8:12], ("end", 2, 1),  # ended by close()
    ]  # fmt: skip


def test_critic_stepped_after_the_generator_under_accumulation_keeps_the_step_whole():
    # Two micro-batches per step (batch() on each), then the generator steps and the critic
    # twice: the step ends when the next step's first micro-batch starts, never between its
    # micro-batches nor after the critic's first step().
    model, generator, critic, opt_c, opt_g = _gan()
    rec = StepRecorder()
    vitals = Vitals([rec], writer=RecordingWriter(), accumulate_grad_batches=2)
    vitals.attach(model, [opt_g, opt_c])
    stepped = []
    for _ in range(2):
        opt_g.zero_grad()
        for _ in range(2):
            z = torch.randn(5, 3)
            vitals.batch(z)
            (-critic(generator(z)).mean() / 2).backward()
        stepped.append((opt_g, _snapshot(generator)))  # accumulated over both micro-batches
        opt_g.step()
        for i in range(2):
            opt_c.zero_grad()
            (critic(generator(z).detach()).mean() * (1 + i)).backward()
            stepped.append((opt_c, _snapshot(critic)))
            opt_c.step()
    vitals.close()
    for (stepping, grads), (optimizer, expected) in zip(rec.seen, stepped, strict=True):
        assert stepping is optimizer
        _assert_current(grads, expected)
    assert rec.events == [
        e
        for s in range(2)
        for e in (("mb", s), ("mb", s), ("grads", s), ("grads", s), ("grads", s), ("end", s, 2))
    ]
    assert vitals.step == 2


def test_a_failure_after_a_complete_batch_still_ends_its_step():
    # The loop fails between batches: the batch in which every optimizer stepped is a step
    # (its step_end comes before exception_raised); the critic's later step()s are in it.
    model, generator, critic, opt_c, opt_g = _gan()
    rec = StepRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [opt_g, opt_c])
    with pytest.raises(RuntimeError, match="loader died"), vitals:
        _wgan_batch(vitals, generator, critic, opt_g, opt_c, "generator_first")
        raise RuntimeError("loader died")
    assert vitals.step == 1
    assert rec.events == [("mb", 0), *[("grads", 0)] * 4, ("end", 0, 1), ("failed", 1)]


def test_norm_monitor_sees_each_batch_of_a_critic_stepped_after_the_generator():
    # NormMonitor at step s: the generator's norms at its step() and the critic's at its last
    # step() of batch s (float64 by hand), one row per batch.
    from trainvitals.callbacks.norm_monitor import NormMonitor

    def norms(net: torch.nn.Module) -> tuple[float, float]:
        params = sum(float((p.detach().double() ** 2).sum()) for p in net.parameters())
        grads = sum(float((p.grad.detach().double() ** 2).sum()) for p in net.parameters())
        return params, grads

    model, generator, critic, opt_c, opt_g = _gan()
    writer = RecordingWriter()
    vitals = Vitals([NormMonitor()], writer=writer, log_every_n_steps=1)
    vitals.attach(model, [opt_g, opt_c])
    expected: list[dict[str, tuple[float, float]]] = []
    for _ in range(3):
        real, z = torch.randn(5, 4), torch.randn(5, 3)
        vitals.batch(real)
        row = {}
        opt_g.zero_grad()
        (-critic(generator(z)).mean()).backward()
        row["gen"] = norms(generator)
        opt_g.step()
        for i in range(3):
            opt_c.zero_grad()
            (critic(generator(z).detach()).mean() - critic(real * (1 + i)).mean()).backward()
            row[f"critic{i}"] = norms(critic)
            opt_c.step()
        expected.append(row)
    vitals.close()
    assert sorted(writer.rows) == [0, 1, 2]
    for step, want in enumerate(expected):
        got = writer.rows[step]
        (p_g, g_g), (p_c, g_c) = want["gen"], want["critic2"]
        assert g_c != pytest.approx(want["critic0"][1], rel=1e-3)  # the last step() differs
        assert got["l2_norm/grad/optimizer_0"] == pytest.approx(g_g**0.5, rel=1e-6)
        assert got["l2_norm/param/optimizer_0"] == pytest.approx(p_g**0.5, rel=1e-6)
        assert got["l2_norm/grad/optimizer_1"] == pytest.approx(g_c**0.5, rel=1e-6)
        assert got["l2_norm/param/optimizer_1"] == pytest.approx(p_c**0.5, rel=1e-6)
        assert got["l2_norm/grad/global"] == pytest.approx((g_g + g_c) ** 0.5, rel=1e-6)
        assert got["l2_norm/param/global"] == pytest.approx((p_g + p_c) ** 0.5, rel=1e-6)


def test_a_loop_without_batch_calls_ends_the_step_once_every_optimizer_stepped():
    # No batch() calls: each forward of the model is a micro-batch, and the step still ends at
    # the last optimizer's step() (vitals.step counts it right away).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    rec = GradRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [first, second])
    counted = []
    for _ in range(2):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        first.step()
        counted.append(vitals.step)
        second.step()
        counted.append(vitals.step)
        first.zero_grad()
        second.zero_grad()
    vitals.close()
    assert counted == [0, 1, 1, 2]
    assert rec.events == _two_steps_per_batch(2)
