"""ThroughputMonitor(measure_flops=True) on tiny Hugging Face MoE models (8 experts, top-2):
which flops it reports, against independent counts.

* The model-flops formula of PaLM (Chowdhery et al. 2022, appendix B), also Megatron-LM's and
  torchtitan's ``get_num_flop_per_token``: ``6 * N + 12 * L * H * Q * T`` per token, ``N`` the
  (active) non-embedding parameters, ``L`` layers, ``H`` heads of size ``Q``, ``T`` tokens per
  sequence. Its 12 is 2 attention matmuls forward and 4 backward, times 2 flops per
  multiply-add; torchtitan notes that the fused kernel's recomputation of the scores in the
  backward "should not be counted in calculating MFU". ``FlopCounterMode`` counts it (torch's
  ``sdpa_backward_flop_count``: five matmuls), so a measurement is hardware flops,
  ``2 * L * H * Q * T`` per token above the formula: the docs say so.
* A ``FlopCounterMode`` (with trainvitals' extra formulas: torch 2.13 has none for
  ``_grouped_mm`` or the CPU attention kernel) run by hand around each step's forward and
  backward: the work of every step, which the monitor's count of the first step stands for.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.scripts.vitals_testing import FakeClock, RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor
from trainvitals.stats.flops import extra_flop_formulas

transformers = pytest.importorskip("transformers")

B, S, VOCAB, HIDDEN, E, TOP_K, LAYERS, HEADS, HEAD_DIM = 2, 16, 96, 32, 8, 2, 2, 4, 8
PEAK = 1e9


def _build(family: str) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            **common,
            intermediate_size=24,
            num_local_experts=E,
            num_experts_per_tok=TOP_K,
            head_dim=HEAD_DIM,
        )
        cls = transformers.MixtralForCausalLM
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=E,
            num_experts_per_tok=TOP_K,
            head_dim=HEAD_DIM,
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.OlmoeConfig(
            **common,
            intermediate_size=24,
            num_experts=E,
            num_experts_per_tok=TOP_K,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        )
        cls = transformers.OlmoeForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(cfg)


def _active_matmul_params(model: torch.nn.Module) -> float:
    """``N_active``: the weights of the model's matmuls (embedding lookup and norm scales
    apart, the lm_head in), each routed expert's at ``top_k / E``."""
    n = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or "norm" in name:
            continue
        n += p.numel() * (TOP_K / E if ".experts." in name else 1)
    return n


def _by_hand(model: torch.nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as counter:
        model(input_ids=x, labels=x).loss.backward()
    return counter.get_total_flops()


def _train(model, batches, **monitor_kwargs):
    """Steps over ``batches`` (a list of micro-batch lists) with the monitor measuring and a
    hand count of each step; returns the monitor, its rows and the hand counts per step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = FakeClock()
    writer = RecordingWriter()
    monitor = ThroughputMonitor(
        window_size=1,
        warmup_steps=0,
        clock=clock,
        measure_flops=True,
        peak_flops=PEAK,
        log_every_n_steps=1,
        **monitor_kwargs,
    )
    accumulate = len(batches[0])
    vitals = Vitals([monitor], writer=writer, accumulate_grad_batches=accumulate)
    vitals.attach(model, opt)
    hand = []
    for micro_batches in batches:
        flops = 0
        for x in micro_batches:
            vitals.batch({"input_ids": x})
            clock.t += 1.0
            flops += _by_hand(model, x)
        hand.append(flops)
        opt.step()
        opt.zero_grad()
    vitals.close()
    return monitor, writer.rows, hand


def _tokens(seed: int, n: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (B, S), generator=g) for _ in range(n)]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_measured_flops_are_hardware_flops_above_palm_model_flops(family):
    model = _build(family)
    monitor, rows, hand = _train(model, [_tokens(0)])
    n_active = _active_matmul_params(model)
    palm = 6 * n_active + 12 * LAYERS * HEADS * HEAD_DIM * S  # model flops per token
    recomputed_scores = 2 * LAYERS * HEADS * HEAD_DIM * S  # the fused backward's extra matmul
    unit, per_token = monitor.state_dict()["measured"]
    assert unit == "tokens"
    assert per_token == pytest.approx(palm + recomputed_scores, rel=1e-12)
    assert per_token == pytest.approx(hand[0] / (B * S), rel=1e-12)
    row = rows[max(rows)]
    assert row["throughput/device/flops_per_sec"] == pytest.approx(hand[0], rel=1e-12)  # 1 s
    assert row["throughput/device/mfu"] == pytest.approx(hand[0] / PEAK, rel=1e-12)
    assert row["throughput/mfu"] == pytest.approx(hand[0] / PEAK, rel=1e-12)


def test_routing_does_not_change_the_count_so_the_first_step_stands_for_every_step():
    """Every token runs exactly top_k experts: the same work per step whichever experts the
    router picks, also when every token goes to the same two (six experts get no token)."""
    model = _build("qwen3_moe")
    same = torch.full((B, S), 7)
    batches = [_tokens(0), _tokens(1), [same]]
    _monitor, rows, hand = _train(model, batches)
    assert len(set(hand)) == 1
    written = [rows[s]["throughput/device/flops_per_sec"] for s in sorted(rows)]
    assert written == [pytest.approx(h, rel=1e-12) for h in hand]


def test_gradient_accumulation_counts_every_micro_batch_of_the_step():
    model = _build("mixtral")
    batches = [_tokens(0, 3), _tokens(1, 3)]
    monitor, rows, hand = _train(model, batches)
    assert monitor.state_dict()["measured"][1] == pytest.approx(hand[0] / (3 * B * S))
    for step, flops in enumerate(hand):  # 3 s per optimizer step
        assert rows[step]["throughput/device/flops_per_sec"] == pytest.approx(flops / 3.0)


def test_activation_checkpointing_is_counted_as_hardware_flops():
    model = _build("olmoe")
    plain = _by_hand(_build("olmoe"), _tokens(0)[0])
    model.activation_checkpointing_enable()
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor, _rows, hand = _train(model, [_tokens(0)])
    # the decoder layers' forward runs twice: their forward flops on top of the plain count
    layers = torch.nn.ModuleList(model.model.layers)
    forward = _forward_flops_of_layers(model, _tokens(0)[0], layers)
    assert hand[0] == plain + forward
    assert monitor.state_dict()["measured"][1] == pytest.approx(hand[0] / (B * S))


def _forward_flops_of_layers(model, x, layers) -> int:
    """Forward flops inside ``layers`` (counted by hooks around each layer, no grad)."""
    total = 0
    counters: list[FlopCounterMode] = []

    def pre(module, args, kwargs):
        counters.append(FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()))
        counters[-1].__enter__()

    def post(module, args, kwargs, out):
        nonlocal total
        counter = counters.pop()
        counter.__exit__(None, None, None)
        total += counter.get_total_flops()

    handles = [layer.register_forward_pre_hook(pre, with_kwargs=True) for layer in layers]
    handles += [layer.register_forward_hook(post, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            model(input_ids=x)
    finally:
        for h in handles:
            h.remove()
    return total


def test_zero_computation_experts_make_the_first_step_an_approximation():
    """LongCat-Flash routes some tokens to identity experts: the work per token follows the
    routing, so the first step's count is reused for steps that did other work, as documented
    (a later step ran 7% more flops than the first here)."""
    cfg = transformers.LongcatFlashConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=64,
        ffn_hidden_size=48,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        head_dim=4,
        v_head_dim=8,
        qk_head_dim=12,
        moe_topk=TOP_K,
        n_routed_experts=E,
        zero_expert_num=4,
        expert_ffn_hidden_size=24,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LongcatFlashForCausalLM(cfg)
    first, second = _tokens(0, 2)
    second[:] = second[0, 0]  # every token routed alike
    _monitor, rows, hand = _train(model, [[first], [second]])
    assert hand[1] / hand[0] == pytest.approx(1.0723, abs=1e-4)  # 4,973,568 then 5,332,992
    written = [rows[s]["throughput/device/flops_per_sec"] for s in sorted(rows)]
    assert written == [pytest.approx(hand[0], rel=1e-12)] * 2
