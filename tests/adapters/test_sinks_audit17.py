"""Audit of the TensorBoard, Comet and W&B sinks: what each backend really stored."""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path
from typing import Any

from tests.adapters.conftest import (
    QUIET_COMET,
    offline_wandb_run,
    read_comet_archive,
    read_wandb_offline,
)
from trainvitals.adapters import CometSink, FanoutWriter, WandbSink


def _comet_metric_messages(offline_directory: Path) -> list[dict[str, Any]]:
    """The payload of every metric message of the (single) offline archive."""
    (archive,) = offline_directory.glob("*.zip")
    with zipfile.ZipFile(archive) as z:
        lines = z.read("messages.json").decode().splitlines()
    return [
        json.loads(line)["payload"]
        for line in lines
        if json.loads(line).get("type") == "metric_msg"
    ]


def test_comet_metrics_keep_their_names_whatever_context_the_loop_is_in(tmp_path: Path) -> None:
    """A step reaches a shared experiment at the writer's next call after it reached the host
    (``thread_safe = False``), in whatever context the loop is in by then: the training steps
    handed over from inside ``experiment.validate()`` were tagged ``validate`` (Comet shows
    them as ``validate_<key>``), so one key could be split over several metrics."""
    import comet_ml

    experiment = comet_ml.OfflineExperiment(
        offline_directory=str(tmp_path / "comet"), **QUIET_COMET
    )
    writer = FanoutWriter([CometSink(experiment)], rank=0)
    with experiment.train():
        writer.add_scalars({"vitals/norm": 1.5, "moe/layer_0/cv": math.nan}, 0)
        writer.add_scalar("vitals/norm", 2.5, 1)  # step 0 is delivered at this call
    with experiment.validate():
        assert writer.flush()  # step 1 is delivered here, inside the validation context
        experiment.log_metric("loss", 0.25, step=1)  # the loop's own metric keeps its context
    writer.close()
    experiment.end()

    payloads = _comet_metric_messages(tmp_path / "comet")
    contexts = {
        (p["metric"]["metricName"], p["metric"]["step"]): p.get("context") for p in payloads
    }
    assert contexts == {
        ("vitals/norm", 0): None,
        ("moe/layer_0/cv", 0): None,
        ("vitals/norm", 1): None,
        ("loss", 1): "validate",
    }
    got = read_comet_archive(tmp_path / "comet")
    assert got["vitals/norm"] == {0: 1.5, 1: 2.5}
    assert math.isnan(got["moe/layer_0/cv"][0])


def test_steps_after_the_comet_experiment_ended_are_reported_missed(tmp_path: Path) -> None:
    """Comet drops what is logged to an ended experiment (``alive`` is False) without a word:
    the sink counted those steps as delivered."""
    import comet_ml

    experiment = comet_ml.OfflineExperiment(
        offline_directory=str(tmp_path / "comet"), **QUIET_COMET
    )
    writer = FanoutWriter([CometSink(experiment)], rank=0)
    for step in range(3):
        writer.add_scalar("vitals/norm", float(step), step)
    assert writer.flush()
    experiment.end()  # e.g. Lightning's CometLogger.finalize, before the writer's last steps
    for step in range(3, 5):
        writer.add_scalar("vitals/norm", float(step), step)
    writer.close()
    status = writer.status()["comet"]
    got = read_comet_archive(tmp_path / "comet")
    assert got["vitals/norm"] == {0: 0.0, 1: 1.0, 2: 2.0}  # what Comet stored
    assert status["delivered"] == len(got["vitals/norm"]) == 3
    assert status["missed"] == 2


def test_steps_after_the_wandb_run_finished_are_missed_without_stalling_close(
    tmp_path: Path,
) -> None:
    """``run.finish()`` before the writer's last steps (Accelerate's ``end_training()`` before
    the writer closes): each write read ``run.step``, which waits 30 s on a finished run, then
    failed with W&B's ``UsageError`` and was retried, so ``close()`` ran into its timeout."""
    writer = FanoutWriter([WandbSink(offline_wandb_run(tmp_path))], rank=0, close_timeout=20)
    run = writer.sinks[0].run
    for step in range(3):
        writer.add_scalar("vitals/norm", float(step), step)
    assert writer.flush()
    run.finish()
    for step in range(3, 5):
        writer.add_scalar("vitals/norm", float(step), step)
    writer.close()
    status = writer.status()["wandb"]
    rows = read_wandb_offline(tmp_path)
    assert [(r["_step"], r["vitals/norm"]) for r in rows] == [(s, float(s)) for s in range(3)]
    assert status["delivered"] == 3
    assert status["missed"] == 2  # refused at once: nothing left pending or hung at close
    assert status["pending"] == 0
    assert not status["hung"]
    assert status["failures"] == 0
