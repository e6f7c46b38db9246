"""ProcessGroups: meshes whose dims come in any order, real Accelerate meshes, and the layout
check of hand-built groups (every group that token sums rely on lies inside ``dp_cp``).

Expected members are computed here from the row-major rank layout of the mesh shape, not with
``DeviceMesh``.
"""

from __future__ import annotations

import itertools
import math

from tests.helpers.shared_ranks import SharedRanks
from trainvitals.distributed import ProcessGroups

# one set of gloo processes per world size runs every case of this file
# (tests/helpers/shared_ranks.py)
shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()

FIELDS = ("dp", "tp", "pp", "ep", "cp", "dp_cp", "edp")


def _along(shape: tuple[int, ...], rank: int, dims: list[int]) -> list[int] | None:
    """The ranks that differ from ``rank`` only in mesh ``dims`` (row-major layout); ``None``
    for no dims (a trivial group)."""
    if not dims:
        return None
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    coord = [(rank // strides[i]) % shape[i] for i in range(len(shape))]
    out = []
    for values in itertools.product(*(range(shape[d]) for d in dims)):
        c = list(coord)
        for d, v in zip(dims, values, strict=True):
            c[d] = v
        out.append(sum(ci * si for ci, si in zip(c, strides, strict=True)))
    return sorted(out)


def _summary(groups: ProcessGroups) -> dict[str, list[int] | None]:
    import torch.distributed as dist

    def ranks(group) -> list[int] | None:
        return None if group is None else sorted(dist.get_process_group_ranks(group))

    return {name: ranks(getattr(groups, name)) for name in FIELDS}


# Meshes whose dims are not in the order the roles are listed in (dp, dp_replicate, dp_shard,
# ep, then cp): slicing a DeviceMesh with its dims out of order raises KeyError.
ORDER_CASES = {
    "ep_dp": ((2, 2), ("ep", "dp")),
    "cp_dp": ((2, 2), ("cp", "dp")),
    "shard_replicate": ((2, 2), ("dp_shard", "dp_replicate")),
    "cp_ep": ((2, 2), ("cp", "ep")),
    "tp_cp_dp": ((1, 2, 2), ("tp", "cp", "dp")),
    "dp_cp_ep": ((2, 2, 1), ("dp", "cp", "ep")),
}

# Accelerate's ParallelismConfig: the mesh it builds (active dims only, with its own flattened
# dp / dp_shard_cp / dp_cp already on the root mesh).
ACCELERATE_CASES = {
    "acc_shard_tp": {"dp_shard_size": 2, "tp_size": 2},
    "acc_replicate_shard": {"dp_replicate_size": 2, "dp_shard_size": 2},
    "acc_shard_cp": {"dp_shard_size": 2, "cp_size": 2},
    "acc_cp_tp": {"cp_size": 2, "tp_size": 2},
    "acc_tp": {"tp_size": 4},
}


def _mesh_order_body(rank: int, world_size: int) -> dict:
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh

    out: dict = {}
    for key, (shape, names) in ORDER_CASES.items():
        try:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            out[key] = _summary(ProcessGroups.from_device_mesh(mesh))
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    try:
        from accelerate.parallelism_config import ParallelismConfig
    except ImportError:
        return out
    for key, sizes in ACCELERATE_CASES.items():
        mesh = ParallelismConfig(**sizes).build_device_mesh("cpu")
        accelerator = SimpleNamespace(torch_device_mesh=mesh, num_processes=world_size)
        out[key] = (
            tuple(mesh.mesh_dim_names),
            _summary(ProcessGroups.from_accelerator(accelerator)),
        )
    return out


def _expected(shape: tuple[int, ...], names: tuple[str, ...], rank: int) -> dict:
    """The groups by the documented rules: dp = the dp/replicate/shard/ep dims, cp = the
    cp/sp dims, dp_cp = both, edp = the data-parallel and cp dims other than ep."""
    idx = {n: i for i, n in enumerate(names)}
    dp = [idx[n] for n in names if n in ("dp", "dp_replicate", "dp_shard", "ep")]
    cp = [idx[n] for n in names if n in ("cp", "sp")]
    one = {n: _along(shape, rank, [idx[n]]) if n in idx else None for n in ("tp", "pp", "ep")}
    edp = None
    if "ep" in idx:
        edp = _along(shape, rank, sorted(d for d in dp + cp if d != idx["ep"]))
    return {
        **one,
        "dp": _along(shape, rank, sorted(dp)),
        "cp": _along(shape, rank, cp),
        "dp_cp": _along(shape, rank, sorted(dp + cp)),
        "edp": edp,
    }


@shared.on_ranks(4, _mesh_order_body)
def test_mesh_dims_in_any_order_and_accelerate_meshes_on_four_ranks(ran):
    _, results = ran
    for rank, res in enumerate(results):
        for key, (shape, names) in ORDER_CASES.items():
            assert res[key] == _expected(shape, names, rank), (key, rank)
        if "acc_tp" not in res:
            continue  # accelerate not installed
        everyone = [0, 1, 2, 3]
        row = [0, 1] if rank < 2 else [2, 3]  # dim 1 of a (2, 2) mesh
        col = [0, 2] if rank % 2 == 0 else [1, 3]  # dim 0
        none = dict.fromkeys(FIELDS)
        assert res["acc_shard_tp"] == (
            ("dp_shard", "tp"),
            {**none, "dp": col, "tp": row, "dp_cp": col},
        )
        assert res["acc_replicate_shard"] == (
            ("dp_replicate", "dp_shard"),
            {**none, "dp": everyone, "dp_cp": everyone},
        )
        assert res["acc_shard_cp"] == (
            ("dp_shard", "cp"),
            {**none, "dp": col, "cp": row, "dp_cp": everyone},
        )
        assert res["acc_cp_tp"] == (("cp", "tp"), {**none, "cp": col, "tp": row, "dp_cp": col})
        assert res["acc_tp"] == (("tp",), {**none, "tp": everyone})


def _hand_built_body(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    world = dist.group.WORLD
    # every rank creates every subgroup, in the same order
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    row, col = rows[rank // 2], cols[rank % 2]
    cases = {
        # the audit's case: LoadBalanceMonitor summed expert loads over this rank alone
        "ep_without_dp": lambda: ProcessGroups(ep=world),
        "ep_outside_dp": lambda: ProcessGroups(dp=col, ep=row),
        # an ep group over ranks that dp_cp leaves out (as MoE parallel folding over tp)
        "ep_outside_dp_cp": lambda: ProcessGroups(dp=col, tp=row, ep=row, dp_cp=col),
        "edp_outside_dp_cp": lambda: ProcessGroups(dp=row, edp=col),
        "dp_outside_dp_cp": lambda: ProcessGroups(dp=world, dp_cp=row),
        "ep_and_edp_overlap": lambda: ProcessGroups(dp=world, ep=row, edp=world),
        # valid layouts
        "dp_ep": lambda: ProcessGroups(dp=world, ep=row, edp=col),
        "ep_is_dp": lambda: ProcessGroups(dp=world, ep=world),
        "dp_cp_ep_over_cp": lambda: ProcessGroups(dp=col, cp=row, dp_cp=world, ep=row, edp=col),
        "dp_tp": lambda: ProcessGroups(dp=col, tp=row),
        "pp_only": lambda: ProcessGroups(pp=world),
    }
    out = {}
    for key, make in cases.items():
        try:
            make()
            out[key] = "ok"
        except ValueError as exc:
            out[key] = str(exc)
    # a collective on the world still pairs up on every rank: nothing above issued one
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = t.item()
    return out


@shared.on_ranks(4, _hand_built_body)
def test_hand_built_groups_must_lie_inside_dp_cp_on_four_ranks(ran):
    _, results = ran
    for rank, res in enumerate(results):
        for key in ("dp_ep", "ep_is_dp", "dp_cp_ep_over_cp", "dp_tp", "pp_only"):
            assert res[key] == "ok", (key, res[key])
        assert "ep (ranks [0, 1, 2, 3]) must lie inside dp_cp" in res["ep_without_dp"]
        assert f"(ranks [{rank}])" in res["ep_without_dp"]
        assert "pass dp" in res["ep_without_dp"]
        assert "ep (ranks" in res["ep_outside_dp"] and "dp_cp" in res["ep_outside_dp"]
        assert "folding" in res["ep_outside_dp_cp"]
        assert res["edp_outside_dp_cp"].startswith("ProcessGroups: edp (ranks")
        assert res["dp_outside_dp_cp"].startswith("ProcessGroups: dp (ranks [0, 1, 2, 3])")
        assert "share ranks" in res["ep_and_edp_overlap"]
        assert res["after"] == 4.0


def test_layout_check_skips_objects_that_are_not_groups_single_process():
    marker = object()
    # not distributed: nothing to look up, every group has one member
    assert ProcessGroups(ep=marker).dp_cp is None


def _sub_mesh_fallback_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    original = DeviceMesh._flatten

    def no_flatten(self, *args, **kwargs):
        raise RuntimeError("no _flatten here")

    DeviceMesh._flatten = no_flatten  # the fallback path (older torch, a name clash)
    try:
        out = {}
        try:
            ProcessGroups.from_device_mesh(mesh["dp_replicate", "dp_shard"])
            out["sub"] = "ok"
        except ValueError as exc:
            out["sub"] = str(exc)
        # the whole mesh: the fallback builds every block's group on every rank
        out["whole"] = _summary(ProcessGroups.from_device_mesh(mesh))
    finally:
        DeviceMesh._flatten = original
    return out


@shared.on_ranks(4, _sub_mesh_fallback_body)
def test_flatten_fallback_refuses_a_sub_mesh_instead_of_hanging(ran):
    # Before: ranks of the two pipeline stages called new_group for different blocks and hung.
    _, results = ran
    for rank, res in enumerate(results):
        assert "sub-mesh" in res["sub"]
        stage = [0, 1] if rank < 2 else [2, 3]
        assert res["whole"]["dp"] == stage == res["whole"]["dp_cp"]
        assert res["whole"]["pp"] == ([0, 2] if rank % 2 == 0 else [1, 3])
