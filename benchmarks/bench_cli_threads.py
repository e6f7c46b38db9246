"""Benchmark: the report/query merges (``combine_moments``) on one torch thread against two,
on an idle host and with ``--busy`` busy-loop processes beside them (a training job on the same
node), which is why the ``trainvitals`` command line runs torch on one thread.

Each repetition times one grouped merge of ``--rows`` random moment rows into ``--groups``
groups with 1 thread, then with 2, alternating; reported: the median and minimum of each and
the median of the per-repetition ratios.

Usage::

    python benchmarks/bench_cli_threads.py                 # idle
    python benchmarks/bench_cli_threads.py --busy 2        # two busy processes beside it
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from trainvitals.stats.moments import combine_moments, fused_moments


def _spin(stop) -> None:  # a busy core
    while not stop.is_set():
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=25_600)
    parser.add_argument("--groups", type=int, default=256)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--busy", type=int, default=0, help="busy-loop processes beside it")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, generator=gen, dtype=torch.float64) for _ in range(args.rows)]
    parts = fused_moments(tensors)  # [rows, fields] float64, as the readers merge them
    index = torch.randint(0, args.groups, (args.rows,), generator=gen)
    stop = multiprocessing.Event()
    busy = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(args.busy)]
    for p in busy:
        p.start()
    times: dict[int, list[float]] = {1: [], 2: []}
    try:
        for _ in range(args.reps):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                combine_moments(parts, index, args.groups)
                times[threads].append(time.perf_counter() - t0)
    finally:
        stop.set()
        for p in busy:
            p.join()
    ratios = [b / a for a, b in zip(times[1], times[2], strict=True)]
    print(
        f"torch {torch.__version__}, {args.rows} rows into {args.groups} groups, busy {args.busy}"
    )
    for threads, ts in times.items():
        print(
            f"{threads} thread(s): median {statistics.median(ts) * 1e3:.2f} ms, "
            f"min {min(ts) * 1e3:.2f} ms"
        )
    print(f"2 threads / 1 thread: {statistics.median(ratios):.2f}x (median of {args.reps})")


if __name__ == "__main__":
    main()
