"""FanoutWriter.from_lightning / from_accelerator on real Trainers, loggers and trackers."""

from __future__ import annotations

import csv
import importlib
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.adapters.conftest import (
    offline_wandb_run,
    read_mlflow,
    read_tensorboard,
    read_wandb_offline,
)
from trainvitals.adapters import (
    CometSink,
    FanoutWriter,
    JsonlSink,
    LightningLoggerSink,
    MLflowSink,
    TensorBoardSink,
    TrackerSink,
    WandbSink,
    read_jsonl,
)
from trainvitals.adapters.sinks.base import MLFLOW_KEYS

N_STEPS = 4


def _our_values(step: int, loss: torch.Tensor) -> dict[str, Any]:
    return {
        "vitals/loss": loss.detach().clone(),
        "vitals/step_squared": float(step * step),
        "vitals/tokens": torch.tensor(1000 * step + 7),
        "vitals/odd[key]": torch.tensor(0.25 * step, dtype=torch.float64),
    }


def _expected(step: int, loss: float) -> dict[str, float]:
    return {
        "vitals/loss": loss,
        "vitals/step_squared": float(step * step),
        "vitals/tokens": float(1000 * step + 7),
        "vitals/odd[key]": 0.25 * step,
    }


# --------------------------------------------------------------------------------------------
# Lightning


@pytest.mark.timeout(300)
@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_trainer_with_tensorboard_mlflow_and_csv_loggers(package: str, tmp_path) -> None:
    pl = importlib.import_module(package)
    loggers = importlib.import_module(f"{package}.loggers")

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class WriterCallback(pl.Callback):
        def __init__(self) -> None:
            self.expected: dict[int, dict[str, float]] = {}

        def setup(self, trainer, pl_module, stage):
            self.writer = FanoutWriter.from_lightning(trainer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            self.writer.add_scalars(_our_values(step, outputs["loss"]), step)
            self.expected[step] = _expected(step, float(outputs["loss"]))

        def on_train_end(self, trainer, pl_module):
            self.writer.close()

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    tb = loggers.TensorBoardLogger(str(tmp_path), name="tb")
    mlf = loggers.MLFlowLogger(experiment_name="lit", tracking_uri=f"sqlite:///{tmp_path}/ml.db")
    csv_logger = loggers.CSVLogger(str(tmp_path), name="csv")
    callback = WriterCallback()
    trainer = pl.Trainer(
        max_steps=N_STEPS,
        accelerator="cpu",
        logger=[tb, mlf, csv_logger],
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))

    sinks = callback.writer.sinks
    assert [type(s) for s in sinks] == [TensorBoardSink, MLflowSink, LightningLoggerSink]
    assert sinks[0].writer is tb.experiment and sinks[1].run_id == mlf.run_id
    expected = callback.expected
    assert sorted(expected) == list(range(1, N_STEPS + 1))
    assert callback.writer.status()["csvlogger"]["delivered"] == N_STEPS

    # TensorBoard: the logger's own event file(s), float32 summaries
    got_tb = read_tensorboard(tb.log_dir)
    for key in _expected(0, 0.0):
        assert got_tb[key] == {s: float(np.float32(v[key])) for s, v in expected.items()}, key

    # MLflow: the logger's run; the key Lightning itself would strip is mapped instead
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/ml.db")
    mapped = {MLFLOW_KEYS.map(k): k for k in _expected(0, 0.0)}
    assert "vitals/odd_x5bkey_x5d" in mapped
    got_ml = read_mlflow(client, mlf.run_id, list(mapped))
    for mkey, key in mapped.items():
        assert got_ml[mkey] == {s: v[key] for s, v in expected.items()}, key

    # CSV: rows written by the logger, one per step for our keys
    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("vitals/loss")]
    assert [int(r["step"]) for r in rows] == sorted(expected)
    for r in rows:
        want = expected[int(r["step"])]
        assert {k: float(r[k]) for k in want} == want


class _Exploding:
    """A logger whose experiment must not be touched (a non-zero rank's dummy)."""

    @property
    def experiment(self):
        raise AssertionError("experiment accessed on a non-zero rank")

    def log_metrics(self, metrics, step):
        raise AssertionError("logged on a non-zero rank")


def test_from_lightning_on_a_nonzero_rank_builds_nothing() -> None:
    trainer = SimpleNamespace(global_rank=1, loggers=[_Exploding()])
    writer = FanoutWriter.from_lightning(trainer)
    writer.add_scalar("a", 1.0, 0)
    writer.close()
    assert writer.rank == 1 and writer.sinks == [] and writer.status() == {}


def test_from_lightning_without_loggers(tmp_path) -> None:
    trainer = SimpleNamespace(global_rank=0, loggers=[])
    with pytest.raises(ValueError, match="default_jsonl"):
        FanoutWriter.from_lightning(trainer)
    with pytest.raises(ValueError, match="default_jsonl"):  # the same on every rank
        FanoutWriter.from_lightning(SimpleNamespace(global_rank=1, loggers=[]))
    with FanoutWriter.from_lightning(trainer, default_jsonl=tmp_path / "m.jsonl") as writer:
        writer.add_scalar("a", 1.0, 3)
    assert [type(s) for s in writer.sinks] == [JsonlSink]
    assert read_jsonl(tmp_path / "m.jsonl")[0]["metrics"] == {"a": 1.0}


def test_from_lightning_maps_comet_and_wandb_loggers_by_class_name() -> None:
    experiment = SimpleNamespace(log_metrics=lambda *a, **k: None, log=lambda *a, **k: None)
    CometLogger = type("CometLogger", (), {"experiment": experiment})
    WandbLogger = type("WandbLogger", (), {"experiment": experiment})
    Custom = type("NeptuneLogger", (), {"log_metrics": lambda self, m, s: None})
    trainer = SimpleNamespace(global_rank=0, loggers=[CometLogger(), WandbLogger(), Custom()])
    writer = FanoutWriter.from_lightning(trainer)
    comet, wandb_sink, custom = writer.sinks
    assert isinstance(comet, CometSink) and comet.experiment is experiment and not comet.owned
    assert isinstance(wandb_sink, WandbSink) and wandb_sink.step_metric == "trainer/global_step"
    assert isinstance(custom, LightningLoggerSink) and not custom.thread_safe
    writer.close()


def test_from_lightning_keys_carry_each_loggers_prefix_as_its_own_log_metrics(tmp_path) -> None:
    # A logger's prefix= is applied by its log_metrics; the sinks that write to its backend
    # directly must name our keys the same way. Reference: the names the loggers themselves
    # give a key, logged through their own log_metrics into the same backends.
    from lightning.pytorch import loggers
    from mlflow import MlflowClient

    tb = loggers.TensorBoardLogger(str(tmp_path), name="tb", prefix="exp")
    mlf = loggers.MLFlowLogger(
        experiment_name="p", tracking_uri=f"sqlite:///{tmp_path}/ml.db", prefix="exp"
    )
    csv_logger = loggers.CSVLogger(str(tmp_path), name="csv", prefix="exp")
    logged: dict[str, list[str]] = {"comet": [], "wandb": []}
    comet_experiment = SimpleNamespace(
        log_metrics=lambda metrics, step=None: logged["comet"].extend(metrics)
    )
    wandb_run = SimpleNamespace(log=lambda data, **k: logged["wandb"].extend(data))
    # Lightning's CometLogger passes prefix to comet_ml, which joins it with "_"
    # (comet_ml Experiment.__internal_api__log_metrics__); WandbLogger uses "-"
    comet = type("CometLogger", (), {"experiment": comet_experiment, "_prefix": "exp"})()
    wandb_logger = type(
        "WandbLogger", (), {"experiment": wandb_run, "_prefix": "exp", "LOGGER_JOIN_CHAR": "-"}
    )()
    trainer = SimpleNamespace(global_rank=0, loggers=[tb, mlf, csv_logger, comet, wandb_logger])
    for logger in (tb, mlf, csv_logger):
        logger.log_metrics({"own/x": 1.0}, step=0)
    with FanoutWriter.from_lightning(trainer) as writer:
        writer.add_scalar("vitals/x", 2.0, 1)
    csv_logger.save()

    assert set(read_tensorboard(tb.log_dir)) == {"exp-own/x", "exp-vitals/x"}
    history = MlflowClient(f"sqlite:///{tmp_path}/ml.db").get_run(mlf.run_id).data.metrics
    assert set(history) == {"exp-own/x", "exp-vitals/x"}
    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as f:
        header = next(csv.reader(f))
    assert {"exp-own/x", "exp-vitals/x"} <= set(header)
    assert logged["comet"] == ["exp_vitals/x"]
    assert logged["wandb"] == ["exp-vitals/x", "trainer/global_step"]


def test_wandb_sink_with_lightnings_step_metric_shares_the_run(tmp_path) -> None:

    run = offline_wandb_run(tmp_path, "tv")
    try:
        with FanoutWriter([WandbSink(run, step_metric="trainer/global_step")], rank=0) as w:
            run.log({"user/loss": 1.0, "trainer/global_step": 0})  # the logger's own row
            for step in range(3):
                w.add_scalar("vitals/x", float(step) / 3, step)
    finally:
        run.finish()
    rows = [r for r in read_wandb_offline(tmp_path) if "vitals/x" in r]
    assert [(r["trainer/global_step"], r["vitals/x"]) for r in rows] == [
        (s, s / 3) for s in range(3)
    ]


def test_wandb_sink_reports_a_step_the_run_has_passed(tmp_path) -> None:

    run = offline_wandb_run(tmp_path, "tv")
    try:
        writer = FanoutWriter([WandbSink(run)], rank=0)
        writer.add_scalar("vitals/x", 1.0, 2)
        run.log({"user/loss": 1.0}, step=5)  # someone else moves the run to step 5 first
        with pytest.warns(
            RuntimeWarning, match=r"refused step 2: the W&B run is already at step 5"
        ):
            writer.add_scalar("vitals/x", 2.0, 6)
            writer.flush()
        with pytest.warns(
            RuntimeWarning, match=r"missed 1 of 2 steps \(1 refused by the backend\)"
        ):
            writer.close()
    finally:
        run.finish()
    assert writer.status()["wandb"]["missed"] == 1
    rows = [r for r in read_wandb_offline(tmp_path) if "vitals/x" in r]
    assert [(r["_step"], r["vitals/x"]) for r in rows] == [(6, 2.0)]


# --------------------------------------------------------------------------------------------
# Accelerate


def _recording_tracker_class():
    """An Accelerate GeneralTracker recording what it receives (accelerate imported lazily)."""
    from accelerate.tracking import GeneralTracker

    class RecordingTracker(GeneralTracker):
        name = "recording"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.logged: list[tuple[dict[str, Any], int | None, str]] = []

        @property
        def tracker(self):
            return self

        def log(self, values, step=None, **kwargs):
            self.logged.append((dict(values), step, threading.current_thread().name))

    return RecordingTracker


@pytest.mark.timeout(300)
def test_accelerate_with_tensorboard_mlflow_and_a_custom_tracker(tmp_path, monkeypatch) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    monkeypatch.chdir(tmp_path)
    tracking_uri = f"sqlite:///{tmp_path}/acc.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    custom = _recording_tracker_class()()
    try:
        accelerator = Accelerator(
            log_with=["tensorboard", "mlflow", custom], project_dir=str(tmp_path / "proj")
        )
        accelerator.init_trackers("acc_exp")
        writer = FanoutWriter.from_accelerator(accelerator)
        assert [type(s) for s in writer.sinks] == [TensorBoardSink, MLflowSink, TrackerSink]

        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        expected: dict[int, dict[str, float]] = {}
        for step in range(N_STEPS):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log(
                {"user/loss": float(loss.detach())}, step=step
            )  # the user's own logging
            writer.add_scalars(_our_values(step, loss), step)
            expected[step] = _expected(step, float(loss.detach()))
        writer.add_scalar("vitals/inf", torch.tensor(math.inf), N_STEPS)
        writer.close()
        tb_dir = accelerator.get_tracker("tensorboard").logging_dir
        run_id = accelerator.get_tracker("mlflow").active_run.info.run_id
        accelerator.end_training()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    got_tb = read_tensorboard(tb_dir)
    assert got_tb["user/loss"] == {
        s: float(np.float32(v["vitals/loss"])) for s, v in expected.items()
    }
    for key in _expected(0, 0.0):
        assert got_tb[key] == {s: float(np.float32(v[key])) for s, v in expected.items()}, key

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    mapped = {MLFLOW_KEYS.map(k): k for k in _expected(0, 0.0)}
    got_ml = read_mlflow(client, run_id, [*mapped, "user/loss"])
    for mkey, key in mapped.items():
        assert got_ml[mkey] == {s: v[key] for s, v in expected.items()}, key

    # the custom tracker got Python floats (Accelerate's trackers drop tensors), in order,
    # from the training thread
    ours = [
        (values, step, thread) for values, step, thread in custom.logged if "vitals/loss" in values
    ]
    assert [step for _, step, _ in ours] == list(range(N_STEPS))
    for values, step, thread in ours:
        assert values == expected[step] and all(type(v) is float for v in values.values())
        assert thread == threading.current_thread().name
    last = [values for values, step, _ in custom.logged if step == N_STEPS]
    assert last == [{"vitals/inf": math.inf}]


def test_from_accelerator_without_trackers_and_on_other_processes(tmp_path) -> None:
    with pytest.raises(ValueError, match="no trackers"):
        FanoutWriter.from_accelerator(SimpleNamespace(process_index=0, log_with=[], trackers=[]))
    with pytest.raises(ValueError, match="no trackers"):
        FanoutWriter.from_accelerator(SimpleNamespace(process_index=1, log_with=[], trackers=[]))
    with pytest.raises(ValueError, match="init_trackers"):
        FanoutWriter.from_accelerator(
            SimpleNamespace(process_index=0, log_with=["tensorboard"], trackers=[])
        )
    # another process: Accelerate starts no tracker there; the writer drops everything
    other = FanoutWriter.from_accelerator(
        SimpleNamespace(process_index=1, log_with=["tensorboard"], trackers=[])
    )
    assert other.rank == 1 and other.sinks == []
    other.close()
    acc = SimpleNamespace(process_index=0, log_with=[], trackers=[])
    with FanoutWriter.from_accelerator(acc, default_jsonl=tmp_path / "m.jsonl") as writer:
        writer.add_scalar("a", torch.tensor(2.0), 0)
    assert read_jsonl(tmp_path / "m.jsonl")[0]["metrics"] == {"a": 2.0}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("first", "every"), [(1, 1), (0, 1), (1, 3), (None, 1)])
def test_accelerate_wandb_keeps_every_step_whatever_the_loops_own_numbering(
    tmp_path, monkeypatch, first, every
) -> None:
    # The loop logs to the same W&B run with accelerator.log(..., step=completed_steps), as
    # Hugging Face's *_no_trainer scripts do (counting from 1; here also from 0, and every 3rd
    # step; first=None: accelerator.log without step=, W&B counting). W&B refuses a step below
    # the run's: counting from 1, a plain WandbSink lost every trainvitals step. Every step must arrive, at its own x-axis value, and none of the loop's
    # rows may be lost.
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import NormMonitor

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    steps = 7
    expected: dict[int, float] = {}
    loop_logged: dict[int, float] = {}
    try:
        accelerator = Accelerator(cpu=True, log_with="wandb")
        accelerator.init_trackers(
            "acc",
            init_kwargs={
                "wandb": {
                    "mode": "offline",
                    "dir": str(tmp_path),
                    "settings": {"console": "off", "x_disable_stats": True, "silent": True},
                }
            },
        )
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = accelerator.prepare(model, opt)
        vitals = Vitals([NormMonitor()], accelerator=accelerator, log_every_n_steps=1)
        writer = vitals.ctx.writer
        (sink,) = writer.sinks
        assert isinstance(sink, WandbSink) and sink.shared_step
        vitals.attach(model, opt)
        completed = first or 0
        for step in range(steps):
            x = torch.randn(8, 4)
            vitals.batch(x)  # hands the previous step over ...
            # ... which is delivered while this step runs (a real step takes long enough)
            deadline = time.monotonic() + 20
            while writer.status()["wandb"]["delivered"] < len(expected):
                assert time.monotonic() < deadline, f"step {step - 1} was not handed over"
                time.sleep(0.01)
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            squares = sum(float(p.grad.double().square().sum()) for p in model.parameters())
            expected[step] = math.sqrt(squares)
            opt.step()
            opt.zero_grad()
            if first == 1:
                completed += 1
            if completed % every == 0:
                loop_logged[completed] = float(loss.detach())
                at = {} if first is None else {"step": completed}
                accelerator.log({"loss": loop_logged[completed]}, **at)
            if first != 1:
                completed += 1
        vitals.close()
        assert writer.status()["wandb"]["missed"] == 0
        accelerator.end_training()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    rows = read_wandb_offline(tmp_path)
    key = "l2_norm/grad/global"
    got = {r["trainvitals/step"]: r[key] for r in rows if key in r}
    assert got == pytest.approx(expected, rel=1e-6)
    if first is None:  # W&B numbered the loop's rows: every value is there, in order
        assert [r["loss"] for r in rows if "loss" in r] == [*loop_logged.values()]
    else:
        assert {r["_step"]: r["loss"] for r in rows if "loss" in r} == pytest.approx(loop_logged)
    if first == 0 and every == 1:  # the loop's numbering is trainvitals': one row per step
        assert all(r["_step"] == r["trainvitals/step"] for r in rows if key in r)


def test_shared_wandb_sink_never_lets_two_steps_share_a_row(tmp_path) -> None:
    # A step the run has passed joins the open row; a later step whose row that is (nothing
    # logged in between) takes the next row instead of overwriting it. The rest of a step
    # joins its row while that row is open, else the open row: each part carries its step.
    run = offline_wandb_run(tmp_path, "tv")
    try:
        writer = FanoutWriter([WandbSink(run, shared_step=True)], rank=0, background=False)
        run.log({"loop": 1.0}, step=5)  # the loop is ahead
        writer.add_scalar("vitals/x", 2.0, 2)  # joins row 5
        writer.end_step()
        writer.add_scalar("vitals/y", 2.5, 2)  # the rest of step 2: row 5, still open
        writer.add_scalar("vitals/x", 3.0, 3)  # row 5 holds step 2: row 6
        writer.end_step()
        run.log({"loop": 2.0}, step=6)  # the loop's next row: joins step 3
        writer.add_scalar("vitals/x", 4.0, 4)  # row 6 holds step 3: row 7
        writer.add_scalar("vitals/x", 9.0, 9)  # the run has not reached 9: its own row
        writer.end_step()
        run.log({"loop": 3.0}, step=10)
        writer.add_scalar("vitals/y", 9.5, 9)  # the rest of step 9: row 9 is closed
        writer.close()
    finally:
        run.finish()
    rows = [r for r in read_wandb_offline(tmp_path) if "loop" in r or "trainvitals/step" in r]
    assert [
        (
            r["_step"],
            r.get("trainvitals/step"),
            r.get("vitals/x"),
            r.get("vitals/y"),
            r.get("loop"),
        )
        for r in rows
    ] == [
        (5, 2, 2.0, 2.5, 1.0),
        (6, 3, 3.0, None, 2.0),
        (7, 4, 4.0, None, None),
        (9, 9, 9.0, None, None),
        (10, 9, None, 9.5, 3.0),
    ]
    assert writer.status()["wandb"]["missed"] == 0
