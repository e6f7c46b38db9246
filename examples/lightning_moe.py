"""Every trainvitals callback in a Lightning ``Trainer``, on the tiny MoE model, on CPU.

    python examples/lightning_moe.py --run-dir runs/lightning --steps 100
    python examples/lightning_moe.py --devices 2          # DDP on two CPU processes

The callbacks write into the loggers the Trainer already has (here TensorBoard and CSV),
through their batch APIs; ``tensor_stats.jsonl`` lands in the logger's folder. Each run is a
new ``version_<n>`` folder of each logger. A short validation every ``--val-every`` optimizer
steps gives ``val/loss`` and ``RuntimeMonitor``'s ``time/validation_hours``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from trainvitals import (
    LoadBalanceMonitor,
    MemoryMonitor,
    MoEMetricsMonitor,
    NormMonitor,
    RuntimeMonitor,
    TensorStatsMonitor,
    ThroughputMonitor,
)
from trainvitals.moe.tiny_model import RandomTokenDataset, TinyMoELightningModule
from trainvitals.report import write_report


def positive_int(text: str) -> int:
    """An argparse type: ``--accumulate 0`` ended in a ZeroDivisionError inside Lightning,
    ``--steps 0`` wrote an empty report, ``--steps -1`` is Lightning's "no step limit" (then up
    to its default 1000 epochs), ``--log-every 0`` stopped in a callback's traceback."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


class LoggedTinyMoE(TinyMoELightningModule):
    """The tiny MoE module with its losses logged (``train/loss``, ``val/loss``)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().validation_step(batch, batch_idx)
        self.log("val/loss", loss, sync_dist=True)
        return loss


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Command lines kept as written, and each option's default."""


def main(argv: list[str] | None = None) -> None:
    # --help shows the docstring's command lines and the defaults
    first, rest = __doc__.replace("``", "`").split("\n\n", 1)
    parser = argparse.ArgumentParser(description=first, epilog=rest, formatter_class=HelpFormatter)
    parser.add_argument(
        "--run-dir",
        default="runs/lightning",
        type=Path,
        help="the loggers' folder: tb/version_<n> (event files, tensor_stats.jsonl, "
        "report.html) and csv/version_<n>",
    )
    parser.add_argument("--steps", default=100, type=positive_int, help="optimizer steps")
    parser.add_argument(
        "--devices", default=1, type=positive_int, help="CPU processes (2 or more: DDP, gloo)"
    )
    parser.add_argument(
        "--accumulate", default=2, type=positive_int, help="micro-batches per optimizer step"
    )
    parser.add_argument(
        "--log-every", default=10, type=positive_int, help="optimizer steps between logged values"
    )
    parser.add_argument(
        "--val-every", default=50, type=positive_int, help="optimizer steps between validations"
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    module = LoggedTinyMoE(
        lr=3e-3, vocab_size=64, hidden_size=64, num_layers=4, num_experts=8, top_k=2
    )
    data = RandomTokenDataset(num_samples=4096, seq_len=32, vocab_size=64, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    val_data = RandomTokenDataset(num_samples=64, seq_len=32, vocab_size=64, seed=1)
    val_loader = torch.utils.data.DataLoader(val_data, batch_size=8)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        log_every_n_steps=args.log_every,
        # Lightning counts val_check_interval in training batches, not optimizer steps (and,
        # with check_val_every_n_epoch=None, across epoch ends)
        val_check_interval=args.val_every * args.accumulate,
        check_val_every_n_epoch=None,
        accelerator="cpu",
        devices=args.devices,
        logger=[TensorBoardLogger(args.run_dir, name="tb"), CSVLogger(args.run_dir, name="csv")],
        callbacks=[
            MoEMetricsMonitor(per_layer_logging=True),
            LoadBalanceMonitor(mode="detailed"),
            TensorStatsMonitor(),
            NormMonitor(),
            MemoryMonitor(),
            ThroughputMonitor(window_size=20),
            RuntimeMonitor(),
        ],
        enable_progress_bar=False,
        default_root_dir=args.run_dir,
    )
    trainer.fit(module, loader, val_loader)
    if trainer.is_global_zero:
        print(f"logs in {args.run_dir} (tensorboard --logdir {args.run_dir / 'tb'})")
        # the TensorBoard logger's folder holds the event file and tensor_stats.jsonl; it, not
        # --run-dir (two loggers' folders: two runs to `trainvitals`), is the run folder
        run_folder = trainer.loggers[0].log_dir
        print(f"HTML report: {write_report(run_folder)}")
        print(f"queries: trainvitals query {run_folder} --kind grad --stat kurtosis")


if __name__ == "__main__":
    main()
