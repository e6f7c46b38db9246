"""ThroughputMonitor's count reduction: one collective per rank set, not per group object (a
data-parallel group built apart from the world group over the same ranks, as a 1-D device
mesh gives, cost a second all-reduce at every logging step)."""

from __future__ import annotations

import torch

from tests.helpers.dist import run_distributed


def _body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from trainvitals.callbacks.throughput_monitor import count_reduction_calls, reduce_counts
    from trainvitals.distributed import ProcessGroups

    dp = dist.new_group(list(range(world_size)))  # the world's ranks, another object
    groups = ProcessGroups(dp=dp)
    calls = count_reduction_calls(1, groups)
    matrix = torch.arange(7, dtype=torch.float64).reshape(1, 7) * (rank + 1)
    return {"calls": len(calls), "reduced": reduce_counts(matrix, groups).tolist()}


def test_one_collective_for_dp_and_world_of_the_same_ranks() -> None:
    results = run_distributed(_body, world_size=2, timeout=120)
    expected = (torch.arange(7, dtype=torch.float64) * 3).tolist()  # rank factors 1 + 2
    for r in results:
        assert r["calls"] == 1
        assert r["reduced"] == [expected]
