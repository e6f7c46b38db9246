"""Router capture on tiny randomly initialised models: the counts equal the bincount of the
routers' own indices (recorded here by a separate hook), summed over the step's micro-batches;
evaluation forwards and activation-checkpoint re-runs are not counted."""

from __future__ import annotations

import copy
import os
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.moe.recording_routers import topk_routers_with_recorder
from trainvitals.moe.capture import (
    RouterCapture,
    clear_router_extractors,
    find_routers,
    layer_number_from_name,
    register_router_extractor,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

VOCAB = 64
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)

# family -> (config class, model class, config kwargs, router class name, expected layers, E)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], str, list[int], int]] = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2),
        "MixtralTopKRouter",
        [0, 1],
        4,
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=32,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=2,  # MoE on layers 1 and 3
        ),
        "Qwen2MoeTopKRouter",
        [1, 3],
        4,
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=32,
            moe_intermediate_size=8,
            head_dim=8,
            num_hidden_layers=12,  # layers.10 and layers.11 must come after layers.2
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[0, 5],
        ),
        "Qwen3MoeTopKRouter",
        [1, 2, 3, 4, 6, 7, 8, 9, 10, 11],
        4,
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(intermediate_size=32, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2),
        "OlmoeTopKRouter",
        [0, 1],
        4,
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            intermediate_size=32,
            moe_intermediate_size=8,
            num_hidden_layers=3,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,  # layer 0 dense
            n_shared_experts=1,
            kv_lora_rank=8,
            q_lora_rank=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            qk_nope_head_dim=4,
        ),
        "DeepseekV3TopkRouter",
        [1, 2],
        8,
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            intermediate_size=16,
            head_dim=8,
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
        ),
        "GptOssTopKRouter",
        [0, 1],
        4,
    ),
}


def build(family: str, seed: int = 0) -> tuple[nn.Module, str, list[int], int]:
    cfg_name, model_name, kwargs, router_cls, layers, num_experts = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**COMMON, **kwargs)
    model = getattr(transformers, model_name)(config)
    if family == "deepseek_v3":
        # exercise the aux-loss-free bias in the selection
        for module in model.modules():
            if type(module).__name__ == router_cls:
                module.e_score_correction_bias.normal_(0, 0.1)
    return model, router_cls, layers, num_experts


class IndexRecorder:
    """Independent record of each router's top-k indices (a hook of the test's own)."""

    def __init__(self, model: nn.Module, router_cls: str) -> None:
        self.recording = False
        self.by_layer: dict[int, list[np.ndarray]] = {}
        self.logits: dict[int, list[np.ndarray]] = {}
        self.handles = []
        for name, module in model.named_modules():
            if type(module).__name__ == router_cls:
                layer = int(name.split("layers.")[1].split(".")[0])
                self.by_layer[layer] = []
                self.logits[layer] = []
                self.handles.append(module.register_forward_hook(self._hook(layer)))

    def _hook(self, layer: int):
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self.recording:
                self.by_layer[layer].append(output[2].detach().numpy().copy())
                self.logits[layer].append(output[0].detach().double().numpy().copy())

        return hook

    def counts(self, num_experts: int) -> np.ndarray:
        rows = []
        for layer in sorted(self.by_layer):
            idx = np.concatenate([a.reshape(-1) for a in self.by_layer[layer]])
            rows.append(np.bincount(idx, minlength=num_experts).astype(np.float64))
        return np.stack(rows)

    def switch_aux(self, num_experts: int) -> np.ndarray:
        """Per layer, the mean over forwards of E / (T k) * sum_i tokens_i * mean_softmax_i."""
        out = []
        for layer in sorted(self.by_layer):
            values = []
            for idx, logits in zip(self.by_layer[layer], self.logits[layer], strict=True):
                t, k = idx.shape
                counts = np.bincount(idx.reshape(-1), minlength=num_experts)
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                values.append(num_experts / (t * k) * (counts * p.mean(0)).sum())
            out.append(np.mean(values))
        return np.array(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_family_counts_equal_bincount_over_micro_batches(family: str) -> None:
    model, router_cls, layers, num_experts = build(family)
    capture = RouterCapture(model)
    recorder = IndexRecorder(model, router_cls)
    assert [r.layer for r in capture.routers] == layers
    assert capture.layer_labels == [str(x) for x in layers]
    assert {r.kind for r in capture.routers} == {"hf"}

    gen = torch.Generator().manual_seed(1)
    model.train()
    for micro_batch in range(3):  # gradient accumulation: three micro-batches, one step
        x = torch.randint(0, VOCAB, (2, 5 + micro_batch), generator=gen)
        recorder.recording = True
        model(x).logits.float().pow(2).mean().backward()
        recorder.recording = False
        # forwards that must not count: no_grad in train mode, and eval mode
        with torch.no_grad():
            model(x)
        model.eval()
        model(x)
        model.train()

    expected = recorder.counts(num_experts)
    loads = capture.loads()
    aux_sum, aux_count = capture.aux_losses()
    if family == "deepseek_v3":  # sigmoid + bias balancing: no Switch aux loss
        assert (aux_count == 0).all()
    else:
        np.testing.assert_array_equal(aux_count.numpy(), [3] * len(layers))
        np.testing.assert_allclose(
            (aux_sum / aux_count).numpy(), recorder.switch_aux(num_experts), rtol=1e-5
        )
    assert loads.dtype == torch.float64 and loads.shape == (len(layers), num_experts)
    np.testing.assert_array_equal(loads.numpy(), expected)
    # every token is routed to exactly k experts
    top_k = model.config.num_experts_per_tok
    assert (loads.sum(1) == top_k * (2 * 5 + 2 * 6 + 2 * 7)).all()

    capture.reset()
    assert capture.loads().sum() == 0
    capture.remove()
    model(torch.randint(0, VOCAB, (2, 5))).logits.sum().backward()
    assert capture.loads().sum() == 0  # hooks removed


def test_deepseek_indices_follow_group_limited_rule() -> None:
    """The counted indices are DeepSeek-V3's group-limited, bias-corrected sigmoid choice
    (recomputed here from the router logits), not a plain top-k of the logits."""
    model, router_cls, _, num_experts = build("deepseek_v3")
    router = next(m for m in model.modules() if type(m).__name__ == router_cls)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    router.register_forward_hook(lambda m, i, o: seen.append((o[0].detach(), o[2].detach())))
    capture = RouterCapture(model)
    model.train()
    model(torch.randint(0, VOCAB, (3, 7))).logits.sum().backward()
    logits, _ = seen[0]
    scores = logits.double().sigmoid() + router.e_score_correction_bias.double()
    groups = scores.view(-1, router.num_group, num_experts // router.num_group)
    group_scores = groups.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(router.topk_group, dim=-1).indices, True)
    masked = scores.masked_fill(~keep.repeat_interleave(num_experts // router.num_group, 1), -1e9)
    chosen = masked.topk(router.top_k, dim=-1).indices
    expected = np.bincount(chosen.reshape(-1).numpy(), minlength=num_experts)
    np.testing.assert_array_equal(capture.loads()[0].numpy(), expected)


def test_activation_checkpoint_rerun_not_counted() -> None:
    model, _, _, _ = build("mixtral")
    reference, _, _, _ = build("mixtral")
    reference.load_state_dict(model.state_dict())
    model.activation_checkpointing_enable()
    x = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    counts = []
    for m in (reference, model):
        capture = RouterCapture(m)
        m.train()
        m(x).logits.sum().backward()
        counts.append(capture.loads())
    assert counts[0].sum() > 0
    torch.testing.assert_close(counts[1], counts[0], rtol=0, atol=0)


# ---------------------------------------------------------------------- HF padding left out

# Two micro-batches of 2 sequences: the second sequence of the first is right-padded, the first
# of the second left-padded (and the two have different lengths).
PADDED_MASKS = (
    torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),
    torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]),
)


def _masked_expectation(
    recorder: IndexRecorder, masks: list[torch.Tensor], num_experts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From the routers' own indices and logits (recorded by the test's hook) and the masks of
    the forwards: per layer, the bincount over the non-padding tokens of every forward, the
    mean over forwards of E / (k T_valid) * sum_i count_i * mean_valid_softmax_i (float64), and
    the mean over forwards of Hugging Face's load_balancing_loss_func term / k."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    counts, aux, hf_aux = [], [], []
    for layer in sorted(recorder.by_layer):
        forwards = list(zip(recorder.by_layer[layer], recorder.logits[layer], masks, strict=True))
        row = np.zeros(num_experts)
        values, hf_values = [], []
        for idx, logits, mask in forwards:
            valid = mask.reshape(-1).numpy() != 0  # router token b * S + s is mask[b, s]
            _, k = idx.shape
            layer_counts = np.bincount(idx[valid].reshape(-1), minlength=num_experts)
            row += layer_counts
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            t_valid = valid.sum()
            values.append(num_experts / (k * t_valid) * (layer_counts * p[valid].mean(0)).sum())
            hf = load_balancing_loss_func(
                (torch.from_numpy(logits).float(),), num_experts, k, attention_mask=mask
            )
            hf_values.append(float(hf) / k)
        counts.append(row)
        aux.append(np.mean(values))
        hf_aux.append(np.mean(hf_values))
    return np.stack(counts), np.array(aux), np.array(hf_aux)


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen3_moe"])
def test_hf_padding_tokens_are_not_counted(family: str) -> None:
    model, router_cls, layers, num_experts = build(family)
    capture = RouterCapture(model)
    recorder = IndexRecorder(model, router_cls)
    gen = torch.Generator().manual_seed(5)
    model.train()
    for n, mask in enumerate(PADDED_MASKS):
        x = torch.randint(0, VOCAB, mask.shape, generator=gen)
        recorder.recording = True
        if n == 0:  # the mask by keyword
            out = model(x, attention_mask=mask).logits
        else:  # as the second positional argument, to the inner model only (its sole hook)
            out = model.model(x, mask).last_hidden_state
        recorder.recording = False
        out.float().pow(2).mean().backward()
    expected, aux, hf_aux = _masked_expectation(recorder, list(PADDED_MASKS), num_experts)
    everything = recorder.counts(num_experts)
    assert (expected.sum(1) < everything.sum(1)).all()  # the padding is really left out
    top_k = model.config.num_experts_per_tok
    assert (expected.sum(1) == top_k * sum(int(m.sum()) for m in PADDED_MASKS)).all()
    np.testing.assert_array_equal(capture.loads().numpy(), expected)
    aux_sum, aux_count = capture.aux_losses()
    np.testing.assert_array_equal(aux_count.numpy(), [2] * len(layers))
    np.testing.assert_allclose((aux_sum / aux_count).numpy(), aux, rtol=1e-5)
    # Hugging Face's own masked term of the layer is top_k times ours
    np.testing.assert_allclose(hf_aux, aux, rtol=1e-5)


def test_hf_padding_left_out_under_reentrant_checkpointing() -> None:
    # The counted run is the re-run in the backward pass: it is matched with its forward's mask.
    model, router_cls, _, num_experts = build("mixtral")
    reference, _, _, _ = build("mixtral")
    reference.load_state_dict(model.state_dict())
    model.activation_checkpointing_enable({"use_reentrant": True})
    capture = RouterCapture(model)
    recorder = IndexRecorder(reference, router_cls)
    recorder.recording = True
    model.train()
    reference.train()
    gen = torch.Generator().manual_seed(6)
    for mask in PADDED_MASKS:
        x = torch.randint(0, VOCAB, mask.shape, generator=gen)
        reference(x, attention_mask=mask)
        model(x, attention_mask=mask).logits.float().pow(2).mean().backward()
    expected, aux, _ = _masked_expectation(recorder, list(PADDED_MASKS), num_experts)
    np.testing.assert_array_equal(capture.loads().numpy(), expected)
    aux_sum, aux_count = capture.aux_losses()
    np.testing.assert_allclose((aux_sum / aux_count).numpy(), aux, rtol=1e-5)


def test_hf_without_mask_or_all_ones_counts_every_token() -> None:
    model, router_cls, _, num_experts = build("mixtral")
    capture = RouterCapture(model)
    recorder = IndexRecorder(model, router_cls)
    model.train()
    x = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    model(x, attention_mask=PADDED_MASKS[0]).logits.sum().backward()
    assert capture.loads().sum() < 2 * 2 * 12  # padding left out (layers x k x tokens)
    capture.reset()
    recorder.recording = True
    # no mask (clears the previous forward's), None, all ones
    model(x).logits.sum().backward()
    model(x, attention_mask=None).logits.sum().backward()
    model(x, attention_mask=torch.ones(2, 6, dtype=torch.long)).logits.sum().backward()
    np.testing.assert_array_equal(capture.loads().numpy(), recorder.counts(num_experts))
    assert (capture.loads().sum(1) == 2 * 3 * 12).all()
    aux_sum, aux_count = capture.aux_losses()
    np.testing.assert_allclose(
        (aux_sum / aux_count).numpy(), recorder.switch_aux(num_experts), rtol=1e-5
    )


def test_hf_mask_of_another_size_counts_every_token_and_warns_once() -> None:
    # With a KV cache the mask covers the cached tokens too: [B, past + S] for B * S routed.
    import warnings

    model, router_cls, layers, num_experts = build("mixtral")
    capture = RouterCapture(model)
    recorder = IndexRecorder(model, router_cls)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():  # the cache of a 5-token prefix (an evaluation forward: not counted)
        model.eval()
        first = model(torch.randint(0, VOCAB, (2, 5), generator=gen), use_cache=True)
    model.train()
    recorder.recording = True
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(
                torch.randint(0, VOCAB, (2, 3), generator=gen),
                attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]] * 2),
                past_key_values=copy.deepcopy(first.past_key_values),
                use_cache=True,
            )
        mismatch = [w for w in caught if "attention mask has 16" in str(w.message)]
        # one warning per router, on the first such forward only
        assert len(mismatch) == (len(layers) if _ == 0 else 0), [str(w.message) for w in caught]
    np.testing.assert_array_equal(capture.loads().numpy(), recorder.counts(num_experts))
    assert (capture.loads().sum(1) == 2 * 2 * 6).all()


def test_hf_padding_needs_no_host_synchronisation() -> None:
    # The operations that read a device value back to the host (.item(), nonzero for boolean
    # indexing, masked_select): none is added by the capture on a padded forward.
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    syncing = {"_local_scalar_dense", "nonzero", "masked_select", "item", "boolean index"}

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.__name__.split(".")[0]
            if name == "index" and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1]
            ):
                name = "boolean index"  # sizes its output from the mask: a sync on CUDA
            self.names[name] += 1
            return func(*args, **(kwargs or {}))

    model, _, _, _ = build("mixtral")
    capture = RouterCapture(model)
    model.train()
    x = torch.randint(0, VOCAB, (2, 6))
    runs = []
    for enabled in (False, True):
        capture.enabled = enabled
        with Ops() as ops:
            model(x, attention_mask=PADDED_MASKS[0])
        runs.append(ops.names)
    added = runs[1] - runs[0]
    assert added["masked_fill"] == 2  # the padding was sent to the overflow column, per layer
    assert not syncing & set(added), added
    assert capture.loads().sum() == 2 * 2 * 10


def test_hf_mask_hooks_removed_with_the_capture() -> None:
    model, _, _, _ = build("mixtral")
    assert not any(m._forward_pre_hooks for m in model.modules())
    capture = RouterCapture(model)
    # the outer and the inner transformers model record the mask
    assert [m for m in model.modules() if m._forward_pre_hooks] == [model, model.model]
    capture.remove()
    assert not any(
        m._forward_pre_hooks or m._forward_pre_hooks_with_kwargs for m in model.modules()
    )
    model.train()
    model(torch.randint(0, VOCAB, (2, 6)), attention_mask=PADDED_MASKS[0]).logits.sum().backward()
    assert capture.loads().sum() == 0 and capture._source_masks == {}  # (no mask recorded)
    capture.attach()  # and they come back with the router hooks
    assert [m for m in model.modules() if m._forward_pre_hooks] == [model, model.model]


# ---------------------------------------------------------------------- torchtitan stand-in


class TitanRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).softmax(-1)
        top, idx = scores.topk(self.top_k, dim=-1)
        return top, idx


class TitanMoE(nn.Module):
    """Faithful stand-in for torchtitan 0.3 ``models/common/moe.py::MoE`` (torchtitan itself
    needs triton and cannot be imported on this CPU machine): a non-persistent float32 buffer
    ``tokens_per_expert_E`` to which each training forward adds its counts."""

    def __init__(self, dim: int = 8, num_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.router = TitanRouter(dim, num_experts, top_k)
        self.experts = nn.Parameter(torch.randn(num_experts, dim, dim) * 0.1)
        self.register_buffer("tokens_per_expert_E", torch.zeros(num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, idx = self.router(x)
        routing_map = torch.zeros(*idx.shape[:-1], self.experts.shape[0], dtype=torch.bool)
        routing_map.scatter_(-1, idx, True)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(routing_map.reshape(-1, routing_map.shape[-1]).sum(0))
        out = torch.einsum("td,edf->tef", x, self.experts)
        return (out.gather(1, idx[..., None].expand(-1, -1, x.shape[-1])) * top[..., None]).sum(1)


class TitanModel(nn.Module):
    def __init__(self, num_layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(
            {str(i): nn.ModuleDict({"moe": TitanMoE()}) for i in range(num_layers)}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = x + block["moe"](x)
        return x


@pytest.mark.parametrize("titan_zeroes_buffer", [True, False])
def test_torchtitan_buffer_read_before_its_pre_hook_zeroes_it(titan_zeroes_buffer: bool) -> None:
    torch.manual_seed(0)
    model = TitanModel()
    capture = RouterCapture(model)
    assert [r.kind for r in capture.routers] == ["torchtitan"] * 3
    assert capture.layer_labels == ["0", "1", "2"]
    seen: dict[int, list[np.ndarray]] = {i: [] for i in range(3)}
    for i in range(3):
        model.layers[str(i)]["moe"].router.register_forward_hook(
            lambda m, inp, out, i=i: (
                seen[i].append(out[1].detach().numpy().copy())
                if m.training and torch.is_grad_enabled()
                else None
            )
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if titan_zeroes_buffer:  # torchtitan's _update_expert_bias runs as an optimizer PRE-hook

        def update_expert_bias(*args: Any) -> None:
            for block in model.layers.values():
                block["moe"].tokens_per_expert_E.zero_()

        opt.register_step_pre_hook(update_expert_bias)
    for step in range(2):
        for _ in seen.values():
            _.clear()
        for _ in range(2):  # two micro-batches
            model(torch.randn(10, 8)).pow(2).mean().backward()
        with torch.no_grad():
            model.eval()
            model(torch.randn(10, 8))
            model.train()
        opt.step()  # torchtitan zeroes its buffer here; the capture must already have it
        opt.zero_grad()
        expected = np.stack(
            [np.bincount(np.concatenate(seen[i]).reshape(-1), minlength=4) for i in range(3)]
        )
        np.testing.assert_array_equal(capture.loads().numpy(), expected, err_msg=f"step {step}")
        capture.reset()


class _FailingTitanMoE(TitanMoE):
    """A TitanMoE whose forward raises after torchtitan's add, when told to."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.fail:
            raise RuntimeError("out of memory (simulated)")
        return out


def test_torchtitan_counts_exact_past_float32_integers_and_buffer_untouched() -> None:
    """torchtitan never zeroes its float32 buffer without a load_balance_coeff (its optimizer
    pre-hook is registered only with one), so over a run it grows past 2**24, where float32
    holds no odd integer: a difference of its totals rounds each forward's counts to the
    total's spacing (8 at 2**26). The counts must still be the exact bincount of the routers'
    choices, and the buffer must hold what torchtitan alone would have left (bit for bit),
    also after a forward that raised."""
    torch.manual_seed(0)
    model = TitanModel()
    reference = copy.deepcopy(model)  # the same weights, never captured
    for m in (model, reference):
        for block in m.layers.values():
            block["moe"].tokens_per_expert_E.fill_(2.0**26 + 24)  # a long run's total
    seen: dict[int, list[np.ndarray]] = {i: [] for i in range(3)}
    for i in range(3):
        model.layers[str(i)]["moe"].router.register_forward_hook(
            lambda m, inp, out, i=i: seen[i].append(out[1].detach().numpy().copy())
        )
    capture = RouterCapture(model)
    assert [r.kind for r in capture.routers] == ["torchtitan"] * 3
    for _ in range(3):  # micro-batches of 9 tokens: odd counts
        x = torch.randn(9, 8)
        model(x).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
    expected = np.stack(
        [np.bincount(np.concatenate(seen[i]).reshape(-1), minlength=4) for i in range(3)]
    )
    assert (expected % 2).any()  # odd counts, which a float32 difference at 2**26 cannot hold
    np.testing.assert_array_equal(capture.loads().numpy(), expected)
    for name in ("0", "1", "2"):
        got = model.layers[name]["moe"].tokens_per_expert_E
        want = reference.layers[name]["moe"].tokens_per_expert_E
        assert torch.equal(got, want), name

    # a forward that raises after torchtitan's add: the buffer keeps its total plus that add
    failing = TitanModel(num_layers=1)
    failing.layers["0"]["moe"] = _FailingTitanMoE()
    moe = failing.layers["0"]["moe"]
    moe.tokens_per_expert_E.fill_(2.0**26)
    capture = RouterCapture(failing)
    moe.fail = True
    x = torch.randn(9, 8)
    with pytest.raises(RuntimeError, match="simulated"):
        failing(x)
    routed = torch.zeros(4).index_add_(0, moe.router(x)[1].reshape(-1), torch.ones(18))
    assert torch.equal(moe.tokens_per_expert_E, torch.full((4,), 2.0**26) + routed)
    capture.remove()
    assert not capture._snapshots


class _TopKBlock(nn.Module):
    def __init__(self, dim: int = 8, num_experts: int = 4) -> None:
        super().__init__()
        from trainvitals.moe import TopKRouter

        self.router = TopKRouter(dim, num_experts, 2)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, _ = self.router(x)
        return x + probs.sum(-1, keepdim=True) * self.proj(x)


class _Checkpointed(nn.Module):
    """Blocks run under torch.utils.checkpoint (or plainly, ``reentrant=None``)."""

    def __init__(self, blocks: list[nn.Module], reentrant: bool | str | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.layers:
            if self.reentrant is None:
                x = block(x)
            elif self.reentrant == "nested":
                inner = lambda t, b=block: checkpoint(b, t, use_reentrant=True)  # noqa: E731
                x = checkpoint(inner, x, use_reentrant=True)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("no_grad_between", [False, True])
@pytest.mark.parametrize("reentrant", [False, True, "nested"])
@pytest.mark.parametrize("kind", ["topk_router", "torchtitan"])
def test_each_forward_counted_once_under_either_activation_checkpointing(
    kind: str, reentrant: bool | str, no_grad_between: bool
) -> None:
    # Non-reentrant checkpointing re-runs a forward with autograd on in the backward pass; the
    # reentrant kind runs the first forward with autograd off (like evaluation) and re-runs
    # it in the backward pass: in both, each training forward must count exactly once, also
    # with a training-mode no_grad forward (generation) between a forward and its backward.
    torch.manual_seed(0)
    blocks: list[nn.Module] = [
        _TopKBlock() if kind == "topk_router" else TitanMoE() for _ in range(3)
    ]
    reference = _Checkpointed(blocks, None)
    model = _Checkpointed([copy.deepcopy(b) for b in blocks], reentrant)
    # expected: the routers' own choices in plain forwards of the same weights and inputs
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(3)}
    for i, block in enumerate(reference.layers):
        router = block.router
        router.register_forward_hook(
            lambda m, inp, out, i=i: seen[i].append(out[1].detach().clone())
        )
    capture = RouterCapture(model)
    assert [r.kind for r in capture.routers] == [kind] * 3
    # (reentrant checkpointing needs an input that requires grad)
    xs = [torch.randn(10, 8, requires_grad=True) for _ in range(2)]
    for x in xs:  # two micro-batches
        reference(x).pow(2).mean().backward()
        out = model(x)
        if no_grad_between:
            with torch.no_grad():
                model(torch.randn(10, 8))
        out.pow(2).mean().backward()
    with torch.no_grad():  # a training-mode forward without backward (e.g. generation)
        model(torch.randn(10, 8))
    expected = []
    for i in range(3):
        if kind == "topk_router":
            expected.append(torch.stack(seen[i]).sum(dim=(0, 1)).double())
        else:  # the TitanRouter's top-k indices
            idx = torch.cat([t.reshape(-1) for t in seen[i]])
            expected.append(torch.bincount(idx, minlength=4).double())
    assert torch.stack(expected).sum() == 3 * 2 * 10 * 2  # layers x micro-batches x tokens x k
    torch.testing.assert_close(capture.loads(), torch.stack(expected), rtol=0, atol=0)


# ---------------------------------------------------------------------- user extractors, naming


class CountingGate(nn.Module):
    """A router with an unusual output: (weights, a dict with the counts)."""

    def __init__(self, num_experts: int = 3) -> None:
        super().__init__()
        self.w = nn.Linear(4, num_experts)
        self.n = num_experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        choice = self.w(x).argmax(-1)
        return self.w(x), {
            "counts": torch.bincount(choice, minlength=self.n),
            "aux": self.w(x).pow(2).mean(),
        }


class Gates(nn.Module):
    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.ModuleDict({"gate": CountingGate()}) for _ in range(num_layers)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(block["gate"](x)[0].sum() for block in self.layers)


def _extract(module: nn.Module, inputs: Any, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return output[1]["counts"], output[1]["aux"]


def test_registered_extractor_counts_and_aux() -> None:
    torch.manual_seed(0)
    model = Gates(3)
    clear_router_extractors()
    try:
        assert len(find_routers(model)) == 0
        register_router_extractor(CountingGate, _extract, num_experts=lambda m: m.n)
        capture = RouterCapture(model)
    finally:
        clear_router_extractors()
    assert capture.layer_labels == ["0", "1", "2"]
    xs = [torch.randn(6, 4) for _ in range(2)]
    expected = np.zeros((3, 3))
    aux = np.zeros(3)
    for x in xs:
        for i, block in enumerate(model.layers):
            expected[i] += np.bincount(block["gate"].w(x).argmax(-1).numpy(), minlength=3)
            aux[i] += block["gate"].w(x).pow(2).mean().item()
        model(x)
    np.testing.assert_array_equal(capture.loads().numpy(), expected)
    aux_sum, aux_count = capture.aux_losses()
    np.testing.assert_allclose(aux_sum.numpy(), aux, rtol=1e-6)
    np.testing.assert_array_equal(aux_count.numpy(), [2, 2, 2])


def test_layer_numbers_numeric_fallbacks_and_clashes() -> None:
    assert layer_number_from_name("model.layers.10.mlp.gate") == 10
    assert layer_number_from_name("module.decoder.layers.3.mlp.router") == 3
    assert layer_number_from_name("mlp.gate") is None
    assert layer_number_from_name("block2.gate") is None  # only whole dotted components count

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module() for _ in range(12)])
    for i in (11, 2, 10, 0):
        model.layers[i].gate = CountingGate()
    model.encoder = nn.ModuleList([nn.Module() for _ in range(3)])
    model.encoder[2].gate = CountingGate()  # clashes with layers.2
    model.shared_gate = CountingGate()  # no number
    own = CountingGate()
    own.layer_number = 40
    model.final_gate = own  # no number in the name, but its own layer_number
    routers = find_routers(model, extractors=[(CountingGate, _extract, 3)])
    labels = [r.label for r in routers]
    # numeric order; the clash of layers.2 / encoder.2 resolved with full names; routers
    # without a number after the numbered ones (own 1-based layer_number 40 -> block 39, else
    # discovery position 5)
    assert labels == ["0", "layers_2_gate", "encoder_2_gate", "10", "11", "5", "39"]
    assert len(set(labels)) == len(labels)


def test_routers_with_different_expert_counts_raise() -> None:
    model = nn.Sequential(CountingGate(3), CountingGate(5), CountingGate(3))
    with pytest.raises(ValueError, match="same number of experts") as raised:
        RouterCapture(model, extractors=[(CountingGate, _extract, lambda m: m.n)])
    # which routers have which count, what is unsupported and what to do instead
    message = str(raised.value)
    assert "found 3 in 0, 2; 5 in 1." in message
    assert "do not support MoE layers with different numbers of experts" in message
    assert "leave LoadBalanceMonitor out" in message
    with pytest.raises(ValueError, match="number of experts is unknown"):
        RouterCapture(nn.Sequential(nn.Linear(2, 2)), extractors=[(nn.Linear, _extract)])
    with pytest.raises(TypeError, match="extractors"):
        RouterCapture(model, extractors=["nope"])


class FakeTopKRouter(nn.Module):
    """A router of an HF family not in the verified list, with sentinel indices (-1, E)."""

    def __init__(self, bad_output: bool = False) -> None:
        super().__init__()
        self.num_experts = 4
        self.top_k = 2
        self.bad_output = bad_output

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = x @ torch.ones(2, 4)
        idx = torch.tensor([[0, 1], [1, 4], [-1, 3], [3, 3]])
        if self.bad_output:  # e.g. (logits, indices, tokens_per_expert): not top-k indices last
            return logits, idx, torch.tensor([1, 2, 0, 3])
        return logits, logits, idx


FakeTopKRouter.__module__ = "transformers.models.fake.modeling_fake"


def test_generic_hf_router_and_out_of_range_indices() -> None:
    model = nn.Sequential(nn.Linear(2, 2), FakeTopKRouter())
    capture = RouterCapture(model)
    assert [(r.kind, r.label, r.has_aux_loss) for r in capture.routers] == [("hf", "1", False)]
    model(torch.randn(4, 2).requires_grad_())
    np.testing.assert_array_equal(capture.loads().numpy(), [[1, 2, 0, 3]])


def test_generic_hf_router_with_other_output_is_not_counted() -> None:
    model = nn.Sequential(nn.Linear(2, 2), FakeTopKRouter(bad_output=True))
    capture = RouterCapture(model)
    with pytest.warns(RuntimeWarning, match="unexpected output"):
        model(torch.randn(4, 2).requires_grad_())
    model(torch.randn(4, 2).requires_grad_())  # warned once, then skipped
    assert capture.loads().sum() == 0


# ---------------------------------------------------------------------- trainvitals TopKRouter


def test_topk_router_in_tiny_moe_lm_twelve_layers_numeric_order() -> None:
    from tests.helpers.moe_models import tiny_moe_lm
    from trainvitals.moe import TopKRouter, destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()  # its routers record into the global tracker

    model = tiny_moe_lm(num_layers=12)
    capture = RouterCapture(model)
    assert capture.layer_labels == [str(i) for i in range(12)]  # layers.10 after layers.2
    assert {r.kind for r in capture.routers} == {"topk_router"}
    maps: dict[int, list[np.ndarray]] = {i: [] for i in range(12)}
    aux: dict[int, list[float]] = {i: [] for i in range(12)}
    for i, block in enumerate(model.layers):
        router = block.mlp.router
        assert isinstance(router, TopKRouter)

        def hook(m: nn.Module, inp: Any, out: Any, i: int = i) -> None:
            if m.training and torch.is_grad_enabled():
                maps[i].append(out[1].numpy().copy())
                aux[i].append(float(m.last_aux_loss))

        router.register_forward_hook(hook)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        x = torch.randint(0, 32, (2, 6), generator=gen)
        model(x, labels=x).loss.backward()
    with torch.no_grad():
        model(x)
    expected = np.stack([np.concatenate(maps[i]).sum(0) for i in range(12)]).astype(np.float64)
    np.testing.assert_array_equal(capture.loads().numpy(), expected)
    aux_sum, aux_count = capture.aux_losses()
    np.testing.assert_allclose(aux_sum.numpy(), [sum(aux[i]) for i in range(12)], rtol=1e-6)
    np.testing.assert_array_equal(aux_count.numpy(), [2] * 12)
    destroy_moe_metrics_tracker()


def test_topk_router_padding_slots_not_counted() -> None:
    from trainvitals.moe import TopKRouter

    torch.manual_seed(0)
    padded = TopKRouter(8, 4, 2, capacity_factor=1.0, pad_to_capacity=True)
    plain = TopKRouter(8, 4, 2, capacity_factor=1.0)
    plain.load_state_dict(padded.state_dict())
    model = nn.ModuleList([padded])
    capture = RouterCapture(model)
    x = torch.randn(12, 8) * torch.linspace(0.1, 3, 8)
    _, padded_map = padded(x)
    _, kept_map = plain(x)
    assert padded_map.sum() > kept_map.sum()  # the padding is really there
    np.testing.assert_array_equal(capture.loads()[0].numpy(), kept_map.sum(0).numpy())


def test_packed_is_loads_then_aux_sums_then_aux_counts() -> None:
    from trainvitals.moe import TopKRouter

    torch.manual_seed(0)
    model = nn.ModuleList(
        [TopKRouter(8, 4, 2, aux_loss_type="aux_loss", aux_loss_coeff=0.01) for _ in range(3)]
    )
    capture = RouterCapture(model)
    empty = capture.packed()
    assert empty.dtype == torch.float64 and empty.shape == (3 * 4 + 3 + 3,)
    assert not empty.any()
    for _ in range(2):  # two micro-batches
        for router in model:
            router(torch.randn(10, 8)).__getitem__(0).sum().backward()
    values = capture.packed()
    aux_sum, aux_count = capture.aux_losses()
    expected = torch.cat([capture.loads().reshape(-1), aux_sum, aux_count])
    assert values.dtype == torch.float64
    assert torch.equal(values, expected)
    assert values[-3:].tolist() == aux_count.tolist() == [2, 2, 2]
    values.zero_()  # a new tensor: the counts are untouched
    assert capture.loads().sum() == 3 * 2 * 10 * 2
    capture.reset()
    assert not capture.packed().any()
    capture.reset()  # nothing counted since: still zeros
    assert not capture.packed().any()


def _expected(
    maps: dict[int, list[torch.Tensor]], aux: dict[int, list[float]]
) -> tuple[list[list[float]], list[float], list[int]]:
    rows = [
        np.concatenate([m.numpy() for m in maps[i]]).sum(0).astype(np.float64).tolist()
        if maps[i]
        else [0.0] * 4
        for i in sorted(maps)
    ]
    return rows, [sum(aux[i]) for i in sorted(aux)], [len(aux[i]) for i in sorted(aux)]


def test_read_host_equals_loads_and_aux_over_micro_batches_and_mixed_shapes() -> None:
    model, maps, aux = topk_routers_with_recorder(3)
    capture = RouterCapture(model)
    assert capture.read_host() == ([[0.0] * 4] * 3, [0.0] * 3, [0, 0, 0])
    gen = torch.Generator().manual_seed(1)
    for tokens in (10, 10, 7):  # three micro-batches, the last with another token count
        for router in model[:2]:  # router 2 never runs: a zero row
            router(torch.randn(tokens, 8, generator=gen))[0].sum().backward()
    rows, aux_sum, aux_count = capture.read_host()
    exp_rows, exp_aux, exp_count = _expected(maps, aux)
    assert rows == exp_rows
    assert aux_count == exp_count == [3, 3, 0]
    np.testing.assert_allclose(aux_sum, exp_aux, rtol=1e-12)
    # the device path gives the same numbers
    assert capture.loads().tolist() == exp_rows
    assert capture.read_host()[0] == exp_rows
    capture.reset()
    assert capture.read_host() == ([[0.0] * 4] * 3, [0.0] * 3, [0, 0, 0])


def test_hooks_run_no_kernel_in_the_forward() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.count += 1
            return func(*args, **(kwargs or {}))

    model, _, _ = topk_routers_with_recorder(1)
    router = model[0]
    x = torch.randn(10, 8)
    capture = RouterCapture(model)
    router(x)  # the first counted forward makes the accumulators (once per run)
    capture.enabled = False
    with Ops() as plain:
        router(x)
    capture.enabled = True
    with Ops() as counted:
        router(x)
    # the same operations as a forward that is not counted (the recorder hook clones in both)
    assert counted.count == plain.count
    assert capture.loads().sum() == 2 * 10 * 2


def test_map_changed_in_place_after_the_forward_drops_the_layer_for_the_step() -> None:
    model, maps, aux = topk_routers_with_recorder(2)
    capture = RouterCapture(model)
    gen = torch.Generator().manual_seed(3)
    outputs = [router(torch.randn(10, 8, generator=gen)) for router in model]
    outputs[0][1].zero_()  # the model reuses router 0's map in place
    with pytest.warns(RuntimeWarning, match="modified in place"):
        rows, _, counts = capture.read_host()
    assert rows[0] == [0.0] * 4 and counts[0] == 0  # unknown: no number rather than a wrong one
    assert rows[1] == _expected(maps, aux)[0][1]
    capture.reset()
    for _ in range(2):  # router 0 is now counted in its hook: in-place changes are harmless
        outputs = [router(torch.randn(10, 8, generator=gen)) for router in model]
        outputs[0][1].zero_()
    rows, _, counts = capture.read_host()
    expected_rows = [
        np.stack([m.numpy() for m in maps[i][1:]]).sum((0, 1)).astype(np.float64).tolist()
        for i in range(2)
    ]
    assert rows == expected_rows and counts == [2, 2]


def test_held_maps_are_counted_early_past_the_memory_bound(monkeypatch) -> None:
    import trainvitals.moe.capture as capture_module

    monkeypatch.setattr(capture_module, "_MAX_PENDING_NUMEL", 100)  # 10 tokens x 4 experts
    model, maps, aux = topk_routers_with_recorder(2)
    capture = RouterCapture(model)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        for router in model:
            router(torch.randn(10, 8, generator=gen))
    assert len(capture._pending_maps) < 6  # some were counted before the step was read
    rows, aux_sum, counts = capture.read_host()
    exp_rows, exp_aux, exp_count = _expected(maps, aux)
    assert rows == exp_rows and counts == exp_count
    np.testing.assert_allclose(aux_sum, exp_aux, rtol=1e-12)


def test_all_padding_micro_batch_does_not_count_in_the_logged_aux_loss() -> None:
    """Gradient accumulation over three micro-batches, the second entirely padding: the logged
    aux loss of each layer is the mean over the two micro-batches that have tokens (Hugging
    Face's masked term / k, computed here by transformers' own function), not a mean over
    three that counts the padding micro-batch's 0."""
    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor

    model, router_cls, layers, num_experts = build("mixtral")
    recorder = IndexRecorder(model, router_cls)
    masks = [PADDED_MASKS[0], torch.zeros(2, 5, dtype=torch.long), PADDED_MASKS[1]]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = RecordingWriter()
    monitor = LoadBalanceMonitor(mode="detailed")
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    gen = torch.Generator().manual_seed(11)
    model.train()
    for mask in masks:
        vitals.batch()
        x = torch.randint(0, VOCAB, mask.shape, generator=gen)
        recorder.recording = True
        out = model(x, attention_mask=mask).logits
        recorder.recording = False
        out.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    vitals.close()
    # independent: only the micro-batches with a non-padding token, float64 numpy
    kept = [n for n, m in enumerate(masks) if m.any()]
    for layer in recorder.by_layer:
        recorder.by_layer[layer] = [recorder.by_layer[layer][n] for n in kept]
        recorder.logits[layer] = [recorder.logits[layer][n] for n in kept]
    _, aux, hf_aux = _masked_expectation(recorder, [masks[n] for n in kept], num_experts)
    np.testing.assert_allclose(hf_aux, aux, rtol=1e-5)
    (row,) = writer.rows.values()
    for label, expected in zip(layers, aux, strict=True):
        np.testing.assert_allclose(row[f"moe/layer_{label}/aux_loss"], expected, rtol=1e-6)
    np.testing.assert_allclose(row["moe/aux_loss_mean"], np.mean(aux), rtol=1e-6)
    # the device-side read gives the same counts (the path taken with several ranks)
    capture = RouterCapture(model)
    model(torch.randint(0, VOCAB, (2, 5)), attention_mask=masks[1]).logits.sum().backward()
    model(torch.randint(0, VOCAB, (2, 6)), attention_mask=masks[0]).logits.sum().backward()
    _, aux_count = capture.aux_losses()
    np.testing.assert_array_equal(aux_count.numpy(), [1] * len(layers))
    assert capture.read_host()[2] == [1] * len(layers)


# ---------------------------------------------------------------------- torch.compile


class _TwoRouters(nn.Module):
    """The smallest compiled model with routers: two TopKRouters (E = 4, k = 2, Switch aux
    loss) on the same tokens, in a loop over a ModuleList as in a decoder stack."""

    def __init__(self) -> None:
        super().__init__()
        from trainvitals.moe import TopKRouter

        self.routers = nn.ModuleList(
            [TopKRouter(8, 4, 2, aux_loss_type="aux_loss", aux_loss_coeff=0.01) for _ in range(2)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(())
        for router in self.routers:
            probs, _ = router(x)
            out = out + probs.pow(2).sum()
        return out


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_model_counts_every_step_without_tracing_the_hooks() -> None:
    # Under torch.compile, Dynamo traced the capture's hooks: they guarded on its Python state
    # (len(self._pending_aux), self._aux_count[i], ...), which changes on every forward, so the
    # hook was recompiled forward after forward up to the recompile limit. The hooks now run
    # eagerly: nothing of capture.py is compiled, and every step's counts are exact.
    import trainvitals.moe.capture as capture_module

    torch.manual_seed(0)
    model = _TwoRouters()
    compiled = torch.compile(model)
    capture = RouterCapture(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(2)
    e, k = 4, 2
    for step in range(3):
        # independent: float64 top-k counts and Switch loss from the weights before the step
        weights = [r.weight.detach().double().clone() for r in model.routers]
        counts = np.zeros((2, e))
        aux = np.zeros(2)
        for _ in range(2):  # two micro-batches
            x = torch.randn(10, 8, generator=gen)
            compiled(x).backward()
            for i, w in enumerate(weights):
                scores = (x.double() @ w.T).softmax(dim=-1)
                chosen = np.bincount(scores.topk(k, dim=-1).indices.reshape(-1), minlength=e)
                counts[i] += chosen
                aux[i] += e / (k * 10**2) * float((scores.sum(0).numpy() * chosen).sum())
        rows, aux_sum, aux_count = capture.read_host()
        assert rows == counts.tolist(), f"step {step}"
        assert aux_count == [2, 2], f"step {step}"
        np.testing.assert_allclose(aux_sum, aux, rtol=1e-5, err_msg=f"step {step}")
        capture.reset()
        opt.step()
        opt.zero_grad()
    recompiled = [
        code.co_name
        for code in torch._dynamo.utils.guard_failures
        if code.co_filename == capture_module.__file__
    ]
    assert not recompiled, recompiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device beside the CPU")
def test_hf_model_split_over_devices_counts_and_aux_of_every_layer() -> None:
    """A model split over devices (``device_map="auto"``, offloaded layers): the counts live on
    the first router's device (CUDA), layer 1 runs on the CPU. Its aux loss needs the
    forward's counts where its logits are (before: a device mismatch raised in the hook, the
    router was dropped after its first forward, so its row held part of the step), and the
    attention mask it is matched with is copied to the host without a ``non_blocking`` race."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model, router_cls, layers, num_experts = build("mixtral")
    model.to("cuda")
    add_hook_to_module(
        model.model.layers[1].to("cpu"),
        AlignDevicesHook(execution_device="cpu", io_same_device=True),
    )
    seen: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {layer: [] for layer in layers}
    for name, module in model.named_modules():
        if type(module).__name__ == router_cls:
            layer = int(name.split("layers.")[1].split(".")[0])
            module.register_forward_hook(
                lambda m, i, out, layer=layer: seen[layer].append(
                    (out[2].detach().cpu().numpy(), out[0].detach().double().cpu().numpy())
                )
            )
    capture = RouterCapture(model)
    assert [r.module.weight.device.type for r in capture.routers] == ["cuda", "cpu"]
    gen = torch.Generator().manual_seed(5)
    model.train()
    for mask in PADDED_MASKS:
        x = torch.randint(0, VOCAB, mask.shape, generator=gen).cuda()
        model(x, attention_mask=mask.cuda()).logits.float().pow(2).mean().backward()
    recorder = IndexRecorder(nn.Module(), router_cls)  # filled from the hooks above
    recorder.by_layer = {layer: [idx for idx, _ in v] for layer, v in seen.items()}
    recorder.logits = {layer: [logits for _, logits in v] for layer, v in seen.items()}
    expected, aux, _ = _masked_expectation(recorder, list(PADDED_MASKS), num_experts)
    assert capture.device.type == "cuda"
    np.testing.assert_array_equal(capture.loads().cpu().numpy(), expected)
    aux_sum, aux_count = capture.aux_losses()
    np.testing.assert_array_equal(aux_count.cpu().numpy(), [2, 2])
    np.testing.assert_allclose((aux_sum / aux_count).cpu().numpy(), aux, rtol=1e-5)
