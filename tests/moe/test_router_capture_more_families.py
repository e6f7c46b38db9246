"""Router capture on the Hugging Face MoE families whose routers do not return (logits, scores,
indices) or whose width is not ``num_experts`` (tiny random models of transformers 5.x built
from their configs): JetMoE, DBRX, AFMoE, Switch Transformers, LongCat-Flash (zero experts),
and the DeepSeek-V2 / V3.2 / GLM-4-MoE-Lite routers of the generic rule. The counts equal the
experts' own inputs (the indices or dispatch mask the expert modules receive, recorded by a hook
of the test's own), padding left out; the aux loss equals transformers' own per-layer
``load_balancing_loss_func`` of the model's ``router_logits`` output. (NLLB-MoE stays warned
about: test_router_capture_families.py.)"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers.moe_models import (
    HF_MLA,
    HF_TINY,
    HF_VOCAB,
    randomise_selection_biases,
    tiny_switch_transformers,
)
from trainvitals.moe.capture import RouterCapture

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

from tests.moe.test_router_capture_families import _masks  # noqa: E402

VOCAB = HF_VOCAB
E, K = 4, 2
TINY = HF_TINY | dict(
    num_hidden_layers=2,
    num_experts=E,
    num_local_experts=E,
    num_experts_per_tok=K,
    moe_topk=K,
)
MLA = HF_MLA | dict(n_routed_experts=E, first_k_dense_replace=0)
# model type -> (config overrides, router class, experts class, number of columns E,
# whether transformers trains it with load_balancing_loss_func, routers)
FAMILIES: dict[str, tuple[dict[str, Any], str, str, int, bool, int]] = {
    # two routers per layer: MoE attention (self_attention.experts.router) and MoE MLP
    "jetmoe": (dict(kv_channels=16), "JetMoeTopKGating", "", E, True, 4),
    "dbrx": (
        dict(
            d_model=32,
            n_heads=2,
            n_layers=2,
            ffn_config=dict(moe_num_experts=E, moe_top_k=K, ffn_hidden_size=16),
            attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),
        ),
        "DbrxRouter",
        "DbrxExperts",
        E,
        True,
        2,
    ),
    "afmoe": (
        dict(num_dense_layers=0, num_shared_experts=1),
        "AfmoeTokenChoiceRouter",
        "AfmoeExperts",
        E,
        False,
        2,
    ),
    "deepseek_v2": (
        dict(MLA, topk_method="group_limited_greedy"),
        "DeepseekV2TopkRouter",
        "DeepseekV2Experts",
        E,
        False,
        2,
    ),
    "deepseek_v32": (MLA, "DeepseekV32TopkRouter", "DeepseekV32Experts", E, False, 2),
    "glm4_moe_lite": (
        dict(MLA, num_hidden_layers=3),  # layer 0 dense
        "Glm4MoeLiteTopkRouter",
        "Glm4MoeLiteExperts",
        E,
        False,
        2,
    ),
    # 4 routed + 2 zero (identity) experts: indices and logits have 6 columns
    "longcat_flash": (
        dict(
            MLA,
            zero_expert_num=2,
            expert_ffn_hidden_size=16,
            ffn_hidden_size=32,
            num_hidden_layers=4,  # LongCat: 2 decoder layers of two sub-blocks each
            head_dim=8,
        ),
        "LongcatFlashTopkRouter",
        "LongcatFlashExperts",
        E + 2,
        False,
        2,
    ),
}


def _build(model_type: str) -> nn.Module:
    torch.manual_seed(0)
    config = CONFIG_MAPPING[model_type](**{**TINY, **FAMILIES[model_type][0]})
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomise_selection_biases(model, ("e_score_correction_bias", "expert_bias"))
    return model


class ExpertInputs:
    """Per router (by module name), per forward: the ``[N, k]`` expert indices the model's
    experts received, and the router's logits (hooks of the test's own)."""

    def __init__(self, model: nn.Module, router_cls: str, experts_cls: str) -> None:
        self.indices: dict[str, list[torch.Tensor]] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.recording = False
        for name, module in model.named_modules():
            if type(module).__name__ == router_cls:
                self.indices[name], self.logits[name] = [], []
                module.register_forward_hook(self._router_hook(name, router_cls))
            if experts_cls and type(module).__name__ == experts_cls:
                router = self._router_of(model, name, router_cls)
                module.register_forward_hook(self._experts_hook(router))

    @staticmethod
    def _router_of(model: nn.Module, experts_name: str, router_cls: str) -> str:
        parent = experts_name.rpartition(".")[0]
        (name,) = [
            n
            for n, m in model.named_modules()
            if n.rpartition(".")[0] == parent and type(m).__name__ == router_cls
        ]
        return name

    def _router_hook(self, name: str, router_cls: str):
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not self.recording:
                return
            if router_cls == "DbrxRouter":
                self.logits[name].append(output.detach().clone())
            elif router_cls == "JetMoeTopKGating":
                # what the experts get: slot j of the sorted slots goes to expert
                # repeat_interleave(arange(E), expert_size)[j], from token batch_index[j]
                _, batch_index, _, expert_size, logits = output
                experts = torch.repeat_interleave(torch.arange(E), torch.tensor(expert_size))
                n = logits.shape[0]
                idx = torch.full((n, E), -1)
                idx[batch_index, experts] = experts
                self.indices[name].append(idx)  # [N, E], -1 where not selected
                self.logits[name].append(logits.detach().clone())
            else:
                self.logits[name].append(output[0].detach().clone())

        return hook

    def _experts_hook(self, router: str):
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self.recording:
                self.indices[router].append(inputs[1].detach().clone())  # top_k_index

        return hook


def _counts(indices: torch.Tensor, mask: torch.Tensor, num_experts: int) -> np.ndarray:
    keep = mask.reshape(-1).bool()
    selected = indices[keep].reshape(-1)
    selected = selected[selected >= 0]
    return np.bincount(selected.numpy(), minlength=num_experts)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_counts_and_aux_equal_the_models_own(model_type: str) -> None:
    _, router_cls, experts_cls, num_experts, has_loss, num_routers = FAMILIES[model_type]
    model = _build(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # recognised: no warning
        capture = RouterCapture(model)
    seen = ExpertInputs(model, router_cls, experts_cls)
    assert [type(r.module).__name__ for r in capture.routers] == [router_cls] * num_routers
    assert [r.has_aux_loss for r in capture.routers] == [has_loss] * num_routers
    assert capture.num_experts == num_experts

    gen = torch.Generator().manual_seed(1)
    model.train()
    masks = _masks()
    lbl = importlib.import_module(type(model).__module__).__dict__.get("load_balancing_loss_func")
    expected_model_aux = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # counted: no warning
        for mask in masks:  # three micro-batches of one step
            x = torch.randint(3, VOCAB, mask.shape, generator=gen)
            seen.recording = True
            out = model(input_ids=x, attention_mask=mask, output_router_logits=has_loss)
            seen.recording = False
            out.logits.float().pow(2).mean().backward()
            if has_loss:  # the model's own per-layer router logits
                expected_model_aux.append(
                    [float(lbl((g.detach(),), num_experts, K, mask)) / K for g in out.router_logits]
                )

    expected_loads = []
    for r in capture.routers:
        counts = np.zeros(num_experts)
        assert len(seen.indices[r.name]) == len(masks)
        for idx, mask in zip(seen.indices[r.name], masks, strict=True):
            assert idx.shape[0] == mask.numel()
            counts += _counts(idx, mask, num_experts)
        expected_loads.append(counts)
    loads = capture.loads().numpy()
    np.testing.assert_array_equal(loads, np.stack(expected_loads))
    assert loads.sum() == num_routers * K * sum(int(m.sum()) for m in masks)
    aux_sum, aux_count = capture.aux_losses()
    if not has_loss:
        assert (aux_count == 0).all()
        return
    np.testing.assert_array_equal(aux_count.numpy(), [3] * num_routers)
    # each router's loss against transformers' function of its own logits (the test's hook)
    expected = [
        np.mean(
            [
                float(lbl((logits,), num_experts, K, mask)) / K
                for logits, mask in zip(seen.logits[r.name], masks, strict=True)
            ]
        )
        for r in capture.routers
    ]
    np.testing.assert_allclose((aux_sum / aux_count).numpy(), expected, rtol=1e-5)
    if model_type == "dbrx":  # one router per layer: the model's own router_logits output
        np.testing.assert_allclose(
            (aux_sum / aux_count).numpy(), np.mean(expected_model_aux, axis=0), rtol=1e-5
        )


def _switch_model() -> nn.Module:
    # blocks 1 and 3 sparse (sparse step 2: aux loss on); tokens of a sequence beyond 3 per
    # expert are dropped
    return tiny_switch_transformers(VOCAB, E, d_model=32, d_ff=32, expert_capacity=3)


def test_switch_transformers_counts_dispatch_after_capacity_and_its_own_aux_loss() -> None:
    from transformers.models.switch_transformers import modeling_switch_transformers as st

    model = _switch_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        capture = RouterCapture(model)
    names = [r.name for r in capture.routers]
    assert sorted(names) == sorted(
        f"{stack}.block.{b}.layer.{j}.mlp.router"
        for stack, j in (("encoder", 1), ("decoder", 2))
        for b in (1, 3)
    )
    assert all(r.has_aux_loss for r in capture.routers)
    assert len(set(capture.layer_labels)) == 4

    dispatched: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for name in names:  # the experts' own input: the dispatch mask after the capacity drop
        experts = model.get_submodule(name.rpartition(".")[0] + ".experts")
        experts.register_forward_hook(
            lambda m, inputs, out, n=name: dispatched[n].append(inputs[1].detach().clone())
        )

    gen = torch.Generator().manual_seed(2)
    model.train()
    enc_mask = torch.ones(2, 7, dtype=torch.long)
    enc_mask[1, 4:] = 0
    dec_mask = torch.ones(2, 5, dtype=torch.long)
    dec_mask[0, :2] = 0
    batches = [(enc_mask, dec_mask), (torch.ones(3, 6, dtype=torch.long), None)]
    expected_aux: dict[str, list[float]] = {n: [] for n in names}
    for mask, dmask in batches:
        x = torch.randint(3, VOCAB, mask.shape, generator=gen)
        y = torch.randint(3, VOCAB, (mask.shape[0], 5), generator=gen)
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
            stack_names = sorted(n for n in names if n.startswith(stack))
            for n, logits in zip(stack_names, logits_per_layer, strict=True):
                # transformers' own loss function on this layer's logits from the model output
                logits = logits.detach()
                probs = torch.softmax(logits, dim=-1)
                expected_aux[n].append(float(st.load_balancing_loss_func(probs, logits.argmax(-1))))

    loads = capture.loads().numpy()
    aux_sum, aux_count = capture.aux_losses()
    dropped = 0
    for row, r in enumerate(capture.routers):
        masks = [m if r.name.startswith("encoder") else d for m, d in batches]
        counts = np.zeros(E)
        for dispatch, mask in zip(dispatched[r.name], masks, strict=True):
            flat = dispatch.reshape(-1, E)
            if mask is not None:
                flat = flat[mask.reshape(-1).bool()]
            counts += flat.sum(0).numpy()
            dropped += int((flat.sum(-1) == 0).sum())  # a token over its expert's capacity
        np.testing.assert_array_equal(loads[row], counts)
        assert int(aux_count[row]) == 2
        np.testing.assert_allclose(
            float(aux_sum[row] / aux_count[row]), np.mean(expected_aux[r.name]), rtol=1e-5
        )
    assert dropped > 0  # the capacity limit was reached: dropped tokens are not counted
