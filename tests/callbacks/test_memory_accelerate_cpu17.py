"""MemoryMonitor under the driver with a real ``Accelerator``: the accelerator's device is the
run's declared device, as Lightning's ``root_device`` is. ``Accelerator(cpu=True)`` in a
process where other code initialised CUDA writes no CUDA key (it read the current CUDA
device). No GPU here: the CUDA API is faked after the Accelerator is made, and the device
each ``torch.cuda.memory_stats`` call asks for is recorded."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fake_cuda import CudaParameter, expected_cuda_row, fake_cuda_api
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.callbacks.memory_monitor import MemoryMonitor

_HOST_KEYS = {"memory/rss_gb", "memory/peak_rss_gb"}


class _Model(torch.nn.Module):
    def __init__(self, extra: torch.nn.Parameter | None = None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        if extra is not None:
            self.extra = extra  # not trained, only looked at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.fixture
def accelerator():
    """A real ``Accelerator(cpu=True)`` in a fresh Accelerate state, reset afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    reset()
    try:
        yield Accelerator(cpu=True)
    finally:
        reset()


@pytest.fixture
def cuda_initialised_elsewhere(monkeypatch):
    """CUDA available and initialised by other code of the process, current device 1 (set
    after the Accelerator is made); returns the devices ``memory_stats`` was asked for."""
    return fake_cuda_api(monkeypatch, initialised=True)


def _run(accelerator, model: torch.nn.Module, steps: int = 3) -> RecordingWriter:
    from trainvitals.adapters.loop import Vitals

    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    writer = RecordingWriter()
    vitals = Vitals([MemoryMonitor()], writer=writer, accelerator=accelerator, log_every_n_steps=2)
    vitals.attach(model, optimizer)
    x = torch.arange(6.0).reshape(2, 3)
    for _ in range(steps):
        vitals.batch(x)
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    vitals.close()
    return writer


def test_accelerator_cpu_with_cuda_initialised_elsewhere_writes_no_cuda_key(
    accelerator, cuda_initialised_elsewhere
):
    assert accelerator.device == torch.device("cpu")
    writer = _run(accelerator, _Model())
    assert sorted(writer.rows) == [0, 2]
    for row in writer.rows.values():
        # host keys only: the run computes on the CPU, CUDA is someone else's
        assert set(row) == _HOST_KEYS
    assert cuda_initialised_elsewhere == []  # the allocator was never read


def test_accelerator_cpu_with_a_model_tensor_on_cuda_reads_that_device(
    accelerator, cuda_initialised_elsewhere
):
    # the declared device does not hide a model tensor that is on CUDA
    model = _Model(CudaParameter(torch.zeros(2), requires_grad=False))
    writer = _run(accelerator, model)
    for row in writer.rows.values():
        assert {k: v for k, v in row.items() if k not in _HOST_KEYS} == pytest.approx(
            expected_cuda_row(), rel=1e-15
        )
        assert set(row) >= _HOST_KEYS
    assert cuda_initialised_elsewhere == [torch.device("cuda", 0)] * 2  # steps 0 and 2


def test_accelerator_on_cuda_with_the_model_on_cpu_reads_the_accelerators_device(
    accelerator, cuda_initialised_elsewhere
):
    # An Accelerator on cuda:0 (its state says so: accelerator.device is the shared state's
    # device) with the model left on the CPU (device_placement=False, moved per layer): the
    # declared device, not the process's current device (1).
    from accelerate.state import AcceleratorState

    from trainvitals.adapters.loop import Vitals

    # (the accelerator fixture's reset clears the state afterwards)
    AcceleratorState._shared_state["device"] = torch.device("cuda", 0)
    assert accelerator.device == torch.device("cuda", 0)
    model = _Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    vitals = Vitals([MemoryMonitor(host=False)], writer=writer, accelerator=accelerator)
    vitals.attach(model, optimizer)  # not prepared: prepare() would move it to the fake GPU
    x = torch.ones(2, 3)
    vitals.batch(x)
    model(x).sum().backward()
    optimizer.step()
    vitals.close()
    assert writer.rows[0] == pytest.approx(expected_cuda_row(), rel=1e-15)
    assert cuda_initialised_elsewhere == [torch.device("cuda", 0)]
