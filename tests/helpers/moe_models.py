"""Tiny MoE models shared by the MoE tests: the package's ``TinyMoELM`` with small sizes, the
tracker fixture its routers record into, and the tiny Hugging Face config sizes and selection
bias randomisation of the router-capture family tests.

``tiny_moe_lm(seed, **overrides)`` seeds the global RNG and builds a ``TinyMoELM`` of
``tiny_moe_kwargs(**overrides)`` (vocabulary ``VOCAB``, width ``HIDDEN``, 3 layers, ``EXPERTS``
experts top-``TOPK``, FFN 8, 2 heads, sequences up to 16; ``LOSS_COEFFS`` are the aux and z
loss coefficients of the monitor tests). ``fresh_tracker = fresh_tracker_fixture()`` in a test
module gives it an autouse ``fresh_tracker`` fixture (a new global ``MoEMetricsTracker`` per
test, destroyed afterwards).

``HF_TINY`` holds the sizes every tiny Hugging Face MoE config of the family tests shares;
``randomise_selection_biases(model, names)`` draws the named selection-bias buffers from
N(0, 0.5) in module order (so that a bias changes the routers' own top-k).
``tiny_switch_transformers(vocab_size, num_experts, **overrides)``: the tiny encoder-decoder
Switch Transformers model of the capture and z-loss tests. ``RoutingMaps(model)``: the
``TopKRouter`` loads and aux losses of the training forwards, counted by the test's own hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

VOCAB, HIDDEN, EXPERTS, TOPK = 32, 16, 4, 2
LOSS_COEFFS: dict[str, float] = dict(aux_loss_coeff=0.01, z_loss_coeff=0.001)


def tiny_moe_kwargs(**overrides: Any) -> dict[str, Any]:
    """The ``TinyMoELM`` arguments of the tests, with ``overrides`` in place of the defaults."""
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=3,
        num_experts=EXPERTS,
        top_k=TOPK,
        ffn_hidden_size=8,
        num_heads=2,
        max_seq_len=16,
    )
    return kwargs | overrides


def tiny_moe_lm(seed: int = 0, **overrides: Any) -> nn.Module:
    """``torch.manual_seed(seed)``, then ``TinyMoELM(**tiny_moe_kwargs(**overrides))``."""
    from trainvitals.moe import TinyMoELM

    torch.manual_seed(seed)
    return TinyMoELM(**tiny_moe_kwargs(**overrides))


def fresh_tracker_fixture() -> Callable[..., Any]:
    """An autouse fixture named ``fresh_tracker``: a new global ``MoEMetricsTracker`` per test
    (yielded), destroyed afterwards. Assign it to ``fresh_tracker`` in the test module."""

    @pytest.fixture(autouse=True, name="fresh_tracker")
    def _fresh_tracker():
        from trainvitals.moe import (
            MoEMetricsTracker,
            destroy_moe_metrics_tracker,
            set_moe_metrics_tracker,
        )

        tracker = MoEMetricsTracker()
        set_moe_metrics_tracker(tracker)
        yield tracker
        destroy_moe_metrics_tracker()

    return _fresh_tracker


# ------------------------------------------------------------ tiny Hugging Face MoE configs

HF_VOCAB = 64
HF_TINY: dict[str, Any] = dict(
    vocab_size=HF_VOCAB,
    hidden_size=32,
    intermediate_size=32,
    moe_intermediate_size=16,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# multi-head latent attention and group-limited routing (DeepSeek-V2/V3 style configs)
HF_MLA: dict[str, Any] = dict(
    n_routed_experts=4,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    num_key_value_heads=2,
    kv_lora_rank=8,
    q_lora_rank=8,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
)


def randomise_selection_biases(
    model: nn.Module,
    names: Iterable[str],
    then: Callable[[nn.Module], None] | None = None,
) -> None:
    """Every tensor attribute ``names`` of every module (in ``model.modules()`` order, then in
    the order of ``names``) drawn from N(0, 0.5) in place: a selection bias that changes the
    routers' own top-k (random init leaves it at 0). ``then(module)`` runs after each module's
    biases (a family's own adjustment, drawn in the same order as before)."""
    names = tuple(names)
    for module in model.modules():
        for name in names:
            bias = getattr(module, name, None)
            if isinstance(bias, torch.Tensor):
                bias.data.normal_(0, 0.5)
        if then is not None:
            then(module)


def tiny_switch_transformers(vocab_size: int, num_experts: int = 4, **overrides: Any) -> nn.Module:
    """``torch.manual_seed(0)`` (the same weights on every rank), then a tiny
    ``SwitchTransformersForConditionalGeneration``: 4 encoder and 4 decoder blocks, blocks 1 and 3
    of each stack sparse (sparse step 2: the model adds its aux and z losses), width 16,
    ``expert_capacity`` 4, padding token 0; ``overrides`` replace any config field."""
    import transformers

    config = transformers.SwitchTransformersConfig(
        **{
            "vocab_size": vocab_size,
            "d_model": 16,
            "d_kv": 8,
            "d_ff": 16,
            "expert_capacity": 4,
            "num_layers": 4,
            "num_sparse_encoder_layers": 2,
            "num_decoder_layers": 4,
            "num_sparse_decoder_layers": 2,
            "num_heads": 2,
            "num_experts": num_experts,
            "pad_token_id": 0,
            "decoder_start_token_id": 0,
        }
        | overrides
    )
    torch.manual_seed(0)
    return transformers.SwitchTransformersForConditionalGeneration(config)


class RoutingMaps:
    """The ``TopKRouter`` routing maps (summed in float64 per layer) and aux losses of the
    training forwards of ``model`` (training mode, autograd on) run while ``recording`` is on:
    the independent count the load-balance tests compare with. The hooks run eagerly
    (``torch.compiler.disable``), so compiled code calls them as it calls the monitor's."""

    def __init__(self, model: nn.Module) -> None:
        from trainvitals.moe import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.recording = True
        self.loads = np.zeros((len(routers), routers[0].num_experts))
        self.aux: list[list[float]] = [[] for _ in routers]
        for i, router in enumerate(routers):
            router.register_forward_hook(torch.compiler.disable(self._hook(i)))

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self.recording and module.training and torch.is_grad_enabled():
                self.loads[i] += output[1].detach().to(torch.float64).sum(0).numpy()
                self.aux[i].append(float(module.last_aux_loss))

        return hook

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """The loads ``[layers, experts]`` and mean aux loss per layer since the last take."""
        out = self.loads.copy(), np.array([np.mean(a) for a in self.aux])
        self.loads[:] = 0
        self.aux = [[] for _ in self.aux]
        return out
