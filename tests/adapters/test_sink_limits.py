"""MLflow / W&B / Comet sinks at the edges of their backends' rules."""

from __future__ import annotations

import pytest

from tests.adapters.conftest import (
    _wandb_records,
    free_port,
    offline_wandb_run,
    read_mlflow,
    read_wandb_offline,
)
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


def _wandb_declared(wandb_dir) -> dict[str, str]:
    """name (or glob) -> step metric of every define_metric record in the offline run file."""
    import glob
    import os

    from wandb.proto import wandb_internal_pb2 as pb

    pattern = os.path.join(wandb_dir, "**", "offline-run-*", "run-*.wandb")
    (path,) = glob.glob(pattern, recursive=True)
    declared = {}
    for raw in _wandb_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "metric":
            declared[rec.metric.name or rec.metric.glob_name] = rec.metric.step_metric
    return declared


@pytest.mark.timeout(120)
def test_shared_wandb_sink_takes_keys_with_a_star_and_declares_each_one(tmp_path) -> None:
    # WandbSink(shared_step=True) (Accelerate's wandb tracker) declares every key's x-axis with
    # run.define_metric(key, ...), which raises for "*" inside a name: every step failed and
    # the sink was switched off after 10 tries, losing every key of every step; a trailing "*"
    # is a glob there, which would declare the loop's own keys starting alike as trainvitals'.
    from trainvitals.adapters import WandbSink, unmap_key

    keys = ["loss", "attn*scale", "grad/norm*", "_step"]
    run = offline_wandb_run(tmp_path, "tv")
    try:
        writer = FanoutWriter(
            [WandbSink(run, shared_step=True)], rank=0, max_failures=2, retry_backoff=(0.01, 0.01)
        )
        for step in range(4):
            writer.add_scalars({k: i + step / 8 for i, k in enumerate(keys)}, step)
            writer.end_step()
            run.log({"grad/norm_of_the_loop": 1.0}, step=step + 1)  # the loop's own key
        writer.close()
    finally:
        run.finish()
    status = writer.status()["wandb"]
    assert (status["delivered"], status["missed"], status["failures"]) == (4, 0, 0)
    mapped = {"loss": "loss", "attn*scale": "attn_x2ascale", "grad/norm*": "grad/norm_x2a"}
    mapped["_step"] = "_x5fstep"
    assert all(unmap_key(m) == k for k, m in mapped.items())
    got: dict[str, dict[int, float]] = {}
    for row in read_wandb_offline(tmp_path):
        if "trainvitals/step" in row:
            for k in mapped.values():
                if k in row:
                    got.setdefault(k, {})[row["trainvitals/step"]] = row[k]
    assert got == {mapped[k]: {s: i + s / 8 for s in range(4)} for i, k in enumerate(keys)}
    declared = _wandb_declared(tmp_path)
    assert {k: declared.get(k) for k in mapped.values()} == dict.fromkeys(
        mapped.values(), "trainvitals/step"
    )
    assert not any("*" in name for name in declared)  # no glob over the loop's keys


def _wandb_summary(wandb_dir) -> dict[tuple[str, ...], object]:
    """The run's last summary: path (W&B's nested_key) -> JSON-decoded value."""
    import glob
    import json
    import os

    from wandb.proto import wandb_internal_pb2 as pb

    pattern = os.path.join(wandb_dir, "**", "offline-run-*", "run-*.wandb")
    (path,) = glob.glob(pattern, recursive=True)
    summary: dict[tuple[str, ...], object] = {}
    for raw in _wandb_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "summary":
            for item in rec.summary.update:
                key = tuple(item.nested_key) or (item.key,)
                summary[key] = json.loads(item.value_json)
    return summary


@pytest.mark.timeout(120)
def test_shared_wandb_sink_declares_dotted_keys_under_the_name_wandb_reads_as_that_key(
    tmp_path, monkeypatch
) -> None:
    # W&B reads a define_metric name as a path: "a.b" is the nested key a -> b (log({"a":
    # {"b": v}})), "a\.b" the flat key "a.b". The sink declared the per-tensor keys
    # (l2_norm/grad/model.layers.0.weight) unescaped, so their x-axis was declared for a key
    # nobody logs. W&B's own reading is the judge here: each declaration the sink makes also
    # asks for summary="max", which wandb-core applies to the key it reads the name as.
    # A "\" is escaped in the logged key (WANDB_SHARED_KEYS): wandb-core has no name for a key
    # with an odd run of "\" before a "." or at its end ("odd\" would be read as "odd").
    from trainvitals.adapters import WandbSink, unmap_key

    keys = [
        "loss",
        "l2_norm/grad/model.layers.0.weight",
        "tensor_stats/grad/model.layers.0.mlp.up_proj.weight/mean",
        "a\\b.c",
        "two\\\\.x",
        "odd\\",
    ]
    logged = dict(zip(keys, keys, strict=True))
    logged |= {"a\\b.c": "a_x5cb.c", "two\\\\.x": "two_x5c_x5c.x", "odd\\": "odd_x5c"}
    assert all(unmap_key(name) == k for k, name in logged.items())
    run = offline_wandb_run(tmp_path, "tv")
    declare = run.define_metric
    monkeypatch.setattr(run, "define_metric", lambda *a, **kw: declare(*a, **kw, summary="max"))
    values = {k: {s: (i + 1) * (3 - s) for s in range(3)} for i, k in enumerate(keys)}  # max at 0
    try:
        writer = FanoutWriter([WandbSink(run, shared_step=True)], rank=0)
        for step in range(3):
            writer.add_scalars({k: values[k][step] for k in keys}, step)
            writer.end_step()
            run.log({"odd": 7.0 - step}, step=step + 1)  # the loop's own key
        writer.close()
    finally:
        run.finish()
    status = writer.status()["wandb"]
    assert (status["delivered"], status["missed"], status["failures"]) == (3, 0, 0)
    rows = [r for r in read_wandb_offline(tmp_path) if "trainvitals/step" in r]
    got = {k: {r["trainvitals/step"]: r[n] for r in rows if n in r} for k, n in logged.items()}
    assert got == values
    summary = _wandb_summary(tmp_path)
    declared = _wandb_declared(tmp_path)
    assert {k: summary.get((n,)) for k, n in logged.items()} == {
        k: {"max": values[k][0]} for k in keys
    }
    assert summary.get(("odd",)) == 5.0  # the loop's key was not declared as trainvitals' one
    assert list(declared.values()) == ["trainvitals/step"] * len(keys)  # each with the axis
