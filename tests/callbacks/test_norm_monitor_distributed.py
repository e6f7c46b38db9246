"""NormMonitor on real gloo processes: DDP, FSDP2, FSDP2+TP, and Lightning DDP / ModelParallel.

Every norm is compared with a float64 computation on the whole, unsharded model: either the same
seeded model rebuilt here in one process in float64 and fed the union of all ranks' data, or the
full tensors gathered with ``full_tensor()`` and normed in float64.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import (
    MLP,
    RecordingWriter,
    TiedLM,
    check_lightning_norms,
    float64_norms,
    float64_reference_norms,
    lm_loss,
    mlp_batch,
    mlp_loss,
)
from tests.helpers.shared_ranks import CASE_DIR, SharedRanks
from tests.scripts.vitals_testing import quiet_trainer

pytestmark = pytest.mark.slow

STEPS = 2
LR = 0.5
REL = 2e-5  # fp32 training vs the float64 rebuild, after at most one SGD step


# ----------------------------------------------------------- ranks shared by the cases of a file
# (tests/helpers/shared_ranks.py: one set of gloo processes per world size runs every case)

ranks = SharedRanks(__name__)
on_ranks = ranks.on_ranks
case_runs, ran = ranks.fixtures()


def _lm_batch(dp_rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, 13, (4, 6), generator=g)


def _train(model, opt, batches, monitor, groups=None):
    """The plain loop with the driver; returns what this rank's writer received."""
    from trainvitals.adapters.loop import Vitals
    from trainvitals.distributed import collective_counter

    writer = RecordingWriter()
    counts = []
    with Vitals([monitor], writer=writer, log_every_n_steps=1, groups=groups) as vitals:
        vitals.attach(model, opt)
        for step, (x, loss_fn) in enumerate(batches):
            vitals.batch(x)
            loss_fn(model, x).backward()
            before = collective_counter["all_reduce"]
            opt.step()  # the driver's pre-hook runs NormMonitor here
            counts.append(collective_counter["all_reduce"] - before)
            opt.zero_grad()
            assert step < STEPS
    return {"steps": writer.steps, "all_reduce_per_step": counts}


# ------------------------------------------------------------------------------------ DDP


def _ddp_body(rank: int, world_size: int) -> dict:
    from trainvitals.callbacks.norm_monitor import NormMonitor

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(TiedLM())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = [(_lm_batch(rank, s), lm_loss) for s in range(STEPS)]
    return _train(model, opt, batches, NormMonitor(per_param="up.weight"))


@on_ranks(2, _ddp_body)
def test_ddp_replicas_are_not_counted_twice(ran):
    _, results = ran
    ref = float64_reference_norms(TiedLM, _lm_batch, lm_loss, 2, STEPS, LR)
    for res in results:
        for step in range(STEPS):
            row = res["steps"][step]
            assert row["l2_norm/param/global"] == pytest.approx(ref[step][0], rel=REL)
            assert row["l2_norm/grad/global"] == pytest.approx(ref[step][1], rel=REL)
        assert res["all_reduce_per_step"] == [0] * STEPS  # replicas: nothing to reduce


# ------------------------------------------------------------------------------------ FSDP2


def _fsdp2_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainvitals.callbacks.norm_monitor import NormMonitor
    from trainvitals.distributed import ProcessGroups

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = TiedLM()
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the tied embedding/head lives in the root unit
    assert type(model.embed.weight).__name__ == "DTensor"
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = [(_lm_batch(rank, s), lm_loss) for s in range(STEPS)]
    monitor = NormMonitor(per_param=["embed.weight", "down.weight"])
    out = _train(model, opt, batches, monitor, groups=ProcessGroups.from_device_mesh(mesh))
    return out


def _per_param_reference(step: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = TiedLM().double()
    for s in range(step + 1):
        model.zero_grad()
        (sum(lm_loss(model, _lm_batch(r, s)) for r in range(2)) / 2).backward()
        if s < step:
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
    return {n: float(p.grad.norm()) for n, p in model.named_parameters()}


@on_ranks(2, _fsdp2_body)
def test_fsdp2_shards_are_summed_once(ran):
    _, results = ran
    ref = float64_reference_norms(TiedLM, _lm_batch, lm_loss, 2, STEPS, LR)
    per_param = _per_param_reference(1)
    for res in results:
        for step in range(STEPS):
            row = res["steps"][step]
            assert row["l2_norm/param/global"] == pytest.approx(ref[step][0], rel=REL)
            assert row["l2_norm/grad/global"] == pytest.approx(ref[step][1], rel=REL)
            assert row["l2_norm/grad/nonfinite_count"] == 0
        for name in ("embed.weight", "down.weight"):
            assert res["steps"][1][f"l2_norm/grad/{name}"] == pytest.approx(
                per_param[name], rel=REL
            )
        # parameters and gradients of every DTensor: one collective on the one shard group
        assert res["all_reduce_per_step"] == [1] * STEPS


# ------------------------------------------------------------------------------ FSDP2 + TP


def _fsdp_tp_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from trainvitals.callbacks.norm_monitor import NormMonitor
    from trainvitals.distributed import ProcessGroups

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = MLP()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    dp_rank = mesh.get_local_rank("dp")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches = [(mlp_batch(dp_rank, s), mlp_loss) for s in range(STEPS)]
    monitor = NormMonitor(per_param="*", per_param_kinds=("grad", "param"))
    out = _train(model, opt, batches, monitor, groups=ProcessGroups.from_device_mesh(mesh))
    out["placements"] = {n: str(p.placements) for n, p in model.named_parameters()}
    return out


@on_ranks(4, _fsdp_tp_body)
def test_fsdp2_tp_sums_shard_dims_never_replicate_dims(ran):
    _, results = ran
    ref = float64_reference_norms(MLP, mlp_batch, mlp_loss, 2, STEPS, LR)
    # the layout under test: sharded over dp and tp, over dp only, and Replicate over tp
    assert "Replicate()" in results[0]["placements"]["down.bias"]
    assert results[0]["placements"]["norm.weight"] == "(Shard(dim=0),)"
    torch.manual_seed(0)
    full = MLP().double()
    for res in results:
        for step in range(STEPS):
            row = res["steps"][step]
            assert row["l2_norm/param/global"] == pytest.approx(ref[step][0], rel=REL)
            assert row["l2_norm/grad/global"] == pytest.approx(ref[step][1], rel=REL)
        for name, p in full.named_parameters():  # step 0: the initial weights, per parameter
            expected = float(p.detach().norm())
            assert res["steps"][0][f"l2_norm/param/{name}"] == pytest.approx(expected, rel=1e-6)
        # one collective per distinct group (dp and tp), params and grads together
        assert res["all_reduce_per_step"] == [2] * STEPS


# ------------------------------------------------------------------------------- Lightning


def _lightning_body(rank: int, world_size: int, strategy_name: str, out_dir: str) -> dict:
    import lightning.pytorch as pl

    from trainvitals.callbacks.norm_monitor import NormMonitor

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = MLP()
            self.refs: dict[int, tuple[float, float]] = {}

        def configure_model(self) -> None:
            if strategy_name != "model_parallel":
                return
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            mesh = self.device_mesh
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            parallelize_module(self.model, mesh["tensor_parallel"], plan)
            fully_shard(self.model, mesh=mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            return mlp_loss(self.model, batch[0])

        def on_before_optimizer_step(self, optimizer):
            # independent float64 reference from the whole tensors (gathered when sharded)
            p2 = g2 = 0.0
            for p in self.parameters():
                full_p = p.full_tensor() if hasattr(p, "full_tensor") else p
                full_g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                p2 += float(full_p.detach().double().pow(2).sum())
                g2 += float(full_g.double().pow(2).sum())
            self.refs[self.trainer.global_step] = (math.sqrt(p2), math.sqrt(g2))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    if strategy_name == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    else:
        strategy = "ddp"
    x = torch.cat([mlp_batch(r, s) for s in range(STEPS) for r in range(2)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)
    writer = RecordingWriter()
    module = Lit()
    trainer = quiet_trainer(
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        log_every_n_steps=1,
        callbacks=[NormMonitor(writer=writer)],
        default_root_dir=out_dir,
    )
    trainer.fit(module, loader)
    from trainvitals.distributed import ProcessGroups

    return {
        "steps": writer.steps,
        "refs": module.refs,
        "sizes": ProcessGroups.from_strategy(trainer.strategy).sizes(),
        "dtensor": type(next(module.parameters())).__name__,
    }


@on_ranks(2, _lightning_body, "ddp", CASE_DIR, needs="lightning.pytorch")
def test_lightning_ddp_two_devices(ran):
    _, results = ran
    check_lightning_norms(results, STEPS)
    assert results[0]["dtensor"] == "Parameter"
    assert results[0]["sizes"]["dp"] == 2 and results[0]["sizes"]["tp"] == 1


@on_ranks(4, _lightning_body, "model_parallel", CASE_DIR, needs="lightning.pytorch")
def test_lightning_model_parallel_fsdp2_tp_four_devices(ran):
    _, results = ran
    check_lightning_norms(results, STEPS)
    assert results[0]["dtensor"] == "DTensor"
    assert results[0]["sizes"]["dp"] == 2 and results[0]["sizes"]["tp"] == 2


# -------------------------------------------------------------------------- pipeline stages


def _stage(rank: int) -> tuple[nn.Module, torch.Tensor]:
    """Pipeline stage ``rank``: its own layers (different shapes per stage) and input."""
    torch.manual_seed(rank)
    return nn.Sequential(nn.Linear(4 + rank, 3), nn.Tanh(), nn.Linear(3, 2)), torch.randn(
        5, 4 + rank
    )


def _pp_body(rank: int, world_size: int) -> dict:

    from trainvitals.callbacks.norm_monitor import NormMonitor
    from trainvitals.distributed import ProcessGroups, world_group

    model, x = _stage(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # "0.weight" exists on both stages; "9.*" on none: with pipeline stages that is a warning,
    # not an error (raising on one stage would leave the other waiting in the collective).
    globs = ["0.weight", "9.*"] if rank == 0 else ["0.weight"]
    monitor = NormMonitor(per_param=globs, per_param_kinds=("grad", "param"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _train(
            model,
            opt,
            [(x, lambda m, inp: m(inp).pow(2).sum())],
            monitor,
            groups=ProcessGroups(pp=world_group()),
        )
    out["warnings"] = [str(w.message) for w in caught]
    return out


@on_ranks(2, _pp_body)
def test_pipeline_stages_sum_their_totals(ran):
    _, results = ran
    p2 = g2 = 0.0
    for rank in range(2):
        model, x = _stage(rank)
        model.double()
        model(x.double()).pow(2).sum().backward()
        p, g = float64_norms(list(model.parameters()))
        p2, g2 = p2 + p**2, g2 + g**2
    for rank, res in enumerate(results):
        row = res["steps"][0]
        assert row["l2_norm/param/global"] == pytest.approx(math.sqrt(p2), rel=1e-6)
        assert row["l2_norm/grad/global"] == pytest.approx(math.sqrt(g2), rel=1e-6)
        # per-parameter keys are this stage's own
        model, _ = _stage(rank)
        assert row["l2_norm/param/0.weight"] == pytest.approx(
            float(model[0].weight.norm()), rel=1e-6
        )
        assert res["all_reduce_per_step"] == [1]  # the totals over the pipeline group
    assert any("9.*" in w for w in results[0]["warnings"])


def _fsdp2_nan_body(rank: int, world_size: int) -> dict:

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor
    from trainvitals.distributed import ProcessGroups

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = TiedLM()
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = RecordingWriter()
    groups = ProcessGroups.from_device_mesh(mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1, groups=groups) as v:
            v.attach(model, opt)
            ids = _lm_batch(rank, 0)
            v.batch(ids)
            lm_loss(model, ids).backward()
            if rank == 1:  # only rank 1's shard of one gradient goes bad
                model.down.weight.grad.to_local()[0, 0] = float("nan")
            opt.step()
    return {"steps": writer.steps, "warnings": [str(w.message) for w in caught]}


@on_ranks(2, _fsdp2_nan_body)
def test_fsdp2_nonfinite_shard_on_one_rank_is_seen_and_named_by_the_reporting_rank(ran):
    _, results = ran
    for res in results:
        assert res["steps"][0]["l2_norm/grad/nonfinite_count"] == 1
        assert math.isnan(res["steps"][0]["l2_norm/grad/global"])
    named = [w for w in results[0]["warnings"] if "NaN/Inf" in w]
    assert len(named) == 1 and "down.weight" in named[0]
    assert not [w for w in results[1]["warnings"] if "NaN/Inf" in w]  # one rank reports


# ------------------------------------------------------------- stats.norms on placements


def _local_part(rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))


def _placements_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from trainvitals.distributed import collective_counter
    from trainvitals.stats.norms import local_sq_norms, reduce_sq_norms, sharding_groups

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    local = _local_part(rank)
    tensors = [
        DTensor.from_local(local, mesh, [Partial()]),  # logical: the sum of the locals
        DTensor.from_local(local, mesh, [Partial("avg")]),  # logical: their mean
        DTensor.from_local(local, mesh, [Shard(0)]),  # logical: the locals stacked
        DTensor.from_local(_local_part(0), mesh, [Replicate()]),  # logical: one copy
        local,  # plain: a replica (or a whole tensor)
    ]
    before = sum(collective_counter.values())
    sq = reduce_sq_norms(local_sq_norms(tensors), [sharding_groups(t) for t in tensors])
    return {"sq": sq.tolist(), "collectives": sum(collective_counter.values()) - before}


@on_ranks(2, _placements_body)
def test_sq_norms_of_partial_shard_and_replicate_placements(ran):
    _, results = ran
    parts = [_local_part(r).double() for r in range(2)]
    expected = [
        float((parts[0] + parts[1]).pow(2).sum()),
        float(((parts[0] + parts[1]) / 2).pow(2).sum()),
        float(torch.cat(parts).pow(2).sum()),
        float(parts[0].pow(2).sum()),
    ]
    for rank, res in enumerate(results):
        assert res["sq"][:4] == pytest.approx(expected, rel=1e-6)
        assert res["sq"][4] == pytest.approx(float(parts[rank].pow(2).sum()), rel=1e-6)
        # one collective to sum the Partial tensors elementwise, one for the Shard sums
        assert res["collectives"] == 2
