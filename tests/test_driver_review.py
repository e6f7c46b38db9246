"""Review of the Vitals driver's checkpoint inside an accumulation window and of its
``accelerator.end_training()`` wrapper: numpy micro-batch sizes in the checkpoint, and an
``end_training()`` inside ``except StopIteration`` (a loop that ran out of batches)."""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor

ACC = 4
SIZES = [2, 3, 5, 7, 2, 3, 5, 7]  # two optimizer steps of ACC micro-batches
SEQ = 3


def _plain(run_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals = Vitals(
        [ThroughputMonitor()], run_dir=run_dir, log_every_n_steps=1, accumulate_grad_batches=ACC
    )
    vitals.attach(model, optimizer)
    return vitals, model, optimizer


def _train(vitals, model, optimizer, micro_batches: range) -> None:
    for i in micro_batches:
        x = torch.randn(SIZES[i], 4)
        # sizes as numpy scalars (read off a numpy mask or array, say)
        vitals.batch(x, batch_size=np.int64(SIZES[i]), num_tokens=np.int32(SIZES[i] * SEQ))
        model(x).pow(2).mean().backward()
        if (i + 1) % ACC == 0:
            optimizer.step()
            optimizer.zero_grad()


def test_a_window_checkpoint_with_numpy_sizes_loads_with_weights_only(tmp_path) -> None:
    """Saved after micro-batch 6 (2 of step 1), the checkpoint is plain Python data: the
    default ``torch.load`` (``weights_only=True``) reads it, and the restored run counts what
    an uninterrupted one does."""
    vitals, model, optimizer = _plain(tmp_path / "a")
    _train(vitals, model, optimizer, range(6))
    buffer = io.BytesIO()
    torch.save(vitals.state_dict(), buffer)
    vitals.close()
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    carried = state["micro_batches_in_step"]
    assert carried == [{"ThroughputMonitor": [2, 6]}, {"ThroughputMonitor": [3, 9]}]
    assert all(type(n) is int for sizes in carried for n in sizes["ThroughputMonitor"])

    vitals, model, optimizer = _plain(tmp_path / "a")
    vitals.load_state_dict(state)
    _train(vitals, model, optimizer, range(6, len(SIZES)))
    vitals.close()
    totals = vitals.state_dict()["callbacks"]["ThroughputMonitor"]["totals"]
    assert totals == {
        "steps": float(len(SIZES) // ACC),
        "batches": float(len(SIZES)),
        "samples": float(sum(SIZES)),
        "tokens": float(SEQ * sum(SIZES)),
    }


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


class _Hooks(ThroughputMonitor):
    """Records how the run ended."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: list[str] = []

    def run_end(self, ctx) -> None:
        self.ends.append("run_end")
        super().run_end(ctx)

    def exception_raised(self, ctx, exception: BaseException) -> None:
        self.ends.append(type(exception).__name__)


@pytest.mark.parametrize(
    ("handled", "expected"),
    [(StopIteration, ["run_end"]), (RuntimeError, ["RuntimeError"])],
    ids=["stop-iteration", "runtime-error"],
)
def test_end_training_inside_except_stop_iteration_is_a_normal_end(
    tmp_path, fresh_accelerate_state, handled, expected
) -> None:
    """A loop pulling batches with ``next()`` that calls ``accelerator.end_training()`` in its
    ``except StopIteration:`` ended normally: the callbacks get ``run_end`` (a real error being
    handled there still ends the run as failed)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    hooks = _Hooks()
    vitals = Vitals([hooks], accelerator=accelerator, run_dir=tmp_path, log_every_n_steps=1)
    vitals.attach(model, optimizer)
    batches = iter([torch.randn(2, 4), torch.randn(3, 4)])
    while True:
        try:
            if handled is RuntimeError and vitals.step == 2:
                raise RuntimeError("a failure the loop handles by ending the run")
            x = next(batches)
        except handled:
            accelerator.end_training()
            break
        vitals.batch(x)
        accelerator.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
    assert vitals.step == 2
    assert hooks.ends == expected
    assert "end_training" not in vars(accelerator)  # the wrapper is gone after close
