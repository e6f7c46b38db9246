"""TensorStatsMonitor's merge over groups is keyed by rank set: a tensor whose groups name two
group objects over the same ranks (equal meshes built apart, a mesh dim and a ProcessGroups
group) is merged once (twice before: its count and sums doubled), in one all_gather."""

from __future__ import annotations

import torch

from tests.helpers.dist import run_distributed
from tests.stats.test_moments import assert_matches, reference


def _body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from trainvitals.callbacks.tensor_stats_monitor import _Kind, _merge_over_groups
    from trainvitals.distributed import collective_counter
    from trainvitals.stats.moments import fused_moments

    a = dist.new_group([0, 1])
    b = dist.new_group([0, 1])  # the same ranks, another object
    g = torch.Generator().manual_seed(rank)
    x = [torch.randn(5000, generator=g) + rank, torch.randn(300, generator=g)]
    kind = _Kind(names=["x", "y"], moments=fused_moments(x), groups=[(a, b), (b,)])
    before = collective_counter["all_gather"]
    _merge_over_groups([kind])
    return {
        "moments": kind.moments.tolist(),
        "gathers": collective_counter["all_gather"] - before,
    }


def test_two_group_objects_of_one_rank_set_merge_once() -> None:
    from trainvitals.stats.moments import derive

    results = run_distributed(_body, world_size=2, timeout=120)
    full = []
    for i in (0, 1):
        parts = []
        for rank in (0, 1):
            g = torch.Generator().manual_seed(rank)
            x = [torch.randn(5000, generator=g) + rank, torch.randn(300, generator=g)]
            parts.append(x[i])
        full.append(torch.cat(parts))
    for r in results:
        assert r["gathers"] == 1
        got = derive(torch.tensor(r["moments"], dtype=torch.float64))
        for i, t in enumerate(full):
            assert float(got["count"][i]) == t.numel()
            assert_matches(got, i, reference(t), f"tensor {i}")
