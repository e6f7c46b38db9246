"""ProcessGroups.from_accelerator under Accelerate's DeepSpeed sequence parallelism
(``ParallelismConfig(sp_size=N)``, Ulysses/ALST), for which Accelerate builds no device mesh.

Each sp rank holds a part of the same samples' sequences: sample counts must be summed over
``dp`` without the sp ranks, token counts over ``dp_cp`` with them. Expected members are
computed here from the row-major layout (data parallel, sp, tp) of the ranks.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest

from tests.helpers.dist import run_distributed
from trainvitals.distributed import ProcessGroups

pytest.importorskip("accelerate.parallelism_config")

FIELDS = ("dp", "tp", "pp", "ep", "cp", "dp_cp", "edp")
SAMPLES_PER_RANK = 3  # each rank's batch: 3 samples, sequences of 8 tokens split over sp
SEQ_LEN = 8

# ParallelismConfig kwargs -> (sp, tp) on 4 ranks
CASES = {
    "sp2": {"sp_size": 2},
    "sp4": {"sp_size": 4},
    "shard2_sp2": {"dp_shard_size": 2, "sp_size": 2},
    "sp2_tp2": {"sp_size": 2, "tp_size": 2},
}


def _along(shape: tuple[int, ...], rank: int, dims: list[int]) -> list[int] | None:
    """The ranks differing from ``rank`` only in ``dims`` of a row-major layout; ``None`` for
    a group of this rank alone."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    coord = [(rank // strides[i]) % shape[i] for i in range(len(shape))]
    out = []
    for values in itertools.product(*(range(shape[d]) for d in dims)):
        c = list(coord)
        for d, v in zip(dims, values, strict=True):
            c[d] = v
        out.append(sum(ci * si for ci, si in zip(c, strides, strict=True)))
    return None if len(out) == 1 else sorted(out)


def _body(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from accelerate.parallelism_config import ParallelismConfig

    def members(group) -> list[int] | None:
        return None if group is None else sorted(dist.get_process_group_ranks(group))

    def total(value: int, group) -> int:
        t = torch.tensor([value])
        if group is not None:
            dist.all_reduce(t, group=group)
        return int(t.item())

    out: dict = {}
    for key, sizes in CASES.items():
        config = ParallelismConfig(**sizes)
        mesh = config.build_device_mesh("cpu")  # what Accelerator sets as torch_device_mesh
        accelerator = SimpleNamespace(
            torch_device_mesh=mesh, num_processes=world_size, parallelism_config=config
        )
        groups = ProcessGroups.from_accelerator(accelerator)
        sp = sizes["sp_size"]
        tp = sizes.get("tp_size", 1)
        # this rank holds 1/sp of the tokens of its data-parallel replica's batch
        replica = rank // (sp * tp)
        out[key] = {
            "mesh_built": mesh is not None,
            "groups": {name: members(getattr(groups, name)) for name in FIELDS},
            "replica": replica,
            "samples": total(SAMPLES_PER_RANK, groups.dp),
            "tokens": total(SAMPLES_PER_RANK * SEQ_LEN // sp, groups.dp_cp),
        }
    try:
        ProcessGroups.from_accelerator(
            SimpleNamespace(
                torch_device_mesh=None,
                num_processes=world_size,
                parallelism_config=ParallelismConfig(sp_size=3),
            )
        )
        out["bad"] = "no error"
    except ValueError as exc:
        out["bad"] = str(exc)
    return out


def test_from_accelerator_deepspeed_sp_on_four_ranks():
    world = 4
    results = run_distributed(_body, world, timeout=180)
    for key, sizes in CASES.items():
        sp, tp = sizes["sp_size"], sizes.get("tp_size", 1)
        shape = (world // (sp * tp), sp, tp)
        replicas = {results[r][key]["replica"] for r in range(world)}
        for rank in range(world):
            res = results[rank][key]
            assert res["mesh_built"] is False, key  # Accelerate skips the mesh under DS SP
            expected = {
                "dp": _along(shape, rank, [0]),
                "cp": _along(shape, rank, [1]),
                "tp": _along(shape, rank, [2]),
                "dp_cp": _along(shape, rank, [0, 1]),
                "pp": None,
                "ep": None,
                "edp": None,
            }
            assert res["groups"] == expected, (key, rank)
            # every distinct batch counted once; tokens: every sp shard of every batch
            assert res["samples"] == SAMPLES_PER_RANK * len(replicas), (key, rank)
            assert res["tokens"] == SAMPLES_PER_RANK * SEQ_LEN * len(replicas), (key, rank)
    for rank in range(world):
        assert "sp_size=3" in results[rank]["bad"]
