"""Benchmark of the fan-out writer: training-thread cost and MLflow delivery throughput.

Part (a): ``--keys`` scalars per step (one-element tensors, fresh every step, as the callbacks
hand them over) for ``--steps`` steps into TensorBoard + an MLflow SQLite store + JSONL through
one :class:`FanoutWriter`. Between steps the "training thread" sleeps ``--step-ms`` (a step
waiting on the device, the GIL released); we time only the writer calls. Reported: time in the
writer per step (mean, median, p95, max) for ``add_scalars(dict)`` and for one ``add_scalar``
per key, the time ``close()`` then needs to drain, and how long each sink spent writing.

Part (b): MLflow delivery throughput, each on a fresh SQLite store with the same keys, one after
the other in this run:

* ours: a ``FanoutWriter`` with only an ``MLflowSink`` (``log_batch``, 1000 metrics per call),
  end to end (first call to ``close()`` returned);
* per-scalar forwarding: one ``MlflowClient.log_metric`` call per scalar, the way an adapter
  that forwards each ``add_scalar`` to its backend does (fewer steps: it is slow);
* Lightning's ``MLFlowLogger.log_metrics`` once per step (one ``log_batch`` of the step).

Throughput is metrics per second; ratios are against the per-scalar baseline of the same run.

Usage::

    python benchmarks/bench_writer.py            # 200 steps x 1000 keys (a few minutes)
    python benchmarks/bench_writer.py --quick    # 50 steps, fewer MLflow steps (~1 minute)
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainvitals.adapters import FanoutWriter, JsonlSink, MLflowSink, Sink, TensorBoardSink


class TimedSink(Sink):
    """Wraps a sink and adds up the time spent in its writes."""

    def __init__(self, inner: Sink) -> None:
        super().__init__(name=inner.name, owned=inner.owned)
        self.inner = inner
        self.thread_safe = inner.thread_safe
        self.write_s = 0.0
        self.writes = 0

    def open(self) -> None:
        self.inner.open()

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        t = time.perf_counter()
        self.inner.write(step, metrics, wall_time)
        self.write_s += time.perf_counter() - t
        self.writes += 1

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


def _keys(n: int) -> list[str]:
    return [f"moe/layer_{i // 16}/expert_{i % 16}/load" for i in range(n)]


def _summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    return {
        "mean": statistics.fmean(ms),
        "p50": ms[len(ms) // 2],
        "p95": ms[min(len(ms) - 1, int(0.95 * len(ms)))],
        "max": ms[-1],
    }


class NullSink(Sink):
    name = "null"

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        pass


def bench_training_thread(
    root: Path, keys: list[str], steps: int, step_ms: float, per_key: bool, null: bool = False
) -> dict[str, Any]:
    """Part (a): TensorBoard + MLflow SQLite + JSONL, time in the writer per step.

    ``null``: the control: the same writer with one sink that does nothing, so that no
    background thread competes for the GIL and the CPU.
    """
    sinks = [
        TimedSink(TensorBoardSink(root / "tb")),
        TimedSink(MLflowSink(run_dir=root, experiment_name="bench")),
        TimedSink(JsonlSink(root / "metrics.jsonl")),
    ]
    if null:
        sinks = [TimedSink(NullSink())]
    writer = FanoutWriter(sinks, rank=0, buffer_steps=max(1000, steps), close_timeout=3600)
    n = len(keys)
    in_writer: list[float] = []
    in_writer_cpu: list[float] = []
    loop_start = time.perf_counter()
    for step in range(steps):
        data = torch.rand(n, dtype=torch.float32)
        values = dict(zip(keys, data.unbind(), strict=True))  # fresh 0-d tensors, not timed
        c = time.thread_time()
        t = time.perf_counter()
        if per_key:
            for k, v in values.items():
                writer.add_scalar(k, v, step)
        else:
            writer.add_scalars(values, step)
        in_writer.append(time.perf_counter() - t)
        in_writer_cpu.append(time.thread_time() - c)
        if step_ms:
            time.sleep(step_ms / 1e3)
    loop_s = time.perf_counter() - loop_start
    t = time.perf_counter()
    writer.close()
    close_s = time.perf_counter() - t
    status = writer.status()
    assert all(s["delivered"] == steps and s["missed"] == 0 for s in status.values()), status
    return {
        "in_writer_ms": _summary(in_writer),
        "in_writer_cpu_ms": _summary(in_writer_cpu),
        "loop_s": loop_s,
        "close_s": close_s,
        "sink_write_s": {s.name: s.write_s for s in sinks},
        "mlflow_metrics_per_s_in_fanout": steps * n / sinks[-1 if null else 1].write_s,
    }


def bench_ours(root: Path, keys: list[str], steps: int) -> float:
    writer = FanoutWriter([MLflowSink(run_dir=root, experiment_name="ours")], rank=0)
    writer.add_scalar("warmup", 0.0, 0)  # creates the store and run: not part of the rate
    writer.flush()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        writer.add_scalars(dict(zip(keys, torch.rand(len(keys)).unbind(), strict=True)), step)
    writer.close()
    elapsed = time.perf_counter() - start
    assert writer.status()["mlflow"]["delivered"] == steps + 1
    return steps * len(keys) / elapsed


def bench_per_scalar(root: Path, keys: list[str], calls: int) -> float:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("per-scalar")).info.run_id
    client.log_metric(run_id, "warmup", 0.0, step=0)
    start = time.perf_counter()
    for i in range(calls):
        step, k = divmod(i, len(keys))
        client.log_metric(run_id, keys[k], float(torch.rand(())), step=step + 1)
    return calls / (time.perf_counter() - start)


def bench_lightning(root: Path, keys: list[str], steps: int) -> float:
    try:
        from lightning.pytorch.loggers import MLFlowLogger
    except ImportError:  # pragma: no cover
        from pytorch_lightning.loggers import MLFlowLogger

    logger = MLFlowLogger(
        experiment_name="lightning", tracking_uri=f"sqlite:///{root / 'mlflow.db'}"
    )
    logger.log_metrics({"warmup": 0.0}, step=0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        values = torch.rand(len(keys)).tolist()
        logger.log_metrics(dict(zip(keys, values, strict=True)), step=step)
    return steps * len(keys) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1000, help="scalars per step")
    parser.add_argument("--steps", type=int, default=200, help="steps of part (a)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated step time")
    parser.add_argument("--mlflow-steps", type=int, default=40, help="steps of part (b)")
    parser.add_argument("--per-scalar-calls", type=int, default=2000, help="log_metric calls")
    parser.add_argument("--quick", action="store_true", help="fewer steps everywhere")
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go (temp)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.mlflow_steps, args.per_scalar_calls = 50, 10, 500
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    keys = _keys(args.keys)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        for name in ("control", "a_dict", "a_per_key", "ours", "per_scalar", "lightning"):
            (root / name).mkdir()
        print(
            f"# trainvitals bench_writer: load average {os.getloadavg()[0]:.1f} at start; "
            f"{args.keys} keys/step; python {platform.python_version()}, "
            f"torch {torch.__version__}, {os.cpu_count()} CPUs; {platform.platform()}"
        )
        print(
            f"# command: {' '.join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])])}"
        )
        control = bench_training_thread(
            root / "control", keys, args.steps, args.step_ms, per_key=False, null=True
        )
        a = bench_training_thread(root / "a_dict", keys, args.steps, args.step_ms, per_key=False)
        a_key = bench_training_thread(
            root / "a_per_key", keys, args.steps, args.step_ms, per_key=True
        )
        ours = bench_ours(root / "ours", keys, args.mlflow_steps)
        per_scalar = bench_per_scalar(root / "per_scalar", keys, args.per_scalar_calls)
        lightning = bench_lightning(root / "lightning", keys, args.mlflow_steps)

    print()
    print(
        f"## (a) training-thread time in the writer per step ({args.keys} tensors/step, "
        f"{args.steps} steps, TensorBoard + MLflow SQLite + JSONL, {args.step_ms:g} ms simulated step)"
    )
    print()
    print("| call | clock | mean ms | p50 ms | p95 ms | max ms | target |")
    print("|---|---|---:|---:|---:|---:|---|")
    rows = (
        ("add_scalars(dict)", a),
        (f"{args.keys} x add_scalar", a_key),
        ("control: add_scalars(dict), one no-op sink", control),
    )
    for label, r in rows:
        for clock, s in (("wall", r["in_writer_ms"]), ("thread CPU", r["in_writer_cpu_ms"])):
            print(
                f"| {label} | {clock} | {s['mean']:.3f} | {s['p50']:.3f} | {s['p95']:.3f} "
                f"| {s['max']:.3f} | <= 1 ms |"
            )
    print()
    print(
        f"Delivery (background threads, add_scalars run): loop {a['loop_s']:.1f} s, then close() "
        f"drained for {a['close_s']:.1f} s; time inside each sink's writes: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in a["sink_write_s"].items())
        + f"; MLflow log_batch rate inside the fan-out: {a['mlflow_metrics_per_s_in_fanout']:.0f} metrics/s."
    )
    print()
    print(f"## (b) MLflow delivery throughput into SQLite ({args.keys} keys/step)")
    print()
    print("| path | metrics/s | vs per-scalar | measured over |")
    print("|---|---:|---:|---|")
    print(
        f"| FanoutWriter -> MLflowSink (log_batch), end to end | {ours:.0f} | {ours / per_scalar:.1f}x | {args.mlflow_steps} steps |"
    )
    print(
        f"| Lightning MLFlowLogger.log_metrics once per step | {lightning:.0f} | {lightning / per_scalar:.1f}x | {args.mlflow_steps} steps |"
    )
    print(
        f"| one log_metric call per scalar (baseline) | {per_scalar:.0f} | 1.0x | {args.per_scalar_calls} calls |"
    )
    print()
    print(f"Ours vs Lightning's logger: {ours / lightning:.2f}x. Target: ours >= 20x per-scalar.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
