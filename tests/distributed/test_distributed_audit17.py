"""Audit of ProcessGroups and the coalesced collectives (session 17, h12).

* Two equal meshes built separately have different group objects for the same ranks:
  ``all_reduce_by_groups`` merges its tensors per rank set (one collective per distinct set
  of ranks), not per group object.
* A rank outside the mesh passed to ``ProcessGroups.from_device_mesh`` gets a ``ValueError``
  naming it (torch failed deep inside ``get_group`` with an ``IndexError``/``RuntimeError``).

Expected rank sets are written by hand from the row-major mesh layouts.
"""

from __future__ import annotations

from tests.helpers.shared_ranks import SharedRanks
from trainvitals import distributed as tvd

# one set of gloo processes per world size runs every case of this file
# (tests/helpers/shared_ranks.py)
shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()


def _equal_meshes_body(rank: int, world_size: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    b = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # ("tp", "dp"): rank = 2 * tp + dp, so its tp groups are the dp groups of a and b
    c = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    v = float(rank + 1)
    items = [
        (torch.tensor([v]), (a.get_group("dp"),)),
        (torch.tensor([10 * v, 1.0]), (b.get_group("tp"),)),
        (torch.tensor([100 * v]), (b.get_group("dp"),)),
        (torch.tensor(1000 * v), (a.get_group("dp"), b.get_group("tp"))),
        (torch.tensor([v, -v]), (c.get_group("tp"),)),
        (torch.tensor([5 * v]), (a.get_group("tp"), c.get_group("dp"))),  # the same ranks twice
        (torch.tensor([7.0]), ()),
    ]
    out: dict = {}
    for op in ("sum", "max"):
        before = sum(tvd.collective_counter.values())
        out[op] = [r.tolist() for r in tvd.all_reduce_by_groups(items, op)]
        out[f"{op}_collectives"] = sum(tvd.collective_counter.values()) - before
    return out


@shared.on_ranks(4, _equal_meshes_body)
def test_equal_meshes_built_separately_cost_one_collective_per_rank_set(ran):
    _, results = ran
    dp_of = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}  # ("dp", "tp") (2, 2): rank = 2dp + tp
    tp_of = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    val = {r: float(r + 1) for r in range(4)}
    for rank, res in enumerate(results):
        dp_sum = sum(val[r] for r in dp_of[rank])
        tp_sum = sum(val[r] for r in tp_of[rank])
        dp_max = max(val[r] for r in dp_of[rank])
        tp_max = max(val[r] for r in tp_of[rank])
        assert res["sum"] == [
            [dp_sum],
            [10 * tp_sum, 2.0],
            [100 * dp_sum],
            1000 * sum(val.values()),  # over dp, then tp: the world
            [dp_sum, -dp_sum],
            [5 * tp_sum],  # once over the tp ranks, not twice
            [7.0],
        ]
        assert res["max"] == [
            [dp_max],
            [10 * tp_max, 1.0],
            [100 * dp_max],
            4000.0,
            [dp_max, -min(val[r] for r in dp_of[rank])],
            [5 * tp_max],
            [7.0],
        ]
        # two rank sets (dp, tp): one collective each, however many mesh objects hold them
        # (were 5: one per group object)
        assert res["sum_collectives"] == 2
        assert res["max_collectives"] == 2


def _outside_the_mesh_body(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.tensor([[0], [1]]), mesh_dim_names=("dp", "tp"))
    try:
        groups = tvd.ProcessGroups.from_device_mesh(mesh)
    except Exception as exc:
        return {"error": (type(exc).__name__, str(exc))}

    def ranks(g: object) -> list[int] | None:
        return None if g is None else sorted(dist.get_process_group_ranks(g))

    return {"dp": ranks(groups.dp), "dp_cp": ranks(groups.dp_cp), "tp_size": groups.sizes()["tp"]}


@shared.on_ranks(4, _outside_the_mesh_body)
def test_a_rank_outside_the_mesh_gets_a_clear_value_error(ran):
    _, results = ran
    for rank in (0, 1):  # members: dp is ranks 0 and 1, tp one rank
        assert results[rank] == {"dp": [0, 1], "dp_cp": [0, 1], "tp_size": 1}
    for rank in (2, 3):
        kind, message = results[rank]["error"]
        assert kind == "ValueError", (kind, message)
        assert f"rank {rank} is not in the mesh" in message


def _lone_dp_cp_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    loss_mesh = mesh["dp", "cp"]._flatten("dp_cp")  # torchtitan's / Accelerate's dp_cp
    out: dict = {}
    try:
        groups = tvd.ProcessGroups.from_device_mesh(loss_mesh)
        out["alone"] = groups.sizes()
    except ValueError as exc:
        out["alone"] = str(exc)
    groups = tvd.ProcessGroups.from_device_mesh(loss_mesh, mesh)
    out["with_dims"] = {
        name: sorted(dist.get_process_group_ranks(getattr(groups, name)))
        for name in ("dp", "cp", "dp_cp")
    }
    return out


@shared.on_ranks(4, _lone_dp_cp_body)
def test_a_flattened_dp_cp_without_its_dims_is_refused_not_read_as_no_data_parallelism(ran):
    _, results = ran
    for rank, res in enumerate(results):
        # refused on every rank (was dp of one rank: samples counted on one of two dp ranks)
        assert isinstance(res["alone"], str), res["alone"]
        assert "'dp_cp'" in res["alone"] and "data parallel" in res["alone"]
        # ("dp", "cp") (2, 2): rank = 2 dp + cp
        assert res["with_dims"] == {
            "dp": [rank % 2, rank % 2 + 2],
            "cp": [rank - rank % 2, rank - rank % 2 + 1],
            "dp_cp": [0, 1, 2, 3],
        }
