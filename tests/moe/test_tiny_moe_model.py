"""TinyMoELM: router layer numbers and module paths, the MoE MLP against a per-expert loop,
no host transfer in a training step, step-end maintenance, and the random-token data."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.moe_models import fresh_tracker_fixture, tiny_moe_lm
from trainvitals.moe import TinyMoELM
from trainvitals.moe.tiny_model import RandomTokenDataset, random_token_batches

fresh_tracker = fresh_tracker_fixture()


def small(**kwargs) -> TinyMoELM:
    # max_seq_len: TinyMoELM's default
    return tiny_moe_lm(0, **(dict(num_layers=4, ffn_hidden_size=24, max_seq_len=256) | kwargs))


def test_router_paths_and_layer_numbers_follow_the_block_index(fresh_tracker):
    model = small(moe_layer_freq=[1, 0, 1, 1])
    routers = dict(model.routers())
    assert list(routers) == ["layers.0.mlp.router", "layers.2.mlp.router", "layers.3.mlp.router"]
    assert [r.layer_number for r in routers.values()] == [1, 3, 4]
    assert {r.num_layers for r in routers.values()} == {4}
    batch = next(random_token_batches(1, 2, 8, 32))
    model(batch["input_ids"], batch["labels"]).loss.backward()
    values = fresh_tracker.metrics["load_balancing_loss"].values
    assert [bool(v) for v in values] == [True, False, True, True]
    assert small(moe_layer_freq=2).moe_layer_pattern == [True, False, True, False]


def test_moe_mlp_equals_a_loop_over_experts():
    model = small(num_layers=1).double()
    mlp = model.layers[0].mlp
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    out = mlp(x)
    probs, _ = mlp.router(x)
    tokens = x.reshape(-1, 16)
    expected = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for e in range(4):
            if probs[t, e] > 0:
                h = torch.nn.functional.gelu(tokens[t] @ mlp.w1[e] + mlp.b1[e])
                expected[t] += probs[t, e] * (h @ mlp.w2[e])
    assert torch.allclose(out.reshape(-1, 16), expected, atol=1e-10)


def _record_host_transfers(monkeypatch) -> list[str]:
    """Record every call of a Tensor method that copies to the host (item, tolist, cpu, numpy)."""
    calls: list[str] = []
    for method in ("item", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(
            torch.Tensor,
            method,
            lambda self, *a, _m=method, _o=original, **k: calls.append(_m) or _o(self, *a, **k),
        )
    return calls


def test_training_step_has_no_host_transfer(monkeypatch):
    model = small(capacity_factor=1.0, expert_bias=True, aux_loss_type="seq_aux_loss")
    batch = next(random_token_batches(1, 2, 8, 32))
    calls = _record_host_transfers(monkeypatch)
    model(batch["input_ids"], batch["labels"]).loss.backward()
    model.moe_step_end()
    monkeypatch.undo()
    assert calls == []


def test_moe_step_end_updates_bias_and_resets_global_counts():
    model = small(expert_bias=True, aux_loss_type="global_aux_loss")
    batch = next(random_token_batches(1, 2, 8, 32))
    model(batch["input_ids"], batch["labels"]).loss.backward()
    routers = [r for _, r in model.routers()]
    assert all(r.global_aux_micro_batches == 1 for r in routers)
    assert all(r.local_tokens_per_expert.sum() == 2 * 8 * 2 for r in routers)
    model.moe_step_end()
    for r in routers:
        assert r.global_aux_micro_batches == 0 and r.global_tokens_per_expert.sum() == 0
        assert r.local_tokens_per_expert.sum() == 0
        assert r.expert_bias.abs().sum() > 0


def test_random_token_dataset_labels_are_the_next_tokens():
    data = RandomTokenDataset(5, 12, 50, seed=1)
    item = data[3]
    assert item["input_ids"].shape == (12,) and item["labels"].shape == (12,)
    assert torch.equal(item["input_ids"][1:], item["labels"][:-1])
    stride = (item["input_ids"][1] - item["input_ids"][0]) % 50
    assert torch.equal((item["input_ids"] + stride) % 50, item["labels"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_heads": 3}, "num_heads"),
        ({"num_layers": 0}, "num_layers"),
        ({"moe_layer_freq": [1, 0]}, "moe_layer_freq"),
        ({"moe_layer_freq": 0}, "moe_layer_freq"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        small(**kwargs)


def test_forward_rejects_bad_input():
    model = small(max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(9, dtype=torch.long))


def test_backward_with_grad_scaler_has_no_host_transfer(monkeypatch):
    from trainvitals.moe import set_aux_loss_backward_scale

    model = small()
    batch = next(random_token_batches(1, 2, 8, 32))
    scaler = torch.amp.GradScaler("cpu")
    set_aux_loss_backward_scale(0.5, grad_scaler=scaler)
    calls = _record_host_transfers(monkeypatch)
    try:
        scaler.scale(model(batch["input_ids"], batch["labels"]).loss).backward()
    finally:
        monkeypatch.undo()
        set_aux_loss_backward_scale(1.0)
    assert calls == []


def _switch_and_z_loss64(
    x: torch.Tensor, w: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 Switch aux loss and z-loss of a softmax top-k router on tokens ``x [T, H]``."""
    num_tokens, num_experts = x.shape[0], w.shape[0]
    logits = x @ w.T
    top = torch.topk(logits, top_k, dim=-1).indices.reshape(-1)
    tokens = torch.zeros(num_experts, dtype=torch.float64).index_add_(
        0, top, torch.ones(top.numel(), dtype=torch.float64)
    )
    probs_sum = torch.softmax(logits, dim=-1).sum(dim=0)
    aux = num_experts / (top_k * num_tokens**2) * (probs_sum * tokens).sum()
    return aux, torch.logsumexp(logits, dim=-1).square().mean()


def test_lightning_16_mixed_aux_loss_gradient_equals_the_fp32_objective(tmp_path):
    # Under precision="16-mixed" Lightning multiplies the main loss by the GradScaler's scale
    # (65536) and unscales the gradients before the step; the routers' injected aux-loss
    # gradient must come out of unscale_ as d(coeff * loss / accum)/dW, as in fp32.
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from trainvitals.moe import set_aux_loss_backward_scale
    from trainvitals.moe._aux_loss import get_aux_loss_backward_scale, get_aux_loss_grad_scaler
    from trainvitals.moe.tiny_model import TinyMoELightningModule

    accum, coeff_aux, coeff_z, top_k = 2, 0.5, 0.1, 2

    class OnlyAuxLosses(TinyMoELightningModule):
        def training_step(self, batch, batch_idx):
            # 0 * loss: the main loss adds exactly nothing, only the injected losses remain
            return 0.0 * super().training_step(batch, batch_idx)

        def on_before_optimizer_step(self, optimizer):  # gradients are unscaled here
            self.router_grads = [r.weight.grad.detach().clone() for _, r in self.model.routers()]
            self.grad_scale = self.trainer.precision_plugin.scaler.get_scale()

    torch.manual_seed(0)
    module = OnlyAuxLosses(
        vocab_size=32,
        hidden_size=16,
        num_layers=2,
        num_experts=4,
        top_k=top_k,
        ffn_hidden_size=24,
        num_heads=2,
        aux_loss_coeff=coeff_aux,
        z_loss_coeff=coeff_z,
        # one MoE layer: a second router's aux loss would also reach this router's weights
        # through the hidden states, which the reference below keeps fixed
        moe_layer_freq=[0, 1],
    )
    routers = [r for _, r in module.model.routers()]
    weights = [r.weight.detach().double().clone() for r in routers]
    inputs: list[list[torch.Tensor]] = [[] for _ in routers]  # each router's input per micro-batch
    for router, seen in zip(routers, inputs, strict=True):
        router.register_forward_hook(
            lambda mod, args, out, seen=seen: seen.append(
                args[0].detach().reshape(-1, args[0].shape[-1]).double()
            )
        )
    loader = torch.utils.data.DataLoader(RandomTokenDataset(4, 8, 32, seed=3), batch_size=2)
    set_aux_loss_backward_scale(0.25)  # a setting from before: restored at train end
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # the plugin itself: Trainer(precision="16-mixed") on CPU silently switches to bf16
        plugins=[MixedPrecision("16-mixed", device="cpu")],
        max_steps=1,
        accumulate_grad_batches=accum,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    try:
        trainer.fit(module, loader)
        assert get_aux_loss_backward_scale() == 0.25 and get_aux_loss_grad_scaler() is None
    finally:
        set_aux_loss_backward_scale(1.0)
    assert module.grad_scale == 2.0**16  # the scaler was in use
    assert len(routers) == 1
    for w, seen, grad in zip(weights, inputs, module.router_grads, strict=True):
        assert len(seen) == accum
        w = w.requires_grad_(True)
        objective = sum(
            (coeff_aux * aux + coeff_z * z) / accum
            for aux, z in (_switch_and_z_loss64(x, w, top_k) for x in seen)
        )
        (expected,) = torch.autograd.grad(objective, w)
        assert torch.allclose(grad.double(), expected, rtol=1e-5, atol=1e-9)
