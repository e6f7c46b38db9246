"""Shared pieces of the NormMonitor tests: a recording writer, tiny models and float64 references."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn


class RecordingWriter:
    """Stores every value as a float, per step: ``self.steps[step][key]``."""

    def __init__(self, path: str | None = None) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.path = path
        self.calls = 0

    def add_scalars(self, mapping: dict[str, Any], step: int) -> None:
        self.calls += 1
        row = self.steps.setdefault(int(step), {})
        for key, value in mapping.items():
            row[key] = float(value.item() if isinstance(value, torch.Tensor) else value)
        if self.path is not None:
            Path(self.path).write_text(json.dumps(self.steps))

    def add_scalar(self, name: str, value: Any, step: int) -> None:
        self.add_scalars({name: value}, step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TiedLM(nn.Module):
    """Embedding -> MLP block -> norm -> head whose weight IS the embedding's (tied)."""

    def __init__(self, vocab: int = 13, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(self.norm(x))


class MLP(nn.Module):
    """Two linear layers and a LayerNorm; the shape tensor parallel examples use."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


def mlp_batch(dp_rank: int, step: int) -> torch.Tensor:
    """The ``MLP`` input of one data-parallel rank at one step: 4 x 8, seeded by both."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(4, 8, generator=g)


def mlp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient reaches every parameter unevenly (not a plain mean square)."""
    y = model(x)
    return y.pow(2).mean() + y[:, 0].mean()


def float64_reference_norms(
    model_cls: type, batch_fn, loss_fn, dp_size: int, steps: int, lr: float
) -> dict[int, tuple[float, float]]:
    """Float64, one process: ``(param norm, grad norm)`` by step of ``model_cls()`` (built after
    ``torch.manual_seed(0)``) trained with plain SGD at ``lr``, the loss of a step being the
    mean of the ``dp_size`` ranks' losses (what DDP, FSDP1 and FSDP2 average)."""
    torch.manual_seed(0)
    model = model_cls().double()
    out = {}
    for step in range(steps):
        model.zero_grad()
        loss = sum(loss_fn(model, _double(batch_fn(r, step))) for r in range(dp_size)) / dp_size
        loss.backward()
        out[step] = float64_norms(list(model.parameters()))
        with torch.no_grad():
            for p in {id(p): p for p in model.parameters()}.values():
                p -= lr * p.grad
    return out


def _double(x: torch.Tensor) -> torch.Tensor:
    return x.double() if x.is_floating_point() else x


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def float64_norms(params: list[torch.Tensor]) -> tuple[float, float]:
    """(param norm, grad norm) in float64 over distinct tensors, computed elementwise here."""
    unique = list({id(p): p for p in params}.values())
    p2 = sum(float(p.detach().double().pow(2).sum()) for p in unique)
    g2 = sum(float(p.grad.double().pow(2).sum()) for p in unique if p.grad is not None)
    return math.sqrt(p2), math.sqrt(g2)


def check_lightning_norms(results: list[dict], steps: int) -> None:
    """The global param and grad norms each rank's ``RecordingWriter`` got at every step of a
    Lightning run equal the float64 references the module kept (``refs[step]``), the same on
    every rank."""
    for res in results:
        assert sorted(res["steps"]) == list(range(steps))
        for step in range(steps):
            row = res["steps"][step]
            p_ref, g_ref = res["refs"][step]
            assert row["l2_norm/param/global"] == pytest.approx(p_ref, rel=1e-6)
            assert row["l2_norm/grad/global"] == pytest.approx(g_ref, rel=1e-6)
    assert results[0]["steps"] == results[1]["steps"]
