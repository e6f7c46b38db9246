"""The JSONL metrics file: its schema, the encoding of non-finite values, and its reader.

Schema: one JSON object per line and per delivered step, appended and flushed as the step is
delivered::

    {"step": 120, "time": 1732186112.513, "metrics": {"train/loss": 2.31, "moe/layer_0/cv": "NaN"}}

* ``step``: the integer step the values were logged at (an optimizer step).
* ``time``: Unix time in seconds (float) of the first value logged for that step.
* ``metrics``: key -> value. A finite value is a JSON number written with Python's shortest
  round-tripping ``repr``, so it reads back bit-exactly as a float64. JSON has no literal for
  NaN or infinities: they are written as the strings ``"NaN"``, ``"Infinity"`` and
  ``"-Infinity"`` (the spellings of JavaScript and of Python's ``json`` module), which
  :func:`read_jsonl` turns back into floats. No other string ever appears as a value.

The same step can appear on more than one line (values logged for a step after a ``flush()``);
:func:`metric_history` merges them. A process killed while writing leaves a last line without
its newline: :func:`read_jsonl` skips it and warns. A resumed run appends to the file of the run
it resumes: before its first line, :class:`~trainvitals.adapters.JsonlSink` drops every record
of a step at or after the step the run resumes at (given by ``FanoutWriter.resume_at``, else
the first step it writes; lines the interrupted run wrote past its checkpoint would otherwise
stay, as values of a timeline that no longer exists) and a last line cut by a crash. A new run
(resuming at step 0, or, when it did not say, whose first step no record of the file is below)
moves an earlier run's file aside (``metrics.jsonl.1``, ...) instead. A
symbolic link is followed: the file it points at is cut, rewritten or moved aside.

Example::

    records = read_jsonl("runs/demo/metrics.jsonl")
    steps, values = zip(*metric_history(records, "train/loss"))
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypedDict

__all__ = [
    "JsonlRecord",
    "decode_value",
    "drop_steps_from",
    "encode_metrics",
    "iter_jsonl",
    "metric_history",
    "move_aside",
    "read_jsonl",
]

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class JsonlRecord(TypedDict):
    step: int
    time: float
    metrics: dict[str, float]


def _encode_nonfinite(v: float) -> str:
    if v != v:
        return "NaN"
    return "Infinity" if v > 0 else "-Infinity"


def encode_metrics(metrics: Mapping[str, float]) -> dict[str, float | str]:
    """``metrics`` with NaN and infinities replaced by their string spellings."""
    # v - v is 0.0 for every finite float and NaN for NaN and +-Inf: one cheap test per value.
    return {k: (v if v - v == 0.0 else _encode_nonfinite(v)) for k, v in metrics.items()}


def decode_value(value: Any) -> float:
    """A metric value from the file as a float (``"NaN"`` -> nan, ``"Infinity"`` -> inf)."""
    if isinstance(value, str):
        try:
            return _NONFINITE[value]
        except KeyError:
            raise ValueError(f"unexpected string metric value {value!r}") from None
    return float(value)


def read_jsonl(path: str | os.PathLike[str], *, strict: bool = False) -> list[JsonlRecord]:
    """Read a trainvitals JSONL metrics file into a list of records, in file order.

    Values come back as floats, NaN and infinities included. A last line without its newline
    (the writing process was killed mid-line) is skipped with a ``RuntimeWarning`` saying so;
    other lines that do not parse (a truncated line followed by later appends) are skipped with
    a warning naming their line numbers, or raise ``ValueError`` when ``strict`` is true.
    :func:`iter_jsonl` reads the same records one at a time, for files too large to hold.

    Example::

        >>> records = read_jsonl("metrics.jsonl")          # doctest: +SKIP
        >>> records[0]["step"], records[0]["metrics"]["train/loss"]  # doctest: +SKIP
        (0, 2.302585092994046)
    """
    return list(_iter_jsonl(path, strict))


def iter_jsonl(
    path: str | os.PathLike[str],
    *,
    strict: bool = False,
    first: int | None = None,
    last: int | None = None,
) -> Iterator[JsonlRecord]:
    """The records of :func:`read_jsonl`, one at a time: the file is read line by line, so
    memory does not grow with its length. The warnings (or, with ``strict``, the
    ``ValueError``) for lines that do not parse come once the file has been read to its end.

    ``first`` / ``last`` (inclusive): a complete line as :class:`JsonlSink` writes it
    (``{"step":N,"time":...}``) whose step is outside them is passed over without being parsed
    (a report of the last 100 of 20,000 steps parses 100 lines) and is not checked (a
    corrupted one is not warned about); any other line is parsed and yielded whatever its
    step, so the caller still filters the steps.

    Example::

        >>> losses = [r["metrics"]["train/loss"] for r in iter_jsonl("metrics.jsonl")]  # doctest: +SKIP
    """
    return _iter_jsonl(path, strict, first, last)


def _iter_jsonl(
    path: str | os.PathLike[str], strict: bool, first: int | None = None, last: int | None = None
) -> Iterator[JsonlRecord]:
    bad: list[int] = []
    truncated_tail = b""
    filtered = first is not None or last is not None
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):  # only the last line can end without a newline
                truncated_tail = raw
                break
            if not raw.strip():
                continue
            if filtered and _outside(raw, first, last):
                continue
            record = _parse(raw)
            if record is None:
                bad.append(number)
            else:
                yield record
    if bad:
        msg = f"{os.fspath(path)}: skipped {len(bad)} line(s) that do not parse: {bad[:10]}"
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=_user_level())
    if truncated_tail.strip():
        record = _parse(truncated_tail)
        if record is not None:
            # a complete object whose newline did not make it: keep it
            yield record
        else:
            warnings.warn(
                f"{os.fspath(path)}: the last line is truncated ({len(truncated_tail)} bytes "
                "without a newline; the writing process was killed mid-write, or a live run is writing it); "
                "it was skipped",
                RuntimeWarning,
                stacklevel=_user_level(),
            )


def _user_level() -> int:
    """The ``stacklevel`` of the reader's caller: ``read_jsonl``'s, or the loop iterating
    :func:`iter_jsonl` (a fixed 3 named the caller of that loop's function)."""
    from trainvitals.adapters.sinks.base import stacklevel  # (base's package imports this)

    # (stacklevel() counts its caller's caller, _iter_jsonl here, as 2; warnings.warn, called
    # in _iter_jsonl, as 1)
    return stacklevel() - 1


# the start of a line as JsonlSink writes it (compact separators, "step" first)
_STEP_PREFIX = re.compile(rb'\{"step":(\d+),"time":')


def drop_steps_from(
    path: str | os.PathLike[str],
    first_step: int,
    *,
    line_step: Callable[[bytes], int | None] | None = None,
) -> int:
    """Make ``path`` ready for appending records from ``first_step`` on: drop every record of a
    step ``>= first_step`` and a last line cut by a crash (no newline, does not parse); keep
    every other line, also lines that are not records; end the file with a newline. Returns
    how many lines were dropped.

    ``line_step`` gives the step of a record line (the raw bytes, newline included) and
    ``None`` for any other line; the default reads the records of this module's schema. The
    file is read line by line; it is cut short when the dropped lines are all at its end (the
    usual case: records are in step order), else rewritten through a temporary file and
    ``os.replace``. A symbolic link (a run directory's ``metrics.jsonl`` pointing at shared
    storage) is followed: its target is cut or rewritten (keeping its permission bits) and the
    link stays as it is.
    """
    records, cut = _drop_steps_from(path, first_step, line_step)
    return records + cut


def _drop_steps_from(
    path: str | os.PathLike[str],
    first_step: int,
    line_step: Callable[[bytes], int | None] | None = None,
) -> tuple[int, int]:
    """:func:`drop_steps_from`, returning apart how many records of steps ``>= first_step`` and
    how many lines cut by a crash it dropped: a resumed run expects the former only."""
    step_of = _line_step if line_step is None else line_step
    # os.replace onto the link would put a regular file in its place, cut off from the storage
    # it points at: rewrite the target, next to it (same file system, so the replace is atomic).
    path = os.path.realpath(path)

    cut = 0  # lines cut by a crash, among the dropped ones

    def dropped_line(raw: bytes) -> bool:
        nonlocal cut
        step = step_of(raw)
        if step is not None:
            return step >= first_step
        if not raw.endswith(b"\n") and bool(raw.strip()):  # cut by a crash
            cut += 1
            return True
        return False

    kept_end = 0  # byte offset just past the last kept line
    drop: list[bool] = []  # per line
    rewrite = False  # a kept line follows a dropped one
    last = b""
    with open(path, "rb") as f:
        offset = 0
        for raw in f:
            offset += len(raw)
            drop.append(dropped_line(raw))
            if not drop[-1]:
                rewrite = rewrite or kept_end != offset - len(raw)
                kept_end, last = offset, raw
    dropped = sum(drop)
    if rewrite:
        tmp = f"{path}.tmp"
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            for raw, gone in zip(src, drop, strict=True):
                if not gone:
                    dst.write(raw if raw.endswith(b"\n") else raw + b"\n")
            os.chmod(tmp, stat.S_IMODE(os.fstat(src.fileno()).st_mode))
        os.replace(tmp, path)
        return dropped - cut, cut
    if kept_end != offset:
        os.truncate(path, kept_end)
    if last and not last.endswith(b"\n"):  # a complete last line whose newline was lost
        with open(path, "ab") as f:
            f.write(b"\n")
    return dropped - cut, cut


def _holds_step_below(
    path: str | os.PathLike[str],
    step: int,
    *,
    line_step: Callable[[bytes], int | None] | None = None,
) -> bool:
    """Whether ``path`` holds a record of a step below ``step``: read line by line, stopping at
    the first such record (usually the file's first line)."""
    step_of = _line_step if line_step is None else line_step
    with open(path, "rb") as f:
        for raw in f:
            found = step_of(raw)
            if found is not None and found < step:
                return True
    return False


def move_aside(path: str | os.PathLike[str]) -> Path:
    """Rename ``path`` to the first free ``<name>.1``, ``<name>.2``, ... and return the new
    path: an earlier run's file is kept, never overwritten.

    A symbolic link is followed: its target is renamed, in the target's directory, and the
    link is left pointing at the target's name, where the next run's file is then created.
    """
    # Renaming the link itself would leave the next run writing a regular file in the link's
    # place, on local disk instead of the storage the user pointed the link at.
    path = Path(os.path.realpath(path))
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    kept = path.with_name(f"{path.name}.{n}")
    os.replace(path, kept)
    return kept


def _outside(raw: bytes, first: int | None, last: int | None) -> bool:
    """Whether a complete line as JsonlSink writes it is of a step outside ``first..last``
    (from its start alone); ``False`` for any other line (it is parsed)."""
    m = _STEP_PREFIX.match(raw)
    if m is None or not raw.endswith(b"}}\n"):
        return False
    step = int(m.group(1))
    return (first is not None and step < first) or (last is not None and step > last)


def _line_step(raw: bytes) -> int | None:
    """The step of a valid line; ``None`` for a cut or unparsable line."""
    m = _STEP_PREFIX.match(raw)
    if m is not None and raw.endswith(b"}}\n"):  # as JsonlSink writes it: skip the full parse
        return int(m.group(1))
    record = _parse(raw)
    return None if record is None else record["step"]


def _parse(raw: bytes) -> JsonlRecord | None:
    try:
        obj = json.loads(raw)
        metrics = {str(k): decode_value(v) for k, v in obj["metrics"].items()}
        return {"step": int(obj["step"]), "time": float(obj["time"]), "metrics": metrics}
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
        # (OverflowError: a step of Infinity or a 400-digit integer value, JSON that json.loads
        # reads, crashed read_jsonl and the sink's resume instead of being skipped)
        return None


def metric_history(records: Iterable[JsonlRecord], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` pairs of one key, in file order (a later line wins within a step)."""
    out: dict[int, float] = {}
    for r in records:
        if key in r["metrics"]:
            out.pop(r["step"], None)
            out[r["step"]] = r["metrics"][key]
    return list(out.items())
