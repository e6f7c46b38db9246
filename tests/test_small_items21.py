"""Session 21 small items: tokens of a ``(features, labels)`` batch, float16 averages over
ranks, expert biases under Lightning's manual optimization, and rank 0's word on a memory key
another rank could not read."""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings

import pytest
import torch

from tests.helpers.moe_models import fresh_tracker_fixture, tiny_moe_kwargs
from tests.helpers.shared_ranks import SharedRanks
from tests.test_small_items20 import record_router_loads

fresh_tracker = fresh_tracker_fixture()
ranks = SharedRanks(__name__)  # the two 2-rank cases share their gloo processes
case_runs, ran = ranks.fixtures()


# --------------------------------------------------------------------------------------------
# 1. infer_num_tokens: a features mapping first in a tuple or list, a record holding input_ids


@dataclasses.dataclass
class _Features:
    pixel_values: torch.Tensor
    input_ids: torch.Tensor


_Named = collections.namedtuple("_Named", "pixel_values input_ids")


def test_input_ids_of_a_features_then_labels_batch_are_counted():
    from transformers import BatchEncoding

    from trainvitals.adapters.context import infer_batch_size, infer_num_tokens

    batch, seq = 3, 5
    ids = torch.randint(0, 16, (batch, seq))
    pixels = torch.randn(batch, 3, 8, 8)
    labels = torch.zeros(batch, dtype=torch.long)
    decoder_labels = torch.zeros(batch, 9, dtype=torch.long)
    want = batch * seq
    encoding = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    cases = {
        # before: None (the pixels, a float tensor, are the first tensor: "not token ids")
        "tuple(pixels+ids, labels)": ({"pixel_values": pixels, "input_ids": ids}, labels),
        "list(pixels+ids, labels)": [{"pixel_values": pixels, "input_ids": ids}, labels],
        # before: 27, the decoder labels' count (the first 2-d integer tensor)
        "tuple(labels+ids, ...)": ({"labels": decoder_labels, "input_ids": ids}, labels),
        # before: None for both
        "dataclass(pixels, ids)": _Features(pixels, ids),
        "namedtuple(pixels, ids)": _Named(pixels, ids),
        # already counted, kept
        "dict": {"input_ids": ids},
        "list(dict, labels)": [{"input_ids": ids}, labels],
        "tuple(ids, labels)": (ids, labels),
        "BatchEncoding": encoding,
        "tuple(BatchEncoding, labels)": (encoding, labels),
    }
    got = {name: infer_num_tokens(b) for name, b in cases.items()}
    assert got == dict.fromkeys(cases, want)
    assert {name: infer_batch_size(b) for name, b in cases.items()} == dict.fromkeys(cases, batch)
    # a first item without input_ids is still read as before (no token ids: no count)
    assert infer_num_tokens(({"pixel_values": pixels}, decoder_labels)) is None


# --------------------------------------------------------------------------------------------
# 2. all_reduce_coalesced(op="avg"/"sum") of float16 / bfloat16 inputs


def _half_body(rank: int, world_size: int) -> dict:
    from trainvitals.distributed import all_reduce_coalesced, world_group

    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        values = _half_inputs(rank, dtype)
        for op in ("avg", "sum"):
            for asked in (None, dtype):
                (got,) = all_reduce_coalesced([values], op, world_group(), dtype=asked)
                out[(str(dtype), op, str(asked))] = (str(got.dtype), got.double().tolist())
    return out


def _half_inputs(rank: int, dtype: torch.dtype) -> torch.Tensor:
    # 40000 twice: a float16 sum of 80000 is inf (max 65504) though the average fits;
    # 1 + rank/1024: the average lies between float16 neighbours, rounded once
    return torch.tensor([40000.0, 1.0 + rank / 1024, -3.0 * (rank + 1), 0.1 * rank], dtype=dtype)


@ranks.on_ranks(2, _half_body)
def test_half_precision_average_over_ranks_does_not_overflow(ran):
    world = 2
    _, results = ran
    for dtype in (torch.float16, torch.bfloat16):
        stacked = torch.stack([_half_inputs(r, dtype).double() for r in range(world)])
        want = {
            "sum": stacked.sum(0).to(dtype).double().tolist(),
            "avg": (stacked.sum(0) / world).to(dtype).double().tolist(),
        }
        for result in results:
            for op in ("avg", "sum"):
                for asked in (None, dtype):
                    got_dtype, got = result[(str(dtype), op, str(asked))]
                    assert got_dtype == str(dtype)
                    # before, float16: avg [inf, 1.0, -4.5, 0.0500...] (the 40000s summed to inf)
                    assert got == want[op], (dtype, op, asked)
        if dtype == torch.float16:  # the average fits, the sum is inf in float16 itself
            assert want["avg"][0] == 40000.0 and want["sum"][0] == math.inf


# --------------------------------------------------------------------------------------------
# 3. TinyMoELightningModule under manual optimization


def _manual_run(tmp_path, *, fp16: bool):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from trainvitals.moe.tiny_model import RandomTokenDataset, TinyMoELightningModule

    rate = 0.125  # a power of two: the float32 bias holds the expected steps exactly

    class Manual(TinyMoELightningModule):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            loss = self.model(batch["input_ids"], batch["labels"]).loss
            if fp16 and batch_idx == 0:  # non-finite gradients: GradScaler skips the step
                loss = loss * math.inf
            self.manual_backward(loss)
            opt.step()
            return loss

    torch.manual_seed(0)
    module = Manual(
        **tiny_moe_kwargs(num_layers=2, expert_bias=True, bias_update_rate=rate, z_loss_coeff=0.0)
    )
    routers, loads = record_router_loads(module)
    biases: list[list[torch.Tensor]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            biases.append([r.expert_bias.detach().double().clone() for r in routers])

    steps = 3
    loader = torch.utils.data.DataLoader(RandomTokenDataset(2 * steps, 8, 32, seed=3), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[MixedPrecision("16-mixed", device="cpu")] if fp16 else [],
        max_steps=steps,
        callbacks=[Record()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on a tiny CPU run
        trainer.fit(module, loader)
    assert "step" not in vars(module.optimizers())  # the manual steps are followed no more
    return rate, steps, loads, biases


@pytest.mark.parametrize("fp16", [False, True])
def test_manual_optimization_updates_expert_biases_after_each_real_step(
    tmp_path, fresh_tracker, fp16
):
    rate, steps, loads, biases = _manual_run(tmp_path, fp16=fp16)
    assert len(biases) == steps
    for r, seen in enumerate(loads):
        assert len(seen) == steps
        expected = torch.zeros_like(seen[0])
        pending = torch.zeros_like(seen[0])  # loads of skipped steps, kept for the next one
        for step in range(steps):
            pending = pending + seen[step]
            if not (fp16 and step == 0):
                expected = expected + torch.sign(pending.mean() - pending) * rate
                pending = torch.zeros_like(pending)
            # before: zeros at every step (moe_step_end was never called)
            assert torch.equal(biases[step][r], expected), (r, step)
        assert expected.abs().sum() > 0


# --------------------------------------------------------------------------------------------
# 4. MemoryMonitor: a statistic one rank lacks is left out everywhere, and rank 0 says so


_CUDA_API = ("is_available", "is_initialized", "current_device", "memory_stats")
_CUDA_API += ("reset_peak_memory_stats",)


def _memory_body(rank: int, world_size: int) -> dict:
    from tests.callbacks.test_memory_audit20 import _patch, _run, _without
    from trainvitals.callbacks.memory_monitor import MemoryMonitor

    # rank 1's allocator lacks the inactive-split statistics; rank 0's has them all
    missing = ("inactive_split_bytes.all.current", "inactive_split_bytes.all.peak")
    stats = _without(*missing) if rank else _without()
    stats = {k: v * (1 + rank) for k, v in stats.items()}
    real = {n: getattr(torch.cuda, n) for n in _CUDA_API}
    _patch(lambda device=None: dict(stats), [])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = _run(MemoryMonitor(host=False)).rows
    finally:  # the ranks go on with other cases
        for name, fn in real.items():
            setattr(torch.cuda, name, fn)
    return {"rows": rows, "stats": stats, "messages": [str(w.message) for w in caught]}


@ranks.on_ranks(2, _memory_body)
def test_rank_zero_says_why_a_key_another_rank_lacks_is_left_out(ran):
    from tests.helpers.fake_cuda import TORCH_NAMES

    _, results = ran
    per_rank = [r["stats"] for r in results]
    for result in results:
        row = result["rows"][0]
        # the value: left out everywhere (never the max of the ranks that have it)
        assert "memory/inactive_gb" not in row and "memory/peak_inactive_gb" not in row
        want = max(s[TORCH_NAMES["allocated_gb"]] for s in per_rank) / 1e9
        assert row["memory/allocated_gb"] == pytest.approx(want, rel=1e-15)
    rank0 = [m for m in results[0]["messages"] if "inactive" in m]
    # before: nothing in rank 0's log; rank 1 said its allocator lacks them
    assert rank0 == [
        "MemoryMonitor: memory/inactive_gb, memory/peak_inactive_gb left out: another rank "
        "could not read it (that rank's log says why)"
    ]
    assert any("has no memory/inactive_gb" in m for m in results[1]["messages"])
    assert not any("another rank" in m for m in results[1]["messages"])
