"""The Vitals driver in plain loops: hook order under gradient accumulation, validation, clipping,
AMP-skipped steps, batch counts, state, the default JSONL writer, bad input, failing callbacks."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch

from tests.scripts.vitals_testing import FakeClock, RecordingWriter, batch_size, dt
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.base import VitalsCallback
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor


class Recorder(VitalsCallback):
    def __init__(self, name: str = "Recorder", **kwargs) -> None:
        super().__init__(**kwargs)
        self.name = name
        self.events: list[tuple] = []
        self.grad_norms: list[float] = []

    @property
    def state_key(self) -> str:
        return self.name

    def run_start(self, ctx):
        self.events.append(("run_start",))

    def micro_batch_start(self, ctx, batch):
        self.events.append(("mb", ctx.step, ctx.micro_batch, batch.batch_size, batch.num_tokens))

    def before_optimizer_step(self, ctx):
        norm = torch.norm(torch.stack([p.grad.norm() for p in ctx.model.parameters()]))
        self.grad_norms.append(float(norm))
        self.events.append(("grads", ctx.step))

    def step_end(self, ctx):
        self.events.append(("end", ctx.step, ctx.micro_batches_in_step))

    def validation_start(self, ctx):
        self.events.append(("val_start", ctx.step))

    def validation_end(self, ctx):
        self.events.append(("val_end", ctx.step))

    def exception_raised(self, ctx, exc):
        self.events.append(("exception", type(exc).__name__))

    def run_end(self, ctx):
        self.events.append(("run_end",))

    def state_dict(self):
        return {"events": len(self.events)}

    def load_state_dict(self, state):
        self.loaded = state


def _model_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_one_step_per_real_optimizer_step_with_accumulation():
    model, opt = _model_opt()
    rec = Recorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, opt)
    acc = 3
    for i in range(10):  # 3 full steps and a last partial one of 1 micro-batch
        x = torch.randn(2 + i % 2, 4)
        vitals.batch(x)
        (model(x).pow(2).mean() / acc).backward()
        if (i + 1) % acc == 0 or i == 9:
            opt.step()
            opt.zero_grad()
    vitals.close()
    mbs = [e for e in rec.events if e[0] == "mb"]
    assert [(e[1], e[2]) for e in mbs] == [(s, m) for s in range(3) for m in range(3)] + [(3, 0)]
    assert [e[3] for e in mbs] == [2 + i % 2 for i in range(10)]
    assert [e for e in rec.events if e[0] == "grads"] == [("grads", s) for s in range(4)]
    assert [e for e in rec.events if e[0] == "end"] == [
        ("end", 0, 3),
        ("end", 1, 3),
        ("end", 2, 3),
        ("end", 3, 1),
    ]
    assert rec.events[0] == ("run_start",) and rec.events[-1] == ("run_end",)
    assert vitals.step == 4


def test_validation_hooks_and_batches_inside_validation_ignored():
    model, opt = _model_opt()
    rec = Recorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, opt)
    vitals.batch(torch.randn(2, 4))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with vitals.validating():
        vitals.batch(torch.randn(5, 4))  # an evaluation batch: not training
    vitals.close()
    assert [e[0] for e in rec.events] == [
        "run_start",
        "mb",
        "grads",
        "end",
        "val_start",
        "val_end",
        "run_end",
    ]


def test_clip_grad_norm_shows_unclipped_gradients():
    model, opt = _model_opt()
    rec = Recorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, opt)
    x = torch.randn(8, 4) * 100
    vitals.batch(x)
    model(x).pow(2).mean().backward()
    expected = float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    vitals.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    opt.step()
    vitals.close()
    assert expected > 1.0
    assert rec.grad_norms == [pytest.approx(expected)]
    assert [e for e in rec.events if e[0] == "grads"] == [("grads", 0)]


def test_skipped_optimizer_step_ends_at_next_batch():
    # GradScaler skips optimizer.step() on inf gradients: the pre/post hooks do not fire.
    model, opt = _model_opt()
    rec = Recorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, opt)
    for i in range(3):
        x = torch.randn(2, 4)
        vitals.batch(x)
        model(x).sum().backward()
        vitals.clip_grad_norm_(model.parameters(), max_norm=1.0)
        if i != 1:  # step 1 is skipped
            opt.step()
        opt.zero_grad()
    vitals.close()
    assert [e for e in rec.events if e[0] == "end"] == [("end", 0, 1), ("end", 1, 1), ("end", 2, 1)]
    assert [e[1] for e in rec.events if e[0] == "mb"] == [0, 1, 2]
    assert vitals.step == 3


def test_grad_scaler_unscaling_shows_gradients_of_skipped_steps_too():
    # GradScaler.step() skips optimizer.step() (and its hooks) on inf gradients; with the scaler
    # attached the callbacks still see every step's unscaled, unclipped gradients.
    model, opt = _model_opt()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    rec = Recorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, opt, scaler=scaler)
    expected = []
    for i in range(4):
        x = torch.randn(2, 4) * 10
        vitals.batch(x)
        loss = model(x).pow(2).mean() * (math.inf if i == 1 else 1.0)
        scaler.scale(loss).backward()
        grads = [p.grad.double() / scaler.get_scale() for p in model.parameters()]
        expected.append(float(torch.stack([g.norm() for g in grads]).norm()))
        if i == 2:  # explicit unscale, then clip: the callbacks see the unclipped gradients
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    vitals.close()
    assert [e for e in rec.events if e[0] == "grads"] == [("grads", s) for s in range(4)]
    assert [e for e in rec.events if e[0] == "end"] == [("end", s, 1) for s in range(4)]
    assert not math.isfinite(rec.grad_norms[1]) and not math.isfinite(expected[1])
    for got, want in zip(rec.grad_norms, expected, strict=True):
        if math.isfinite(want):
            assert want > 1e-2  # so that the clipped norm (1e-3) could not pass
            assert got == pytest.approx(want, rel=1e-5)
    assert "unscale_" not in vars(scaler)  # close() gave the scaler its own method back
    # two drivers on one scaler: the one closing first leaves the other's wrapper in place
    first = Vitals([Recorder("a")], writer=RecordingWriter()).attach(*_model_opt(), scaler=scaler)
    wrapper = vars(scaler)["unscale_"]
    second = Vitals([Recorder("b")], writer=RecordingWriter()).attach(*_model_opt(), scaler=scaler)
    second.close()
    assert vars(scaler)["unscale_"] is wrapper
    first.close()
    assert "unscale_" not in vars(scaler)


def test_scaler_must_unscale():
    with pytest.raises(TypeError, match="GradScaler"):
        Vitals([Recorder()], writer=RecordingWriter()).attach(*_model_opt(), scaler=object())


def test_restore_mid_step_replays_the_step_from_its_first_micro_batch():
    model, opt = _model_opt()
    rec = Recorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, opt)

    def micro_batch() -> None:
        x = torch.randn(2, 4)
        vitals.batch(x)
        model(x).sum().backward()

    for _ in range(2):
        micro_batch()
    opt.step()
    opt.zero_grad()
    state = vitals.state_dict()
    micro_batch()  # step 1 starts, then the run rolls back to the checkpoint
    vitals.gradients_ready()
    vitals.load_state_dict(state)
    rec.events.clear()
    for _ in range(2):
        micro_batch()
    opt.step()
    vitals.close()
    assert [e[1:3] for e in rec.events if e[0] == "mb"] == [(1, 0), (1, 1)]
    assert [e for e in rec.events if e[0] in ("grads", "end")] == [("grads", 1), ("end", 1, 2)]


def test_batch_counts_explicit_beat_callback_functions_beat_inference():
    model, opt = _model_opt()
    plain = Recorder("plain")
    custom = Recorder("custom")
    custom.num_tokens_fn = lambda b: int(b["attention_mask"].sum())
    vitals = Vitals([plain, custom], writer=RecordingWriter()).attach(model, opt)
    batch = {"input_ids": torch.zeros(3, 7, dtype=torch.long), "attention_mask": torch.ones(3, 7)}
    batch["attention_mask"][:, 5:] = 0
    vitals.batch(batch)
    vitals.batch(batch, num_tokens=11)
    vitals.close()
    assert [e[3:] for e in plain.events if e[0] == "mb"] == [(3, 21), (3, 11)]
    assert [e[3:] for e in custom.events if e[0] == "mb"] == [(3, 15), (3, 11)]


def test_state_dict_round_trip_and_errors():
    model, opt = _model_opt()
    rec = Recorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, opt)
    for _ in range(3):
        vitals.batch(torch.randn(2, 4))
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    state = vitals.state_dict()
    assert state["step"] == 3
    other = Recorder()
    resumed = Vitals([other], writer=RecordingWriter()).attach(*_model_opt())
    resumed.load_state_dict(state)
    assert resumed.step == 3 and other.loaded == {"events": len(rec.events)}
    with pytest.raises(ValueError, match="state_dict"):
        resumed.load_state_dict({"step": 1})
    with pytest.raises(ValueError, match="state_key"):
        Vitals([Recorder("a"), Recorder("a")], writer=RecordingWriter())


@pytest.mark.parametrize("value", [0, -1])
def test_bad_interval_is_value_error(value):
    with pytest.raises(ValueError, match="log_every_n_steps"):
        Vitals([], writer=RecordingWriter(), log_every_n_steps=value)
    with pytest.raises(ValueError, match="log_every_n_steps"):
        Recorder(log_every_n_steps=value)


def test_bad_input_types():
    with pytest.raises(TypeError, match="log_every_n_steps"):
        Vitals([], writer=RecordingWriter(), log_every_n_steps="5")
    with pytest.raises(ValueError, match="max_steps"):
        Vitals([], writer=RecordingWriter(), max_steps=0)
    vitals = Vitals([Recorder()], writer=RecordingWriter())
    with pytest.raises(RuntimeError, match="attach"):
        vitals.batch(torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"nn\.Module"):
        vitals.attach("model", None)
    with pytest.raises(TypeError, match="Optimizer"):
        vitals.attach(torch.nn.Linear(2, 2), object())
    with pytest.raises(TypeError, match="list of callbacks"):
        Vitals(Recorder(), writer=RecordingWriter())
    one, two = Recorder("one"), Recorder("two")
    assert Vitals(iter([one, two]), writer=RecordingWriter()).callbacks == [one, two]
    assert Vitals({"a": one}.values(), writer=RecordingWriter()).callbacks == [one]
    for bad in ("100", 10.5, True):
        with pytest.raises(TypeError, match="max_steps"):
            Vitals([], writer=RecordingWriter(), max_steps=bad)


def test_attach_twice_raises_and_batch_after_close_is_ignored():
    model, opt = _model_opt()
    rec = Recorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, opt)
    with pytest.raises(RuntimeError, match="attach"):
        vitals.attach(model, opt)  # e.g. before and after accelerator.prepare()
    x = torch.randn(2, 4)
    vitals.batch(x)
    model(x).sum().backward()
    opt.step()
    vitals.close()
    with pytest.warns(RuntimeWarning, match="after close"):
        vitals.batch(x)
    vitals.batch(x)  # warned once
    assert [e[:2] for e in rec.events if e[0] in ("mb", "end")] == [("mb", 0), ("end", 0)]
    assert vitals.step == 1


def test_an_instance_starting_a_second_run_at_step_0_warns():
    # the same callback objects given to a second driver (a new Trainer, a sweep): their
    # counters would go on from the first run; say so (a reset per run is not implemented)
    rec = Recorder()
    for run in range(2):
        model, opt = _model_opt()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            with Vitals([rec], writer=RecordingWriter()) as vitals:
                vitals.attach(model, opt)
                vitals.batch(torch.randn(2, 4))
        reused = [w for w in record if "already ran" in str(w.message)]
        assert len(reused) == run  # the second run only


def test_failing_callback_is_disabled_and_training_continues(monkeypatch):
    monkeypatch.setenv("TRAINVITALS_STRICT", "0")

    class Broken(VitalsCallback):
        calls = 0

        def step_end(self, ctx):
            Broken.calls += 1
            raise RuntimeError("telemetry bug")

    model, opt = _model_opt()
    rec = Recorder()
    vitals = Vitals([Broken(), rec], writer=RecordingWriter()).attach(model, opt)
    with pytest.warns(RuntimeWarning, match="disabled"):
        for _ in range(3):
            vitals.batch(torch.randn(2, 4))
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    vitals.close()
    assert Broken.calls == 1
    assert len([e for e in rec.events if e[0] == "end"]) == 3


def test_exception_in_context_manager_reaches_callbacks():
    model, opt = _model_opt()
    rec = Recorder()
    with pytest.raises(KeyError), Vitals([rec], writer=RecordingWriter()) as vitals:
        vitals.attach(model, opt)
        vitals.batch(torch.randn(2, 4))
        raise KeyError("boom")
    assert rec.events[-1] == ("exception", "KeyError")


def _train(vitals, model, opt, sizes, *, restore_before=None, state_after=None):
    """One step per batch of ``sizes`` samples; keeps the state taken after batch
    ``state_after`` and restores it before batch ``restore_before`` (an in-process rollback,
    after a loss spike). Returns that state."""
    state = None
    for i, size in enumerate(sizes):
        if i == restore_before:
            vitals.load_state_dict(state)
        x = torch.full((size, 4), 0.5)
        vitals.batch(x)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        if i == state_after:
            state = vitals.state_dict()
    return state


def test_default_writer_is_jsonl_in_run_dir(tmp_path):
    from trainvitals.adapters import read_jsonl

    clock = FakeClock()
    model, opt = _model_opt()
    monitors = [
        RuntimeMonitor(clock=clock, max_steps=10),
        ThroughputMonitor(clock=clock, window_size=2, warmup_steps=0),
    ]
    vitals = Vitals(monitors, run_dir=tmp_path, log_every_n_steps=2).attach(model, opt)
    for step in range(4):
        bs = batch_size(step, 0)
        vitals.batch({"input_ids": torch.zeros(bs, 5, dtype=torch.long)})
        clock.t += dt(step, 0)
        model(torch.randn(bs, 4)).sum().backward()
        opt.step()
    vitals.close()
    records = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert sorted(records) == [0, 2]
    samples = sum(batch_size(s, 0) for s in range(3))
    assert records[2]["time/samples"] == samples
    assert records[2]["time/train_hours"] == pytest.approx(sum(dt(s, 0) for s in range(3)) / 3600)
    window = (1, 2)
    rate = sum(batch_size(s, 0) for s in window) / sum(dt(s, 0) for s in window)
    assert records[2]["throughput/samples_per_sec"] == pytest.approx(rate)


def test_attach_unwraps_optimizer_subclass_wrappers():
    """Accelerate's AcceleratedOptimizer subclasses Optimizer without its __init__ (no hook
    registries): the driver must hook the optimizer inside it."""

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self, closure=None):
            return self.optimizer.step(closure)

    model, opt = _model_opt()
    rec = Recorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, Wrapper(opt))
    vitals.batch(torch.randn(2, 4))
    model(torch.randn(2, 4)).sum().backward()
    Wrapper(opt).step()
    vitals.close()
    assert vitals.ctx.optimizers == [opt]
    assert [e for e in rec.events if e[0] == "end"] == [("end", 0, 1)]


def _global_grad_norm(model: torch.nn.Module, divide_by: float = 1.0) -> float:
    """float64 norm of every gradient of ``model``, divided by ``divide_by`` (a loss scale)."""
    return float(torch.stack([p.grad.double().norm() for p in model.parameters()]).norm()) / (
        divide_by
    )


def test_several_optimizers_sharing_a_scaler_never_show_scaled_gradients():
    # torch.amp's multi-optimizer pattern, scaler.step(opt0); scaler.step(opt1): each
    # optimizer's own gradients are shown inside its scaler.step, unscaled, never opt1's scaled
    # ones with opt0 (tests/test_driver_amp_several_optimizers.py checks their values).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    rec = Recorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [first, second], scaler=scaler)
    expected = []
    for explicit in (False, True):
        x = torch.randn(2, 4) * 10
        vitals.batch(x)
        scaler.scale(model(x).pow(2).mean()).backward()
        expected.append(_global_grad_norm(model, scaler.get_scale()))
        if explicit:  # every optimizer unscaled first: the gradients are seen, unclipped
            scaler.unscale_(first)
            scaler.unscale_(second)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.step(first)
            scaler.step(second)
        scaler.update()
        first.zero_grad()
        second.zero_grad()
        assert not any("still scaled" in str(w.message) for w in caught)
    # a scaler that is off (bf16/fp32 with GradScaler(enabled=False)) never scaled anything
    off = torch.amp.GradScaler("cpu", enabled=False)
    model_off = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in model_off]
    rec_off = Recorder("off")
    vitals_off = Vitals([rec_off], writer=RecordingWriter()).attach(model_off, opts, scaler=off)
    x = torch.randn(2, 4) * 10
    vitals_off.batch(x)
    model_off(x).pow(2).mean().backward()
    want_off = _global_grad_norm(model_off)
    off.unscale_(opts[0])  # the loop unscales (a no-op) the optimizer it clips, then clips
    torch.nn.utils.clip_grad_norm_(model_off.parameters(), max_norm=1e-3)
    for opt in opts:
        off.step(opt)
    vitals.close()
    vitals_off.close()
    assert min(expected) > 1e-2  # so that neither a clipped norm (1e-3) could pass
    # Step 0: each optimizer at its own scaler.step (the Recorder's norm over every gradient
    # is not the measure there: the second's are still scaled at the first's). Step 1: all at
    # once, unclipped.
    assert rec.grad_norms[-1] == pytest.approx(expected[1], rel=1e-5)
    assert [e for e in rec.events if e[0] in ("grads", "end")] == [
        ("grads", 0),
        ("grads", 0),
        ("end", 0, 1),
        ("grads", 1),
        ("end", 1, 1),
    ]
    assert rec_off.grad_norms == [pytest.approx(want_off, rel=1e-5)] and want_off > 1e-2


def test_step_skipped_by_the_scaler_is_in_a_checkpoint_taken_before_the_next_batch(tmp_path):
    # An fp16 loop's checkpoint right after an inf/nan step: the loop counted that step, and so
    # must the saved driver state (its index and its samples), or the resumed run is one behind.
    def run(vitals: Vitals, model, opt, scaler, sizes: list[int], skip: int | None) -> None:
        for i, size in enumerate(sizes):
            x = torch.randn(size, 4)
            vitals.batch(x)
            loss = model(x).pow(2).mean() * (math.inf if i == skip else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    sizes = [2, 3, 4]  # step 2 is skipped (inf loss), then a checkpoint
    model, opt = _model_opt()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    rec = Recorder()
    monitor = RuntimeMonitor(max_steps=10)
    vitals = Vitals([rec, monitor], writer=RecordingWriter(), log_every_n_steps=1)
    vitals.attach(model, opt, scaler=scaler)
    run(vitals, model, opt, scaler, sizes, skip=2)
    state = vitals.state_dict()
    vitals.close()
    assert state["step"] == len(sizes)
    assert [e for e in rec.events if e[0] == "end"] == [("end", s, 1) for s in range(3)]

    model, opt = _model_opt()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    writer = RecordingWriter()
    resumed = Vitals(
        [Recorder(), RuntimeMonitor(max_steps=10)], writer=writer, log_every_n_steps=1
    ).attach(model, opt, scaler=scaler)
    resumed.load_state_dict(state)
    run(resumed, model, opt, scaler, [7], skip=None)
    resumed.close()
    assert sorted(writer.rows) == [3]
    assert writer.rows[3]["time/samples"] == sum(sizes) + 7
    assert writer.rows[3]["time/batches"] == len(sizes) + 1


def test_a_second_forward_of_an_announced_micro_batch_is_not_another_micro_batch():
    # R-Drop, adversarial training (FGM): two forwards per micro-batch after vitals.batch().
    model, opt = _model_opt()
    rec = Recorder()
    writer = RecordingWriter()
    monitor = RuntimeMonitor(max_steps=10)
    vitals = Vitals([rec, monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    sizes = [(3, 5), (2, 4)]  # (samples of micro-batch 0, of micro-batch 1) per step
    for step_sizes in sizes:
        for size in step_sizes:
            x = torch.randn(size, 4)
            vitals.batch(x)
            model(x).sum().backward()
            model(x + 0.01).sum().backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    mbs = [e for e in rec.events if e[0] == "mb"]
    assert [(e[1], e[2], e[3]) for e in mbs] == [(0, 0, 3), (0, 1, 5), (1, 0, 2), (1, 1, 4)]
    assert [e for e in rec.events if e[0] == "end"] == [("end", 0, 2), ("end", 1, 2)]
    assert writer.key("time/samples") == {0: 8.0, 1: 14.0}
    assert writer.key("time/batches") == {0: 2.0, 1: 4.0}
    # a loop that never calls batch(): each training forward is one micro-batch
    model, opt = _model_opt()
    silent = Recorder("silent")
    vitals = Vitals([silent], writer=RecordingWriter()).attach(model, opt)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    opt.step()
    vitals.close()
    assert [e for e in silent.events if e[0] in ("mb", "end")] == [
        ("mb", 0, 0, None, None),
        ("mb", 0, 1, None, None),
        ("end", 0, 2),
    ]


def test_close_gives_accelerator_unscale_gradients_back():
    # After close() the callbacks have had run_end: a later clip (a second training phase with
    # a new driver on the same accelerator) must not reach them.
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(*_model_opt())
    rec = Recorder()
    vitals = Vitals([rec], accelerator=accelerator, writer=RecordingWriter()).attach(model, opt)
    x = torch.randn(2, 4)
    vitals.batch(x)
    accelerator.backward(model(x).sum())
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    vitals.close()
    assert "unscale_gradients" not in vars(accelerator)
    accelerator.backward(model(x).sum())
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    vitals.clip_grad_norm_(model.parameters(), 1.0)
    assert rec.events[-3:] == [("grads", 0), ("end", 0, 1), ("run_end",)]


@pytest.mark.filterwarnings("ignore:JsonlSink.*dropped:RuntimeWarning")  # abandoned steps 1, 2
def test_rollback_to_an_earlier_step_replays_it_in_the_default_writer(tmp_path, monkeypatch):
    # In-process rollback (load the last checkpoint after a loss spike): the driver's own
    # writer refuses steps lower than those it was given; the replayed steps must be written.
    from trainvitals.adapters import read_jsonl

    monkeypatch.setenv("TRAINVITALS_STRICT", "1")
    model, opt = _model_opt()
    monitor = RuntimeMonitor(max_steps=10)
    vitals = Vitals([monitor], run_dir=tmp_path, log_every_n_steps=1).attach(model, opt)
    # steps 0, 1, 2, then back to after step 0: 1, 2 again
    _train(vitals, model, opt, [2, 3, 4, 5, 6], restore_before=3, state_after=0)
    vitals.close()
    rows = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert sorted(rows) == [0, 1, 2]
    assert [rows[s]["time/samples"] for s in (0, 1, 2)] == [2, 2 + 5, 2 + 5 + 6]


def test_validating_after_close_reaches_no_callback_and_warns_once():
    # An evaluation after the run ended (a final eval after vitals.close()): the callbacks had
    # run_end; a validation_start/end then would pause and resume clocks of a finished run.
    model, opt = _model_opt()
    rec = Recorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, opt)
    vitals.batch(torch.randn(2, 4))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    vitals.close()
    events_at_close = list(rec.events)
    ran = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with vitals.validating():
                ran.append(vitals.ctx.in_validation)
    assert ran == [False, False]  # the block itself runs, as evaluation, unchanged
    assert rec.events == events_at_close and rec.events[-1] == ("run_end",)
    closed = [w for w in caught if "validating() after close()" in str(w.message)]
    assert len(closed) == 1 and closed[0].filename == __file__
    # closed inside the block: run_end was the callbacks' last hook, no validation_end after it
    model, opt = _model_opt()
    inner = Recorder("inner")
    vitals = Vitals([inner], writer=RecordingWriter()).attach(model, opt)
    vitals.batch(torch.randn(2, 4))
    with vitals.validating():
        vitals.close()
    assert [e[0] for e in inner.events] == ["run_start", "mb", "val_start", "run_end"]


def test_a_callback_disabled_in_one_run_runs_again_in_the_next(monkeypatch):
    # The guard disables a failing callback for the rest of ITS run; a new run with the same
    # instance (a retried or second training phase) is a new run: it runs, and warns again.
    monkeypatch.setenv("TRAINVITALS_STRICT", "0")

    class FailsOnce(VitalsCallback):
        def __init__(self) -> None:
            super().__init__(log_every_n_steps=1)
            self.fail_at: set[tuple[int, int]] = set()
            self.ends: list[tuple[int, int]] = []
            self.run = -1

        def run_start(self, ctx):
            self.run += 1

        def step_end(self, ctx):
            if (self.run, ctx.step) in self.fail_at:
                raise RuntimeError("telemetry bug")
            self.ends.append((self.run, ctx.step))

    callback = FailsOnce()
    callback.fail_at = {(0, 1), (1, 2)}
    messages = []
    for _ in range(2):
        model, opt = _model_opt()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # Python's own once-per-location filter
            with Vitals([callback], writer=RecordingWriter()) as vitals:
                vitals.attach(model, opt)
                for _ in range(4):
                    vitals.batch(torch.randn(2, 4))
                    model(torch.randn(2, 4)).sum().backward()
                    opt.step()
        messages += [str(w.message) for w in caught if "disabled" in str(w.message)]
    # run 0: steps 0 then disabled at 1; run 1: enabled again, steps 0, 1, disabled at 2
    assert callback.ends == [(0, 0), (1, 0), (1, 1)]
    assert len(messages) == 2 and "run 2 of this instance" in messages[1]


def test_rollback_with_a_given_writer_drops_the_refused_steps_and_keeps_the_callback(tmp_path):
    # A FanoutWriter given to Vitals refuses steps lower than those it holds and cannot be
    # rewound: after an in-process rollback, the replayed steps below the step the rollback
    # left on are dropped from it (one warning), and the callback goes on writing the later
    # steps with the restored counters, instead of being disabled by the guard.
    from trainvitals.adapters import FanoutWriter, JsonlSink, read_jsonl

    model, opt = _model_opt()
    monitor = RuntimeMonitor(max_steps=10)
    writer = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")], background=False)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # steps 0, 1, 2; back to after step 0; 1, 2, 3, 4
        _train(vitals, model, opt, [2, 3, 4, 5, 6, 7, 8], restore_before=3, state_after=0)
        vitals.close()
    writer.close()
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "disabled" in m]
    assert len([m for m in messages if "dropped from that writer" in m]) == 1
    assert not monitor._disabled
    rows = [
        (r["step"], r["metrics"]["time/samples"]) for r in read_jsonl(tmp_path / "metrics.jsonl")
    ]
    # the first timeline's 0, 1, 2 stay (the writer cannot take them back); 3 and 4 count the
    # restored timeline: step 0 (2 samples) then 5, 6, 7, 8
    assert rows == [(0, 2), (1, 5), (2, 9), (3, 2 + 5 + 6 + 7), (4, 2 + 5 + 6 + 7 + 8)]
    # a writer that takes any step (SummaryWriter-like) is left alone: it gets the replay too
    model, opt = _model_opt()
    permissive = RecordingWriter()
    vitals = Vitals([RuntimeMonitor(max_steps=10)], writer=permissive, log_every_n_steps=1)
    vitals.attach(model, opt)
    _train(vitals, model, opt, [2, 3, 4, 5, 6, 7, 8], restore_before=3, state_after=0)
    vitals.close()
    assert permissive.key("time/samples") == {0: 2, 1: 7, 2: 13, 3: 20, 4: 28}


def test_a_resumed_run_drops_every_line_the_interrupted_run_wrote_after_its_checkpoint(
    tmp_path, caplog
):
    # The interrupted run logged every step; the resumed one (from the checkpoint of step 1)
    # logs every second step, so it never writes step 1 again: the interrupted run's line of
    # step 1 is of a timeline that no longer exists and must not stay in the file.
    from trainvitals.adapters import read_jsonl

    def run(sizes, log_every, state=None):
        model, opt = _model_opt()
        vitals = Vitals(
            [RuntimeMonitor(max_steps=10)], run_dir=tmp_path, log_every_n_steps=log_every
        ).attach(model, opt)
        if state is not None:
            vitals.load_state_dict(state)
        checkpoint = _train(vitals, model, opt, sizes, state_after=0)  # resumes at step 1
        vitals.close()
        return checkpoint

    checkpoint = run([2, 3, 4, 5], log_every=1)  # steps 0..3, the process then dies
    assert checkpoint["step"] == 1
    # the lines after the checkpoint's step: an ordinary resume, an INFO log (no warning)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, "trainvitals"):
        warnings.filterwarnings("error", "JsonlSink", RuntimeWarning)
        run([7, 8], log_every=2, state=checkpoint)  # steps 1 and 2; only 2 is logged
    assert any("dropped 3 line(s) of steps >= 1" in r.message for r in caplog.records)
    rows = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert sorted(rows) == [0, 2]
    assert rows[0]["time/samples"] == 2  # the interrupted run's, before its checkpoint
    assert rows[2]["time/samples"] == 2 + 7 + 8  # the resumed run's


def test_how_the_with_block_ends_is_how_the_driver_ends_its_writers_run(tmp_path, monkeypatch):
    # A script stopping early on success (sys.exit(0) once its target loss is reached) ends
    # the run as a normal end: run_end for the callbacks, an MLflow run the driver's writer
    # created FINISHED. A non-zero or message exit fails it; Ctrl-C is MLflow's KILLED.
    from mlflow import MlflowClient

    import trainvitals.adapters.loop as loop
    from trainvitals.adapters import FanoutWriter, MLflowSink

    sinks: list[MLflowSink] = []

    def default_writer(accelerator, run_dir):
        sinks.append(MLflowSink(run_dir=tmp_path / "mlruns", experiment_name="driver"))
        return FanoutWriter([sinks[-1]], rank=0)

    monkeypatch.setattr(loop, "_default_writer", default_writer)
    endings = {
        "exit()": SystemExit(),
        "exit(0)": SystemExit(0),
        "exit(None)": SystemExit(None),
        "exit(1)": SystemExit(1),
        "exit('msg')": SystemExit("target missed"),
        "ctrl-c": KeyboardInterrupt(),
        "error": ValueError("diverged"),
    }
    ended = {}
    for name, exception in endings.items():
        model, opt = _model_opt()
        rec = Recorder()
        with pytest.raises(type(exception)), Vitals([rec], run_dir=tmp_path) as vitals:
            vitals.attach(model, opt)
            x = torch.randn(2, 4)
            vitals.batch(x)
            model(x).sum().backward()
            opt.step()
            vitals.ctx.writer.add_scalar("loss", 0.5, vitals.ctx.step)
            raise exception
        client = MlflowClient(tracking_uri=sinks[-1].tracking_uri)
        run = client.get_run(sinks[-1].run_id)
        ended[name] = (run.info.status, run.data.metrics.get("loss"), rec.events[-1])
    success, failure = ("run_end",), lambda kind: ("exception", kind)
    assert ended == {
        "exit()": ("FINISHED", 0.5, success),
        "exit(0)": ("FINISHED", 0.5, success),
        "exit(None)": ("FINISHED", 0.5, success),
        "exit(1)": ("FAILED", 0.5, failure("SystemExit")),
        "exit('msg')": ("FAILED", 0.5, failure("SystemExit")),
        "ctrl-c": ("KILLED", 0.5, failure("KeyboardInterrupt")),
        "error": ("FAILED", 0.5, failure("ValueError")),
    }


@pytest.mark.filterwarnings("ignore:JsonlSink.*dropped:RuntimeWarning")  # the abandoned step 3
@pytest.mark.parametrize("ending", ["close", "exception"])
def test_a_rollback_then_an_end_before_the_next_logging_step_drops_the_abandoned_steps(
    tmp_path, ending
):
    # Log every 3 steps; steps 0..3 run (step 3 logged), then the loop restores the state of
    # step 2 and replays only step 2 before the run ends (or fails): the new timeline never
    # logs again, so no write cuts metrics.jsonl back. It must still read as the run
    # 0, 1, 2 that happened, not keep step 3 of the abandoned timeline.
    from trainvitals.adapters import read_jsonl

    sizes = [2, 3, 4, 5, 7]  # batches 0..3, then step 2 replayed with 7 samples
    model, opt = _model_opt()
    rolled = Vitals(
        [RuntimeMonitor(max_steps=10)], run_dir=tmp_path / "rolled", log_every_n_steps=3
    )
    rolled.attach(model, opt)
    if ending == "close":
        _train(rolled, model, opt, sizes, restore_before=4, state_after=1)
        rolled.close()
    else:
        with pytest.raises(RuntimeError, match="diverged"), rolled:
            _train(rolled, model, opt, sizes, restore_before=4, state_after=1)
            raise RuntimeError("diverged")
    model, opt = _model_opt()
    straight = Vitals(
        [RuntimeMonitor(max_steps=10)], run_dir=tmp_path / "straight", log_every_n_steps=3
    ).attach(model, opt)
    _train(straight, model, opt, [2, 3, 7])  # the timeline that remains: 0, 1, then 2 again
    straight.close()

    def samples_by_step(run_dir):
        return [
            (r["step"], r["metrics"]["time/samples"]) for r in read_jsonl(run_dir / "metrics.jsonl")
        ]

    assert samples_by_step(tmp_path / "straight") == [(0, 2)]  # the independent run
    assert samples_by_step(tmp_path / "rolled") == samples_by_step(tmp_path / "straight")


def test_replay_writer_drops_every_call_form_below_its_floor(tmp_path):
    # The writer that outlived a rollback holds steps up to 4. Every way of naming a step
    # (positional, global_step=, SummaryWriter's add_scalars(main_tag, dict, ...), a numpy
    # integer) is dropped below the floor instead of reaching the FanoutWriter, which would
    # refuse the lower step with a ValueError; from the floor on every form is written.
    import numpy as np

    from trainvitals.adapters import FanoutWriter, JsonlSink, read_jsonl
    from trainvitals.adapters.context import ReplayWriter, RunContext
    from trainvitals.distributed import ProcessGroups

    fanout = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")], background=False)
    fanout.add_scalar("old", 1.0, 4)  # the abandoned timeline's last step
    ctx = RunContext(writer=fanout, groups=ProcessGroups())
    writer = ReplayWriter(fanout, floor=5, ctx=ctx)

    def every_form(step):
        writer.add_scalar("a", 1.0, step)
        writer.add_scalar("b", 1.0, global_step=step)
        writer.add_scalars({"c": 1.0}, step)
        writer.add_scalars({"d": 1.0}, global_step=step)
        writer.add_scalars("main", {"e": 1.0}, step)
        writer.add_scalars("main", {"f": 1.0}, global_step=step)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        every_form(3)
        every_form(np.int64(4))
        every_form(np.int64(5))
    fanout.close()
    assert len([w for w in caught if "dropped from that writer" in str(w.message)]) == 1
    rows = {r["step"]: set(r["metrics"]) for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert rows == {4: {"old"}, 5: {"a", "b", "c", "d", "main/e", "main/f"}}
