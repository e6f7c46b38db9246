"""TensorStatsMonitor on sharded layouts the other distributed tests leave out (gloo, 4 ranks).

FSDP2 with a bf16 ``MixedPrecisionPolicy`` and gradient accumulation
(``set_requires_gradient_sync(False)`` on the first micro-batch), parameters whose dim 0 does
not divide by 4 (shards of 2, 2, 1, 0 rows; a one-element bias held by rank 0 alone); HSDP on a
(``dp_replicate``, ``dp_shard``) mesh; tensor parallelism with activation sites whose input and
output are DTensors (``use_local_output=False``, ``SequenceParallel`` norms as sites) and a
column-parallel layer of 3 rows over 4 ranks. Every statistic must equal the float64
statistic of the whole tensor: parameters and gradients gathered with ``full_tensor()``,
activations and dgrads as the model produced them on every rank (gathered), or, for tensor
parallelism, from the same seeded model unsharded in float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.shared_ranks import CASE_DIR, SharedRanks
from tests.scripts.vitals_testing import NullWriter
from tests.stats.test_moments import assert_written_moments

pytestmark = pytest.mark.slow

ranks = SharedRanks(__name__)
case_runs, ran = ranks.fixtures()


def _lines(run_dir: Path) -> dict[str, dict]:
    text = (run_dir / "tensor_stats.jsonl").read_text()
    return {r["kind"]: r["tensors"] for r in map(json.loads, text.splitlines())}


# ------------------------------------------------------------------ FSDP2: uneven, bf16, HSDP


class Uneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)  # 5 rows over 4 ranks: 2, 2, 1, 0
        self.b = nn.Linear(5, 3)
        self.c = nn.Linear(3, 1)  # a bias of one element: rank 0's alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.tanh(self.a(x)))))


def _keep_sites(
    model: nn.Module,
    out: dict[str, dict[str, list[torch.Tensor]]],
    names: tuple[str, ...] = ("a", "b", "c"),
) -> list:
    """The test's own record of every site's tensors and their gradients (modules ``names``),
    as the model made them on this rank (bf16 under the mixed-precision policy), in float64."""

    def keep(kind: str, site: str, t: torch.Tensor) -> None:
        out[kind].setdefault(site, []).append(t.detach().double().reshape(-1).clone())

    def hook(name: str):
        def fn(module, args, output):
            for suffix, t in (("input0", args[0]), ("output0", output)):
                keep("activation", f"{name}/{suffix}", t)
                if t.requires_grad:
                    t.register_hook(lambda g, s=f"{name}/{suffix}": keep("dgrad", s, g))

        return fn

    return [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]


def _fsdp_body(rank: int, world_size: int, run_dir: str, layout: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups

    torch.manual_seed(0)
    model = Uneven()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        fully_shard(model, mesh=mesh)
        micro = 1
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for name in ("a", "b", "c"):
            fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        micro = 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[str, dict[str, list[torch.Tensor]]] = {"activation": {}, "dgrad": {}}
    handles = _keep_sites(model, seen)
    with Vitals(
        [TensorStatsMonitor(kernel="eager")],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=ProcessGroups.from_device_mesh(mesh),
        accumulate_grad_batches=micro,
    ) as vitals:
        vitals.attach(model, opt)
        for m in range(micro):
            g = torch.Generator().manual_seed(10 * rank + m)
            x = 1 + 2 * torch.randn(4, 6, generator=g)
            vitals.batch(x)
            if micro > 1:  # the gradients are reduce-scattered after the last micro-batch only
                model.set_requires_gradient_sync(m == micro - 1)
            (model(x) ** 2).sum().backward()
        whole = {
            kind: {
                n: (p if kind == "param" else p.grad).full_tensor().detach().double().numpy()
                for n, p in model.named_parameters()
            }
            for kind in ("param", "grad")
        }
        local_rows = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
        opt.step()
    for h in handles:
        h.remove()
    sites = {k: {s: torch.cat(v).numpy() for s, v in d.items()} for k, d in seen.items()}
    every = [None] * world_size
    dist.all_gather_object(every, sites)
    return {"whole": whole, "sites": every, "rows": local_rows}


def _check_fsdp(ran) -> list[dict]:
    run_dir, results = ran
    lines = _lines(run_dir)
    r0 = results[0]
    for kind in ("param", "grad"):
        want = {n: torch.from_numpy(a) for n, a in r0["whole"][kind].items()}
        assert_written_moments(lines[kind], want, kind)
    for kind in ("activation", "dgrad"):  # every rank's tokens (all ranks' data differ)
        want = {
            s: torch.cat([torch.from_numpy(r[kind][s]) for r in r0["sites"]])
            for s in r0["sites"][0][kind]
        }
        assert_written_moments(lines[kind], want, kind)
    return results


@ranks.on_ranks(4, _fsdp_body, CASE_DIR, "mp")
def test_fsdp2_bf16_policy_accumulation_and_empty_shards(ran) -> None:
    results = _check_fsdp(ran)
    assert [r["rows"]["a.weight"] for r in results] == [2, 2, 1, 0]
    assert [r["rows"]["c.bias"] for r in results] == [1, 0, 0, 0]


@ranks.on_ranks(4, _fsdp_body, CASE_DIR, "hsdp")
def test_hsdp_replicate_by_shard_mesh(ran) -> None:
    results = _check_fsdp(ran)
    assert [r["rows"]["a.weight"] for r in results] == [3, 2, 3, 2]


# ------------------------------------------------------------ tensor parallel: DTensor sites

B, S, D, H, OUT = 2, 8, 8, 6, 3  # H = 6 over 4 tp ranks: 2, 2, 2, 0; OUT = 3: 1, 1, 1, 0


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.norm(x)))))


def _sequence() -> torch.Tensor:
    return 2 + torch.randn(B, S, D, generator=torch.Generator().manual_seed(50))


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y**2).sum() + y[..., 0].sum()


def _tp_body(rank: int, world_size: int, run_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = TPNet()
    # every site's input is a DTensor (Shard(1) into the norm; Replicate into up; Shard(-1)
    # into down; Shard(1) into head), and so are the outputs of norm, up and down
    parallelize_module(
        model,
        mesh,
        {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
            "down": RowwiseParallel(
                input_layouts=Shard(-1), output_layouts=Shard(1), use_local_output=False
            ),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    # (torch's SGD cannot update head: its gradient comes back Replicate on the uneven shards)
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if "head" not in n], lr=0.1)
    x = _sequence()[:, rank * S // world_size : (rank + 1) * S // world_size]
    with Vitals(
        [TensorStatsMonitor(kernel="eager", module_types=(nn.Linear, nn.LayerNorm))],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=ProcessGroups.from_device_mesh(mesh),
    ) as vitals:
        vitals.attach(model, opt)
        vitals.batch(x)
        _loss(model(x)).backward()
        grads = {
            n: p.grad.full_tensor().detach().double().numpy() for n, p in model.named_parameters()
        }
        rows = model.up.weight.to_local().shape[0]
        opt.step()
    return {"grads": grads, "rows": rows}


def _tp_float64() -> dict[str, dict[str, torch.Tensor]]:
    """float64, one process, the whole sequence through the unsharded model."""
    out: dict[str, dict[str, list[torch.Tensor]]] = {"activation": {}, "dgrad": {}}
    torch.manual_seed(0)
    model = TPNet().double()
    _keep_sites(model, out, ("norm", "up", "down", "head"))
    _loss(model(_sequence().double())).backward()
    want = {k: {s: torch.cat(v) for s, v in d.items()} for k, d in out.items()}
    want["param"] = {n: p.detach() for n, p in model.named_parameters()}
    want["grad"] = {n: p.grad for n, p in model.named_parameters()}
    return want


@ranks.on_ranks(4, _tp_body, CASE_DIR)
def test_tensor_parallel_dtensor_sites_and_empty_shards(ran) -> None:
    run_dir, results = ran
    assert [r["rows"] for r in results] == [2, 2, 2, 0]
    lines = _lines(run_dir)
    want = _tp_float64()
    for kind in ("param", "activation", "dgrad"):
        assert_written_moments(lines[kind], want[kind], kind)
    # the gradients against float64 and against torch's own gather
    assert_written_moments(lines["grad"], want["grad"], "grad")
    gathered = {n: torch.from_numpy(a) for n, a in results[0]["grads"].items()}
    assert_written_moments(lines["grad"], gathered, "grad (full_tensor)")
