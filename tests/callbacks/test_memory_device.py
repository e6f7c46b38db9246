"""MemoryMonitor's choice of the CUDA device to read: the run's compute device, not only the
first parameter's (FSDP2 CPU offload, a CPU embedding table first, Lightning's root device).
No GPU here: the CUDA API is faked and the device each reading asks for is recorded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.context import RunContext
from trainvitals.callbacks.memory_monitor import MemoryMonitor
from trainvitals.distributed import ProcessGroups
from trainvitals.stats import memory as memory_stats

_FAKE_STATS = {
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


class _CudaParameter(torch.nn.Parameter):
    """A CPU parameter that reports itself on cuda:0 (only its ``device`` is looked at)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


class _OffloadedShard(torch.nn.Parameter):
    """Stands for an FSDP2 DTensor parameter with CPUOffloadPolicy: the local shard on the CPU,
    the mesh on CUDA (``DTensor.device_mesh.device_type``)."""

    device_mesh = SimpleNamespace(device_type="cuda")


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA available but not initialised, current device 1; returns the devices that
    ``torch.cuda.memory_stats`` was asked for."""
    asked: list = []

    def memory_stats_of(device=None):
        asked.append(device)
        return dict(_FAKE_STATS)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats_of)
    return asked


def _expected_cuda_row() -> dict[str, float]:
    # independent of CUDA_STATS' conversion: the torch names of the docstring's table
    names = {
        "allocated_gb": "allocated_bytes.all.current",
        "active_gb": "active_bytes.all.current",
        "inactive_gb": "inactive_split_bytes.all.current",
        "reserved_gb": "reserved_bytes.all.current",
        "peak_allocated_gb": "allocated_bytes.all.peak",
        "peak_active_gb": "active_bytes.all.peak",
        "peak_inactive_gb": "inactive_split_bytes.all.peak",
        "peak_reserved_gb": "reserved_bytes.all.peak",
    }
    row = {f"memory/{k}": _FAKE_STATS[v] / 1e9 for k, v in names.items()}
    row["memory/alloc_retries"] = 3.0
    row["memory/ooms"] = 2.0
    assert set(row) == {f"memory/{k}" for k in memory_stats.CUDA_STATS}
    return row


def _run_loop(model: torch.nn.Module, steps: int = 3) -> RecordingWriter:
    from trainvitals.adapters.loop import Vitals

    writer = RecordingWriter()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    vitals = Vitals([MemoryMonitor(host=False)], writer=writer, log_every_n_steps=2)
    vitals.attach(model, opt)
    ids = torch.tensor([[0, 1, 2]])
    for _ in range(steps):
        vitals.batch({"input_ids": ids})
        model.embed(ids).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    return writer


class _EmbeddingFirst(torch.nn.Module):
    def __init__(self, second: torch.nn.Parameter) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4, 2)  # the first parameter, kept on the CPU
        self.head = torch.nn.Module()
        self.head.weight = second


def test_cpu_embedding_first_and_a_parameter_on_cuda_reads_that_device(fake_cuda):
    model = _EmbeddingFirst(_CudaParameter(torch.zeros(2, 2), requires_grad=False))
    assert next(model.parameters()).device.type == "cpu"
    writer = _run_loop(model)
    assert sorted(writer.rows) == [0, 2]
    for row in writer.rows.values():
        assert row == pytest.approx(_expected_cuda_row(), rel=1e-15)
    assert fake_cuda == [torch.device("cuda", 0)] * 2  # one reading per logging step


def test_fsdp2_cpu_offload_reads_the_current_cuda_device(fake_cuda):
    model = _EmbeddingFirst(_OffloadedShard(torch.zeros(2, 2), requires_grad=False))
    assert all(p.device.type == "cpu" for p in model.parameters())
    writer = _run_loop(model)
    assert writer.rows[2] == pytest.approx(_expected_cuda_row(), rel=1e-15)
    assert fake_cuda == [torch.device("cuda", 1)] * 2


def test_cuda_initialised_with_the_model_on_cpu_reads_the_current_device(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    writer = _run_loop(_EmbeddingFirst(torch.nn.Parameter(torch.zeros(2, 2))))
    assert writer.rows[0] == pytest.approx(_expected_cuda_row(), rel=1e-15)
    assert fake_cuda == [torch.device("cuda", 1)] * 2


def test_lightning_root_device_decides_with_the_model_on_cpu(fake_cuda):
    writer = RecordingWriter()
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    ctx = RunContext(
        writer=writer,
        groups=ProcessGroups(),
        model=torch.nn.Linear(2, 2),
        log_every_n_steps=1,
        trainer=trainer,
    )
    monitor = MemoryMonitor(host=False)
    monitor.run_start(ctx)
    monitor.step_end(ctx)
    assert writer.rows[0] == pytest.approx(_expected_cuda_row(), rel=1e-15)
    assert fake_cuda == [torch.device("cuda", 0)]


def test_cuda_available_but_unused_writes_no_cuda_key(fake_cuda):
    # CUDA present on the machine, the run on the CPU: host keys only, the allocator untouched
    from trainvitals.adapters.loop import Vitals

    model = _EmbeddingFirst(torch.nn.Parameter(torch.zeros(2, 2)))
    writer = RecordingWriter()
    vitals = Vitals([MemoryMonitor()], writer=writer, log_every_n_steps=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals.attach(model, opt)
    vitals.batch({"input_ids": torch.tensor([[0, 1]])})
    model.embed(torch.tensor([[0, 1]])).sum().backward()
    opt.step()
    vitals.close()
    assert set(writer.rows[0]) == {"memory/rss_gb", "memory/peak_rss_gb"}
    assert fake_cuda == []
