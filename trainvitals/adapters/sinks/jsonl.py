"""JSONL sink: one line per step, appended and flushed as each step is delivered."""

from __future__ import annotations

import io
import json
import logging
import os
import stat
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path

from trainvitals.adapters.jsonl import (
    _drop_steps_from,
    _holds_step_below,
    encode_metrics,
    move_aside,
)
from trainvitals.adapters.sinks.base import Sink, make_folder, warn

__all__ = ["JsonlSink"]

log = logging.getLogger(__name__)

# Sinks of this process with their file open (for the warning when one moves another's
# file aside: two writers given one path, e.g. two ``Vitals`` drivers on one ``run_dir``).
_open_sinks: weakref.WeakSet[JsonlSink] = weakref.WeakSet()
_open_sinks_lock = threading.Lock()  # (each writer's sinks open in their own worker thread)


class JsonlSink(Sink):
    """Append one JSON line per step to ``path`` (schema in :mod:`trainvitals.adapters.jsonl`).

    The file is opened on the first delivery (append mode, parent directories created), each
    line is written whole and flushed to the operating system at once, so a killed process
    loses at most the line being written. A write that fails (disk full) is cut off again, so
    the file holds whole lines only and the writer's retry adds the line once. Keys are
    written unchanged; NaN and infinities as ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.

    Appending to an existing file (a resumed run): before its first line the sink drops every
    record of a step at or after the step the run resumes at, saying how many: an INFO log
    (``logging``, logger ``trainvitals.adapters.sinks.jsonl``) when they are the records from
    the step given to ``resume_at`` on (an ordinary resume from a checkpoint), a warning when
    the run did not say, when it dropped records below that step or a line cut by a crash.
    That step is the one given to :meth:`FanoutWriter.resume_at` (the checkpoint's step), or,
    when the run did not say, the first step the sink writes (or the lower of the two). The
    lines the interrupted run wrote after its checkpoint would otherwise stay in the file,
    values of a timeline that no longer exists; guessing from the first step written keeps
    those of steps between the checkpoint and that first step (after a rollback the resumed run
    need not log the same steps: another interval, no NaN to report). After ``resume_at``
    this happens at ``flush()``/``close()`` too when nothing was written by then (a rollback,
    then the end of the run before its next logging step). A last line cut by a
    crash is dropped too (see :func:`~trainvitals.adapters.jsonl.drop_steps_from`); other lines
    are kept. A run resuming at step 0 is a new run: the earlier file is moved aside
    (``metrics.jsonl.1``, ..., with a warning) and a new one started. So is a run that did not
    call ``resume_at`` and whose first step is at or below the step of every record in the
    file (a loop logging from step 1, run twice): a resume would keep none of its lines. So
    give each writer of a run its own file: a second writer appending at a step the first one
    already wrote replaces its lines, and one whose first step is 0 moves the file aside while
    the first is still writing into it (two ``Vitals`` drivers on one ``run_dir``: warned, naming
    the other open sink). A path that is not a regular file (a pipe,
    ``/dev/stdout``) is appended to as it is. A symbolic link (to shared storage) is followed:
    its target is cut, rewritten or moved aside, and the link is kept. A path that cannot be
    written (its folder is a regular file, it is a folder, no permission, a read-only file
    system) raises an ``OSError`` whose ``errno`` makes the writer disable the sink at its first
    step, with one warning naming the path (see ``docs/writer.md``, *When a backend fails*).

    Example::

        with FanoutWriter([JsonlSink("runs/demo/metrics.jsonl")]) as writer:
            writer.add_scalar("train/loss", 2.3, step=0)
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike[str], *, name: str | None = None) -> None:
        super().__init__(name=name, owned=True)
        self.path = Path(path).absolute()  # fixed now: a later chdir does not move it
        self._file: io.FileIO | None = None
        self._partial = False  # a failed write may have left part of a line
        self._resume_step: int | None = None  # from FanoutWriter.resume_at
        self._cut_from: int | None = None  # the file holds no line of a step >= this

    def resume_at(self, step: int) -> None:
        self._resume_step = step

    def settle_resume(self) -> None:
        # A run that rolled back, then ended (or failed) before its next logging step, writes
        # nothing: the abandoned timeline's lines must go all the same.
        if self._file is None and self._resume_step is not None:
            self._drop_abandoned(self._resume_step)

    def open(self) -> None:
        # The file itself is opened by the first write, which knows the first step.
        make_folder(self.path.parent)  # (a regular file in the way: NotADirectoryError)

    def _open_from(self, first_step: int) -> None:
        self.open()
        if self._resume_step is not None:
            # lines from the first written step on would be duplicated, whatever was declared
            first_step = min(first_step, self._resume_step)
        self._drop_abandoned(first_step)
        # Unbuffered: a failed write (disk full) leaves nothing in a buffer that a later flush
        # would write after the retried line (the step twice in the file).
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - kept open
        with _open_sinks_lock:
            _open_sinks.add(self)

    def _other_open_sink(self) -> JsonlSink | None:
        """Another sink of this process writing to this sink's file now, if any."""
        with _open_sinks_lock:
            sinks = list(_open_sinks)
        for sink in sinks:
            if sink is not self and sink._file is not None and sink.path == self.path:
                return sink
        return None

    def _drop_abandoned(self, first_step: int) -> None:
        """Make the file ready for lines from ``first_step`` on (once per cut point)."""
        if self._cut_from is not None and first_step >= self._cut_from:
            return  # settle_resume did it already (a flush before the first write)
        message = None
        expected = False  # an ordinary resume: only the lines past the checkpoint's step
        # Only a regular file holding lines: a pipe, a terminal or /dev/stdout is appended to
        # as it is (reading it would block).
        if self.path.is_file() and self.path.stat().st_size > 0:
            # A new run, not a resume: step 0, or (the run did not say) a first step that no
            # record of the file is below, so that a resume would keep none of them (a second
            # run of a loop logging from step 1 deleted the first run's lines). Keep that file.
            if first_step == 0 or (
                self._resume_step is None and not _holds_step_below(self.path, first_step)
            ):
                writing = self._other_open_sink()
                kept = move_aside(self.path)
                message = f"JsonlSink: {self.path} held an earlier run; moved it to {kept.name}"
                if writing is not None:
                    message = (
                        f"JsonlSink: {self.path} is being written by another open JsonlSink "
                        f"of this process (two Vitals drivers, or two writers, given one "
                        f"run_dir or path?); its file was moved to {kept.name}, where it goes "
                        "on writing, and this sink starts a new one: give each writer its own "
                        "path (Vitals(run_dir=...)), or put the callbacks in one Vitals"
                    )
            else:
                records, cut = _drop_steps_from(self.path, first_step)
                # resume_at named this step and the file held nothing else to drop: the lines
                # the interrupted run wrote after its checkpoint, dropped as documented
                expected = not cut and first_step == self._resume_step
                if expected and records:
                    message = (
                        f"JsonlSink: {self.path}: dropped {records} line(s) of steps >= "
                        f"{first_step}, written after the checkpoint this run resumes from"
                    )
                elif records + cut:
                    message = (
                        f"JsonlSink: {self.path}: dropped {records + cut} line(s) of steps >= "
                        f"{first_step} (this run logs them again: a resumed run) or cut by a crash"
                    )
        self._cut_from = first_step  # only once done: a failed cut is tried again
        if message is not None and expected:
            log.info(message)
        elif message is not None:
            warn(message)  # at the user's flush()/close()/add_scalar line; never raises

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        if self._file is None:
            self._open_from(step)
        assert self._file is not None
        line = json.dumps(
            {"step": step, "time": wall_time, "metrics": encode_metrics(metrics)},
            separators=(",", ":"),
            allow_nan=False,
        )
        before = self._partial
        if before:
            line = "\n" + line
        data = memoryview((line + "\n").encode("utf-8"))
        start = _size(self._file)
        self._partial = True
        try:
            while data:
                written = self._file.write(data)
                if not written:  # (a non-blocking pipe that takes nothing: no progress)
                    raise BlockingIOError(f"JsonlSink: {self.path} took no bytes")
                data = data[written:]
        except BaseException:
            # Disk full, quota, I/O error: the part written is cut off again, so the file holds
            # whole lines only and the sink's retry writes the line once. Where the file cannot
            # be cut (a pipe), the next line starts on a line of its own (_partial).
            if start is not None and _truncate(self._file, start):
                self._partial = before
            raise
        self._partial = False

    def flush(self) -> None:
        pass  # every line is written through at once (unbuffered)

    def close(self) -> None:
        if self._file is None:
            self.settle_resume()
            return
        self._file.close()
        self._file = None
        with _open_sinks_lock:
            _open_sinks.discard(self)


def _size(file: io.FileIO) -> int | None:
    """The size of a regular file, where a failed write is cut off again; ``None`` else."""
    try:
        status = os.fstat(file.fileno())
    except OSError:
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None


def _truncate(file: io.FileIO, size: int) -> bool:
    try:
        os.ftruncate(file.fileno(), size)
    except OSError:
        return False
    return True
