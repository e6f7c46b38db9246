"""TensorStatsMonitor under sequence parallelism (an ``sp`` dim inside ``groups.dp_cp``) with
expert parallelism, and with activation DTensors sharded over a data-parallel mesh dim.

Experts: a Megatron-style sequence-parallel block (column- then row-parallel ``Linear`` over the
``sp`` ranks, ending in sequence shards), whose tokens are then routed to experts named
``moe.experts.<i>`` held over ``groups.ep`` (an ``all_gather`` of the EP group's token streams
stands in for the all-to-all). Expert sites are merged over ``groups.edp`` (the ranks holding the
same experts), so ``_count_once`` works there with ``edp`` as the data group; the other sites
with ``dp_cp``. Three layouts: ``("ep", "sp")`` through ``ProcessGroups.from_device_mesh`` (edp
is the ``sp`` dim), the same with the experts column-parallel over ``sp`` (expert tensor
parallelism: an expert's input is a replica and its dgrad a ``Partial`` over a group inside
edp, counted once only by ``_count_once``; fails before it, the inputs 2x), and ``("dp", "sp")``
with the experts spread over the ``sp`` ranks (ep borrows the sequence-parallel ranks, edp is
``dp``; hand-built groups).

DTensor activations: a ``Linear`` on a DTensor ``[Shard(0), Shard(0)]`` over ``("dp", "sp")``
and one on a DTensor ``Shard(0)`` over the ``dp`` sub-mesh, whose ``Shard`` groups lie inside
``dp_cp`` and must not be merged over a second time.

Real gloo processes on 4 ranks; every statistic of every site must equal the float64 statistic
of the tokens that site really saw on all ranks, computed in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.callbacks.test_tensor_stats_replicas import assert_every_site_matches
from tests.helpers.dist import run_distributed
from tests.scripts.vitals_testing import NullWriter

pytestmark = pytest.mark.slow

B, S, D, F = 2, 8, 8, 16  # batch, sequence (split over the sp ranks), model and hidden width
E = 4  # experts in all, 2 per EP rank
T = B * S // 2  # tokens of one rank's stream (its sequence shard of its batch)


def _batch(dp_rank: int) -> torch.Tensor:
    """Different on every data-parallel rank, the same on the ranks of one sp group."""
    return 3 + torch.randn(B, S, D, generator=torch.Generator().manual_seed(500 + dp_rank))


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y**2).sum() + y[..., 0].sum()


def _expert_loss(y: torch.Tensor) -> torch.Tensor:
    """Elementwise, so that a column-parallel expert's local output shards add up to it."""
    return (y**2).sum() + y.sum()


def _route(stream: int) -> torch.Tensor:
    """The global expert of each token of a stream (one stream per rank, = its global rank)."""
    return torch.randint(0, E, (T,), generator=torch.Generator().manual_seed(200 + stream))


def _expert(g: int) -> nn.Linear:
    """Global expert ``g``, the same on every rank that holds it."""
    torch.manual_seed(10 + g)
    e = nn.Linear(D, D)
    nn.init.normal_(e.weight, mean=0.1 * g, std=1 + g)
    return e


class MoEBlock(nn.Module):
    """Local experts ``experts.<i>`` (global expert ``2 * ep_rank + i``) fed the tokens routed
    to them from the token streams of the EP group."""

    def __init__(self, ep_group, ep_rank: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([_expert(2 * ep_rank + i) for i in range(2)])
        self.ep_group, self.ep_rank = ep_group, ep_rank

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        # ep_group None: expert tensor parallelism over sp, whose ranks must hold the same
        # tokens: the sequence gathered over sp, then the EP exchange (every stream, here)
        members = dist.get_process_group_ranks(self.ep_group or dist.group.WORLD)
        parts = [torch.empty_like(h) for _ in members]
        dist.all_gather(parts, h.detach().contiguous(), group=self.ep_group)
        tokens = torch.cat(parts).requires_grad_()
        route = torch.cat([_route(m) for m in members])
        loss = torch.zeros(())
        for i, e in enumerate(self.experts):
            loss = loss + _expert_loss(e(tokens[route == 2 * self.ep_rank + i]))
        return loss


class SPMoE(nn.Module):
    """``up`` (column parallel, gathers the sequence) and ``down`` (row parallel, hands out
    sequence shards) over the sp ranks, then the experts on this rank's sequence shard."""

    def __init__(self, ep_group, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(D, F)
        self.down = nn.Linear(F, D)
        self.moe = MoEBlock(ep_group, ep_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.relu(self.up(x)))  # [B, S / sp, D]
        return _loss(h) + self.moe(h.reshape(-1, D))


def _moe_body(rank: int, world_size: int, run_dir: str, layout: str) -> dict:
    """``layout`` "ep_sp": mesh ("ep", "sp"), groups from the mesh (edp: the sp group);
    "ep_sp_etp": the same, the experts column-parallel over sp (expert tensor parallel: the sp
    ranks hold the same tokens, each expert's input a replica and its output a shard over sp,
    inside edp); "dp_sp_ep_on_sp": mesh ("dp", "sp") with ep the sp group and edp the dp group
    (hand-built). Dim 0 picks the batch, dim 1 the sequence shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups, collective_counter

    first = "dp" if layout == "dp_sp_ep_on_sp" else "ep"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(first, "sp"))
    groups = ProcessGroups.from_device_mesh(mesh)
    if first == "ep":
        ep_dim = "ep"
        assert set(dist.get_process_group_ranks(groups.edp)) == set(
            dist.get_process_group_ranks(mesh["sp"].get_group())
        )
    else:
        ep_dim = "sp"
        groups = ProcessGroups(
            dp=groups.dp, cp=groups.cp, dp_cp=groups.dp_cp, ep=groups.cp, edp=groups.dp
        )
    etp = layout == "ep_sp_etp"
    model = SPMoE(None if etp else mesh[ep_dim].get_group(), mesh.get_local_rank(ep_dim))
    plan = {
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    if etp:
        plan |= {f"moe.experts.{i}": ColwiseParallel() for i in range(2)}
    parallelize_module(model, mesh["sp"], plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sp = mesh.get_local_rank("sp")
    x = _batch(mesh.get_local_rank(first))[:, sp * S // 2 : (sp + 1) * S // 2]
    with Vitals(
        [TensorStatsMonitor(kinds=["activation", "dgrad"], kernel="eager")],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=groups,
    ) as vitals:
        vitals.attach(model, opt)
        x = x.contiguous().requires_grad_()
        vitals.batch(x)
        model(x).backward()
        before = dict(collective_counter)
        opt.step()
        counts = {k: v - before.get(k, 0) for k, v in collective_counter.items()}
    return {"counts": counts}


def _moe_float64() -> dict[str, dict[str, torch.Tensor]]:
    """One process, float64, unsharded: both batches through up/down, and each expert fed all
    tokens routed to it from the four streams (stream of rank 2 b + s: batch b's sequence
    half s)."""
    torch.manual_seed(0)
    up, down = nn.Linear(D, F).double(), nn.Linear(F, D).double()
    out: dict[str, dict[str, list[torch.Tensor]]] = {"activation": {}, "dgrad": {}}

    def keep(site: str, t: torch.Tensor) -> None:
        out["activation"].setdefault(site, []).append(t.detach().reshape(-1).clone())
        t.register_hook(lambda g: out["dgrad"].setdefault(site, []).append(g.reshape(-1)))

    loss = torch.zeros((), dtype=torch.float64)
    streams = []
    for b in range(2):
        x = _batch(b).double().requires_grad_()
        u = up(x)
        r = torch.relu(u)
        h = down(r)
        for site, t in (
            ("up/input0", x),
            ("up/output0", u),
            ("down/input0", r),
            ("down/output0", h),
        ):
            keep(site, t)
        loss = loss + _loss(h)
        streams += [h[:, s * S // 2 : (s + 1) * S // 2].reshape(-1, D).detach() for s in (0, 1)]
    for g in range(E):
        tokens = torch.cat([h[_route(s) == g] for s, h in enumerate(streams)])
        assert tokens.shape[0] >= 2, "every expert must get tokens (change the seeds)"
        tokens.requires_grad_()
        y = _expert(g).double()(tokens)
        keep(f"moe.experts.{g}/input0", tokens)
        keep(f"moe.experts.{g}/output0", y)
        loss = loss + _expert_loss(y)
    loss.backward()
    return {k: {s: torch.cat(v) for s, v in d.items()} for k, d in out.items()}


LAYOUTS = ["ep_sp", "ep_sp_etp", "dp_sp_ep_on_sp"]


def _moe_bodies(rank: int, world_size: int, root: str, layouts: list[str]) -> dict:
    """``_moe_body`` of each layout in turn, each with a run folder of its own (``root/<layout>``),
    on the same four processes: starting four processes costs more than a layout's step."""
    out = {}
    for layout in layouts:
        try:
            out[layout] = _moe_body(rank, world_size, str(Path(root) / layout), layout)
        except Exception as e:
            raise RuntimeError(f"layout {layout!r} failed") from e
    return out


@pytest.fixture(scope="module")
def moe_runs(request, tmp_path_factory) -> tuple[Path, list[dict]]:
    """The run folders' root and each rank's results by layout, for the layouts of the
    selected tests, run in one ``run_distributed``."""
    selected = {
        item.callspec.params["layout"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and "layout" in getattr(getattr(item, "callspec", None), "params", {})
    }
    layouts = [layout for layout in LAYOUTS if layout in selected]
    root = tmp_path_factory.mktemp("sp_moe")
    for layout in layouts:
        (root / layout).mkdir()
    results = run_distributed(_moe_bodies, world_size=4, args=(str(root), layouts), timeout=240)
    return root, results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_and_sp_sites_count_every_token_once(moe_runs, layout: str) -> None:
    """Every expert's activation/dgrad statistics are those of all tokens routed to it from the
    four streams (merged over edp, gathered over ep); the sequence-parallel sites' those of both
    batches, each element once: up's input is a replica over sp (one copy counts), its dgrad a
    Partial over sp summed in the gradient hook (then a replica), down's input and output are
    sequence/feature shards over sp (merged over dp_cp only)."""
    root, results = moe_runs
    assert_every_site_matches(root / layout, _moe_float64())
    for res in (r[layout] for r in results):
        # one all_gather per distinct group: dp_cp (the sp sites), edp (the experts) and the
        # expert gather over ep; the Partial dgrad's all_reduce ran in backward, not here
        assert res["counts"].get("all_gather", 0) == 3, res["counts"]
        assert res["counts"].get("all_reduce", 0) == 0, res["counts"]


# ------------------------------------------------ DTensor activations sharded over dp

N = 12  # rows in all: 3 per rank


class DTensorNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.l1 = nn.Linear(D, F)
        self.l2 = nn.Linear(F, D)


def _rows() -> torch.Tensor:
    return 1 + 2 * torch.randn(N, D, generator=torch.Generator().manual_seed(7))


def _dtensor_body(rank: int, world_size: int, run_dir: str) -> dict:
    """``l1`` on a DTensor ``[Shard(0), Shard(0)]`` over ("dp", "sp") (rank (d, s) holds row
    block 2 d + s), its output handed to ``l2`` as a DTensor ``Shard(0)`` over the dp sub-mesh
    of this sp rank (blocks s and 2 + s: different on the two sp ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_module

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups, collective_counter

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    groups = ProcessGroups.from_device_mesh(mesh)
    model = DTensorNet()
    model.requires_grad_(False)  # the weights are replicated DTensors; only dgrads are wanted
    distribute_module(model.l1, mesh)
    distribute_module(model.l2, mesh["dp"])
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01)
    per = N // 4
    local = _rows()[rank * per : (rank + 1) * per].clone().requires_grad_()
    with Vitals(
        [TensorStatsMonitor(kinds=["activation", "dgrad"], kernel="eager")],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=groups,
    ) as vitals:
        vitals.attach(model, opt)
        vitals.batch(local)
        x = DTensor.from_local(local, mesh, [Shard(0), Shard(0)])
        h = model.l1(x)
        assert [type(p) for p in h.placements] == [Shard, Shard], h.placements
        h2 = DTensor.from_local(h.to_local(), mesh["dp"], [Shard(0)])
        y = model.l2(h2)
        _loss(y.to_local()).backward()
        before = dict(collective_counter)
        opt.step()
        counts = {k: v - before.get(k, 0) for k, v in collective_counter.items()}
    return {"counts": counts}


def _dtensor_float64() -> dict[str, dict[str, torch.Tensor]]:
    model = DTensorNet().double()
    out: dict[str, dict[str, torch.Tensor]] = {"activation": {}, "dgrad": {}}

    def keep(site: str, t: torch.Tensor) -> None:
        out["activation"][site] = t.detach().reshape(-1).clone()
        t.register_hook(lambda g: out["dgrad"].__setitem__(site, g.reshape(-1)))

    x = _rows().double().requires_grad_()
    h = model.l1(x)
    h2 = h.detach().requires_grad_()  # l2's input: the same values, its own dgrad
    y = model.l2(h2)
    for site, t in (("l1/input0", x), ("l1/output0", h), ("l2/input0", h2), ("l2/output0", y)):
        keep(site, t)
    _loss(y).backward()
    h.backward(h2.grad)
    return out


def test_dtensor_activation_sharded_over_dp_merged_once(tmp_path: Path) -> None:
    """A DTensor's ``Shard`` groups over dp and sp lie inside dp_cp: merged over dp_cp alone
    (before, over dp, sp and dp_cp: l1's sites counted 4x; l2's, sharded over the dp
    sub-mesh, 2x)."""
    results = run_distributed(_dtensor_body, world_size=4, args=(str(tmp_path),), timeout=240)
    assert_every_site_matches(tmp_path, _dtensor_float64())
    for res in results:
        assert res["counts"].get("all_gather", 0) == 1, res["counts"]
        assert res["counts"].get("all_reduce", 0) == 0, res["counts"]
