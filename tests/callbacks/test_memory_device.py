"""MemoryMonitor's choice of the CUDA device to read: the run's compute device, not only the
first parameter's (FSDP2 CPU offload, a CPU embedding table first, Lightning's root device).
No GPU here: the CUDA API is faked and the device each reading asks for is recorded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.fake_cuda import (
    CudaParameter,
    OffloadedShard,
    expected_cuda_row,
    fake_cuda_api,
)
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.context import RunContext
from trainvitals.callbacks.memory_monitor import MemoryMonitor
from trainvitals.distributed import ProcessGroups


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA available but not initialised, current device 1; returns the devices that
    ``torch.cuda.memory_stats`` was asked for."""
    return fake_cuda_api(monkeypatch, initialised=False)


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
    model = _EmbeddingFirst(CudaParameter(torch.zeros(2, 2), requires_grad=False))
    assert next(model.parameters()).device.type == "cpu"
    writer = _run_loop(model)
    assert sorted(writer.rows) == [0, 2]
    for row in writer.rows.values():
        assert row == pytest.approx(expected_cuda_row(), rel=1e-15)
    assert fake_cuda == [torch.device("cuda", 0)] * 2  # one reading per logging step


def test_fsdp2_cpu_offload_reads_the_current_cuda_device(fake_cuda):
    model = _EmbeddingFirst(OffloadedShard(torch.zeros(2, 2), requires_grad=False))
    assert all(p.device.type == "cpu" for p in model.parameters())
    writer = _run_loop(model)
    assert writer.rows[2] == pytest.approx(expected_cuda_row(), rel=1e-15)
    assert fake_cuda == [torch.device("cuda", 1)] * 2


def test_cuda_initialised_with_the_model_on_cpu_reads_the_current_device(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    writer = _run_loop(_EmbeddingFirst(torch.nn.Parameter(torch.zeros(2, 2))))
    assert writer.rows[0] == pytest.approx(expected_cuda_row(), rel=1e-15)
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
    assert writer.rows[0] == pytest.approx(expected_cuda_row(), rel=1e-15)
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
