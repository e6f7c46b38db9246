"""TensorStatsMonitor overhead and the moments kernel, in one run.

Run (from the repository root)::

    .venv/bin/python benchmarks/bench_tensor_stats.py            # full: ~110M values, 25M LM
    .venv/bin/python benchmarks/bench_tensor_stats.py --quick    # smaller, for a smoke test

Two parts, each interleaved against a baseline measured in the same run (ratios, medians):

1. Kernel: the moments of ~110M float32 values in 121 tensors (the issue's setting) with the
   fused eager kernel and the ``torch.compile``d kernel, against one ``torch.sum`` pass per
   tensor and against four separate power sums per tensor (the eager fallback of Megatron-LM
   PR #5492).
2. Training step of the ~25M-parameter transformer of ``benchmarks/common.py`` on 2 threads:
   baseline; params+grads every step; all four kinds every step; the same two with the
   four-power-sums method swapped in; ``wandb.watch(model, log="all", log_freq=1)`` offline.

Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    DiscardWriter,
    HookTimer,
    LMConfig,
    build_lm,
    count_parameters,
    interleaved_ratios,
    lm_batch,
    sync,
)
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor
from trainvitals.stats.moments import _EAGER_BLOCK, NUM_FIELDS, fused_moments

# ------------------------------------------------------------------------------ the comparison


def power_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Four separate float32 power sums per tensor (the reference's eager fallback)."""
    out = []
    for t in tensors:
        x = t.detach().float()
        out.append(torch.stack([x.sum(), (x * x).sum(), (x**3).sum(), (x**4).sum()]))
    return torch.stack(out)


def power_sum_partial(tensors, *, kernel="auto"):
    """Drop-in for ``partial_moments`` inside the monitor, costing what the reference costs (its
    numbers are the naive raw-sum conversion; only the time matters here)."""
    tensors = list(tensors)
    sums = power_sums(tensors).double()
    device = sums.device
    n = torch.tensor([float(t.numel()) for t in tensors], dtype=torch.float64, device=device)
    mean = sums[:, 0] / n
    parts = torch.zeros(len(tensors), NUM_FIELDS, dtype=torch.float64, device=device)
    parts[:, 0] = n
    parts[:, 1] = mean
    parts[:, 2] = sums[:, 1] - n * mean * mean
    return parts, torch.arange(len(tensors), device=device)


class PowerSumAccumulator:
    """Drop-in for ``MomentAccumulator`` in the monitor's hooks: four power sums per tensor."""

    def __init__(self, num_slots, *, kernel="auto"):
        self.num_slots = num_slots
        self.sums = torch.zeros(num_slots, 5, dtype=torch.float64)

    def add(self, slot, tensor, **kwargs):
        s = power_sums([tensor])[0]
        self.sums = self.sums.to(s.device)  # (the device of the first tensor added)
        self.sums[slot, 0] += tensor.numel()
        self.sums[slot, 1:] += s.double()

    def add_many(self, items):
        # (the monitor hands its hooks' batches over at once since session 20; one add each)
        for slot, tensor, key in items:
            self.add(slot, tensor, key=key)

    def result(self):
        parts = torch.zeros(
            self.num_slots, NUM_FIELDS, dtype=torch.float64, device=self.sums.device
        )
        n = self.sums[:, 0].clamp_min(1)
        parts[:, 0] = self.sums[:, 0]
        parts[:, 1] = self.sums[:, 1] / n
        parts[:, 2] = self.sums[:, 2] - n * parts[:, 1] ** 2
        return parts


@contextlib.contextmanager
def patched_kernel(method: str) -> Iterator[None]:
    import trainvitals.callbacks.tensor_stats_monitor as mod

    originals = mod.partial_moments, mod.MomentAccumulator
    if method == "powersums":
        mod.partial_moments = power_sum_partial
        mod.MomentAccumulator = PowerSumAccumulator
    try:
        yield
    finally:
        mod.partial_moments, mod.MomentAccumulator = originals


# ------------------------------------------------------------------------------ kernel part


def kernel_tensors(scale: float) -> list[torch.Tensor]:
    """121 tensors, ~112M values at scale 1: 12 layers of (qkv, o, up, down weights, 4 norm
    vectors, 2 biases) and an embedding, the mix of a ~110M-parameter model."""
    g = torch.Generator().manual_seed(0)
    d, f = int(1024 * scale**0.5), int(2048 * scale**0.5)
    shapes: list[tuple[int, ...]] = []
    for _ in range(12):
        shapes += [(3 * d, d), (d, d), (f, d), (d, f), (d,), (d,), (d,), (d,), (3 * d,), (f,)]
    shapes.append((int(16000 * scale**0.5), d))
    return [torch.randn(*s, generator=g) for s in shapes]


def aten_floor(tensors: list[torch.Tensor]) -> None:
    """A lower bound for any eager kernel made of ATen passes over cached blocks: per 2 MiB
    block one min/max (``aminmax``) and four sums of the block: the reductions the four power
    sums need, with the powers themselves (and the float64 work) left out. BLAS dot products
    would fuse a product into its sum, but in float32 over a block they are off by ~1e-5
    relative (measured), a tenth of the accuracy budget before any cancellation."""
    for t in tensors:
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), _EAGER_BLOCK):
            block = flat[start : start + _EAGER_BLOCK]
            torch.aminmax(block)
            for _ in range(4):
                block.sum()


def bench_kernel(
    tensors: list[torch.Tensor],
    reps: int,
    compile_ok: bool,
    clock: Callable[[], float],
    sync: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    variants: dict[str, Callable[[], object]] = {
        "one torch.sum pass": lambda: [t.sum() for t in tensors],
        "four power sums (reference fallback)": lambda: power_sums(tensors),
        "fused moments, eager": lambda: fused_moments(tensors, kernel="eager"),
        "floor of an ATen kernel: min/max + 4 sums per block, no powers": lambda: aten_floor(
            tensors
        ),
    }
    if compile_ok:
        variants["fused moments, torch.compile"] = lambda: fused_moments(tensors, kernel="compile")
    for fn in variants.values():  # warm-up (and compile)
        fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            sync()  # (a device: nothing queued before the start, all of it done at the end)
            start = clock()
            variants[name]()
            sync()
            times[name].append(clock() - start)
    return times


# ------------------------------------------------------------------------------ training part


def instrument(timer: HookTimer, monitor: TensorStatsMonitor) -> None:
    """Time the monitor's callback hooks and the forward/gradient hooks it installs."""
    for name in ("micro_batch_start", "before_optimizer_step", "step_end"):
        setattr(monitor, name, timer.wrap(getattr(monitor, name)))
    for name in ("_make_forward_hook", "_make_grad_hook"):
        factory = getattr(monitor, name)
        setattr(monitor, name, lambda *a, _f=factory, **k: timer.wrap(_f(*a, **k)))


def make_variant(
    kind: str, tmp: Path, batch: torch.Tensor, clock: Callable[[], float], cfg: LMConfig
) -> Callable[[int], float]:
    device = batch.device
    model = build_lm(cfg, device=str(device))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    vitals = None
    method = "fused"
    run = None
    timer = HookTimer(clock)
    if kind.startswith("params+grads") or kind.startswith("all four"):
        kinds = ["param", "grad"] if kind.startswith("params+grads") else None
        kernel = "compile" if "compiled" in kind else "eager"
        monitor = TensorStatsMonitor(
            kinds=kinds or ["param", "grad", "activation", "dgrad"], kernel=kernel
        )
        instrument(timer, monitor)
        vitals = Vitals(
            [monitor],
            writer=DiscardWriter(),
            run_dir=tmp / kind.replace(" ", "_"),
            log_every_n_steps=1,
        )
        vitals.attach(model, opt)
        method = "powersums" if "power" in kind else "fused"
    elif kind.startswith("wandb"):
        import wandb

        run = wandb.init(mode="offline", dir=str(tmp), project="bench")
        wandb.watch(model, log="all", log_freq=1)  # hooks on the global run

    def step() -> None:
        if vitals is not None:
            vitals.batch(batch)
        loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if run is not None:
            run.log({"loss": float(loss.detach())})

    def timed_steps(n: int) -> float:
        with patched_kernel(method):
            step()  # warm-up: one untimed step per call
            timer.reset()
            sync(device)
            start = clock()
            for _ in range(n):
                step()
            sync(device)  # (a device: the steps' queued work is in the time)
            elapsed = clock() - start
            hook_seconds.append(timer.wall / n)
            return elapsed

    hook_seconds: list[float] = []
    timed_steps.hook_seconds = hook_seconds  # type: ignore[attr-defined]

    timed_steps.close = lambda: (vitals.close() if vitals else None, run.finish() if run else None)  # type: ignore[attr-defined]
    return timed_steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--kernel-scale", type=float, default=None)
    parser.add_argument("--skip-training", action="store_true")
    # 8 x 128 tokens: with it the reference methods cost what the issue measured on its 25M
    # model (four power sums, params+grads: +9 to +11%; wandb.watch: +39 to +40%); at 4 x 128
    # they cost about twice that, i.e. the step was about twice as long.
    parser.add_argument(
        "--batch", type=int, default=None, help="sequences per step (8; --quick: 2)"
    )
    parser.add_argument(
        "--seq", type=int, default=None, help="tokens per sequence (128; --quick: 32)"
    )
    parser.add_argument("--skip-kernel", action="store_true")
    parser.add_argument(
        "--device",
        default="cpu",
        help="device of the kernel's tensors and of the training part's model (e.g. cuda)",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="1 thread, timed by this process's CPU time (robust on a shared machine; W&B's "
        "separate service process is then not counted)",
    )
    args = parser.parse_args()
    torch.set_num_threads(2)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.process_time
    reps = args.reps or (3 if args.quick else 7)
    steps = args.steps or (2 if args.quick else 4)
    scale = args.kernel_scale or (0.1 if args.quick else 1.0)
    how = "1 thread, CPU time" if args.cpu_time else f"{torch.get_num_threads()} threads, wall time"
    print(f"torch {torch.__version__}, {how}, {os.cpu_count()} CPUs")

    if not args.skip_kernel:
        device = torch.device(args.device)
        tensors = [t.to(device) for t in kernel_tensors(scale)]
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        numel = sum(t.numel() for t in tensors)
        compile_ok = True
        try:
            fused_moments(tensors[:2], kernel="compile")
            from trainvitals.stats.moments import _compiled

            compile_ok = _compiled.failed is None
        except Exception:
            compile_ok = False
        times = bench_kernel(tensors, reps, compile_ok, clock, sync)
        base = times["one torch.sum pass"]
        print(
            f"\n### Kernel: {numel / 1e6:.1f}M float32 values in {len(tensors)} tensors on "
            f"{device}, {reps} reps\n"
        )
        print("| method | median ms | median ratio to one torch.sum pass (min-max) |")
        print("|---|---|---|")
        for name, ts in times.items():
            ratios = [t / b for t, b in zip(ts, base, strict=True)]
            print(
                f"| {name} | {statistics.median(ts) * 1e3:.1f} | {statistics.median(ratios):.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f}) |"
            )

    if not args.skip_training:
        cfg = (
            LMConfig(vocab_size=512, d_model=64, n_layers=2, d_ff=256) if args.quick else LMConfig()
        )
        batch = lm_batch(
            batch_size=args.batch or (2 if args.quick else 8),
            seq_len=args.seq or (32 if args.quick else 128),
            vocab_size=cfg.vocab_size,
            device=args.device,
        )
        names = [
            "baseline",
            "params+grads every step",
            "all four every step",
            "params+grads every step, compiled kernel",
            "all four every step, compiled kernel",
            "params+grads every step, four power sums",
            "all four every step, four power sums",
            "wandb.watch(log='all', log_freq=1)",
        ]
        if importlib.util.find_spec("wandb") is None:
            print("(wandb is not installed: its row is left out)")
            names.remove("wandb.watch(log='all', log_freq=1)")
        with tempfile.TemporaryDirectory() as tmp:
            variants = {n: make_variant(n, Path(tmp), batch, clock, cfg) for n in names}
            n_params = count_parameters(build_lm(cfg))
            res = interleaved_ratios(variants, baseline="baseline", reps=reps, steps=steps)
            hook_times = {
                n: v.hook_seconds  # type: ignore[attr-defined]
                for n, v in variants.items()
                if any(v.hook_seconds)  # type: ignore[attr-defined]
            }
            for v in variants.values():
                v.close()  # type: ignore[attr-defined]
        print(
            f"\n### Training step: {n_params / 1e6:.1f}M-parameter transformer, batch "
            f"{tuple(batch.shape)} on {args.device}, {reps} reps x {steps} steps, {how}\n"
        )
        base_step = res["baseline"]["median_step_s"]
        print(
            "| variant | median s/step | end-to-end overhead, median (min-max) "
            "| monitor's own time per step (median) | monitor time / baseline step |"
        )
        print("|---|---|---|---|---|")
        for name, r in res.items():
            hooks = hook_times.get(name)
            own = "-" if not hooks else f"{1e3 * statistics.median(hooks):.1f} ms"
            share = "-" if not hooks else f"{100 * statistics.median(hooks) / base_step:.2f}%"
            print(
                f"| {name} | {r['median_step_s']:.3f} | {100 * (r['median_ratio'] - 1):+.1f}% "
                f"({100 * (r['min_ratio'] - 1):+.1f}% to {100 * (r['max_ratio'] - 1):+.1f}%) "
                f"| {own} | {share} |"
            )


if __name__ == "__main__":
    main()
