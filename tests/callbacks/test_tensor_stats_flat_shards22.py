"""TensorStatsMonitor under FSDP1 and DeepSpeed, whose parameters and gradients are flat
plain-tensor shards: no param/grad lines (they held one rank's shard as the whole tensor's),
one warning naming FSDP2 as the fix, activation and dgrad lines kept and exact.

Before: under FSDP1 on 2 ranks (``use_orig_params=True``, root only wrapped) the ``2.weight``
line held 14 of its 30 elements (RMS 0.2576 for 0.2478), ``4.weight`` none, and under
``use_orig_params=False`` one ``_flat_param`` line stood for the whole model; no warning.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.helpers.shared_ranks import CASE_DIR, SharedRanks
from tests.scripts.vitals_testing import NullWriter
from tests.stats.test_moments import assert_written_moments
from trainvitals.adapters.context import RunContext
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor
from trainvitals.distributed import ProcessGroups

ranks = SharedRanks(__name__)
case_runs, ran = ranks.fixtures()

STEPS = 2
SITES = [f"{i}/{s}" for i in (0, 2, 4) for s in ("input0", "output0")]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _lines(path: Path) -> dict[tuple[int, str], dict]:
    return {
        (r["step"], r["kind"]): r["tensors"] for r in map(json.loads, path.read_text().splitlines())
    }


def _flat_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "flat shard" in str(w.message)]


def _replica_sites(replica: nn.Module, x: torch.Tensor) -> tuple[dict, dict]:
    """float64 activations and dgrads of every site of an unsharded replica on ``x``."""
    acts: dict[str, torch.Tensor] = {}
    kept: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module, args, output):
            for site, t in ((f"{name}/input0", args[0]), (f"{name}/output0", output)):
                acts[site] = t.detach().clone()
                if t.requires_grad:
                    t.retain_grad()
                    kept[site] = t

        return record

    handles = [
        m.register_forward_hook(hook(n))
        for n, m in replica.named_children()
        if isinstance(m, nn.Linear)
    ]
    replica(x).pow(2).mean().backward()
    for h in handles:
        h.remove()
    return acts, {site: t.grad.detach().clone() for site, t in kept.items()}


# ---------------------------------------------------------------------------- FSDP1, 2 ranks


def _fsdp1_body(rank: int, world_size: int, run_dir: str, orig: bool, wrap: bool, inner: bool):
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from trainvitals.stats.norms import canonical_name

    model = _model()
    replica = _model().double()
    policy = {"auto_wrap_policy": ModuleWrapPolicy({nn.Linear})} if wrap else {}
    # (device_id=cpu: FSDP1 runs on CPU over gloo; without it FSDP1 asks for an accelerator)
    fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=orig, **policy)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    acts, dgrads = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals(
            [TensorStatsMonitor(kernel="eager")],
            writer=NullWriter(),
            run_dir=run_dir,
            log_every_n_steps=1,
            groups=ProcessGroups(dp=dist.group.WORLD),
        ) as vitals:
            # the inner module of a root-only wrap: only its parameters tell FSDP1
            vitals.attach(fsdp.module if inner else fsdp, opt)
            for step in range(STEPS):
                with FSDP.summon_full_params(fsdp):
                    whole = {canonical_name(n): p.detach() for n, p in fsdp.named_parameters()}
                    replica.load_state_dict(whole)
                g = torch.Generator().manual_seed(100 * step + rank)
                x = 1 + 2 * torch.randn(5, 4, generator=g)
                a, d = _replica_sites(replica, x.double())
                acts.append(a)
                dgrads.append(d)
                vitals.batch(x)
                fsdp(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    return {"acts": acts, "dgrads": dgrads, "warned": _flat_warnings(caught)}


def _check_fsdp1(ran) -> None:
    run_dir, results = ran
    lines = _lines(run_dir / "tensor_stats.jsonl")
    # (before: param and grad lines of one rank's shards, no warning)
    assert {kind for _, kind in lines} == {"activation", "dgrad"}
    said = results[0]["warned"]
    assert len(said) == 1, said
    for words in ("FSDP1", "fully_shard", "ModelParallelStrategy", "fsdp_version=2"):
        assert words in said[0], (words, said[0])
    assert results[1]["warned"] == []  # rank 0 warns, for the run
    for step in range(STEPS):
        for kind, key in (("activation", "acts"), ("dgrad", "dgrads")):
            want = {
                site: torch.cat([torch.from_numpy(r[key][step][site]) for r in results])
                for site in results[0][key][step]
            }
            assert_written_moments(lines[(step, kind)], want, f"step {step} {kind}")
    assert set(results[0]["acts"][0]) == set(SITES)


@ranks.on_ranks(2, _fsdp1_body, CASE_DIR, True, True, False)
def test_fsdp1_orig_params_wrapped_linears(ran) -> None:
    _check_fsdp1(ran)


@ranks.on_ranks(2, _fsdp1_body, CASE_DIR, False, False, False)
def test_fsdp1_flat_parameter_root_only(ran) -> None:
    _check_fsdp1(ran)


@ranks.on_ranks(2, _fsdp1_body, CASE_DIR, True, False, True)
def test_fsdp1_inner_module_of_a_root_only_wrap(ran) -> None:
    _check_fsdp1(ran)


# ------------------------------------------------------------------- DeepSpeed (stand-in)


class DeepSpeedEngine(nn.Module):
    """Stands in for ``deepspeed.DeepSpeedEngine`` (not installed): the wrapper that
    ``deepspeed.initialize`` and Accelerate's ``prepare`` return, the model in ``module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _run_one(model: nn.Module, forward: nn.Module, run_dir: Path) -> tuple[list[str], list]:
    """Two steps of ``forward`` with a TensorStatsMonitor attached to ``model``; the flat-shard
    warnings and the inputs of every step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals(
            [TensorStatsMonitor(kernel="eager")],
            writer=NullWriter(),
            run_dir=run_dir,
            log_every_n_steps=1,
        ) as vitals:
            vitals.attach(model, opt)
            for step in range(STEPS):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
                seen.append(x.double())
                vitals.batch(x)
                forward(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    return _flat_warnings(caught), seen


def test_deepspeed_engine_leaves_param_and_grad_out(tmp_path) -> None:
    engine = DeepSpeedEngine(_model())
    said, seen = _run_one(engine, engine, tmp_path / "ds")
    assert len(said) == 1 and "DeepSpeed" in said[0] and "fully_shard" in said[0], said
    lines = _lines(tmp_path / "ds" / "tensor_stats.jsonl")
    assert {kind for _, kind in lines} == {"activation", "dgrad"}  # (before: param, grad too)
    for step in range(STEPS):
        got = {k: v for k, v in lines[(step, "activation")].items() if k == "0/input0"}
        assert_written_moments(got, {"0/input0": seen[step]}, f"step {step}")

    # the same model unwrapped is whole on one process: every kind, no warning
    model = _model()
    said, _ = _run_one(model, model, tmp_path / "plain")
    assert said == []
    kinds = {kind for _, kind in _lines(tmp_path / "plain" / "tensor_stats.jsonl")}
    assert kinds == {"param", "grad", "activation", "dgrad"}


def test_layouts_told_by_strategy_accelerator_or_parameters(tmp_path) -> None:
    """What tells the layout where the model alone does not: the Lightning strategy (its
    model is the LightningModule), Accelerate's distributed type, a ZeRO-3 parameter; FSDP2
    and a plain run are left alone."""
    strategies = pytest.importorskip("lightning.pytorch.strategies")
    from accelerate.utils import DistributedType

    def said(model: nn.Module, **ctx: object) -> list[str]:
        """The flat-shard warnings of a monitor's run start in the context ``ctx``."""
        monitor = TensorStatsMonitor(kernel="eager")
        run = RunContext(writer=NullWriter(), groups=ProcessGroups(), run_dir=tmp_path, model=model)
        for key, value in ctx.items():
            setattr(run, key, value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            monitor.run_start(run)
            monitor.run_end(run)
        return _flat_warnings(caught)

    def trainer(strategy: object) -> SimpleNamespace:
        return SimpleNamespace(strategy=strategy)

    def accelerator(kind: DistributedType, fsdp2: bool = False) -> SimpleNamespace:
        return SimpleNamespace(distributed_type=kind, is_fsdp2=fsdp2)

    class DeepSpeedStrategy:  # (lightning's needs deepspeed installed to be made)
        pass

    plain = _model()
    zero3 = _model()
    zero3[2].weight.ds_tensor = torch.empty(0)  # a ZeRO-3 partition (this rank's part)
    flat = {
        "FSDP1": [
            said(plain, trainer=trainer(strategies.FSDPStrategy())),
            said(plain, accelerator=accelerator(DistributedType.FSDP)),
        ],
        "DeepSpeed": [
            said(plain, trainer=trainer(DeepSpeedStrategy())),
            said(plain, accelerator=accelerator(DistributedType.DEEPSPEED)),
            said(zero3),
        ],
    }
    for layout, runs in flat.items():
        for i, warned in enumerate(runs):
            assert len(warned) == 1 and warned[0].startswith(f"TensorStatsMonitor: {layout}"), (
                layout,
                i,
                warned,
            )
    # FSDP2 (DTensor shards, measured exactly) and a plain run
    assert said(plain, trainer=trainer(strategies.ModelParallelStrategy())) == []
    assert said(plain, accelerator=accelerator(DistributedType.FSDP, fsdp2=True)) == []
    assert said(plain, accelerator=accelerator(DistributedType.MULTI_CPU)) == []
    assert said(plain) == []
