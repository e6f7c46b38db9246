"""JSONL sink: one line per step, appended and flushed as each step is delivered."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from trainvitals.adapters.jsonl import encode_metrics
from trainvitals.adapters.sinks.base import Sink

__all__ = ["JsonlSink"]


class JsonlSink(Sink):
    """Append one JSON line per step to ``path`` (schema in :mod:`trainvitals.adapters.jsonl`).

    The file is opened on the first delivery (append mode, parent directories created), each
    line is written whole and flushed to the operating system at once, so a killed process
    loses at most the line being written. When the file already ends in a partial line (a
    previous process was killed mid-write), a newline is written first so that the partial line
    stays on its own and :func:`~trainvitals.adapters.jsonl.read_jsonl` can skip it. Keys are
    written unchanged; NaN and infinities as ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.

    Example::

        with FanoutWriter([JsonlSink("runs/demo/metrics.jsonl")]) as writer:
            writer.add_scalar("train/loss", 2.3, step=0)
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike[str], *, name: str | None = None) -> None:
        super().__init__(name=name, owned=True)
        self.path = Path(path).absolute()  # fixed now: a later chdir does not move it
        self._file: IO[str] | None = None
        self._partial = False  # a failed write may have left part of a line

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        if needs_newline:
            self._file.write("\n")
            self._file.flush()

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        if self._file is None:
            self.open()
        assert self._file is not None
        line = json.dumps(
            {"step": step, "time": wall_time, "metrics": encode_metrics(metrics)},
            separators=(",", ":"),
            allow_nan=False,
        )
        if self._partial:
            line = "\n" + line
        self._partial = True
        self._file.write(line + "\n")
        self._file.flush()
        self._partial = False

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
