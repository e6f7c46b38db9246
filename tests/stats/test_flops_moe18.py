"""Measured flops of mixture-of-experts models against an independent analytic count.

transformers 5.x runs the experts of its MoE families with ``torch._grouped_mm`` by default
(``experts_implementation="grouped_mm"``), which torch 2.13's ``flop_counter`` has no formula
for: every routed expert's matmuls were missing from a measured step (and, on CPU, the
``scaled_dot_product_attention`` kernel's too). The analytic count here: every ``Linear`` a
token goes through costs ``2 * in * out`` forward and twice that backward (input and weight
gradients: every input needs a gradient, the embeddings being trained); each routed expert
only for the tokens the router sent it (read from the router's choice); attention's two
matmuls ``2 * b * heads * s * s * (d_qk + d_v)`` forward, three times that with plain matmuls
and, for the fused SDPA kernel, the backward as torch counts its CUDA kernels (the scores
recomputed: ``2 * b * heads * s * s * (3 d_qk + 2 d_v)``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.scripts.vitals_testing import FakeClock, RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor
from trainvitals.stats.flops import FlopCounterSession, grouped_mm_flops, measure_flops

transformers = pytest.importorskip("transformers")

B, S, VOCAB, HIDDEN, E, TOP_K = 2, 8, 64, 32, 4, 2
FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]
IMPLEMENTATIONS = ["grouped_mm", "batched_mm", "eager"]


def _build(family: str, attn: str = "eager") -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_experts=E,
            num_experts_per_tok=TOP_K,
            num_key_value_heads=2,
            head_dim=8,
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(
            **common,
            intermediate_size=24,
            num_local_experts=E,
            num_experts_per_tok=TOP_K,
            num_key_value_heads=2,
            head_dim=8,
        )
        cls = transformers.MixtralForCausalLM
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(
            **common,
            intermediate_size=24,
            num_experts=E,
            num_experts_per_tok=TOP_K,
            num_key_value_heads=2,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        )
        cls = transformers.OlmoeForCausalLM
    elif family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            **common,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_key_value_heads=4,
            n_routed_experts=E,
            n_shared_experts=1,
            num_experts_per_tok=TOP_K,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
        cls = transformers.DeepseekV3ForCausalLM
    else:
        cfg = transformers.GptOssConfig(
            **common,
            intermediate_size=24,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=E,
            num_experts_per_tok=TOP_K,
            layer_types=["full_attention", "full_attention"],
            sliding_window=16,
        )
        cls = transformers.GptOssForCausalLM
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(cfg)


def _record_assignments(model: torch.nn.Module) -> list[torch.Tensor]:
    """Tokens per expert of every MoE layer, read from the router's choice (the ``top_k_index``
    each experts module is called with)."""
    counts: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        counts.append(torch.bincount(index.reshape(-1), minlength=module.num_experts))

    for module in model.modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, "num_experts"):
            module.register_forward_pre_hook(hook, with_kwargs=True)
    return counts


def _analytic(model: torch.nn.Module, family: str, assignments: list[torch.Tensor], attn: str):
    """Forward + backward flops of one training step on a ``[B, S]`` batch, from the config."""
    cfg = model.config
    t, h, n_layers = B * S, cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    # multiply-adds per token of the dense Linears (routed experts apart)
    macs = h * cfg.vocab_size  # lm_head
    if family == "deepseek_v3":
        d_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        d_v = cfg.v_head_dim
        attn_proj = (
            h * heads * d_qk  # q_proj (no q LoRA)
            + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # kv_a_proj_with_mqa
            + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + d_v)  # kv_b_proj
            + heads * d_v * h  # o_proj
        )
        dense = cfg.first_k_dense_replace
        macs += n_layers * attn_proj + dense * 3 * h * cfg.intermediate_size
        shared = 3 * h * cfg.moe_intermediate_size * cfg.n_shared_experts
        macs += (n_layers - dense) * (shared + h * cfg.n_routed_experts)  # + router
        expert_intermediate = cfg.moe_intermediate_size
        n_experts, moe_layers = cfg.n_routed_experts, n_layers - dense
    else:
        d_qk = d_v = getattr(cfg, "head_dim", None) or h // heads
        kv = cfg.num_key_value_heads
        attn_proj = h * heads * d_qk + 2 * h * kv * d_qk + heads * d_qk * h
        n_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        macs += n_layers * (attn_proj + h * n_experts)  # + router
        expert_intermediate = getattr(cfg, "moe_intermediate_size", cfg.intermediate_size)
        moe_layers = n_layers
    linear = 6 * t * macs
    # routed experts: gate and up (h -> 2 I) and down (I -> h) per token sent to the expert
    assert len(assignments) == moe_layers
    routed = sum(int(c.sum()) for c in assignments)
    assert routed == moe_layers * t * cfg.num_experts_per_tok
    assert all(c.numel() == n_experts for c in assignments)
    experts = 6 * routed * 3 * h * expert_intermediate
    forward_attention = 2 * B * heads * S * S * (d_qk + d_v)
    if attn == "eager":
        attention = 3 * forward_attention  # plain matmuls: dQ, dK, dP, dV
    else:  # the fused kernel's backward recomputes the scores
        attention = forward_attention + 2 * B * heads * S * S * (3 * d_qk + 2 * d_v)
    return linear + experts + n_layers * attention


def _measure(model: torch.nn.Module) -> int:
    x = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))
    session = FlopCounterSession()
    session.start()
    try:
        model(input_ids=x, labels=x).loss.backward()
    finally:
        flops = session.stop()
    assert flops is not None
    return flops


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_moe_measured_flops_equal_the_active_experts_analytic_count(family, implementation):
    # before the fix, grouped_mm (transformers' default): measured / analytic 0.51 (Qwen3-MoE,
    # Mixtral, OLMoE, GPT-OSS), 0.80 (DeepSeek-V3); batched_mm and eager were exact already
    model = _build(family)
    model.set_experts_implementation(implementation)
    assignments = _record_assignments(model)
    measured = _measure(model)
    assert measured == _analytic(model, family, assignments, "eager")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_cpu_sdpa_kernel_counted(family):
    # before the fix: the CPU attention kernel counted 0 (0.94 of the analytic count with
    # eager experts; with grouped_mm experts 0.45)
    model = _build(family, attn="sdpa")
    model.set_experts_implementation("eager")
    assignments = _record_assignments(model)
    assert _measure(model) == _analytic(model, family, assignments, "sdpa")


def test_transformers_grouped_mm_fallback_counted(monkeypatch):
    """transformers' custom-op loop over experts (no grouped_mm kernel: a GPU before SM80,
    torch.compile with weights not in bf16) hides its ``mm`` calls from the mode."""
    # before the fix: 0.51 of the analytic count (the experts' custom ops uncounted)
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.integrations import moe

    class OpNames(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *a: False)
    model = _build("qwen3_moe")
    model.set_experts_implementation("grouped_mm")
    assignments = _record_assignments(model)
    assert _measure(model) == _analytic(model, "qwen3_moe", assignments, "eager")
    ops = OpNames()
    x = torch.randint(0, VOCAB, (B, S))
    with ops:
        model(input_ids=x, labels=x).loss.backward()
    assert "transformers.grouped_mm_fallback.default" in ops.names
    assert "transformers.grouped_mm_fallback_backward.default" in ops.names
    assert "aten._grouped_mm.default" not in ops.names


def test_tiny_moe_lm_counts_every_expert_it_computes():
    """TinyMoELM runs every expert on every token (a dense einsum, masked by the router's
    weights): the measurement is the work done, E experts per token, not the top-k (before the
    fix 0.97 of it: its CPU attention kernel uncounted)."""
    from trainvitals.moe.tiny_model import TinyMoELM

    v, h, f, layers, heads = 64, 32, 48, 2, 4
    torch.manual_seed(0)
    model = TinyMoELM(
        vocab_size=v,
        hidden_size=h,
        num_layers=layers,
        num_experts=E,
        top_k=TOP_K,
        ffn_hidden_size=f,
        num_heads=heads,
        max_seq_len=S,
        aux_loss_type=None,
        z_loss_coeff=0.0,
    )
    x = torch.randint(0, v, (B, S), generator=torch.Generator().manual_seed(1))
    session = FlopCounterSession()
    session.start()
    model(x, labels=x).loss.backward()
    measured = session.stop()
    t, d = B * S, h // heads
    # qkv + proj + router + lm_head, all E experts (h -> f -> h) and the E-way combine
    macs = layers * (3 * h * h + h * h + h * E + E * (h * f + f * h) + E * h) + h * v
    attention = 2 * B * heads * S * S * (2 * d) + 2 * B * heads * S * S * (3 * d + 2 * d)
    assert measured == 6 * t * macs + layers * attention


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "offs", "mms"),
    [
        # shapes with 16-byte strides (the CPU kernel's requirement)
        # (M, K) x (G, K, N): each group's rows through its matrix; rows past offs[-1] skipped
        ((10, 8), (3, 8, 4), [2, 2, 7], [(2, 8, 4), (0, 8, 4), (5, 8, 4)]),
        # (M, K) x (K, N) grouped along K: out (G, M, N)
        ((4, 12), (12, 8), [3, 8], [(4, 3, 8), (4, 5, 8)]),
        # (G, M, K) x (K, N) grouped along N: out (M, N)
        ((2, 4, 8), (8, 12), [4, 7], [(4, 8, 4), (4, 8, 3)]),
        # (G, M, K) x (G, K, N): batched
        ((3, 4, 8), (3, 8, 4), None, [(4, 8, 4)] * 3),
    ],
)
def test_grouped_mm_flops_each_layout(a_shape, b_shape, offs, mms):
    expected = sum(2 * m * k * n for m, k, n in mms)
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    o = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    assert measure_flops(lambda: torch._grouped_mm(a, b, offs=o)) == expected
    used = None if offs is None else offs[-1]
    assert grouped_mm_flops(a_shape, b_shape, used) == expected


def test_grouped_mm_on_meta_counts_the_whole_operand():
    # (offsets on the meta device cannot be read: every row counts; the meta function checks
    # the CUDA kernel's rules: bf16, the weight column-major)
    a = torch.empty(10, 8, device="meta", dtype=torch.bfloat16)
    b = torch.empty(3, 4, 8, device="meta", dtype=torch.bfloat16).transpose(-2, -1)
    offs = torch.tensor([2, 4, 10], dtype=torch.int32, device="meta")
    assert measure_flops(lambda: torch._grouped_mm(a, b, offs=offs)) == 2 * 10 * 8 * 4


def test_throughput_monitor_measures_the_routed_experts():
    """End to end: the monitor's measured flops per token of a Qwen3-MoE step (transformers'
    default grouped_mm experts) are the analytic count's (before the fix: 56832 per token, 0.51
    of 112128)."""
    model = _build("qwen3_moe")
    model.set_experts_implementation("grouped_mm")
    assignments = _record_assignments(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    clock = FakeClock()
    monitor = ThroughputMonitor(
        window_size=2, clock=clock, measure_flops=True, peak_flops=1e9, log_every_n_steps=1
    )
    writer = RecordingWriter()
    vitals = Vitals([monitor], writer=writer).attach(model, opt)
    expected = None
    for _ in range(2):
        x = torch.randint(0, VOCAB, (B, S))
        vitals.batch({"input_ids": x})
        clock.t += 1.0
        model(input_ids=x, labels=x).loss.backward()
        if expected is None:
            expected = _analytic(model, "qwen3_moe", list(assignments), "eager")
        opt.step()
        opt.zero_grad()
    vitals.close()
    assert monitor.state_dict()["measured"] == ["tokens", pytest.approx(expected / (B * S))]
    row = writer.rows[max(writer.rows)]
    assert row["throughput/device/flops_per_sec"] == pytest.approx(expected)
