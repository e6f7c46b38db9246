"""TensorStatsMonitor on real gloo processes.

FSDP2 x TP on 4 ranks: every statistic of every parameter, gradient, activation and dgrad must
equal the float64 statistic of the full, unsharded tensor computed in one process: parameters
and gradients gathered whole with ``full_tensor()``, activations and dgrads from the same seeded
model rebuilt here unsharded in float64 and fed the union of the data-parallel ranks' batches.
Expert parallelism on 2 ranks with a stand-in MoE layer: global expert indices in the names.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.shared_ranks import CASE_DIR, SharedRanks
from tests.scripts.vitals_testing import NullWriter
from tests.stats.test_moments import assert_matches, reference
from trainvitals.stats.moments import FIELDS, derive, moments_from_dicts

pytestmark = pytest.mark.slow

D, F = 128, 512


# ----------------------------------------------------------- ranks shared by the cases of a file
# (tests/helpers/shared_ranks.py: one set of gloo processes per world size runs every case)

ranks = SharedRanks(__name__)
on_ranks = ranks.on_ranks
case_runs, ran = ranks.fixtures()


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, F)  # 65536-element weight: chunked kernel path on each shard
        self.down = nn.Linear(F, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


def _batch(dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + dp_rank)
    return 3 + torch.randn(16, D, generator=g)


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y**2).sum() + y[:, 0].sum()


def _fsdp_tp_body(rank: int, world_size: int, run_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups, collective_counter

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TPNet()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TensorStatsMonitor(kernel="eager", log_every_n_steps=2)
    dp_rank = mesh.get_local_rank("dp")
    full: dict[str, dict[str, torch.Tensor]] = {"param": {}, "grad": {}}
    gathers = []
    with Vitals(
        [monitor],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=ProcessGroups.from_device_mesh(mesh),
    ) as vitals:
        vitals.attach(model, opt)
        x = _batch(dp_rank)
        vitals.batch(x)
        hooks0 = sum(len(m._forward_hooks) for m in model.modules())
        _loss(model(x)).backward()
        for n, p in model.named_parameters():  # the test's own gather of the whole tensors
            full["param"][n] = p.full_tensor().detach().double()
            full["grad"][n] = p.grad.full_tensor().detach().double()
        before = dict(collective_counter)
        opt.step()
        gathers = {k: collective_counter[k] - before.get(k, 0) for k in collective_counter}
        opt.zero_grad()
        # step 1 is not a logging step: no hook, no collective of ours
        vitals.batch(x)
        hooks = sum(len(m._forward_hooks) for m in model.modules())
        _loss(model(x)).backward()
        before = sum(collective_counter.values())
        opt.step()
        quiet = {"hooks": hooks0 - hooks, "collectives": sum(collective_counter.values()) - before}
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    # numpy: torch tensors would cross the process boundary through shared memory that dies
    # with the worker
    arrays = {k: {n: t.numpy() for n, t in d.items()} for k, d in full.items()}
    return {
        "full": arrays if rank == 0 else None,
        "collectives": gathers,
        "placements": placements,
        "quiet": quiet,
    }


def _unsharded_sites() -> dict[str, dict[str, torch.Tensor]]:
    """float64, one process: the union of the two dp ranks' batches through the unsharded model;
    the loss is the sum of the ranks' losses, so each rank's activations get their own dgrads."""
    torch.manual_seed(0)
    model = TPNet().double()
    out: dict[str, dict[str, list[torch.Tensor]]] = {"activation": {}, "dgrad": {}}

    def keep(kind: str, site: str, t: torch.Tensor) -> None:
        out[kind].setdefault(site, []).append(t.detach().reshape(-1).clone())

    def hook(name: str):
        def fn(module, args, output):
            for suffix, t in (("input0", args[0]), ("output0", output)):
                keep("activation", f"{name}/{suffix}", t)
                t.register_hook(lambda g, s=f"{name}/{suffix}": keep("dgrad", s, g))

        return fn

    model.up.register_forward_hook(hook("up"))
    model.down.register_forward_hook(hook("down"))
    total = sum(_loss(model(_batch(r).double().requires_grad_())) for r in range(2))
    total.backward()
    return {k: {s: torch.cat(v) for s, v in d.items()} for k, d in out.items()}


def _lines(run_dir: Path) -> dict[str, dict]:
    return {
        r["kind"]: r
        for r in map(json.loads, (run_dir / "tensor_stats.jsonl").read_text().splitlines())
    }


def _check(line: dict, want: dict[str, torch.Tensor], what: str) -> None:
    assert set(line["tensors"]) == set(want), (what, sorted(line["tensors"]), sorted(want))
    names = sorted(want)
    got = derive(
        moments_from_dicts([dict(zip(FIELDS, line["tensors"][n], strict=True)) for n in names])
    )
    for i, n in enumerate(names):
        assert_matches(got, i, reference(want[n]), f"{what}/{n}")


@on_ranks(4, _fsdp_tp_body, CASE_DIR)
def test_fsdp2_tp_every_statistic_equals_the_unsharded_float64(ran) -> None:
    run_dir, results = ran
    placements = results[0]["placements"]
    assert "Replicate()" in placements["down.bias"] and "Shard" in placements["up.weight"]
    lines = _lines(run_dir)
    assert set(lines) == {"param", "grad", "activation", "dgrad"}
    full = {
        k: {n: torch.from_numpy(a) for n, a in d.items()} for k, d in results[0]["full"].items()
    }
    _check(lines["param"], full["param"], "param")
    _check(lines["grad"], full["grad"], "grad")
    sites = _unsharded_sites()
    _check(lines["activation"], sites["activation"], "activation")
    _check(lines["dgrad"], sites["dgrad"], "dgrad")
    # one all_gather per distinct group (dp and tp) for all kinds together, nothing else
    for res in results:
        assert res["collectives"].get("all_gather", 0) == 2, res["collectives"]
        assert res["collectives"].get("all_reduce", 0) == 0
        assert res["quiet"]["collectives"] == 0
        assert res["quiet"]["hooks"] == 4  # 2 per site module (up, down), only on step 0


# ------------------------------------------------------------------------------ experts


class MoEStandIn(nn.Module):
    """Two local experts per rank (expert parallel over 2 ranks -> 4 experts in all)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.shared = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x) + self.experts[0](x[:4]).sum() + self.experts[1](x[4:]).sum()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoEStandIn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def _ep_body(rank: int, world_size: int, run_dir: str) -> dict:
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups, world_group

    torch.manual_seed(0)
    model = Model()
    torch.manual_seed(1 + rank)  # each EP rank holds different experts
    for e in model.moe.experts:
        nn.init.normal_(e.weight, mean=rank, std=1 + rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TensorStatsMonitor(kinds=["param", "activation"], kernel="eager")
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(7))  # same data on both ranks
    # the expert outputs the monitor will see (computed before its hooks exist)
    with torch.no_grad():
        outs = {
            f"moe.experts.{2 * rank + i}/output0": e(x[:4] if i == 0 else x[4:]).double().numpy()
            for i, e in enumerate(model.moe.experts)
        }
    with Vitals(
        [monitor],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=ProcessGroups(dp=world_group(), ep=world_group()),
    ) as vitals:
        vitals.attach(model, opt)
        vitals.batch(x)
        model(x).sum().backward()
        # what the monitor sees: the weights and activations before the update
        experts = {
            f"moe.experts.{2 * rank + i}.weight": e.weight.detach().double().numpy().copy()
            for i, e in enumerate(model.moe.experts)
        }
        shared = model.moe.shared.weight.detach().double().numpy().copy()
        opt.step()
    return {"experts": experts, "outs": outs, "shared": shared}


@on_ranks(2, _ep_body, CASE_DIR)
def test_expert_parallel_names_carry_global_expert_index(ran) -> None:
    run_dir, results = ran
    lines = _lines(run_dir)
    params = lines["param"]["tensors"]
    assert sorted(n for n in params if "experts" in n) == [
        f"moe.experts.{i}.{p}" for i in range(4) for p in ("bias", "weight")
    ]
    want = {n: torch.from_numpy(w) for r in results for n, w in r["experts"].items()}
    want["moe.shared.weight"] = torch.from_numpy(results[0]["shared"])
    _check({"tensors": {n: params[n] for n in want}}, want, "expert params")
    acts = lines["activation"]["tensors"]
    outs = {n: torch.from_numpy(t) for r in results for n, t in r["outs"].items()}
    _check({"tensors": {n: acts[n] for n in outs}}, outs, "expert activations")


class SkippingMoE(nn.Module):
    """Runs only the experts that receive tokens (as Hugging Face's Mixtral loop does): an
    expert no token reached has no gradient on its rank."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.shared = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, hit: list[int]) -> torch.Tensor:
        y = self.shared(x).pow(2).sum()
        for i in hit:
            y = y + self.experts[i](x).pow(3).sum()
        return y


def _ep_unhit_expert_body(rank: int, world_size: int, run_dir: str) -> dict:
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups, world_group

    torch.manual_seed(rank)  # each EP rank holds different experts
    model = SkippingMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TensorStatsMonitor(kinds=["grad"], kernel="eager")
    with Vitals(
        [monitor],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=ProcessGroups(dp=world_group(), ep=world_group()),
    ) as vitals:
        vitals.attach(model, opt)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        vitals.batch(x)
        model(x, hit=[0, 1] if rank == 0 else [0]).backward()  # rank 1's expert 1: no tokens
        # by global name: local expert i of EP rank r is expert 2 r + i
        grads = {
            re.sub(r"experts\.(\d+)", lambda m: f"experts.{2 * rank + int(m[1])}", n): (
                p.grad.detach().double().numpy().copy()
            )
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        opt.step()
    return {"grads": grads}


@on_ranks(2, _ep_unhit_expert_body, CASE_DIR)
def test_expert_without_gradient_on_one_ep_rank(ran) -> None:
    # The expert gather needs the same rows on every EP rank: a gradient missing on one rank
    # made the ranks' buffers differ (gloo aborted, or the ranks hung).
    run_dir, results = ran
    want: dict[str, torch.Tensor] = {}
    for r in results:
        for name, g in r["grads"].items():
            want.setdefault(name, torch.from_numpy(g))  # shared (not an expert): rank 0's
    assert "experts.3.weight" not in want and "experts.2.weight" in want
    _check(_lines(run_dir)["grad"], want, "grads, one expert unhit")


# -------------------------------------------------- experts on a ("dp", "ep") mesh: edp merge

E, T = 4, 16  # experts in all (2 per EP rank), tokens per rank


def _route(stream: int) -> torch.Tensor:
    """The global expert of each token of a token stream (one stream per rank), uneven."""
    return torch.randint(0, E, (T,), generator=torch.Generator().manual_seed(200 + stream))


def _stream(stream: int) -> torch.Tensor:
    return 3 + torch.randn(T, 8, generator=torch.Generator().manual_seed(100 + stream))


def _expert(g: int) -> nn.Linear:
    """Global expert ``g``, the same on every rank that holds it (replicated over "dp")."""
    torch.manual_seed(10 + g)
    e = nn.Linear(8, 8)
    nn.init.normal_(e.weight, mean=0.1 * g, std=1 + g)
    return e


class EPMoE(nn.Module):
    """A shared Linear on this rank's tokens, then expert parallelism over ``ep``: the EP
    group's token streams are exchanged (an all_gather standing in for the all-to-all) and
    each local expert takes the tokens of those streams routed to it."""

    def __init__(self, ep_group, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(8, 8)
        self.experts = nn.ModuleList([_expert(2 * ep_rank + i) for i in range(2)])
        self.ep_group, self.ep_rank = ep_group, ep_rank

    def forward(self, x: torch.Tensor, stream: int) -> torch.Tensor:
        import torch.distributed as dist

        h = self.shared(x)
        members = dist.get_process_group_ranks(self.ep_group)
        parts = [torch.empty_like(h) for _ in members]
        dist.all_gather(parts, h.detach().contiguous(), group=self.ep_group)
        tokens = torch.cat(parts).requires_grad_()
        route = torch.cat([_route(m) for m in members])  # stream of a rank = its global rank
        loss = _loss(h)
        for i, e in enumerate(self.experts):
            loss = loss + _loss(e(tokens[route == 2 * self.ep_rank + i]))
        return loss


def _dp_ep_body(rank: int, world_size: int, run_dir: str, hand_built: bool) -> dict:

    from torch.distributed.device_mesh import init_device_mesh

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    groups = ProcessGroups.from_device_mesh(mesh)
    if hand_built:  # no edp: the monitor must say that expert sites miss tokens
        groups = ProcessGroups(dp=groups.dp, ep=groups.ep)
    model = EPMoE(mesh["ep"].get_group(), mesh.get_local_rank("ep"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = TensorStatsMonitor(kinds=["activation", "dgrad"], kernel="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals(
            [monitor], writer=NullWriter(), run_dir=run_dir, log_every_n_steps=1, groups=groups
        ) as vitals:
            vitals.attach(model, opt)
            x = _stream(rank).requires_grad_()
            vitals.batch(x)
            model(x, rank).backward()
            opt.step()
    return {"warnings": [str(w.message) for w in caught]}


def _all_tokens_float64() -> dict[str, dict[str, torch.Tensor]]:
    """float64, one process: every rank's stream through the shared Linear, and every expert
    fed all tokens routed to it from all four streams."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8).double()
    out: dict[str, dict[str, list[torch.Tensor]]] = {"activation": {}, "dgrad": {}}

    def keep(site: str, t: torch.Tensor) -> None:
        out["activation"].setdefault(site, []).append(t.detach().reshape(-1).clone())
        t.register_hook(lambda g: out["dgrad"].setdefault(site, []).append(g.reshape(-1)))

    loss = torch.zeros((), dtype=torch.float64)
    hs = []
    for s in range(4):
        x = _stream(s).double().requires_grad_()
        h = shared(x)
        keep("shared/input0", x)
        keep("shared/output0", h)
        loss = loss + _loss(h)
        hs.append(h.detach())
    for g in range(E):
        tokens = torch.cat([h[_route(s) == g] for s, h in enumerate(hs)]).requires_grad_()
        y = _expert(g).double()(tokens)
        keep(f"experts.{g}/input0", tokens)
        keep(f"experts.{g}/output0", y)
        loss = loss + _loss(y)
    loss.backward()
    return {k: {s: torch.cat(v) for s, v in d.items()} for k, d in out.items()}


@on_ranks(4, _dp_ep_body, CASE_DIR, False)
def test_dp_ep_mesh_merges_expert_sites_over_expert_data_parallel(ran) -> None:
    """("dp", "ep") of shape (2, 2): 4 token streams, each EP group routes only its own two
    streams' tokens, and each expert is held by one rank of each EP group. Every expert's
    activation/dgrad statistics must be those of all tokens routed to it from all 4 ranks
    (merged over groups.edp); the shared site's those of all 4 streams (groups.dp_cp)."""
    run_dir, results = ran
    lines = _lines(run_dir)
    want = _all_tokens_float64()
    for kind in ("activation", "dgrad"):
        _check(lines[kind], want[kind], kind)
    assert not any("edp" in w for r in results for w in r["warnings"])


@on_ranks(4, _dp_ep_body, CASE_DIR, True)
def test_dp_ep_without_edp_warns_that_experts_miss_tokens(ran) -> None:
    _, results = ran
    for r in results:
        assert sum("edp=" in w for w in r["warnings"]) == 1, r["warnings"]


# ------------------------------------------------------------------------------ pipeline


class TwoStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(8, 8), "1": nn.Linear(8, 8)})


def _pp_body(rank: int, world_size: int, run_dir: str) -> dict:
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups, collective_counter, world_group

    torch.manual_seed(0)
    model = TwoStage()
    del model.layers[str(1 - rank)]  # each stage keeps its own layer, with its global name
    stage = model.layers[str(rank)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    with Vitals(
        [TensorStatsMonitor(kinds=["param", "activation"], kernel="eager")],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=ProcessGroups(pp=world_group()),
    ) as vitals:
        vitals.attach(model, opt)
        vitals.batch(x)
        stage(x).sum().backward()
        weight = stage.weight.detach().double().numpy().copy()
        before = collective_counter["all_gather_object"]
        opt.step()
        objects = collective_counter["all_gather_object"] - before
    return {"weight": weight, "x": x.double().numpy(), "objects": objects}


@on_ranks(2, _pp_body, CASE_DIR)
def test_pipeline_stages_are_gathered_to_rank0(ran) -> None:
    run_dir, results = ran
    lines = _lines(run_dir)
    want = {f"layers.{r}.weight": torch.from_numpy(res["weight"]) for r, res in enumerate(results)}
    params = lines["param"]["tensors"]
    assert sorted(params) == [
        "layers.0.bias",
        "layers.0.weight",
        "layers.1.bias",
        "layers.1.weight",
    ]
    _check({"tensors": {n: params[n] for n in want}}, want, "pipeline params")
    inputs = {f"layers.{r}/input0": torch.from_numpy(res["x"]) for r, res in enumerate(results)}
    acts = lines["activation"]["tensors"]
    _check({"tensors": {n: acts[n] for n in inputs}}, inputs, "pipeline activations")
    assert [res["objects"] for res in results] == [1, 1]  # one object gather per logging step


# ------------------------------------------------------------------------------ a failing rank


def _train_data_parallel(
    rank: int, monitor, run_dir: str, steps: int, state: dict[str, int]
) -> int:
    """Train a seeded TPNet under the driver with ``monitor``, data-parallel over the world
    (each rank its own batch), logging every step; ``state["step"]`` follows the step. Returns
    the rows of a batch."""
    from trainvitals.adapters.loop import Vitals
    from trainvitals.distributed import ProcessGroups, world_group

    torch.manual_seed(0)
    model = TPNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Vitals(
        [monitor],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=ProcessGroups(dp=world_group()),
    ) as vitals:
        vitals.attach(model, opt)
        for step in range(steps):
            state["step"] = step
            x = _batch(rank)
            vitals.batch(x)
            _loss(model(x)).backward()
            opt.step()
            opt.zero_grad()
    return x.shape[0]


def _failing_rank_body(rank: int, world_size: int, run_dir: str) -> dict:

    import trainvitals.callbacks.tensor_stats_monitor as mod
    from trainvitals.callbacks import TensorStatsMonitor

    os.environ["TRAINVITALS_STRICT"] = "0"
    state = {"step": -1}
    original = mod.MomentAccumulator.add

    def add(self, *args, **kwargs):
        if rank == 1 and state["step"] == 1:
            raise RuntimeError("out of memory on rank 1 only")
        return original(self, *args, **kwargs)

    mod.MomentAccumulator.add = add
    try:  # the ranks run other cases after this one
        monitor = TensorStatsMonitor(kinds=["param", "activation", "dgrad"], kernel="eager")
        _train_data_parallel(rank, monitor, run_dir, 3, state)
    finally:
        mod.MomentAccumulator.add = original
    return {}


@on_ranks(2, _failing_rank_body, CASE_DIR)
def test_a_rank_whose_hook_work_fails_leaves_the_sites_out_everywhere(ran) -> None:
    # Rank 1's kernel fails inside its forward hooks at step 1 (rank-local, e.g. out of
    # memory): no hang, no partial merge (rank 0's tokens alone would be a wrong number), the
    # other kinds and steps complete.
    run_dir, _ = ran
    lines = [json.loads(x) for x in (run_dir / "tensor_stats.jsonl").read_text().splitlines()]
    by = {(line["step"], line["kind"]): line["tensors"] for line in lines}
    for kind in ("activation", "dgrad"):
        assert by[(1, kind)] == {}, kind
        assert len(by[(0, kind)]) == len(by[(2, kind)]) > 0, kind
    assert set(by[(1, "param")]) == set(by[(0, "param")]) != set()


def _failing_emit_body(rank: int, world_size: int, run_dir: str) -> dict:
    import warnings

    import trainvitals.callbacks.tensor_stats_monitor as mod
    from trainvitals.callbacks import TensorStatsMonitor

    os.environ["TRAINVITALS_STRICT"] = "0"
    state = {"step": -1}
    original = mod._merge_over_groups

    def merge(kinds):
        # an unanticipated failure on rank 1 at step 2, before the step's collectives
        if rank == 1 and state["step"] == 2:
            raise RuntimeError("unexpected failure on rank 1 only")
        return original(kinds)

    mod._merge_over_groups = merge
    monitor = TensorStatsMonitor(
        kinds=["param", "grad", "activation"], kernel="eager", activation_every_n_steps=2
    )
    try:  # the ranks run other cases after this one
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = _train_data_parallel(rank, monitor, run_dir, 6, state)
    finally:
        mod._merge_over_groups = original
    return {"warnings": [str(w.message) for w in caught], "rows": rows}


@on_ranks(2, _failing_emit_body, CASE_DIR)
def test_an_unanticipated_failure_on_one_rank_drops_that_step_everywhere(ran) -> None:
    """Rank 1 raises inside step_end before its collectives at step 2 (an activation step: the
    two intervals give that hook different collectives at odd and even steps): the guard
    issues the rest of step 2's collectives for it, rank 0 leaves step 2 out, and every other
    step's activations are merged over both ranks' tokens."""
    run_dir, results = ran
    lines = [json.loads(x) for x in (run_dir / "tensor_stats.jsonl").read_text().splitlines()]
    by = {(line["step"], line["kind"]): line["tensors"] for line in lines}
    assert sorted({step for step, _ in by}) == [0, 1, 3, 4, 5]
    assert sorted(step for step, kind in by if kind == "activation") == [0, 4]
    for step in (0, 4):  # merged over both ranks: each input site counts both ranks' rows
        site = by[(step, "activation")]["up/input0"]
        assert site[FIELDS.index("count")] == 2 * results[0]["rows"] * D
    assert any("missing on every rank" in w for w in results[0]["warnings"])
    assert any("unexpected failure on rank 1 only" in w for w in results[1]["warnings"])


# ------------------------------------------------------- sequence parallel: local sequence shards

SB, SS = 2, 8  # batch, sequence length (sharded over the tp ranks)


def _sequence(dp_rank: int) -> torch.Tensor:
    return 3 + torch.randn(SB, SS, D, generator=torch.Generator().manual_seed(300 + dp_rank))


def _sp_body(rank: int, world_size: int, run_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups, collective_counter

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TPNet()
    # Megatron-style sequence parallelism: the norm works on this rank's part of the sequence;
    # "down" reduce-scatters its output back to sequence shards, handed out as local tensors
    parallelize_module(
        model,
        mesh["tp"],
        {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        },
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tp_rank = mesh.get_local_rank("tp")
    x = _sequence(mesh.get_local_rank("dp"))[:, tp_rank * SS // 2 : (tp_rank + 1) * SS // 2]
    with Vitals(
        [TensorStatsMonitor(kernel="eager", log_every_n_steps=2)],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=ProcessGroups.from_device_mesh(mesh),
    ) as vitals:
        vitals.attach(model, opt)
        counts = []
        for _ in range(2):  # a logging step, then one that is not
            vitals.batch(x)
            _loss(model(x).reshape(-1, D)).backward()
            before = dict(collective_counter)
            opt.step()
            counts.append({k: v - before.get(k, 0) for k, v in collective_counter.items()})
            opt.zero_grad()
    return {"counts": counts}


def _sp_float64() -> dict[str, dict[str, torch.Tensor]]:
    """float64, one process, whole sequences: activations and dgrads of both dp ranks' batches;
    parameters, and the gradients of dp rank 0's batch (the monitor reports a gradient that is
    not synchronised over "dp" as a replica: rank 0's)."""
    out: dict[str, dict[str, list[torch.Tensor]]] = {"activation": {}, "dgrad": {}}

    def keep(kind: str, site: str, t: torch.Tensor) -> None:
        out[kind].setdefault(site, []).append(t.detach().reshape(-1).clone())

    def hook(name: str):
        def fn(module, args, output):
            for suffix, t in (("input0", args[0]), ("output0", output)):
                keep("activation", f"{name}/{suffix}", t)
                t.register_hook(lambda g, s=f"{name}/{suffix}": keep("dgrad", s, g))

        return fn

    torch.manual_seed(0)
    model = TPNet().double()
    model.up.register_forward_hook(hook("up"))
    model.down.register_forward_hook(hook("down"))
    for r in range(2):
        x = _sequence(r).double().requires_grad_()
        _loss(model(x).reshape(-1, D)).backward()
        if r == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    want = {k: {s: torch.cat(v) for s, v in d.items()} for k, d in out.items()}
    torch.manual_seed(0)
    want["param"] = {n: p.detach().double() for n, p in TPNet().named_parameters()}
    want["grad"] = grads
    return want


@on_ranks(4, _sp_body, CASE_DIR)
def test_sequence_parallel_local_shards_are_merged_over_tp(ran) -> None:
    """dp x tp (2 x 2) with sequence parallelism: "down" (RowwiseParallel with
    output_layouts=Shard(1)) hands out each tp rank's part of the sequence as a plain tensor.
    Taken as a replica, its activation and dgrad held tp rank 0's half of the sequence only
    (count 2048 where float64 says 4096). One all_gather per group on the logging step, no
    collective on the other."""
    run_dir, results = ran
    lines = _lines(run_dir)
    assert set(lines) == {"param", "grad", "activation", "dgrad"}
    want = _sp_float64()
    for kind in ("param", "grad", "activation", "dgrad"):
        _check(lines[kind], want[kind], kind)
    for res in results:
        logging, quiet = res["counts"]
        assert logging.get("all_gather", 0) == 2, logging  # one per group: dp and tp
        assert sum(quiet.values()) == 0, quiet
