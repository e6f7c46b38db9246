"""Audit 21 of the sinks behind the fan-out writer: keys no backend can encode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.adapters.conftest import read_tensorboard
from trainvitals.adapters import (
    FanoutWriter,
    JsonlSink,
    MLflowSink,
    TensorBoardSink,
    metric_history,
    read_jsonl,
)


def test_a_key_without_utf8_form_is_refused_before_it_switches_a_sink_off(tmp_path: Path) -> None:
    # "\udcff" is what os.fsdecode makes of a byte that is not UTF-8: TensorBoard's protobuf
    # raised UnicodeEncodeError for it at every retry of its step, so the sink was switched
    # off and every later value of the run was lost there (W&B the same).
    writer = FanoutWriter(
        [TensorBoardSink(tmp_path / "tb"), JsonlSink(tmp_path / "m.jsonl")],
        rank=0,
        retry_backoff=(0.01, 0.02),
        close_timeout=30,
    )
    bad = "run/\udcff"
    expected: dict[str, dict[int, float]] = {"ok": {}, "temp/°C": {}}
    for step in range(5):
        writer.add_scalar("ok", float(step) + 0.5, step)
        writer.add_scalar("temp/°C", -float(step), step)  # valid non-ASCII: still taken
        expected["ok"][step] = float(step) + 0.5
        expected["temp/°C"][step] = -float(step)
        if step == 1:
            with pytest.raises(ValueError, match="surrogate"):
                writer.add_scalar(bad, 1.0, step)
            with pytest.raises(ValueError, match="surrogate"):
                writer.add_scalars({"also_ok": 2.0, bad: 1.0}, step)  # nothing of it logged
            with pytest.raises(ValueError, match="surrogate"):
                writer.add_scalars("\udcff", {"a": 1.0}, step)  # a main_tag alike
    writer.close()

    status = writer.status()
    assert all(s["delivered"] == 5 and s["missed"] == 0 for s in status.values()), status
    # read back by TensorBoard itself: every step of both keys, nothing else
    assert read_tensorboard(tmp_path / "tb") == expected
    records = read_jsonl(tmp_path / "m.jsonl")
    for key, per_step in expected.items():
        assert dict(metric_history(records, key)) == per_step
    assert all(set(r["metrics"]) == set(expected) for r in records)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """One SQLite MLflow store for this file's tests (making one takes seconds)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    return uri, MlflowClient(tracking_uri=uri)


def test_mlflow_sink_on_a_deleted_experiment_is_disabled_at_once(tmp_path: Path, store) -> None:
    # MLflow refuses a run in a deleted experiment at every retry: the sink was retried until
    # close() gave up after its whole close_timeout (60 s by default), at the end of every run
    # logging to an experiment someone had deleted in the UI.
    uri, client = store
    client.delete_experiment(client.create_experiment("trainvitals"))
    writer = FanoutWriter(
        [MLflowSink(tracking_uri=uri), JsonlSink(tmp_path / "m.jsonl")], rank=0, close_timeout=3
    )
    with pytest.warns(RuntimeWarning) as caught:
        for step in range(20):
            writer.add_scalar("loss", 1.0 / (step + 1), step)
        writer.close()

    status = writer.status()
    assert status["mlflow"]["disabled"] and status["mlflow"]["failures"] == 1, status
    assert status["mlflow"]["missed"] == 20 and status["mlflow"]["pending"] == 0
    assert any("'trainvitals'" in str(w.message) and "deleted" in str(w.message) for w in caught)
    # the other sink got every value; the deleted experiment got no run
    history = dict(metric_history(read_jsonl(tmp_path / "m.jsonl"), "loss"))
    assert history == {step: 1.0 / (step + 1) for step in range(20)}
    experiment = client.get_experiment_by_name("trainvitals")
    assert experiment.lifecycle_stage == "deleted"
    assert client.search_runs([experiment.experiment_id], run_view_type=3) == []


def test_mlflow_sink_on_a_run_deleted_meanwhile_is_disabled_at_once(tmp_path: Path, store) -> None:
    # a run deleted in the UI while training logs to it: MLflow refuses every later log_batch,
    # which was retried until close() gave up after its whole close_timeout
    _, client = store
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    writer = FanoutWriter(
        [MLflowSink(client, run_id), JsonlSink(tmp_path / "m.jsonl")], rank=0, close_timeout=3
    )
    for step in range(5):
        writer.add_scalar("loss", 2.0**-step, step)
    assert writer.flush()
    client.delete_run(run_id)
    with pytest.warns(RuntimeWarning) as caught:
        for step in range(5, 10):
            writer.add_scalar("loss", 2.0**-step, step)
        writer.close()

    status = writer.status()["mlflow"]
    assert status["disabled"] and status["failures"] == 1, status
    assert (status["delivered"], status["missed"], status["pending"]) == (5, 5, 0)
    assert any(run_id in str(w.message) and "deleted" in str(w.message) for w in caught)
    stored = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert stored == {step: 2.0**-step for step in range(5)}
    history = dict(metric_history(read_jsonl(tmp_path / "m.jsonl"), "loss"))
    assert history == {step: 2.0**-step for step in range(10)}
