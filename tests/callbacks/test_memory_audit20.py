"""MemoryMonitor audit (session 20): statistics that ``torch.cuda.memory_stats`` does not have
(an older torch, another allocator, an allocator not initialised yet) are left out, never
written as 0, on every rank, and an allocator without statistics (a ``CUDAPluggableAllocator``
such as RMM's: ``memory_stats`` raises) costs the CUDA keys only, not the host keys. No GPU
here: the CUDA API is faked and every expected number is computed from the fake counters."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.callbacks.test_memory_audit17 import _run as run_monitor
from tests.helpers.dist import run_distributed
from tests.helpers.fake_cuda import FAKE_STATS, TORCH_NAMES, CudaParameter
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.callbacks.memory_monitor import MemoryMonitor


class _Model(torch.nn.Module):
    """A parameter that reports itself on cuda:0 (so cuda:0 is read) and one that trains."""

    def __init__(self) -> None:
        super().__init__()
        self.on_cuda = CudaParameter(torch.zeros(2), requires_grad=False)
        self.w = torch.nn.Parameter(torch.ones(2))


def _patch(stats_of, resets: list) -> None:
    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.memory_stats = stats_of
    torch.cuda.reset_peak_memory_stats = lambda device=None: resets.append(device)


@pytest.fixture
def restore_cuda(monkeypatch):
    for name in (
        "is_available",
        "is_initialized",
        "current_device",
        "memory_stats",
        "reset_peak_memory_stats",
    ):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))


def _run(monitor: MemoryMonitor, steps: int = 3) -> RecordingWriter:
    return run_monitor(_Model(), monitor, steps)


def _without(*names: str) -> dict[str, int]:
    return {k: v for k, v in FAKE_STATS.items() if k not in names}


def _gb(key: str, value: float) -> float:
    return value if TORCH_NAMES[key].startswith("num_") else value / 1e9


# torch.cuda.memory_stats of an allocator that keeps only current and peak bytes
_PARTIAL = (
    "active_bytes.all.current",
    "active_bytes.all.peak",
    "inactive_split_bytes.all.current",
    "inactive_split_bytes.all.peak",
    "num_alloc_retries",
    "num_ooms",
)


def test_statistics_missing_from_memory_stats_are_left_out_not_written_as_zero(restore_cuda):
    stats = _without(*_PARTIAL)
    _patch(lambda device=None: dict(stats), [])
    with pytest.warns(RuntimeWarning, match="has no memory/active_gb") as caught:
        writer = _run(MemoryMonitor(host=False))
    expected = {f"memory/{k}": _gb(k, stats[t]) for k, t in TORCH_NAMES.items() if t in stats}
    assert len(expected) == 4  # allocated, reserved and their peaks
    assert sorted(writer.rows) == [0, 2]
    for row in writer.rows.values():
        assert row == pytest.approx(expected, rel=1e-15)  # no key at 0.0 for a missing stat
    assert sum("has no" in str(w.message) for w in caught) == 1  # warned once

    # an allocator not initialised on the device: memory_stats is {} -> no CUDA key at all
    _patch(lambda device=None: {}, [])
    with pytest.warns(RuntimeWarning, match="has no memory/allocated_gb"):
        writer = _run(MemoryMonitor(host=False))
    assert writer.rows == {}


def test_an_allocator_without_statistics_keeps_the_host_keys(restore_cuda):
    calls: list = []

    def no_stats(device=None):  # what CUDAPluggableAllocator (RMM's) raises
        calls.append(device)
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats.")

    resets: list = []
    _patch(no_stats, resets)
    monitor = MemoryMonitor(peak_since_last_log=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = _run(monitor, steps=5)
    assert not monitor._disabled
    assert sorted(writer.rows) == [0, 2, 4]
    for row in writer.rows.values():
        assert set(row) == {"memory/rss_gb", "memory/peak_rss_gb"}
        assert 0 < row["memory/rss_gb"] <= row["memory/peak_rss_gb"]
    # asked once per logging step (in case it recovers), no peak reset (it raises too under
    # that allocator)
    assert len(calls) == 3 and resets == []
    messages = [str(w.message) for w in caught]
    assert sum("getDeviceStats" in m for m in messages) == 1, messages


def _ranks_body(rank: int, world_size: int) -> dict:
    # rank 1's allocator lacks the inactive and retry statistics; rank 0's has them all
    missing = ("inactive_split_bytes.all.current", "num_alloc_retries") if rank else ()
    stats = {k: v * (1 + rank) + 1_000_000 * rank for k, v in _without(*missing).items()}
    _patch(lambda device=None: dict(stats), [])
    out = {"stats": stats}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for reduce in (("max",), ("max", "min", "mean")):
            out[reduce] = _run(MemoryMonitor(host=False, reduce=reduce)).rows
    return out


@pytest.mark.timeout(180)
def test_two_ranks_leave_out_a_statistic_one_rank_lacks():
    results = run_distributed(_ranks_body, world_size=2)
    per_rank = [r["stats"] for r in results]
    expected: dict[str, float] = {}
    for key, torch_name in TORCH_NAMES.items():
        if any(torch_name not in s for s in per_rank):
            continue  # some rank did not measure it: left out everywhere, not its max
        values = [_gb(key, s[torch_name]) for s in per_rank]
        expected[f"memory/{key}"] = max(values)
        expected[f"memory/{key}/min"] = min(values)
        expected[f"memory/{key}/mean"] = sum(values) / len(values)
    assert len(expected) == 3 * 8
    for result in results:
        assert result[("max",)][2] == pytest.approx(
            {k: v for k, v in expected.items() if k.count("/") == 1}, rel=1e-14
        )
        assert result[("max", "min", "mean")][2] == pytest.approx(expected, rel=1e-14)


def test_the_cuda_malloc_async_backend_zeros_are_left_out(restore_cuda, monkeypatch):
    """Under backend:cudaMallocAsync memory_stats holds every key, but only allocated, active
    and reserved bytes are counted (the others stay 0): those four are left out, the rest
    written as read."""
    stats = dict(FAKE_STATS)
    for name in ("inactive_split_bytes.all.current", "inactive_split_bytes.all.peak"):
        stats[name] = 0
    stats["num_alloc_retries"] = stats["num_ooms"] = 0
    _patch(lambda device=None: dict(stats), [])
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    with pytest.warns(RuntimeWarning, match="cudaMallocAsync backend"):
        writer = _run(MemoryMonitor(host=False))
    async_counted = {"allocated_gb", "active_gb", "reserved_gb"}
    expected = {
        f"memory/{k}": _gb(k, stats[t])
        for k, t in TORCH_NAMES.items()
        if k.removeprefix("peak_") in async_counted
    }
    assert len(expected) == 6
    for row in writer.rows.values():
        assert row == pytest.approx(expected, rel=1e-15)
    # the native backend: the same zeros are counts it keeps, written
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    writer = _run(MemoryMonitor(host=False))
    assert writer.rows[0]["memory/ooms"] == 0 and writer.rows[0]["memory/inactive_gb"] == 0
