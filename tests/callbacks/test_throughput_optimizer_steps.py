"""ThroughputMonitor: ``throughput/seconds_per_step`` counts optimizer steps, also when one batch
steps several optimizers (Lightning's manual optimization) and after restoring a window."""

from __future__ import annotations

import pytest
import torch

from tests.scripts.vitals_testing import (
    FakeClock,
    RecordingWriter,
    manual_optimization_module,
    quiet_trainer,
)
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor


@pytest.mark.parametrize("optimizers", [1, 2])
def test_seconds_per_step_is_per_optimizer_step_under_manual_optimization(tmp_path, optimizers):
    """A GAN-shaped module steps ``optimizers`` optimizers per batch; Lightning's global_step
    (the step axis, max_steps, RuntimeMonitor's time/seconds_per_step) counts each of them.
    The key said per optimizer step but was the time per batch: twice too long with two."""
    clock = FakeClock()
    writer = RecordingWriter()
    seconds_per_batch, batches = 1.5, 6

    def tick(batch_idx: int) -> None:
        clock.t += seconds_per_batch

    module = manual_optimization_module(
        [torch.nn.Linear(3, 1) for _ in range(optimizers)], 2 * batches, on_batch=tick
    )
    throughput = ThroughputMonitor(window_size=3, clock=clock, writer=writer)
    runtime = RuntimeMonitor(clock=clock, writer=writer)
    trainer = quiet_trainer(
        callbacks=[throughput, runtime],
        max_epochs=1,
        default_root_dir=str(tmp_path),
        log_every_n_steps=1,
    )
    trainer.fit(module)
    assert trainer.global_step == optimizers * batches
    per_step = writer.key("throughput/seconds_per_step")
    # every batch after the warm-up one (batch 0) is logged at its first optimizer step
    assert sorted(per_step) == [optimizers * b for b in range(1, batches)]
    expected = seconds_per_batch / optimizers  # independent: batch time over its steps
    for step, value in per_step.items():
        assert value == pytest.approx(expected, rel=1e-12), step
        # the same meaning as RuntimeMonitor's key of the same name
        assert writer.rows[step]["time/seconds_per_step"] == pytest.approx(value, rel=1e-12)


def test_restored_window_keeps_its_optimizer_steps_and_loads_older_records():
    """A record saved with two optimizer steps restores as two; a record saved before records
    carried their steps (8 values) restores as one step."""
    clock = FakeClock()
    writer = RecordingWriter()
    monitor = ThroughputMonitor(window_size=4, clock=clock, writer=writer, log_every_n_steps=1)
    seconds_two, seconds_old = 3.0, 2.0
    state = {
        "window": {
            "size": 4,
            # seconds, batches, samples, tokens, 3 x missing, flops[, steps]
            "records": [
                [seconds_two, 1, 2, 0, 0, 0, 1, 0.0, 2],
                [seconds_old, 1, 2, 0, 0, 0, 1, 0.0],
            ],
            "globals": [[1, 2, 0, 0, 0, 1, 0.0], [1, 2, 0, 0, 0, 1, 0.0]],
        },
        "totals": {"steps": 3, "batches": 2, "samples": 4, "tokens": 0},
        "measured": None,
    }
    monitor.load_state_dict(state)
    assert monitor._window.sums().steps == 3
    saved = monitor.state_dict()["window"]["records"]
    assert [r[-1] for r in saved] == [2, 1]
    from trainvitals.adapters.loop import Vitals

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Vitals([monitor], writer=writer, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        for _ in range(2):  # warm-up step, then one step of 4 s
            x = torch.randn(2, 3)
            vitals.batch(x)
            clock.t += 4.0
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    # window: the two restored records (3 steps) and the 4 s step after the warm-up one
    assert writer.rows[1]["throughput/seconds_per_step"] == pytest.approx(
        (seconds_two + seconds_old + 4.0) / 4, rel=1e-12
    )
