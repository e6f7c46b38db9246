"""A faked CUDA allocator API for MemoryMonitor tests on a machine without a GPU.

``TORCH_NAMES`` maps the MemoryMonitor keys of its docstring's table to the
``torch.cuda.memory_stats`` names (written here, not read from ``CUDA_STATS``), ``FAKE_STATS``
is one fixed reading, ``expected_cuda_row`` the row that reading must give, computed here from
the torch names. ``fake_cuda_api`` patches ``torch.cuda`` (available, initialised or not,
current device 1) and returns the devices that ``memory_stats`` was asked for.
``CudaParameter`` and ``OffloadedShard`` stand for parameters on a GPU (only what the monitor
looks at is faked)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainvitals.stats import memory as memory_stats

# torch.cuda.memory_stats names of the docstring's table (not read from CUDA_STATS)
TORCH_NAMES = {
    "allocated_gb": "allocated_bytes.all.current",
    "active_gb": "active_bytes.all.current",
    "inactive_gb": "inactive_split_bytes.all.current",
    "reserved_gb": "reserved_bytes.all.current",
    "peak_allocated_gb": "allocated_bytes.all.peak",
    "peak_active_gb": "active_bytes.all.peak",
    "peak_inactive_gb": "inactive_split_bytes.all.peak",
    "peak_reserved_gb": "reserved_bytes.all.peak",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}

FAKE_STATS = {
    "allocated_bytes.all.current": 1_250_000_000,
    "active_bytes.all.current": 1_500_000_000,
    "inactive_split_bytes.all.current": 125_000_000,
    "reserved_bytes.all.current": 4_000_000_000,
    "allocated_bytes.all.peak": 2_750_000_000,
    "active_bytes.all.peak": 3_000_000_000,
    "inactive_split_bytes.all.peak": 500_000_000,
    "reserved_bytes.all.peak": 5_000_000_000,
    "num_alloc_retries": 3,
    "num_ooms": 2,
}


def expected_cuda_row() -> dict[str, float]:
    """The MemoryMonitor row of one ``FAKE_STATS`` reading: bytes / 1e9, the counts as they are
    (the counts written out as numbers, independent of the table's conversion too)."""
    row = {f"memory/{k}": FAKE_STATS[v] / 1e9 for k, v in TORCH_NAMES.items() if k.endswith("_gb")}
    row["memory/alloc_retries"] = 3.0
    row["memory/ooms"] = 2.0
    assert set(row) == {f"memory/{k}" for k in memory_stats.CUDA_STATS}
    return row


def fake_cuda_api(monkeypatch: pytest.MonkeyPatch, *, initialised: bool) -> list:
    """CUDA available (initialised by other code of the process or not), current device 1,
    every ``memory_stats`` reading ``FAKE_STATS``; returns the devices it was asked for."""
    asked: list = []

    def memory_stats_of(device=None):
        asked.append(device)
        return dict(FAKE_STATS)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats_of)
    return asked


class CudaParameter(torch.nn.Parameter):
    """A CPU parameter that reports itself on cuda:0 (only its ``device`` is looked at)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


class OffloadedShard(torch.nn.Parameter):
    """Stands for an FSDP2 DTensor parameter with CPUOffloadPolicy: the local shard on the CPU,
    the mesh on CUDA (``DTensor.device_mesh.device_type``)."""

    device_mesh = SimpleNamespace(device_type="cuda")
