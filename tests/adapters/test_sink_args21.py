"""Sink arguments MLflow or Comet would refuse at the first delivery are refused when the sink is
built, in the caller's thread (DESIGN: bad input is a clear TypeError/ValueError naming the
argument): an MLflowSink with ``experiment_name=3`` was retried until ``close()`` gave up after
its whole ``close_timeout`` (every step missed), a CometSink given ``offline_directory`` twice
failed each retry of its first step."""

from __future__ import annotations

import pytest

from trainvitals.adapters import CometSink, FanoutWriter, MLflowSink


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"experiment_name": 3}, "experiment_name"),
        ({"experiment_name": "  "}, "experiment_name"),
        ({"tags": "team=a"}, "tags"),
    ],
)
def test_mlflow_sink_refuses_arguments_mlflow_would_refuse(tmp_path, kwargs, named):
    with pytest.raises(TypeError, match=named):
        MLflowSink(run_dir=tmp_path, **kwargs)


def test_arguments_mlflow_takes_as_text_still_work(tmp_path):
    # a run_name or tag key of another type: MLflow stores its text, as it did before
    from mlflow.tracking import MlflowClient

    sink = MLflowSink(run_dir=tmp_path, run_name=3, tags=[(1, "a")])
    writer = FanoutWriter([sink])
    writer.add_scalar("loss", 0.25, 0)
    writer.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("trainvitals").experiment_id])
    assert run.info.run_name == "3" and run.data.tags["1"] == "a"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [0.25]


def test_mlflow_sink_with_good_arguments_still_writes_them(tmp_path):
    from mlflow.tracking import MlflowClient

    sink = MLflowSink(run_dir=tmp_path, experiment_name="exp", run_name="r", tags={"team": "a"})
    writer = FanoutWriter([sink])
    writer.add_scalar("loss", 0.5, 0)
    writer.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.data.tags["team"] == "a" and run.info.run_name == "r"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [0.5]


def test_comet_sink_refuses_experiment_kwargs_it_would_pass_twice(tmp_path):
    with pytest.raises(ValueError, match="offline_directory"):
        CometSink(offline_directory=tmp_path, experiment_kwargs={"offline_directory": tmp_path})
    with pytest.raises(TypeError, match="experiment_kwargs"):
        CometSink(offline_directory=tmp_path, experiment_kwargs=[("project_name", "p")])
    # with an experiment given they build nothing: not checked
    given = CometSink(_Experiment(), experiment_kwargs={"offline_directory": tmp_path})
    assert given.experiment is not None


class _Experiment:
    def log_metrics(self, *args, **kwargs):
        pass
