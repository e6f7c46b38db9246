"""TensorStatsMonitor: a fused experts module whose weights are sharded over a tensor-parallel
mesh dim is not a default activation/dgrad site.

torchtitan's ``TensorParallel`` / ``ExpertTensorParallel`` on ``GroupedExperts`` shard ``w1`` /
``w3`` on dim 1 and ``w2`` on dim 2, run the experts on the ``to_local()`` shards and sum the
row-parallel partial outputs after the module: the site's ``output0`` and the dgrad of its
``input0`` would be one rank's partial sums (recorded before as the layer's values). Built here
by hand on 2 gloo ranks: DTensor weights through ``distribute_module``, the copy into and the
sum out of the tensor-parallel region as two small autograd functions (Megatron-LM's
``copy_to_tensor_model_parallel_region`` / ``reduce_from_tensor_model_parallel_region``) around
the experts. Under FSDP2 (``Shard(0)`` over ``dp``) the same module's activations are whole:
it stays a site, exact against float64 of both ranks' tensors. Naming the class in
``module_types=`` records it under tensor parallelism too (the user's choice).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from tests.callbacks.test_tensor_stats_monitor import check_line, read_lines
from tests.helpers.shared_ranks import CASE_DIR, SharedRanks

ranks = SharedRanks(__name__)
case_runs, ran = ranks.fixtures()

E, H, F, T, K = 4, 8, 6, 10, 2  # experts, model width, expert width, tokens, experts per token
INP = ("inp/input0", "inp/output0")
EXP = ("experts/input0", "experts/output0")


class GroupedExperts(nn.Module):
    """3-d ``w1``/``w2``/``w3`` as torchtitan's ``GroupedExperts``; a loop over the experts,
    on the local weights when they are DTensors (as torchtitan's forward does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.w1 = nn.Parameter(torch.randn(E, F, H) * 0.5 + 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, F) * 0.5)
        self.w3 = nn.Parameter(torch.randn(E, F, H) * 0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (getattr(w, "to_local", lambda w=w: w)() for w in (self.w1, self.w2, self.w3))
        outs = []
        for e, xe in enumerate(torch.split(x, counts.tolist())):
            h = nn.functional.silu(xe @ w1[e].T) * (xe @ w3[e].T)
            outs.append(h @ w2[e].T)
        return torch.cat(outs)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the gradient summed over the tensor-parallel ranks (each holds a
    partial one, from its shard of the columns)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """The row-parallel partial outputs summed; the gradient (a replica) passed through."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class MoE(nn.Module):
    """A ``Linear``, then each token to ``K`` fixed experts (weight 1), outputs summed."""

    def __init__(self, tp_group=None) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(H, H)
        self.experts = GroupedExperts()
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        flat = route.reshape(-1)
        order = torch.argsort(flat, stable=True)
        routed = h[order // K]
        if self.tp_group is not None:
            routed = _CopyToTP.apply(routed, self.tp_group)
        out = self.experts(routed, torch.bincount(flat, minlength=E))
        if self.tp_group is not None:
            out = _ReduceFromTP.apply(out, self.tp_group)  # the sum after the module
        back = torch.empty_like(out)
        back[order] = out
        return back.view(T, K, H).sum(1)


def _stream(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + s)
    x = 2 + torch.randn(T, H, generator=g)
    return x, torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


def _capture(model: MoE, seen: dict[str, list[float]]) -> None:
    """The float64 values of each site's first input and output and of their gradients."""

    def keep(key: str, t: torch.Tensor) -> None:
        seen.setdefault(key, []).extend(t.detach().double().flatten().tolist())

    def hook(name: str, args: tuple, out: torch.Tensor) -> None:
        for site, t in ((f"{name}/input0", args[0]), (f"{name}/output0", out)):
            keep(f"activation/{site}", t)
            if t.requires_grad:
                t.register_hook(lambda g, site=site: keep(f"dgrad/{site}", g))

    for name in ("inp", "experts"):
        model.get_submodule(name).register_forward_hook(lambda m, a, o, name=name: hook(name, a, o))


def _body(rank: int, world_size: int, run_dir: str, layout: str) -> dict:
    """``layout`` "tp": the experts tensor-parallel (``w1``/``w3`` ``Shard(1)``, ``w2``
    ``Shard(2)`` over a ``tp`` mesh), the same tokens on both ranks, default sites;
    "tp_named": the same with ``module_types`` naming the experts class; "fsdp": FSDP2 over a
    ``dp`` mesh, each rank its own tokens."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups

    dim = "dp" if layout == "fsdp" else "tp"
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(dim,))
    model = MoE(mesh.get_group() if dim == "tp" else None)
    if dim == "tp":

        def shard(name: str, mod: nn.Module, mesh) -> None:
            for pn, placement in (("w1", Shard(1)), ("w2", Shard(2)), ("w3", Shard(1))):
                weight = distribute_tensor(getattr(mod, pn), mesh, [placement])
                mod.register_parameter(pn, nn.Parameter(weight))

        distribute_module(model.experts, mesh, shard)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.experts, mesh=mesh)
        fully_shard(model, mesh=mesh)
    seen: dict[str, list[float]] = {}
    _capture(model, seen)
    kwargs = {"module_types": (GroupedExperts, nn.Linear)} if layout == "tp_named" else {}
    monitor = TensorStatsMonitor(kinds=["activation", "dgrad"], kernel="eager", **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = ProcessGroups.from_device_mesh(mesh)
        with Vitals(
            [monitor], writer=RecordingWriter(), run_dir=run_dir, log_every_n_steps=1, groups=groups
        ) as vitals:
            vitals.attach(model, opt)
            x, route = _stream(rank if dim == "dp" else 0)
            vitals.batch(x)
            model(x, route).pow(2).mean().backward()
            opt.step()
    notes = [str(w.message) for w in caught if "TensorStatsMonitor" in str(w.message)]
    return {"seen": seen, "notes": notes}


def _records(run_dir: Path) -> dict[str, dict]:
    return {r["kind"]: r for r in read_lines(run_dir / "tensor_stats.jsonl")}


def _want(results: list[dict], kind: str, sites: tuple[str, ...], every_rank: bool) -> dict:
    """Each site's float64 values: every rank's (data parallel) or rank 0's (the ranks'
    copies)."""
    use = results if every_rank else results[:1]
    return {s: torch.tensor([v for r in use for v in r["seen"][f"{kind}/{s}"]]) for s in sites}


def _truth() -> dict[str, torch.Tensor]:
    """One process, no parallelism, float64: what the layer computes on stream 0."""
    model = MoE().double()
    seen: dict[str, list[float]] = {}
    _capture(model, seen)
    x, route = _stream(0)
    model(x.double(), route).pow(2).mean().backward()
    return {k: torch.tensor(v) for k, v in seen.items()}


@ranks.on_ranks(2, _body, CASE_DIR, "tp")
def test_tensor_parallel_experts_are_left_out_with_one_warning(ran) -> None:
    # Before: experts/output0 and the dgrad of experts/input0 were rank 0's partial sums
    # (kurtosis 6.42 against the layer's 4.63 in the probe), written as the layer's.
    run_dir, results = ran
    truth = _truth()
    # the construction is the layer's: the summed output's gradient reaches inp whole
    for key in ("activation/inp/output0", "dgrad/inp/output0", "activation/experts/input0"):
        for r in results:
            assert torch.allclose(torch.tensor(r["seen"][key]), truth[key], rtol=1e-4, atol=1e-5)
    # ... and the experts' own output on a rank is a partial sum, not the layer's
    part = torch.tensor(results[0]["seen"]["activation/experts/output0"])
    assert not torch.allclose(part, truth["activation/experts/output0"], rtol=1e-2, atol=1e-2)
    records = _records(run_dir)
    for kind in ("activation", "dgrad"):
        assert not [n for n in records[kind]["tensors"] if n.startswith("experts/")], kind
    # the other sites as before, exact (the tensor-parallel ranks' copies counted once)
    check_line(records["activation"], _want(results, "activation", INP, False), "activation")
    check_line(records["dgrad"], _want(results, "dgrad", INP[1:], False), "dgrad")
    # one warning (rank 0, at run start) naming the module and the way to record it anyway
    notes = [n for n in results[0]["notes"] if "tensor-parallel" in n]
    assert len(notes) == 1, results[0]["notes"]
    assert "experts" in notes[0] and "module_types" in notes[0] and "moe_tp_experts" in notes[0]
    assert not [n for n in results[1]["notes"] if "tensor-parallel" in n]


@ranks.on_ranks(2, _body, CASE_DIR, "tp_named")
def test_named_experts_class_is_recorded_under_tensor_parallelism(ran) -> None:
    run_dir, results = ran
    records = _records(run_dir)
    # the user's choice: what the module returns on the rank (here a partial sum), as named
    check_line(records["activation"], _want(results, "activation", INP + EXP, False), "act")
    check_line(records["dgrad"], _want(results, "dgrad", INP[1:] + EXP, False), "dgrad")
    assert not [n for r in results for n in r["notes"] if "tensor-parallel" in n]


@ranks.on_ranks(2, _body, CASE_DIR, "fsdp")
def test_fsdp2_sharded_experts_stay_a_default_site(ran) -> None:
    # FSDP2's Shard(0) over dp (inside dp_cp) keeps whole activations: a site, both ranks'
    # tokens merged
    run_dir, results = ran
    records = _records(run_dir)
    check_line(records["activation"], _want(results, "activation", INP + EXP, True), "act")
    check_line(records["dgrad"], _want(results, "dgrad", INP[1:] + EXP, True), "dgrad")
    assert not [n for r in results for n in r["notes"] if "tensor-parallel" in n]
