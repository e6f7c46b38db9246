"""A real ``mlflow server`` on 127.0.0.1: written to over HTTP, stopped and restarted mid-run."""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch

from tests.adapters.conftest import RecordingSink, read_mlflow
from trainvitals.adapters import FanoutWriter, MLflowSink

FLOAT_MAX = 1.7976931348623157e308
KEYS = ["train/loss", "moe/layer_0/cv", "grad[norm]", "nan", "inf"]


def _values(step: int) -> dict[str, object]:
    return {
        "train/loss": torch.tensor(1.0 / (step + 1), dtype=torch.float64),
        "moe/layer_0/cv": 0.1 * step,
        "grad[norm]": torch.tensor(step, dtype=torch.int64),
        "nan": math.nan,
        "inf": torch.tensor(-math.inf if step % 2 else math.inf),
    }


def _expected(step: int) -> dict[str, float]:
    return {
        "train/loss": 1.0 / (step + 1),
        "moe/layer_0/cv": 0.1 * step,
        "grad_x5bnorm_x5d": float(step),  # MLflow refuses [ and ]: mapped
        "nan": math.nan,
        "inf": -FLOAT_MAX if step % 2 else FLOAT_MAX,  # MLflow's SQL store: +-Inf -> +-max
    }


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_server_stopped_and_restarted_mid_run_loses_no_step(mlflow_server) -> None:
    from mlflow import MlflowClient

    sink = MLflowSink(tracking_uri=mlflow_server.url, experiment_name="over-http")
    local = RecordingSink("local")
    writer = FanoutWriter(
        [sink, local],
        rank=0,
        max_failures=1000,  # outlive the restart
        retry_backoff=(0.2, 1.0),
        buffer_steps=100,
        close_timeout=120,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        # phase 1: server up
        for step in range(10):
            writer.add_scalars(_values(step), step)
        assert writer.flush(timeout=120) is True
        # phase 2: server down; training goes on, steps pile up in the sink's buffer
        mlflow_server.stop()
        for step in range(10, 20):
            writer.add_scalars(_values(step), step)
        writer.flush(timeout=30)
        assert _wait_until(lambda: writer.status()["mlflow"]["failures"] >= 2, 60)
        status = writer.status()["mlflow"]
        assert status["delivered"] == 10 and status["pending"] >= 9 and not status["disabled"]
        assert [s for s, _, _ in local.steps] == list(range(20))  # the other sink went on
        # phase 3: server back on the same port and store
        mlflow_server.start()
        for step in range(20, 30):
            writer.add_scalars(_values(step), step)
        writer.close()
    messages = [str(w.message) for w in record]
    failed = [m for m in messages if "sink 'mlflow' failed on step" in m]
    assert len(failed) == 1  # reported once, however many retries
    assert not [m for m in messages if "missed" in m or "'mlflow' disabled" in m]
    status = writer.status()["mlflow"]
    assert status["delivered"] == 30 and status["missed"] == 0

    # read back over HTTP
    client = MlflowClient(mlflow_server.url)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED"
    mapped = list(_expected(0))
    got = read_mlflow(client, sink.run_id, mapped)
    for key in mapped:
        assert sorted(got[key]) == list(range(30)), key
        for step in range(30):
            want = _expected(step)[key]
            assert got[key][step] == want or (math.isnan(want) and math.isnan(got[key][step]))
