"""The trainvitals demo: a small mixture-of-experts language model trained on CPU with every
callback, logging to TensorBoard, an MLflow SQLite store and JSONL through one fan-out writer.

Run it with ``make demo`` (which sets up the virtual environment) or directly::

    python examples/demo.py --run-dir runs/demo --steps 300

At the end it writes ``<run-dir>/report.html`` (``trainvitals report``). The corpus is the
package's own source code, read byte by byte (vocabulary 256), so the loss
falls visibly within a few hundred steps and nothing is downloaded; its last tenth is held out
and validated on every ``--val-every`` steps (``val/loss``; its time is ``time/validation_hours``).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

import trainvitals
from trainvitals import (
    LoadBalanceMonitor,
    MemoryMonitor,
    MoEMetricsMonitor,
    NormMonitor,
    RuntimeMonitor,
    TensorStatsMonitor,
    ThroughputMonitor,
)
from trainvitals.adapters import FanoutWriter, JsonlSink, MLflowSink, TensorBoardSink
from trainvitals.adapters.loop import Vitals
from trainvitals.moe import TinyMoELM, set_aux_loss_backward_scale
from trainvitals.report import write_report

# The demo model and batch (benchmarks/bench_moe.py measures the MoE callbacks on exactly these).
MODEL_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    num_layers=4,
    num_experts=8,
    top_k=2,
    ffn_hidden_size=128,
    aux_loss_type="aux_loss",
    aux_loss_coeff=1e-2,
    z_loss_coeff=1e-3,
)
BATCH_SIZE, SEQ_LEN, MICRO_BATCHES = 8, 64, 2
VAL_BATCHES = 4  # batches of held-out text per validation


def load_corpus() -> torch.Tensor:
    """The bytes of trainvitals' own source files: a small, real, shipped text."""
    root = Path(trainvitals.__file__).parent
    text = b"\n".join(p.read_bytes() for p in sorted(root.rglob("*.py")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batches(corpus: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch_size,), generator=generator)
        rows = torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()])
        yield {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}


def positive_int(text: str) -> int:
    """An argparse type: 0 steps divided by zero in the schedule, 0 micro-batches "trained"
    every step on no data; say so at the command line instead."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def make_callbacks() -> list:
    """Every callback, as the demo runs them (tests/test_cross_checks19.py checks their numbers
    against each other and against float64 recomputations)."""
    return [
        MoEMetricsMonitor(per_layer_logging=True, percentiles={"load_balancing_loss": [0.5, 0.9]}),
        LoadBalanceMonitor(mode="detailed"),
        # per-layer RMS and kurtosis on the dashboards too (tensor_stats.jsonl has every tensor)
        TensorStatsMonitor(layer_pattern=r"layers\.(\d+)\."),
        # each router's gradient norm and each layer's next to the global one
        NormMonitor(per_param=["*.router.weight"], group_by=r"layers\.(\d+)\."),
        MemoryMonitor(),
        # flops counted on the first step: TinyMoELM runs every expert on every token, so they
        # are hardware flops (docs/callbacks.md); CPUs have no peak in the table, so no MFU key
        # unless peak_flops= is given
        ThroughputMonitor(window_size=20, measure_flops=True),
        RuntimeMonitor(),
    ]


def main(argv: list[str] | None = None) -> None:
    # --help shows each option's default
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--run-dir",
        default="runs/demo",
        type=Path,
        help="where the TensorBoard, MLflow and JSONL logs and report.html go",
    )
    parser.add_argument("--steps", default=300, type=positive_int, help="optimizer steps")
    parser.add_argument(
        "--micro-batches",
        default=MICRO_BATCHES,
        type=positive_int,
        help="micro-batches per optimizer step (gradient accumulation)",
    )
    parser.add_argument(
        "--batch-size", default=BATCH_SIZE, type=positive_int, help="sequences per micro-batch"
    )
    parser.add_argument(
        "--seq-len", default=SEQ_LEN, type=positive_int, help="tokens (bytes) per sequence"
    )
    parser.add_argument(
        "--log-every", default=10, type=positive_int, help="optimizer steps between logged values"
    )
    parser.add_argument(
        "--val-every", default=100, type=positive_int, help="optimizer steps between validations"
    )
    parser.add_argument(
        "--lr", default=3e-3, type=float, help="peak learning rate (warm-up, then cosine decay)"
    )
    parser.add_argument(
        "--seed",
        default=0,
        type=int,
        help="seed of the model's initialisation (the batches are fixed)",
    )
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a tiny model gains nothing from intra-op threads
    run_dir: Path = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)

    model = TinyMoELM(**MODEL_CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        ),
    )

    tensorboard_dir = run_dir / "tensorboard"
    mlflow_uri = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    jsonl_path = run_dir / "metrics.jsonl"
    writer = FanoutWriter(
        [
            TensorBoardSink(tensorboard_dir),
            MLflowSink(tracking_uri=mlflow_uri, experiment_name="trainvitals-demo"),
            JsonlSink(jsonl_path),
        ]
    )
    vitals = Vitals(
        make_callbacks(),
        writer=writer,
        log_every_n_steps=args.log_every,
        run_dir=run_dir,
        max_steps=args.steps,
        accumulate_grad_batches=args.micro_batches,
    )
    vitals.attach(model, optimizer)
    # the loop divides its loss by the micro-batches: the routers' injected aux-loss gradients too
    set_aux_loss_backward_scale(1 / args.micro_batches)

    corpus = load_corpus()
    held_out = corpus.numel() // 10  # the last tenth of the corpus: never trained on
    data = batches(
        corpus[:-held_out], args.batch_size, args.seq_len, torch.Generator().manual_seed(1)
    )
    val_data = batches(corpus[-held_out:], args.batch_size, args.seq_len, torch.Generator())
    started = time.perf_counter()
    with vitals:
        for step in range(args.steps):
            step_loss = torch.zeros(())
            for _ in range(args.micro_batches):
                batch = next(data)
                vitals.batch(batch)
                loss = model(batch["input_ids"], labels=batch["labels"]).loss
                (loss / args.micro_batches).backward()
                step_loss += loss.detach() / args.micro_batches
            vitals.clip_grad_norm_(model.parameters(), 1.0)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            model.moe_step_end()  # expert-bias updates and global-aux-loss counts, when used
            writer.add_scalars({"train/loss": step_loss, "train/lr": lr}, step)
            if (step + 1) % args.val_every == 0 or step == args.steps - 1:
                # its time goes to time/validation_hours, not into the training rates
                with vitals.validating(), torch.no_grad():
                    model.eval()
                    val_loss = sum(
                        model(b["input_ids"], labels=b["labels"]).loss
                        for b in (next(val_data) for _ in range(VAL_BATCHES))
                    )
                    model.train()
                writer.add_scalar("val/loss", val_loss / VAL_BATCHES, step)
            if step % (args.log_every * 5) == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {step_loss.item():.3f}  lr {lr:.2e}", flush=True)
    writer.close()
    elapsed = time.perf_counter() - started

    print(f"\ntrained {args.steps} steps in {elapsed:.1f} s; metrics went to:")
    print(f"  TensorBoard   {tensorboard_dir}   (tensorboard --logdir {tensorboard_dir})")
    print(f"  MLflow        {mlflow_uri}   (mlflow ui --backend-store-uri {mlflow_uri})")
    print(f"  JSONL         {jsonl_path}")
    print(f"  tensor stats  {run_dir / 'tensor_stats.jsonl'}   (trainvitals query {run_dir} ...)")
    print(f"  HTML report   {write_report(run_dir)}   (trainvitals report {run_dir})")


if __name__ == "__main__":
    main()
