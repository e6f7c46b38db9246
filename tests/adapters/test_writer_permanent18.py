"""A sink that can never work (a run folder that cannot be written) is disabled at once.

Retrying it on the backoff schedule made ``close()`` wait its whole ``close_timeout`` (a 4-step
driver run under a regular file took 62 s instead of 2 s). Transient errors are still retried.
"""

from __future__ import annotations

import errno
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.adapters.conftest import RecordingSink
from trainvitals.adapters import FanoutWriter, JsonlSink, Sink

STEPS = 4


def _messages(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]


def _close_in_thread(writer: FanoutWriter) -> threading.Thread:
    """close() in a thread joined for 20 s: before the fix it retried the sink for about
    two minutes (default backoff, disabled after 10 failures) under close_timeout=600."""
    closer = threading.Thread(target=writer.close, daemon=True)
    closer.start()
    closer.join(20.0)
    return closer


@pytest.mark.parametrize(
    ("layout", "error", "named"),
    [
        # run_dir/metrics.jsonl under a regular file: mkdir raises ENOTDIR
        ("under_file", "NotADirectoryError", "afile/run"),
        # run_dir itself is a regular file: pathlib's mkdir raises EEXIST naming no path
        ("dir_is_file", "NotADirectoryError", "afile"),
        # metrics.jsonl is a folder: open raises EISDIR
        ("file_is_dir", "IsADirectoryError", "run/metrics.jsonl"),
    ],
)
def test_unwritable_jsonl_path_disables_the_sink_at_once(
    tmp_path: Path, layout: str, error: str, named: str
) -> None:
    (tmp_path / "afile").write_text("not a folder")
    if layout == "under_file":
        path = tmp_path / "afile" / "run" / "metrics.jsonl"
    elif layout == "dir_is_file":
        path = tmp_path / "afile" / "metrics.jsonl"
    else:
        path = tmp_path / "run" / "metrics.jsonl"
        path.mkdir(parents=True)
    good = RecordingSink("good")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        writer = FanoutWriter([JsonlSink(path), good], rank=0, close_timeout=600.0)
        for step in range(STEPS):
            writer.add_scalar("loss", 0.5 * step, step)
        closer = _close_in_thread(writer)
        assert not closer.is_alive(), "close() still waiting for a sink that can never work"
    status = writer.status()["jsonl"]
    assert status["disabled"] and status["failures"] == 1
    assert status["delivered"] == 0 and status["missed"] == STEPS and status["pending"] == 0
    assert status["last_error"].startswith(error)
    # the other sink got every step, with its value
    assert [(s, m) for s, m, _ in good.steps] == [(s, {"loss": 0.5 * s}) for s in range(STEPS)]
    assert writer.status()["good"]["missed"] == 0
    msgs = _messages(record)
    about = [m for m in msgs if "'jsonl'" in m and "closed:" not in m]
    assert len(about) == 1, about  # one warning, not "retrying" then "disabled"
    assert "cannot work" in about[0] and error in about[0]
    assert str(tmp_path / named) in about[0]  # names the path
    final = [m for m in msgs if f"closed: sink 'jsonl' missed {STEPS} of {STEPS} steps" in m]
    assert len(final) == 1 and "disabled at once" in final[0]
    assert (tmp_path / "afile").read_text() == "not a folder"


class FailsThenWorks(RecordingSink):
    """Raises ``OSError(code)`` on its first ``fail`` writes, then records."""

    def __init__(self, code: int, fail: int) -> None:
        super().__init__("flaky")
        self.code = code
        self.fail = fail
        self.calls = 0

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self.calls += 1
        if self.calls <= self.fail:
            raise OSError(self.code, errno.errorcode[self.code], "/some/path")
        super().write(step, metrics, wall_time)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EDQUOT])
def test_transient_oserrors_are_still_retried(code: int) -> None:
    sink = FailsThenWorks(code, fail=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        writer = FanoutWriter([sink], rank=0, retry_backoff=(0.01, 0.05), close_timeout=600.0)
        for step in range(STEPS):
            writer.add_scalar("a", float(step), step)
        closer = _close_in_thread(writer)
        assert not closer.is_alive()
    assert sink.calls == 3 + STEPS  # three failed attempts of step 0, then every step once
    assert [s for s, _, _ in sink.steps] == list(range(STEPS))
    status = writer.status()["flaky"]
    assert not status["disabled"] and status["failures"] == 3 and status["missed"] == 0
    msgs = _messages(record)
    assert not any("cannot work" in m for m in msgs)
    assert len([m for m in msgs if "'flaky' failed on step 0" in m and "Retrying" in m]) == 1


class NoPermission(Sink):
    name = "locked"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self.calls += 1
        raise PermissionError(errno.EACCES, "Permission denied", "/runs/locked")


def test_a_permission_error_of_any_sink_is_not_retried() -> None:
    sink, good = NoPermission(), RecordingSink("good")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        writer = FanoutWriter([sink, good], rank=0, max_failures=10, close_timeout=600.0)
        for step in range(STEPS):
            writer.add_scalar("a", float(step), step)
        closer = _close_in_thread(writer)
        assert not closer.is_alive()
    assert sink.calls == 1
    assert [s for s, _, _ in good.steps] == list(range(STEPS))
    status = writer.status()["locked"]
    assert status["disabled"] and status["missed"] == STEPS
    about = [m for m in _messages(record) if "'locked' cannot work" in m]
    assert len(about) == 1 and "PermissionError" in about[0] and "/runs/locked" in about[0]
