"""RuntimeMonitor: exact times from a fake clock, validation excluded, horizon, resume, ranks."""

from __future__ import annotations

import io
import math

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.scripts.vitals_testing import (
    FakeClock,
    RecordingWriter,
    batch_size,
    dt,
    fake_loop,
    fit_twice_with_a_gap,
    manual_optimization_module,
    quiet_trainer,
)
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor
from trainvitals.distributed import collective_counter
from trainvitals.stats.runtime import training_horizon

ACC = 2


def _train_seconds(first: int, last: int) -> float:
    return sum(dt(s, mb) for s in range(first, last + 1) for mb in range(ACC))


def _validations_before(step: int, val_every: int = 3) -> int:
    """Validations run after steps 0..step-1 (they follow step s when (s+1) % val_every == 0)."""
    return sum(1 for s in range(step) if (s + 1) % val_every == 0)


def test_times_counts_and_remaining_exact():
    clock = FakeClock()
    horizon = 30
    writer, _ = fake_loop([RuntimeMonitor(clock=clock, max_steps=horizon)], clock, steps=range(9))
    # (9: the validation after the last step is written at the run's end, at the next step)
    assert sorted(writer.rows) == [0, 2, 4, 6, 8, 9]
    assert "time/remaining_hours" not in writer.rows[0]  # only the warm-up step so far
    final = writer.rows[9]
    train, val = _train_seconds(0, 8), 100.0 * _validations_before(9)
    assert val == 300.0
    assert final["time/train_hours"] == pytest.approx(train / 3600, rel=1e-12)
    assert final["time/validation_hours"] == pytest.approx(val / 3600, rel=1e-12)
    assert final["time/total_hours"] == pytest.approx((train + val) / 3600, rel=1e-12)
    assert set(final) == {"time/train_hours", "time/validation_hours", "time/total_hours"}
    for step in (0, 2, 4, 6, 8):
        row = writer.rows[step]
        train = _train_seconds(0, step)
        val = 100.0 * _validations_before(step)
        assert row["time/train_hours"] == pytest.approx(train / 3600, rel=1e-12)
        assert row["time/validation_hours"] == pytest.approx(val / 3600, rel=1e-12)
        assert row["time/total_hours"] == pytest.approx((train + val) / 3600, rel=1e-12)
        samples = sum(batch_size(s, mb) for s in range(step + 1) for mb in range(ACC))
        assert row["time/samples"] == samples
        assert row["time/tokens"] == 5 * samples
        assert row["time/batches"] == ACC * (step + 1)
        if step:
            per_step = _train_seconds(1, step) / step  # step 0 is warm-up
            assert row["time/seconds_per_step"] == pytest.approx(per_step, rel=1e-12)
            remaining = (horizon - step - 1) * per_step
            assert row["time/remaining_hours"] == pytest.approx(remaining / 3600, rel=1e-12)


def test_time_unit_and_horizon_from_the_driver():
    clock = FakeClock()
    writer, _ = fake_loop(
        [RuntimeMonitor(clock=clock, time_unit="minutes", warmup_steps=0)],
        clock,
        steps=range(3),
        max_steps=12,
    )
    row = writer.rows[2]
    per_step = _train_seconds(0, 2) / 3
    assert row["time/remaining_minutes"] == pytest.approx((12 - 3) * per_step / 60)
    assert "time/remaining_hours" not in row


def test_resume_continues_clocks_rate_and_counts():
    horizon = 40
    clock = FakeClock()
    _, first = fake_loop([RuntimeMonitor(clock=clock, max_steps=horizon)], clock, steps=range(10))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    clock = FakeClock(t=5e6)  # a new process: its clock has nothing to do with the old one
    writer, vitals = fake_loop(
        [RuntimeMonitor(clock=clock, max_steps=horizon)], clock, steps=range(10, 20), state=state
    )
    assert vitals.step == 20
    for step in (12, 14, 16, 18):
        row = writer.rows[step]
        train = _train_seconds(0, step)
        val = 100.0 * _validations_before(step)
        assert row["time/train_hours"] == pytest.approx(train / 3600, rel=1e-12)
        assert row["time/total_hours"] == pytest.approx((train + val) / 3600, rel=1e-12)
        assert row["time/samples"] == sum(
            batch_size(s, mb) for s in range(step + 1) for mb in range(ACC)
        )
        # Rate: steps 1..9 of the first process, 11..step of the second (10 is its warm-up).
        seconds = _train_seconds(1, 9) + _train_seconds(11, step)
        steps = 9 + (step - 10)
        assert row["time/seconds_per_step"] == pytest.approx(seconds / steps, rel=1e-12)
        remaining = (horizon - step - 1) * seconds / steps
        assert row["time/remaining_hours"] == pytest.approx(remaining / 3600, rel=1e-12)


def test_training_horizon():
    assert training_horizon(max_steps=100) == 100
    assert training_horizon(max_epochs=3, num_training_batches=10, accumulate_grad_batches=4) == 9
    assert training_horizon(max_steps=5, max_epochs=3, num_training_batches=10) == 5
    assert training_horizon() is None


def test_unknown_horizon_warns_and_writes_no_estimate():
    clock = FakeClock()
    with pytest.warns(RuntimeWarning, match="horizon unknown"):
        writer, _ = fake_loop([RuntimeMonitor(clock=clock)], clock, steps=range(3))
    assert "time/remaining_hours" not in writer.rows[2]
    assert "time/train_hours" in writer.rows[2]


@pytest.mark.parametrize(
    "kwargs",
    [{"time_unit": "weeks"}, {"max_steps": 0}, {"warmup_steps": -2}, {"log_every_n_steps": -1}],
)
def test_bad_arguments_raise_value_error(kwargs):
    # the error names the bad argument (not a ValueError from elsewhere in the constructor)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        RuntimeMonitor(**kwargs)


def _two_rank_body(rank: int, world_size: int) -> dict:
    clock = FakeClock()
    counts: list[int] = []
    before = collective_counter["all_reduce"]
    writer, vitals = fake_loop(
        [RuntimeMonitor(clock=clock, max_steps=10)],
        clock,
        steps=range(5),
        rank=rank,
        on_step=lambda s: counts.append(collective_counter["all_reduce"] - before),
    )
    state = vitals.callbacks[0].state_dict()  # collective: every rank calls it
    return {"rows": writer.rows, "collectives": counts, "state": state}


@pytest.mark.timeout(180)
def test_two_ranks_consumed_counts_are_true_sums():
    results = run_distributed(_two_rank_body, world_size=2, timeout=150)
    for result in results:
        for step in (0, 2, 4):
            true = sum(
                batch_size(s, mb, r) for r in (0, 1) for s in range(step + 1) for mb in range(ACC)
            )
            assert result["rows"][step]["time/samples"] == true
            assert result["rows"][step]["time/batches"] == 2 * ACC * (step + 1)
        assert result["collectives"] == [1, 1, 2, 2, 3]  # one per logging step only
        assert result["state"]["consumed"]["samples"] == sum(
            batch_size(s, mb, r) for r in (0, 1) for s in range(5) for mb in range(ACC)
        )


def test_train_clock_waits_for_queued_device_work_at_the_validation_boundaries():
    # The callbacks give the clock torch.cuda.synchronize on CUDA: work queued before a pause
    # is training time, work queued before a resume is validation time. A fake sync stands in
    # for the device: it "finishes" 3 s of queued work by advancing the time.
    from trainvitals.stats.runtime import TrainClock

    now = [0.0]
    calls = []

    def sync():
        calls.append(now[0])
        now[0] += 3.0

    clock = TrainClock(lambda: now[0], sync)
    clock.pause()  # not started: nothing to wait for
    assert calls == []
    clock.start()
    now[0] = 10.0
    clock.pause()  # t=10, +3 s of queued training work
    now[0] = 20.0
    clock.resume()  # t=20, +3 s of queued validation work
    now[0] = 30.0
    clock.sync()
    assert calls == [10.0, 20.0, 30.0]
    assert clock.read() == {"train": 13.0 + (33.0 - 23.0), "validation": 10.0, "total": 33.0}
    fresh = clock.fresh()
    assert fresh.sync_fn is sync and not fresh.started
    with pytest.raises(TypeError, match="sync"):
        TrainClock(sync=3)


def test_a_peer_marked_sum_leaves_the_counts_for_the_next_one(monkeypatch):
    """On accelerators a peer's missing mark comes back as NaN sums: they are not added to the
    totals (which would stay NaN for the rest of the run); the pending counts wait for the next
    sum instead."""
    import trainvitals.callbacks.runtime_monitor as runtime_module
    from trainvitals.distributed import PeerRankFailed

    monitor = RuntimeMonitor()
    monitor._pending.update(batches=2.0, samples=8.0, tokens=40.0)
    before = dict(monitor._consumed)
    real = runtime_module.reduce_counts
    monkeypatch.setattr(
        runtime_module, "reduce_counts", lambda m, g: torch.full_like(m, math.nan, dtype=float)
    )
    with pytest.raises(PeerRankFailed):
        monitor._sync_consumed()
    assert monitor._consumed == before
    assert (monitor._pending["samples"], monitor._pending["tokens"]) == (8.0, 40.0)
    monkeypatch.setattr(runtime_module, "reduce_counts", real)
    monitor._sync_consumed()
    assert monitor._consumed["samples"] == before["samples"] + 8.0
    assert monitor._consumed["tokens"] == before["tokens"] + 40.0


def test_restore_mid_step_drops_the_abandoned_micro_batches():
    """A restore while a step is in progress (a rollback to the last checkpoint): the
    micro-batches already counted for that step belong to the abandoned timeline, and the
    restored run replays the step, so they must not be added to it."""
    from trainvitals.adapters.loop import Vitals

    clock = FakeClock()
    writer = RecordingWriter()
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    vitals = Vitals(
        [RuntimeMonitor(clock=clock, max_steps=10, warmup_steps=0)],
        writer=writer,
        log_every_n_steps=1,
    ).attach(model, opt)
    sizes = {0: [4, 3], "abandoned": [5], 1: [2, 6]}

    def micro_batch(n: int) -> None:
        x = torch.randn(n, 3)
        vitals.batch(x)
        clock.t += 1.0
        model(x).sum().backward()

    for n in sizes[0]:
        micro_batch(n)
    opt.step()
    opt.zero_grad()
    state = vitals.state_dict()
    for n in sizes["abandoned"]:
        micro_batch(n)
    vitals.load_state_dict(state)
    for n in sizes[1]:
        micro_batch(n)
    opt.step()
    opt.zero_grad()
    vitals.close()
    row = writer.rows[1]
    assert row["time/samples"] == sum(sizes[0]) + sum(sizes[1])
    assert row["time/batches"] == len(sizes[0]) + len(sizes[1])


@pytest.mark.parametrize("optimizers", [1, 2])
def test_lightning_manual_optimization_with_max_epochs_only(tmp_path, optimizers):
    """The epochs x batches horizon counts one optimizer step per batch. A module stepping two
    optimizers per batch advances global_step (the step axis) by two: that horizon then ran
    out halfway (remaining time 0 with half the run left). With one step per batch it holds."""
    import warnings

    from torch import nn

    clock = FakeClock()
    writer = RecordingWriter()
    epochs, batches, seconds_per_batch = 2, 6, 1.0

    def tick(batch_idx: int) -> None:
        clock.t += seconds_per_batch

    layers = [nn.Linear(3, 1) for _ in range(optimizers)]
    module = manual_optimization_module(layers, 2 * batches, on_batch=tick)
    trainer = quiet_trainer(
        callbacks=[RuntimeMonitor(clock=clock, writer=writer)],
        max_epochs=epochs,
        default_root_dir=str(tmp_path),
        log_every_n_steps=1,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    assert trainer.global_step == optimizers * epochs * batches
    remaining = writer.key("time/remaining_hours")
    if optimizers == 1:
        # batches (= steps) left after step s, at 1 s each (the warm-up step 0 has no rate)
        assert remaining == {
            s: pytest.approx((epochs * batches - s - 1) * seconds_per_batch / 3600, abs=1e-15)
            for s in range(1, epochs * batches)
        }
    else:
        assert remaining == {}  # no horizon in optimizer steps: no estimate, not a wrong one
        assert any("manual optimization" in str(w.message) for w in caught)


def _driver(monitor, clock: FakeClock):
    """A driver over a tiny model; ``step(seconds)``: one micro-batch of ``seconds`` and an
    optimizer step."""
    from trainvitals.adapters.loop import Vitals

    writer = RecordingWriter()
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)

    def step(seconds: float) -> None:
        x = torch.randn(2, 3)
        vitals.batch(x)
        clock.t += seconds
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    return vitals, writer, step


def test_validation_before_the_first_training_batch_is_validation_time():
    """An evaluation before training (a baseline at step 0; Lightning finishing a validation
    that a restart interrupted, before any training batch): the clock was not started yet,
    so its time was in neither time/validation nor time/total."""
    clock = FakeClock()
    monitor = RuntimeMonitor(clock=clock, max_steps=4, time_unit="seconds")
    vitals, writer, step = _driver(monitor, clock)
    with vitals.validating():
        clock.t += 50.0
    clock.t += 7.0  # between the evaluation and the first batch: neither
    for seconds in (2.0, 1.0, 1.0):
        step(seconds)
    with vitals.validating():
        clock.t += 30.0
    step(1.0)
    vitals.close()
    for s, train, validation in ((0, 2.0, 50.0), (2, 4.0, 50.0), (3, 5.0, 80.0)):
        row = writer.rows[s]
        assert row["time/train_seconds"] == train
        assert row["time/validation_seconds"] == validation
        assert row["time/total_seconds"] == train + validation
    # the rate and the estimate are training time only: steps 1..3 took 1 s each
    assert writer.rows[3]["time/seconds_per_step"] == 1.0
    assert writer.rows[2]["time/remaining_seconds"] == 1.0


class _QueuedDevice:
    """A GPU-bound device behind a host that enqueues in no time: ``run(seconds)`` queues work,
    the host clock (``clock.t``) catches up with the device only at a synchronisation."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.done = clock.t  # when the device finishes its queued work

    def run(self, seconds: float) -> None:
        self.done = max(self.done, self.clock.t) + seconds

    def synchronize(self, device=None) -> None:
        self.clock.t = max(self.clock.t, self.done)


def test_the_rate_starts_when_the_warm_up_steps_work_is_done(monkeypatch):
    """The rate's starting point (the end of the last warm-up step) was read without a device
    sync unless that step logged: with warmup_steps=2, or after a resume at a step that is not
    a multiple of the interval. The host is then ahead of the GPU, and the warm-up step's own
    (slow) device work was charged to the measured steps. The rate now starts at the first
    logging step at or after the warm-up, and no non-logging step synchronises."""
    from trainvitals.adapters.context import RunContext

    clock = FakeClock()
    device = _QueuedDevice(clock)
    monkeypatch.setattr(RunContext, "device", property(lambda self: torch.device("cuda", 0)))
    syncs: list[int] = []  # the step each synchronisation happened in

    def synchronize(device_index=None) -> None:
        syncs.append(vitals.ctx.step)
        device.synchronize()

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monitor = RuntimeMonitor(clock=clock, max_steps=20, warmup_steps=2, time_unit="seconds")
    vitals, writer, _ = _driver(monitor, clock)
    vitals.ctx.log_every_n_steps = 4
    model, opt = vitals.ctx.model, vitals.ctx.optimizers[0]
    # device seconds of steps 0..8: two slow warm-up steps, and a slower step 3
    work = [10.0, 10.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    for seconds in work:
        x = torch.randn(2, 3)
        vitals.batch(x)
        model(x).sum().backward()
        device.run(seconds)
        opt.step()
        opt.zero_grad()
    vitals.close()
    assert set(syncs) == {0, 4, 8}  # the logging steps only: never step 1, the warm-up's end
    row = writer.rows[4]
    assert row["time/train_seconds"] == sum(work[:5])
    assert "time/seconds_per_step" not in row  # no synchronised start yet: no rate, no guess
    row = writer.rows[8]
    assert row["time/seconds_per_step"] == 1.0  # steps 5..8, after the first synced reading
    assert row["time/remaining_seconds"] == (20 - 9) * 1.0


@pytest.mark.parametrize(
    ("limits", "stops_on"),
    [({"max_steps": 100}, "time"), ({"max_steps": 6}, "steps"), ({}, "time")],
)
def test_lightning_time_limit_caps_the_remaining_time(tmp_path, monkeypatch, limits, stops_on):
    """Trainer(max_time=) stops the run at its Timer's limit (validation counted): the
    estimate is the smaller of the steps' and the limit's. It used to ignore the limit (a run
    stopping in 20 s showed 190 s to go) and, with the limit alone, wrote nothing."""
    from types import SimpleNamespace

    import lightning.pytorch as pl
    import lightning.pytorch.callbacks.timer as timer_module

    clock = FakeClock()
    monkeypatch.setattr(timer_module, "time", SimpleNamespace(monotonic=clock))
    writer = RecordingWriter()
    train_s, val_s, val_every, limit_s = 2.0, 5.0, 3, 40.0

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            clock.t += train_s
            return self.layer(batch).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            clock.t += val_s

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(200, 3), batch_size=2)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(2, 3), batch_size=2)

    trainer = quiet_trainer(
        callbacks=[RuntimeMonitor(clock=clock, writer=writer, time_unit="seconds")],
        max_time={"seconds": limit_s},
        val_check_interval=val_every,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        log_every_n_steps=1,
        **limits,
    )
    trainer.fit(Module())
    remaining = writer.key("time/remaining_seconds")
    assert remaining, "no estimate written"
    for step, value in remaining.items():
        done = step + 1
        wall = done * train_s + _validations_before(step, val_every) * val_s
        by_time = max(limit_s - wall, 0.0)  # Lightning's Timer: wall time since train start
        by_steps = (limits["max_steps"] - done) * train_s if "max_steps" in limits else math.inf
        assert value == pytest.approx(min(by_time, by_steps), abs=1e-9), step
    if stops_on == "time":
        assert trainer.global_step < limits.get("max_steps", 10**9)
    else:
        assert trainer.global_step == limits["max_steps"]


def test_a_second_fit_on_the_same_trainer_does_not_count_the_gap_between_fits():
    """Another fit with the same instance keeps what the first measured (as a restore would)
    and starts its own clock: the 500 s between the fits were counted as training time (and
    the next step's rate, and the estimate from it)."""
    clock = FakeClock()
    writer = RecordingWriter()
    monitor = RuntimeMonitor(clock=clock, writer=writer, time_unit="seconds", log_every_n_steps=1)
    fit_twice_with_a_gap(monitor, clock, seconds_per_step=2.0, gap=500.0)
    assert sorted(writer.rows) == list(range(8))
    for step, row in writer.rows.items():
        assert row["time/train_seconds"] == pytest.approx(2.0 * (step + 1), rel=1e-12), step
        assert row["time/total_seconds"] == pytest.approx(2.0 * (step + 1), rel=1e-12), step
        if step > 0:  # (the warm-up step 0 has no rate; the second fit's warm-up is step 4)
            assert row["time/seconds_per_step"] == pytest.approx(2.0, rel=1e-12), step
            horizon = 4 if step < 4 else 8
            assert row["time/remaining_seconds"] == pytest.approx(
                2.0 * (horizon - step - 1), rel=1e-12
            ), step
    assert row["time/batches"] == 8
