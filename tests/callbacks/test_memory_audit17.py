"""MemoryMonitor audit: a model spread over several CUDA devices of one process (every device
is read, reduced with the other ranks' devices in the same one collective), and the allocator
history stopped when the monitor is disabled or its exception snapshot fails. No GPU here: the
CUDA API is faked per device and the expected values are computed from the fake numbers."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.fake_cuda import TORCH_NAMES
from tests.scripts.vitals_testing import NullWriter, RecordingWriter
from trainvitals.callbacks.memory_monitor import MemoryMonitor
from trainvitals.distributed import collective_counter


def _stats(rank: int, index: int) -> dict[str, int]:
    """Fake allocator counters of cuda:<index> on ``rank``: every key differs by device and
    rank, and device 1 is not the largest in every key (so max, min and mean all differ)."""
    base = 1_000_000_000 * (1 + index) + 250_000_000 * rank
    stats = {name: base + 10_000_000 * i for i, name in enumerate(TORCH_NAMES.values())}
    stats["reserved_bytes.all.current"] = 9_000_000_000 - base  # largest on device 0
    stats["num_alloc_retries"] = 5 - index + rank
    stats["num_ooms"] = index * (rank + 1)
    return stats


def _expected(readings: list[dict[str, int]]) -> dict[str, float]:
    """max, min and mean over the given device readings, float64, bytes / 1e9."""
    out: dict[str, float] = {}
    for key, stat in TORCH_NAMES.items():
        scale = 1.0 if stat.startswith("num_") else 1e9
        values = [r[stat] / scale for r in readings]
        out[f"memory/{key}"] = max(values)
        out[f"memory/{key}/min"] = min(values)
        out[f"memory/{key}/mean"] = sum(values) / len(values)
    return out


class _OnDevice(torch.nn.Parameter):
    """A CPU parameter that reports itself on ``cuda:<index>`` (only ``device`` is read)."""

    index = 0

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.index)


def _param_on(index: int) -> torch.nn.Parameter:
    cls = type(f"_OnDevice{index}", (_OnDevice,), {"index": index})
    return cls(torch.zeros(2), requires_grad=False)


class _Spread(torch.nn.Module):
    """device_map="auto"-like: the first layer on cuda:<first>, the last on cuda:<last>, a CPU
    parameter that trains (for the optimizer)."""

    def __init__(self, devices: list[int]) -> None:
        super().__init__()
        self.layers = torch.nn.ParameterList([_param_on(i) for i in devices])
        self.w = torch.nn.Parameter(torch.ones(2))


def _patch_cuda(rank: int, asked: list, resets: list) -> None:
    def memory_stats(device=None):
        asked.append(device)
        return _stats(rank, torch.device(device).index)

    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.memory_stats = memory_stats
    torch.cuda.reset_peak_memory_stats = lambda device=None: resets.append(device)


def _run(model: torch.nn.Module, monitor: MemoryMonitor, steps: int = 3) -> RecordingWriter:
    from trainvitals.adapters.loop import Vitals

    writer = RecordingWriter()
    opt = torch.optim.SGD([model.w], lr=0.1)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=2)
    vitals.attach(model, opt)
    for _ in range(steps):
        vitals.batch({"x": torch.zeros(1, 2)})
        model.w.pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    return writer


@pytest.fixture
def patched(monkeypatch):
    asked: list = []
    resets: list = []
    for name in ("is_available", "is_initialized", "current_device", "memory_stats"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", torch.cuda.reset_peak_memory_stats)
    _patch_cuda(0, asked, resets)
    return asked, resets


def test_model_spread_over_two_devices_reads_both(patched):
    asked, resets = patched
    monitor = MemoryMonitor(host=False, reduce=("max", "min", "mean"), peak_since_last_log=True)
    writer = _run(_Spread([0, 1]), monitor)
    assert sorted(writer.rows) == [0, 2]
    expected = _expected([_stats(0, 0), _stats(0, 1)])
    for row in writer.rows.values():
        assert row == pytest.approx(expected, rel=1e-14)
    # one reading and one peak reset per device per logging step, nothing else
    both = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert asked == both * 2
    assert resets == both * 2


def test_max_only_is_the_worst_device(patched):
    # the first parameter on cuda:2, the last on cuda:0: both read, in index order
    asked, _ = patched
    writer = _run(_Spread([2, 0]), MemoryMonitor(host=False))
    expected = _expected([_stats(0, 0), _stats(0, 2)])
    assert writer.rows[2] == pytest.approx(
        {k: v for k, v in expected.items() if k.count("/") == 1}, rel=1e-14
    )
    assert asked == [torch.device("cuda", 0), torch.device("cuda", 2)] * 2


def _two_ranks_body(rank: int, world_size: int) -> dict:
    asked: list = []
    _patch_cuda(rank, asked, [])
    counts = []
    before = collective_counter["all_gather"], collective_counter["all_reduce"]
    # rank 0 computes on one device, rank 1 on two
    devices = [0] if rank == 0 else [0, 1]
    writer = _run(_Spread(devices), MemoryMonitor(reduce=("max", "min", "mean")))
    counts = (
        collective_counter["all_gather"] - before[0],
        collective_counter["all_reduce"] - before[1],
    )
    return {"rows": writer.rows, "counts": counts, "asked": len(asked)}


@pytest.mark.timeout(180)
def test_two_ranks_reduce_over_every_device_of_every_rank():
    results = run_distributed(_two_ranks_body, world_size=2)
    readings = [_stats(0, 0), _stats(1, 0), _stats(1, 1)]  # three devices in all
    expected = _expected(readings)
    for rank, result in enumerate(results):
        row = result["rows"][2]
        cuda = {k: v for k, v in row.items() if "rss" not in k}
        assert cuda == pytest.approx(expected, rel=1e-14)
        # the host keys are per process, reduced over the two ranks
        assert {"memory/rss_gb", "memory/rss_gb/min", "memory/rss_gb/mean"} <= set(row)
        assert row["memory/rss_gb/min"] <= row["memory/rss_gb/mean"] <= row["memory/rss_gb"]
        assert result["counts"] == (2, 0)  # one all-gather per logging step (0 and 2)
        assert result["asked"] == 2 * (1 + rank)


# ------------------------------------------------------------------ allocator history


@pytest.fixture
def history(monkeypatch):
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})
    monkeypatch.setattr(
        torch.cuda.memory,
        "_record_memory_history",
        lambda enabled="all", **kw: calls.append(enabled),
    )

    def disk_full(filename="x"):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", disk_full)
    return calls


def test_a_failing_snapshot_disables_the_monitor_and_stops_the_history(
    history, tmp_path, monkeypatch
):
    monkeypatch.setenv("TRAINVITALS_STRICT", "0")  # the guard as in a real run
    monitor = MemoryMonitor(record_history=True, snapshot_steps=[1], snapshot_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(_Spread([0]), monitor, steps=4)
    assert any("is disabled for the rest of the run" in str(w.message) for w in caught)
    # started at run start, stopped when the guard disabled the monitor at step 1
    assert history == ["all", None]


def test_a_failing_exception_snapshot_still_stops_the_history(history, tmp_path):
    from trainvitals.adapters.context import RunContext
    from trainvitals.distributed import ProcessGroups

    ctx = RunContext(
        writer=NullWriter(), groups=ProcessGroups(), model=_Spread([0]), run_dir=tmp_path
    )
    monitor = MemoryMonitor(record_history=True)
    monitor.run_start(ctx)
    with pytest.raises(OSError, match="No space left"):
        monitor.exception_raised(ctx, RuntimeError("CUDA out of memory"))
    assert history == ["all", None]


# ------------------------------------------------------------------ host reading failures


def _flaky_host(rank: int, failing_calls: set[int]):
    """Rank-dependent host readings; on rank 1 the calls numbered in ``failing_calls`` (0 is
    the run-start probe) raise, as a passing EMFILE would."""
    calls = {"n": 0}

    def readings(process=None):
        n = calls["n"]
        calls["n"] += 1
        if rank == 1 and n in failing_calls:
            raise OSError(24, "Too many open files")
        return {"rss_gb": 1.0 + rank + n, "peak_rss_gb": 10.0 - rank}

    return readings


def _flaky_body(rank: int, world_size: int, reduce: tuple[str, ...]) -> dict:
    import os

    from tests.scripts.vitals_testing import fake_loop
    from trainvitals.stats import memory as memory_stats

    os.environ["TRAINVITALS_STRICT"] = "0"
    # rank 1 cannot read at run start nor at step 0, then can
    memory_stats.host_memory_readings = _flaky_host(rank, {0, 1})
    kind = "all_reduce" if reduce == ("max",) else "all_gather"
    before = collective_counter[kind]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer, _ = fake_loop([MemoryMonitor(reduce=reduce)], None, steps=range(5), log_every=2)
    return {
        "rows": writer.rows,
        "gathers": collective_counter[kind] - before,
        "warnings": [str(w.message) for w in caught],
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("reduce", [("max", "min", "mean"), ("max",)])
def test_host_reading_failing_on_one_rank_at_run_start_keeps_the_ranks_in_step(reduce):
    # ("max",): one all-reduce MAX, in which gloo drops a NaN depending on the rank order
    # (the max of the ranks that could read, instead of nothing)
    results = run_distributed(_flaky_body, world_size=2, args=(reduce,), timeout=90)
    for result in results:
        assert result["rows"].get(0, {}) == {}  # rank 1 could not read: left out on both
        for step, n in ((2, 2), (4, 3)):  # the n-th reading of each rank
            rss = [1.0 + r + n for r in range(2)]
            expected = {
                "memory/rss_gb": max(rss),
                "memory/rss_gb/min": min(rss),
                "memory/rss_gb/mean": sum(rss) / 2,
                "memory/peak_rss_gb": 10.0,
                "memory/peak_rss_gb/min": 9.0,
                "memory/peak_rss_gb/mean": 9.5,
            }
            wanted = {
                f"memory/{n}{'' if r == 'max' else '/' + r}"
                for n in ("rss_gb", "peak_rss_gb")
                for r in reduce
            }
            assert result["rows"][step] == {k: v for k, v in expected.items() if k in wanted}
        assert result["gathers"] == 3  # one collective per logging step on both ranks
    assert any("cannot read the host memory" in w for w in results[1]["warnings"])


def test_host_reading_failing_mid_run_leaves_out_the_host_keys_of_that_step(patched, monkeypatch):
    from trainvitals.stats import memory as memory_stats

    monkeypatch.setenv("TRAINVITALS_STRICT", "0")
    # run start (0), step 0 (1) read; step 2 (2) raises; step 4 (3) reads again
    monkeypatch.setattr(memory_stats, "host_memory_readings", _flaky_host(1, {2}))
    with pytest.warns(RuntimeWarning, match="reading the host memory raised OSError"):
        writer = _run(_Spread([0]), MemoryMonitor(), steps=5)
    cuda = {k: v for k, v in _expected([_stats(0, 0)]).items() if k.count("/") == 1}
    assert writer.rows[0] == {**cuda, "memory/rss_gb": 3.0, "memory/peak_rss_gb": 9.0}
    assert writer.rows[2] == cuda  # the CUDA keys still, the monitor not disabled
    assert writer.rows[4] == {**cuda, "memory/rss_gb": 5.0, "memory/peak_rss_gb": 9.0}
