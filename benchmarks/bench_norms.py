"""NormMonitor cost against a baseline step and against the per-parameter ``.item()`` styles.

Model: a ~25M-parameter decoder-only transformer (defined below), AdamW, CPU, 2 threads.

Two measurements, all in the same process and interleaved round by round so that the load of a
shared machine hits every variant alike; medians over rounds:

1. Whole training step (forward, backward, gradient hook, optimizer step), baseline vs
   ``NormMonitor`` at every step (``log_every_n_steps=1``), default and ``per_param="*"``;
   the variants alternate step by step, and each round's ratio is taken against the same
   round's baseline steps (median of the per-round ratios reported, with their range).
2. The gradient-norm work alone, called where it would run (grads complete, before the
   optimizer step): ``NormMonitor`` (global param + grad norms, plus the writer's single
   device-to-host transfer), ``NormMonitor(per_param="*")``, ``NormMonitor(group_by=...)`` (one
   norm per block), Composer ``OptimizerMonitor`` /
   Megatron-Bridge ``report_l2_norm_grad`` style (one ``p.grad.norm().item()`` per parameter,
   global from the per-parameter values), Lightning ``grad_norm(model, 2)``.

Every figure is reported as a ratio to the baseline step measured in the same run.

    python benchmarks/bench_norms.py            # a few minutes on 2 CPU cores
    python benchmarks/bench_norms.py --rounds 3 --steps 1   # quicker, noisier
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch
from torch import nn

from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.norm_monitor import NormMonitor


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class SmallTransformer(nn.Module):
    """vocab 8192, dim 512, 7 blocks, 8 heads, ffn 2048, tied head: ~26M parameters."""

    def __init__(self, vocab=8192, dim=512, layers=7, heads=8, ffn=2048, seq=128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.embed(ids) + self.pos[:t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


class OneTransferWriter:
    """Does what the fan-out writer does with a step's tensors: one stack, one host transfer."""

    def add_scalars(self, mapping: dict[str, Any], step: int) -> None:
        tensors = [v for v in mapping.values() if isinstance(v, torch.Tensor)]
        if tensors:
            torch.stack([t.reshape(()).to(torch.float64) for t in tensors]).tolist()

    def add_scalar(self, name: str, value: Any, step: int) -> None:
        self.add_scalars({name: value}, step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------- the compared styles


def composer_style(model: nn.Module) -> dict[str, float]:
    """Composer OptimizerMonitor / Megatron-Bridge report_l2_norm_grad: one .item() per param."""
    out = {}
    total = 0.0
    for name, p in model.named_parameters():
        if p.grad is not None:
            value = p.grad.detach().norm(2).item()
            out[f"l2_norm/grad/{name}"] = value
            total += value**2
    out["l2_norm/grad/global"] = math.sqrt(total)
    return out


def item_style_params_and_grads(model: nn.Module) -> dict[str, float]:
    """The same outputs as NormMonitor (param and grad norms), one .item() per tensor."""
    out = composer_style(model)
    total = 0.0
    for name, p in model.named_parameters():
        value = p.detach().norm(2).item()
        out[f"l2_norm/param/{name}"] = value
        total += value**2
    out["l2_norm/param/global"] = math.sqrt(total)
    return out


def lightning_style(model: nn.Module) -> dict[str, float]:
    from lightning.pytorch.utilities import grad_norm

    return {k: float(v) for k, v in grad_norm(model, 2).items()}


def make_monitor_call(model: nn.Module, **kwargs: Any):
    """NormMonitor's gradient hook alone, as the driver calls it on a logging step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    vitals = Vitals([NormMonitor(**kwargs)], writer=OneTransferWriter(), log_every_n_steps=1)
    vitals.attach(model, opt)
    vitals._start()
    monitor = vitals.callbacks[0]
    return lambda: monitor.before_optimizer_step(vitals.ctx)


# ----------------------------------------------------------------------------- measurement


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    # 8 x 128 tokens, as bench_tensor_stats.py and bench_callbacks.py (see docs/benchmarks.md)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = SmallTransformer(seq=args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (args.batch, args.seq))

    def loss_fn() -> torch.Tensor:
        logits = model(ids[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, 8192), ids[:, 1:].reshape(-1))

    # --- 1. whole steps
    variants: dict[str, Vitals | None] = {
        "baseline": None,
        "NormMonitor": Vitals([NormMonitor()], writer=OneTransferWriter(), log_every_n_steps=1),
        "NormMonitor(per_param='*')": Vitals(
            [NormMonitor(per_param="*")], writer=OneTransferWriter(), log_every_n_steps=1
        ),
    }
    step_times: dict[str, list[float]] = {k: [] for k in variants}

    def run_steps(vitals: Vitals | None, n: int, record: list[float] | None) -> None:
        handles = vitals.attach(model, opt)._handles if vitals is not None else []
        for _ in range(n):
            t0 = time.perf_counter()
            if vitals is not None:
                vitals.batch(ids)
            loss_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if record is not None:
                record.append(time.perf_counter() - t0)
        for h in handles:
            h.remove()
        if vitals is not None:
            vitals._handles.clear()

    run_steps(None, 2, None)  # warm-up
    # one step of each variant in turn, so that neighbouring steps of different variants see
    # the same machine load; ratios are taken per round (against that round's baseline steps)
    round_ratios: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        start = {k: len(v) for k, v in step_times.items()}
        for _ in range(args.steps):
            for name, vitals in variants.items():
                run_steps(vitals, 1, step_times[name])
        this_round = {k: statistics.median(v[start[k] :]) for k, v in step_times.items()}
        for name in variants:
            round_ratios[name].append(this_round[name] / this_round["baseline"])

    # --- 2. the norm work alone, on complete gradients
    loss_fn().backward()
    calls = {
        "NormMonitor (params + grads)": make_monitor_call(model),
        "NormMonitor(per_param='*')": make_monitor_call(model, per_param="*"),
        # one norm per block (7), params and grads: the per-layer view without per-param keys
        "NormMonitor(group_by: 7 blocks, param+grad)": make_monitor_call(
            model, group_by=r"blocks\.(\d+)\.", per_param_kinds=("grad", "param")
        ),
        "Composer/Megatron-Bridge per-param .item() (grads only)": lambda: composer_style(model),
        "per-param .item(), params + grads (NormMonitor's outputs)": lambda: (
            item_style_params_and_grads(model)
        ),
        "Lightning grad_norm (grads only)": lambda: lightning_style(model),
    }
    call_times: dict[str, list[float]] = {k: [] for k in calls}
    for fn in calls.values():
        fn()  # warm-up
    for _ in range(args.rounds * 3):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            call_times[name].append(time.perf_counter() - t0)

    base = statistics.median(step_times["baseline"])
    n_tensors = len(list(model.parameters()))
    print(
        f"model: {n_params / 1e6:.1f}M parameters in {n_tensors} tensors; batch {args.batch}x{args.seq}"
    )
    print(f"threads {args.threads}, rounds {args.rounds}, {args.steps} steps per variant per round")
    print()
    print("| whole step | median ms | median of per-round ratios | range of per-round ratios |")
    print("|---|---:|---:|---:|")
    for name, times in step_times.items():
        m = statistics.median(times)
        r = round_ratios[name]
        med = statistics.median(r)
        print(
            f"| {name} at every step | {m * 1e3:.1f} | {med:.3f}x ({(med - 1) * 100:+.1f}%) "
            f"| {min(r):.3f}x - {max(r):.3f}x |"
        )
    print()
    print("| norm work alone (median) | ms | % of baseline step | vs NormMonitor |")
    print("|---|---:|---:|---:|")
    ours = statistics.median(call_times["NormMonitor (params + grads)"])
    for name, times in call_times.items():
        m = statistics.median(times)
        print(f"| {name} | {m * 1e3:.2f} | {m / base * 100:.2f}% | {m / ours:.2f}x |")


if __name__ == "__main__":
    main()
