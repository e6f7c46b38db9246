"""Two pipeline stages of different size, ``measure_flops=True``, a checkpoint, a resume.

Run under torchrun on 2 CPU ranks (gloo): ``throughput_audit19_pp_resume.py OUT_DIR``. Stage 0
is ``Linear(3, 4)`` and reports token ids; stage 1 is ``Linear(4, 64)`` and reports its
micro-batches without token ids (``stage1=samples``) or with a token count (``stage1=tokens``).
Each rank measures its own flops, the checkpoint keeps rank 0's copy of the state (restored on
both ranks, as Lightning and Accelerate do), and the run goes on. Writes
``OUT_DIR/rank{r}.json``: the written rows and the measured figures before and after. Then
both ranks train one data stream each with ``flops_per_token`` given, and rank 0 writes the
checkpoint's state to ``OUT_DIR/given_state.json`` (the test resumes it on one process).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.scripts.vitals_testing import FakeClock, RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor
from trainvitals.distributed import ProcessGroups

SEQ = 5
DIMS = ((3, 4), (4, 64))


def batch_size(step: int) -> int:
    return 2 + step % 3


def run(stage, groups, mode, steps, clock, state=None):
    torch.manual_seed(stage)
    model = torch.nn.Linear(*DIMS[stage])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if mode == "given":
        monitor = ThroughputMonitor(window_size=3, clock=clock, flops_per_token=10.0)
    else:
        monitor = ThroughputMonitor(window_size=2, clock=clock, measure_flops=True, peak_flops=1e3)
    writer = RecordingWriter()
    with Vitals([monitor], writer=writer, groups=groups, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        if state is not None:
            vitals.load_state_dict(state)
        for step in steps:
            bs = batch_size(step)
            x = torch.randn(bs, DIMS[stage][0])
            if stage == 0 or mode == "given":
                vitals.batch({"input_ids": torch.zeros(bs, SEQ, dtype=torch.long), "x": x})
            elif mode == "tokens":
                vitals.batch(x, num_tokens=bs * SEQ)
            else:
                vitals.batch(x)  # samples only: no token ids on a later stage
            clock.t += 1.0 + 0.25 * step
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        state = vitals.state_dict()  # collective: on every rank
    return writer.rows, state, monitor._measured


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    groups = ProcessGroups.from_device_mesh(mesh)
    stage = mesh.get_local_rank("pp")
    result = {}
    for mode in ("samples", "tokens"):
        rows, state, before = run(stage, groups, mode, range(4), FakeClock())
        saved = [state]
        dist.broadcast_object_list(saved, src=0)  # the checkpoint keeps rank 0's copy
        resumed, _, after = run(stage, groups, mode, range(4, 10), FakeClock(), saved[0])
        result[mode] = {
            "rows": {str(k): v for k, v in {**rows, **resumed}.items()},
            "measured_before": list(before),
            "measured_after": list(after) if after is not None else None,
        }
    with open(f"{out_dir}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    # two data streams (no pipeline: every rank is its own data-parallel rank)
    _, state, _ = run(stage, ProcessGroups(dp=dist.group.WORLD), "given", range(4), FakeClock())
    if dist.get_rank() == 0:
        with open(f"{out_dir}/given_state.json", "w") as f:
            json.dump(state, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
