"""Audit 19 of the writer and its sinks: permanent errors that backends wrap.

A real local MLflow store that cannot be written was retried as a transient failure: MLflow
wraps the ``OSError`` (its file store raises an ``MlflowException`` while handling the
``PermissionError``; its SQLite store reports sqlalchemy's ``OperationalError`` "attempt to write
a readonly database"), and a folder that cannot hold the database held every write for MLflow's
own 101 s of retries. Such a sink is now disabled at once, with one warning naming the path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from tests.adapters.conftest import RecordingSink
from trainvitals.adapters import FanoutWriter, MLflowSink

pytest.importorskip("mlflow")

STEPS = 3


def _run(sink: MLflowSink, tmp_path: Path, mid_run=None) -> tuple[FanoutWriter, list[str]]:
    good = RecordingSink("good")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        # max_failures=3 and a short backoff: before the fix the sink failed three times
        writer = FanoutWriter(
            [sink, good], rank=0, max_failures=3, retry_backoff=(0.01, 0.01), close_timeout=60
        )
        for step in range(STEPS):
            writer.add_scalar("loss", 0.25 * step, step)
            if step == 0 and mid_run is not None:
                assert writer.flush()
                mid_run()
        writer.close()
    # the other sink got every step, with its value
    assert [(s, m) for s, m, _ in good.steps] == [(s, {"loss": 0.25 * s}) for s in range(STEPS)]
    msgs = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    return writer, [m for m in msgs if "'mlflow'" in m]


def test_sqlite_store_under_a_regular_file_is_disabled_at_once(tmp_path: Path) -> None:
    # MLflow makes the database's folder with pathlib (exist_ok): a regular file there raised
    # FileExistsError (EEXIST), retried as transient
    (tmp_path / "afile").write_text("not a folder")
    uri = f"sqlite:///{tmp_path / 'afile' / 'mlflow.db'}"
    writer, msgs = _run(MLflowSink(tracking_uri=uri), tmp_path)
    status = writer.status()["mlflow"]
    assert status["last_error"].startswith("NotADirectoryError"), status["last_error"]
    assert status["disabled"] and status["failures"] == 1
    assert status["delivered"] == 0 and status["missed"] == STEPS
    about = [m for m in msgs if "closed:" not in m]
    assert len(about) == 1 and "cannot work" in about[0], about
    assert str(tmp_path / "afile") in about[0]
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_file_store_error_wrapped_by_mlflow_is_permanent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MLflow's file store: log_batch raises MlflowException(e) while handling the OSError of
    # the metric file (here a folder in its place: EISDIR, also as root)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    sink = MLflowSink(tracking_uri=store.as_uri())

    def break_metric_file() -> None:
        (metric,) = store.glob("*/*/metrics/loss")
        assert metric.read_text().split() == [metric.read_text().split()[0], "0.0", "0"]
        metric.unlink()
        metric.mkdir()

    writer, msgs = _run(sink, tmp_path, mid_run=break_metric_file)
    status = writer.status()["mlflow"]
    assert status["last_error"].startswith("MlflowException"), status["last_error"]
    assert "Errno 21" in status["last_error"]
    assert status["disabled"] and status["failures"] == 1
    assert status["delivered"] == 1 and status["missed"] == STEPS - 1
    about = [m for m in msgs if "closed:" not in m and "closing" not in m]
    assert len(about) == 1 and "cannot work" in about[0] and "failed on step 1" in about[0]


_READ_ONLY_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    from pathlib import Path
    from trainvitals.adapters import FanoutWriter, MLflowSink

    case, folder = sys.argv[1], Path(sys.argv[2])
    warnings.simplefilter("always")
    if case == "existing_db":
        from mlflow import MlflowClient
        MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}").create_experiment("other")
        os.chmod(folder / "mlflow.db", 0o444)
    if case != "mid_run":
        os.chmod(folder, 0o555)
    writer = FanoutWriter(
        [MLflowSink(run_dir=folder)], rank=0, max_failures=3, retry_backoff=(0.01, 0.01),
        sink_timeout=60, close_timeout=60,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(3):
            writer.add_scalar("loss", 0.25 * step, step)
            if step == 0 and case == "mid_run":
                writer.flush()
                os.chmod(folder, 0o555)
        writer.close()
    s = writer.status()["mlflow"]
    print("STATUS", s["delivered"], s["missed"], s["failures"], s["disabled"])
    print("ERROR", str(s["last_error"]).splitlines()[0])
    for w in record:
        if "'mlflow'" in str(w.message) and "clos" not in str(w.message):
            print("WARN", str(w.message).splitlines()[0])
    """
)


def _without_root_override() -> list[str] | None:
    """The command prefix that runs Python where file permissions apply: none needed for a
    normal user; root without CAP_DAC_OVERRIDE (``setpriv``); ``None`` when not possible."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    probe = subprocess.run(
        [setpriv, "--bounding-set=-dac_override,-dac_read_search", "true"], capture_output=True
    )
    return (
        [setpriv, "--bounding-set=-dac_override,-dac_read_search"] if not probe.returncode else None
    )


@pytest.mark.parametrize(
    ("case", "delivered", "failed_step"),
    [
        ("new_db", 0, 0),  # a read-only run folder: MLflow retried opening it for 101 s
        ("existing_db", 0, 0),  # a read-only database: "attempt to write a readonly database"
        ("mid_run", 1, 1),  # the folder made read-only mid-run: SQLite cannot make its journal
    ],
)
def test_read_only_sqlite_store_is_disabled_at_once(
    tmp_path: Path, case: str, delivered: int, failed_step: int
) -> None:
    prefix = _without_root_override()
    if prefix is None:
        pytest.skip("cannot run without root's permission override here")
    folder = tmp_path / "run"
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-c", _READ_ONLY_SCRIPT, case, str(folder)],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            cwd=tmp_path,
        )
    finally:
        os.chmod(folder, 0o755)
    out = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr[-3000:]
    status = next(line for line in out if line.startswith("STATUS"))
    error = next(line for line in out if line.startswith("ERROR"))
    warns = [line for line in out if line.startswith("WARN")]
    assert status == f"STATUS {delivered} {STEPS - delivered} 1 True", (status, error, warns)
    assert error.startswith("ERROR PermissionError: [Errno 13]"), error
    assert len(warns) == 1 and "cannot work" in warns[0], warns
    assert f"failed on step {failed_step}" in warns[0]
    named = folder if case == "mid_run" else folder / "mlflow.db"
    assert f"'{named}'" in warns[0], warns[0]


def _here() -> int:
    return sys._getframe(1).f_lineno


def test_move_aside_warning_names_the_users_line(tmp_path: Path) -> None:
    # JsonlSink moved an earlier run's file aside with a warning that named sinks/jsonl.py
    from trainvitals.adapters import JsonlSink

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step":3,"time":1.0,"metrics":{"loss":1.0}}\n')
    writer = FanoutWriter([JsonlSink(path)], rank=0)
    writer.resume_at(0)  # a new run: the earlier file is moved aside at flush()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = _here() + 1
        writer.flush()
    writer.close()
    moved = [w for w in record if "moved it to metrics.jsonl.1" in str(w.message)]
    assert len(moved) == 1, [str(w.message) for w in record]
    assert (moved[0].filename, moved[0].lineno) == (__file__, line)
    assert (tmp_path / "metrics.jsonl.1").read_text().startswith('{"step":3,')


def test_iter_jsonl_warning_names_the_loop(tmp_path: Path) -> None:
    from trainvitals.adapters.jsonl import iter_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step":0,"time":1.0,"metrics":{"loss":1.0}}\n{"step":1,"ti')
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        steps = []
        line = _here() + 1
        for record_ in iter_jsonl(path):  # (a plain loop: the warning named its caller)
            steps.append(record_["step"])
    assert steps == [0]
    (cut,) = [w for w in record if "last line is truncated" in str(w.message)]
    assert (cut.filename, cut.lineno) == (__file__, line)
