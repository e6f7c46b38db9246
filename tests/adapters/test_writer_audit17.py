"""FanoutWriter audit: close() from two threads, status() of an abandoned write, forked children."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Mapping

import pytest

from tests.adapters.conftest import RecordingSink
from trainvitals.adapters import FanoutWriter


class SlowSink(RecordingSink):
    """Records like RecordingSink, each write taking ``delay`` seconds."""

    def __init__(self, delay: float, name: str = "slow") -> None:
        super().__init__(name)
        self.delay = delay

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        time.sleep(self.delay)
        super().write(step, metrics, wall_time)


def test_a_second_close_from_another_thread_returns_with_every_step_delivered() -> None:
    sink = SlowSink(0.02)
    writer = FanoutWriter([sink], rank=0)
    for step in range(20):
        writer.add_scalar("x", float(step), step)
    first = threading.Thread(target=writer.close)
    first.start()
    while not writer.closed:  # the first close() has begun
        time.sleep(0.001)
    writer.close()  # returned at once before, with 0 of the 20 steps delivered
    delivered = [step for step, _, _ in sink.steps]
    first.join()
    assert delivered == list(range(20))
    assert sink.closed == 1


def test_a_close_running_in_a_daemon_thread_is_not_cut_off_by_the_exit(tmp_path) -> None:
    out = tmp_path / "steps.txt"
    script = textwrap.dedent(
        f"""
        import threading, time
        from trainvitals.adapters import FanoutWriter
        from trainvitals.adapters.sinks.base import Sink

        class FileSink(Sink):
            def write(self, step, metrics, wall_time):
                time.sleep(0.01)
                with open({str(out)!r}, "a") as f:
                    f.write(f"{{step}} {{metrics['x']}}\\n")

        writer = FanoutWriter([FileSink(name="file")], rank=0)
        for step in range(100):
            writer.add_scalar("x", float(step), step)
        threading.Thread(target=writer.close, daemon=True).start()
        time.sleep(0.05)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=os.getcwd()
    )
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    # before: the exit hook skipped the writer being closed, and the daemon thread was killed
    # with it (5 of the 100 lines written)
    assert lines == [f"{s} {float(s)}" for s in range(100)]


class HangingSink(RecordingSink):
    """Blocks in the write of step 1 until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__("hang")
        self.release = threading.Event()

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        if step == 1:
            self.release.wait(30)
        super().write(step, metrics, wall_time)


def test_a_write_abandoned_at_close_that_returns_later_is_counted_once() -> None:
    sink = HangingSink()
    writer = FanoutWriter([sink], rank=0, sink_timeout=0.2, close_timeout=0.5)
    for step in range(5):
        writer.add_scalar("x", float(step), step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        writer.close()
    at_close = writer.status()["hang"]
    # step 0 delivered; step 1 hung in its write; steps 2..4 never tried: 4 missed
    assert (at_close["delivered"], at_close["missed"], at_close["pending"]) == (1, 4, 0)
    sink.release.set()
    deadline = time.monotonic() + 10
    while len(sink.steps) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the worker's bookkeeping after the write returned
    after = writer.status()["hang"]
    got = [step for step, _, _ in sink.steps]
    assert got == [0, 1]
    # every step counted once: what the sink got is delivered, the rest missed (was 2 + 4 = 6)
    assert after["delivered"] == len(got)
    assert after["delivered"] + after["missed"] + after["pending"] == 5
    assert after["missed"] == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_values_logged_in_a_forked_child_are_dropped_with_a_warning(tmp_path) -> None:
    out = tmp_path / "steps.jsonl"
    script = textwrap.dedent(
        f"""
        import json, os, signal, threading, warnings
        from trainvitals.adapters import FanoutWriter
        from trainvitals.adapters.sinks.base import Sink

        class FileSink(Sink):
            def write(self, step, metrics, wall_time):
                with open({str(out)!r}, "a") as f:
                    f.write(json.dumps([os.getpid(), step, dict(metrics)]) + "\\n")

        writer = FanoutWriter([FileSink(name="file")], rank=0)
        writer.add_scalar("parent", 1.0, 0)
        held, go = threading.Event(), threading.Event()

        def hold():  # another thread holds the writer's lock at the fork
            with writer._lock:
                held.set()
                go.wait()

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a child blocked on the lock for ever ends (unfixed: it did)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                writer.add_scalar("child", 2.0, 0)
                writer.add_scalars({{"child": 3.0}}, 1)
                writer.add_scalar("child", 4.0, 2)
                writer.flush()
                writer.close()
            messages = [str(w.message) for w in caught]
            os.write(1, json.dumps(messages).encode() + b"\\n")
            os._exit(0)
        go.set()
        holder.join()
        os.waitpid(pid, 0)
        writer.add_scalar("parent", 5.0, 1)
        writer.close()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=os.getcwd()
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(step, metrics) for _, step, metrics in records] == [
        (0, {"parent": 1.0}),
        (1, {"parent": 5.0}),
    ]
    lines = proc.stdout.strip().splitlines()
    assert lines, f"the child wrote nothing: {proc.stderr[-500:]}"
    messages = json.loads(lines[-1])
    # before: nothing was said, and the lock held at the fork blocked the child for ever (no
    # line from the child; it ended by its alarm)
    assert len(messages) == 1 and "forked child process" in messages[0], messages
