"""The shipped examples run end to end and log what they promise (short runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainvitals.adapters.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_demo_logs_to_every_backend(tmp_path):
    out = _run("demo.py", "--run-dir", str(tmp_path), "--steps", "6", "--log-every", "3")
    assert str(tmp_path / "metrics.jsonl") in out

    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    logged = {k for r in records if r["step"] == 3 for k in r["metrics"]}
    for prefix in ("train/loss", "moe/", "l2_norm/", "memory/", "throughput/", "time/"):
        assert any(k.startswith(prefix) for k in logged), prefix
    assert (tmp_path / "tensor_stats.jsonl").stat().st_size > 0
    report = (tmp_path / "report.html").read_text()
    assert str(tmp_path / "report.html") in out
    assert 'data-key="train/loss"' in report and 'data-kind="grad"' in report

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("trainvitals-demo")
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    by_step = {r["step"]: r["metrics"]["train/loss"] for r in records}
    assert {m.step: m.value for m in history} == pytest.approx(by_step)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (tmp_path / "tensorboard").rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("train/loss")] == list(range(6))


def test_accelerate_example(tmp_path):
    pytest.importorskip("accelerate")
    _run("accelerate_moe.py", "--run-dir", str(tmp_path), "--steps", "4", "--log-every", "2")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = tmp_path.rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("l2_norm/grad/global")] == [0, 2]
    assert "moe/cv_mean" in accumulator.Tags()["scalars"]
    report = (tmp_path / "report.html").read_text()  # its scalars from the event file
    assert 'data-key="l2_norm/grad/global"' in report and "TensorBoard event file" in report


def test_lightning_example(tmp_path):
    pytest.importorskip("lightning")
    out = _run("lightning_moe.py", "--run-dir", str(tmp_path), "--steps", "4", "--log-every", "2")
    (stats,) = tmp_path.rglob("tensor_stats.jsonl")
    report = stats.parent / "report.html"  # the TensorBoard logger's version folder
    assert str(report) in out
    text = report.read_text()
    assert 'data-key="l2_norm/grad/global"' in text and 'data-kind="grad"' in text
