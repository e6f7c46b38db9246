"""TinyMoELM: router layer numbers and module paths, the MoE MLP against a per-expert loop,
no host transfer in a training step, step-end maintenance, and the random-token data."""

from __future__ import annotations

import pytest
import torch

from trainvitals.moe import MoEMetricsTracker, TinyMoELM, set_moe_metrics_tracker
from trainvitals.moe.tiny_model import RandomTokenDataset, random_token_batches


@pytest.fixture(autouse=True)
def fresh_tracker():
    tracker = MoEMetricsTracker()
    set_moe_metrics_tracker(tracker)
    yield tracker
    from trainvitals.moe import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()


def small(**kwargs) -> TinyMoELM:
    torch.manual_seed(0)
    args = dict(
        vocab_size=32,
        hidden_size=16,
        num_layers=4,
        num_experts=4,
        top_k=2,
        ffn_hidden_size=24,
        num_heads=2,
    )
    args.update(kwargs)
    return TinyMoELM(**args)


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


def test_training_step_has_no_host_transfer(monkeypatch):
    model = small(capacity_factor=1.0, expert_bias=True, aux_loss_type="seq_aux_loss")
    batch = next(random_token_batches(1, 2, 8, 32))
    calls = []
    for method in ("item", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(
            torch.Tensor,
            method,
            lambda self, *a, _m=method, _o=original, **k: calls.append(_m) or _o(self, *a, **k),
        )
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
