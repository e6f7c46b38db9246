"""Router capture on the Hugging Face MoE families of transformers 5.23 not covered by the other
family tests (tiny random models built from their configs, no download): A.X-K1, A.X-K2,
Ernie 4.5-VL-MoE (text), GLM-4.5V-MoE (text), GraniteMoE-Hybrid, LFM2-MoE, Qwen3-Omni-MoE
(thinker), ZAYA (a skip expert), Step-3.7 and Doge (``DogeCDMoE``, product keys).

Each family's selection is recomputed here from the router's own logits with the family's
scoring (softmax, sigmoid, a correction bias, group-limited, product keys, the skip expert),
checked against what the model's expert modules receive, and the capture's tokens per expert
must equal its counts over the tokens that are not padding. Where the family computes an aux
loss in its forward, the capture's per-layer value must equal the family's own
``load_balancing_loss_func`` of that layer's ``router_logits`` output (``/ top_k`` for the
Switch form; Doge's divides by ``T * k`` itself), and with one MoE layer ``outputs.aux_loss``.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers.moe_models import HF_MLA, HF_TINY, HF_VOCAB, randomise_selection_biases
from trainvitals.moe.capture import RouterCapture

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from tests.moe.test_router_capture_families import _masks  # noqa: E402

VOCAB = HF_VOCAB
E, K = 4, 2
BASE = HF_TINY | dict(num_experts_per_tok=K)
MLA = HF_MLA | dict(head_dim=8, n_routed_experts=E, num_local_experts=E)


def _build(model_type: str, layers: int = 2) -> nn.Module:
    """A tiny random model of the family, every layer MoE, its selection biases randomised."""
    torch.manual_seed(0)
    n = dict(num_hidden_layers=layers)
    sparse = dict(mlp_layer_types=["sparse"] * layers)
    if model_type in ("axk1", "axk2"):
        extra = (
            dict(index_topk=4, index_head_dim=8, index_n_heads=2) if model_type == "axk2" else {}
        )
        config = transformers.AutoConfig.for_model(model_type, **BASE | MLA | n | sparse | extra)
        model = transformers.AutoModelForCausalLM.from_config(config)
    elif model_type == "granitemoehybrid":
        config = transformers.GraniteMoeHybridConfig(
            **BASE | n,
            num_local_experts=E,
            shared_intermediate_size=16,
            layer_types=["mamba", "attention"][-layers:],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=8,
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
    elif model_type == "lfm2_moe":
        config = transformers.Lfm2MoeConfig(
            **BASE | n,
            num_experts=E,
            num_dense_layers=0,
            layer_types=["full_attention", "conv"][:layers],
            use_expert_bias=True,
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
    elif model_type == "zaya":  # ZAYA supports top-1 only
        config = transformers.ZayaConfig(
            **BASE | n | dict(num_experts_per_tok=1), num_experts=E, router_hidden_size=16
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
    elif model_type == "doge":  # E = num_keys**2 = 4
        config = transformers.DogeConfig(
            **BASE | n | dict(num_key_value_heads=2), is_moe=True, num_experts=E
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
    elif model_type == "ernie4_5_vl_moe":
        text = BASE | n | sparse
        text |= dict(moe_num_experts=E, moe_k=K, moe_intermediate_size=[16, 16])
        text |= dict(moe_num_shared_experts=1, rope_parameters=_rope([3, 3, 2]))
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32)
        config = transformers.Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision)
        model = transformers.Ernie4_5_VLMoeForConditionalGeneration(config)
    elif model_type == "glm4v_moe":
        text = BASE | n | dict(n_routed_experts=E, n_shared_experts=1, n_group=2, topk_group=1)
        text |= dict(first_k_dense_replace=0)
        text |= dict(rope_parameters=_rope([2, 1, 1]) | dict(partial_rotary_factor=0.5))
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32)
        config = transformers.Glm4vMoeConfig(
            text_config=text, vision_config=vision | dict(out_hidden_size=32)
        )
        model = transformers.Glm4vMoeForConditionalGeneration(config)
    elif model_type == "qwen3_omni_moe":
        from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as conf
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

        config = conf.Qwen3OmniMoeThinkerConfig(
            text_config=BASE | n | dict(num_experts=E, decoder_sparse_step=1),
            vision_config=dict(
                depth=1,
                hidden_size=32,
                num_heads=2,
                intermediate_size=32,
                out_hidden_size=32,
                deepstack_visual_indexes=[0],
            ),
            audio_config=dict(
                encoder_layers=1,
                encoder_attention_heads=2,
                encoder_ffn_dim=32,
                d_model=32,
                output_dim=32,
                downsample_hidden_size=8,
            ),
        )
        # the thinker's rope index reads it, its config does not define it (transformers 5.23)
        config.vision_start_token_id = VOCAB + 100
        model = modeling.Qwen3OmniMoeThinkerForConditionalGeneration(config)
    elif model_type == "step3p7":
        from transformers.models.step3p7 import modeling_step3p7 as modeling

        text = BASE | n | sparse | dict(num_local_experts=E, n_routed_experts=E)
        text |= dict(share_expert_dim=16, layer_types=["full_attention"] * layers)
        text |= dict(num_sliding_attention_heads=2, sliding_window=8)
        vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1)
        vision |= dict(num_attention_heads=2, image_size=28, patch_size=14)
        config = transformers.Step3p7Config(text_config=text, vision_config=vision)
        model = modeling.Step3p7ForConditionalGeneration(config)
    else:
        raise AssertionError(model_type)
    # selection biases that change the routers' own top-k
    names = ("e_score_correction_bias", "expert_bias", "balancing_biases")
    randomise_selection_biases(model, names, then=_spread_zaya_router)
    return model


def _spread_zaya_router(module: nn.Module) -> None:
    if isinstance(getattr(module, "balancing_biases", None), torch.Tensor):
        # ZAYA: logits spread out (random init leaves them near 0), small biases, the skip
        # class a likely one
        mlp = module.router_mlp
        for linear in (module.down_proj, mlp.fc1, mlp.fc2, mlp.out_proj):
            linear.weight.data.normal_(0, linear.in_features**-0.5)
        module.balancing_biases.data.normal_(0, 0.05)[-1] = 0.05


def _rope(mrope_section: list[int]) -> dict[str, Any]:
    return dict(rope_type="default", rope_theta=10000.0, mrope_section=mrope_section)


# model type -> (router class, columns E, top-k, aux-loss form: None (the model trains
# without one), "switch" (load_balancing_loss_func(gate_logits, num_experts, top_k, mask) / k)
# or "doge" (its own function, already 1.0 at balance), routers in the 2-layer model)
FAMILIES: dict[str, tuple[str, int, int, str | None, int]] = {
    "axk1": ("AXK1TopkRouter", E, K, None, 2),
    "axk2": ("AXK2TopkRouter", E, K, None, 2),
    # modality-isolated experts: text_moe.gate and vision_moe.gate per layer (text input: the
    # vision routers route nothing)
    "ernie4_5_vl_moe": ("Ernie4_5_VLMoeMoeTopKRouter", E, K, "switch", 4),
    "glm4v_moe": ("Glm4vMoeTextTopkRouter", E, K, "switch", 2),
    "granitemoehybrid": ("GraniteMoeHybridTopKRouter", E, K, "switch", 2),
    "lfm2_moe": ("Lfm2MoeTopKRouter", E, K, None, 2),
    "qwen3_omni_moe": ("Qwen3OmniMoeThinkerTextTopKRouter", E, K, "switch", 2),
    "zaya": ("ZayaRouter", E + 1, 1, None, 2),  # the skip expert is the last column
    "step3p7": ("Step3p7TopKRouter", E, K, None, 2),
    "doge": ("DogeCDMoE", E, K, "doge", 2),
}


def _group_limited(scores: torch.Tensor, router: nn.Module, fill: float) -> torch.Tensor:
    """DeepSeek-V3-style group-limited choice: the best ``topk_group`` groups by the sum of
    their two best scores; the other groups' experts get ``fill``."""
    n, groups = scores.shape[0], router.num_group
    grouped = scores.view(n, groups, -1)
    best = grouped.topk(2, dim=-1).values.sum(-1).topk(router.topk_group, dim=-1).indices
    keep = torch.zeros(n, groups, dtype=torch.bool).scatter(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), fill).view(n, -1)


def _select(model_type: str, router: nn.Module, parent: nn.Module, logits: Any) -> torch.Tensor:
    """The family's own choice of experts ``[N, k]`` from the router's logits (written from the
    modeling files of transformers 5.23)."""
    k = FAMILIES[model_type][2]
    if model_type == "doge":  # product keys: expert x * num_keys + y, scored sx + sy
        (sx, sy), (ix, iy) = logits.topk(router.num_keys, dim=-1)
        scores = (sx[..., :, None] + sy[..., None, :]).flatten(1)
        experts = (ix[..., :, None] * router.num_keys + iy[..., None, :]).flatten(1)
        return experts.gather(1, scores.topk(k, dim=-1).indices)
    if model_type in ("granitemoehybrid", "qwen3_omni_moe"):  # softmax top-k
        return torch.softmax(logits.float(), dim=-1).topk(k, dim=-1).indices
    if model_type == "ernie4_5_vl_moe":  # softmax + moe_statics correction bias
        bias = router.moe_statics.e_score_correction_bias.reshape(-1)
        return (torch.softmax(logits.float(), dim=-1) + bias).topk(k, dim=-1).indices
    if model_type == "zaya":  # softmax + balancing biases, over the experts and the skip class
        scores = torch.softmax(logits, dim=-1).float() + router.balancing_biases
        return scores.topk(k, dim=-1).indices
    scores = torch.sigmoid(logits.float())
    if model_type == "lfm2_moe":  # the bias is its MoE block's expert_bias
        return (scores + parent.expert_bias).topk(k, dim=-1).indices
    scores = scores + router.e_score_correction_bias
    if model_type in ("axk1", "glm4v_moe"):
        scores = _group_limited(scores, router, float("-inf"))
    elif model_type == "axk2":  # A.X-K2 fills the other groups with 0.0
        scores = _group_limited(scores, router, 0.0)
    return scores.topk(k, dim=-1).indices


class Seen:
    """Per router (by name), per forward: the router's logits and the expert indices its
    experts module received (hooks of the test's own)."""

    def __init__(self, model: nn.Module, router_cls: str) -> None:
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.experts_got: dict[str, list[torch.Tensor]] = {}
        self.recording = False
        for name, module in model.named_modules():
            if type(module).__name__ != router_cls:
                continue
            self.logits[name], self.experts_got[name] = [], []
            module.register_forward_hook(
                self._hook(self.logits[name], 1 if "Doge" in router_cls else 0)
            )
            parent = name.rpartition(".")[0]
            experts = dict(model.named_modules()).get(parent + ".experts")
            if experts is not None:
                experts.register_forward_hook(self._hook(self.experts_got[name], 1, inputs=True))

    def _hook(self, into: list[torch.Tensor], pos: int, inputs: bool = False):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.recording:
                into.append((args if inputs else output)[pos].detach().clone())

        return hook


def _forward_step(model: nn.Module, seen: Seen | None, aux: bool) -> list[Any]:
    """Three micro-batches of one step (padded left, full, padded right); their outputs."""
    gen = torch.Generator().manual_seed(1)
    model.train()
    outs = []
    for mask in _masks():
        x = torch.randint(3, VOCAB, mask.shape, generator=gen)
        if seen is not None:
            seen.recording = True
        out = model(input_ids=x, attention_mask=mask, output_router_logits=aux)
        if seen is not None:
            seen.recording = False
        out.logits.float().pow(2).mean().backward()
        outs.append(out)
    return outs


def _family_loss(model: nn.Module, form: str, logits: tuple, mask: torch.Tensor) -> float:
    """The family's own ``load_balancing_loss_func`` of ``logits``, normalised to 1.0 at
    perfect balance."""
    lbl = importlib.import_module(type(model).__module__).load_balancing_loss_func
    if form == "doge":
        return float(lbl(logits, E, int(E**0.5), K, mask))
    return float(lbl(logits, E, K, mask)) / K


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_counts_equal_its_own_routing(model_type: str) -> None:
    router_cls, columns, k, form, num_routers = FAMILIES[model_type]
    model = _build(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # recognised: no warning
        capture = RouterCapture(model)
    seen = Seen(model, router_cls)
    assert [type(r.module).__name__ for r in capture.routers] == [router_cls] * num_routers
    # (Ernie 4.5-VL: the layer's one loss term is on its text router's row, none on its vision
    # router's: tests/moe/test_capture_audit21.py)
    vision = [r.name.rsplit(".", 2)[-2] == "vision_moe" for r in capture.routers]
    assert [r.has_aux_loss for r in capture.routers] == [form is not None and not v for v in vision]
    assert capture.num_experts == columns
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # counted: no warning
        outs = _forward_step(model, seen, aux=form is not None)

    masks = _masks()
    expected = np.zeros((num_routers, columns))
    for row, r in enumerate(capture.routers):
        parent = model.get_submodule(r.name.rpartition(".")[0])
        for f, logits in enumerate(seen.logits[r.name]):
            chosen = _select(model_type, r.module, parent, logits)
            got = seen.experts_got[r.name]
            if got:  # the family's choice is what its experts received
                if model_type == "zaya":  # the skip expert reaches them as expert 0
                    chosen_for_experts = chosen.masked_fill(chosen == E, 0)
                else:
                    chosen_for_experts = chosen
                assert torch.equal(got[f].sort(-1).values, chosen_for_experts.sort(-1).values)
            keep = masks[f].reshape(-1).bool()
            expected[row] += np.bincount(chosen[keep].reshape(-1).numpy(), minlength=columns)
    loads = capture.loads().numpy()
    np.testing.assert_array_equal(loads, expected)
    valid = sum(int(m.sum()) for m in masks)
    routed = [len(seen.logits[r.name]) > 0 for r in capture.routers]
    np.testing.assert_array_equal(loads.sum(1), [k * valid * x for x in routed])
    if model_type == "zaya":
        assert loads[:, E].sum() > 0 and loads[:, :E].sum() > 0  # the skip expert was chosen

    aux_sum, aux_count = capture.aux_losses()
    if form is None:
        assert (aux_count == 0).all()
        assert all(getattr(out, "aux_loss", None) is None for out in outs)
        return
    np.testing.assert_array_equal(aux_count.numpy(), [3 if x else 0 for x in routed])
    rows = [row for row, x in enumerate(routed) if x]
    per_layer = [
        np.mean(
            [
                _family_loss(model, form, (out.router_logits[layer].detach(),), mask)
                for out, mask in zip(outs, masks, strict=True)
            ]
        )
        for layer in range(len(rows))
    ]
    np.testing.assert_allclose((aux_sum[rows] / aux_count[rows]).numpy(), per_layer, rtol=1e-5)
    for out, mask in zip(outs, masks, strict=True):  # that function is the model's aux loss
        logits = tuple(g.detach() for g in out.router_logits)
        scale = 1 if form == "doge" else K
        assert float(out.aux_loss.detach()) == pytest.approx(
            _family_loss(model, form, logits, mask) * scale
        )


@pytest.mark.parametrize("model_type", sorted(t for t, f in FAMILIES.items() if f[3]))
def test_one_moe_layer_aux_loss_equals_the_models_own(model_type: str) -> None:
    form = FAMILIES[model_type][3]
    model = _build(model_type, layers=1)
    capture = RouterCapture(model)
    outs = _forward_step(model, None, aux=True)
    scale = 1 if form == "doge" else K
    aux_sum, aux_count = capture.aux_losses()
    routed = aux_count > 0  # Ernie 4.5-VL: its vision router saw no token
    assert int(routed.sum()) == 1 and int(aux_count[routed]) == 3
    assert float(aux_sum[routed] / aux_count[routed]) == pytest.approx(
        np.mean([float(out.aux_loss.detach()) / scale for out in outs]), rel=1e-5
    )
