"""ProcessGroups.from_device_mesh on torchtitan's ``ParallelDims`` (passed as the first argument)
and on its dense mesh alone, built here the way torchtitan's
``torchtitan/distributed/parallel_dims.py`` builds them, without importing torchtitan:

* ``_DevParallelDims``: a 2025 development version of pytorch/torchtitan (commit 0119de15): its
  ``world_mesh`` property builds lazily and returns the ``ParallelDims`` itself, whose
  ``_all_meshes`` list holds a data mesh ``(pp, dp, cp, tp)`` (``dp`` = dp_replicate x dp_shard,
  ``dp_cp`` flattened from it), a dense mesh ``(pp, dp_replicate, dp_shard_cp, tp)`` and an EP mesh
  ``(pp, dp_replicate, dp_shard_in_ep, ep)``, keeping the enabled dims only (its world mesh is
  unnamed there; torch 2.13 unflattens only named meshes, so it is named "world" here; tp is 1,
  as that version's ``add_dim`` call for tp takes one argument too many);
* ``_EtpParallelDims``: early 2026 (weifengpy/torchtitan 2887f45b): ``build_mesh(device_type)``
  unflattens a one-dim "world" mesh into dataloading ``(pp, batch, cp, tp)``, ``loss_mesh``
  (``batch`` x ``cp``), dense ``(pp, dp_replicate, fsdp, tp)`` with ``fsdp`` = dp_shard x cp, and
  sparse ``(pp, dp_replicate, efsdp, ep, etp)``, in ``_global_meshes``; ``world_mesh`` raises
  until built;
* ``_SpmdParallelDims``: later (saforem2/torchtitan ec69ad7d): ``_global_meshes`` holds
  ``loss``, dense ``(pp, dp_replicate, dp_shard, cp, tp)``, sparse ``(pp, dp_replicate, efsdp,
  ep)`` and ``spmd_dense_for_fwdbwd`` ``(dp, cp, tp)`` (a slice of ``(pp, dp, cp, tp)``);
  ``world_mesh`` builds lazily.

torchtitan gives size-1 dims the "fake" backend; gloo is used for every dim here (the ranks are
the same). Expected groups come from the row-major rank layout: the ranks that agree with this
rank on every coordinate a group keeps fixed. ``dp`` is the data loader's group (dp_replicate x
dp_shard), ``dp_cp`` torchtitan's loss group (dp_replicate x dp_shard x cp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tests.helpers.shared_ranks import SharedRanks
from trainvitals.distributed import ProcessGroups

# one set of gloo processes per world size runs every case of this file
# (tests/helpers/shared_ranks.py)
shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()

FIELDS = ("dp", "tp", "pp", "ep", "cp", "dp_cp", "edp")


def _unflatten(world: Any, names: tuple[str, ...], sizes: tuple[int, ...]) -> Any:
    return world._unflatten(0, sizes, names)


def _world(size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (size,), mesh_dim_names=("world",))


@dataclass
class _DevParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    etp: int
    world_size: int
    mesh_dim_names: tuple[str, ...] = ()
    _world_mesh: Any = None

    def build_mesh(self) -> _DevParallelDims:
        world = _world(self.world_size)
        in_ep = self.dp_shard * self.cp // self.ep
        data: list[tuple[str, int]] = []
        dense: list[tuple[str, int]] = []
        expert: list[tuple[str, int]] = []
        if self.pp > 1:
            for dims in (data, dense, expert):
                dims.append(("pp", self.pp))
        if self.dp_replicate > 1 or self.dp_shard > 1:
            data.append(("dp", self.dp_replicate * self.dp_shard))
            if self.dp_replicate > 1:
                dense.append(("dp_replicate", self.dp_replicate))
                expert.append(("dp_replicate", self.dp_replicate))
            if self.dp_shard > 1:
                dense.append(("dp_shard_cp", self.dp_shard * self.cp))
                expert.append(("dp_shard_in_ep", in_ep))
        if self.cp > 1:
            data.append(("cp", self.cp))
        self._all_meshes = []
        data_mesh = _unflatten(world, *map(tuple, zip(*data, strict=True)))
        self._all_meshes.append(data_mesh)
        loss = data_mesh["dp", "cp"] if self.cp > 1 else data_mesh["dp"]
        loss._flatten(mesh_dim_name="dp_cp")
        self._all_meshes.append(_unflatten(world, *map(tuple, zip(*dense, strict=True))))
        if self.ep > 1:
            expert.append(("ep", self.ep))
            self._all_meshes.append(_unflatten(world, *map(tuple, zip(*expert, strict=True))))
        self._world_mesh = world
        self.mesh_dim_names = tuple(n for m in self._all_meshes for n in m.mesh_dim_names)
        return self

    def __getitem__(self, name: str) -> Any:
        for mesh in self._all_meshes:
            try:
                return mesh[name]
            except KeyError:
                pass
        raise AttributeError(name)

    @property
    def world_mesh(self) -> _DevParallelDims:
        if self._world_mesh is None:
            self.build_mesh()
        return self


@dataclass
class _EtpParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    etp: int
    world_size: int
    _meshes: dict[str, Any] = field(default_factory=dict)
    _world_mesh: Any = None

    def build_mesh(self, device_type: str) -> Any:
        batch = self.dp_replicate * self.dp_shard
        fsdp = self.dp_shard * self.cp
        efsdp = fsdp * self.tp // (self.etp * self.ep)
        self._world_mesh = _world(self.world_size)
        data = _unflatten(
            self._world_mesh, ("pp", "batch", "cp", "tp"), (self.pp, batch, self.cp, self.tp)
        )
        loss = data["batch", "cp"]._flatten("loss_mesh")
        dense = _unflatten(
            self._world_mesh,
            ("pp", "dp_replicate", "fsdp", "tp"),
            (self.pp, self.dp_replicate, fsdp, self.tp),
        )
        sparse = _unflatten(
            self._world_mesh,
            ("pp", "dp_replicate", "efsdp", "ep", "etp"),
            (self.pp, self.dp_replicate, efsdp, self.ep, self.etp),
        )
        self._global_meshes = {"dataloading": data, "loss": loss, "dense": dense, "sparse": sparse}
        self._meshes = {
            "pp": data["pp"],
            "batch": data["batch"],
            "loss": loss,
            "dp_replicate": dense["dp_replicate"],
            "fsdp": dense["fsdp"],
            "cp": data["cp"],
            "tp": data["tp"],
            "ep": sparse["ep"],
            "efsdp": sparse["efsdp"],
            "etp": sparse["etp"],
        }
        return self._world_mesh

    def get_mesh(self, dims: str | list[str]) -> Any:
        if isinstance(dims, str):
            return self._meshes[dims]
        owner = next(m for m in self._global_meshes.values() if set(dims) <= set(m.mesh_dim_names))
        return owner[tuple(dims)]

    @property
    def world_mesh(self) -> Any:
        if self._world_mesh is None:
            raise RuntimeError("Device mesh not built. Call build_mesh(device_type) first.")
        return self._world_mesh


@dataclass
class _SpmdParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    enable_sequence_parallel: bool = False
    _single_axis_meshes: dict[str, Any] = field(default_factory=dict)
    _world_mesh: Any = None

    def build_mesh(self) -> Any:
        batch = self.dp_replicate * self.dp_shard
        efsdp = self.dp_shard * self.cp * self.tp // self.ep
        self._world_mesh = _world(self.world_size)
        dense = _unflatten(
            self._world_mesh,
            ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
        )
        fwdbwd = _unflatten(
            self._world_mesh, ("pp", "dp", "cp", "tp"), (self.pp, batch, self.cp, self.tp)
        )
        spmd_dense = fwdbwd["dp", "cp", "tp"]
        loss = fwdbwd["dp", "cp"]._flatten("loss_mesh")
        sparse = _unflatten(
            self._world_mesh,
            ("pp", "dp_replicate", "efsdp", "ep"),
            (self.pp, self.dp_replicate, efsdp, self.ep),
        )
        self._global_meshes = {"loss": loss, "dense": dense, "sparse": sparse}
        self._global_meshes["spmd_dense_for_fwdbwd"] = spmd_dense
        if self.ep > 1:
            self._global_meshes["spmd_sparse_for_fwdbwd"] = sparse["dp_replicate", "efsdp", "ep"]
        self._single_axis_meshes = {
            "pp": fwdbwd["pp"],
            "loss": loss,
            "dp_replicate": dense["dp_replicate"],
            "cp": fwdbwd["cp"],
            "tp": fwdbwd["tp"],
            "ep": sparse["ep"],
            "efsdp": sparse["efsdp"],
            "dp": spmd_dense["dp"],
            "dp_shard": dense["dp_shard"],
        }
        return self._world_mesh

    def get_mesh(self, dims: str | list[str]) -> Any:
        if not self._single_axis_meshes:
            self.build_mesh()
        return self._single_axis_meshes[dims] if isinstance(dims, str) else None

    @property
    def world_mesh(self) -> Any:
        if self._world_mesh is None:
            self._world_mesh = self.build_mesh()
        return self._world_mesh


# (pp, dp_replicate, dp_shard, cp, tp, ep, etp)
CASES = {
    4: {
        "dev_shard_cp_ep": ("dev", (1, 1, 2, 2, 1, 2, 1)),
        "dev_hsdp_ep": ("dev", (1, 2, 2, 1, 1, 2, 1)),
        "etp_shard_cp_ep": ("etp", (1, 1, 2, 2, 1, 2, 1)),
        "etp_tp_etp_tp": ("etp", (1, 1, 2, 1, 2, 2, 2)),
        "spmd_shard_cp_ep": ("spmd", (1, 1, 2, 2, 1, 2, 1)),
        "spmd_hsdp_no_ep": ("spmd", (1, 2, 2, 1, 1, 1, 1)),
    },
    8: {
        "dev_pp_cp_ep4": ("dev", (2, 1, 2, 2, 1, 4, 1)),
        "dev_hsdp_cp_ep": ("dev", (1, 2, 2, 2, 1, 2, 1)),
        "etp_cp_tp_ep_over_tp": ("etp", (1, 1, 2, 2, 2, 4, 1)),
        "etp_hsdp_tp_etp_tp": ("etp", (1, 2, 2, 1, 2, 2, 2)),
        "spmd_pp_cp_ep": ("spmd", (2, 1, 2, 2, 1, 2, 1)),
        "spmd_cp_tp_ep8": ("spmd", (1, 1, 2, 2, 2, 8, 1)),
    },
}


def _make(kind: str, degrees: tuple[int, ...], world: int) -> Any:
    pp, rep, shard, cp, tp, ep, etp = degrees
    if kind == "dev":
        return _DevParallelDims(rep, shard, cp, tp, pp, ep, etp, world)  # built lazily
    if kind == "etp":
        dims = _EtpParallelDims(rep, shard, cp, tp, pp, ep, etp, world)
        dims.build_mesh("cpu")
        return dims
    return _SpmdParallelDims(rep, shard, cp, tp, pp, ep, world)  # built lazily


def _summary(groups: ProcessGroups, rank: int) -> dict[str, list[int]]:
    import torch.distributed as dist

    def ranks(group: Any) -> list[int]:
        return [rank] if group is None else sorted(dist.get_process_group_ranks(group))

    return {name: ranks(getattr(groups, name)) for name in FIELDS}


def _parallel_dims_body(rank: int, world_size: int) -> dict:
    out: dict = {}
    for key, (kind, degrees) in CASES[world_size].items():
        try:
            out[key] = _summary(
                ProcessGroups.from_device_mesh(_make(kind, degrees, world_size)), rank
            )
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def _keep(rank: int, world: int, names: tuple[str, ...], sizes: tuple[int, ...], varying: str):
    """The ranks that agree with ``rank`` on every coordinate not in ``varying`` (row-major)."""
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]

    def at(r: int) -> tuple[int, ...]:
        return tuple(
            (r // st) % sz
            for n, st, sz in zip(names, strides, sizes, strict=True)
            if n not in varying.split()
        )

    return [r for r in range(world) if at(r) == at(rank)]


def _expected(kind: str, degrees: tuple[int, ...], rank: int, world: int) -> dict:
    pp, rep, shard, cp, tp, ep, etp = degrees
    dense_names, dense_sizes = ("P", "R", "S", "C", "T"), (pp, rep, shard, cp, tp)

    def dense(varying: str) -> list[int]:
        return _keep(rank, world, dense_names, dense_sizes, varying)

    if kind == "dev":  # EP mesh (pp, dp_replicate, dp_shard_in_ep, ep): tp is 1 there
        sparse_names, sparse_sizes = ("P", "R", "EF", "EP"), (pp, rep, shard * cp // ep, ep)
    elif kind == "etp":
        efsdp = shard * cp * tp // (etp * ep)
        sparse_names, sparse_sizes = ("P", "R", "EF", "EP", "ET"), (pp, rep, efsdp, ep, etp)
    else:
        sparse_names, sparse_sizes = ("P", "R", "EF", "EP"), (pp, rep, shard * cp * tp // ep, ep)

    def sparse(varying: str) -> list[int]:
        return _keep(rank, world, sparse_names, sparse_sizes, varying)

    return {
        "dp": dense("R S"),
        "tp": dense("T"),
        "pp": dense("P"),
        "ep": sparse("EP") if ep > 1 else [rank],
        "cp": dense("C"),
        "dp_cp": dense("R S C"),
        "edp": sparse("R EF") if ep > 1 else [rank],
    }


def _check_parallel_dims(world: int, results: list[dict]) -> None:
    for rank, res in enumerate(results):
        for key, (kind, degrees) in CASES[world].items():
            assert res[key] == _expected(kind, degrees, rank, world), (key, rank, res[key])


@shared.on_ranks(4, _parallel_dims_body)
def test_parallel_dims_as_first_argument_on_four_ranks(ran):
    _check_parallel_dims(4, ran[1])


@shared.on_ranks(8, _parallel_dims_body)
def test_parallel_dims_as_first_argument_on_eight_ranks(ran):
    _check_parallel_dims(8, ran[1])


def _dense_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out: dict = {}

    def attempt(key: str, *meshes: Any) -> None:
        try:
            out[key] = _summary(ProcessGroups.from_device_mesh(*meshes), rank)
        except ValueError as exc:
            out[key] = f"ValueError: {exc}"

    # torchtitan's dense mesh (pp, dp_replicate, fsdp, tp), fsdp = dp_shard x cp, passed alone
    for key, degrees in {
        "shard2_cp2": (1, 1, 2, 2, 1, 1, 1),
        "shard4_cp1": (1, 1, 4, 1, 1, 1, 1),
        "rep2_tp2": (1, 2, 1, 1, 2, 1, 1),  # fsdp of one rank: nothing to tell apart
    }.items():
        dims = _make("etp", degrees, world_size)
        attempt(key, dims._global_meshes["dense"])
        attempt(
            key + "/with_batch", dims._global_meshes["dataloading"], dims._global_meshes["dense"]
        )
    # the development version's dense mesh (dp_replicate, dp_shard_cp) alone
    dev = _DevParallelDims(2, 2, 1, 1, 1, 1, 1, world_size).build_mesh()
    attempt("dev_dense", dev._all_meshes[1])
    # the later dense mesh (pp, dp_replicate, dp_shard, cp, tp) names dp_shard and cp apart
    spmd = _make("spmd", (1, 1, 2, 2, 1, 1, 1), world_size)
    spmd.build_mesh()
    attempt("spmd_dense", spmd._global_meshes["dense"])
    # an "fsdp" dim outside torchtitan's meshes is a plain dp_shard dim
    attempt("plain_fsdp", init_device_mesh("cpu", (2, 2), mesh_dim_names=("ddp", "fsdp")))
    return out


@shared.on_ranks(4, _dense_body)
def test_dense_mesh_alone_gives_right_groups_or_raises(ran):
    _, results = ran
    for rank, res in enumerate(results):
        for key in ("shard2_cp2", "shard4_cp1"):
            # dp and cp cannot be told apart: with shard2_cp2 the loader's dp is 2 ranks, with
            # shard4_cp1 it is 4; one answer for both would be wrong for one of them
            assert res[key].startswith("ValueError"), (key, res[key])
            assert "'fsdp'" in res[key] and "ParallelDims" in res[key] and "'batch'" in res[key]
        assert res["shard2_cp2/with_batch"] == _expected("etp", (1, 1, 2, 2, 1, 1, 1), rank, 4)
        assert res["shard4_cp1/with_batch"] == _expected("etp", (1, 1, 4, 1, 1, 1, 1), rank, 4)
        rep2_tp2 = _expected("etp", (1, 2, 1, 1, 2, 1, 1), rank, 4)
        assert res["rep2_tp2"] == res["rep2_tp2/with_batch"] == rep2_tp2
        assert res["dev_dense"].startswith("ValueError") and "'dp_shard_cp'" in res["dev_dense"]
        assert res["spmd_dense"] == _expected("spmd", (1, 1, 2, 2, 1, 1, 1), rank, 4)
        assert res["plain_fsdp"]["dp"] == [0, 1, 2, 3]
        assert res["plain_fsdp"]["dp_cp"] == [0, 1, 2, 3]
