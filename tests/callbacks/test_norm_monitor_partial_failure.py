"""A rank-local failure before the Partial-DTensor collective of ``local_sq_norms`` (say, out of
memory) on real gloo processes: every rank still joins that collective, the failing rank raises
after it, the others mark the Partial tensors "not measured" (-inf), and the next call is in
step again with exact values."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.dist import run_distributed

pytestmark = pytest.mark.slow


def _local_part(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))


def _failing_rank_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    import trainvitals.stats.norms as norms
    from trainvitals.stats.norms import local_sq_norms, reduce_sq_norms, sharding_groups

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    original = norms._real_view
    calls = [0]

    def fail_once_on_rank_1(tensor):
        calls[0] += 1
        if rank == 1 and calls[0] == 1:
            raise RuntimeError("simulated out of memory")
        return original(tensor)

    norms._real_view = fail_once_on_rank_1
    out: dict = {"errors": [], "sq": []}
    for step in range(2):
        local = _local_part(rank, step)
        tensors = [
            DTensor.from_local(local, mesh, [Partial()]),  # logical: the sum of the locals
            DTensor.from_local(local, mesh, [Shard(0)]),  # logical: the locals stacked
            local,  # plain: this rank's own tensor
        ]
        try:
            sq = local_sq_norms(tensors)
        except RuntimeError as exc:  # what NormMonitor does: -inf, "not measured"
            out["errors"].append((step, str(exc)))
            sq = torch.full((len(tensors),), -math.inf, dtype=torch.float64)
        out["sq"].append(reduce_sq_norms(sq, [sharding_groups(t) for t in tensors]).tolist())
    return out


def test_a_rank_failing_before_the_partial_collective_keeps_the_ranks_in_step():
    results = run_distributed(_failing_rank_body, 2, timeout=60)
    assert results[0]["errors"] == []
    assert results[1]["errors"] == [(0, "simulated out of memory")]
    # step 0: the Partial sum and the Shard sum lack rank 1's part on every rank: not measured
    assert results[0]["sq"][0][:2] == [-math.inf, -math.inf]
    assert results[1]["sq"][0] == [-math.inf] * 3
    plain0 = float(_local_part(0, 0).double().pow(2).sum())
    assert results[0]["sq"][0][2] == pytest.approx(plain0, rel=1e-6)
    # step 1: in step again, exact against float64
    parts = [_local_part(r, 1).double() for r in range(2)]
    expected = [float((parts[0] + parts[1]).pow(2).sum()), float(torch.cat(parts).pow(2).sum())]
    for rank, res in enumerate(results):
        assert res["sq"][1][:2] == pytest.approx(expected, rel=1e-6)
        assert res["sq"][1][2] == pytest.approx(float(parts[rank].pow(2).sum()), rel=1e-6)
