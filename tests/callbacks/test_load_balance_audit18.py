"""LoadBalanceMonitor audit 18: experts without compute (ZAYA's skip expert, LongCat-Flash's zero
experts), which the router capture counts as the router's last columns, are left out of the
load statistics and written as ``moe/layer_<l>/tokens_skipped``.

The expected values are computed here in float64 from the routers' own outputs (test hooks),
with padding left out by the attention mask, over the three micro-batches of each step."""

from __future__ import annotations

import math
import os
import re
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers.moe_models import HF_MLA, HF_TINY, HF_VOCAB
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

E = 4  # experts that compute
QUANTILES = {"min": 0.0, "p25": 0.25, "median": 0.5, "p75": 0.75, "max": 1.0}


def _zaya() -> nn.Module:
    """A tiny ZAYA model as transformers initialises it: the skip class's balancing bias -1."""
    torch.manual_seed(0)
    config = transformers.ZayaConfig(
        **HF_TINY | dict(num_hidden_layers=2, num_experts_per_tok=1),
        num_experts=E,
        router_hidden_size=16,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def _longcat() -> nn.Module:
    """A tiny LongCat-Flash model (2 decoder layers of two sub-blocks each): 4 routed experts
    and 2 zero (identity) experts."""
    torch.manual_seed(0)
    mla = HF_MLA | dict(n_routed_experts=E, first_k_dense_replace=0, head_dim=8)
    config = transformers.LongcatFlashConfig(
        **HF_TINY
        | mla
        | dict(num_experts_per_tok=2, num_hidden_layers=4, expert_ffn_hidden_size=16),
        zero_expert_num=2,
        ffn_hidden_size=32,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    for module in model.modules():  # a bias that sends some tokens to a zero expert
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            bias.data.normal_(0, 0.02)[E] = 0.01
    return model


def _choice(router_cls: str, output: Any) -> torch.Tensor:
    """The ``[N, k]`` columns a router chose, from its own output; a no-compute expert is a
    column ``>= E``."""
    if router_cls == "ZayaRouter":
        # ZayaRouter returns the skip class as expert 0 with probability 0 (a real choice has
        # a softmax probability > 0): put it back in its column E
        probs, indices = output[1], output[2]
        return torch.where(probs == 0, E, indices)
    return output[2]  # LongcatFlashTopkRouter: indices over routed + zero experts


def _masks() -> list[torch.Tensor]:
    left = torch.ones(2, 6, dtype=torch.long)
    left[0, :3] = 0
    right = torch.ones(2, 5, dtype=torch.long)
    right[1, 3:] = 0
    return [left, torch.ones(2, 6, dtype=torch.long), right]


def _expected(loads: np.ndarray, labels: list[str], top_k: int) -> dict[str, float]:
    """Every load-statistics key of one step from the ``[L, columns]`` loads, by hand over the
    first ``E`` columns (the experts that compute), and ``tokens_skipped`` of the others."""
    out: dict[str, float] = {}
    per_metric: dict[str, list[float]] = {}
    everything: list[float] = []
    ranked: list[tuple[float, int, int]] = []
    for pos, (label, full_row) in enumerate(zip(labels, loads, strict=True)):
        row = full_row[:E]
        out[f"moe/layer_{label}/tokens_skipped"] = float(full_row[E:].sum())
        if row.sum() == 0:
            continue
        mean = row.sum() / E
        u = row / mean
        p = row[row > 0] / row.sum()
        metrics = {
            "cv": float(np.sqrt(((row - mean) ** 2).mean()) / mean),
            "dead_expert_frac": float((row == 0).sum() / E),
            "expert_diversity": float(math.exp(-(p * np.log(p)).sum()) / E),
            "max_overload_factor": float(row.max() / mean),
        }
        metrics |= {f"utilization_{q}": float(np.quantile(u, v)) for q, v in QUANTILES.items()}
        for name, value in metrics.items():
            out[f"moe/layer_{label}/{name}"] = value
            per_metric.setdefault(name, []).append(value)
        for e in range(E):
            out[f"moe/layer_{label}/tokens_per_expert/{e}"] = float(row[e])
            ranked.append((float(u[e]), pos, e))
        everything += u.tolist()
    for name in ("cv", "dead_expert_frac", "expert_diversity", "max_overload_factor"):
        values = per_metric[name]
        out[f"moe/{name}_mean"] = float(np.mean(values))
        out[f"moe/{name}_median"] = float(np.median(values))
        out[f"moe/{name}_min"] = float(np.min(values))
        out[f"moe/{name}_max"] = float(np.max(values))
    for q, v in QUANTILES.items():
        out[f"moe/expert_utilization_{q}"] = float(np.quantile(everything, v))
    for value, pos, e in (
        sorted(ranked, key=lambda t: (-t[0], t[1], t[2]))[:top_k] + sorted(ranked)[:top_k]
    ):
        out[f"moe_expert_utilization/layer_{labels[pos]}_expert_{e}"] = value
    return out


@pytest.mark.parametrize(
    ("family", "router_cls", "columns"),
    [("zaya", "ZayaRouter", E + 1), ("longcat_flash", "LongcatFlashTopkRouter", E + 2)],
)
def test_experts_without_compute_are_left_out_of_the_statistics(
    family: str, router_cls: str, columns: int
) -> None:
    model = _zaya() if family == "zaya" else _longcat()
    names = [n for n, m in model.named_modules() if type(m).__name__ == router_cls]
    assert len(names) == 2
    loads: dict[int, np.ndarray] = {}
    state = {"step": 0, "mask": None}

    def hook(row: int):
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if state["mask"] is None:
                return
            chosen = _choice(router_cls, output)
            keep = state["mask"].reshape(-1).bool()
            step = loads.setdefault(state["step"], np.zeros((len(names), columns)))
            step[row] += np.bincount(chosen[keep].reshape(-1).numpy(), minlength=columns)

        return record

    modules = dict(model.named_modules())
    for row, name in enumerate(names):
        modules[name].register_forward_hook(hook(row))
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=2, dead_expert_patience=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    vitals = Vitals(
        [monitor], writer=writer, log_every_n_steps=1, accumulate_grad_batches=3
    ).attach(model, opt)
    gen = torch.Generator().manual_seed(1)
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            state["step"] = step
            for mask in _masks():
                x = torch.randint(3, HF_VOCAB, mask.shape, generator=gen)
                vitals.batch({"input_ids": x, "attention_mask": mask})
                state["mask"] = mask
                out = model(input_ids=x, attention_mask=mask)
                state["mask"] = None
                out.logits.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        vitals.close()

    labels = [re.search(r"\.(\d+)\.", n).group(1) for n in names]
    assert sorted(writer.rows) == [0, 1, 2]
    for step, row in sorted(writer.rows.items()):
        expected = _expected(loads[step], labels, top_k=2)
        got = {k: v for k, v in row.items() if k != "moe/dead_experts_persistent"}
        for key, value in expected.items():
            if key in got:
                assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), (step, key)
        assert sorted(got) == sorted(expected), step
    if family == "zaya":
        # transformers starts the skip class's bias at -1: it is (almost) never chosen, and
        # the experts that compute all receive tokens. The skip expert is no dead expert.
        assert all(loads[s][:, E].sum() == 0 for s in loads)
        assert all(row["moe/dead_experts_persistent"] == 0 for row in writer.rows.values())
        assert not [w for w in caught if "LoadBalanceMonitor" in str(w.message)]
    else:  # the zero experts were chosen: their assignments are written, not hidden
        assert sum(loads[s][:, E:].sum() for s in loads) > 0
