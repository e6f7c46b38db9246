"""The key tables of `MoEMetricsMonitor` (its docstring and docs/moe.md) against what it writes.

Every key the monitor writes must match a row of both tables, every row must be written by some
router configuration, and the logged values must be what the rows say: the router's losses
before their coefficients, means over the MoE layers only, and any metric a model records into
the tracker itself (`get_moe_metrics_tracker().record(name, ...)`, as docs/moe.md invites)
written as `moe/{name}`.
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import pytest
import torch

from tests.test_all_callbacks import documented_key_pattern
from trainvitals.adapters import FanoutWriter, JsonlSink
from trainvitals.adapters.jsonl import read_jsonl
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import MoEMetricsMonitor
from trainvitals.moe import (
    TinyMoELM,
    TopKRouter,
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
)

ROOT = Path(__file__).resolve().parents[1]
CUSTOM = "router_input_rms"  # a name with no "_p" / "_layer_" in it
E, K, LAYERS, MOE_LAYERS = 4, 2, 3, (0, 2)


def _docstring_rows() -> list[str]:
    """The first cells of the rows of the docstring's key table (continuation lines skipped)."""
    doc = inspect.getdoc(MoEMetricsMonitor) or ""
    return re.findall(r"^``(moe/[^`]+)``\s{2,}\S", doc, flags=re.M)


def _page_rows() -> list[str]:
    page = (ROOT / "docs" / "moe.md").read_text()
    return re.findall(r"^\| `(moe/[^`]+)` \|", page, flags=re.M)


def _run(tmp_path: Path, aux_loss_type: str) -> tuple[dict[str, float], dict[str, list]]:
    """One logged optimizer step of one micro-batch; returns the written metrics and, per MoE
    layer, what its router saw: (router input [T, H], router weight, routing_map)."""
    destroy_moe_metrics_tracker()
    torch.manual_seed(0)
    model = TinyMoELM(
        vocab_size=32,
        hidden_size=16,
        num_layers=LAYERS,
        num_experts=E,
        top_k=K,
        ffn_hidden_size=16,
        num_heads=2,
        max_seq_len=16,
        moe_layer_freq=[1, 0, 1],
        aux_loss_type=aux_loss_type,
        aux_loss_coeff=1e-2,
        z_loss_coeff=1e-3,
        capacity_factor=0.5,  # drops tokens: dropped_token_fraction is recorded
    )
    seen: dict[str, list] = {}

    def hook(router: TopKRouter, args: tuple, output: tuple) -> None:
        x = args[0].detach().reshape(-1, router.hidden_size)
        seen.setdefault(f"layer_{router.layer_number - 1}", []).append(
            (x, router.weight.detach().clone(), output[1].detach())
        )
        # a metric of the model's own, recorded into the tracker as docs/moe.md shows
        rms = x.double().square().mean().sqrt()
        get_moe_metrics_tracker().record(CUSTOM, rms, router.layer_number, router.num_layers)

    for _, router in model.routers():
        router.register_forward_hook(hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = MoEMetricsMonitor(
        per_layer_logging=True, percentiles={"load_balancing_loss": [0.5, 0.95]}
    )
    writer = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")], background=False)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with Vitals([monitor], writer=writer, log_every_n_steps=1, run_dir=tmp_path) as vitals:
        vitals.attach(model, optimizer)
        vitals.batch({"input_ids": tokens[:, :-1]})
        model(tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    writer.close()
    destroy_moe_metrics_tracker()
    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    return record["metrics"], seen


@pytest.mark.parametrize("source", ["docstring", "docs/moe.md"])
def test_every_written_key_is_a_row_and_every_row_is_written(tmp_path, source):
    rows = _docstring_rows() if source == "docstring" else _page_rows()
    assert len(rows) >= 7, rows
    patterns = [documented_key_pattern(row) for row in rows]
    written: set[str] = set()
    for aux in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
        metrics, _ = _run(tmp_path / aux, aux)
        written |= set(metrics)
    undocumented = sorted(k for k in written if not any(p.match(k) for p in patterns))
    assert not undocumented, f"written but not in the {source} key table: {undocumented}"
    unwritten = [
        row for row, p in zip(rows, patterns, strict=True) if not any(map(p.match, written))
    ]
    assert not unwritten, f"{source} rows no configuration wrote: {unwritten}"
    assert f"moe/{CUSTOM}" in written


def test_logged_values_are_what_the_rows_say(tmp_path):
    metrics, seen = _run(tmp_path, "aux_loss")
    assert sorted(seen) == [f"layer_{i}" for i in MOE_LAYERS]
    expected: dict[str, dict[int, float]] = {}
    for label, ((x, weight, routing_map),) in seen.items():
        layer = int(label.split("_")[1])
        logits = x.double() @ weight.double().T  # [T, E]
        t = logits.shape[0]
        probs = logits.softmax(-1)
        # tokens_i: tokens whose top-k of the scores holds i (not the capacity-limited choice)
        chosen = torch.zeros(t, E, dtype=torch.float64).scatter_(1, probs.topk(K).indices, 1.0)
        switch = E / (K * t * t) * float((probs.sum(0) * chosen.sum(0)).sum())
        values = {
            "load_balancing_loss": switch,
            "z_loss": float(logits.logsumexp(-1).square().mean()),  # before its coefficient
            "dropped_token_fraction": 1.0 - float(routing_map.sum()) / (t * K),
            CUSTOM: float(x.double().square().mean().sqrt()),
        }
        for name, value in values.items():
            expected.setdefault(name, {})[layer] = value
    assert expected["dropped_token_fraction"][0] > 0  # the capacity limit did drop tokens
    for name, per_layer in expected.items():
        for layer, value in per_layer.items():
            assert metrics[f"moe/{name}_layer_{layer}"] == pytest.approx(value, rel=1e-5)
        # the mean over the MoE layers (2), not over every layer slot (3)
        mean = math.fsum(per_layer.values()) / len(MOE_LAYERS)
        assert metrics[f"moe/{name}"] == pytest.approx(mean, rel=1e-5), name
    assert not any("_layer_1" in k for k in metrics)  # a dense layer has no per-layer key
    lbl = sorted(expected["load_balancing_loss"].values())
    assert metrics["moe/load_balancing_loss_p50"] == pytest.approx(sum(lbl) / 2, rel=1e-5)
    assert metrics["moe/load_balancing_loss_p95"] == pytest.approx(
        lbl[0] + 0.95 * (lbl[1] - lbl[0]), rel=1e-5
    )
