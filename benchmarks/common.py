"""Shared benchmark pieces: a small dense transformer LM (~25M parameters by default) and a
timing helper that interleaves variants and reports median ratios against a baseline measured
in the same run.

Usage from another benchmark::

    from benchmarks.common import build_lm, lm_batch, interleaved_ratios

    model = build_lm()                      # ~25.2M parameters
    ids = lm_batch(batch_size=2, seq_len=64)

Timing figures are only meaningful as ratios against a baseline measured in the same process,
interleaved with it (machine load changes over seconds); that is what
:func:`interleaved_ratios` returns.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "DiscardWriter",
    "HookTimer",
    "LMConfig",
    "TinyTransformerLM",
    "build_lm",
    "count_parameters",
    "format_params",
    "interleaved_ratios",
    "lm_batch",
    "sync",
    "timed",
]


@dataclass
class LMConfig:
    """Defaults give 25.2M parameters: 2 x 6144 x 512 (embedding, untied head) + 6 layers x
    (4 x 512^2 attention + 2 x 512 x 2048 MLP) + norms."""

    vocab_size: int = 6144
    d_model: int = 512
    n_layers: int = 6
    n_heads: int = 8
    d_ff: int = 2048
    max_seq_len: int = 512


class _Block(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for y in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class TinyTransformerLM(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm blocks, untied LM head.
    ``forward(ids)`` returns the mean next-token cross-entropy."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="mean"
        )


def build_lm(
    cfg: LMConfig | None = None, *, seed: int = 0, device: str = "cpu"
) -> TinyTransformerLM:
    torch.manual_seed(seed)
    return TinyTransformerLM(cfg or LMConfig()).to(device)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def lm_batch(
    batch_size: int = 2, seq_len: int = 64, vocab_size: int = 6144, *, seed: int = 0,
    device: str = "cpu",
) -> torch.Tensor:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=g).to(device)


def sync(device: str | torch.device = "cpu") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved_ratios(
    variants: dict[str, Callable[[int], float]],
    *,
    baseline: str,
    reps: int = 5,
    steps: int = 8,
) -> dict[str, dict[str, float]]:
    """Time each variant ``reps`` times, interleaved (the order rotates every repetition), and
    compare it with the baseline of the same repetition.

    ``variants[name](steps)`` runs ``steps`` timed training steps and returns their wall time in
    seconds (it does its own warm-up and synchronisation). Returns, per variant, the median
    seconds per step, the median of the per-repetition ratios to the baseline, and their min
    and max.
    """
    if baseline not in variants:
        raise ValueError(f"baseline {baseline!r} is not one of {list(variants)}")
    names = list(variants)
    per_step: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            per_step[name].append(variants[name](steps) / steps)
    out: dict[str, dict[str, float]] = {}
    for name in names:
        ratios = [v / b for v, b in zip(per_step[name], per_step[baseline], strict=True)]
        out[name] = {
            "median_step_s": statistics.median(per_step[name]),
            "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios),
            "max_ratio": max(ratios),
        }
    return out


def timed(fn: Callable[[], None], device: str | torch.device = "cpu") -> float:
    """Wall seconds of ``fn()``, synchronising the device before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


class HookTimer:
    """Time spent inside wrapped functions (a callback's hooks, the forward/gradient hooks it
    installs), outermost calls only: a wrapped function called from another one is not
    counted twice. ``wall`` accumulates ``clock`` seconds, ``cpu`` this process's CPU seconds
    (``time.process_time``, which the machine's load does not inflate; it counts every
    intra-op thread). Timing a monitor's own work inside the same runs as the step times
    resolves effects far below the run-to-run noise of whole steps on a shared machine."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.wall = 0.0
        self.cpu = 0.0
        self._depth = 0

    def reset(self) -> None:
        self.wall = self.cpu = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start, cpu = self.clock(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += self.clock() - start
                self.cpu += time.process_time() - cpu
                self._depth -= 1

        return timed_call


def format_params(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else str(n)


class DiscardWriter:
    """A writer that drops every value unread (no device-to-host transfer): what a benchmark
    passes when the writer's own cost is not what it measures."""

    def add_scalars(self, mapping: dict[str, Any], step: int) -> None:
        pass

    def add_scalar(self, name: str, value: Any, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
