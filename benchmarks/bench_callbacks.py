"""Overhead of the run-health callbacks at every step on a ~25M-parameter transformer LM.

Each variant trains the same model (shared, so memory stays small) for ``--steps`` timed
optimizer steps per repetition, after one untimed warm-up step; variants are interleaved and
their order rotates every repetition; the figure reported is the median over repetitions of
(variant seconds per step) / (baseline seconds per step of the same repetition).

Variants: ``baseline`` (plain loop, no trainvitals), then each callback alone (under the
Vitals driver) with ``log_every_n_steps=1`` (it logs at every step, the worst case;
``--log-every 50``, the default interval, gives the usual cost), ``NormMonitor`` when it
exists, and ``all`` of them together.

Run::

    .venv/bin/python -m benchmarks.bench_callbacks --reps 5 --steps 4

Because end-to-end ratios on a loaded machine are noisy, the table also gives the time spent
inside the callbacks' hooks during the timed steps (each hook timed with ``perf_counter``, and
its process CPU time with ``process_time``, which the machine's load does not inflate), per
step, and the wall time as a fraction of the baseline's median step time of the same run. On CPU the
hooks' work is synchronous, so this is their whole cost; on CUDA a callback's kernels run
asynchronously and the end-to-end ratio is the figure to read.

``--fixed-costs`` measures instead each callback's CPU time per step (driver included) on a
tiny model, logging at every step and never logging: the callbacks' cost is a fixed amount per
step, independent of the model (NormMonitor excepted: its cost grows with the parameters).

Values go to a writer that turns every value into a Python float (the device-to-host transfer
the real writer does once per step); ``--writer jsonl`` uses the real ``FanoutWriter`` with a
``JsonlSink`` in a temporary folder instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import (
    HookTimer,
    LMConfig,
    build_lm,
    count_parameters,
    format_params,
    interleaved_ratios,
    lm_batch,
    timed,
)
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.memory_monitor import MemoryMonitor
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor


class FloatWriter:
    """Takes every value to the host as a float, then drops it."""

    def add_scalars(self, mapping: dict[str, Any], step: int) -> None:
        for v in mapping.values():
            float(v)

    def add_scalar(self, name: str, value: Any, step: int) -> None:
        float(value)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def fixed_costs(factories: dict[str, Callable[[], list] | None], steps: int = 300) -> None:
    """CPU time per step (a Linear(8, 8) forward, backward and SGD step, the driver and the
    callback) on a tiny model, logging at every step and never logging; best of 5 runs. The
    callback's own cost is its row minus the ``driver (no callback)`` row."""
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    x = torch.randn(2, 8)
    print("| callback | CPU ms per logging step | CPU ms per non-logging step |")
    print("|---|---|---|")
    for name, factory in factories.items():
        if factory is None:
            continue
        costs = []
        for every in (1, 10**9):
            vitals = Vitals(factory(), writer=FloatWriter(), log_every_n_steps=every)
            vitals.attach(model, optimizer)
            best = float("inf")
            for _ in range(5):
                start = time.process_time()
                for _ in range(steps):
                    vitals.batch(batch)
                    model(x).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                best = min(best, (time.process_time() - start) / steps)
            vitals.close()
            costs.append(best)
        print(f"| {name} | {1e3 * costs[0]:.3f} | {1e3 * costs[1]:.4f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    # 8 x 128 tokens, as bench_tensor_stats.py and bench_norms.py (see docs/benchmarks.md)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--writer", choices=("float", "jsonl"), default="float")
    parser.add_argument(
        "--log-every",
        type=int,
        default=1,
        help="log_every_n_steps of every variant (1: the worst case, every step logs)",
    )
    parser.add_argument(
        "--fixed-costs",
        action="store_true",
        help="only measure each callback's CPU cost per step on a tiny model",
    )
    args = parser.parse_args(argv)

    cfg = LMConfig()
    model = build_lm(cfg, device=args.device)
    n_params = count_parameters(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = lm_batch(args.batch_size, args.seq_len, cfg.vocab_size, device=args.device)
    tmp = tempfile.TemporaryDirectory()

    def writer() -> Any:
        if args.writer == "float":
            return FloatWriter()
        from trainvitals.adapters import FanoutWriter, JsonlSink

        return FanoutWriter([JsonlSink(f"{tmp.name}/metrics.jsonl")])

    def one_step(vitals: Vitals | None) -> None:
        if vitals is not None:
            vitals.batch(ids)
        model(ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # Seconds spent inside the callbacks' hooks during timed steps, per variant.
    hook_seconds: dict[str, list[float]] = {}
    hook_cpu: dict[str, list[float]] = {}

    def runner(name: str, factory: Callable[[], list] | None) -> Callable[[int], float]:
        def run(steps: int) -> float:
            vitals = None
            timer = HookTimer()
            if factory is not None:
                callbacks = factory()
                for cb in callbacks:  # every hook a callback runs goes through its _dispatch
                    cb._dispatch = timer.wrap(cb._dispatch)
                vitals = Vitals(callbacks, writer=writer(), log_every_n_steps=args.log_every)
                vitals.attach(model, optimizer)
            one_step(vitals)  # warm-up: first step of each callback instance
            timer.reset()
            seconds = timed(lambda: [one_step(vitals) for _ in range(steps)], args.device)
            hook_seconds.setdefault(name, []).append(timer.wall / steps)
            hook_cpu.setdefault(name, []).append(timer.cpu / steps)
            if vitals is not None:
                vitals.close()
            return seconds

        return run

    flops_per_token = 6.0 * n_params
    factories: dict[str, Callable[[], list] | None] = {
        "baseline": None,
        "MemoryMonitor": lambda: [MemoryMonitor()],
        "ThroughputMonitor": lambda: [
            ThroughputMonitor(flops_per_token=flops_per_token, peak_flops=1e12, warmup_steps=0)
        ],
        "RuntimeMonitor": lambda: [RuntimeMonitor(max_steps=1000, warmup_steps=0)],
    }
    has_norm = importlib.util.find_spec("trainvitals.callbacks.norm_monitor") is not None
    if has_norm:
        from trainvitals.callbacks.norm_monitor import NormMonitor

        factories["NormMonitor"] = lambda: [NormMonitor()]
    factories["all"] = lambda: [
        MemoryMonitor(),
        ThroughputMonitor(flops_per_token=flops_per_token, peak_flops=1e12, warmup_steps=0),
        RuntimeMonitor(max_steps=1000, warmup_steps=0),
        *([NormMonitor()] if has_norm else []),
    ]
    if args.fixed_costs:
        fixed_costs({"driver (no callback)": list, **factories})
        return
    results = interleaved_ratios(
        {name: runner(name, f) for name, f in factories.items()},
        baseline="baseline",
        reps=args.reps,
        steps=args.steps,
    )
    tmp.cleanup()
    print(
        f"model {format_params(n_params)} parameters, batch {args.batch_size} x {args.seq_len} "
        f"tokens, {args.device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{args.reps} reps x {args.steps} steps, writer {args.writer}, "
        f"log_every_n_steps={args.log_every}"
    )
    print()
    base = results["baseline"]["median_step_s"]
    print(
        "| variant | median s/step | end-to-end ratio (median) | min-max ratio "
        "| hooks wall per step | hooks CPU per step | hooks wall / baseline step |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        hooks = statistics.median(hook_seconds.get(name, [0.0]))
        cpu = statistics.median(hook_cpu.get(name, [0.0]))
        print(
            f"| {name} | {r['median_step_s']:.3f} | {r['median_ratio']:.3f} "
            f"| {r['min_ratio']:.3f}-{r['max_ratio']:.3f} | {1e3 * hooks:.3f} ms "
            f"| {1e3 * cpu:.3f} ms | {100 * hooks / base:.3f}% |"
        )


if __name__ == "__main__":
    main()
