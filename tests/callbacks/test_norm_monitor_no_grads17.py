"""NormMonitor at a step without gradients (no backward: a Lightning ``training_step`` returning
None for every micro-batch): no gradient-norm key is written where every gradient it covers is
None on every rank of its reduction (0.0 would read as vanishing gradients), the parameter
keys stay, and a step with some gradients keeps its values (a missing gradient counts 0).
Checked with the driver in one process and on 2 gloo ranks, against float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import RecordingWriter
from tests.helpers.dist import run_distributed
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.norm_monitor import NormMonitor

REL = 1e-6
NAMES = ("0.weight", "0.bias", "1.weight", "1.bias")


def _norm64(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


def test_a_step_without_backward_writes_no_grad_norm_and_a_partial_one_keeps_its_values():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    refs: dict[int, dict[str, float]] = {}
    g = torch.Generator().manual_seed(1)
    monitor = NormMonitor(per_param="*", per_param_kinds=("grad", "param"))
    no_grads = pytest.warns(RuntimeWarning, match="no parameter has a gradient")
    with no_grads, Vitals([monitor], writer=writer, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        for step in range(4):
            x = torch.randn(5, 3, generator=g)
            vitals.batch(x)
            if step == 1:
                pass  # no backward: every .grad is None
            elif step == 2:
                model[1](x.new_ones(5, 4)).pow(2).sum().backward()  # layer 0: no gradient
            else:
                model(x).pow(2).sum().backward()
            params = dict(zip(NAMES, model.parameters(), strict=True))
            grads = {n: p.grad for n, p in params.items() if p.grad is not None}
            refs[step] = {f"l2_norm/param/{n}": _norm64([p]) for n, p in params.items()}
            refs[step] |= {f"l2_norm/grad/{n}": _norm64([t]) for n, t in grads.items()}
            refs[step]["l2_norm/param/global"] = _norm64(list(params.values()))
            if grads:
                refs[step]["l2_norm/grad/global"] = _norm64(list(grads.values()))
            refs[step]["l2_norm/grad/nonfinite_count"] = 0.0
            opt.step()
            opt.zero_grad()
    assert sorted(writer.steps) == [0, 1, 2, 3]
    for step, row in writer.steps.items():
        assert sorted(row) == sorted(refs[step]), step
        for key, value in refs[step].items():
            assert row[key] == pytest.approx(value, rel=REL, abs=0.0), (step, key)
    assert "l2_norm/grad/global" not in writer.steps[1]  # was 0.0
    assert "l2_norm/param/global" in writer.steps[1]
    assert sorted(k for k in writer.steps[2] if k.startswith("l2_norm/grad/1.")) == [
        "l2_norm/grad/1.bias",
        "l2_norm/grad/1.weight",
    ]


def test_an_optimizer_without_gradients_writes_no_grad_norm_of_its_own():
    # two optimizers stepped apart in the driver: the one whose parameters got no gradient
    # writes its parameter norm but no gradient norm; a step where neither got one writes no
    # gradient norm at all
    torch.manual_seed(0)
    a, b = nn.Linear(3, 4), nn.Linear(4, 2)
    model = nn.ModuleDict({"a": a, "b": b})
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    writer = RecordingWriter()
    refs: dict[int, dict[str, float]] = {}
    g = torch.Generator().manual_seed(2)
    no_grads = pytest.warns(RuntimeWarning, match="no parameter has a gradient")
    with no_grads, Vitals([NormMonitor()], writer=writer, log_every_n_steps=1) as vitals:
        vitals.attach(model, [opt_a, opt_b])
        for step in range(3):
            x = torch.randn(5, 3, generator=g)
            vitals.batch(x)
            if step == 0:
                b(a(x)).pow(2).sum().backward()
            elif step == 1:
                a(x).pow(2).sum().backward()  # b: no gradient
            pa, pb = list(a.parameters()), list(b.parameters())
            ga = [p.grad for p in pa if p.grad is not None]
            gb = [p.grad for p in pb if p.grad is not None]
            ref = {
                "l2_norm/param/global": _norm64(pa + pb),
                "l2_norm/param/optimizer_0": _norm64(pa),
                "l2_norm/param/optimizer_1": _norm64(pb),
                "l2_norm/grad/nonfinite_count": 0.0,
            }
            if ga or gb:
                ref["l2_norm/grad/global"] = _norm64(ga + gb)
            if ga:
                ref["l2_norm/grad/optimizer_0"] = _norm64(ga)
            if gb:
                ref["l2_norm/grad/optimizer_1"] = _norm64(gb)
            refs[step] = ref
            opt_a.step()
            opt_b.step()
            opt_a.zero_grad()
            opt_b.zero_grad()
    assert sorted(writer.steps) == [0, 1, 2]
    assert "l2_norm/grad/optimizer_1" in writer.steps[0]
    assert "l2_norm/grad/optimizer_1" not in writer.steps[1]  # was 0.0
    assert not any(k.startswith("l2_norm/grad/optimizer_") for k in writer.steps[2])
    for step, row in writer.steps.items():
        assert sorted(row) == sorted(refs[step]), step
        for key, value in refs[step].items():
            assert row[key] == pytest.approx(value, rel=REL, abs=0.0), (step, key)


# ------------------------------------------------------------------------- 2 gloo ranks

SHARD_ROWS = 2  # rows of each rank's shard of ``w`` (Shard(0) over the 2 ranks)


def _local_grad(rank: int) -> torch.Tensor:
    return torch.randn(SHARD_ROWS, 3, generator=torch.Generator().manual_seed(50 + rank))


def _sharded_body(rank: int, world_size: int) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from trainvitals.distributed import ProcessGroups, collective_counter

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Module()
    full_w = torch.randn(SHARD_ROWS * world_size, 3)  # the same on every rank (same seed)
    model.w = nn.Parameter(distribute_tensor(full_w, mesh, [Shard(0)]))
    model.c = nn.Parameter(torch.randn(5))  # a plain replica, never given a gradient
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    writer = RecordingWriter()
    out: dict = {"params": [], "all_reduce": []}
    monitor = NormMonitor(per_param="*")
    groups = ProcessGroups.from_device_mesh(mesh)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "NormMonitor: no parameter has a gradient")
        with Vitals([monitor], writer=writer, log_every_n_steps=1, groups=groups) as vitals:
            vitals.attach(model, opt)
            for step in range(3):
                vitals.batch(torch.zeros(1))
                # step 0: both ranks hold their shard's gradient; step 1: only rank 1 does;
                # step 2: no rank does
                if step == 0 or (step == 1 and rank == 1):
                    model.w.grad = DTensor.from_local(_local_grad(rank), mesh, [Shard(0)])
                out["params"].append(
                    [float(model.w.full_tensor().double().norm()), float(model.c.double().norm())]
                )
                before = collective_counter["all_reduce"]
                opt.step()
                out["all_reduce"].append(collective_counter["all_reduce"] - before)
                opt.zero_grad()
    out["steps"] = writer.steps
    return out


@pytest.mark.slow
def test_two_ranks_a_gradient_on_one_rank_is_written_and_none_on_any_is_not():
    results = run_distributed(_sharded_body, 2, timeout=90)
    full = torch.cat([_local_grad(0), _local_grad(1)]).double()
    grad_ref = {
        0: float(full.norm()),
        1: float(_local_grad(1).double().norm()),  # rank 0's shard without gradient counts 0
    }
    for rank, res in enumerate(results):
        for step, row in sorted(res["steps"].items()):
            w_norm, c_norm = res["params"][step]
            assert row["l2_norm/param/global"] == pytest.approx(math.hypot(w_norm, c_norm), rel=REL)
            assert row["l2_norm/grad/nonfinite_count"] == 0
            assert "l2_norm/grad/c" not in row  # no rank ever had its gradient
            grad_keys = sorted(k for k in row if k.startswith("l2_norm/grad/") and "count" not in k)
            if step in grad_ref:
                # rank 0 at step 1 holds no gradient, but rank 1 of w's reduction does
                assert grad_keys == ["l2_norm/grad/global", "l2_norm/grad/w"], (rank, step)
                assert row["l2_norm/grad/global"] == pytest.approx(grad_ref[step], rel=REL)
                assert row["l2_norm/grad/w"] == pytest.approx(grad_ref[step], rel=REL)
            else:
                assert grad_keys == [], (rank, step)  # was l2_norm/grad/global = 0.0
        assert sorted(res["steps"]) == [0, 1, 2]
        # the gradients' presence rides in the one all-reduce of w's shard group
        assert res["all_reduce"] == [1, 1, 1]
