"""Audit 19 of the writer's sinks against the real backends, read back with their own readers.

* A sink already disabled when the writer closes, whose backend then also fails to close (an
  MLflow store that refused the steps refuses ``set_terminated`` too), gave a third warning for
  the one failure ("closing sink 'mlflow' failed"): now the failure warning and the summary
  only, the summary naming the close error.
* A step above 2**63 - 1 (what TensorBoard, MLflow and W&B store steps as) failed at every
  retry in those backends ("Value out of range", "Python int too large to convert to SQLite
  INTEGER"), had the sink disabled after ``max_failures`` and ``close()`` wait on its backoff:
  now refused (one warning, counted as missed) while JSONL keeps it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tests.adapters.conftest import (
    RecordingSink,
    offline_wandb_run,
    read_tensorboard,
    read_wandb_offline,
)
from trainvitals.adapters import (
    FanoutWriter,
    JsonlSink,
    MLflowSink,
    TensorBoardSink,
    WandbSink,
    read_jsonl,
)

pytest.importorskip("mlflow")


def _ours(record: list[warnings.WarningMessage], sink: str) -> list[str]:
    return [
        str(w.message)
        for w in record
        if issubclass(w.category, RuntimeWarning) and f"sink {sink!r}" in str(w.message)
    ]


def test_disabled_mlflow_sink_that_cannot_close_gives_one_failure_warning_and_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MLflow's file store: the run's meta.yaml replaced by a folder after the first step makes
    # log_batch fail with EISDIR (the sink is disabled at once) and set_terminated too
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    sink = MLflowSink(tracking_uri=store.as_uri())
    good = RecordingSink("good")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        writer = FanoutWriter([sink, good], rank=0, max_failures=3, retry_backoff=(0.01, 0.01))
        writer.add_scalar("loss", 0.5, 0)
        assert writer.flush()
        (meta,) = store.glob("*/*/meta.yaml")
        meta.unlink()
        meta.mkdir()
        writer.add_scalar("loss", 0.25, 1)
        writer.add_scalar("loss", 0.125, 2)
        writer.close()
    status = writer.status()["mlflow"]
    assert status["disabled"] and status["delivered"] == 1 and status["missed"] == 2, status
    assert [(s, m) for s, m, _ in good.steps] == [
        (0, {"loss": 0.5}),
        (1, {"loss": 0.25}),
        (2, {"loss": 0.125}),
    ]
    msgs = _ours(record, "mlflow")
    # before the fix: [cannot work, closing sink 'mlflow' failed, closed: missed 2 of 3]
    assert len(msgs) == 2, msgs
    assert "cannot work: IsADirectoryError" in msgs[0] and "failed on step 1" in msgs[0]
    assert "closed: sink 'mlflow' missed 2 of 3 steps" in msgs[1], msgs[1]
    assert "closing sink 'mlflow' failed too: IsADirectoryError" in msgs[1], msgs[1]
    assert str(meta) in msgs[1]


def test_a_healthy_sink_whose_close_fails_still_warns(tmp_path: Path) -> None:
    class BadClose(RecordingSink):
        def close(self) -> None:
            raise RuntimeError("cannot end the run")

    sink = BadClose("badclose")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        writer = FanoutWriter([sink], rank=0)
        writer.add_scalar("loss", 1.0, 0)
        writer.close()
    msgs = _ours(record, "badclose")
    assert len(msgs) == 1 and "closing sink 'badclose' failed" in msgs[0], msgs
    assert "cannot end the run" in msgs[0]


INT64_MAX = 2**63 - 1
STEPS = [0, 2**31, 2**53 + 1, INT64_MAX, INT64_MAX + 1, 2**64 + 5]


def test_steps_beyond_int64_are_refused_once_by_the_backends_that_store_int64(
    tmp_path: Path,
) -> None:
    from mlflow import MlflowClient

    run = offline_wandb_run(tmp_path / "wandb", "audit19")
    sinks = [
        TensorBoardSink(tmp_path / "tb"),
        MLflowSink(run_dir=tmp_path / "mlflow"),
        WandbSink(run, owned=True),
        JsonlSink(tmp_path / "metrics.jsonl"),
    ]
    # (step % 1000) / 8 is exact in float32 and float64
    value = {s: (s % 1000) / 8 for s in STEPS}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        writer = FanoutWriter(sinks, rank=0, max_failures=2, retry_backoff=(0.01, 0.01))
        for step in STEPS:
            writer.add_scalar("v", value[step], step)
        writer.close()
    status = writer.status()
    fits = [s for s in STEPS if s <= INT64_MAX]
    for name in ("tensorboard", "mlflow", "wandb"):
        st = status[name]
        # before the fix: failures=2, disabled=True, last_error "Value out of range" / "Python
        # int too large to convert to SQLite INTEGER"
        assert (st["delivered"], st["missed"], st["failures"], st["disabled"]) == (
            len(fits),
            2,
            0,
            False,
        ), (name, st)
        msgs = _ours(record, name)
        assert len(msgs) == 2, (name, msgs)
        assert f"refused step {INT64_MAX + 1}" in msgs[0] and "64-bit" in msgs[0], msgs[0]
        assert "missed 2 of 6 steps (2 refused by the backend)" in msgs[1], msgs[1]
    assert status["jsonl"]["delivered"] == len(STEPS)

    expected = {s: value[s] for s in fits}
    assert read_tensorboard(tmp_path / "tb") == {"v": expected}
    client = MlflowClient(tracking_uri=sinks[1].tracking_uri)
    got = {m.step: m.value for m in client.get_metric_history(sinks[1].run_id, "v")}
    assert got == expected
    rows = read_wandb_offline(tmp_path / "wandb")
    assert {r["_step"]: r["v"] for r in rows if "v" in r} == expected
    assert [(r["step"], r["metrics"]["v"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (s, value[s]) for s in STEPS
    ]
