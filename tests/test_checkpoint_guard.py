"""The guard around ``state_dict``/``load_state_dict``: checkpointing (the driver's
``state_dict``, Lightning's ``save_checkpoint``/``ModelCheckpoint``/``fit(ckpt_path=)``) calls them
outside the hook guard, and a callback failing there must not end the run."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.scripts.vitals_testing import FakeClock, batch_size, fake_loop, quiet_trainer
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.base import STATE_FAILED_KEY, VitalsCallback
from trainvitals.callbacks.norm_monitor import NormMonitor
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor

MICRO_BATCHES = 2  # per optimizer step in _train


@pytest.fixture(autouse=True)
def _not_strict(monkeypatch):
    monkeypatch.setenv("TRAINVITALS_STRICT", "0")


class StepCounter(VitalsCallback):
    """Counts optimizer steps (its state) and writes the count at every step."""

    def __init__(self) -> None:
        super().__init__(log_every_n_steps=1)
        self.steps = 0

    def step_end(self, ctx):
        self.steps += 1
        self.write(ctx, {"count/steps": self.steps})

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state_dict):
        self.steps = state_dict["steps"]


def _boom(*args, **kwargs):
    raise RuntimeError("tensor cannot be read")


def _train(vitals: Vitals, model: torch.nn.Module, optimizer, steps: int) -> None:
    for _ in range(steps):
        for _ in range(MICRO_BATCHES):
            x = torch.ones(4, 3)
            vitals.batch(x)
            model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _batches(writer: Recorder) -> dict[int, float]:
    return writer.key("time/batches")


def _run(callbacks, writer, steps, state=None):
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals = Vitals(callbacks, writer=writer, log_every_n_steps=1)
    if state is not None:
        vitals.load_state_dict(state)
    vitals.attach(model, optimizer)
    _train(vitals, model, optimizer, steps)
    return vitals, model, optimizer


def test_a_failing_state_dict_leaves_a_marker_and_the_run_goes_on(tmp_path):
    runtime, counter, writer = RuntimeMonitor(), StepCounter(), Recorder()
    vitals, model, optimizer = _run([runtime, counter], writer, 3)
    with pytest.MonkeyPatch.context() as patch, pytest.warns(RuntimeWarning, match="no state"):
        # the monitor's collective part (one process: a plain sum) raises
        patch.setattr(runtime, "_sync_consumed", _boom)
        state = vitals.state_dict()
    assert state["callbacks"]["RuntimeMonitor"] == {
        STATE_FAILED_KEY: "RuntimeError: tensor cannot be read"
    }
    assert state["callbacks"]["StepCounter"] == {"steps": 3}
    torch.save(state, tmp_path / "vitals.pt")  # plain data: saved and read back
    _train(vitals, model, optimizer, 2)
    vitals.close()
    # both callbacks kept running after the failed save, with exact counts
    assert _batches(writer) == {s: MICRO_BATCHES * (s + 1.0) for s in range(5)}
    assert writer.key("count/steps") == {s: s + 1.0 for s in range(5)}

    # resume from that checkpoint: the marker is skipped with a warning, the monitor starts
    # fresh (counting batches since the resume), the other callback continues
    loaded = torch.load(tmp_path / "vitals.pt", weights_only=True)
    writer2 = Recorder()
    with pytest.warns(RuntimeWarning, match="holds no state of this callback"):
        vitals2, _, _ = _run([RuntimeMonitor(), StepCounter()], writer2, 2, state=loaded)
    vitals2.close()
    assert _batches(writer2) == {3: MICRO_BATCHES * 1.0, 4: MICRO_BATCHES * 2.0}
    assert writer2.key("count/steps") == {3: 4.0, 4: 5.0}


def test_a_failing_load_state_dict_keeps_the_fresh_state_and_the_callback_running():
    runtime, writer = RuntimeMonitor(), Recorder()
    vitals, _, _ = _run([runtime, StepCounter()], writer, 3)
    state = vitals.state_dict()
    vitals.close()
    # a corrupt entry, read after the monitor already took its seconds and rate
    state["callbacks"]["RuntimeMonitor"]["consumed"]["batches"] = "not a number"
    state["callbacks"]["RuntimeMonitor"]["seconds"]["train"] = 1e6
    fresh = RuntimeMonitor()
    writer2 = Recorder()
    with pytest.warns(RuntimeWarning, match=r"load_state_dict raised ValueError"):
        vitals2, _, _ = _run([fresh, StepCounter()], writer2, 2, state=state)
    vitals2.close()
    # the checkpoint's seconds were not kept (this run's own, folded in at its end, are)
    assert all(v < 1.0 for v in fresh._prev.values()), fresh._prev
    assert writer2.key("time/train_hours")[4] < 1.0  # (1e6 s would be 277 h)
    assert _batches(writer2) == {3: MICRO_BATCHES * 1.0, 4: MICRO_BATCHES * 2.0}
    assert writer2.key("count/steps") == {3: 4.0, 4: 5.0}


class ExtendedNorms(NormMonitor):
    """A user's subclass adding to the state of its parent through ``super()``."""

    def state_dict(self):
        return {**super().state_dict(), "mine": 1}


def test_a_subclass_state_built_on_super_fails_as_one_marker():
    monitor = ExtendedNorms()
    with pytest.MonkeyPatch.context() as patch, pytest.warns(RuntimeWarning, match="no state"):
        patch.setattr(monitor, "_report_pending", _boom)
        state = monitor.state_dict()
    assert state == {STATE_FAILED_KEY: "RuntimeError: tensor cannot be read"}
    assert monitor.state_dict() == {
        "first_nonfinite_step": None,
        "first_nonfinite_names": [],
        "nonfinite_logging_steps": 0,
        "mine": 1,
    }


def test_strict_mode_raises_from_both(monkeypatch):
    monkeypatch.setenv("TRAINVITALS_STRICT", "1")
    monitor = RuntimeMonitor()
    monkeypatch.setattr(monitor, "_sync_consumed", _boom)
    with pytest.raises(RuntimeError, match="cannot be read"):
        monitor.state_dict()
    with pytest.raises(TypeError, match="not subscriptable"):
        StepCounter().load_state_dict(None)


def _lightning_module(pl):
    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.ones(8, 3), batch_size=2)

    return Tiny()


class UnreadableRuntime(RuntimeMonitor):
    """A user's subclass whose state holds a tensor that cannot be read as a number."""

    def state_dict(self):
        return {**super().state_dict(), "extra": float(torch.ones(2))}


def test_lightning_checkpoints_are_saved_when_a_state_dict_fails(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    writer = Recorder()
    runtime = UnreadableRuntime(log_every_n_steps=1, writer=writer)
    checkpoints = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1
    )
    trainer = quiet_trainer(
        callbacks=[runtime, checkpoints],
        enable_checkpointing=True,
        max_steps=4,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own (few workers, ...)
        warnings.simplefilter("always", RuntimeWarning)
        with pytest.warns(RuntimeWarning, match="no state of this callback"):
            trainer.fit(_lightning_module(pl))
    assert trainer.global_step == 4
    assert _batches(writer) == {s: s + 1.0 for s in range(4)}
    saved = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert saved == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    checkpoint = torch.load(tmp_path / saved[0], weights_only=False)
    assert STATE_FAILED_KEY in checkpoint["callbacks"]["UnreadableRuntime"]

    # resume from it with a fresh monitor: skipped with a warning, the run finishes
    resumed = UnreadableRuntime(log_every_n_steps=1, writer=Recorder())
    trainer2 = quiet_trainer(callbacks=[resumed], max_steps=4, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", RuntimeWarning)
        with pytest.warns(RuntimeWarning, match="holds no state of this callback"):
            trainer2.fit(_lightning_module(pl), ckpt_path=tmp_path / saved[0])
    assert trainer2.global_step == 4
    assert _batches(resumed._writer_override) == {2: 1.0, 3: 2.0}


# ---------------------------------------------------------------------------- several ranks


class SubclassFailingFirst(ThroughputMonitor):
    """A user's subclass whose own code fails, on one rank, before ``super().state_dict()``."""

    fail = False

    def state_dict(self):
        if self.fail:
            raise RuntimeError("a rank-local failure before the collective")
        return super().state_dict()


def _failing_state_dict_body(rank: int, world_size: int, kind: str) -> dict:
    """Two ranks train, save a checkpoint whose ``state_dict`` fails on rank 1 before the
    monitor's collective, train on, then save once more (no failure)."""
    import os

    os.environ["TRAINVITALS_STRICT"] = "0"
    warnings.simplefilter("ignore", RuntimeWarning)
    clock = FakeClock()
    if kind == "runtime":
        monitor = RuntimeMonitor(clock=clock, log_every_n_steps=1)
    else:
        monitor = SubclassFailingFirst(window_size=3, warmup_steps=0, clock=clock)
        monitor.log_every_n_steps = 1
    writer = Recorder()
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, optimizer)

    def train(steps: range) -> None:
        for step in steps:
            x = torch.ones(batch_size(step, 0, rank), 3)
            vitals.batch(x)
            clock.t += 1.0
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    train(range(3))
    if rank == 1:
        if kind == "runtime":  # a count that cannot be read on the host
            monitor._pending["samples"] = torch.tensor(1.0, device="meta")
        else:
            monitor.fail = True
    failed = monitor.state_dict()
    if kind == "runtime":
        monitor._pending["samples"] = 0.0  # as it was: every step logs, so all was summed
    monitor.fail = False
    train(range(3, 6))
    saved = monitor.state_dict()
    vitals.close()
    return {"failed": failed, "saved": saved, "rows": writer.rows}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["runtime", "throughput_subclass"])
def test_a_state_dict_failing_on_one_rank_leaves_no_rank_waiting(kind):
    """Before the fix the healthy rank waited in the monitor's checkpoint collective, which then
    paired with the failed rank's next logging step (a crash on a size mismatch, or sums of two
    different steps)."""
    results = run_distributed(_failing_state_dict_body, world_size=2, args=(kind,), timeout=150)
    samples = {s: sum(batch_size(s, 0, r) for r in (0, 1)) for s in range(6)}
    for rank, result in enumerate(results):
        # every rank's checkpoint gets the marker: rank 0's (the one saved) has no partial state
        assert STATE_FAILED_KEY in result["failed"], rank
        assert STATE_FAILED_KEY not in result["saved"], rank
        rows = result["rows"]
        assert sorted(rows) == list(range(6))
        if kind == "runtime":
            consumed = result["saved"]["consumed"]
            assert consumed["batches"] == 2 * 6
            assert consumed["samples"] == sum(samples.values())
            for step in range(6):
                assert rows[step]["time/batches"] == 2 * (step + 1), (rank, step)
                expected = sum(samples[s] for s in range(step + 1))
                assert rows[step]["time/samples"] == expected, (rank, step)
        else:
            for step in range(6):
                window = range(max(0, step - 2), step + 1)
                expected = sum(samples[s] for s in window) / len(window)
                assert rows[step]["throughput/samples_per_sec"] == pytest.approx(expected), step
            # the second checkpoint holds the exact global sums of the window (steps 3-5)
            globals_ = result["saved"]["window"]["globals"]
            assert [g[1] for g in globals_] == [samples[s] for s in (3, 4, 5)]


def test_a_peer_marked_checkpoint_sum_leaves_the_window_live(monkeypatch):
    """On accelerators a peer's "missing" mark comes back as NaN sums (no host sync in the
    collective): the checkpoint must get the marker, not NaN global sums that a resume would
    turn into NaN rates, and the window stays to be summed at the next logging step."""
    import trainvitals.callbacks.throughput_monitor as throughput_module

    clock = FakeClock()
    monitor = ThroughputMonitor(window_size=3, warmup_steps=0, clock=clock)
    fake_loop([monitor], clock, steps=range(4))
    real = throughput_module.reduce_counts
    monkeypatch.setattr(
        throughput_module, "reduce_counts", lambda m, g: torch.full_like(m, float("nan"))
    )
    with pytest.warns(RuntimeWarning, match="no state of this callback"):
        marked = monitor.state_dict()
    assert STATE_FAILED_KEY in marked
    monkeypatch.setattr(throughput_module, "reduce_counts", real)
    saved = monitor.state_dict()["window"]
    # one process: the global sums are this rank's own counts, for the last 3 steps
    assert [g[1] for g in saved["globals"]] == [r[2] for r in saved["records"]]
    assert len(saved["records"]) == 3
