"""ThroughputMonitor(measure_flops=True) whose first step is one restored from a checkpoint
taken inside a gradient-accumulation window: the driver tells the callbacks again of the
micro-batches the checkpoint carried (``micro_batch_start`` with ``batch=None``), which this
process does not run. The flops are measured in the next full step, so FLOPs per token and
MFU equal an uninterrupted run's and the model's own count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.scripts.vitals_testing import FakeClock
from trainvitals.adapters import read_jsonl
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor

ACC = 4  # micro-batches per optimizer step
SIZES = [2, 3, 5, 7, 1, 4, 6, 8, 2, 2, 3, 3, 5, 1, 1, 4]  # samples per micro-batch: 4 steps
SEQ = 3  # tokens per sample (passed as num_tokens)
D, H = 8, 16  # Linear(D, H) -> ReLU -> Linear(H, 1)
PEAK = 1e5  # FLOP/s of the (pretend) device, so that MFU is written on CPU
# Independent: flops per sample of one forward and backward (matmuls only, as FlopCounterMode
# counts them): forward 2DH + 2H; backward the weight gradients 2DH + 2H and the hidden
# layer's input gradient 2H (the input needs no gradient).
FLOPS_PER_TOKEN = (4 * D * H + 6 * H) / SEQ


def _driver(run_dir: Path, clock: FakeClock, warmup_steps: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = ThroughputMonitor(
        measure_flops=True,
        peak_flops=PEAK,
        window_size=2,
        warmup_steps=warmup_steps,
        clock=clock,
    )
    vitals = Vitals([monitor], run_dir=run_dir, log_every_n_steps=1).attach(model, optimizer)
    return model, optimizer, vitals


def _train(model, optimizer, vitals, clock: FakeClock, micro_batches: range) -> None:
    for i in micro_batches:
        x = torch.randn(SIZES[i], D)
        vitals.batch(x, num_tokens=SIZES[i] * SEQ)
        clock.t += 0.5 + 0.25 * (i % 3)
        model(x).pow(2).mean().backward()
        if i % ACC == ACC - 1:
            optimizer.step()
            optimizer.zero_grad()


def _flops(run_dir: Path) -> dict[int, dict[str, float]]:
    keys = ("throughput/device/flops_per_sec", "throughput/flops_per_sec", "throughput/mfu")
    return {
        r["step"]: {k: r["metrics"][k] for k in keys if k in r["metrics"]}
        for r in read_jsonl(run_dir / "metrics.jsonl")
    }


@pytest.mark.parametrize("warmup_steps", [1, 0])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_a_first_step_restored_inside_its_window_measures_the_next_full_step(
    tmp_path, split, warmup_steps
):
    """Saved after micro-batch ``split`` of step 0 (nothing measured yet), the restored run's
    first step has ``split`` carried micro-batches: the flop counter started at the first of
    them saw only the micro-batches this process ran, while the step's tokens hold all of
    them (flops per token low by that share: 45/51 of the true count for split 1, 21/51 for
    split 3). Measured in step 1 instead: the uninterrupted run's flops per token, FLOP/s and
    MFU. With ``warmup_steps=0`` the unmeasured step is in the window: its flops are unknown,
    so no flops key is written while it is there (not a low one)."""
    clock = FakeClock()
    model, optimizer, vitals = _driver(tmp_path / "whole", clock, warmup_steps)
    _train(model, optimizer, vitals, clock, range(len(SIZES)))
    vitals.close()
    whole_measured = vitals.state_dict()["callbacks"]["ThroughputMonitor"]["measured"]
    assert whole_measured[0] == "tokens"
    assert whole_measured[1] == pytest.approx(FLOPS_PER_TOKEN, rel=1e-12)

    clock = FakeClock()
    run_dir = tmp_path / "split"
    model, optimizer, vitals = _driver(run_dir, clock, warmup_steps)
    _train(model, optimizer, vitals, clock, range(split))
    state = vitals.state_dict()
    vitals.close()  # the process ends here
    assert state["callbacks"]["ThroughputMonitor"]["measured"] is None
    assert len(state["micro_batches_in_step"]) == split
    model, optimizer, vitals = _driver(run_dir, clock, warmup_steps)
    vitals.load_state_dict(state)
    _train(model, optimizer, vitals, clock, range(split, len(SIZES)))
    vitals.close()
    measured = vitals.state_dict()["callbacks"]["ThroughputMonitor"]["measured"]
    assert measured[0] == "tokens"
    assert measured[1] == pytest.approx(FLOPS_PER_TOKEN, rel=1e-12)

    whole, restored = _flops(tmp_path / "whole"), _flops(run_dir)
    last = len(SIZES) // ACC - 1
    # the window (2 steps) holds steps 2 and 3 in both runs: the same tokens and seconds
    for step in (2, last):
        assert restored[step] == pytest.approx(whole[step], rel=1e-12), step
        assert restored[step]["throughput/mfu"] == pytest.approx(
            restored[step]["throughput/flops_per_sec"] / PEAK, rel=1e-12
        )
    if warmup_steps == 0:
        # step 0 (restored, not measured) is in the windows of steps 0 and 1
        assert restored[0] == restored[1] == {}
        assert (
            set(whole[0])
            == set(whole[1])
            == {
                "throughput/device/flops_per_sec",
                "throughput/flops_per_sec",
                "throughput/mfu",
            }
        )
