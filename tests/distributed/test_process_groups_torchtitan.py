"""ProcessGroups.from_device_mesh on the meshes torchtitan's ParallelDims builds
(torchtitan/distributed/parallel_dims.py), built here the way torchtitan builds them, without
importing torchtitan:

* the single world mesh of its 2025 releases (``init_device_mesh`` over the enabled dims, with
  ``dp_shard`` split into ``dp_shard_mod_ep`` x ``dp_shard_in_ep`` under expert parallelism,
  then ``_flatten`` of ``dp``, ``dp_shard_cp``, ``dp_cp`` and ``ep``);
* the meshes of its later versions, unflattened from a one-dim ``"world"`` mesh:
  dataloading ``(pp, batch, cp, tp)``, ``loss_mesh`` (``batch`` x ``cp`` flattened), dense
  ``(pp, dp_replicate, fsdp, tp)`` and sparse ``(pp, dp_replicate, efsdp, ep)``.

Expected members come from the row-major rank layout: the ranks that agree with this rank on
every coordinate a group keeps fixed. Torchtitan reduces its loss and its expert loads
(``tokens_per_expert``) over ``dp_cp`` / ``loss``: dp_replicate x dp_shard x cp.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

from tests.helpers.dist import run_distributed
from trainvitals.distributed import ProcessGroups

FIELDS = ("dp", "tp", "pp", "ep", "cp", "dp_cp", "edp")


def _coords(rank: int, names: tuple[str, ...], sizes: tuple[int, ...]) -> dict[str, int]:
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
    return {n: (rank // st) % sz for n, st, sz in zip(names, strides, sizes, strict=True)}


def _same(rank: int, world: int, key) -> list[int]:
    return [r for r in range(world) if key(r) == key(rank)]


# The 2025 world mesh: (pp, dp_replicate, dp_shard, cp, tp) degrees, ep and etp.
WORLD_MESH_CASES = {
    4: {
        "hsdp_cp": dict(pp=1, dp_replicate=2, dp_shard=1, cp=2, tp=1, ep=1, etp=1),
        "ep4": dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1, ep=4, etp=1),
        "shard_cp_ep_over_cp": dict(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=2, etp=1),
        "ep_tp_etp_tp": dict(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=2, etp=2),
        "ep_over_tp": dict(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=4, etp=1),
    },
    8: {
        "pp_hsdp_tp": dict(pp=2, dp_replicate=2, dp_shard=1, cp=1, tp=2, ep=1, etp=1),
        "ep_tp_etp_tp": dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2, ep=2, etp=2),
        # ep borrows the tensor-parallel ranks (etp 1)
        "ep_over_tp": dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=2, ep=4, etp=1),
        "hsdp_cp_ep": dict(pp=1, dp_replicate=2, dp_shard=2, cp=2, tp=1, ep=2, etp=1),
        "pp_shard_ep": dict(pp=2, dp_replicate=1, dp_shard=4, cp=1, tp=1, ep=2, etp=1),
    },
}

# The later meshes: (pp, dp_replicate, dp_shard, cp, tp, ep).
UNFLATTENED_CASES = {
    4: {"u_ep4": (1, 1, 4, 1, 1, 4), "u_cp_ep": (1, 1, 2, 2, 1, 2), "u_ep_tp": (1, 1, 2, 1, 2, 4)},
    8: {
        "u_tp_ep": (1, 1, 4, 1, 2, 4),
        "u_ep_over_tp": (1, 1, 4, 1, 2, 8),
        "u_pp_cp_ep": (2, 1, 2, 2, 1, 2),
        "u_hsdp_ep": (1, 2, 2, 1, 2, 2),
    },
}


def _world_mesh(c: dict):
    """torchtitan's ParallelDims.build_mesh of 2025 (with and without ep), as it does it."""
    from torch.distributed.device_mesh import init_device_mesh

    pp, rep, shard, cp = c["pp"], c["dp_replicate"], c["dp_shard"], c["cp"]
    tp, ep, etp = c["tp"], c["ep"], c["etp"]
    if ep > 1:
        if etp == tp:
            mod, inside = shard * cp // ep, ep // cp
        else:
            mod, inside = shard * cp * tp // ep, ep // (cp * tp)
        degrees = [pp, rep, mod, inside, cp, tp]
        names = ["pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp"]
        keep = [
            (d, n) for d, n in zip(degrees, names, strict=True) if d > 1 or n == "dp_shard_mod_ep"
        ]
        mesh = init_device_mesh("cpu", [d for d, _ in keep], mesh_dim_names=[n for _, n in keep])
        active = set(mesh.mesh_dim_names)
        dp = [n for n in ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep") if n in active]
        shard_cp = [n for n in ("dp_shard_mod_ep", "dp_shard_in_ep", "cp") if n in active]
        dp_cp = [
            n for n in ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp") if n in active
        ]
        ep_dims = [n for n in ("dp_shard_in_ep", "cp") if n in active]
        if etp == 1 and tp > 1:
            ep_dims.append("tp")
        mesh[tuple(dp)]._flatten(mesh_dim_name="dp")
        mesh[tuple(shard_cp)]._flatten(mesh_dim_name="dp_shard_cp")
        mesh[tuple(dp_cp)]._flatten(mesh_dim_name="dp_cp")
        mesh[tuple(ep_dims)]._flatten(mesh_dim_name="ep")
        return mesh
    keep = [
        (d, n)
        for d, n in zip(
            [pp, rep, shard, cp, tp], ["pp", "dp_replicate", "dp_shard", "cp", "tp"], strict=True
        )
        if d > 1
    ]
    mesh = init_device_mesh("cpu", [d for d, _ in keep], mesh_dim_names=[n for _, n in keep])
    active = set(mesh.mesh_dim_names)
    for flat, dims in (
        ("dp", ("dp_replicate", "dp_shard")),
        ("dp_shard_cp", ("dp_shard", "cp")),
        ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
    ):
        dims = tuple(n for n in dims if n in active)
        if dims:
            mesh[dims]._flatten(mesh_dim_name=flat)
    return mesh


def _unflattened(degrees: tuple[int, ...]) -> SimpleNamespace:
    """torchtitan's later ParallelDims.build_mesh: meshes unflattened from one "world" dim."""
    from torch.distributed.device_mesh import init_device_mesh

    pp, rep, shard, cp, tp, ep = degrees
    world = init_device_mesh("cpu", (pp * rep * shard * cp * tp,), mesh_dim_names=("world",))
    data = world._unflatten(0, (pp, rep * shard, cp, tp), ("pp", "batch", "cp", "tp"))
    loss = data["batch", "cp"]._flatten("loss_mesh")
    dense = world._unflatten(0, (pp, rep, shard * cp, tp), ("pp", "dp_replicate", "fsdp", "tp"))
    efsdp = shard * cp * tp // ep
    sparse = world._unflatten(0, (pp, rep, efsdp, ep), ("pp", "dp_replicate", "efsdp", "ep"))
    meshes = {"dataloading": data, "loss": loss, "dense": dense, "sparse": sparse}
    # a ParallelDims stand-in: from_device_mesh reads its meshes
    return SimpleNamespace(_global_meshes=meshes, world=world)


def _summary(groups: ProcessGroups, rank: int) -> dict[str, list[int]]:
    import torch.distributed as dist

    def ranks(group) -> list[int]:
        return [rank] if group is None else sorted(dist.get_process_group_ranks(group))

    return {name: ranks(getattr(groups, name)) for name in FIELDS}


def _body(rank: int, world_size: int) -> dict:
    out: dict = {}
    for key, c in WORLD_MESH_CASES[world_size].items():
        try:
            out[key] = _summary(ProcessGroups.from_device_mesh(_world_mesh(c)), rank)
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    for key, degrees in UNFLATTENED_CASES[world_size].items():
        dims = _unflattened(degrees)
        try:
            out[key] = _summary(ProcessGroups.from_device_mesh(dims), rank)
            # the same meshes passed one by one
            m = dims._global_meshes
            out[key + "/meshes"] = _summary(
                ProcessGroups.from_device_mesh(
                    m["dataloading"], m["loss"], m["dense"], m["sparse"]
                ),
                rank,
            )
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
        try:
            ProcessGroups.from_device_mesh(dims.world)
            out[key + "/world"] = "ok"
        except ValueError as exc:
            out[key + "/world"] = str(exc)
    return out


def _expected_world_mesh(c: dict, rank: int, world: int) -> dict[str, list[int]]:
    pp, rep, shard, cp, tp, ep, etp = (
        c[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")
    )
    if ep > 1:
        region = shard * cp * (tp if etp == 1 else 1)
        mod, inside = region // ep, ep // (cp * (tp if etp == 1 else 1))
    else:
        mod, inside = shard, 1
    names = ("P", "R", "MOD", "IN", "C", "T")
    at = lambda r: _coords(r, names, (pp, rep, mod, inside, cp, tp))  # noqa: E731

    def fixed(*keep: str) -> list[int]:
        return _same(rank, world, lambda r: tuple(at(r)[k] for k in keep))

    ep_fixed = ("P", "R", "MOD") if etp == 1 else ("P", "R", "MOD", "T")
    return {
        "dp": fixed("P", "C", "T"),
        "dp_cp": fixed("P", "T"),
        "cp": fixed("P", "R", "MOD", "IN", "T"),
        "tp": fixed("P", "R", "MOD", "IN", "C"),
        "pp": fixed("R", "MOD", "IN", "C", "T"),
        "ep": fixed(*ep_fixed) if ep > 1 else [rank],
        "edp": fixed("P", "IN", "C", "T") if ep > 1 else [rank],
    }


def _expected_unflattened(degrees: tuple[int, ...], rank: int, world: int) -> dict:
    pp, rep, shard, cp, tp, ep = degrees
    dense = lambda r: _coords(r, ("P", "R", "S", "C", "T"), (pp, rep, shard, cp, tp))  # noqa: E731
    efsdp = shard * cp * tp // ep
    sparse = lambda r: _coords(r, ("P", "R", "EF", "EP"), (pp, rep, efsdp, ep))  # noqa: E731

    def fixed(at, *keep: str) -> list[int]:
        return _same(rank, world, lambda r: tuple(at(r)[k] for k in keep))

    return {
        "dp": fixed(dense, "P", "C", "T"),
        "dp_cp": fixed(dense, "P", "T"),
        "cp": fixed(dense, "P", "R", "S", "T"),
        "tp": fixed(dense, "P", "R", "S", "C"),
        "pp": fixed(dense, "R", "S", "C", "T"),
        "ep": fixed(sparse, "P", "R", "EF"),
        "edp": fixed(sparse, "P", "EP"),
    }


def _check(world: int) -> None:
    results = run_distributed(_body, world, timeout=300)
    for rank, res in enumerate(results):
        for key, c in WORLD_MESH_CASES[world].items():
            assert res[key] == _expected_world_mesh(c, rank, world), (key, rank, res[key])
        for key, degrees in UNFLATTENED_CASES[world].items():
            expected = _expected_unflattened(degrees, rank, world)
            assert res[key] == expected, (key, rank, res[key])
            assert res[key + "/meshes"] == expected, (key, rank)
            assert "one-dim 'world' mesh" in res[key + "/world"], res[key + "/world"]


def test_torchtitan_meshes_on_four_ranks():
    _check(4)


def test_torchtitan_meshes_on_eight_ranks():
    _check(8)
