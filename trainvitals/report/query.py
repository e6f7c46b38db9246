"""Queries over a run's ``tensor_stats.jsonl``: exact statistics of any group of tensors.

Each line of the file holds, for one step and kind, every tensor's moments (count, mean,
central sums M2..M4, min, max, non-finite count; format in ``docs/tensor_stats.md``). Because
the moments are central and merge exactly (:func:`trainvitals.stats.moments.combine_moments`),
the statistics of a group of tensors (all MLP gradients of layers 10-20, say) are those of
their elements pooled together, not an average of per-tensor statistics.

Example::

    from trainvitals.report import query
    rows = query("runs/exp1", kind="grad", group="layers.*.mlp.*", stat="kurtosis",
                 steps="100:200", by=r"layers\\.(\\d+)\\.")
    # [{"step": 100, "group": "0", "tensors": 3, "kurtosis": 3.1}, ...]
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import itertools
import json
import math
import operator
import re
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainvitals._natural import natural_order
from trainvitals.report.sources import name_a_few
from trainvitals.stats.moments import DERIVED, FIELDS, combine_moments, derive

__all__ = [
    "SUPPORTED_VERSIONS",
    "NewerVersionError",
    "parse_steps",
    "query",
    "read_tensor_stats",
]

SUPPORTED_VERSIONS = (1,)
KINDS = ("param", "grad", "activation", "dgrad")
#: Records of one kind held and merged at a time while a file is read (:func:`query`, the HTML
#: report): bounds memory whatever the file's length, and keeps one merge per few hundred steps.
CHUNK_RECORDS = 256
#: Tensors (moment vectors) of the records held at a time, whatever their number: a chunk is
#: also merged once it holds this many. Parsed, a vector costs about 0.3 kB (a list of eight
#: boxed numbers and its key), so 256 records of 20,000 tensors each held ~1.7 GB (the report
#: holds a chunk per kind: ~700 MB above the interpreter for a 200 MB file read whole); this
#: bounds a chunk to ~20 MB, and a merge still spans ~65,000 rows.
CHUNK_TENSORS = 1 << 16
#: Skipped lines of a file warned about one by one; the rest are counted in one warning.
MAX_LINE_WARNINGS = 5
#: The types a moment vector's element may have once parsed: a number, or ``null`` for a
#: non-finite value (``bool`` is not a number here, though Python counts it as an ``int``).
_ELEMENT_TYPES = frozenset({int, float, type(None)})
_REGEX_CHARS = re.compile(r"[\\^$()+|{}]")
#: The TensorStatsMonitor file a run folder holds (its default ``filename``).
TENSOR_STATS_FILE = "tensor_stats.jsonl"
#: Folder levels below a run folder searched for tensor statistics files when it holds none
#: (the only one found is read; several are named in the error): ``lightning_logs/version_0/``,
#: ``runs/<name>/version_0/``.
_SEARCH_DEPTH = 2


class NewerVersionError(ValueError):
    """A ``tensor_stats.jsonl`` of which no line could be read, some of them of a newer schema
    version than :data:`SUPPORTED_VERSIONS` (written by a newer trainvitals): upgrade. A
    ``ValueError``, so callers that handle bad input as such (the CLI's exit status 2) need
    not know it; the HTML report catches it to show the run's metrics with the message."""


def _files_below(folder: Path) -> list[Path]:
    """The tensor statistics files a run folder without its own holds: earlier runs moved
    aside (``.1``, ``.2``, ...), then those of subfolders (a logger's version folder)."""
    found = sorted(folder.glob(f"{TENSOR_STATS_FILE}.*"))
    for depth in range(1, _SEARCH_DEPTH + 1):  # bounded: a folder may hold a big tree
        found += sorted(folder.glob("/".join(["*"] * depth + [TENSOR_STATS_FILE])))
    return found


def _found_below(found: list[Path], folder: Path) -> str:
    """The tail of the missing-file error: the files a folder of several runs (or of a run
    moved aside by a new one) holds instead, so the user can name one."""
    if not found:
        return ""
    return f"; {len(found)} found in or below {folder}: {name_a_few(found)} (give one of them)"


def tensor_stats_path(path: str | Path) -> Path:
    """The file a query of ``path`` reads: ``path`` itself, or a run folder's
    ``tensor_stats.jsonl``; a folder without its own whose subfolders, up to two levels down
    (``<logger>/version_0/``), hold exactly one, and no earlier run moved aside
    (``tensor_stats.jsonl.1``), is read from that one. ``FileNotFoundError`` otherwise (naming
    the files found, when several runs or runs moved aside leave the user to name one).
    (``trainvitals report`` searches the whole tree and ignores moved-aside files: a report
    shows one run, a query must not pick a run the user did not mean.)"""
    path = Path(path)
    if path.is_dir():
        folder, path = path, path / TENSOR_STATS_FILE
        if not path.exists():
            found = _files_below(folder)
            if len(found) == 1 and found[0].name == TENSOR_STATS_FILE and found[0].is_file():
                return found[0]
            raise FileNotFoundError(
                f"no tensor statistics file at {path}{_found_below(found, folder)}"
            )
    if not path.exists():
        raise FileNotFoundError(f"no tensor statistics file at {path}")
    return path


def read_tensor_stats(
    path: str | Path,
    *,
    kinds: Collection[str] | None = None,
    first: int | None = None,
    last: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield the records of a ``tensor_stats.jsonl`` file (or of ``<run_dir>/tensor_stats.jsonl``).

    ``kinds``, ``first`` and ``last`` (None: every kind, open ends) say which records the
    caller keeps: a line of another kind or of a step outside ``first..last`` is passed over
    without being parsed where its start says so (:func:`_passed_over`: a complete line that
    starts as ``TensorStatsMonitor`` writes it, of a supported version): a query of one kind
    parses a quarter of the lines. Any other line is parsed and checked as below. Records of
    other kinds and steps may still be yielded (the caller filters them). A line passed over
    is not checked further (a corrupted one is not warned about) and counts as readable for
    :class:`NewerVersionError`.

    A last line cut by a crash is skipped with a warning, as are other unreadable lines, lines
    of an unknown schema version, lines without an integer ``step``, a ``kind`` string or a
    ``tensors`` object, and lines with a moment vector that is not a list of numbers (or
    ``null``) as long as the ``fields`` or that holds an integer too large for a float (a
    hand-edited or corrupted line)
    (the first :data:`MAX_LINE_WARNINGS` one by one, the rest counted in one warning at the
    end, so a wrong file does not print a warning per line). When a (step, kind) appears
    twice, the later line wins (:func:`query` applies this).

    Raises:
        FileNotFoundError: no such file (a folder's message names the files found below it;
            a folder without its own file whose subfolders, up to two levels down, hold exactly
            one, and no run moved aside, is read from that one: :func:`tensor_stats_path`).
        NewerVersionError: (a ``ValueError``) no line could be read and some are of a newer
            schema version than :data:`SUPPORTED_VERSIONS` (a file written by a newer
            trainvitals: upgrade), raised once the file was read. A file with some readable
            lines only warns about the newer ones.
    """
    path = tensor_stats_path(path)
    skipped = 0
    read = 0  # records yielded, and lines passed over (_passed_over)
    filtered = kinds is not None or first is not None or last is not None
    wanted = None if kinds is None else frozenset(k.encode() for k in kinds)
    newest = 0  # the highest newer-than-supported schema version skipped (0: none)

    def skip(message: str) -> None:
        nonlocal skipped
        skipped += 1
        if skipped <= MAX_LINE_WARNINGS:
            warnings.warn(f"{path}: {message}", RuntimeWarning, stacklevel=3)

    with open(path, "rb") as f:  # line by line: memory does not grow with the file
        unreadable = 0  # number of an unreadable line not yet known to be the last one
        for i, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            if unreadable:
                skip(f"skipped an unreadable line (line {unreadable})")
                unreadable = 0
            if filtered and _passed_over(raw, wanted, first, last):
                read += 1  # (a complete line of a supported version: not a reason to upgrade)
                continue
            try:
                rec = json.loads(raw)
            except (ValueError, RecursionError):
                # (RecursionError: JSON nested deeper than the interpreter's recursion limit,
                # ~1,000 levels of arrays in a hand-made line: a traceback out of the CLI)
                unreadable = i
                continue
            version = rec.get("version") if isinstance(rec, dict) else None
            if version not in SUPPORTED_VERSIONS:
                newer = type(version) is int and version > max(SUPPORTED_VERSIONS)
                if newer:
                    newest = max(newest, version)
                skip(
                    f"line {i} has schema version {version!r}"
                    + (" (written by a newer trainvitals)" if newer else "")
                    + f"; this reader supports {SUPPORTED_VERSIONS}"
                )
                continue
            step = rec.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                skip(f"line {i} has no integer 'step'")
                continue
            if not isinstance(rec.get("kind"), str):
                # (the no-match message sorts the kinds found: None beside "grad" was a
                # TypeError, exit 2 instead of 1; an unhashable kind broke the report)
                skip(f"line {i} has no 'kind' string")
                continue
            tensors = rec.get("tensors")
            if not isinstance(tensors, dict):
                # (the readers index rec["tensors"]: a KeyError traceback out of the CLI before)
                skip(f"line {i} has no 'tensors' object")
                continue
            fields = rec.get("fields", FIELDS)
            width = len(fields) if isinstance(fields, list | tuple) else -1
            vectors = tensors.values()
            if (
                width < 0
                or not all(type(f) is str for f in fields)  # (set() of a list: a TypeError)
                or not set(FIELDS) <= set(fields)
                # every vector a list of the fields' length (as sets of types and lengths: the
                # loop runs in C, where a generator over the vectors cost ~7% of the read)
                or not set(map(type, vectors)) <= {list}
                or not set(map(len, vectors)) <= {width}
            ):
                # (the merge indexes every vector by the fields: an IndexError before)
                skip(f"line {i} has a moment vector that does not match its 'fields'")
                continue
            types = set(map(type, itertools.chain.from_iterable(vectors)))
            if not _ELEMENT_TYPES.issuperset(types):
                # (a string in a hand-edited line failed the whole query in float(): "could
                # not convert string to float")
                skip(f"line {i} has a moment vector element that is not a number or null")
                continue
            if not _converts_to_float(tensors.values(), type(None) in types):
                # (the merge's float(): "OverflowError: int too large to convert to float", a
                # traceback out of the CLI)
                skip(f"line {i} has a moment vector element too large for a float")
                continue
            read += 1
            yield rec
    if skipped > MAX_LINE_WARNINGS:
        warnings.warn(
            f"{path}: {skipped - MAX_LINE_WARNINGS} more lines skipped (unreadable, of another "
            "schema version or incomplete)",
            RuntimeWarning,
            stacklevel=2,
        )
    if unreadable:  # reported last and always: a run that crashed while writing
        warnings.warn(
            f"{path}: skipped an unreadable line (last line: cut by a crash, or still being written by a live run)",
            RuntimeWarning,
            stacklevel=2,
        )
    if not read and newest:
        # Every line skipped, some of them of a newer format: say so, not "no record" (the
        # query's "is it a tensor_stats.jsonl file?", the report's page without tensors).
        raise NewerVersionError(
            f"{path} was written by a newer trainvitals (schema version {newest}; this one "
            f"reads up to version {max(SUPPORTED_VERSIONS)}): upgrade trainvitals to read it"
        )


#: The start of a line as ``TensorStatsMonitor`` writes it (compact separators, ``version``,
#: ``step`` and ``kind`` first; JSON integers have no leading zero), and its end: the
#: ``tensors`` object closing the line, or the activation kinds' ``micro_batches`` after it.
_LINE_START = re.compile(rb'\{"version":(0|[1-9][0-9]*),"step":(0|[1-9][0-9]*),"kind":"([a-z_]+)",')
_KEY_AGAIN = re.compile(rb'"(?:version|step|kind)":')  # (one search: a third of three finds)
_LINE_END = re.compile(rb'(?:\}|"micro_batches":(?:0|[1-9][0-9]*))\}\r?\n\Z')


def _passed_over(
    raw: bytes, kinds: frozenset[bytes] | None, first: int | None, last: int | None
) -> bool:
    """Whether ``raw`` (a line with its newline) is a record of a kind not in ``kinds`` or of a
    step outside ``first..last``, known without parsing it: it starts as the monitor writes a
    line (:data:`_LINE_START`) of a supported version, ends as a complete one does
    (:data:`_LINE_END`; a last line cut by a crash has no newline, and its warning stays),
    and names no ``version``, ``step`` or ``kind`` key again and holds no escape after its
    start (``json.loads`` keeps the last of repeated keys, and ``\\u006b`` spells ``k``): the
    record ``json.loads`` would give has that kind and step. Anything else is False: the line
    is parsed and checked."""
    m = _LINE_START.match(raw)
    if m is None or int(m[1]) not in SUPPORTED_VERSIONS:
        return False
    step = int(m[2])
    if not (
        (kinds is not None and m[3] not in kinds)
        or (first is not None and step < first)
        or (last is not None and step > last)
    ):
        return False  # a record the caller keeps
    start = m.end()
    return (
        _LINE_END.search(raw, len(raw) - 40) is not None
        and raw.find(b"\\", start) < 0
        and _KEY_AGAIN.search(raw, start) is None
    )


def _converts_to_float(vectors: Iterable[list[Any]], has_null: bool) -> bool:
    """Whether every element of ``vectors`` (numbers, and ``null`` where ``has_null``) converts
    to a float, as the merge converts them: an integer of 2**1024 - 2**970 or more in magnitude
    does not (OverflowError). JSON's ``1e400`` is parsed as inf, a float, but an integer literal
    of 309 digits or more is a Python int. One ``sum`` from a float start is the check, at C
    speed: floats and integers that fit a C long are added as doubles without a conversion
    that could fail, and any other integer is added as ``float + int``, the same conversion as
    ``float()`` (OverflowError where that fails). ``filter(None, ...)`` drops the nulls (and
    zeros, which cannot overflow)."""
    elements = itertools.chain.from_iterable(vectors)
    try:
        sum(filter(None, elements) if has_null else elements, 0.0)
    except OverflowError:
        return False
    return True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a run's files are read and merged (as it was
    before, after). Parsing a long JSONL file allocates millions of containers, none of them in
    a reference cycle, and the collector's repeated passes over them cost about a fifth of the
    report's time (measured: 26.4 s against 17.8 s with 1,600 lines of 1,000 tensors); objects
    are still freed by reference counting as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse_steps(
    steps: str | tuple[int | None, int | None] | int | None,
) -> tuple[int | None, int | None]:
    """``"100:200"`` (both ends included), ``"100:"``, ``":200"``, ``"150"``, ``(a, b)``, an int or
    None -> (first, last) with None for open ends."""
    if steps is None:
        return None, None
    if isinstance(steps, bool):
        raise TypeError("steps must be 'A:B', an int, a (first, last) pair or None")
    if isinstance(steps, int):
        return steps, steps
    if isinstance(steps, tuple | list) and len(steps) == 2:
        try:  # (an integer of any type, numpy's too, as an int; a float end was compared as
            # is, 1.5 showing step 2, and a str one failed in "<")
            if any(isinstance(e, bool) for e in steps):
                raise TypeError
            first, last = (None if e is None else operator.index(e) for e in steps)
        except TypeError:
            raise TypeError(f"steps: a (first, last) pair of ints or None, got {steps!r}") from None
    elif isinstance(steps, str):
        text = steps.strip()
        try:
            if ":" in text:
                a, b = text.split(":", 1)
                first = int(a) if a.strip() else None
                last = int(b) if b.strip() else None
            else:
                first = last = int(text)
        except ValueError:
            raise ValueError(
                f"steps must look like '100:200', '100:', ':200' or '150', got {steps!r}"
            ) from None
    else:
        raise TypeError(f"steps must be 'A:B', an int, a (first, last) pair or None, got {steps!r}")
    for end in (first, last):
        if end is not None and end < 0:
            raise ValueError(f"steps are counted from 0, got {steps!r}")
    if first is not None and last is not None and first > last:
        raise ValueError(f"steps: first step {first} is after last step {last}")
    return first, last


def matcher(group: str | None) -> Callable[[str], bool]:
    """A name predicate: ``re:<regex>`` (searched), ``glob:<glob>``, or a bare pattern that is a
    regex if it contains one of ``\\ ^ $ ( ) + | { }`` and a glob (fnmatch, whole name) otherwise."""
    if group is None:
        return lambda name: True
    if not isinstance(group, str):
        raise TypeError(f"group must be a glob or regex string, got {type(group).__name__}")
    if group.startswith("glob:"):
        glob = group[5:]
        return lambda name: fnmatch.fnmatchcase(name, glob)
    if group.startswith("re:") or _REGEX_CHARS.search(group):
        text = group[3:] if group.startswith("re:") else group
        try:
            rx = re.compile(text)
        except re.error as exc:
            raise ValueError(f"group is not a valid regex: {exc}") from exc
        return lambda name: rx.search(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, group)


def format_value(v: Any) -> str:
    """A table cell: 6 significant digits, ``-`` for none, ``NaN``/``inf``/``-inf`` spelt out
    (the query tool's table and the HTML report)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.6g}"
    return str(v)


def query(
    run_dir: str | Path,
    *,
    kind: str = "grad",
    group: str | None = None,
    stat: str | Sequence[str] = "kurtosis",
    steps: str | tuple[int | None, int | None] | int | None = None,
    by: str | None = None,
    per_tensor: bool = False,
) -> list[dict[str, Any]]:
    """Statistics of a group of tensors, step by step, merged exactly.

    Args:
        run_dir: the run folder (or the ``tensor_stats.jsonl`` file itself); a folder
            without its own whose subfolders hold exactly one is read from that one
            (:func:`tensor_stats_path`).
        kind: ``"param"``, ``"grad"``, ``"activation"`` or ``"dgrad"``.
        group: which tensors: a glob over full names (``"layers.*.mlp.*"``), a regex (prefix
            ``re:``, or any pattern with ``\\ ^ $ ( ) + | { }``), or None for all.
        stat: one name or a list from :data:`trainvitals.stats.moments.DERIVED` (``mean``,
            ``var``, ``std``, ``l2``, ``rms``, ``skewness``, ``kurtosis``,
            ``excess_kurtosis``, ``min``, ``max``, ``count``, ``nonfinite``) or ``"all"``.
        steps: ``"100:200"`` (inclusive), ``"100:"``, ``":200"``, ``"150"`` or None for all.
        by: regex with one capture group; tensors are grouped by the captured text (e.g.
            ``r"layers\\.(\\d+)\\."`` for the layer index) and each group merged separately.
            Numeric labels sort as numbers. Tensors the regex does not match are left out.
        per_tensor: one row per tensor instead of merging (``by`` is then ignored).

    Returns:
        Rows ``{"step", "kind", "group", "tensors", <stat>...}`` sorted by step, then group;
        ``group`` is the captured label (``by``), the tensor name (``per_tensor``) or ``"*"``;
        ``tensors`` is how many tensors were merged; undefined values (kurtosis of a constant
        tensor, statistics of no elements) are ``None``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    stats = list(DERIVED) if stat == "all" else [stat] if isinstance(stat, str) else list(stat)
    bad = [s for s in stats if s not in DERIVED]
    if bad or not stats:
        raise ValueError(f"stat must be 'all' or among {DERIVED}, got {stat!r}")
    first, last = parse_steps(steps)
    match = matcher(group)
    by_rx = None
    if by is not None and not per_tensor:
        try:
            by_rx = re.compile(by)
        except re.error as exc:
            raise ValueError(f"by is not a valid regex: {exc}") from exc
        if by_rx.groups != 1:
            raise ValueError(f"by must have exactly one capture group, got {by_rx.groups}")

    grouping = Grouping(match, by_rx, per_tensor)  # (its plans serve every chunk)

    def by_step(records: dict[int, dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
        out: dict[int, list[dict[str, Any]]] = {}
        for row in merge_grouped(records, kind, [(stats, grouping)])[0]:
            out.setdefault(row["step"], []).append(row)
        return out

    chunks = StepChunks(by_step)
    with gc_paused():  # millions of parsed containers, none in a cycle
        for rec in read_tensor_stats(run_dir, kinds=(kind,), first=first, last=last):
            if rec.get("kind") != kind:
                continue
            step = int(rec["step"])
            if (first is None or step >= first) and (last is None or step <= last):
                chunks.add(step, rec)
        chunks.flush()
    return [row for step in sorted(chunks.results) for row in chunks.results[step]]


class StepChunks:
    """Records of one kind, in file order, turned into results per step :data:`CHUNK_RECORDS`
    at a time, fewer where they hold :data:`CHUNK_TENSORS` tensors together, by ``reduce``
    (one call per chunk, from the chunk's records keyed by step to results keyed by step):
    memory holds one chunk of records and the results, not the file.
    A step read again (a resumed run) replaces what its earlier line gave: the later line
    wins. Used by :func:`query` and by the HTML report."""

    def __init__(self, reduce: Callable[[dict[int, dict[str, Any]]], dict[int, Any]]) -> None:
        self.results: dict[int, Any] = {}
        self._reduce = reduce
        self._pending: dict[int, dict[str, Any]] = {}
        self._tensors = 0  # the tensors of the records pending

    def add(self, step: int, record: dict[str, Any]) -> None:
        replaced = self._pending.get(step)
        if replaced is not None:
            self._tensors -= _size(replaced)
        self._pending[step] = record
        self._tensors += _size(record)
        if len(self._pending) >= CHUNK_RECORDS or self._tensors >= CHUNK_TENSORS:
            self.flush()

    def flush(self) -> None:
        """Reduce the records held (call once more after the last :meth:`add`)."""
        if not self._pending:
            return
        for step in self._pending:  # a step the reduction leaves out must not keep old results
            self.results.pop(step, None)
        self.results.update(self._reduce(self._pending))
        self._pending = {}
        self._tensors = 0


def _size(record: dict[str, Any]) -> int:
    """The tensors of a record (0 for a ``tensors`` that is not a collection)."""
    tensors = record.get("tensors")
    return len(tensors) if isinstance(tensors, dict) else 0


class Grouping:
    """How the tensors of a record are grouped for a merge: those ``match`` accepts, labelled
    by ``by_rx``'s capture (tensors it does not match are left out), by their own name
    (``per_tensor``) or all ``"*"``. The plan of a list of tensor names (which rows of the
    record take part, their labels in order, each row's label) is made once and reused for
    every record with the same names: a run writes the same tensors step after step, so the
    names are matched once per file rather than once per line."""

    #: plans kept; a run's records hold a few distinct lists of names (kinds, resumes)
    MAX_PLANS = 64

    def __init__(
        self, match: Callable[[str], bool], by_rx: re.Pattern[str] | None, per_tensor: bool
    ) -> None:
        self.match = match
        self.by_rx = None if per_tensor else by_rx
        self.per_tensor = per_tensor
        self._plans: dict[tuple[str, ...], tuple[np.ndarray, list[str], np.ndarray]] = {}

    def plan(self, names: tuple[str, ...]) -> tuple[np.ndarray, list[str], np.ndarray]:
        """(rows of the record taking part, their distinct labels in the order of the rows
        of :func:`merge_records`, each taking row's index into those labels)."""
        found = self._plans.get(names)
        if found is not None:
            return found
        rows: list[int] = []
        labels: list[str] = []
        for j, name in enumerate(names):
            if not self.match(name):
                continue
            if self.per_tensor:
                label = name
            elif self.by_rx is not None:
                m = self.by_rx.search(name)
                if m is None or m.group(1) is None:  # (an optional group that did not take part)
                    continue
                label = m.group(1)
            else:
                label = "*"
            rows.append(j)
            labels.append(label)
        # the label itself breaks ties ("01" and "1" have one natural key): a stable order
        distinct = sorted(set(labels), key=natural_order)
        pos = {g: i for i, g in enumerate(distinct)}
        found = (
            np.array(rows, dtype=np.intp),
            distinct,
            np.array([pos[g] for g in labels], dtype=np.int64),
        )
        if len(self._plans) >= self.MAX_PLANS:
            self._plans.clear()
        self._plans[names] = found
        return found


def record_moments(rec: dict[str, Any]) -> np.ndarray:
    """The moments of a record's tensors, ``[tensors, NUM_FIELDS]`` float64 in the order of
    :data:`FIELDS` (the record's ``fields`` may order them otherwise): one conversion of the
    parsed lists by numpy, the same values as ``float()`` of each element; ``null`` is the
    identity of ``min`` / ``max`` (+inf / -inf) and NaN elsewhere."""
    tensors = rec["tensors"]
    fields = list(rec.get("fields", FIELDS))
    vectors = list(tensors.values())
    values = np.array(vectors, dtype=np.float64).reshape(len(vectors), len(fields))
    col = [fields.index(f) for f in FIELDS]
    if col != list(range(len(fields))):
        values = values[:, col]
    for j, fill in ((FIELDS.index("min"), math.inf), (FIELDS.index("max"), -math.inf)):
        # numpy turns null into NaN: the few NaN cells are looked at one by one (a NaN written
        # in the file, which Python's json reads, stays NaN as float() keeps it)
        for i in np.flatnonzero(np.isnan(values[:, j])).tolist():
            if vectors[i][col[j]] is None:
                values[i, j] = fill
    return values


def merge_grouped(
    latest: dict[int, dict[str, Any]],
    kind: str,
    requests: Sequence[tuple[Sequence[str], Grouping]],
) -> list[list[dict[str, Any]]]:
    """The rows of :func:`merge_records` for each ``(stats, grouping)`` of ``requests`` over
    the same records, in one :func:`combine_moments`: each record's moments are converted to
    an array once (:func:`record_moments`), the rows taking part are picked by the grouping's
    cached plan, and every (request, step, group) is one output slot. The parts of a slot come
    in the same order as in a merge of its own (steps in order, a record's tensors in file
    order), so every number is the one such a merge gives."""
    steps = sorted(latest)
    moments: dict[int, np.ndarray] = {}
    names: dict[int, tuple[str, ...]] = {}
    parts: list[np.ndarray] = []
    owners: list[np.ndarray] = []
    layout: list[tuple[list[tuple[int, str]], list[int]]] = []  # per request: slots, counts
    total = 0
    for _, grouping in requests:
        slots: list[tuple[int, str]] = []
        counts: list[int] = []
        for step in steps:
            rec = latest[step]
            if step not in names:
                names[step] = tuple(rec["tensors"])
            rows, labels, index = grouping.plan(names[step])
            if not labels:
                continue
            if step not in moments:
                moments[step] = record_moments(rec)
            values = moments[step]
            parts.append(values if len(rows) == len(values) else values[rows])
            owners.append(index + (total + len(slots)))
            slots.extend((step, g) for g in labels)
            counts.extend(np.bincount(index, minlength=len(labels)).tolist())
        layout.append((slots, counts))
        total += len(slots)
    if not total:
        return [[] for _ in requests]
    merged = combine_moments(
        torch.from_numpy(np.concatenate(parts)), torch.from_numpy(np.concatenate(owners)), total
    )
    every = derive(merged)
    wanted = dict.fromkeys(s for stats, _ in requests for s in stats)
    derived = {s: every[s].tolist() for s in wanted}
    out: list[list[dict[str, Any]]] = []
    start = 0
    for (stats, _), (slots, counts) in zip(requests, layout, strict=True):
        rows_out: list[dict[str, Any]] = []
        for i, (step, g) in enumerate(slots):
            row: dict[str, Any] = {"step": step, "kind": kind, "group": g, "tensors": counts[i]}
            for s in stats:
                v = derived[s][start + i]
                row[s] = (
                    int(v)
                    if s in ("count", "nonfinite") and math.isfinite(v)
                    else (v if math.isfinite(v) else None)
                )
            rows_out.append(row)
        out.append(rows_out)
        start += len(slots)
    return out


def merge_records(
    latest: dict[int, dict[str, Any]],
    kind: str,
    stats: Sequence[str],
    match: Callable[[str], bool],
    by_rx: re.Pattern[str] | None,
    per_tensor: bool,
) -> list[dict[str, Any]]:
    """The rows of :func:`query` for ``latest`` (one record per step, keyed by step; arguments
    already checked), sorted by step, then group.

    Every (step, group) of the call is merged in one :func:`combine_moments` over all parts,
    not one per step: a chunk of hundreds of steps costs a few array operations
    (:func:`merge_grouped`, which merges several groupings of the same records at once)."""
    return merge_grouped(latest, kind, [(stats, Grouping(match, by_rx, per_tensor))])[0]
