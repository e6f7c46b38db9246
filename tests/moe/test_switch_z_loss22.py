"""LoadBalanceMonitor writes Switch Transformers' router z-loss per layer (``moe/z_loss_*`` and,
detailed, ``moe/layer_<l>/z_loss``): each layer's value is transformers'
``router_z_loss_func`` of that layer's logits (the mean over every token, padding included, of
``logsumexp(logits)**2``), computed here in float64 from the router logits the model returns
(``output_router_logits=True``), averaged over the step's micro-batches and, on 2 gloo ranks
with different data, over the ranks, in the aux loss's one collective. A Mixtral model writes
no z-loss key."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.moe_models import tiny_switch_transformers
from tests.helpers.shared_ranks import SharedRanks
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor
from trainvitals.stats.load_balance import AGGREGATES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

E, VOCAB = 4, 64
SPARSE_BLOCKS = (1, 3)  # 4 blocks, 2 sparse per stack: sparse step 2, the model's z-loss on


def _switch_model() -> torch.nn.Module:
    return tiny_switch_transformers(VOCAB, E, router_z_loss_coef=0.01, dropout_rate=0.0)


def _label(stack: str, block: int) -> str:
    # encoder and decoder routers of one block number: labelled by their full module names
    return f"{stack}_block_{block}_layer_{1 if stack == 'encoder' else 2}_mlp_router"


LABELS = [_label(stack, b) for b in SPARSE_BLOCKS for stack in ("encoder", "decoder")]


def _train(
    model: torch.nn.Module, vitals: Vitals, opt: torch.optim.Optimizer, seed: int, steps: int
) -> dict[str, Any]:
    """``steps`` optimizer steps of 2 micro-batches with padding; per step and layer label, the
    float64 z-loss of each micro-batch from the model's returned router logits, per step the
    model's own (float32) encoder and decoder z-losses, and the trainvitals collectives of each
    optimizer step (its step end, where the monitor reports)."""
    from trainvitals.distributed import collective_counter

    gen = torch.Generator().manual_seed(seed)
    expected: dict[int, dict[str, list[float]]] = {}
    model_z: dict[int, list[tuple[float, float]]] = {}
    collectives: dict[int, int] = {}
    for step in range(steps):
        per_layer: dict[str, list[float]] = {label: [] for label in LABELS}
        for micro in range(2):
            batch, seq = 2, 6 + micro  # another sequence length per micro-batch
            x = torch.randint(3, VOCAB, (batch, seq), generator=gen)
            mask = torch.ones(batch, seq, dtype=torch.long)
            mask[1, seq - 3 :] = 0  # padding: in the z-loss, as transformers computes it
            y = torch.randint(3, VOCAB, (batch, 5), generator=gen)
            dmask = torch.ones(batch, 5, dtype=torch.long)
            dmask[0, 3:] = 0
            vitals.batch(x)
            out = model(
                input_ids=x,
                attention_mask=mask,
                labels=y,
                decoder_attention_mask=dmask,
                output_router_logits=True,
            )
            out.loss.backward()
            for stack, logits_per_layer in (
                ("encoder", out.encoder_router_logits),
                ("decoder", out.decoder_router_logits),
            ):
                assert len(logits_per_layer) == len(SPARSE_BLOCKS)
                for block, logits in zip(SPARSE_BLOCKS, logits_per_layer, strict=True):
                    assert logits.shape[-1] == E and logits.ndim == 3
                    z = torch.logsumexp(logits.detach().double(), dim=-1).square().mean()
                    per_layer[_label(stack, block)].append(float(z))
            model_z.setdefault(step, []).append(
                (float(out.encoder_z_loss.detach()), float(out.decoder_z_loss.detach()))
            )
        expected[step] = per_layer
        before = sum(collective_counter.values())
        opt.step()  # step_end runs in the optimizer's post-hook
        collectives[step] = sum(collective_counter.values()) - before
        opt.zero_grad()
    return {"expected": expected, "model_z": model_z, "collectives": collectives}


def _check_written(row: dict[str, float], layer_means: dict[str, float], detailed: bool) -> None:
    """``row``'s z-loss keys against the float64 ``layer_means`` by label."""
    values = np.array([layer_means[label] for label in LABELS])
    for label in LABELS:
        key = f"moe/layer_{label}/z_loss"
        if detailed:
            np.testing.assert_allclose(row[key], layer_means[label], rtol=1e-6)
        else:
            assert key not in row
    reference = {
        "mean": values.mean(),
        "median": np.median(values),
        "min": values.min(),
        "max": values.max(),
    }
    assert set(AGGREGATES) == set(reference)
    for agg in AGGREGATES:
        np.testing.assert_allclose(row[f"moe/z_loss_{agg}"], reference[agg], rtol=1e-6)


@pytest.mark.parametrize("mode", ["detailed", "brief"])
def test_switch_z_loss_per_layer_over_micro_batches(mode: str) -> None:
    model = _switch_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    writer = Recorder()
    vitals = Vitals([LoadBalanceMonitor(mode=mode)], writer=writer, log_every_n_steps=1)
    vitals.attach(model, opt)
    model.train()
    result = _train(model, vitals, opt, seed=1, steps=2)
    vitals.close()
    assert sorted(writer.rows) == [0, 1]
    for step, per_layer in result["expected"].items():
        row = writer.rows[step]
        means = {label: float(np.mean(v)) for label, v in per_layer.items()}
        _check_written(row, means, detailed=mode == "detailed")
        # the model's own z-loss of a stack is the mean over its layers' tokens (every layer
        # of a stack sees the same tokens): per micro-batch, the mean of its layers' values
        for s, stack in enumerate(("encoder", "decoder")):
            model_mean = np.mean([z[s] for z in result["model_z"][step]])
            layers = [means[label] for label in LABELS if label.startswith(stack)]
            np.testing.assert_allclose(model_mean, np.mean(layers), rtol=1e-5)
    # the aux loss is still written alongside, from the same buffer
    assert "moe/aux_loss_mean" in writer.rows[0]


def test_mixtral_writes_no_z_loss_key() -> None:
    from tests.moe.test_router_capture import build

    model, _, _, _ = build("mixtral")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = Recorder()
    vitals = Vitals([LoadBalanceMonitor(mode="detailed")], writer=writer, log_every_n_steps=1)
    vitals.attach(model, opt)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        x = torch.randint(0, 32, (2, 6), generator=gen)
        vitals.batch(x)
        model(x).logits.float().pow(2).mean().backward()
    opt.step()
    vitals.close()
    keys = set(writer.rows[0])
    assert "moe/aux_loss_mean" in keys and "moe/layer_1/aux_loss" in keys
    assert not [k for k in keys if "z_loss" in k]


# ---------------------------------------------------------------------- 2 gloo ranks

shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()


def _ddp_body(rank: int, world_size: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from trainvitals.distributed import ProcessGroups

    model = _switch_model()
    # experts that get no token have no gradient
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed")
    vitals = Vitals([monitor], writer=writer, groups=ProcessGroups.world(), log_every_n_steps=1)
    vitals.attach(ddp, opt)
    ddp.train()
    result = _train(ddp, vitals, opt, seed=100 + rank, steps=1)  # other tokens on each rank
    vitals.close()
    return {"rows": writer.rows, **result}


@pytest.mark.slow
@shared.on_ranks(2, _ddp_body)
def test_two_gloo_ranks_average_the_z_loss_over_ranks(ran) -> None:
    _, results = ran
    per_rank = [r["expected"][0] for r in results]
    # the mean over every micro-batch of every rank (each rank ran 2)
    means = {label: float(np.mean([v for p in per_rank for v in p[label]])) for label in LABELS}
    assert per_rank[0][LABELS[0]] != per_rank[1][LABELS[0]]  # the ranks saw other data
    for r in results:  # every rank computed the same reduced numbers
        # (the full-name labels of Switch's routers are those of the unwrapped model: DDP's
        # "module." is left out)
        _check_written(r["rows"][0], means, detailed=True)
    # the logging step's reduction: the z sums ride in the loads' one all-reduce
    # (DDP's own gradient all-reduces are not counted by trainvitals' counter)
    for r in results:
        assert r["collectives"] == {0: 1}


def _pipeline_body(rank: int, world_size: int) -> dict[str, Any]:
    """Two pipeline stages of other families (E = 4 both): stage 0 a Switch model (z-loss),
    stage 1 a Mixtral model (none), so their packed buffers differ in size."""
    import torch.distributed as dist

    from tests.moe.test_router_capture import build
    from trainvitals.distributed import ProcessGroups

    groups = ProcessGroups(pp=dist.group.WORLD)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=0)
    vitals = Vitals([monitor], writer=writer, groups=groups, log_every_n_steps=1)
    if rank == 0:
        model = _switch_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        vitals.attach(model, opt)
        model.train()
        result = _train(model, vitals, opt, seed=7, steps=1)
    else:
        model, _, _, _ = build("mixtral")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        vitals.attach(model, opt)
        gen = torch.Generator().manual_seed(8)
        for _ in range(2):
            x = torch.randint(0, 32, (2, 6), generator=gen)
            vitals.batch(x)
            model(x).logits.float().pow(2).mean().backward()
        opt.step()
        result = {}
    vitals.close()
    return {"rows": writer.rows, **result}


@pytest.mark.slow
@shared.on_ranks(2, _pipeline_body)
def test_pipeline_stage_with_z_loss_beside_one_without(ran) -> None:
    _, results = ran
    per_layer = results[0]["expected"][0]
    means = {label: float(np.mean(v)) for label, v in per_layer.items()}
    for r in results:  # every stage reports both stages' layers
        row = r["rows"][0]
        _check_written(row, means, detailed=True)
        # Mixtral's layers (stage 1): loads in their own rows (2 micro-batches of 12 tokens,
        # top-2), an aux loss, no z-loss
        for layer in (0, 1):
            tokens = sum(row[f"moe/layer_{layer}/tokens_per_expert/{e}"] for e in range(E))
            assert tokens == 2 * 12 * 2
            assert f"moe/layer_{layer}/aux_loss" in row
            assert f"moe/layer_{layer}/z_loss" not in row


def test_full_name_labels_leave_the_wrappers_out() -> None:
    # Switch's encoder and decoder routers share block numbers, so their labels are full module
    # names; a wrapper's components (torch.compile's "_orig_mod.", DDP's "module.", activation
    # checkpointing's "_checkpoint_wrapped_module.") must not enter them, or the same model
    # writes other keys on one rank and on several.
    from trainvitals.moe.capture import RouterCapture

    model = _switch_model()
    plain = RouterCapture(model, attach=False).layer_labels
    assert sorted(plain) == sorted(LABELS)

    class Wrapper(torch.nn.Module):  # DDP's and Accelerate's attribute name
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = inner

    for wrapped in (torch.compile(model), Wrapper(model), Wrapper(torch.compile(model))):
        assert RouterCapture(wrapped, attach=False).layer_labels == plain
