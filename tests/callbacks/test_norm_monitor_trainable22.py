"""NormMonitor when what trains changes during the run: parameters added mid-run (LoRA adapters
given to the optimizer with ``add_param_group``), on one process and on 2 gloo ranks (plain
replicas, and FSDP2 with an adapter sharded mid-run).

The norms at a logging step are over the parameters that train at that step; every value is
compared with a float64 sum of squares computed here over those parameters (the whole,
unsharded tensors under FSDP2).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import RecordingWriter
from tests.helpers.shared_ranks import SharedRanks
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.norm_monitor import NormMonitor

REL = 1e-6
GROUP = r"^(backbone|head|adapter)\."
ADD_AT = 2  # the step before which the adapters are added
STEPS = 4


class _LoRA(nn.Module):
    """A frozen base layer plus a trainable low-rank update (``lora_b @ lora_a``)."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight)  # (not zero: its gradient reaches lora_a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)
        self.adapter: nn.Module | None = None  # added mid-run: a new group_by label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.backbone(x))
        if self.adapter is not None:
            h = h + self.adapter(h)
        return self.head(h)


def _add_adapters(model: _Net, opt: torch.optim.Optimizer) -> None:
    """LoRA on the backbone's first layer (new parameters in a known group) and a new
    top-level adapter (a new group), both given to the optimizer as PEFT users do."""
    model.backbone[0] = _LoRA(model.backbone[0])
    model.adapter = nn.Linear(4, 4)
    new = [p for n, p in model.named_parameters() if "lora_" in n or n.startswith("adapter.")]
    opt.add_param_group({"params": new})


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double()


def _reference(model: nn.Module) -> dict[str, float]:
    """float64 norms over the parameters that train now (requires_grad), by group too."""
    sq: dict[str, float] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        label = re.match(r"(backbone|head|adapter)\.", name).group(1)
        p_sq = float(_full(p).pow(2).sum())
        g_sq = 0.0 if p.grad is None else float(_full(p.grad).pow(2).sum())
        for key, value in (("param/global", p_sq), ("grad/global", g_sq)):
            sq[key] = sq.get(key, 0.0) + value
        for key, value in ((f"param/group/{label}", p_sq), (f"grad/group/{label}", g_sq)):
            sq[key] = sq.get(key, 0.0) + value
        sq[f"grad/{name}"] = g_sq
    return {f"l2_norm/{k}": math.sqrt(v) for k, v in sq.items()}


def _check(steps: dict[int, dict[str, float]], refs: list[dict[str, float]]) -> None:
    for step, ref in enumerate(refs):
        row = steps[step]
        groups = {k for k in row if "/group/" in k}
        assert groups == {k for k in ref if "/group/" in k}, step
        for key, value in ref.items():
            if key.startswith("l2_norm/grad/") and "/group/" not in key and "global" not in key:
                continue  # (per-parameter keys: checked where selected)
            assert row[key] == pytest.approx(value, rel=REL), (step, key)
    # the adapters' gradients are reported one by one once they train
    last = refs[-1]
    for key in ("l2_norm/grad/backbone.0.lora_a.weight", "l2_norm/grad/adapter.weight"):
        assert steps[STEPS - 1][key] == pytest.approx(last[key], rel=REL)
        assert key not in steps[0]


def _train(model, opt, monitor, batches, groups=None, sync=None) -> tuple[dict, list[dict]]:
    writer = RecordingWriter()
    refs = []
    with Vitals([monitor], writer=writer, log_every_n_steps=1, groups=groups) as vitals:
        vitals.attach(model, opt)
        for step, x in enumerate(batches):
            if step == ADD_AT:
                _add_adapters(model, opt)
            vitals.batch(x)
            model(x).pow(2).mean().backward()
            if sync is not None:
                sync(model)
            refs.append(_reference(model))
            opt.step()
            opt.zero_grad()
    return writer.steps, refs


def _monitor() -> NormMonitor:
    # (per_param globs must match a parameter at run start: "*" selects the later ones too)
    return NormMonitor(group_by=GROUP, per_param_kinds=("grad", "param"), per_param="*")


# --------------------------------------------------------------------------- one process


def test_parameters_added_mid_run_count_in_the_norms_and_their_new_group_appears():
    # Before the fix the monitor kept the parameters found at run start: from step 2 on the
    # adapters were in no norm (param/global 1.894 for 2.342, grad/global 1.302 for 1.379,
    # no group/adapter key, no per-parameter key for the LoRA weights).
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(3, 4) for _ in range(STEPS)]
    steps, refs = _train(model, opt, _monitor(), batches)
    assert "l2_norm/param/group/adapter" not in steps[ADD_AT - 1]
    assert "l2_norm/param/group/adapter" in steps[ADD_AT]
    _check(steps, refs)


# ------------------------------------------------------------------------- 2 gloo ranks

ranks = SharedRanks(__name__)
on_ranks = ranks.on_ranks
case_runs, ran = ranks.fixtures()


def _replicas_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    def average_grads(model: nn.Module) -> None:  # (what DDP does, on plain replicas)
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world_size

    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(3, 4, generator=g) for _ in range(STEPS)]
    steps, refs = _train(model, opt, _monitor(), batches, sync=average_grads)
    return {"steps": steps, "refs": refs}


@pytest.mark.slow
@on_ranks(2, _replicas_body)
def test_replicas_count_parameters_added_mid_run_alike_on_every_rank(ran):
    _, results = ran
    for res in results:
        _check(res["steps"], res["refs"])
    assert results[0]["steps"] == results[1]["steps"]


def _fsdp2_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainvitals.distributed import ProcessGroups

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    groups = ProcessGroups.from_device_mesh(mesh)
    torch.manual_seed(0)
    model = _Net()
    fully_shard(model.backbone, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(3, 4, generator=g) for _ in range(STEPS)]
    writer = RecordingWriter()
    refs = []
    with Vitals(
        [NormMonitor(group_by=GROUP, per_param_kinds=("grad", "param"))],
        writer=writer,
        log_every_n_steps=1,
        groups=groups,
    ) as vitals:
        vitals.attach(model, opt)
        for step, x in enumerate(batches):
            if step == ADD_AT:
                # a new group (its own FSDP2 unit, sharded on both ranks) given to the optimizer
                torch.manual_seed(1)
                model.adapter = nn.Linear(4, 4)
                fully_shard(model.adapter, mesh=mesh)
                opt.add_param_group({"params": list(model.adapter.parameters())})
            # FSDP2 keeps the unsharded parameters registered after backward (accumulation
            # style): the norms must still be the sharded ones', which hold the gradients
            model.set_reshard_after_backward(step % 2 == 0, recurse=True)
            vitals.batch(x)
            model(x).pow(2).mean().backward()
            trainable = [p for group in opt.param_groups for p in group["params"]]
            refs.append(
                {
                    "param": math.sqrt(sum(float(_full(p).pow(2).sum()) for p in trainable)),
                    "grad": math.sqrt(sum(float(_full(p.grad).pow(2).sum()) for p in trainable)),
                    "adapter": math.sqrt(
                        sum(float(_full(p).pow(2).sum()) for p in model.adapter.parameters())
                    )
                    if model.adapter is not None
                    else None,
                }
            )
            opt.step()
            opt.zero_grad()
    return {"steps": writer.steps, "refs": refs}


@pytest.mark.slow
@on_ranks(2, _fsdp2_body)
def test_fsdp2_adapter_sharded_mid_run_counts_in_the_norms(ran):
    _, results = ran
    for res in results:
        for step, ref in enumerate(res["refs"]):
            row = res["steps"][step]
            assert row["l2_norm/param/global"] == pytest.approx(ref["param"], rel=REL), step
            assert row["l2_norm/grad/global"] == pytest.approx(ref["grad"], rel=REL), step
            if ref["adapter"] is None:
                assert "l2_norm/param/group/adapter" not in row
            else:
                assert row["l2_norm/param/group/adapter"] == pytest.approx(ref["adapter"], rel=REL)
    assert results[0]["steps"] == results[1]["steps"]
