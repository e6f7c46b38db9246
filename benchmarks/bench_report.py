"""Benchmark of ``trainvitals report`` and ``trainvitals query``: the time to write the HTML
report of a long run and to query its tensor statistics.

A synthetic run is written into a temporary folder with the package's own writers:
``--steps`` steps of ``--keys`` scalars written by a ``JsonlSink`` (24 layers x 5 MoE metrics
plus the rest in areas of 10 keys), and a ``tensor_stats.jsonl`` (the format of
``docs/tensor_stats.md``, in ``TensorStatsMonitor``'s compact line format, ``micro_batches``
included, so readers see the lines they see in a run) with one line per kind every
``--stats-every`` steps, each line holding ``--tensors`` tensors' moments
(``model.layers.<i // 4>.mlp.w<i % 4>.weight``). ``--tensor-stats-mib N`` sets ``--steps``
instead, to the number that makes ``tensor_stats.jsonl`` about N MiB. Then, interleaved
``--reps`` times:

* baseline: reading both files with the package's readers (``read_jsonl``,
  ``read_tensor_stats``), which any report has to do;
* the report: :func:`trainvitals.report.write_report` of the same folder;
* three queries (:func:`trainvitals.report.query`, what ``trainvitals query`` runs) of the
  gradients: every statistic of all tensors; kurtosis per layer (``by``); the ``w0``
  tensors of the second half of the steps (``group``, ``steps``).

Reported: the median of each, its ratio to the baseline of the same repetition (median,
min-max), the report's size, and the peak memory (``VmHWM``) of the report, of the
baseline and of a query, each measured in a fresh Python process of its own (with, for
scale, one that only imports the package).

``--run-dir DIR`` writes the run there and keeps it (or reuses the run already there).
``--against DIR`` (a folder holding another copy of the ``trainvitals`` package, say the
commit before a change) replaces the above: the baseline, the report and the three queries,
each in a fresh process, alternating between that copy and this tree ``--reps`` times; the
speed-up is the median of the per-repetition ratios.

Usage::

    python benchmarks/bench_report.py                    # 20,000 steps x 200 keys (~2 minutes)
    python benchmarks/bench_report.py --steps 2000 --reps 3
    python benchmarks/bench_report.py --keys 50 --tensors 1000 --tensor-stats-mib 200
    python benchmarks/bench_report.py --keys 50 --tensors 120 --run-dir /tmp/run --against /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
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
from trainvitals.report import query, read_tensor_stats, write_report
from trainvitals.stats.moments import FIELDS, fused_moments, moments_to_rows

KINDS = ("param", "grad", "activation", "dgrad")


def metric_keys(n: int) -> list[str]:
    moe = [
        f"moe/layer_{layer}/{m}"
        for layer in range(24)
        for m in ("cv", "aux_loss", "dead_expert_frac", "max_overload_factor", "expert_diversity")
    ]
    rest = [f"area_{i // 10}/metric_{i % 10}" for i in range(max(0, n - len(moe)))]
    return (moe + rest)[:n]


def tensor_body(tensors: int) -> dict[str, list[float | int | None]]:
    """The ``tensors`` object of a line: ``tensors`` tensors' moments, as the monitor writes
    them (``moments_to_rows``)."""
    g = torch.Generator().manual_seed(0)
    tensor_names = [f"model.layers.{i // 4}.mlp.w{i % 4}.weight" for i in range(tensors)]
    rows = moments_to_rows(fused_moments([torch.randn(4096, generator=g) for _ in tensor_names]))
    return dict(zip(tensor_names, rows, strict=True))


def tensor_line(step: int, kind: str, body: dict[str, list[float | int | None]]) -> str:
    """One line of ``tensor_stats.jsonl`` as ``TensorStatsMonitor`` writes it: compact
    separators, ``version``, ``step``, ``kind`` first, ``micro_batches`` for the activation
    kinds."""
    line: dict[str, object] = {"version": 1, "step": step, "kind": kind, "time": 1.7e9 + step}
    line.update(fields=list(FIELDS), tensors=body)
    if kind in ("activation", "dgrad"):
        line["micro_batches"] = 1
    return json.dumps(line, separators=(",", ":"), allow_nan=False)


def steps_for_size(mib: float, stats_every: int, tensors: int) -> int:
    """The number of steps whose ``tensor_stats.jsonl`` is about ``mib`` MiB."""
    line_bytes = len(tensor_line(10**6, "activation", tensor_body(tensors))) + 1
    return max(1, round(mib * 2**20 / (len(KINDS) * line_bytes))) * stats_every


def write_run(run_dir: Path, steps: int, keys: int, stats_every: int, tensors: int) -> None:
    rng = random.Random(0)
    names = metric_keys(keys)
    sink = JsonlSink(run_dir / "metrics.jsonl")  # the sink itself: a writer would drop steps
    for step in range(steps):  # when they come faster than it delivers them, as here
        sink.write(step, {k: rng.gauss(1.0, 0.1) for k in names}, 1.7e9 + step)
    sink.close()
    body = tensor_body(tensors)
    with open(run_dir / "tensor_stats.jsonl", "w") as f:
        for step in range(0, steps, stats_every):
            for kind in KINDS:
                f.write(tensor_line(step, kind, body) + "\n")


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
    "query: grad, all stats, all tensors": (
        "from trainvitals.report import query\nquery(run, kind='grad', stat='all')"
    ),
}


#: What is timed after the baseline, in this order, each given the run folder and its steps.
TIMED = {
    "write_report": lambda run, steps: write_report(run),
    "write_report, the last tenth of the steps": lambda run, steps: write_report(
        run, steps=f"{steps - steps // 10}:"
    ),
    "query: grad, all stats, all tensors": lambda run, steps: query(run, kind="grad", stat="all"),
    "query: grad kurtosis per layer (by)": lambda run, steps: query(
        run, kind="grad", stat="kurtosis", by=r"layers\.(\d+)\."
    ),
    "query: grad rms of *.w0.*, second half of the steps": lambda run, steps: query(
        run, kind="grad", stat="rms", group="*.w0.*", steps=f"{steps // 2}:"
    ),
}


#: What ``--against`` times in a fresh process per call, with ``run`` and ``steps`` defined.
TIMED_CODE = {
    "reading both files (baseline)": (
        "from trainvitals.adapters.jsonl import read_jsonl\n"
        "from trainvitals.report import read_tensor_stats\n"
        "read_jsonl(run / 'metrics.jsonl'); list(read_tensor_stats(run))"
    ),
    "write_report": "from trainvitals.report import write_report as f\nf(run)",
    "write_report, the last tenth of the steps": (
        "from trainvitals.report import write_report as f\nf(run, steps=f'{steps - steps // 10}:')"
    ),
    "query: grad, all stats, all tensors": (
        "from trainvitals.report import query as f\nf(run, kind='grad', stat='all')"
    ),
    "query: grad kurtosis per layer (by)": (
        "from trainvitals.report import query as f\n"
        "f(run, kind='grad', stat='kurtosis', by=r'layers\\.(\\d+)\\.')"
    ),
    "query: grad rms of *.w0.*, second half of the steps": (
        "from trainvitals.report import query as f\n"
        "f(run, kind='grad', stat='rms', group='*.w0.*', steps=f'{steps // 2}:')"
    ),
    # the command line (its torch thread count, its output), into a null stdout
    "CLI: trainvitals query grad kurtosis per layer (by)": (
        "import contextlib, os\nfrom trainvitals.cli import main as f\n"
        "out = open(os.devnull, 'w')\n"
        "with contextlib.redirect_stdout(out): f(['query', str(run), '--kind', 'grad', "
        "'--stat', 'kurtosis', '--by', r'layers\\.(\\d+)\\.'])"
    ),
}


def child_seconds(statement: str, run: Path, steps: int, package_root: Path) -> float:
    """Seconds ``statement`` (imports before its last line untimed) takes in a fresh Python
    process importing ``trainvitals`` from ``package_root``."""
    *imports, call = statement.splitlines()
    code = (
        "import sys, time\nfrom pathlib import Path\nimport trainvitals\n"
        "assert Path(trainvitals.__file__).parent.parent == Path(sys.argv[3]), trainvitals\n"
        "run, steps = Path(sys.argv[1]), int(sys.argv[2])\n"
        + "".join(f"{line}\n" for line in imports)
        + f"t0 = time.perf_counter()\n{call}\nprint(time.perf_counter() - t0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(run), str(steps), str(package_root)],
        check=True,
        capture_output=True,
        text=True,
        cwd=package_root,  # (-c puts the working folder first on sys.path)
        env={**os.environ, "PYTHONPATH": str(package_root)},
    )
    return float(done.stdout.split()[-1])


def compare(run: Path, steps: int, against: Path, reps: int) -> None:
    """Time :data:`TIMED_CODE` with the ``trainvitals`` of ``against`` (a folder holding an
    older copy of the package) and with this one, each call in a fresh process, the two
    alternating ``reps`` times: the ratio old/new per repetition (median, min-max)."""
    here = Path(__file__).resolve().parent.parent
    print(f"| what | {against} s | this tree s | speed-up (median, min-max) |")
    print("|---|---|---|---|")
    for what, code in TIMED_CODE.items():
        old: list[float] = []
        new: list[float] = []
        for _ in range(reps):
            old.append(child_seconds(code, run, steps, against))
            new.append(child_seconds(code, run, steps, here))
        ratios = [o / n for o, n in zip(old, new, strict=True)]
        print(
            f"| {what} | {statistics.median(old):.2f} | {statistics.median(new):.2f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--stats-every", type=int, default=10)
    parser.add_argument("--tensors", type=int, default=45)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--tensor-stats-mib", type=float, default=None, help="sets --steps: the file's size"
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="write the run there (kept), or reuse the run already there, instead of a "
        "temporary folder",
    )
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        help="a folder holding another copy of the trainvitals package (an older checkout): "
        "compare it with this one, each call in a fresh process, instead of the table below",
    )
    args = parser.parse_args()
    if args.tensor_stats_mib is not None:
        args.steps = steps_for_size(args.tensor_stats_mib, args.stats_every, args.tensors)

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) if args.run_dir is None else args.run_dir
        started = time.perf_counter()
        if not (run / "metrics.jsonl").is_file():
            run.mkdir(parents=True, exist_ok=True)
            write_run(run, args.steps, args.keys, args.stats_every, args.tensors)
        sizes = {p.name: p.stat().st_size / 2**20 for p in run.glob("*.jsonl")}
        print(
            f"run ready in {time.perf_counter() - started:.1f} s: "
            + ", ".join(f"{n} {s:.0f} MiB" for n, s in sorted(sizes.items()))
        )
        print(f"python {platform.python_version()}, torch {torch.__version__}")
        print(
            f"{args.steps} steps x {args.keys} keys, {args.tensors} tensors every "
            f"{args.stats_every}"
        )
        if args.against is not None:
            compare(run, args.steps, args.against.resolve(), args.reps)
            return
        timings: dict[str, list[float]] = {what: [] for what in ("baseline", *TIMED)}
        for _ in range(args.reps):
            t0 = time.perf_counter()
            read_jsonl(run / "metrics.jsonl")
            list(read_tensor_stats(run))
            timings["baseline"].append(time.perf_counter() - t0)
            for what, call in TIMED.items():
                t0 = time.perf_counter()
                out = call(run, args.steps)
                timings[what].append(time.perf_counter() - t0)
                if what == "write_report":
                    size = out.stat().st_size / 2**20
        peaks = {what: child_peak_gib(code, run) for what, code in PEAK_STATEMENTS.items()}
    print("| what | median s | ratio to reading the files (median, min-max) |")
    print("|---|---|---|")
    base = timings.pop("baseline")
    print(f"| reading both files (baseline) | {statistics.median(base):.2f} | 1.00x |")
    for what, times in timings.items():
        ratios = [t / b for t, b in zip(times, base, strict=True)]
        print(
            f"| {what} | {statistics.median(times):.2f} | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    print(f"report: {size:.1f} MiB")
    print("| peak memory of a process doing only this | GiB |")
    print("|---|---|")
    for what, peak in peaks.items():
        print(f"| {what} | {peak:.2f} |")


if __name__ == "__main__":
    main()
