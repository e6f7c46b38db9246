"""FanoutWriter audit 18: a dead or hung W&B service, a sink that stays slow, the Comet epoch of
a late delivery, ``resume_at`` called twice, and where the writer's warnings point."""

from __future__ import annotations

import glob
import json
import os
import threading
import warnings
import zipfile
from collections.abc import Mapping
from typing import Any

import pytest

from tests.adapters.conftest import RecordingSink
from trainvitals.adapters import CometSink, FanoutWriter, JsonlSink, WandbSink

# --------------------------------------------------------------------------------------------
# W&B with a dead or hung service (fake runs: what wandb 0.31 raises, measured on a real
# offline run whose wandb-core was killed / stopped)


class DeadServiceRun:
    """A W&B run whose service dies after ``alive`` rows: ``log`` then raises the
    ``ConnectionResetError`` W&B's client keeps raising for every later call."""

    def __init__(self, alive: int) -> None:
        self.alive = alive
        self.rows: list[tuple[dict[str, float], int | None]] = []
        self.log_calls = 0

    @property
    def step(self) -> int:
        return len(self.rows)

    def log(self, data: dict[str, float], step: int | None = None) -> None:
        self.log_calls += 1
        if len(self.rows) >= self.alive:
            raise ConnectionResetError(104, "Connection reset by peer")
        self.rows.append((dict(data), step))


class UnansweredStepRun:
    """A W&B run whose service does not answer: ``run.step`` raises ``TimeoutError`` (after
    W&B's 30 s, not waited here); ``log`` is buffered and returns."""

    def __init__(self) -> None:
        self.rows: list[tuple[dict[str, float], int | None]] = []
        self.step_reads = 0

    @property
    def step(self) -> int:
        self.step_reads += 1
        raise TimeoutError("Timed out waiting for response on abc")

    def log(self, data: dict[str, float], step: int | None = None) -> None:
        self.rows.append((dict(data), step))


def test_a_dead_wandb_service_is_refused_at_once_not_retried_until_close_times_out() -> None:
    run = DeadServiceRun(alive=1)
    other = RecordingSink("jsonl")
    writer = FanoutWriter(
        [WandbSink(run), other], rank=0, retry_backoff=(0.01, 0.01), close_timeout=2.0
    )
    for step in range(5):
        writer.add_scalar("loss", float(step), step)
    with pytest.warns(RuntimeWarning, match="W&B service of this run is gone"):
        writer.close()
    status = writer.status()["wandb"]
    # one successful row, one call that found the service dead, no retry of a dead service
    # (before: retried on the backoff schedule until close_timeout: 10 failures, disabled)
    assert run.log_calls == 2
    assert run.rows == [({"loss": 0.0}, 0)]
    assert status["failures"] == 0
    assert status["delivered"] == 1 and status["missed"] == 4
    assert not status["disabled"]
    assert [s for s, _, _ in other.steps] == [0, 1, 2, 3, 4]


def test_an_unanswered_wandb_run_step_is_not_asked_again_at_every_step() -> None:
    run = UnansweredStepRun()
    writer = FanoutWriter([WandbSink(run)], rank=0)
    for step in range(6):
        writer.add_scalar("loss", float(step), step)
    writer.close()
    # each read costs W&B's 30 s timeout: once, not once per step (before: 6 reads)
    assert run.step_reads == 1
    assert run.rows == [({"loss": float(s)}, s) for s in range(6)]


def test_an_unanswered_run_step_with_shared_step_still_logs_each_step_at_its_own_row() -> None:
    run = UnansweredStepRun()
    run.define_metric = lambda *a, **k: None  # type: ignore[attr-defined]
    writer = FanoutWriter([WandbSink(run, shared_step=True)], rank=0)
    for step in range(3):
        writer.add_scalar("loss", float(step), step)
    writer.close()
    assert run.step_reads == 1
    assert [(r["loss"], r["trainvitals/step"], s) for r, s in run.rows] == [
        (0.0, 0, 0),
        (1.0, 1, 1),
        (2.0, 2, 2),
    ]


# --------------------------------------------------------------------------------------------
# a sink that stays slow: each write runs past sink_timeout


class GatedSink(RecordingSink):
    """Each write blocks until the test lets one through (``gate.release()``)."""

    def __init__(self, name: str = "gated") -> None:
        super().__init__(name)
        self.gate = threading.Semaphore(0)
        self.started = threading.Semaphore(0)

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self.started.release()
        self.gate.acquire()
        super().write(step, metrics, wall_time)


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_flush_and_close_do_not_wait_again_for_a_sink_whose_writes_run_past_the_timeout() -> None:
    slow, other = GatedSink("slow"), RecordingSink("other")
    writer = FanoutWriter([slow, other], rank=0, sink_timeout=0.2, close_timeout=3600.0)
    try:
        for step in range(4):
            writer.add_scalar("x", float(step), step)
        with pytest.warns(RuntimeWarning, match="'slow' has not returned from writing step 0"):
            assert writer.flush() is False  # waits sink_timeout for the hung write, once
        slow.gate.release()  # step 0's write returns, long after sink_timeout
        assert slow.started.acquire(timeout=30)  # step 0 entered
        assert slow.started.acquire(timeout=30)  # step 1's write has started: slow again
        # From here a hang would only be seen after an hour: a flush or close that waits for
        # this sink again (each write of a dead backend that answers after its own timeout)
        # blocks until the gate opens. Before the fix both waited.
        writer.sink_timeout = 3600.0
        t, result = _in_thread(writer.flush)
        t.join(30)
        assert not t.is_alive(), "flush() waited again for a sink already seen hung"
        assert result == [False]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t, _ = _in_thread(writer.close)
            t.join(30)
            assert not t.is_alive(), "close() waited again for a sink already seen hung"
        messages = [str(w.message) for w in caught]
        assert any("'slow' did not finish" in m and "sink_timeout" in m for m in messages)
        assert [s for s, _, _ in other.steps] == [0, 1, 2, 3]  # the other sink lost nothing
        status = writer.status()["slow"]
        assert status["delivered"] == 1 and status["missed"] == 3
    finally:
        for _ in range(8):
            slow.gate.release()


# --------------------------------------------------------------------------------------------
# Comet: the epoch of a step delivered late


def _comet_epochs(offline_directory: str) -> dict[int, Any]:
    (archive,) = glob.glob(os.path.join(offline_directory, "*.zip"))
    out: dict[int, Any] = {}
    with zipfile.ZipFile(archive) as z:
        for line in z.read("messages.json").decode().splitlines():
            msg = json.loads(line)
            if msg.get("type") == "metric_msg":
                m = msg["payload"]["metric"]
                if m["metricName"] == "m":
                    out[m["step"]] = m.get("epoch")
    return out


def test_comet_tags_each_step_with_the_epoch_it_was_logged_in(tmp_path) -> None:
    import comet_ml

    directory = str(tmp_path / "comet")
    experiment = comet_ml.OfflineExperiment(
        offline_directory=directory, project_name="tv", display_summary_level=0
    )
    writer = FanoutWriter([CometSink(experiment)], rank=0)
    expected = {}
    step = 0
    for epoch in range(3):
        experiment.set_epoch(epoch)
        for _ in range(2):
            writer.add_scalar("m", float(epoch), step)
            expected[step] = epoch
            step += 1
    writer.close()
    assert experiment.curr_epoch == 2  # the loop's epoch is left as the loop set it
    experiment.end()
    # before: {0: 1, 1: 1, 2: 2, 3: 2, 4: 2, 5: 2}, the epoch at delivery
    assert _comet_epochs(directory) == expected


# --------------------------------------------------------------------------------------------
# resume_at twice


class ResumeRecordingSink(RecordingSink):
    def __init__(self) -> None:
        super().__init__("resume")
        self.resumed: list[int] = []

    def resume_at(self, step: int) -> None:
        self.resumed.append(step)


def test_resume_at_again_before_logging_replaces_and_tells_the_sinks_once_per_step() -> None:
    sink = ResumeRecordingSink()
    writer = FanoutWriter([sink], rank=0)
    writer.resume_at(10)
    writer.resume_at(10)  # the same step: nothing new
    writer.resume_at(5)  # the later step replaces the earlier one
    writer.close()
    assert sink.resumed == [10, 5]  # before: [10, 10, 5]


def test_resume_at_another_step_after_a_flush_cut_the_files_is_refused(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    with FanoutWriter([JsonlSink(path)], rank=0) as old:
        for step in range(20):
            old.add_scalar("a", float(step), step)
    writer = FanoutWriter([JsonlSink(path)], rank=0)
    writer.resume_at(5)
    with warnings.catch_warnings():  # an ordinary resume: an INFO log, no warning
        warnings.simplefilter("error", RuntimeWarning)
        writer.flush()  # the file is cut at step 5 now
    # before: accepted without a word, while the file stayed cut at 5 (steps 5..9 gone)
    with pytest.warns(RuntimeWarning, match=r"resume_at\(10\) after a flush\(\).*resume_at\(5\)"):
        writer.resume_at(10)
    for step in range(5, 8):
        writer.add_scalar("a", 100.0 + step, step)
    writer.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["metrics"]["a"]) for r in rows] == [(s, float(s)) for s in range(5)] + [
        (s, 100.0 + s) for s in range(5, 8)
    ]


# --------------------------------------------------------------------------------------------
# where the writer's warnings point


def test_writer_warnings_point_at_the_callers_line() -> None:
    writer = FanoutWriter([RecordingSink()], rank=0)
    writer.add_scalar("x", 1.0, 0)
    writer.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line() + 1
        writer.add_scalar("x", 2.0, 1)
        writer.resume_at(3)
    assert [(os.path.basename(w.filename), w.lineno) for w in caught] == [
        (os.path.basename(__file__), line),
        (os.path.basename(__file__), line + 1),
    ]  # before: fanout_writer.py, the writer's own lines


def _line() -> int:
    import inspect

    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


def _wait_for(condition: Any) -> None:
    for _ in range(3000):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("condition not reached in 30 s")


def test_flush_learns_of_a_write_that_begins_while_it_waits_and_stops_at_sink_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainvitals.adapters import fanout_writer

    hung = GatedSink("hung")
    writer = FanoutWriter([hung], rank=0, sink_timeout=0.3, flush_timeout=60.0)
    flushing = threading.Event()  # the flush() is waiting on the writer's condition
    waiter: list[int] = []
    cond_wait = writer._cond.wait

    def wait(timeout: float | None = None) -> bool:
        # flush()'s wait for the sinks (not its short waits for the dispatcher, <= 0.5 s)
        if waiter and threading.get_ident() == waiter[0] and (timeout is None or timeout > 1):
            flushing.set()
        return cond_wait(timeout)

    monkeypatch.setattr(writer._cond, "wait", wait)
    attempt = fanout_writer._SinkWorker.attempt

    def late_attempt(self: Any, below: int | None = None) -> bool:
        # the worker picks the step up only once flush() waits (a thread scheduled late)
        if self.pending:
            flushing.wait(30)
        return attempt(self, below)

    monkeypatch.setattr(fanout_writer._SinkWorker, "attempt", late_attempt)

    def flush() -> bool:
        waiter.append(threading.get_ident())
        return writer.flush()

    try:
        writer.add_scalar("x", 0.0, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t, result = _in_thread(flush)
            t.join(30)
        # before: the write began unannounced, and flush() slept its whole flush_timeout
        assert not t.is_alive(), "flush() did not see the write begin"
        assert result == [False]
        assert writer.status()["hung"]["hung"]
        for _ in range(4):
            hung.gate.release()  # the hung write returns; later ones return at once
        writer.add_scalar("x", 1.0, 1)
        writer.end_step()
        _wait_for(lambda: writer.status()["hung"]["delivered"] == 2)
        # a write returned in time: the sink is waited for again, and has everything
        assert not writer._workers[0].slow
        writer.add_scalar("x", 2.0, 2)
        assert writer.flush() is True
        assert [s for s, _, _ in hung.steps] == [0, 1, 2]
    finally:
        for _ in range(4):
            hung.gate.release()
    writer.close()
