"""The writer under SummaryWriter's argument names, W&B keys with backslashes, and an MLflow
run continued by a resumed job."""

from __future__ import annotations

import glob
import inspect
import json
import os
from typing import Any

import pytest

from tests.adapters.conftest import _wandb_records, offline_wandb_run, read_wandb_offline
from trainvitals.adapters import FanoutWriter, JsonlSink, MLflowSink, WandbSink, read_jsonl
from trainvitals.adapters.sinks.base import unmap_key

# ---------------------------------------------------------------------------------------------
# add_scalar / add_scalars take torch.utils.tensorboard.SummaryWriter's argument names

# (args, kwargs) of calls valid for SummaryWriter.add_scalar, and the (step, key, value,
# walltime or None) each must log
_SCALAR_CALLS: list[tuple[tuple[Any, ...], dict[str, Any], tuple[int, str, float, float | None]]]
_SCALAR_CALLS = [
    ((), {"tag": "a", "scalar_value": 1.5, "global_step": 0}, (0, "a", 1.5, None)),
    (("b", 2.5), {"global_step": 1, "walltime": 1000.0}, (1, "b", 2.5, 1000.0)),
    (("c", 3.5, 2, 1001.0, True, True), {}, (2, "c", 3.5, 1001.0)),  # all positional
    (
        ("d",),
        {"scalar_value": 4.5, "global_step": 3, "new_style": True, "double_precision": True},
        (3, "d", 4.5, None),
    ),
]
_SCALARS_CALLS: list[tuple[tuple[Any, ...], dict[str, Any], tuple[int, str, float, float | None]]]
_SCALARS_CALLS = [
    ((), {"main_tag": "m", "tag_scalar_dict": {"x": 5.5}, "global_step": 4}, (4, "m/x", 5.5, None)),
    (
        ("m",),
        {"tag_scalar_dict": {"x": 6.5}, "global_step": 5, "walltime": 1002.0},
        (5, "m/x", 6.5, 1002.0),
    ),
    (("m", {"x": 7.5}, 6, 1003.0), {}, (6, "m/x", 7.5, 1003.0)),  # all positional
]


def test_summary_writer_parameter_names_are_all_accepted() -> None:
    # users swap a SummaryWriter for a FanoutWriter: every argument name of its add_scalar /
    # add_scalars must exist on ours (the behaviour is checked below)
    from torch.utils.tensorboard import SummaryWriter

    for method in ("add_scalar", "add_scalars"):
        theirs = list(inspect.signature(getattr(SummaryWriter, method)).parameters)[1:]
        ours = set(inspect.signature(getattr(FanoutWriter, method)).parameters)
        assert set(theirs) <= ours, (method, set(theirs) - ours)


def test_summary_writer_calls_log_the_same_values(tmp_path) -> None:
    # Each call is first made on a real SummaryWriter (so it is a valid call there), then on
    # the writer, whose JSONL must hold the value at the step, key and walltime given.
    from torch.utils.tensorboard import SummaryWriter

    tb = SummaryWriter(str(tmp_path / "tb"))
    writer = FanoutWriter([JsonlSink(tmp_path / "m.jsonl")], rank=0, background=False)
    for args, kwargs, _ in _SCALAR_CALLS:
        tb.add_scalar(*args, **kwargs)
        writer.add_scalar(*args, **kwargs)
    for args, kwargs, _ in _SCALARS_CALLS:
        tb.add_scalars(*args, **kwargs)
        writer.add_scalars(*args, **kwargs)
    tb.close()
    writer.close()
    got = {
        (r["step"], k): (v, r["time"])
        for r in read_jsonl(tmp_path / "m.jsonl")
        for k, v in r["metrics"].items()
    }
    expected = [e for _, _, e in _SCALAR_CALLS + _SCALARS_CALLS]
    assert sorted(got) == sorted((step, key) for step, key, _, _ in expected)
    for step, key, value, walltime in expected:
        assert got[step, key][0] == value
        if walltime is not None:
            assert got[step, key][1] == walltime


def test_our_own_names_still_work_and_two_names_of_one_argument_raise(tmp_path) -> None:
    writer = FanoutWriter([JsonlSink(tmp_path / "m.jsonl")], rank=0, background=False)
    writer.add_scalar(name="n", value=1.0, step=0)
    writer.add_scalar("g", 2.0, global_step=1)
    writer.add_scalars(mapping={"k": 3.0}, step=2)
    writer.add_scalars({"k": 4.0}, global_step=3)
    with pytest.raises(TypeError, match="both name= and tag="):
        writer.add_scalar("a", 1.0, 4, tag="b")
    with pytest.raises(TypeError, match="both value= and scalar_value="):
        writer.add_scalar("a", 1.0, 4, scalar_value=2.0)
    with pytest.raises(TypeError, match="needs a value"):
        writer.add_scalar("a", global_step=4)
    with pytest.raises(TypeError, match="main_tag= and a first positional"):
        writer.add_scalars({"k": 1.0}, main_tag="m", global_step=4)
    with pytest.raises(TypeError, match="tag_scalar_dict= and a second positional"):
        writer.add_scalars("m", {"k": 1.0}, 4, tag_scalar_dict={"k": 1.0})
    writer.close()
    got = [(r["step"], r["metrics"]) for r in read_jsonl(tmp_path / "m.jsonl")]
    assert got == [(0, {"n": 1.0}), (1, {"g": 2.0}), (2, {"k": 3.0}), (3, {"k": 4.0})]


# ---------------------------------------------------------------------------------------------
# W&B (shared step): every logged key gets its x-axis, also with "\" in it


def _wandb_summary(wandb_dir) -> dict[tuple[str, ...], object]:
    """The run's last summary: path (W&B's nested_key) -> JSON-decoded value."""
    from wandb.proto import wandb_internal_pb2 as pb

    pattern = os.path.join(wandb_dir, "**", "offline-run-*", "run-*.wandb")
    (path,) = glob.glob(pattern, recursive=True)
    summary: dict[tuple[str, ...], object] = {}
    for raw in _wandb_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "summary":
            for item in rec.summary.update:
                summary[tuple(item.nested_key) or (item.key,)] = json.loads(item.value_json)
    return summary


@pytest.mark.timeout(120)
def test_shared_wandb_sink_declares_every_key_it_logs_also_with_backslashes(
    tmp_path, monkeypatch
) -> None:
    # wandb-core reads "\" in a define_metric name as an escape and has no name for a key
    # with an odd run of "\" before a "." or at its end: such keys were logged without their
    # x-axis. W&B's own reading is the judge: each declaration also asks for summary="max",
    # which wandb-core applies to the key it reads the name as.
    keys = ["a\\.b", "odd\\", "x\\\\\\.y", "two\\\\.x", "a\\b.c", "plain.k"]
    run = offline_wandb_run(tmp_path, "tv")
    declare = run.define_metric
    monkeypatch.setattr(run, "define_metric", lambda *a, **kw: declare(*a, **kw, summary="max"))
    values = {k: {s: (i + 1) * (3 - s) for s in range(3)} for i, k in enumerate(keys)}
    try:
        writer = FanoutWriter([WandbSink(run, shared_step=True)], rank=0)
        for step in range(3):
            writer.add_scalars({k: values[k][step] for k in keys}, step)
            writer.end_step()
            run.log({"odd": 7.0 - step, "a": 9.0}, step=step + 1)  # the loop's own keys
        writer.close()
    finally:
        run.finish()
    status = writer.status()["wandb"]
    assert (status["delivered"], status["missed"], status["failures"]) == (3, 0, 0)
    rows = [r for r in read_wandb_offline(tmp_path) if "trainvitals/step" in r]
    own = {"trainvitals/step", "_step", "_runtime", "_timestamp", "odd", "a"}  # W&B's, the loop's
    logged = {k for r in rows for k in r} - own
    by_key = {unmap_key(name): name for name in logged}
    assert set(by_key) == set(keys)  # every key logged once, under a name that decodes to it
    for k in keys:
        assert {r["trainvitals/step"]: r[by_key[k]] for r in rows if by_key[k] in r} == values[k]
    summary = _wandb_summary(tmp_path)
    # every logged key declared: W&B kept the max of its values (at step 0) as its summary
    assert {k: summary.get((by_key[k],)) for k in keys} == {
        k: {"max": max(values[k].values())} for k in keys
    }
    assert summary.get(("odd",)) == 5.0  # the loop's keys were not declared as ours
    assert summary.get(("a",)) == 9.0


def test_shared_wandb_sink_refuses_a_step_metric_wandb_cannot_name() -> None:
    class _Run:
        def log(self, *a: Any, **kw: Any) -> None:
            pass

    with pytest.raises(ValueError, match="step_metric 'my\\\\\\\\step\\\\\\\\'"):
        WandbSink(_Run(), shared_step=True, step_metric="my\\step\\")
    WandbSink(_Run(), shared_step=True, step_metric="my\\\\step")  # an even run is a name


# ---------------------------------------------------------------------------------------------
# MLflow: a job resuming in the same run_dir continues its run


def _mlflow_runs(run_dir, experiment: str) -> dict[str, Any]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    return {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}


def _history(run_dir, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _session(
    run_dir, steps: range, *, resume_at: int | None, failed: bool = False, **sink_kw: Any
) -> MLflowSink:
    sink = MLflowSink(run_dir=run_dir, experiment_name="resume", **sink_kw)
    writer = FanoutWriter([sink], rank=0)
    if resume_at is not None:
        writer.resume_at(resume_at)
    for step in steps:
        writer.add_scalars({"loss": 1.0 / (step + 1), "lr": step * 0.5}, step)
    writer.close(failed=failed)
    return sink


@pytest.mark.timeout(120)
@pytest.mark.parametrize("told", [True, False], ids=["resume_at", "first-step"])
@pytest.mark.parametrize("first_ended", ["finished", "failed"])
def test_a_resumed_job_continues_the_mlflow_run_of_its_run_dir(
    tmp_path, told: bool, first_ended: str
) -> None:
    # A job writes steps 0..4 and ends (or fails), the job resuming from the checkpoint of
    # step 5 writes steps 5..11: one MLflow run holding every step once, ended FINISHED.
    first = _session(
        tmp_path, range(5), resume_at=0 if told else None, failed=first_ended == "failed"
    )
    runs = _mlflow_runs(tmp_path, "resume")
    assert runs[first.run_id].info.status == ("FAILED" if first_ended == "failed" else "FINISHED")
    second = _session(tmp_path, range(5, 12), resume_at=5 if told else None)
    assert second.run_id == first.run_id
    runs = _mlflow_runs(tmp_path, "resume")
    assert list(runs) == [first.run_id]
    assert runs[first.run_id].info.status == "FINISHED"
    written = range(12)
    assert _history(tmp_path, first.run_id, "loss") == [(s, 1.0 / (s + 1)) for s in written]
    assert _history(tmp_path, first.run_id, "lr") == [(s, s * 0.5) for s in written]


@pytest.mark.timeout(120)
def test_mlflow_run_dir_gets_a_new_run_when_asked_or_when_the_run_starts_anew(tmp_path) -> None:
    first = _session(tmp_path, range(3), resume_at=None)
    # resume=False: a new run although the job resumes
    fresh = _session(tmp_path, range(3, 6), resume_at=3, resume=False)
    # a run starting at step 0 is a new run (as the JSONL file moves the old one aside)
    restart = _session(tmp_path, range(2), resume_at=0)
    # it is the run recorded now: a resume continues it
    resumed = _session(tmp_path, range(2, 4), resume_at=2)
    assert len({first.run_id, fresh.run_id, restart.run_id}) == 3
    assert resumed.run_id == restart.run_id
    assert set(_mlflow_runs(tmp_path, "resume")) == {first.run_id, fresh.run_id, restart.run_id}
    assert [s for s, _ in _history(tmp_path, first.run_id, "loss")] == [0, 1, 2]
    assert [s for s, _ in _history(tmp_path, fresh.run_id, "loss")] == [3, 4, 5]
    assert [s for s, _ in _history(tmp_path, restart.run_id, "loss")] == [0, 1, 2, 3]


@pytest.mark.timeout(120)
def test_mlflow_resume_creates_a_run_when_the_recorded_one_is_gone(tmp_path) -> None:
    from mlflow import MlflowClient

    first = _session(tmp_path, range(3), resume_at=0)
    MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").delete_run(first.run_id)
    second = _session(tmp_path, range(3, 5), resume_at=3)
    assert second.run_id != first.run_id
    # the new run is the one recorded now: the next resume continues it
    third = _session(tmp_path, range(5, 7), resume_at=5)
    assert third.run_id == second.run_id
    assert [s for s, _ in _history(tmp_path, second.run_id, "loss")] == [3, 4, 5, 6]
    # another experiment: not the recorded run's
    other = MLflowSink(run_dir=tmp_path, experiment_name="other")
    with FanoutWriter([other], rank=0) as writer:
        writer.resume_at(7)
        writer.add_scalar("loss", 1.0, 7)
    assert other.run_id not in (first.run_id, second.run_id)
