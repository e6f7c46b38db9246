"""ThroughputMonitor on an instance that ran before: a second fit, a retry after a failed step."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from tests.scripts.vitals_testing import FakeClock, RecordingWriter, fit_twice_with_a_gap
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor

# Linear(8,16) -> ReLU -> Linear(16,4), input without grad: forward 2(8*16 + 16*4) per sample;
# backward: layer 2 grad input and grad weight 2 * 2*16*4, layer 1 grad weight 2*8*16.
PER_SAMPLE = 2 * (8 * 16 + 16 * 4) + 2 * 2 * 16 * 4 + 2 * 8 * 16


def _mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_a_second_fit_on_the_same_trainer_does_not_time_the_gap_between_fits():
    clock = FakeClock()
    writer = RecordingWriter()
    monitor = ThroughputMonitor(
        window_size=2, warmup_steps=0, clock=clock, writer=writer, log_every_n_steps=2
    )
    fit_twice_with_a_gap(monitor, clock, seconds_per_step=1.0, gap=500.0)  # 4 samples in 1 s
    assert sorted(writer.rows) == [0, 2, 4, 6]
    # step 4, the second fit's first, is timed from its own first batch: window [3, 4], 2 s
    for step in (0, 2, 4, 6):
        row = writer.rows[step]
        assert row["throughput/samples_per_sec"] == pytest.approx(4.0, rel=1e-12), step
        assert row["throughput/seconds_per_step"] == pytest.approx(1.0, rel=1e-12), step


@pytest.mark.filterwarnings("ignore:.*already ran:RuntimeWarning")
def test_the_warm_up_applies_again_in_a_second_run_of_the_instance():
    clock = FakeClock()
    monitor = ThroughputMonitor(window_size=1, warmup_steps=1, clock=clock)
    model, opt = _mlp()
    writers = []
    for seconds in (1.0, 7.0):
        writer = RecordingWriter()
        writers.append(writer)
        vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
        with vitals:
            for step in range(3):
                x = torch.randn(2, 8)
                vitals.batch(x)
                # the run's first step is slow (compilation, warm-up); later steps 1 s each
                clock.t += seconds if step == 0 else 1.0
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
    # the second run's step 0 (7 s) is its warm-up, left out as the first run's was: at step 0
    # the window still holds the first run's last step
    for step in (0, 1, 2):
        row = writers[1].rows[step]
        assert row["throughput/seconds_per_step"] == pytest.approx(1.0, rel=1e-12), step
        assert row["throughput/samples_per_sec"] == pytest.approx(2.0, rel=1e-12), step


@pytest.mark.filterwarnings("ignore:.*already ran:RuntimeWarning")
def test_a_failed_first_step_leaves_no_partial_flop_measurement():
    clock = FakeClock()
    model, opt = _mlp()
    monitor = ThroughputMonitor(measure_flops=True, clock=clock, peak_flops=1e4, window_size=2)
    vitals = Vitals([monitor], writer=RecordingWriter(), log_every_n_steps=1).attach(model, opt)
    with pytest.raises(RuntimeError, match="out of memory"), vitals:
        x = torch.randn(3, 8)
        vitals.batch(x)
        model(x)
        raise RuntimeError("CUDA out of memory (simulated, in the first backward)")
    # a forward without its backward is not the step's flops: nothing measured yet
    assert monitor._measured is None
    writer = RecordingWriter()
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    with vitals:
        for _ in range(3):
            x = torch.randn(3, 8)
            vitals.batch(x)
            clock.t += 1.0
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    # the retry's first step, complete and without the failed step's micro-batch
    assert monitor._measured == ("samples", float(PER_SAMPLE))
    row = writer.rows[2]
    assert row["throughput/flops_per_sec"] == pytest.approx(3 * PER_SAMPLE, rel=1e-12)
    assert row["throughput/mfu"] == pytest.approx(3 * PER_SAMPLE / 1e4, rel=1e-12)


def test_a_disabled_monitor_leaves_the_flop_counting_mode(monkeypatch):
    monkeypatch.setenv("TRAINVITALS_STRICT", "0")  # the guard disables instead of raising
    model, opt = _mlp()
    # a count the monitor cannot add: micro_batch_start raises after the mode was entered
    monitor = ThroughputMonitor(measure_flops=True, num_tokens_fn=lambda batch: "7")
    vitals = Vitals([monitor], writer=RecordingWriter(), log_every_n_steps=1).attach(model, opt)
    with pytest.warns(RuntimeWarning, match="disabled"), vitals:
        for _ in range(2):
            x = torch.randn(2, 8)
            vitals.batch(x)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            # not left on for the rest of the process (every op through Python)
            assert _get_current_dispatch_mode() is None
