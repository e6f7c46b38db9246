"""MoEMetricsTracker under context parallelism, on 2 gloo ranks (a ``("dp", "cp")`` mesh of
shape ``(1, 2)``): the context-parallel ranks route different tokens of the same sequences, so
a metric each computes on its own tokens is averaged over the data x context parallel ranks,
and a metric whose shares are summed over ``cp`` first (Megatron's ``reduce_group``) keeps that
sum; both against a float64 computation on every rank's values."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.dist import run_distributed

NUM_LAYERS = 3
MICRO = 2


def _value(rank: int, name: str, layer: int, micro: int) -> float:
    return 0.2 + 0.41 * rank + 0.13 * layer + 0.07 * micro + 0.3 * len(name)


def _cp_body(rank: int, world_size: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from trainvitals.distributed import ProcessGroups
    from trainvitals.moe import MoEMetricsTracker

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    groups = ProcessGroups.from_device_mesh(mesh)
    tracker = MoEMetricsTracker()
    for micro in range(MICRO):
        for layer in range(1, NUM_LAYERS + 1):
            # computed on this rank's tokens only (TopKRouter, a Hugging Face router)
            v = torch.tensor(_value(rank, "load_balancing_loss", layer, micro))
            tracker.record("load_balancing_loss", v, layer, NUM_LAYERS)
            # this rank's share of the sequence's loss, summed over cp (Megatron's tp_cp)
            v = torch.tensor(_value(rank, "z_loss", layer, micro))
            tracker.record("z_loss", v, layer, NUM_LAYERS, reduce_group=groups.cp)
    rows: dict[str, float] = {}

    class W:
        def add_scalars(self, mapping, step):
            rows.update(mapping)

    tracker.report(1 / MICRO, 0, W(), per_layer_logging=True, groups=groups)
    return {"rows": rows}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_cp_body, 2, timeout=120)


def test_context_parallel_ranks_are_averaged_and_cp_sums_kept(results) -> None:
    ranks = range(2)
    for name, combine in (("load_balancing_loss", np.mean), ("z_loss", np.sum)):
        per_layer = np.array(
            [
                combine([np.mean([_value(r, name, layer, m) for m in range(MICRO)]) for r in ranks])
                for layer in range(1, NUM_LAYERS + 1)
            ],
            dtype=np.float64,
        )
        for r in ranks:  # every rank holds the same reduced values
            rows = results[r]["rows"]
            np.testing.assert_allclose(rows[f"moe/{name}"], per_layer.mean(), rtol=1e-6)
            for i in range(NUM_LAYERS):
                np.testing.assert_allclose(
                    rows[f"moe/{name}_layer_{i}"], per_layer[i], rtol=1e-6, err_msg=f"{r} {i}"
                )
