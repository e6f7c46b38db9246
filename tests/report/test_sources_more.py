"""trainvitals.report.sources: Lightning's ``epoch`` read alike from both of Lightning's loggers,
a subfolder tag (``add_scalars``) never merged into a run-folder tag of the same key, and
tensorboard's expected resumed-run messages kept off the console."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from trainvitals.report.sources import StepValues, find_metrics, load_metrics

pytest.importorskip("tensorboard")


def points_of(values: dict[str, StepValues], key: str) -> list[tuple[int, float]]:
    return list(zip(values[key].steps, values[key].values, strict=True))


def f32(x: float) -> float:
    import numpy as np

    return float(np.float32(x))


def test_lightning_epoch_is_an_axis_in_both_of_lightnings_loggers(tmp_path: Path) -> None:
    # Lightning's logger connector adds "epoch" (current_epoch) to the metrics it gives every
    # logger: the CSVLogger writes an epoch column, which the CSV reader skips as an axis, and
    # the TensorBoardLogger an "epoch" tag, which the TensorBoard reader showed as a metric:
    # the keys of one run depended on the logger that wrote it.
    lightning = pytest.importorskip("lightning")
    import torch
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged: list[tuple[int, float]] = []  # (batch index, its loss) as the module computed them

    class Tiny(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("train/loss", loss)
            logged.append((self.trainer.global_step, loss.item()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2
    )
    trainer = lightning.Trainer(
        max_epochs=3,
        log_every_n_steps=2,
        logger=[TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(Tiny(), data)
    tb, csv_file = tmp_path / "tb" / "version_0", tmp_path / "csv" / "version_0" / "metrics.csv"
    # what Lightning wrote: an epoch tag and column beside the loss, epochs 0, 0, 1, 1, 2, 2
    acc = EventAccumulator(os.fspath(tb), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["epoch", "train/loss"]
    assert [e.value for e in acc.Scalars("epoch")] == [0, 0, 1, 1, 2, 2]
    assert csv_file.read_text().splitlines()[0].split(",") == ["epoch", "step", "train/loss"]

    # log_every_n_steps=2: the batches after which the optimizer steps taken are even, at their
    # index as the step
    want = [(s, v) for s, v in logged if (s + 1) % 2 == 0]
    assert [s for s, _ in want] == [1, 3, 5, 7, 9, 11]
    from_tb = load_metrics(find_metrics(tb), lambda key: True, None, None)
    from_csv = load_metrics(find_metrics(csv_file.parent), lambda key: True, None, None)
    assert sorted(from_tb.values) == sorted(from_csv.values) == ["train/loss"]
    assert points_of(from_csv.values, "train/loss") == want
    assert points_of(from_tb.values, "train/loss") == [(s, f32(v)) for s, v in want]


def test_an_epoch_tag_outside_a_lightning_folder_is_a_metric(tmp_path: Path) -> None:
    # accelerator.log({"epoch": e, ...}) with the tensorboard tracker: the user's own metric
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path) as writer:
        for s in range(4):
            writer.add_scalar("epoch", float(s // 2), s)
            writer.add_scalar("train/loss", 1.0 / (s + 1), s)
    src = load_metrics(tmp_path, lambda key: True, None, None)
    assert points_of(src.values, "epoch") == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0)]
    # the same file beside a Lightning hparams.yaml (TensorBoardLogger.save writes it)
    (tmp_path / "hparams.yaml").write_text("{}\n")
    src = load_metrics(tmp_path, lambda key: True, None, None)
    assert sorted(src.values) == ["train/loss"]


@pytest.mark.parametrize("main_tag", ["lr", "a"])  # "a_pg1" sorts before "events.out..."
def test_an_add_scalars_folder_never_merges_into_a_run_folder_tag(
    tmp_path: Path, main_tag: str
) -> None:
    # add_scalar(f"{main_tag}/pg1") in the run folder and add_scalars(main_tag, {"pg1": ...})
    # in the folder f"{main_tag}_pg1": TensorBoard shows two runs; both were keyed
    # f"{main_tag}/pg1" and merged, the value read last winning at every step, so the
    # add_scalar series (1, 2, 3) was gone without a word.
    from torch.utils.tensorboard import SummaryWriter

    root: list[tuple[int, float]] = []
    sub: dict[str, list[tuple[int, float]]] = {"pg0": [], "pg1": []}
    with SummaryWriter(tmp_path) as writer:
        for s in range(3):
            writer.add_scalar(f"{main_tag}/pg1", 1.0 + s, s)
            root.append((s, 1.0 + s))
            groups = {"pg1": 100.0 + s, "pg0": 50.5 + s}
            writer.add_scalars(main_tag, groups, s)
            for name, v in groups.items():
                sub[name].append((s, v))
    assert (tmp_path / f"{main_tag}_pg1").is_dir()
    with pytest.warns(RuntimeWarning, match=rf"'{main_tag}' of the folder {main_tag}_pg1 .*"):
        src = load_metrics(tmp_path, lambda key: True, None, None)
    assert sorted(src.values) == sorted(
        [f"{main_tag}/pg1", f"{main_tag}/pg0", f"{main_tag}/{main_tag}_pg1"]
    )
    assert points_of(src.values, f"{main_tag}/pg1") == root  # the run folder's tag, as logged
    assert points_of(src.values, f"{main_tag}/{main_tag}_pg1") == sub["pg1"]
    assert points_of(src.values, f"{main_tag}/pg0") == sub["pg0"]  # no collision: its usual key


def test_no_warning_without_a_collision(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path) as writer:
        writer.add_scalar("lr/pg2", 1.0, 0)
        writer.add_scalars("lr", {"pg1": 2.0}, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        src = load_metrics(tmp_path, lambda key: True, None, None)
    assert {k: list(v.values) for k, v in src.values.items()} == {"lr/pg2": [1.0], "lr/pg1": [2.0]}


def write_resumed_run(run: Path) -> None:
    """Steps 0..9, then a resume from step 5 (purge_step=5) logging 5..7, each run with a graph
    (Lightning's TensorBoardLogger(log_graph=True) adds one per fit)."""
    import torch
    from torch.utils.tensorboard import SummaryWriter

    model = torch.nn.Linear(2, 1)
    for steps, purge, offset in ((range(10), None, 0.0), (range(5, 8), 5, 100.0)):
        with SummaryWriter(run, purge_step=purge) as writer:
            writer.add_graph(model, torch.zeros(1, 2))
            for s in steps:
                writer.add_scalar("train/loss", offset + s, s)
        time.sleep(1.05)  # the next file's name (its creation second) sorts after this one


def test_a_resumed_runs_folder_is_read_without_tensorboards_messages(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # tensorboard's reader logs a WARNING for the purge of a resumed run ("Detected out of order
    # event.step likely caused by a TensorFlow restart. Purging ...") and for each run's graph
    # after the first: expected in a resumed run's folder, they read like errors.
    write_resumed_run(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tensorboard"):
        src = load_metrics(tmp_path, lambda key: True, None, None)
    assert [r.getMessage()[:40] for r in caplog.records if r.levelno >= logging.WARNING] == []
    want = [(s, float(s)) for s in range(5)] + [(s, 100.0 + s) for s in range(5, 8)]
    assert points_of(src.values, "train/loss") == want  # the purge itself still happened


def test_the_cli_prints_nothing_but_the_reports_path_for_a_resumed_run(tmp_path: Path) -> None:
    # what a user sees: Python prints an unconfigured logger's warnings to stderr
    run = tmp_path / "run"
    write_resumed_run(run)
    out = tmp_path / "report.html"
    done = subprocess.run(
        [sys.executable, "-m", "trainvitals", "report", str(run), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert done.stderr == ""


def test_tensorboard_messages_other_than_the_expected_ones_are_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from trainvitals.report.sources import _quiet_tensorboard_log

    log = logging.getLogger("tensorboard")
    purge = "Detected out of order event.step likely caused by a TensorFlow restart. Purging"
    with caplog.at_level(logging.INFO, logger="tensorboard"):
        with _quiet_tensorboard_log():
            log.warning(purge)
            log.warning('Found more than one "run metadata" event with tag step1. Overwriting')
            log.warning("Found new file_version for event.proto. Old: 1 New: 2")
            log.error("Failed to stat %s: %s", "/x/events.out.tfevents.1", "gone")
        log.warning(purge)  # the filter is gone once the reading is done
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "Found new file_version for event.proto. Old: 1 New: 2"),
        ("ERROR", "Failed to stat /x/events.out.tfevents.1: gone"),
        ("WARNING", purge),
    ]
    assert log.filters == []
