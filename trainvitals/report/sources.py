"""Where a run's scalar metrics are read from, for :mod:`trainvitals.report.html`.

Three formats, found in this order when none is named:

1. ``metrics.jsonl``: the :class:`~trainvitals.adapters.JsonlSink` file (float64, exact;
   schema in :mod:`trainvitals.adapters.jsonl`), the one at the top of the run folder, else
   the only one below it;
2. TensorBoard event files (``events.out.tfevents.*``) anywhere under the run folder, of one
   run (see :func:`find_metrics`): what a Lightning ``TensorBoardLogger``, an Accelerate
   ``tensorboard`` tracker or a :class:`~trainvitals.adapters.TensorBoardSink` wrote (float32
   values, float64 ones from ``TensorBoardSink(double_precision=True)``; read with
   ``tensorboard``'s own reader, imported only then, its expected resumed-run messages
   silenced: :func:`_quiet_tensorboard_log`); a tag of a folder inside the run's folder
   (``SummaryWriter.add_scalars``) is keyed by its folder too (:func:`_subfolder_key`), and
   differently, with a warning, where that key is a tag of the run folder too;
3. a Lightning ``CSVLogger`` file (``metrics.csv``) anywhere under the run folder, only one: a
   ``step`` column and one column per key, empty where a key was not logged.

Lightning's ``epoch`` is an axis, not a metric, in both of Lightning's formats: its logger
connector adds ``epoch`` (the trainer's ``current_epoch``) to the metrics it hands to every
logger, so a ``TensorBoardLogger`` writes an ``epoch`` tag and a ``CSVLogger`` an ``epoch``
column beside ``step``. Neither is read (:data:`LIGHTNING_EPOCH`): the CSV column, and the
tag of a run folder holding Lightning's ``hparams.yaml`` (which ``TensorBoardLogger.save``
writes there); an ``epoch`` in any other event files (an Accelerate run's
``accelerator.log({"epoch": ...})``) or in a ``metrics.jsonl`` is a metric like any other.

A report shows one run: a format found in several run folders is an error naming them, and so
are two formats found in different run folders (event files in ``version_0``, a
``metrics.csv`` in ``version_1``). Formats in one folder, or one inside the other's folder
(the demo's ``metrics.jsonl`` beside its ``tensorboard/``), are one run.

Within a step, the value read last wins (a later line, a later event file of a resumed run).
The event files of one folder are read together, as TensorBoard reads a run, so a resumed run's
``purge_step`` (TensorBoardSink sets it) hides the earlier run's steps from that step on, the
float64 ones too (:func:`_purging_accumulator`).
"""

from __future__ import annotations

import bisect
import csv
import functools
import itertools
import logging
import operator
import os
import warnings
from array import array
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from trainvitals.adapters.jsonl import iter_jsonl

__all__ = ["MetricsSource", "StepValues", "find_metrics", "holds_values", "load_metrics"]

METRICS_FILE = "metrics.jsonl"
CSV_FILE = "metrics.csv"  # a Lightning CSVLogger's
_EVENTS_PREFIX = "events.out.tfevents."
_EVENTS = _EVENTS_PREFIX + "*"
#: the key Lightning's logger connector adds to the metrics of every logger (``current_epoch``)
LIGHTNING_EPOCH = "epoch"
#: what Lightning's ``TensorBoardLogger.save`` writes beside its event files (and Accelerate's
#: tracker does not: it writes ``hparams.yml``)
LIGHTNING_HPARAMS = "hparams.yaml"


class StepValues:
    """One metric's points in two typed arrays, steps (int64) and values (float64): 16 bytes a
    point, where a dict entry of boxed ints and floats costs about ten times that (a long run's
    millions of points are what bounds the report's memory). Points are appended in file
    order (:meth:`append`, or the arrays' own ``append``, as :func:`load_metrics` does);
    :meth:`finish` sorts them by step and keeps one value per step, the one read last (a
    resumed run's repeated steps), which costs one comparison a point when the steps came in
    increasing order."""

    __slots__ = ("steps", "values")

    def __init__(self) -> None:
        self.steps = array("q")
        self.values = array("d")

    def append(self, step: int, value: float) -> None:
        self.steps.append(step)
        self.values.append(value)

    def finish(self) -> StepValues:
        steps, values = self.steps, self.values
        # strictly increasing already (the usual case): one pass in C, no per-point Python
        if not all(map(operator.lt, steps, itertools.islice(steps, 1, None))):
            order = sorted(range(len(steps)), key=steps.__getitem__)  # stable: file order kept
            last = [i for i, j in itertools.pairwise(order) if steps[i] != steps[j]]
            last.append(order[-1])
            self.steps = array("q", [steps[i] for i in last])
            self.values = array("d", [values[i] for i in last])
        return self

    def get(self, step: int, default: float) -> float:
        """The value at ``step`` (after :meth:`finish`), or ``default``."""
        i = bisect.bisect_left(self.steps, step)
        return self.values[i] if i < len(self.steps) and self.steps[i] == step else default


@dataclass
class MetricsSource:
    """The scalars of a run: ``values[key]``, the :class:`StepValues` of each key (finished:
    in step order, one value per step), the wall times of the points kept (Unix seconds, for
    the span shown; one per TensorBoard event or JSONL line, in a float64 array: 8 bytes each,
    where a list of boxed floats cost 32, about 128 MB for 4M events) and a line saying where
    they came from."""

    values: dict[str, StepValues] = field(default_factory=dict)
    times: array = field(default_factory=lambda: array("d"))
    description: str = ""


def find_metrics(run_dir: Path) -> Path | None:
    """The metrics source of ``run_dir`` in the order of the module docstring (a folder for
    TensorBoard: the one holding the event files), or None.

    Raises ``FileNotFoundError`` naming them when the first format found below ``run_dir``
    belongs to several run folders (``lightning_logs/`` holding ``version_0`` and
    ``version_1``): picking one, the first in name order, would show the oldest run as the
    current one. The event files of one folder are one run (a resumed run adds one there), and
    so are those in folders below it (``SummaryWriter.add_scalars`` writes a folder per key
    inside the run's folder); ``run_dir`` itself holding event files is that one run.

    Also an error naming both: a later format found in a run folder that is neither the chosen
    source's folder nor inside or around it (TensorBoard event files in ``version_0`` and a
    ``metrics.csv`` in ``version_1``), which the first format found would hide. A Lightning
    ``Trainer`` with a ``TensorBoardLogger`` and a ``CSVLogger`` of one ``save_dir`` and
    ``name`` writes them to two version folders too (each logger takes the next free version),
    which cannot be told from two runs: either folder given is that run.
    """
    top = run_dir / METRICS_FILE
    if top.is_file():  # (everything else is below its folder: the same run)
        return top
    jsonls, event_dirs, csvs = _metrics_files(run_dir)
    event_runs = [d for d in event_dirs if not any(o in d.parents for o in event_dirs)]
    # each format found, in the order of the docstring: its sources and their run folders
    formats = [
        (what, found, folders)
        for what, found, folders in (
            (f"a {METRICS_FILE}", jsonls, [f.parent for f in jsonls]),
            ("TensorBoard event files", event_runs, event_runs),
            (f"a {CSV_FILE}", csvs, [f.parent for f in csvs]),
        )
        if found
    ]
    if not formats:
        return None
    what, found, folders = formats[0]
    chosen = _only_run(run_dir, found, what)
    folder = folders[found.index(chosen)]
    # a later format in a folder neither this one, nor inside it, nor around it: another run
    apart = [
        (other, other_what)
        for other_what, _, other_folders in formats[1:]
        for other in other_folders
        if not (other == folder or other in folder.parents or folder in other.parents)
    ]
    if apart:
        listed = [(folder, what), *apart]
        names = name_a_few(f"{f} ({w})" for f, w in listed)
        raise FileNotFoundError(
            f"{run_dir} holds no {METRICS_FILE} at its top and the metrics below it are in "
            f"different run folders: {names}; a report shows one run: give one of these "
            "run folders as the run folder (or name the metrics: --metrics, metrics=). "
            "(A Lightning Trainer with both a TensorBoardLogger and a CSVLogger also writes "
            "each to a version folder of its own; then either folder is that run.)"
        )
    return chosen


def _metrics_files(run_dir: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """The ``metrics.jsonl`` files, the folders holding event files and the ``metrics.csv``
    files below ``run_dir``, each in name order, from one walk of the tree (a run folder may
    hold checkpoints and other runs' files: walked once, not once per format)."""
    jsonls: list[Path] = []
    event_dirs: set[Path] = set()
    csvs: list[Path] = []
    for folder, _, names in os.walk(run_dir):
        here = Path(folder)
        for name in names:
            if name == METRICS_FILE:
                jsonls.append(here / name)
            elif name == CSV_FILE:
                csvs.append(here / name)
            elif name.startswith(_EVENTS_PREFIX):
                event_dirs.add(here)
    return sorted(jsonls), sorted(event_dirs), sorted(csvs)


def name_a_few(items: Iterable[object], limit: int = 5) -> str:
    """The first ``limit`` of ``items``, comma-separated, with ``, ...`` when there are more:
    the files or folders an error names."""
    items = list(items)
    return ", ".join(str(i) for i in items[:limit]) + (", ..." if len(items) > limit else "")


def _only_run(run_dir: Path, found: list[Path], what: str) -> Path:
    if len(found) == 1:
        return found[0]
    folders = [p.parent if p.is_file() else p for p in found]
    names = name_a_few(folders)
    raise FileNotFoundError(
        f"{run_dir} holds no {METRICS_FILE} at its top and {len(found)} run folders below it "
        f"hold {what}: {names}; a report shows one run: give one of these different run "
        "folders as the run folder (or name the metrics: --metrics, metrics=)"
    )


def load_metrics(
    path: Path, keep: Callable[[str], bool], first: int | None, last: int | None
) -> MetricsSource:
    """Read the scalars of ``path`` (a ``.jsonl`` file, a ``.csv`` file, a TensorBoard event
    file or a folder of them), keeping the keys ``keep`` accepts and ``first <= step <= last``."""
    src = MetricsSource()

    def shown(step: int) -> bool:
        return (first is None or step >= first) and (last is None or step <= last)

    def add(key: str, step: int, value: float) -> None:
        if not shown(step):
            return
        points = src.values.get(key)
        if points is None:
            if not keep(key):
                return
            points = src.values[key] = StepValues()
        points.append(step, value)

    try:
        _read_into(src, path, add, shown, keep, first, last)
    except OverflowError:
        # (the step arrays are int64: a step of 2**63 or more, or a CSV's 1e30, ended the
        # report with a traceback; no trainer counts that far)
        raise ValueError(
            f"{path}: a step outside the 64-bit integer range (-2**63 to 2**63 - 1): "
            "not a step count a run writes"
        ) from None
    except RecursionError:
        # (json.loads of a line nested deeper than the recursion limit, in iter_jsonl)
        raise ValueError(f"{path}: a line nested too deeply to be read as JSON") from None
    for points in src.values.values():
        points.finish()
    return src


def holds_values(path: Path) -> bool:
    """Whether the metrics source ``path`` (as for :func:`load_metrics`) holds at least one
    readable value, of any key and step; reads up to the first one. Its unreadable lines are
    not warned about again (the caller read it once already)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if path.is_dir() or path.name.startswith("events.out.tfevents."):
            files = sorted(path.rglob(_EVENTS)) if path.is_dir() else [path]
            values: Iterator[object] = _tensorboard_scalars(
                files, path if path.is_dir() else None, set()
            )
        elif path.suffix == ".csv":
            values = _csv_scalars(path)
        else:
            values = (rec for rec in iter_jsonl(path) if rec["metrics"])
        try:
            return next(values, None) is not None
        finally:
            values.close()  # type: ignore[attr-defined]  # (generators: the file is closed now)


def _read_into(
    src: MetricsSource,
    path: Path,
    add: Callable[[str, int, float], None],
    shown: Callable[[int], bool],
    keep: Callable[[str], bool],
    first: int | None,
    last: int | None,
) -> None:
    """The reading of :func:`load_metrics`: every point of ``path`` into ``src`` (unfinished)
    and its description."""
    if path.is_dir() or path.name.startswith("events.out.tfevents."):
        files = sorted(path.rglob(_EVENTS)) if path.is_dir() else [path]
        if not files:
            raise FileNotFoundError(f"no TensorBoard event files under {path}")
        precisions: set[str] = set()  # shown beside the source: float32 is not exact
        root = path if path.is_dir() else None
        for step, key, value, wall in _tensorboard_scalars(files, root, precisions):
            add(key, step, value)
            if shown(step):  # (the wall time of the steps shown, as the span beside it)
                src.times.append(wall)
        kinds = " and ".join(sorted(precisions)) or "no"
        src.description = f"{path} ({len(files)} TensorBoard event file(s), {kinds} values)"
    elif path.suffix == ".csv":
        rows = 0
        for step, key, value in _csv_scalars(path):
            add(key, step, value)
            rows += 1
        src.description = f"{path} (CSV, {rows} values)"
    else:
        lines = 0
        # key -> the appends of its arrays, or None for a key ``keep`` refuses: the loop below
        # is the report's inner loop (a point per key and line), so one dict lookup a point
        appends: dict[str, tuple[Callable[[int], None], Callable[[float], None]] | None] = {}
        add_time = src.times.append
        # one record at a time: memory holds the kept values only; the lines of other steps
        # are passed over unparsed where their start says their step
        for rec in iter_jsonl(path, first=first, last=last):
            step = rec["step"]
            if (first is not None and step < first) or (last is not None and step > last):
                continue
            lines += 1
            add_time(rec["time"])
            for key, value in rec["metrics"].items():
                try:
                    to = appends[key]
                except KeyError:
                    to = appends[key] = _appends(src, key) if keep(key) else None
                if to is not None:
                    to[0](step)
                    to[1](value)
        shown_only = " in the steps shown" if first is not None or last is not None else ""
        src.description = f"{path} ({lines} line{'s' * (lines != 1)}{shown_only})"


def _appends(src: MetricsSource, key: str) -> tuple[Callable[[int], None], Callable[[float], None]]:
    """The ``append`` of the step and value arrays of ``key``'s new :class:`StepValues`."""
    points = src.values[key] = StepValues()
    return points.steps.append, points.values.append


def _tensorboard_scalars(
    files: list[Path], root: Path | None, precisions: set[str]
) -> Iterator[tuple[int, str, float, float]]:
    """The scalars of ``files`` (sorted), read per folder when ``root`` (a folder, which
    ``files`` are every event file under), else per file; adds the dtypes read to
    ``precisions``. A tag of a folder inside a run folder (the top-most folders holding event
    files) is keyed by :func:`_subfolder_key`; the run folder is read first, and a tag whose
    key a tag of another folder already took is keyed ``tag/<folder>`` instead, with a warning
    (:func:`_distinct_key`). Lightning's ``epoch`` tag is skipped (module docstring)."""
    try:
        from tensorboard.util.tensor_util import make_ndarray

        accumulator = _purging_accumulator()
    except ImportError as exc:  # pragma: no cover - tensorboard is in the dev extra
        raise FileNotFoundError(
            "reading TensorBoard event files needs the tensorboard package "
            "(pip install tensorboard), or write JSONL with JsonlSink"
        ) from exc
    # One accumulator per folder, as TensorBoard reads a run: its files in name order (the names
    # start with their creation time), so a resumed run's SummaryWriter(purge_step=N) (what
    # TensorBoardSink opens on resume) hides the earlier file's steps >= N, the float64 tensor
    # events too (_purging_accumulator). Read file by file, those abandoned steps stayed in the
    # report beyond the steps the resumed run re-logged.
    sources = list(dict.fromkeys(f.parent for f in files)) if root is not None else files
    # the run folder first (its tags keep their names: the subfolders' keys give way to them)
    sources = sorted(sources, key=lambda f: len(f.parts))  # (stable: name order otherwise)
    # the run folders: those holding event files not inside another such folder (``root``
    # itself, or the one folder under it holding them, as find_metrics finds it)
    tops = (
        [f for f in sources if not any(o in f.parents for o in sources)] if root is not None else []
    )
    if len(tops) > 1:  # (find_metrics refuses them too; a folder given by --metrics was read
        # as one run: a later version's steps hid an earlier one's, the rest mixed in)
        raise FileNotFoundError(
            f"{root} holds the TensorBoard event files of {len(tops)} run folders: "
            f"{name_a_few(tops)}; a report shows one run: give one of them (--metrics, metrics=)"
        )
    claimed: dict[str, tuple[str, str]] = {}  # key -> (folder below the run folder, tag)
    for f in sources:
        top = next((t for t in tops if t in f.parents), f)
        below = "" if f == top else f.relative_to(top).as_posix()
        run_folder = top if f.is_dir() else f.parent
        lightning = not below and (run_folder / LIGHTNING_HPARAMS).is_file()
        # (size 0: keep every event; the default samples 10,000 scalars and 10 tensors per tag)
        acc = accumulator(os.fspath(f), size_guidance={"scalars": 0, "tensors": 0})
        with _quiet_tensorboard_log():
            acc.Reload()
        tags = acc.Tags()
        scalar_tags = tags.get("scalars", [])
        # New-style scalars are one-element tensors of the scalars plugin: what
        # TensorBoardSink(double_precision=True) writes (float64) and torch's
        # add_scalar(..., new_style=True); Scalars() does not return them.
        tensor_tags = [
            tag
            for tag in tags.get("tensors", [])
            if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
        ]
        keys = {  # (Lightning's epoch: an axis, as the CSV reader skips its column)
            tag: _distinct_key(claimed, tag, below)
            for tag in dict.fromkeys([*scalar_tags, *tensor_tags])
            if not (lightning and tag == LIGHTNING_EPOCH)
        }
        for tag in scalar_tags:
            if (key := keys.get(tag)) is None:
                continue
            precisions.add("float32")  # (simple_value is a float32 field)
            for event in acc.Scalars(tag):
                yield event.step, key, float(event.value), event.wall_time
        for tag in tensor_tags:
            if (key := keys.get(tag)) is None:
                continue
            for tensor_event in acc.Tensors(tag):
                array = make_ndarray(tensor_event.tensor_proto)
                if array.size == 1 and array.dtype.kind == "f":
                    precisions.add(str(array.dtype))
                    yield tensor_event.step, key, float(array.item()), tensor_event.wall_time


#: The starts of the messages tensorboard's reader logs (WARNING, through the ``tensorboard``
#: logger, which Python prints to stderr when logging is not configured) for what a resumed
#: run's folder holds by design (tensorboard 2.21, ``event_accumulator.py``): the purge of the
#: earlier run's steps from a resumed run's first step on (``SummaryWriter(purge_step=N)``:
#: "Detected out of order event.step likely caused by a TensorFlow restart. Purging ...", with
#: the counts removed), and each run's ``add_graph`` (a Lightning ``log_graph=True``): a graph
#: event and its ``run metadata`` event (tag ``step1``) per run. Printed by ``trainvitals
#: report``, they read like errors; any other message of the reader is kept.
_EXPECTED_TENSORBOARD_MESSAGES = (
    "Detected out of order event.step",
    "Found more than one graph event per run",
    "Found more than one metagraph event per run",
    'Found more than one "run metadata" event with tag',
)


class _ExpectedTensorBoardMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_EXPECTED_TENSORBOARD_MESSAGES)


@contextmanager
def _quiet_tensorboard_log() -> Iterator[None]:
    """Drop tensorboard's :data:`_EXPECTED_TENSORBOARD_MESSAGES` logged while inside (a filter
    on the ``tensorboard`` logger, which the reader logs to directly, removed on leaving)."""
    log = logging.getLogger("tensorboard")
    quiet = _ExpectedTensorBoardMessages()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


@functools.cache
def _purging_accumulator() -> type:
    """tensorboard's legacy ``EventAccumulator``, purging its tensor events as it purges its
    scalars. On a resumed run's ``SessionLog.START`` event of step N (what
    ``SummaryWriter(purge_step=N)`` writes first; files of ``file_version`` 2 and later) it
    drops every event of a step >= N read before it, and in older files, on a step going back,
    those of the event's tags; but only from ``accumulated_attrs`` (scalars, histograms,
    compressed histograms, images, audio: tensorboard 2.21), not from its tensors. The
    new-style scalars (``TensorBoardSink(double_precision=True)``, float64) are tensor events:
    a resume at step 5 of a run that had logged steps 0..9 kept its steps 8 and 9 in the
    report behind the resumed run's 5..7. The same filter, applied at the same points, drops
    them too. (Not added to ``accumulated_attrs``: its purge warning formats one count per
    entry of it, five, and a sixth raised ``TypeError``.)"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class PurgingAccumulator(EventAccumulator):
        def _Purge(self, event, by_tags):  # (overrides tensorboard's method)
            def kept(item) -> bool:
                return item.step < event.step  # (as EventAccumulator._Purge keeps them)

            if by_tags:
                for value in event.summary.value:
                    self.tensors.FilterItems(kept, value.tag)
            else:
                self.tensors.FilterItems(kept)
            super()._Purge(event, by_tags)

    return PurgingAccumulator


def _subfolder_key(tag: str, below: str) -> str:
    """The key of ``tag`` read from the folder ``below`` the run folder (``""``: the run folder
    itself, the key is the tag). ``SummaryWriter.add_scalars(main_tag, {name: value}, step)``
    (what Lightning's ``TensorBoardLogger`` and Accelerate's ``tensorboard`` tracker call for a
    dict value) writes each name to a folder ``<main_tag with / as _>_<name>`` under the tag
    ``main_tag``: those are keyed ``main_tag/name``, the key
    ``FanoutWriter.add_scalars(main_tag, {...})`` writes, and any other folder's tags
    ``tag/<folder>``. Keyed by the tag alone, every name of one ``add_scalars`` call fell on one
    key and the folder read last hid the others (``lr`` of two parameter groups showed the
    second group's values only). The key may be a tag of the run folder too (``lr/pg1``
    logged with ``add_scalar`` and ``add_scalars("lr", {"pg1": ...})``, which TensorBoard
    shows as two runs): :func:`_distinct_key` keeps them apart."""
    if not below:
        return tag
    prefix = tag.replace("/", "_") + "_"
    if below.startswith(prefix) and len(below) > len(prefix):  # (a name with / makes subfolders)
        return f"{tag}/{below[len(prefix) :]}"
    return f"{tag}/{below}"


def _distinct_key(claimed: dict[str, tuple[str, str]], tag: str, below: str) -> str:
    """The key of ``tag`` of the folder ``below`` the run folder (:func:`_subfolder_key`),
    recorded in ``claimed`` (key -> folder and tag). A key another folder's tag already took (the
    run folder is read first, so its tags keep their names) becomes ``tag/<folder>``, then
    ``... (2)``, ``(3)``..., with a ``RuntimeWarning`` naming both: merged, the two series
    showed one value per step, the one read last, and the other was lost without a word."""
    key = _subfolder_key(tag, below)
    owner = claimed.setdefault(key, (below, tag))
    if owner == (below, tag):
        return key
    taken = key
    key = f"{tag}/{below}"
    n = 1
    while claimed.setdefault(key, (below, tag)) != (below, tag):
        n += 1
        key = f"{tag}/{below} ({n})"
    other = f"the folder {owner[0]}'s tag" if owner[0] else "a tag of the run folder"
    warnings.warn(
        f"TensorBoard: the tag {tag!r} of the folder {below} is shown as {key!r}, since its key "
        f"{taken!r} is {other} ({owner[1]!r})",
        RuntimeWarning,
        stacklevel=2,
    )
    return key


def _csv_scalars(path: Path) -> Iterator[tuple[int, str, float]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError(f"{path}: a metrics CSV needs a 'step' column")
        for row in reader:
            try:
                step = int(float(row["step"]))
            except (TypeError, ValueError, OverflowError):  # (OverflowError: a step of inf)
                continue
            for key, text in row.items():
                # (LIGHTNING_EPOCH: an axis, not a metric; see the module docstring)
                if key in ("step", LIGHTNING_EPOCH) or text in (None, ""):
                    continue
                try:
                    value = float(text)  # also 'nan', 'inf'
                except ValueError:
                    continue
                yield step, key, value
