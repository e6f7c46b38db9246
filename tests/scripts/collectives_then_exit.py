"""Run trainvitals' collectives over gloo and end the script at once, the process group still
alive (held here as a DDP wrapper would hold it), without ``destroy_process_group``.

Usage: torchrun --nproc_per_node 2 tests/scripts/collectives_then_exit.py [plain]

With ``plain`` the same reductions go through ``torch.distributed`` directly: gloo's worker
thread may then still hold the last collective's tensors when the interpreter shuts down, and
the process aborts (SIGABRT, "terminate called without an active exception"); measured here in
about 3 runs of 10. trainvitals' collectives wait for the worker to let go first.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from trainvitals import distributed as tvd

dist.init_process_group("gloo")
group = dist.group.WORLD  # kept alive to the end
rank = dist.get_rank()
for _ in range(3):
    if sys.argv[1:] == ["plain"]:
        t = torch.full((8,), float(rank))
        dist.all_reduce(t, group=group)
        del t
    else:
        tvd.all_reduce_coalesced([torch.full((8,), float(rank))], "sum", group)
        tvd.all_gather_coalesced([torch.tensor([rank])], group)
        tvd.all_gather_objects({"rank": rank}, group)
