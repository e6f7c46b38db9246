"""Benchmark of the MoE callbacks: step-time overhead and collectives per logging step.

1. Overhead. The demo model ``TinyMoELM`` trains on CPU (random tokens, AdamW) in a plain loop
   with no callbacks (the baseline), and with ``MoEMetricsMonitor`` + ``LoadBalanceMonitor``
   (detailed mode) through the ``Vitals`` driver logging at EVERY step (the worst case) and
   every 50 steps, both with their default arguments (``MoEMetricsMonitor()``: no per-layer
   keys; ``LoadBalanceMonitor()``: brief mode) at every step, and with each callback alone (``MoEMetricsMonitor`` at every step,
   ``LoadBalanceMonitor`` at every step and every 50). Each configuration has its own model
   and optimizer; they are interleaved step by step in rotating order and each median step
   time is divided by the baseline's median from the same run (see ``bench_overhead``). Only
   ratios measured in the same run are meaningful; absolute times depend on the machine.

2. Collectives. Two gloo processes (DDP) run the same callbacks with ``log_every_n_steps=2``,
   for models of 2, 8 and 24 layers; ``trainvitals.distributed.collective_counter`` counts the
   collectives the callbacks issue at each step (DDP's own gradient all-reduce is not counted).

Usage::

    python benchmarks/bench_moe.py                   # both parts, markdown tables on stdout
    python benchmarks/bench_moe.py --steps 300 --skip-collectives
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor
from trainvitals.moe import TinyMoELM, destroy_moe_metrics_tracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
# The demo model and batch of ``make demo`` (issue 4: "the demo model"), from examples/demo.py.
from demo import BATCH_SIZE as BATCH
from demo import MICRO_BATCHES
from demo import MODEL_CONFIG as MODEL
from demo import SEQ_LEN as SEQ


def _monitors(which: str) -> list[Any]:
    """The callbacks of a configuration: the detailed ones (per-layer keys, the worst case),
    or with ``which == "both_defaults"`` both callbacks with their default arguments."""
    from trainvitals.callbacks.moe_metrics_monitor import MoEMetricsMonitor

    if which == "both_defaults":
        return [MoEMetricsMonitor(), LoadBalanceMonitor()]
    out: list[Any] = []
    if which in ("both", "moe_metrics"):
        out.append(MoEMetricsMonitor(per_layer_logging=True))
    if which in ("both", "load_balance"):
        out.append(LoadBalanceMonitor(mode="detailed", top_k=5))
    return out


class NullWriter:
    """Takes values and does nothing but read tensors back, once per call (like a sink would)."""

    def add_scalar(self, name: str, value: Any, step: int) -> None:
        self.add_scalars({name: value}, step)

    def add_scalars(self, mapping: dict[str, Any], step: int) -> None:
        tensors = [v for v in mapping.values() if isinstance(v, torch.Tensor)]
        if tensors:
            torch.stack([t.detach().reshape(()).double() for t in tensors]).tolist()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Config:
    """One benchmark configuration: its own model, optimizer and (optionally) callbacks."""

    def __init__(
        self,
        name: str,
        monitors: str | None,
        every: int,
        writer: str,
        tmp: str,
        device: str = "cpu",
    ) -> None:
        self.name = name
        self.device = torch.device(device)
        torch.manual_seed(0)
        self.model = TinyMoELM(**MODEL).to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(0)
        self.vitals = None
        self.flush = None
        if monitors is not None:
            if writer == "jsonl":
                from trainvitals.adapters import FanoutWriter, JsonlSink

                w: Any = FanoutWriter([JsonlSink(Path(tmp) / f"{name}.jsonl")], rank=0)
                # The delivery thread writes a step's values during whatever runs next; in
                # this interleaved loop that is always the same other configuration (the
                # rotation keeps the cyclic order). Flushing at the end of each step charges
                # the delivery to the configuration that logged it: the conservative figure
                # (in a real run the delivery thread overlaps the next step).
                self.flush = w.flush
            else:
                w = NullWriter()
            self.vitals = Vitals(_monitors(monitors), writer=w, log_every_n_steps=every)
            self.vitals.attach(self.model, self.opt)

    def step(self, block: int = 1) -> float:
        """Seconds per optimizer step of ``block`` consecutive steps; on a GPU the device is
        synchronised at the end of the block only (a logging step's own wait for the device
        is then part of the figure, as in a real run)."""
        t0 = time.perf_counter()
        for _ in range(block):
            self._one_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - t0) / block

    def _one_step(self) -> None:
        for _ in range(MICRO_BATCHES):
            x = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=self.gen)
            x = x.to(self.device, non_blocking=True)
            if self.vitals is not None:
                self.vitals.batch(x)
            loss = self.model(x, labels=x).loss / MICRO_BATCHES
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.flush is not None:
            self.flush()


def bench_overhead(
    steps: int, warmup: int, writer: str, which: str, device: str = "cpu", block: int = 1
) -> list[dict]:
    """Interleave the configurations step by step (rotating order) and compare medians.

    Each step is timed twice: process CPU time (``time.process_time``: this process's threads
    only, writer threads included, so much less sensitive to other jobs on a shared machine)
    and wall time. The ratio of a configuration's median to the baseline's median is reported,
    with its range over 5 consecutive chunks of the run; a second baseline instance (A/A)
    shows the noise floor.
    """
    tmp = tempfile.mkdtemp(prefix="bench_moe_")
    destroy_moe_metrics_tracker()
    specs = [("baseline", None, 1), ("baseline again (A/A)", None, 1)]
    if which == "both":
        specs += [
            ("both, log every step", "both", 1),
            ("both with default arguments, log every step", "both_defaults", 1),
            ("both, log every 50", "both", 50),
            ("MoEMetricsMonitor, log every step", "moe_metrics", 1),
        ]
    specs += [
        ("LoadBalanceMonitor, log every step", "load_balance", 1),
        ("LoadBalanceMonitor, log every 50", "load_balance", 50),
    ]
    configs = [Config(name, mon, every, writer, tmp, device) for name, mon, every in specs]
    for c in configs:
        for _ in range(warmup):
            c.step()
    cpu: dict[str, list[float]] = {c.name: [] for c in configs}
    wall: dict[str, list[float]] = {c.name: [] for c in configs}
    for i in range(steps):
        shift = i % len(configs)
        for c in configs[shift:] + configs[:shift]:
            t0 = time.process_time()
            wall[c.name].append(c.step(block))
            cpu[c.name].append((time.process_time() - t0) / block)
    for c in configs:
        if c.vitals is not None:
            c.vitals.close()

    def ratio(samples: dict[str, list[float]], name: str) -> tuple[float, float, float]:
        med = statistics.median(samples[name]) / statistics.median(samples["baseline"])
        # the spread: medians of five consecutive chunks (fewer, of one sample each, for a
        # run of fewer than five steps)
        parts = min(5, len(samples[name]))
        n = len(samples[name]) // parts
        chunks = [
            statistics.median(samples[name][j * n : (j + 1) * n])
            / statistics.median(samples["baseline"][j * n : (j + 1) * n])
            for j in range(parts)
        ]
        return med, min(chunks), max(chunks)

    rows = []
    for c in configs:
        r_cpu, lo_cpu, hi_cpu = ratio(cpu, c.name)
        r_wall, lo_wall, hi_wall = ratio(wall, c.name)
        rows.append(
            {
                "config": c.name,
                "cpu_ms": 1e3 * statistics.median(cpu[c.name]),
                "cpu_ratio": r_cpu,
                "cpu_range": (lo_cpu, hi_cpu),
                "wall_ms": 1e3 * statistics.median(wall[c.name]),
                "wall_ratio": r_wall,
                "wall_range": (lo_wall, hi_wall),
            }
        )
    return rows


# --------------------------------------------------------------------------- collectives


def _collective_worker(
    rank: int, world: int, port: int, layers: int, which: str, queue: Any
) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainvitals.distributed import ProcessGroups, collective_counter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        cfg = dict(MODEL, num_layers=layers, hidden_size=32, ffn_hidden_size=32, max_seq_len=16)
        model = DistributedDataParallel(TinyMoELM(**cfg))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        vitals = Vitals(
            _monitors(which), writer=NullWriter(), groups=ProcessGroups.world(), log_every_n_steps=2
        ).attach(model, opt)
        per_step = []
        for _ in range(4):
            for _ in range(2):
                x = torch.randint(0, MODEL["vocab_size"], (2, 8))
                vitals.batch(x)
                model(x, labels=x).loss.backward()
            before = collective_counter.copy()
            opt.step()
            after = collective_counter.copy()
            after.subtract(before)
            per_step.append({k: v for k, v in after.items() if v})
            opt.zero_grad()
        vitals.close()
        queue.put((rank, per_step))
    finally:
        dist.destroy_process_group()


def bench_collectives(layer_counts: list[int], which: str) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for layers in layer_counts:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_collective_worker, args=(r, 2, port, layers, which, queue))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        steps = results[0]
        rows.append(
            {
                "layers": layers,
                "logging": steps[0],
                "non_logging": steps[1],
                "logging_again": steps[2],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--writer", choices=("jsonl", "null"), default="jsonl")
    parser.add_argument(
        "--which",
        choices=("both", "load_balance"),
        default="both",
        help="both MoE callbacks, or LoadBalanceMonitor alone",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        help="optimizer steps per timed sample (on a GPU: synchronised at its end only)",
    )
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-collectives", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRAINVITALS_STRICT", "1")

    if not args.skip_overhead:
        rows = bench_overhead(
            args.steps, args.warmup, args.writer, args.which, args.device, args.block
        )
        print(
            f"\nStep time, TinyMoELM {MODEL}, batch {BATCH}x{SEQ}, {MICRO_BATCHES} micro-batches, "
            f"AdamW, {args.device}, {args.threads} thread(s), writer {args.writer}, "
            f"{args.steps} samples of {args.block} step(s) per configuration, interleaved\n"
        )
        print(
            "| configuration | CPU ms/step | CPU ratio | CPU ratio range (5 chunks) "
            "| wall ms/step | wall ratio | wall ratio range |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['config']} | {r['cpu_ms']:.2f} | {r['cpu_ratio']:.3f} | "
                f"{r['cpu_range'][0]:.3f} - {r['cpu_range'][1]:.3f} | {r['wall_ms']:.2f} | "
                f"{r['wall_ratio']:.3f} | {r['wall_range'][0]:.3f} - {r['wall_range'][1]:.3f} |"
            )
    if not args.skip_collectives:
        variants = ["load_balance"] if args.which == "load_balance" else ["load_balance", "both"]
        print(
            "\nCollectives issued by the callbacks per step, 2 gloo ranks (DDP), log every 2 "
            "steps, all on the data-parallel (= world) group\n"
        )
        print("| callbacks | MoE layers | logging step 0 | non-logging step 1 | logging step 2 |")
        print("|---|---|---|---|---|")
        for which in variants:
            for r in bench_collectives([2, 8, 24], which):
                name = "LoadBalanceMonitor" if which == "load_balance" else "both"
                print(
                    f"| {name} | {r['layers']} | {_fmt(r['logging'])} | "
                    f"{_fmt(r['non_logging'])} | {_fmt(r['logging_again'])} |"
                )


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"


if __name__ == "__main__":
    main()
