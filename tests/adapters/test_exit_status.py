"""How a run a sink created ends: when the script ends without ``close()``, when a
``with writer:`` block ends, and the status each backend is given.

Each script case is a script of its own (the exit hooks run only when an interpreter exits)
that logs to an :class:`MLflowSink` creating its run in a SQLite store, and never closes the
writer: the writer's exit hook closes it. The run's status is read back from the store.

A script would spend seconds importing torch and mlflow, so the first test that needs one runs
the scripts of every selected case together: one launcher imports what they import, then forks
a process per script (see ``_LAUNCHER``). Each starts from a copy of one MLflow store made
beforehand (making a store runs MLflow's migrations, which costs more than the script).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
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

_LOSS = {step: 1.0 / (step + 1) for step in range(3)}


@dataclass(frozen=True)
class Case:
    """A script (the prelude, ``before`` first, then ``body``) and how it must end."""

    body: str
    returncode: int
    status: str
    history: dict[int, float] = field(default_factory=lambda: dict(_LOSS))
    before: str = ""
    stdout: tuple[str, ...] = ()  # texts the script's output must contain
    stderr: tuple[str, ...] = ()


CASES = {
    "normal-end": Case("", 0, "FINISHED"),
    "uncaught-exception": Case("raise ValueError('diverged')", 1, "FAILED"),
    "exit-3": Case("sys.exit(3)", 3, "FAILED"),
    "exit-0": Case("sys.exit(0)", 0, "FINISHED"),
    "exit-none": Case("sys.exit()", 0, "FINISHED"),
    "exit-message": Case("sys.exit('stopped: no data')", 1, "FAILED"),  # a message: status 1
    # CPython ends a process that an uncaught KeyboardInterrupt ended by SIGINT
    "ctrl-c": Case("raise KeyboardInterrupt", -signal.SIGINT, "KILLED"),
    # The writer chains sys.excepthook nowhere: the hook installed before it still runs.
    "hook-installed-before": Case(
        """
        writer.add_scalar("loss", 0.25, 3)
        raise RuntimeError("out of memory")
        """,
        1,
        "FAILED",
        history={**_LOSS, 3: 0.25},
        before="sys.excepthook = lambda exc_type, exc, tb: print('own hook:', exc)",
        stdout=("own hook: out of memory",),
    ),
    # A hook installed after the writer that calls no earlier hook (rich.traceback.install)
    "hook-replaced-after": Case(
        """
        sys.excepthook = lambda exc_type, exc, tb: print('replacing hook:', exc)
        raise RuntimeError("diverged")
        """,
        1,
        "FAILED",
        stdout=("replacing hook: diverged",),
    ),
    # A direct call of sys.excepthook (to print an error and go on), an error that C code
    # reports with PyErr_Print (which stores it in sys.last_value, as for an uncaught one) and
    # goes on, and a sys.exit whose SystemExit is caught, after which training goes on: none
    # ends the script, and the run FINISHES.
    "what-does-not-end-the-script": Case(
        """
        import ctypes
        try:
            raise KeyError("bad batch")
        except KeyError:
            sys.excepthook(*sys.exc_info())
        assert ctypes.pythonapi.PyRun_SimpleString(b"1 / 0") == -1
        assert isinstance(sys.last_value, ZeroDivisionError)
        try:
            sys.exit(2)
        except SystemExit:
            pass
        writer.add_scalar("loss", 0.25, 3)
        """,
        0,
        "FINISHED",
        history={**_LOSS, 3: 0.25},
        # (the default hook printed both errors)
        stderr=("KeyError: 'bad batch'", "ZeroDivisionError: division by zero"),
    ),
    # An error reported as above, then sys.exit(0): the script ended as its exit says.
    "exit-0-after-a-reported-error": Case(
        """
        import ctypes
        assert ctypes.pythonapi.PyRun_SimpleString(b"1 / 0") == -1
        sys.exit(0)
        """,
        0,
        "FINISHED",
        stderr=("ZeroDivisionError: division by zero",),
    ),
    # IPython catches SystemExit in a cell and keeps the kernel running
    # (InteractiveShell.run_code); the kernel's later normal end finishes the run.
    "sys-exit-caught-by-ipython": Case(
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
        0,
        "FINISHED",
    ),
}


@dataclass(frozen=True)
class Ended:
    returncode: int
    stdout: str
    stderr: str
    status: str
    history: dict[int, float]


# Runs each case's script (argv[1]: JSON case folder -> script) to its end in a process of its
# own and prints {case folder: exit status} as JSON. What every script imports is imported
# once here; each process is then forked from this one and runs its script as the rest of this
# program (so its end is the interpreter's own end: uncaught exception, sys.exit, exit hooks).
# Forking is safe only with no other thread alive (the test's environment keeps torch's
# OpenMP pool and pyarrow's jemalloc thread from starting); otherwise each script runs in a
# fresh interpreter.
_LAUNCHER = """
import json, os, subprocess, sys
import mlflow.store.tracking.sqlalchemy_store
import trainvitals.adapters
from mlflow import MlflowClient

scripts = json.loads(sys.argv[1])
tasks = "/proc/self/task"
alone = hasattr(os, "fork") and os.path.isdir(tasks) and len(os.listdir(tasks)) == 1
children, fresh = {}, {}
for case_dir, script in scripts.items():
    with open(os.path.join(case_dir, "stdout"), "wb") as out, \\
            open(os.path.join(case_dir, "stderr"), "wb") as err:
        if not alone:
            fresh[case_dir] = subprocess.Popen(
                [sys.executable, "-c", script], cwd=case_dir, stdout=out, stderr=err
            )
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.chdir(case_dir)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            break
        children[pid] = case_dir
else:
    ends = {case_dir: process.wait() for case_dir, process in fresh.items()}
    while children:
        pid, status = os.wait()
        ends[children.pop(pid)] = os.waitstatus_to_exitcode(status)
    print(json.dumps(ends))
    sys.exit(0)
exec(compile(script, "<script>", "exec"))
"""


def _run_scripts(scripts: dict[Path, str]) -> dict[Path, int]:
    """Run each script to its end in a process of its own; their exit statuses."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["OMP_NUM_THREADS"] = "1"  # torch starts no OpenMP thread at import
    env["JE_ARROW_MALLOC_CONF"] = "background_thread:false"  # nor pyarrow's jemalloc
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, json.dumps({str(d): s for d, s in scripts.items()})],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its scripts too, to end them all on a timeout
    )
    try:
        out, err = launcher.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()
        raise
    assert launcher.returncode == 0, err
    return {Path(d): status for d, status in json.loads(out.splitlines()[-1]).items()}


def _only_run(store: Path) -> tuple[str, dict[int, float]]:
    """Status and ``loss`` history of the single run in the script's store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("exit")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run_id = runs[0].info.run_id
    history = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    return runs[0].info.status, history


@pytest.fixture(scope="module")
def ended(request, tmp_path_factory) -> dict[str, Ended]:
    """How the script of each case selected in this module ended."""
    from mlflow import MlflowClient

    wanted = {
        item.callspec.params["case"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and "case" in getattr(getattr(item, "callspec", None), "params", {})
    }
    root = tmp_path_factory.mktemp("exit")
    template = root / "template.db"
    MlflowClient(tracking_uri=f"sqlite:///{template}").search_experiments()  # creates it
    scripts = {}
    for name in wanted:
        store = root / name / "mlruns" / "mlflow.db"
        store.parent.mkdir(parents=True)
        shutil.copyfile(template, store)
        case = CASES[name]
        script = _PRELUDE.format(before=case.before, run_dir=str(store.parent))
        scripts[root / name] = script + textwrap.dedent(case.body)
    statuses = _run_scripts(scripts)
    return {
        name: Ended(
            statuses[root / name],
            (root / name / "stdout").read_text(),
            (root / name / "stderr").read_text(),
            *_only_run(root / name / "mlruns" / "mlflow.db"),
        )
        for name in wanted
    }


@pytest.mark.parametrize("case", list(CASES))
def test_the_exit_hook_ends_the_run_as_the_script_ended(ended, case) -> None:
    expected, got = CASES[case], ended[case]
    assert got.returncode == expected.returncode, got.stderr
    assert (got.status, got.history) == (expected.status, expected.history), got.stderr
    assert [text for text in expected.stdout if text not in got.stdout] == []
    assert [text for text in expected.stderr if text not in got.stderr] == []


def test_with_writer_ends_the_run_as_the_block_ended(tmp_path) -> None:
    from mlflow import MlflowClient

    from trainvitals.adapters import FanoutWriter, MLflowSink

    statuses = {}
    for name, exception in {
        "exit(0)": SystemExit(0),
        "exit(None)": SystemExit(None),
        "exit(4)": SystemExit(4),
        "ctrl-c": KeyboardInterrupt(),
    }.items():
        sink = MLflowSink(run_dir=tmp_path, experiment_name="with")
        with pytest.raises(type(exception)), FanoutWriter([sink], rank=0) as writer:
            writer.add_scalar("loss", 1.0, 0)
            raise exception
        client = MlflowClient(tracking_uri=sink.tracking_uri)
        statuses[name] = client.get_run(sink.run_id).info.status
    assert statuses == {
        "exit(0)": "FINISHED",
        "exit(None)": "FINISHED",
        "exit(4)": "FAILED",
        "ctrl-c": "KILLED",
    }


class _WandbRun:
    """Stands in for a ``wandb`` run: records ``finish``'s exit code (wandb's default is 0)."""

    step = 0

    def __init__(self) -> None:
        self.exit_codes: list[int] = []

    def log(self, data, step=None) -> None:
        pass

    def finish(self, exit_code: int | None = None) -> None:
        self.exit_codes.append(0 if exit_code is None else exit_code)


def test_an_owned_wandb_run_ends_with_the_exit_code_wandb_gives_such_an_end() -> None:
    # wandb/sdk/lib/exit_hooks.py: 1 for an exception, 255 for Ctrl-C
    from trainvitals.adapters import FanoutWriter, WandbSink

    codes = {}
    for ending in ("finished", "failed", "interrupted"):
        run = _WandbRun()
        writer = FanoutWriter([WandbSink(run, owned=True)], rank=0)
        writer.add_scalar("loss", 1.0, 0)
        writer.close(failed=ending == "failed", interrupted=ending == "interrupted")
        codes[ending] = run.exit_codes
    assert codes == {"finished": [0], "failed": [1], "interrupted": [255]}
