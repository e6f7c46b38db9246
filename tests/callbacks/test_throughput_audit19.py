"""ThroughputMonitor audit 19: measured flops of model-parallel ranks across a resume.

A checkpoint keeps one copy of a callback's state (rank 0's) and restores it on every rank.
Measured flops per unit are each rank's own: pipeline stages (and tensor/expert-parallel ranks
of uneven work) measure different figures, so every rank's travels in the state.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import torchrun
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor

SCRIPT = Path(__file__).parents[1] / "scripts" / "throughput_audit19_pp_resume.py"
DIMS = ((3, 4), (4, 64))  # the script's two stages
SEQ = 5
# per sample: the forward and the weight gradient of each stage's Linear (no input gradient)
STAGE_FLOPS_PER_SAMPLE = tuple(2 * (2 * i * o) for i, o in DIMS)
PEAK = 1e3


def _batch_size(step: int) -> int:
    return 2 + step % 3


def _seconds(step: int) -> float:
    return 1.0 + 0.25 * step


def _window(step: int) -> list[int]:
    """Steps in the window (size 2) written at ``step``: warm-up steps 0 and 4 (the first of
    each run) are left out; the resume at step 4 restores steps 2 and 3."""
    kept = [s for s in range(step + 1) if s not in (0, 4)]
    return kept[-2:]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """The script's output folder (one torchrun for the tests of this module)."""
    out = tmp_path_factory.mktemp("throughput_audit19")
    torchrun(SCRIPT, str(out))
    return out


@pytest.mark.timeout(240)
def test_each_pipeline_stage_restores_its_own_measured_flops(two_rank_run):
    """Before the fix every rank restored rank 0's measured flops per token: with stage 1
    reporting no tokens the flops keys vanished for good after the resume; with stage 1
    counting tokens (16 times stage 0's work per token) flops_per_sec came out 632 instead
    of 1608 at step 5 (rank 0's figure times stage 1's tokens)."""
    tmp_path = two_rank_run
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for mode, stage1_unit in (("tokens", "tokens"), ("samples", "samples")):
        # each stage measured its own figure, and gets it back after the resume
        per_unit = {
            "samples": STAGE_FLOPS_PER_SAMPLE[1],
            "tokens": STAGE_FLOPS_PER_SAMPLE[1] / SEQ,
        }[stage1_unit]
        assert ranks[0][mode]["measured_before"] == ["tokens", STAGE_FLOPS_PER_SAMPLE[0] / SEQ]
        assert ranks[1][mode]["measured_before"] == [stage1_unit, per_unit]
        rows = ranks[0][mode]["rows"]  # rank 0 writes the run's values
        for step in range(1, 10):
            window = _window(step)
            seconds = sum(_seconds(s) for s in window)
            flops = sum(STAGE_FLOPS_PER_SAMPLE) * sum(_batch_size(s) for s in window)
            row = rows[str(step)]
            assert "throughput/flops_per_sec" in row, (mode, step)
            assert row["throughput/flops_per_sec"] == pytest.approx(flops / seconds, rel=1e-12)
            assert row["throughput/mfu"] == pytest.approx(flops / seconds / (2 * PEAK), rel=1e-12)
            # stage 0's own work
            own = STAGE_FLOPS_PER_SAMPLE[0] * sum(_batch_size(s) for s in window)
            assert row["throughput/device/flops_per_sec"] == pytest.approx(own / seconds, rel=1e-12)
        for r in (0, 1):
            assert ranks[r][mode]["measured_after"] == ranks[r][mode]["measured_before"], r


def _restore(by_rank: list) -> ThroughputMonitor:
    monitor = ThroughputMonitor(measure_flops=True)
    state = ThroughputMonitor(measure_flops=True).state_dict()
    state["measured"] = ["tokens", 1.0]  # rank 0's own
    state["measured_by_rank"] = by_rank
    monitor.load_state_dict(state)
    return monitor


def test_a_single_process_checkpoint_holds_its_measured_flops():
    monitor = ThroughputMonitor(measure_flops=True)
    monitor._measured, monitor._measured_seq = ("samples", 96.0), None
    state = monitor.state_dict()
    assert state["measured_by_rank"] == [[2.0, 96.0, 0.0]]
    assert _restore(state["measured_by_rank"])._measured == ("samples", 96.0)


def test_on_another_world_size_differing_measurements_are_measured_again():
    """A checkpoint of two stages restored in one process: no rank of the new layout is known
    to do either stage's work, so nothing is restored (the step is measured again)."""
    stages = [[1.0, 9.6, 5.0], [2.0, 1024.0, 0.0]]
    with pytest.warns(RuntimeWarning, match="differ between its 2 ranks"):
        monitor = _restore(stages)
    assert monitor._measured is None and monitor._measured_seq is None
    # the ranks agree (data parallelism): their one figure is restored
    same = _restore([[1.0, 9.6, 5.0], [1.0, 9.6, 5.0]])
    assert same._measured == ("tokens", 9.6) and math.isclose(same._measured_seq, 5.0)


def test_given_flops_add_no_rows_to_the_checkpoint_collective():
    monitor = ThroughputMonitor(flops_per_token=6.0, window_size=3)
    assert monitor.state_dict()["measured_by_rank"] is None
    assert monitor._measured_slots() == 0


@pytest.mark.timeout(240)
def test_mfu_after_a_resume_on_fewer_devices_counts_each_entry_at_its_own_devices(two_rank_run):
    """Two data-parallel ranks checkpoint, one process resumes. The restored window entries
    hold both ranks' flops (done on 2 devices); dividing them by this run's 1 device wrote
    twice the true MFU at the resume (0.4 where every device ran at 0.2 in the probe), fading
    over a window. MFU is the window's flops over its device-seconds times the peak."""
    from tests.scripts.vitals_testing import FakeClock, RecordingWriter
    from trainvitals.adapters.loop import Vitals

    state = json.loads((two_rank_run / "given_state.json").read_text())
    clock = FakeClock()
    monitor = ThroughputMonitor(window_size=3, clock=clock, flops_per_token=10.0, peak_flops=PEAK)
    model = torch.nn.Linear(3, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = RecordingWriter()
    with Vitals([monitor], writer=writer, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            vitals.load_state_dict(state)
        # taken between steps on 2 ranks (micro_batches_in_step_by_rank [[], []]): nothing
        # carried, so no warning about an accumulation window on another number of ranks
        assert not [w for w in caught if "accumulation window" in str(w.message)]
        for step in range(4, 9):
            bs = _batch_size(step)
            vitals.batch({"input_ids": torch.zeros(bs, SEQ, dtype=torch.long)})
            clock.t += _seconds(step)
            model(torch.randn(bs, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    windows = {4: (1, 2, 3), 5: (2, 3, 5), 6: (3, 5, 6), 7: (5, 6, 7), 8: (6, 7, 8)}
    for step, window in windows.items():
        devices = {s: 2 if s < 4 else 1 for s in window}  # steps 1-3 ran on both ranks
        flops = sum(10.0 * SEQ * _batch_size(s) * devices[s] for s in window)
        capacity = sum(_seconds(s) * devices[s] * PEAK for s in window)
        row = writer.rows[step]
        seconds = sum(_seconds(s) for s in window)
        assert row["throughput/flops_per_sec"] == pytest.approx(flops / seconds, rel=1e-12)
        assert row["throughput/mfu"] == pytest.approx(flops / capacity, rel=1e-12), step
