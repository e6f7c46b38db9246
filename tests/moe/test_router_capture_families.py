"""Router capture on more Hugging Face MoE families (tiny random models built from their
configs): the counts equal the routers' own selections recorded by a separate hook, padding
left out; the aux loss equals transformers' own ``load_balancing_loss_func`` of each layer (with
the attention mask) divided by ``top_k``; routers that are not recognised are warned about."""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers.moe_models import HF_TINY, HF_VOCAB, randomise_selection_biases
from trainvitals.moe.capture import RouterCapture

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

VOCAB = HF_VOCAB
TINY = HF_TINY | dict(
    num_hidden_layers=2,
    num_experts=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_topk=2,
    shared_expert_intermediate_size=16,
    router_aux_loss_coef=1.0,
    moe_layer_start_index=0,  # Ernie 4.5: MoE from layer 0
)

# model type -> (router class, whether transformers trains it with load_balancing_loss_func)
FAMILIES: dict[str, tuple[str, bool]] = {
    "phimoe": ("PhimoeTopKRouter", True),  # sparsemixer selection, softmax-top-k loss
    "granitemoe": ("GraniteMoeTopKRouter", True),
    "granitemoeshared": ("GraniteMoeSharedTopKRouter", True),
    "ernie4_5_moe": ("Ernie4_5_MoeTopKRouter", True),  # selection with a bias (moe_statics)
    "minimax_m2": ("MiniMaxM2TopKRouter", True),  # sigmoid + bias selection
    "flex_olmo": ("FlexOlmoTopKRouter", True),
    "hunyuan_v1_moe": ("HunYuanMoEV1Gate", False),
    "llama4_text": ("Llama4Router", False),
}


def _build(model_type: str) -> nn.Module:
    torch.manual_seed(0)
    config = CONFIG_MAPPING[model_type](**TINY)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomise_selection_biases(model, ("e_score_correction_bias",))
    return model


class Recorder:
    """The routers' own selection and logits of each forward (a hook of the test's own)."""

    def __init__(self, model: nn.Module, router_cls: str) -> None:
        self.indices: dict[str, list[torch.Tensor]] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.modules: dict[str, nn.Module] = {}
        for name, module in model.named_modules():
            if type(module).__name__ == router_cls:
                self.indices[name], self.logits[name] = [], []
                self.modules[name] = module
                module.register_forward_hook(self._hook(name))
        self.recording = False

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not self.recording:
                return
            if type(module).__name__ == "Llama4Router":
                scores, logits = output  # selected experts: the non-zero sigmoid scores
                idx = torch.stack([torch.nonzero(row > 0).reshape(-1) for row in scores])
            else:
                logits, idx = output[0], output[2]
            self.indices[name].append(idx.detach().clone())
            self.logits[name].append(logits.detach().clone())

        return hook


def _masks() -> list[torch.Tensor]:
    full = torch.ones(2, 6, dtype=torch.long)
    left_padded = full.clone()
    left_padded[0, :3] = 0
    right_padded = torch.ones(2, 5, dtype=torch.long)
    right_padded[1, 3:] = 0
    return [left_padded, full, right_padded]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_counts_and_aux_equal_the_models_own(model_type: str) -> None:
    router_cls, has_loss = FAMILIES[model_type]
    model = _build(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # recognised: no warning
        capture = RouterCapture(model)
    recorder = Recorder(model, router_cls)
    assert [type(r.module).__name__ for r in capture.routers] == [router_cls] * 2
    assert [r.has_aux_loss for r in capture.routers] == [has_loss] * 2
    num_experts, top_k = 4, 2

    gen = torch.Generator().manual_seed(1)
    model.train()
    masks = _masks()
    for mask in masks:  # three micro-batches of one step
        x = torch.randint(3, VOCAB, mask.shape, generator=gen)
        recorder.recording = True
        model(input_ids=x, attention_mask=mask).logits.float().pow(2).mean().backward()
        recorder.recording = False

    expected_loads, expected_aux = [], []
    for name in sorted(recorder.indices, key=lambda n: int(n.split("layers.")[1].split(".")[0])):
        counts = np.zeros(num_experts)
        for idx, mask in zip(recorder.indices[name], masks, strict=True):
            assert idx.shape == (mask.numel(), top_k)
            keep = mask.reshape(-1).bool()
            counts += np.bincount(idx[keep].reshape(-1).numpy(), minlength=num_experts)
        expected_loads.append(counts)
        if has_loss:
            lbl = importlib.import_module(type(model).__module__).load_balancing_loss_func
            per_forward = [
                float(lbl((logits,), num_experts, top_k, mask)) / top_k
                for logits, mask in zip(recorder.logits[name], masks, strict=True)
            ]
            expected_aux.append(np.mean(per_forward))
    np.testing.assert_array_equal(capture.loads().numpy(), np.stack(expected_loads))
    aux_sum, aux_count = capture.aux_losses()
    if has_loss:
        np.testing.assert_array_equal(aux_count.numpy(), [3, 3])
        np.testing.assert_allclose((aux_sum / aux_count).numpy(), expected_aux, rtol=1e-5)
    else:
        assert (aux_count == 0).all()


def test_unrecognised_hf_router_is_warned_naming_the_model() -> None:
    # NllbMoeTop2Router: transformers 5.x NLLB-MoE is left unrecognised (docs/load_balance.md)
    config = transformers.NllbMoeConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        num_experts=4,
        expert_capacity=5,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        pad_token_id=0,
        decoder_start_token_id=2,
        max_position_embeddings=32,
    )
    model = transformers.NllbMoeForConditionalGeneration(config)
    with pytest.warns(
        RuntimeWarning, match=r"NllbMoeForConditionalGeneration .*NllbMoeTop2Router x4"
    ):
        capture = RouterCapture(model)
    assert len(capture.routers) == 0
