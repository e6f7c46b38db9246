"""MLflow / W&B / Comet sinks at the edges of their backends' rules."""

from __future__ import annotations

import pytest

from tests.adapters.conftest import free_port, read_mlflow
from trainvitals.adapters import FanoutWriter, MLflowSink


@pytest.mark.timeout(120)
def test_mlflow_async_logging_env_does_not_turn_a_failed_step_into_a_delivered_one(
    tmp_path, monkeypatch
) -> None:
    # MLflow's async logging (MLFLOW_ENABLE_ASYNC_LOGGING, also set by
    # mlflow.config.enable_async_logging) makes log_batch only queue the metrics: a step counted
    # as delivered could still be lost, and an error never reached the writer.
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_LOGGING", "true")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")

    # a server that is not there: nothing can be delivered
    down = MLflowSink(run_id="0" * 32, tracking_uri=f"http://127.0.0.1:{free_port()}")
    writer = FanoutWriter([down], rank=0, max_failures=1, close_timeout=30)
    with pytest.warns(RuntimeWarning, match="sink 'mlflow' failed on step 0"):
        writer.add_scalar("a", 1.0, 0)
        writer.close()
    status = writer.status()["mlflow"]
    assert status["delivered"] == 0 and status["missed"] == 1

    # a working store: every value is in it when close() returns
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("async")).info.run_id
    keys = [f"k{i}" for i in range(1001)]  # two chunks per step
    with FanoutWriter([MLflowSink(client, run_id)], rank=0) as writer:
        for step in range(2):
            writer.add_scalars({k: i / 7 + step for i, k in enumerate(keys)}, step)
    got = read_mlflow(MlflowClient(uri), run_id, [keys[0], keys[1000]])
    assert got == {k: {s: int(k[1:]) / 7 + s for s in range(2)} for k in (keys[0], keys[1000])}


@pytest.mark.parametrize("crash", [False, True])
def test_a_run_the_sink_created_ends_failed_after_an_exception(tmp_path, crash: bool) -> None:
    # MLflow's convention (and its UI filter): a run that ended with an exception is FAILED
    from mlflow.tracking import MlflowClient

    sink = MLflowSink(run_dir=tmp_path)
    try:
        with FanoutWriter([sink], rank=0) as writer:
            writer.add_scalar("loss", 1.0, 0)
            if crash:
                raise RuntimeError("the training loop raised")
    except RuntimeError:
        pass
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(sink.run_id)
    assert run.info.status == ("FAILED" if crash else "FINISHED")
    assert [m.value for m in client.get_metric_history(sink.run_id, "loss")] == [1.0]
