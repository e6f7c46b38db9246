"""The demo's callbacks (examples/demo.py, `make demo`) on a tiny TinyMoELM, a few steps with
gradient accumulation: their numbers against each other and against float64 recomputations
of the same gradients, weights and batches, as a user checks a dashboard before trusting it.

The demo wrote global norms and per-tensor statistics only to the JSONL file: no per-layer
view on the dashboards, no router gradient norms and no flops; `make_callbacks()` now asks for
them and this test checks the values they write."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from trainvitals.adapters import FanoutWriter, JsonlSink
from trainvitals.adapters.loop import Vitals
from trainvitals.moe import TinyMoELM, get_aux_loss_backward_scale, set_aux_loss_backward_scale

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K, FFN, HEADS = 32, 16, 2, 4, 2, 24, 2
BATCH, SEQ, MICRO, STEPS = 3, 10, 2, 3


def _demo():
    spec = importlib.util.spec_from_file_location("demo_cross_checks19", ROOT / "examples/demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _moments(x: torch.Tensor) -> tuple[float, float]:
    """(rms, Pearson kurtosis) of all elements, float64."""
    x = x.double().flatten()
    centred = x - x.mean()
    var = centred.square().mean()
    return float(x.square().mean().sqrt()), float(centred.pow(4).mean() / var.square())


def _analytic_flops_per_token() -> float:
    # Matmul flops of one forward per token: q/k/v and output projections, causal attention as
    # the flop counter counts it (the full S x S scores and their product with V), the router,
    # every expert on every token (TinyMoELM's dense einsum), the combine, the LM head.
    h, f = HIDDEN, FFN
    attention = 2 * 2 * SEQ * h
    layer = 2 * h * 3 * h + 2 * h * h + attention + 2 * h * EXPERTS
    layer += EXPERTS * (2 * h * f + 2 * f * h) + 2 * EXPERTS * h
    forward = LAYERS * layer + 2 * h * VOCAB
    # backward: twice the forward's matmuls, plus torch's attention backward formula, which
    # recomputes the scores (5 batched matmuls against the forward's 2 -> 0.5 extra)
    return 3 * forward + 0.5 * LAYERS * attention


def test_demo_callbacks_agree_with_float64_recomputation(tmp_path):
    demo = _demo()
    torch.manual_seed(0)
    model = TinyMoELM(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=LAYERS,
        num_experts=EXPERTS,
        top_k=TOP_K,
        ffn_hidden_size=FFN,
        num_heads=HEADS,
        max_seq_len=SEQ,
        aux_loss_type="aux_loss",
        aux_loss_coeff=1e-2,
        z_loss_coeff=1e-3,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    writer = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")])
    vitals = Vitals(
        demo.make_callbacks(),
        writer=writer,
        log_every_n_steps=1,
        run_dir=tmp_path,
        max_steps=STEPS,
        accumulate_grad_batches=MICRO,
    )
    vitals.attach(model, optimizer)
    previous_scale = get_aux_loss_backward_scale()
    set_aux_loss_backward_scale(1 / MICRO)
    gen = torch.Generator().manual_seed(1)
    expected: dict[int, dict[str, float]] = {}
    try:
        with vitals:
            for step in range(STEPS):
                for _ in range(MICRO):
                    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
                    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
                    vitals.batch(batch)
                    (model(batch["input_ids"], labels=batch["labels"]).loss / MICRO).backward()
                # the gradients and weights the callbacks see (before clipping and the update)
                named = dict(model.named_parameters())
                want = {
                    "l2_norm/grad/global": math.sqrt(
                        sum(float(p.grad.double().square().sum()) for p in named.values())
                    ),
                    "l2_norm/param/global": math.sqrt(
                        sum(float(p.detach().double().square().sum()) for p in named.values())
                    ),
                }
                for layer in range(LAYERS):
                    router = named[f"layers.{layer}.mlp.router.weight"]
                    want[f"l2_norm/grad/layers.{layer}.mlp.router.weight"] = float(
                        router.grad.double().norm()
                    )
                    for kind in ("grad", "param"):
                        tensors = [
                            (p.grad if kind == "grad" else p.detach()).flatten()
                            for name, p in named.items()
                            if name.startswith(f"layers.{layer}.")
                        ]
                        rms, kurtosis = _moments(torch.cat(tensors))
                        want[f"tensor_stats/{kind}/layer_{layer}/rms"] = rms
                        want[f"tensor_stats/{kind}/layer_{layer}/kurtosis"] = kurtosis
                expected[step] = want
                vitals.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    finally:
        set_aux_loss_backward_scale(previous_scale)
        writer.close()

    rows: dict[int, dict[str, float]] = {}
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows.setdefault(record["step"], {}).update(record["metrics"])
    tokens_per_step = MICRO * BATCH * SEQ
    for step in range(STEPS):
        got = rows[step]
        for key, value in expected[step].items():
            assert got.get(key) == pytest.approx(value, rel=1e-5), (step, key)
        # the global grad norm is the unclipped one: clipping at 0.5 did not shrink it
        assert got["l2_norm/grad/global"] > 0.5
        # every micro-batch counted
        assert got["time/batches"] == MICRO * (step + 1)
        assert got["time/samples"] == MICRO * BATCH * (step + 1)
        assert got["time/tokens"] == tokens_per_step * (step + 1)
        # loads: each token goes to top_k experts, in every layer
        for layer in range(LAYERS):
            loads = [got[f"moe/layer_{layer}/tokens_per_expert/{e}"] for e in range(EXPERTS)]
            assert sum(loads) == tokens_per_step * TOP_K
            assert got[f"moe/layer_{layer}/max_overload_factor"] == pytest.approx(
                max(loads) / (sum(loads) / EXPERTS)
            )
        if step == 0:  # the warm-up step is left out of the rates
            assert not any(k.startswith("throughput/") for k in got)
            continue
        seconds = got["throughput/seconds_per_step"]
        assert got["throughput/tokens_per_sec"] * seconds == pytest.approx(tokens_per_step)
        # measured flops: the step's matmuls per token, the two micro-batches together
        assert got["throughput/flops_per_sec"] / got["throughput/tokens_per_sec"] == (
            pytest.approx(_analytic_flops_per_token(), rel=1e-9)
        )
        assert "throughput/mfu" not in got  # no peak on a CPU
