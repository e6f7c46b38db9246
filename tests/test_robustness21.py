"""Robustness (session 21): MemoryMonitor on ranks of which only some read a CUDA device (a
CPU-only rank of a mixed job, CUDA not initialised on one rank) sends the same collectives on
every rank. No GPU here: the CUDA API is faked and every expected number is computed from the
fake counters."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.callbacks.test_memory_audit17 import _run as run_monitor
from tests.helpers.fake_cuda import FAKE_STATS, CudaParameter, expected_cuda_row
from tests.helpers.shared_ranks import SharedRanks

ranks = SharedRanks(__name__)
case_runs, ran = ranks.fixtures()

_CUDA_API = ("is_available", "is_initialized", "current_device", "memory_stats")
_HOST = {0: (0.5, 0.75), 1: (0.25, 1.5)}  # rank -> (rss_gb, peak_rss_gb), fixed readings
_REDUCES = (("max",), ("max", "min", "mean"))


class _Model(torch.nn.Module):
    def __init__(self, on_cuda: bool) -> None:
        super().__init__()
        if on_cuda:  # a parameter that reports itself on cuda:0, so cuda:0 is read
            self.on_cuda = CudaParameter(torch.zeros(2), requires_grad=False)
        self.w = torch.nn.Parameter(torch.ones(2))


def _mixed_body(rank: int, world_size: int) -> dict:
    """Rank 1 reads a (faked) CUDA device, rank 0 has no CUDA at all."""
    from trainvitals.callbacks.memory_monitor import MemoryMonitor
    from trainvitals.distributed import collective_counter
    from trainvitals.stats import memory as memory_stats

    saved = {name: getattr(torch.cuda, name) for name in _CUDA_API}
    saved_host = memory_stats.host_memory_readings
    rss, peak = _HOST[rank]
    memory_stats.host_memory_readings = lambda process=None: {"rss_gb": rss, "peak_rss_gb": peak}
    if rank == 1:
        torch.cuda.is_available = lambda: True
        torch.cuda.is_initialized = lambda: True
        torch.cuda.current_device = lambda: 0
        torch.cuda.memory_stats = lambda device=None: dict(FAKE_STATS)
    out: dict = {}
    try:
        for host in (True, False):
            for reduce in _REDUCES:
                before = sum(collective_counter.values())
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    monitor = MemoryMonitor(host=host, reduce=reduce)
                    rows = run_monitor(_Model(rank == 1), monitor).rows
                out[(host, reduce)] = {
                    "rows": rows,
                    "collectives": sum(collective_counter.values()) - before,
                    "warned": any("reads no CUDA device" in str(w.message) for w in caught),
                }
    finally:
        memory_stats.host_memory_readings = saved_host
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
    return out


def _expected(host: bool, reduce: tuple[str, ...]) -> dict[str, float]:
    # the CUDA keys: the one device read (rank 1's); the host keys: over both ranks
    row = expected_cuda_row()
    per_key = {key: [value] for key, value in row.items()}
    if host:
        per_key["memory/rss_gb"] = [_HOST[r][0] for r in (0, 1)]
        per_key["memory/peak_rss_gb"] = [_HOST[r][1] for r in (0, 1)]
    out = {}
    for key, values in per_key.items():
        if "max" in reduce:
            out[key] = max(values)
        if "min" in reduce:
            out[f"{key}/min"] = min(values)
        if "mean" in reduce:
            out[f"{key}/mean"] = sum(values) / len(values)
    return out


@ranks.on_ranks(2, _mixed_body)
def test_memory_monitor_on_ranks_of_which_one_reads_no_cuda_device(ran):
    _, results = ran
    for host in (True, False):
        for reduce in _REDUCES:
            expected = _expected(host, reduce)
            assert len(expected) == len(reduce) * (12 if host else 10)
            for result in results:
                got = result[(host, reduce)]
                # logging steps 0 and 2: one collective each, on both ranks alike
                assert got["collectives"] == 2
                assert sorted(got["rows"]) == [0, 2]
                for row in got["rows"].values():
                    assert row == pytest.approx(expected, rel=1e-15)
                assert got["warned"]  # every rank says the CUDA keys cover fewer ranks
