"""ProcessGroups from device meshes, Lightning strategies and Accelerate-like objects.

Multi-rank cases run on 4 real gloo processes with ``init_device_mesh("cpu", ...)``; the
members of every group are checked against the rank layout of the mesh, computed here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.shared_ranks import SharedRanks
from trainvitals.distributed import ProcessGroups

# one set of gloo processes per world size runs every case of this file
# (tests/helpers/shared_ranks.py)
shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()

# Rank layout of a (2, 2) mesh: rank = 2 * row + col.
#   dim 0 groups (vary row): {0, 2}, {1, 3};  dim 1 groups (vary col): {0, 1}, {2, 3}.


def _ranks(group) -> list[int] | None:
    import torch.distributed as dist

    return None if group is None else sorted(dist.get_process_group_ranks(group))


def _summary(groups: ProcessGroups) -> dict[str, list[int] | None]:
    return {
        name: _ranks(getattr(groups, name))
        for name in ("dp", "tp", "pp", "ep", "cp", "dp_cp", "edp")
    }


def _mesh_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out: dict = {}
    cases = {
        "dp": ((4,), ("dp",)),
        "fsdp": ((4,), ("fsdp",)),
        "dp_tp": ((2, 2), ("dp", "tp")),
        "lightning": ((2, 2), ("data_parallel", "tensor_parallel")),
        "hsdp": ((2, 2), ("dp_replicate", "dp_shard")),
        "dp_cp": ((2, 2), ("dp", "cp")),
        "shard_cp": ((2, 2), ("dp_shard", "cp")),
        "pp_ep": ((2, 2), ("pp", "ep")),
        "dp_ep": ((2, 2), ("dp", "ep")),
        "ep_cp": ((2, 2), ("ep", "cp")),
        "pp_tp_long": ((2, 2), ("pipeline_parallel", "tensor_parallel")),
        # sequence parallel shards the sequence: its ranks route different tokens (as cp)
        "dp_sp": ((2, 2), ("dp", "sp")),
        "dp_sp_long": ((2, 2), ("data_parallel", "sequence_parallel")),
        "cp_sp": ((2, 2), ("cp", "sp")),
        "ep_sp": ((2, 2), ("ep", "sp")),
    }
    for key, (shape, names) in cases.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        out[key] = _summary(ProcessGroups.from_device_mesh(mesh))
    # the same mesh a second time (flattened dims already exist) gives the same groups
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    first = _summary(ProcessGroups.from_device_mesh(mesh))
    out["hsdp_twice"] = (first, _summary(ProcessGroups.from_device_mesh(mesh)))
    # errors, raised before any collective
    errors = {}
    for key, names in {
        "unknown": ("dp", "foo"),
        "unnamed": None,
        "same_role": ("dp", "data_parallel"),
    }.items():
        try:
            bad = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
            ProcessGroups.from_device_mesh(bad)
        except ValueError as exc:
            errors[key] = str(exc)
    # a context-parallel group of two ranks without dp_cp: token sums would miss the cp peers
    cp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    try:
        ProcessGroups(dp=cp_mesh.get_group("dp"), cp=cp_mesh.get_group("cp"))
    except ValueError as exc:
        errors["cp_without_dp_cp"] = str(exc)
    out["errors"] = errors
    groups = ProcessGroups.from_device_mesh(
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    )
    out["sizes"] = groups.sizes()
    out["trivial"] = groups.is_trivial
    return out


@shared.on_ranks(4, _mesh_body)
def test_from_device_mesh_on_four_ranks(ran):
    _, results = ran
    row = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}  # dim-1 group of each rank
    col = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}  # dim-0 group of each rank
    everyone = [0, 1, 2, 3]
    for rank, res in enumerate(results):
        none = dict.fromkeys(("dp", "tp", "pp", "ep", "cp", "dp_cp", "edp"))
        assert res["dp"] == {**none, "dp": everyone, "dp_cp": everyone}
        assert res["fsdp"] == res["dp"]
        expected_2d = {**none, "dp": col[rank], "tp": row[rank], "dp_cp": col[rank]}
        assert res["dp_tp"] == expected_2d
        assert res["lightning"] == expected_2d
        # HSDP: data parallel is replicate x shard, flattened
        assert res["hsdp"] == {**none, "dp": everyone, "dp_cp": everyone}
        assert res["hsdp_twice"][0] == res["hsdp_twice"][1] == res["hsdp"]
        # context parallel: dp_cp is every rank that sees different tokens
        assert res["dp_cp"] == {**none, "dp": col[rank], "cp": row[rank], "dp_cp": everyone}
        assert res["shard_cp"] == res["dp_cp"]
        # expert-parallel ranks route different tokens: they are data parallel too
        ep_only = {"dp": row[rank], "ep": row[rank], "dp_cp": row[rank]}
        assert res["pp_ep"] == {**none, "pp": col[rank], **ep_only}
        # edp: the ranks holding the same experts, each seeing other token streams (the
        # data-parallel and cp dims other than ep; trivial when ep spans all of them)
        assert res["dp_ep"] == {
            **none,
            "dp": everyone,
            "ep": row[rank],
            "dp_cp": everyone,
            "edp": col[rank],
        }
        assert res["ep_cp"] == {
            **none,
            "dp": col[rank],
            "ep": col[rank],
            "cp": row[rank],
            "dp_cp": everyone,
            "edp": row[rank],
        }
        assert res["pp_tp_long"] == {**none, "pp": col[rank], "tp": row[rank]}
        # sequence parallel: token sums over dp x sp (Megatron sums tokens_per_expert over
        # the tp_cp ranks its SP shards the sequence over), per-rank metrics averaged there
        assert res["dp_sp"] == {**none, "dp": col[rank], "cp": row[rank], "dp_cp": everyone}
        assert res["dp_sp_long"] == res["dp_sp"]
        # a cp and an sp dim: both shard the sequence, flattened into one cp group
        assert res["cp_sp"] == {**none, "cp": everyone, "dp_cp": everyone}
        assert res["ep_sp"] == {
            **none,
            "dp": col[rank],
            "ep": col[rank],
            "cp": row[rank],
            "dp_cp": everyone,
            "edp": row[rank],
        }
        assert "foo" in res["errors"]["unknown"]
        # two dims of one role: keeping either would leave the other's ranks out silently
        assert "'dp'" in res["errors"]["same_role"]
        assert "data_parallel" in res["errors"]["same_role"]
        assert "mesh_dim_names" in res["errors"]["unnamed"]
        assert "dp_cp" in res["errors"]["cp_without_dp_cp"]
        assert res["sizes"] == {"dp": 2, "tp": 2, "pp": 1, "ep": 1, "cp": 1, "dp_cp": 2, "edp": 1}
        assert res["trivial"] is False


def _strategy_body(rank: int, world_size: int) -> dict:
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh

    out: dict = {}
    # before setup Lightning raises on .device_mesh: the world is data parallel
    try:
        _ = ModelParallelStrategy().device_mesh
    except RuntimeError:
        out["raises_before_setup"] = True
    out["mp_unset"] = _summary(ProcessGroups.from_strategy(ModelParallelStrategy()))
    out["mp_before_setup"] = _summary(ProcessGroups.from_strategy(SimpleNamespace(world_size=2)))
    mp = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    mp._device_mesh = init_device_mesh(
        "cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel")
    )
    out["mp"] = _summary(ProcessGroups.from_strategy(mp))
    ddp = DDPStrategy(
        parallel_devices=[torch.device("cpu")] * world_size,
        cluster_environment=LightningEnvironment(),
    )
    ddp.set_world_ranks()
    out["ddp_world_size"] = ddp.world_size
    out["ddp"] = _summary(ProcessGroups.from_strategy(ddp))
    return out


@shared.on_ranks(2, _strategy_body, needs="lightning")
def test_from_strategy_ddp_and_model_parallel_on_two_ranks(ran):
    pytest.importorskip("lightning.pytorch")
    _, results = ran
    for rank, res in enumerate(results):
        assert res["ddp_world_size"] == 2
        assert res["ddp"]["dp"] == [0, 1] and res["ddp"]["tp"] is None
        assert res["mp_before_setup"]["dp"] == [0, 1]
        assert res["raises_before_setup"]
        assert res["mp_unset"]["tp"] is None
        assert res["mp"]["dp"] == [rank]  # data_parallel of size 1
        assert res["mp"]["tp"] == [0, 1]


def test_from_strategy_single_device_is_trivial():
    pl = pytest.importorskip("lightning.pytorch")
    strategy = pl.strategies.SingleDeviceStrategy(device=torch.device("cpu"))
    groups = ProcessGroups.from_strategy(strategy)
    assert groups.is_trivial
    assert groups == ProcessGroups()


def test_explicit_construction_and_single_process_defaults():
    groups = ProcessGroups()
    assert groups.is_trivial
    assert groups.sizes() == dict.fromkeys(("dp", "tp", "pp", "ep", "cp", "dp_cp", "edp"), 1)
    assert ProcessGroups.single() == groups
    assert ProcessGroups.world().dp is None  # not distributed: no world group
    marker = object()
    assert ProcessGroups(dp=marker).dp_cp is marker  # dp_cp defaults to dp without cp
    # a cp of one rank (here: not distributed) is trivial, so dp_cp is dp
    assert ProcessGroups(dp=marker, cp=object()).dp_cp is marker


def test_from_accelerator_without_mesh_single_process():
    assert ProcessGroups.from_accelerator(SimpleNamespace(num_processes=1)).is_trivial
    assert ProcessGroups.from_accelerator(SimpleNamespace(torch_device_mesh=None)).is_trivial


def _accelerator_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        "cpu", (1, 2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp")
    )
    with_mesh = ProcessGroups.from_accelerator(SimpleNamespace(torch_device_mesh=mesh))
    no_mesh = ProcessGroups.from_accelerator(
        SimpleNamespace(torch_device_mesh=None, num_processes=world_size)
    )
    return {"mesh": _summary(with_mesh), "no_mesh": _summary(no_mesh)}


@shared.on_ranks(4, _accelerator_body)
def test_from_accelerator_with_and_without_mesh_on_four_ranks(ran):
    _, results = ran
    for rank, res in enumerate(results):
        # mesh (1, 2, 1, 2): rank = 2 * shard + tp
        shard = [0, 2] if rank in (0, 2) else [1, 3]
        tp = [0, 1] if rank < 2 else [2, 3]
        assert res["mesh"]["dp"] == shard
        assert res["mesh"]["tp"] == tp
        assert res["mesh"]["cp"] == [rank]
        assert res["mesh"]["dp_cp"] == shard
        assert res["no_mesh"]["dp"] == [0, 1, 2, 3]
        assert res["no_mesh"]["tp"] is None
