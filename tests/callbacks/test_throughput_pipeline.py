"""ThroughputMonitor under pipeline parallelism: a later stage sees activations, not tokens.

Two gloo processes on a ``("pp",)`` mesh of two stages, one data stream. Stage 0 reports its
batch (``input_ids``); stage 1 reports its micro-batches without a batch, so it has no token
count. The global flops and MFU must be the model's flops of the stream's tokens (given
``flops_per_token``), or the sum of both stages' measured flops; a step whose flops some stage
could not count leaves them out instead of writing a sum that is low.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.scripts.vitals_testing import FakeClock, RecordingWriter, batch_size, dt
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor

SEQ = 5
STEPS = 8
FLOPS_PER_TOKEN = 10.0
PEAK = 1e3
# Per sample, forward + weight gradient of each stage's Linear (inputs need no gradient):
# stage 0 Linear(3, 4): 2 * (2*3*4); stage 1 Linear(4, 2): 2 * (2*4*2).
STAGE_FLOPS_PER_SAMPLE = (2 * 2 * 3 * 4, 2 * 2 * 4 * 2)
UNCOUNTED_STEP = 3  # stage 1 reports a micro-batch without any count in this step (measured run)


def _run(stage: int, groups, monitor: ThroughputMonitor, clock: FakeClock, measured: bool):
    torch.manual_seed(stage)
    model = torch.nn.Linear(3, 4) if stage == 0 else torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = RecordingWriter()
    with Vitals([monitor], writer=writer, groups=groups, log_every_n_steps=2) as vitals:
        vitals.attach(model, opt)
        for step in range(STEPS):
            bs = batch_size(step, 0)  # one data stream: both stages see the same samples
            if stage == 0:
                x = torch.randn(bs, 3)
                vitals.batch({"input_ids": torch.zeros(bs, SEQ, dtype=torch.long), "x": x})
            else:
                x = torch.randn(bs, 4)  # the previous stage's activations
                if measured and step == UNCOUNTED_STEP:
                    vitals.batch()  # nothing to count from
                else:
                    vitals.batch(x)  # samples known, tokens not (no integer 2-d tensor)
            clock.t += dt(step, 0)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return writer.rows


def _pipeline_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from trainvitals.distributed import ProcessGroups

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    groups = ProcessGroups.from_device_mesh(mesh)
    stage = mesh.get_local_rank("pp")
    out = {}
    clock = FakeClock()
    given = ThroughputMonitor(
        window_size=2, clock=clock, flops_per_token=FLOPS_PER_TOKEN, peak_flops=PEAK
    )
    out["given"] = _run(stage, groups, given, clock, measured=False)
    clock = FakeClock()
    measured = ThroughputMonitor(window_size=2, clock=clock, measure_flops=True, peak_flops=PEAK)
    out["measured"] = _run(stage, groups, measured, clock, measured=True)
    return out


@pytest.mark.timeout(180)
def test_a_later_pipeline_stage_without_tokens_neither_lowers_nor_hides_flops():
    results = run_distributed(_pipeline_body, world_size=2, timeout=150)
    rows = results[0]  # stage 0 writes the run's values
    for step in (2, 4, 6):
        window = (step - 1, step)  # window_size 2, warm-up step 0 left out
        seconds = sum(dt(s, 0) for s in window)
        samples = sum(batch_size(s, 0) for s in window)

        given = rows["given"][step]
        flops_per_sec = FLOPS_PER_TOKEN * SEQ * samples / seconds  # the model's, all tokens
        assert given["throughput/flops_per_sec"] == pytest.approx(flops_per_sec, rel=1e-12)
        assert given["throughput/mfu"] == pytest.approx(flops_per_sec / (2 * PEAK), rel=1e-12)
        # stage 0's own half of the model (the split over the two stages is assumed even)
        assert given["throughput/device/flops_per_sec"] == pytest.approx(
            flops_per_sec / 2, rel=1e-12
        )

        measured = rows["measured"][step]
        if UNCOUNTED_STEP in window:
            # stage 1's flops of that step are unknown: no global figure rather than a low one
            assert "throughput/flops_per_sec" not in measured
            assert "throughput/mfu" not in measured
        else:
            both = sum(STAGE_FLOPS_PER_SAMPLE) * samples / seconds
            assert measured["throughput/flops_per_sec"] == pytest.approx(both, rel=1e-12)
            assert measured["throughput/mfu"] == pytest.approx(both / (2 * PEAK), rel=1e-12)
        assert measured["throughput/device/flops_per_sec"] == pytest.approx(
            STAGE_FLOPS_PER_SAMPLE[0] * samples / seconds, rel=1e-12
        )
    # stage 1 has no token count: it writes no flops from tokens it does not have
    for step, row in results[1]["given"].items():
        assert "throughput/flops_per_sec" not in row, step
        assert "throughput/device/flops_per_sec" not in row, step
