"""The guard around callback hooks, and the driver without ``vitals.batch()`` calls."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.shared_ranks import SharedRanks
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.base import VitalsCallback
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor
from trainvitals.distributed import all_gather_objects, all_reduce_coalesced, world_group

# one set of gloo processes per world size runs every case of this file
# (tests/helpers/shared_ranks.py)
shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()


class SumOverRanks(VitalsCallback):
    """Sums the step index over the world at every step, then fails where told to (after its
    collective, as a rank-0-only file write would)."""

    def __init__(self, fail_at: set[tuple[int, int]] = frozenset(), **kwargs) -> None:
        super().__init__(log_every_n_steps=1, **kwargs)
        self.fail_at = fail_at
        self.calls = 0

    def step_end(self, ctx):
        self.calls += 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        (total,) = all_reduce_coalesced([torch.tensor(float(ctx.step))], "sum", world_group())
        if (rank, ctx.step) in self.fail_at:
            raise RuntimeError(f"boom on rank {rank} at step {ctx.step}")
        self.write(ctx, {"sum/step": total})


def _train(vitals: Vitals, steps: int, call_batch: bool = True) -> torch.nn.Module:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals.attach(model, optimizer)
    for _ in range(steps):
        for _ in range(2):
            x = torch.randn(4, 3)
            if call_batch:
                vitals.batch(x)
            model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def test_single_process_failure_disables_the_callback(monkeypatch):
    monkeypatch.setenv("TRAINVITALS_STRICT", "0")
    callback = SumOverRanks(fail_at={(0, 1)})
    writer = Recorder()
    with (
        pytest.warns(RuntimeWarning, match="disabled for the rest of the run"),
        Vitals([callback], writer=writer) as vitals,
    ):
        _train(vitals, 4)
    assert callback.calls == 2  # step 0, and step 1 which raised; never again
    assert sorted(writer.rows) == [0]


def test_strict_mode_reraises(monkeypatch):
    monkeypatch.setenv("TRAINVITALS_STRICT", "1")
    vitals = Vitals([SumOverRanks(fail_at={(0, 0)})], writer=Recorder())
    with pytest.raises(RuntimeError, match="boom"):
        _train(vitals, 1)


class BadConfig(VitalsCallback):
    def run_start(self, ctx):
        raise ValueError("per_param glob 'nope*' matches no parameter")


def test_configuration_error_at_run_start_is_raised_even_when_not_strict(monkeypatch):
    monkeypatch.setenv("TRAINVITALS_STRICT", "0")
    vitals = Vitals([BadConfig()], writer=Recorder())
    with pytest.raises(ValueError, match="matches no parameter"):
        _train(vitals, 1)


def _rank_local_failure(rank: int, world_size: int) -> dict[int, dict[str, float]]:
    os.environ["TRAINVITALS_STRICT"] = "0"
    writer = Recorder()
    callback = SumOverRanks(fail_at={(1, 1)})  # rank 1 only, after its collective
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([callback], writer=writer) as vitals:
            _train(vitals, 4)
    assert any("keeps running" in str(w.message) for w in caught) == (rank == 1)
    return writer.rows


@shared.on_ranks(2, _rank_local_failure)
def test_rank_local_failure_keeps_the_ranks_in_lockstep(ran):
    """A callback failing on one rank is not disabled there (its next collective would leave
    the other ranks waiting forever): every later step is reduced and exact on every rank."""
    _, (rank0, rank1) = ran
    expected = {step: {"sum/step": 2.0 * step} for step in range(4)}
    assert rank0 == expected
    assert rank1 == {s: v for s, v in expected.items() if s != 1}


class BadKey(SumOverRanks):
    def collective_key(self, hook, ctx):
        raise KeyError("a bug in an override")


def _bad_key(rank: int, world_size: int) -> tuple[dict, list[str]]:
    os.environ["TRAINVITALS_STRICT"] = "0"
    writer = Recorder()
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([BadKey()], writer=writer) as vitals:
            _train(vitals, 3)
    return writer.rows, [str(w.message) for w in caught]


@shared.on_ranks(2, _bad_key)
def test_a_failing_collective_key_is_reported_and_changes_nothing_else(ran):
    _, ((rank0, warned0), (rank1, _)) = ran
    assert rank0 == rank1 == {step: {"sum/step": 2.0 * step} for step in range(3)}
    assert sum("collective_key raised KeyError" in w for w in warned0) == 1


class GatherThenReduce(VitalsCallback):
    """At every step: agree on names (object gather), sum a vector over the world, take its max;
    raises on ``(rank, step)`` in ``fail_at`` at ``stage`` 0 (before any collective), 1 (after
    the gather) or 2 (after the sum)."""

    def __init__(self, fail_at: dict[tuple[int, int], int]) -> None:
        super().__init__(log_every_n_steps=1)
        self.fail_at = fail_at

    def step_end(self, ctx):
        rank = torch.distributed.get_rank()
        stage = self.fail_at.get((rank, ctx.step))
        if stage == 0:
            raise RuntimeError("boom before the gather")
        names = all_gather_objects(["a", "b"], world_group())[0]
        if stage == 1:
            raise RuntimeError("boom between the gather and the sum")
        local = torch.tensor([rank + 1.0, 10.0 * ctx.step + rank])
        (total,) = all_reduce_coalesced([local], "sum", world_group())
        if stage == 2:
            raise RuntimeError("boom between the sum and the max")
        (top,) = all_reduce_coalesced([local], "max", world_group())
        self.write(ctx, {f"sum/{n}": v for n, v in zip(names, total, strict=True)})
        self.write(ctx, {"max/b": top[1]})


def _part_way_failure(rank: int, world_size: int) -> tuple[dict, list[str]]:
    os.environ["TRAINVITALS_STRICT"] = "0"
    writer = Recorder()
    # rank 1 fails at three stages, rank 0 once at the start of a step
    callback = GatherThenReduce({(1, 1): 0, (1, 3): 1, (1, 4): 2, (0, 6): 0})
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([callback], writer=writer) as vitals:
            _train(vitals, 8)
    return writer.rows, [str(w.message) for w in caught]


@shared.on_ranks(2, _part_way_failure)
def test_part_way_failure_completes_the_steps_collectives_on_every_rank(ran):
    """A hook that fails before or between its collectives on one rank: the rest of them are
    issued with a 'missing' mark, every rank leaves that step out (none waits, none pairs the
    step with the next one) and every other step is reduced exactly."""
    _, ((rank0, warned0), (rank1, warned1)) = ran
    failed = {1, 3, 4, 6}

    def expected(step: int) -> dict[str, float]:
        # ranks 0 and 1 send [1, 10 step] and [2, 10 step + 1]
        return {"sum/a": 3.0, "sum/b": 20.0 * step + 1, "max/b": 10.0 * step + 1}

    want = {step: expected(step) for step in range(8) if step not in failed}
    assert rank0 == want
    assert rank1 == want
    # the failing rank says it failed; the other that a peer did
    assert any("raised RuntimeError: boom before the gather" in w for w in warned1)
    assert any("keeps running" in w for w in warned0)  # rank 0's own failure at step 6
    assert any("missing on every rank" in w for w in warned0)
    assert any("missing on every rank" in w for w in warned1)
    assert not any("could not be issued" in w for w in warned0 + warned1)


def _runtime_peer_failure(rank: int, world_size: int) -> dict:
    os.environ["TRAINVITALS_STRICT"] = "0"
    writer = Recorder()
    monitor = RuntimeMonitor(log_every_n_steps=1)
    sync = monitor._sync_consumed
    step = {"now": 0}

    def failing_sync() -> None:
        if rank == 1 and step["now"] == 2:
            raise RuntimeError("boom before the counts' collective")
        sync()

    monitor._sync_consumed = failing_sync
    with Vitals([monitor], writer=writer) as vitals:
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        vitals.attach(model, optimizer)
        for s in range(5):
            step["now"] = s
            for _ in range(2):
                x = torch.randn(4, 3)
                vitals.batch(x)
                model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return writer.key("time/samples")


@shared.on_ranks(2, _runtime_peer_failure)
def test_counts_summed_over_ranks_stay_exact_after_a_peer_failure(ran):
    """RuntimeMonitor adds each logging step's summed counts to its totals: when a rank fails
    before the sum, no rank adds a partial (or NaN) sum; the counts of the missed step are
    summed at the next one, so the totals stay exact."""
    _, (rank0, rank1) = ran
    # 2 ranks x 2 micro-batches x 4 samples per step, counted through the end of each step
    want = {s: 16.0 * (s + 1) for s in range(5) if s != 2}
    assert rank0 == want
    assert rank1 == want


class Events(VitalsCallback):
    def __init__(self) -> None:
        super().__init__(log_every_n_steps=1)
        self.events: list[tuple] = []

    def run_start(self, ctx):
        self.events.append(("run_start", ctx.step))

    def micro_batch_start(self, ctx, batch):
        self.events.append(("micro_batch", ctx.step, ctx.micro_batch, batch.batch_size))

    def step_end(self, ctx):
        self.events.append(("step_end", ctx.step, ctx.micro_batches_in_step))


def test_driver_without_batch_calls_counts_training_forwards():
    callback = Events()
    with Vitals([callback], writer=Recorder()) as vitals:
        model = _train(vitals, 2, call_batch=False)
        with torch.no_grad():
            model(torch.randn(2, 3))  # not training: not a micro-batch
    assert callback.events == [
        ("run_start", 0),
        ("micro_batch", 0, 0, None),
        ("micro_batch", 0, 1, None),
        ("step_end", 0, 2),
        ("micro_batch", 1, 0, None),
        ("micro_batch", 1, 1, None),
        ("step_end", 1, 2),
    ]


def test_driver_batch_call_is_not_counted_twice_by_the_forward():
    callback = Events()
    with Vitals([callback], writer=Recorder()) as vitals:
        _train(vitals, 1, call_batch=True)
    assert callback.events == [
        ("run_start", 0),
        ("micro_batch", 0, 0, 4),
        ("micro_batch", 0, 1, 4),
        ("step_end", 0, 2),
    ]


def _raising_batch_size_fn(batch):
    return batch.num_samples  # written for another batch type: AttributeError


def test_a_failing_batch_size_fn_leaves_that_count_out_and_training_goes_on(monkeypatch):
    """A user's ``batch_size_fn`` runs outside the hooks' guard (on the way to
    ``micro_batch_start``): when it raises, the samples are not reported, the other counts
    are, and training goes on (before: the exception ended the run)."""
    monkeypatch.setenv("TRAINVITALS_STRICT", "0")
    writer = Recorder()
    monitor = RuntimeMonitor(log_every_n_steps=1, batch_size_fn=_raising_batch_size_fn)
    with (
        pytest.warns(RuntimeWarning, match="batch_size_fn raised AttributeError"),
        Vitals([monitor], writer=writer) as vitals,
    ):
        _train(vitals, 3)
    assert writer.key("time/batches") == {0: 2.0, 1: 4.0, 2: 6.0}
    assert writer.key("time/samples") == {}
    assert not monitor._disabled

    monkeypatch.setenv("TRAINVITALS_STRICT", "1")
    monitor = RuntimeMonitor(log_every_n_steps=1, batch_size_fn=_raising_batch_size_fn)
    with pytest.raises(AttributeError), Vitals([monitor], writer=Recorder()) as vitals:
        _train(vitals, 1)


class FailingWriter(Recorder):
    """A writer that raises (a backend the callback cannot write to), as a bug at a logging
    step would."""

    def add_scalars(self, mapping, step):
        raise OSError("disk full")


def _router_hooks(model: torch.nn.Module) -> int:
    """Forward (pre-)hooks on the model's routers (the driver has one of its own on the model
    during the run)."""
    from trainvitals.moe import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in routers)


def _all_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_disabled_load_balance_monitor_leaves_no_router_hook(monkeypatch):
    from tests.helpers.moe_models import tiny_moe_lm
    from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor

    monkeypatch.setenv("TRAINVITALS_STRICT", "0")
    model = tiny_moe_lm(num_layers=2, max_seq_len=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    without_monitor = _router_hooks(model)
    without_vitals = _all_hooks(model)
    monitor = LoadBalanceMonitor(log_every_n_steps=2, writer=FailingWriter())
    hooks_seen = []
    with (
        pytest.warns(RuntimeWarning, match="disabled for the rest of the run"),
        Vitals([monitor], writer=Recorder()) as vitals,
    ):
        vitals.attach(model, optimizer)
        for _ in range(3):  # step 0 logs and fails; steps 1 and 2 run without the monitor
            ids = torch.randint(0, 32, (2, 8))
            vitals.batch(ids)
            model(ids, ids).loss.backward()
            hooks_seen.append(_router_hooks(model) - without_monitor)
            optimizer.step()
            optimizer.zero_grad()
    # the capture's hooks were on the routers while the monitor ran (2 routers, at least one
    # hook each), and went with it: none at the steps after the failure nor after the run
    assert hooks_seen[0] >= 2
    assert hooks_seen[1:] == [0, 0]
    assert _all_hooks(model) == without_vitals
    assert monitor.capture is None  # its counts on the device are dropped too
