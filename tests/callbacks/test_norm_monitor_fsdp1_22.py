"""NormMonitor under FSDP1 (``FullyShardedDataParallel``) on real gloo CPU ranks.

FSDP1's flat shards are plain tensors: each rank of a unit's process group holds a disjoint
piece of every ``FlatParameter`` (padding is zeros), so the global sums of squares are the
local ones summed over the shard group (NO_SHARD: replicas, not summed; HYBRID_SHARD: summed
within a replica only). The global norms are compared with a float64 rebuild of the whole model
fed every rank's batch, and with FSDP1's own ``clip_grad_norm_`` total; per-parameter and
``group_by`` keys are left out with one warning.
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
    check_lightning_norms,
    float64_reference_norms,
    mlp_batch,
    mlp_loss,
)
from tests.helpers.shared_ranks import CASE_DIR, SharedRanks
from tests.scripts.vitals_testing import quiet_trainer

pytestmark = pytest.mark.slow

STEPS = 2
LR = 0.5
REL = 2e-5  # fp32 training vs the float64 rebuild, after at most one SGD step
GLOBAL_KEYS = {"l2_norm/param/global", "l2_norm/grad/global", "l2_norm/grad/nonfinite_count"}

ranks = SharedRanks(__name__)
on_ranks = ranks.on_ranks
case_runs, ran = ranks.fixtures()


def _fsdp1_body(rank: int, world_size: int, strategy: str, orig: bool, per_param: bool) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor
    from trainvitals.distributed import collective_counter

    kwargs = {}
    if strategy == "HYBRID_SHARD":
        from torch.distributed.device_mesh import init_device_mesh

        # 2 replicas of 2 shards: sharded over the inner dim, replicated over the outer
        kwargs["device_mesh"] = init_device_mesh("cpu", (2, world_size // 2))
    torch.manual_seed(0)
    model = FSDP(
        MLP(),
        # (device_id: FSDP1 refuses to pick a CPU device by itself, it accepts one given)
        device_id=torch.device("cpu"),
        sharding_strategy=getattr(ShardingStrategy, strategy),
        use_orig_params=orig,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),  # nested units; the root keeps the norm
        **kwargs,
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    monitor = (
        NormMonitor(per_param="*", per_param_kinds=("grad", "param"), group_by=r"^(up|down)\.")
        if per_param
        else NormMonitor()
    )
    writer = RecordingWriter()
    counts, clipped = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([monitor], writer=writer, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            for step in range(STEPS):
                x = mlp_batch(rank, step)
                vitals.batch(x)
                mlp_loss(model, x).backward()
                # FSDP1's own total (clipping to 1e30 leaves the gradients as they are)
                clipped.append(float(model.clip_grad_norm_(1e30)))
                before = collective_counter["all_reduce"]
                opt.step()  # the driver's pre-hook runs NormMonitor here
                counts.append(collective_counter["all_reduce"] - before)
                opt.zero_grad()
    messages = [str(w.message) for w in caught if "NormMonitor" in str(w.message)]
    return {
        "steps": writer.steps,
        "all_reduce_per_step": counts,
        "clipped": clipped,
        "warnings": messages,
    }


def _check(results: list[dict], dp_size: int, collectives: int) -> None:
    ref = float64_reference_norms(MLP, mlp_batch, mlp_loss, dp_size, STEPS, LR)
    for res in results:
        assert sorted(res["steps"]) == list(range(STEPS))
        for step in range(STEPS):
            row = res["steps"][step]
            assert set(row) == GLOBAL_KEYS  # no per-parameter value from a flat shard
            assert row["l2_norm/param/global"] == pytest.approx(ref[step][0], rel=REL)
            assert row["l2_norm/grad/global"] == pytest.approx(ref[step][1], rel=REL)
            assert row["l2_norm/grad/global"] == pytest.approx(res["clipped"][step], rel=1e-6)
            assert row["l2_norm/grad/nonfinite_count"] == 0
        # one collective per group, parameters and gradients together (replicas: none)
        assert res["all_reduce_per_step"] == [collectives] * STEPS
    assert results[0]["steps"] == results[1]["steps"]


CASES = [
    (strategy, orig)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    for orig in (False, True)
]
CASE_IDS = [f"{s}-{'orig' if o else 'flat'}" for s, o in CASES]


def _register(test):
    for (strategy, orig), case_id in zip(CASES, CASE_IDS, strict=True):
        test = on_ranks(2, _fsdp1_body, strategy, orig, False, param=case_id)(test)
    return test


@_register
@pytest.mark.parametrize(("strategy", "orig"), CASES, ids=CASE_IDS)
def test_fsdp1_global_norms_equal_the_whole_model(strategy, orig, ran):
    _, results = ran
    _check(results, dp_size=2, collectives=0 if strategy == "NO_SHARD" else 1)
    for res in results:
        assert res["warnings"] == []  # supported: not refused


@on_ranks(4, _fsdp1_body, "HYBRID_SHARD", True, False)
def test_fsdp1_hybrid_shard_sums_within_a_replica_only(ran):
    _, results = ran
    # summed over the replicas too, the norms would read sqrt(2) too large
    _check(results, dp_size=4, collectives=1)


@on_ranks(2, _fsdp1_body, "FULL_SHARD", False, True)
def test_fsdp1_per_parameter_keys_left_out_with_one_warning(ran):
    _, results = ran
    _check(results, dp_size=2, collectives=1)
    for res in results:
        per_param = [m for m in res["warnings"] if "per_param" in m]
        assert len(per_param) == 1 and "FSDP1" in per_param[0]


def _fsdp1_reach_body(rank: int, world_size: int, variant: str) -> dict:
    """``inner``: the monitor is given the inner module of the root unit (nested units found,
    the root's own flat shard out of reach). ``clip``: the loop clips with
    ``vitals.clip_grad_norm_`` (tiny max_norm: the gradients are scaled)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor

    torch.manual_seed(0)
    model = FSDP(
        MLP(),
        device_id=torch.device("cpu"),
        # (the root keeps MLP's other parameters: its own flat shard)
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    writer = RecordingWriter()
    returned = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1) as vitals:
            vitals.attach(model.module if variant == "inner" else model, opt)
            for step in range(STEPS):
                x = mlp_batch(rank, step)
                vitals.batch(x)
                mlp_loss(model, x).backward()
                if variant == "clip":
                    returned.append(float(vitals.clip_grad_norm_(model.parameters(), 1e-3)))
                opt.step()
                opt.zero_grad()
    messages = [str(w.message) for w in caught if "NormMonitor" in str(w.message)]
    return {"steps": writer.steps, "returned": returned, "warnings": messages}


@on_ranks(2, _fsdp1_reach_body, "inner")
def test_fsdp1_units_out_of_reach_write_nothing(ran):
    # Before: the root's flat shard, out of reach, was taken for whole tensors: rank 0 wrote a
    # grad norm 2% low and rank 1 a param norm 28% low, the ranks disagreeing.
    _, results = ran
    for res in results:
        assert res["steps"] == {}
        assert len([m for m in res["warnings"] if "outside the model" in m]) == 1


@on_ranks(2, _fsdp1_reach_body, "clip")
def test_fsdp1_clipping_through_the_driver_clips_by_the_total(ran):
    # torch.nn.utils.clip_grad_norm_ on flat shards clipped each rank by its own shard's norm
    # (2.88 and 2.65 for a total of 3.91) and the ranks' weights drifted apart.
    _, results = ran
    ref = float64_reference_norms(MLP, mlp_batch, mlp_loss, 2, STEPS, LR)
    for res in results:
        assert res["returned"][0] == pytest.approx(ref[0][1], rel=REL)
        # the norms are the unclipped ones, seen before the clipping
        assert res["steps"][0]["l2_norm/grad/global"] == pytest.approx(ref[0][1], rel=REL)
    assert results[0]["returned"] == results[1]["returned"]
    assert results[0]["steps"] == results[1]["steps"]


# ------------------------------------------------------------------------------- Lightning


def _lightning_body(rank: int, world_size: int, wrap: str, out_dir: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from trainvitals.callbacks.norm_monitor import NormMonitor

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning's FSDPStrategy, let onto CPU: the accelerator check accepts a subclass,
        and the wrapping passes a CPU ``device_id`` (Lightning's passes ``device_id=None``
        on CPU, which FSDP1 refuses without an accelerator). As Lightning's, the root unit
        wraps the LightningModule itself: outside ``pl_module``, in ``strategy.model``."""

        def _setup_model(self, model: nn.Module) -> nn.Module:
            return FSDP(model, device_id=torch.device("cpu"), **self.kwargs)

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = MLP()
            self.refs: dict[int, tuple[float, float]] = {}

        def training_step(self, batch, batch_idx):
            return mlp_loss(self.model, batch[0])

        def on_before_optimizer_step(self, optimizer):
            # independent float64 reference from the whole tensors, gathered on every rank
            root = self.trainer.strategy.model
            with FSDP.summon_full_params(root, with_grads=True):
                p2 = sum(float(p.detach().double().pow(2).sum()) for p in self.parameters())
                g2 = sum(float(p.grad.double().pow(2).sum()) for p in self.parameters())
            self.refs[self.trainer.global_step] = (math.sqrt(p2), math.sqrt(g2))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    x = torch.cat([mlp_batch(r, s) for s in range(STEPS) for r in range(2)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)
    writer = RecordingWriter()
    module = Lit()
    # "layers": a unit per Linear inside the LightningModule, the root one around it; "root":
    # the root unit alone, no FSDP1 module inside ``pl_module`` at all
    policy = {"auto_wrap_policy": ModuleWrapPolicy({nn.Linear})} if wrap == "layers" else {}
    trainer = quiet_trainer(
        devices=world_size,
        strategy=CPUFSDPStrategy(**policy),
        max_steps=STEPS,
        log_every_n_steps=1,
        callbacks=[NormMonitor(writer=writer)],
        default_root_dir=out_dir,
    )
    trainer.fit(module, loader)
    return {"steps": writer.steps, "refs": module.refs}


@on_ranks(2, _lightning_body, "layers", CASE_DIR, needs="lightning.pytorch", param="layers")
@on_ranks(2, _lightning_body, "root", CASE_DIR, needs="lightning.pytorch", param="root")
@pytest.mark.parametrize("wrap", ["layers", "root"])
def test_lightning_fsdp_strategy_two_cpu_devices(wrap, ran):
    _, results = ran
    check_lightning_norms(results, STEPS)
    assert all(set(row) == GLOBAL_KEYS for res in results for row in res["steps"].values())
