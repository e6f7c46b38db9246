"""Audit 19 of TopKRouter against Megatron-LM's router: the top-k scaling factor
(``moe_router_topk_scaling_factor``), checked against float64 formulas written here."""

from __future__ import annotations

import math

import pytest
import torch

from trainvitals.moe import (
    MoEMetricsTracker,
    TopKRouter,
    destroy_moe_metrics_tracker,
    set_moe_metrics_tracker,
)
from trainvitals.moe._aux_loss import set_aux_loss_backward_scale
from trainvitals.moe.tiny_model import TinyMoELM

H, E = 8, 6


@pytest.fixture(autouse=True)
def fresh_tracker():
    tracker = MoEMetricsTracker()
    set_moe_metrics_tracker(tracker)
    set_aux_loss_backward_scale(1.0)
    yield tracker
    destroy_moe_metrics_tracker()


def make_router(**kwargs) -> TopKRouter:
    torch.manual_seed(1)
    router = TopKRouter(H, E, kwargs.pop("top_k", 2), **kwargs)
    with torch.no_grad():
        router.weight.normal_(0, 0.7)
    return router


def ref_probs(
    logits: torch.Tensor, k: int, score: str, pre: bool, factor: float | None
) -> torch.Tensor:
    """Megatron's topk_routing_with_score_function in float64: select, weight, normalise, then
    multiply by the scaling factor."""
    if score == "softmax":
        scores = torch.softmax(logits, dim=-1) if pre else logits
    else:
        scores = torch.sigmoid(logits)
    idx = scores.detach().topk(k, dim=-1).indices
    weights = scores.gather(1, idx)
    if score == "softmax" and not pre:
        weights = torch.softmax(weights, dim=-1)
    elif score == "sigmoid" and k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if factor is not None:
        weights = weights * factor
    return torch.zeros_like(logits).scatter(1, idx, weights)


def ref_switch(logits: torch.Tensor, k: int, score: str) -> torch.Tensor:
    if score == "softmax":
        p = torch.softmax(logits, dim=-1)
    else:
        p = torch.sigmoid(logits)
        p = p / p.sum(dim=-1, keepdim=True) if k > 1 else p
    t, e = p.shape
    chosen = torch.zeros_like(p).scatter(1, p.detach().topk(k, dim=-1).indices, 1.0)
    return e / (k * t * t) * (p.sum(dim=0) * chosen.sum(dim=0)).sum()


@pytest.mark.parametrize(
    ("score", "pre", "k"),
    [("softmax", False, 2), ("softmax", True, 2), ("sigmoid", False, 1), ("sigmoid", False, 3)],
)
def test_topk_scaling_factor_scales_the_weights_and_the_gradient_as_megatron(score, pre, k):
    factor = 2.5
    router = make_router(
        top_k=k,
        score_function=score,
        pre_softmax=pre,
        aux_loss_type="aux_loss",
        aux_loss_coeff=0.3,
        z_loss_coeff=0.05,
        topk_scaling_factor=factor,
    )
    x = torch.randn(3, 5, H)
    c = torch.randn(15, E, dtype=torch.float64)
    probs, routing_map = router(x)
    (probs.double() * c).sum().backward()

    w = router.weight.detach().double().clone().requires_grad_(True)
    logits = x.reshape(-1, H).double() @ w.T
    expected = ref_probs(logits, k, score, pre, factor)
    aux = ref_switch(logits, k, score)
    z = torch.logsumexp(logits, dim=-1).square().mean()
    ((expected * c).sum() + 0.3 * aux + 0.05 * z).backward()

    torch.testing.assert_close(probs.double(), expected.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(routing_map, expected.detach() != 0)
    # the selected weights sum to the factor per token (k > 1 normalised, or the softmax)
    if not (score == "sigmoid" and k == 1) and not pre:
        torch.testing.assert_close(
            probs.double().sum(dim=-1), torch.full((15,), factor, dtype=torch.float64)
        )
    # the losses are those of the unscaled scores
    assert float(router.last_aux_loss) == pytest.approx(aux.item(), rel=1e-5)
    assert float(router.last_z_loss) == pytest.approx(z.item(), rel=1e-5)
    torch.testing.assert_close(router.weight.grad.double(), w.grad, rtol=1e-5, atol=1e-7)


def test_topk_scaling_factor_keeps_selection_and_capacity_drops():
    kwargs = dict(capacity_factor=0.5, drop_policy="probs", expert_bias=True)
    plain = make_router(**kwargs)
    scaled = make_router(topk_scaling_factor=3.0, **kwargs)
    x = torch.randn(20, H)
    p0, m0 = plain(x)
    p1, m1 = scaled(x)
    assert torch.equal(m0, m1)
    torch.testing.assert_close(p1, 3.0 * p0)
    assert float(scaled.last_dropped_fraction) == float(plain.last_dropped_fraction) > 0
    assert torch.equal(scaled.local_tokens_per_expert, plain.local_tokens_per_expert)


def test_tiny_moe_lm_passes_the_scaling_factor_to_its_routers():
    model = TinyMoELM(
        vocab_size=32,
        hidden_size=16,
        num_layers=2,
        num_experts=4,
        top_k=2,
        ffn_hidden_size=32,
        topk_scaling_factor=2.0,
    )
    assert [r.topk_scaling_factor for _, r in model.routers()] == [2.0, 2.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(topk_scaling_factor=0.0), "topk_scaling_factor"),
        (dict(topk_scaling_factor=-1.0), "topk_scaling_factor"),
        (dict(topk_scaling_factor=math.nan), "topk_scaling_factor"),
        (dict(topk_scaling_factor=True), "topk_scaling_factor"),
        (dict(topk_scaling_factor=2.0, sinkhorn=True), "sinkhorn"),
    ],
)
def test_topk_scaling_factor_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TopKRouter(H, E, 2, **kwargs)
