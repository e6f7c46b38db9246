"""How a run a sink created ends when the script ends without ``close()``.

Each case is a script of its own (the exit hooks run only when an interpreter exits) that logs
to an :class:`MLflowSink` creating its run in a SQLite store, and never closes the writer: the
writer's exit hook closes it. The run's status is read back from the store.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_PRELUDE = """
import sys
{before}
from trainvitals.adapters import FanoutWriter, MLflowSink
writer = FanoutWriter([MLflowSink(run_dir={run_dir!r}, experiment_name="exit")], rank=0)
for step in range(3):
    writer.add_scalar("loss", 1.0 / (step + 1), step)
writer.flush()  # the run exists in the store before the script ends
"""


def _run_script(tmp_path: Path, body: str, before: str = "") -> subprocess.CompletedProcess[str]:
    """Run the prelude (``before`` first), then ``body``, in a fresh interpreter."""
    code = _PRELUDE.format(before=before, run_dir=str(tmp_path / "mlruns"))
    code += textwrap.dedent(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )


def _only_run(tmp_path: Path) -> tuple[str, dict[int, float]]:
    """Status and ``loss`` history of the single run in the script's store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("exit")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run_id = runs[0].info.run_id
    history = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    return runs[0].info.status, history


_LOSS = {step: 1.0 / (step + 1) for step in range(3)}


@pytest.mark.parametrize(
    ("body", "returncode", "status"),
    [
        ("", 0, "FINISHED"),
        ("raise ValueError('diverged')", 1, "FAILED"),
        ("sys.exit(3)", 3, "FAILED"),
        ("sys.exit(0)", 0, "FINISHED"),
        ("sys.exit('stopped: no data')", 1, "FAILED"),  # a message exits with status 1
    ],
    ids=["normal-end", "uncaught-exception", "exit-3", "exit-0", "exit-message"],
)
def test_the_exit_hook_ends_the_run_as_the_script_ended(tmp_path, body, returncode, status) -> None:
    done = _run_script(tmp_path, body)
    assert done.returncode == returncode, done.stderr
    assert _only_run(tmp_path) == (status, _LOSS)


def test_an_uncaught_exception_still_reaches_the_hook_installed_before_the_writer(
    tmp_path,
) -> None:
    # the writer chains sys.excepthook: the previous hook (here the script's own) still runs
    done = _run_script(
        tmp_path,
        """
        writer.add_scalar("loss", 0.25, 3)
        raise RuntimeError("out of memory")
        """,
        before="sys.excepthook = lambda exc_type, exc, tb: print('own hook:', exc)",
    )
    assert done.returncode == 1
    assert "own hook: out of memory" in done.stdout
    assert _only_run(tmp_path) == ("FAILED", {**_LOSS, 3: 0.25})


def test_what_does_not_end_the_script_does_not_fail_the_run(tmp_path) -> None:
    # A direct call of sys.excepthook (to print an error and go on) and a sys.exit whose
    # SystemExit is caught, after which training goes on, end nothing: the run FINISHES.
    done = _run_script(
        tmp_path,
        """
        try:
            raise KeyError("bad batch")
        except KeyError:
            sys.excepthook(*sys.exc_info())
        try:
            sys.exit(2)
        except SystemExit:
            pass
        writer.add_scalar("loss", 0.25, 3)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "KeyError: 'bad batch'" in done.stderr  # the default hook still printed it
    assert _only_run(tmp_path) == ("FINISHED", {**_LOSS, 3: 0.25})


def test_a_sys_exit_caught_by_ipython_does_not_fail_the_run(tmp_path) -> None:
    # IPython catches SystemExit in a cell and keeps the kernel running
    # (InteractiveShell.run_code); the kernel's later normal end finishes the run.
    done = _run_script(
        tmp_path,
        """
        import types
        ipython = types.ModuleType("IPython")
        ipython.get_ipython = lambda: object()  # a running shell
        sys.modules["IPython"] = ipython
        try:  # a cell calling sys.exit(1), as the shell runs it
            sys.exit(1)
        except SystemExit:
            pass
        """,
    )
    assert done.returncode == 0, done.stderr
    assert _only_run(tmp_path) == ("FINISHED", _LOSS)


def test_with_writer_ends_the_run_finished_on_sys_exit_zero_failed_otherwise(tmp_path) -> None:
    from mlflow import MlflowClient

    from trainvitals.adapters import FanoutWriter, MLflowSink

    statuses = {}
    for code in (0, None, 4):
        sink = MLflowSink(run_dir=tmp_path, experiment_name="with")
        with pytest.raises(SystemExit), FanoutWriter([sink], rank=0) as writer:
            writer.add_scalar("loss", 1.0, 0)
            raise SystemExit(code)
        client = MlflowClient(tracking_uri=sink.tracking_uri)
        statuses[code] = client.get_run(sink.run_id).info.status
    assert statuses == {0: "FINISHED", None: "FINISHED", 4: "FAILED"}
