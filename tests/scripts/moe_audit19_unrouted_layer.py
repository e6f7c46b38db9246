"""Two gloo ranks (torchrun, CPU) train a 4-layer TinyMoELM (every layer MoE) under the loop
driver with ``MoEMetricsMonitor(per_layer_logging=True)``, ``log_every_n_steps=1``, 2 optimizer
steps of 2 micro-batches, while some layers are skipped (layer-drop: the block is not run, its
router records nothing).

Usage: ``torchrun --nproc_per_node 2 moe_audit19_unrouted_layer.py OUT CASE``; CASE:

* ``pp``: one pipeline stage per rank (rank 0 blocks 0-1, rank 1 blocks 2-3, global layer
  numbers); at step 1 block 3 is skipped.
* ``dp``: data parallel over both ranks (different tokens per rank); at step 1 block 3 is
  skipped on both ranks and block 2 on rank 0 only.

Writes ``OUT/rank{r}.json``: the rows the monitor wrote (``{step: {key: value}}``) and, per
training forward of a router, ``[step, layer (0-based), router input, router weight]`` for the
test to recompute the losses in float64.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.moe_models import HIDDEN, LOSS_COEFFS, VOCAB, tiny_moe_lm
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import MoEMetricsMonitor
from trainvitals.distributed import ProcessGroups, world_group
from trainvitals.moe import MoEMetricsTracker, TopKRouter, set_moe_metrics_tracker

SKIPPED = {  # (case, rank) -> step -> blocks not run at that step
    ("pp", 0): {},
    ("pp", 1): {1: {3}},
    ("dp", 0): {1: {2, 3}},
    ("dp", 1): {1: {3}},
}


class Blocks(nn.Module):
    """The blocks ``keep`` of ``full`` under their global names; ``skip`` blocks are not run."""

    def __init__(self, full: nn.Module, keep: list[int]) -> None:
        super().__init__()
        self.embed = full.embed
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in keep})
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for name, block in self.layers.items():
            if int(name) not in self.skip:
                h = block(h)
        return h.pow(2).mean()


def record_router_inputs(model: nn.Module, step: list[int]) -> list[list]:
    """``[step, layer, input rows, weight]`` in float64 of each training forward of the model's
    ``TopKRouter``s (``step[0]`` the step being run), for an independent recomputation of
    their losses."""
    seen: list[list] = []
    for module in model.modules():
        if isinstance(module, TopKRouter):

            def hook(mod, args, _out):
                if mod.training and torch.is_grad_enabled():
                    x = args[0].detach().double().reshape(-1, HIDDEN)
                    w = mod.weight.detach().double()
                    seen.append([step[0], mod.layer_number - 1, x.tolist(), w.tolist()])

            module.register_forward_hook(hook)
    return seen


def main() -> None:
    out, case = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    set_moe_metrics_tracker(MoEMetricsTracker())
    full = tiny_moe_lm(0, num_layers=4, moe_layer_freq=[1, 1, 1, 1], **LOSS_COEFFS)
    if case == "pp":
        model = Blocks(full, [0, 1] if rank == 0 else [2, 3])
        groups = ProcessGroups(pp=world_group())
    else:
        model = Blocks(full, [0, 1, 2, 3])
        groups = ProcessGroups(dp=world_group())
    step = [0]
    seen = record_router_inputs(model, step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    monitor = MoEMetricsMonitor(per_layer_logging=True, writer=writer)
    vitals = Vitals([monitor], groups=groups, log_every_n_steps=1)
    vitals.attach(model, opt)
    # the same tokens on both pipeline stages, other tokens per data-parallel rank
    gen = torch.Generator().manual_seed(7 + (rank if case == "dp" else 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for s in range(2):
            step[0] = s
            model.skip = SKIPPED[(case, rank)].get(s, set())
            for _ in range(2):
                x = torch.randint(0, VOCAB, (2, 6), generator=gen)
                vitals.batch(x)
                model(x).backward()
            opt.step()
            opt.zero_grad()
        vitals.close()
    result = {"rows": writer.rows, "seen": seen}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
