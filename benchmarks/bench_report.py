"""Benchmark of ``trainvitals report``: the time to write the HTML report of a long run.

A synthetic run is written into a temporary folder with the package's own writers:
``--steps`` steps of ``--keys`` scalars written by a ``JsonlSink`` (24 layers x 5 MoE metrics
plus the rest in areas of 10 keys), and a ``tensor_stats.jsonl`` with one line per kind every
``--stats-every`` steps, each line holding ``--tensors`` tensors' moments. Then, interleaved
``--reps`` times:

* baseline: reading both files with the package's readers (``read_jsonl``,
  ``read_tensor_stats``), which any report has to do;
* the report: :func:`trainvitals.report.write_report` of the same folder.

Reported: the median of each, the report's ratio to the baseline of the same repetition
(median, min-max), the report's size, and the peak memory (``ru_maxrss``) of each, measured
in a fresh Python process of its own (with, for scale, one that only imports the package).

Usage::

    python benchmarks/bench_report.py                    # 20,000 steps x 200 keys (~2 minutes)
    python benchmarks/bench_report.py --steps 2000 --reps 3
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainvitals.adapters import JsonlSink
from trainvitals.adapters.jsonl import read_jsonl
from trainvitals.report import read_tensor_stats, write_report
from trainvitals.stats.moments import FIELDS, fused_moments, moments_to_dicts

KINDS = ("param", "grad", "activation", "dgrad")


def metric_keys(n: int) -> list[str]:
    moe = [
        f"moe/layer_{layer}/{m}"
        for layer in range(24)
        for m in ("cv", "aux_loss", "dead_expert_frac", "max_overload_factor", "expert_diversity")
    ]
    rest = [f"area_{i // 10}/metric_{i % 10}" for i in range(max(0, n - len(moe)))]
    return (moe + rest)[:n]


def write_run(run_dir: Path, steps: int, keys: int, stats_every: int, tensors: int) -> None:
    rng = random.Random(0)
    names = metric_keys(keys)
    sink = JsonlSink(run_dir / "metrics.jsonl")  # the sink itself: a writer would drop steps
    for step in range(steps):  # when they come faster than it delivers them, as here
        sink.write(step, {k: rng.gauss(1.0, 0.1) for k in names}, 1.7e9 + step)
    sink.close()
    g = torch.Generator().manual_seed(0)
    tensor_names = [f"model.layers.{i // 4}.mlp.w{i % 4}.weight" for i in range(tensors)]
    rows = moments_to_dicts(fused_moments([torch.randn(4096, generator=g) for _ in tensor_names]))
    body = {n: [r[f] for f in FIELDS] for n, r in zip(tensor_names, rows, strict=True)}
    with open(run_dir / "tensor_stats.jsonl", "w") as f:
        for step in range(0, steps, stats_every):
            for kind in KINDS:
                line = {"version": 1, "step": step, "kind": kind, "time": 0.0}
                line.update(fields=list(FIELDS), tensors=body)
                f.write(json.dumps(line) + "\n")


def child_peak_gib(statement: str, run: Path) -> float:
    """Peak resident memory (GiB) of a fresh Python process that runs ``statement`` with
    ``run`` (the run folder) defined: its ``VmHWM`` (Linux). Not ``ru_maxrss``, which a child
    inherits from the process that started it."""
    code = (
        "import sys\nfrom pathlib import Path\nrun = Path(sys.argv[1])\n"
        f"{statement}\n"
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(run)], check=True, capture_output=True, text=True
    )
    return int(done.stdout.split()[-1]) / 2**20  # KiB -> GiB


PEAK_STATEMENTS = {
    "importing trainvitals.report only": "import trainvitals.report",
    "reading both files (baseline)": (
        "from trainvitals.adapters.jsonl import read_jsonl\n"
        "from trainvitals.report import read_tensor_stats\n"
        "read_jsonl(run / 'metrics.jsonl')\nlist(read_tensor_stats(run))"
    ),
    "write_report": "from trainvitals.report import write_report\nwrite_report(run)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--stats-every", type=int, default=10)
    parser.add_argument("--tensors", type=int, default=45)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        started = time.perf_counter()
        write_run(run, args.steps, args.keys, args.stats_every, args.tensors)
        sizes = {p.name: p.stat().st_size / 2**20 for p in run.glob("*.jsonl")}
        print(
            f"run written in {time.perf_counter() - started:.1f} s: "
            + ", ".join(f"{n} {s:.0f} MiB" for n, s in sorted(sizes.items()))
        )
        print(f"python {platform.python_version()}, torch {torch.__version__}")
        base, report, ratios = [], [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            read_jsonl(run / "metrics.jsonl")
            list(read_tensor_stats(run))
            t1 = time.perf_counter()
            path = write_report(run)
            t2 = time.perf_counter()
            base.append(t1 - t0)
            report.append(t2 - t1)
            ratios.append((t2 - t1) / (t1 - t0))
        size = path.stat().st_size / 2**20
        peaks = {what: child_peak_gib(code, run) for what, code in PEAK_STATEMENTS.items()}
    print(f"{args.steps} steps x {args.keys} keys, {args.tensors} tensors every {args.stats_every}")
    print("| what | median s | ratio to reading the files (median, min-max) |")
    print("|---|---|---|")
    print(f"| reading both files (baseline) | {statistics.median(base):.2f} | 1.00x |")
    print(
        f"| write_report | {statistics.median(report):.2f} | "
        f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
    )
    print(f"report: {size:.1f} MiB")
    print("| peak memory of a process doing only this | GiB |")
    print("|---|---|")
    for what, peak in peaks.items():
        print(f"| {what} | {peak:.2f} |")


if __name__ == "__main__":
    main()
