"""The ``trainvitals`` command line (also ``python -m trainvitals``).

Subcommands register themselves in :data:`SUBCOMMANDS` as ``name -> (add_arguments, run)``:
``add_arguments(parser)`` declares the options and ``run(args) -> int`` does the work and
returns the exit code. Adding one is one function pair and one entry.

Example::

    trainvitals report runs/exp1                  # writes runs/exp1/report.html
    trainvitals query runs/exp1 --kind grad --group 'layers.*.mlp.*' --stat kurtosis \\
        --steps 100:200 --by 'layers\\.(\\d+)\\.' --format csv --output kurt.csv

Exit status (as grep's): 0 on success, 1 when ``query`` matched no row (it still writes the
header, and says why on stderr), 2 on an error (bad arguments, a missing or wrong file, a
contrived one: one line on stderr, not a traceback), 141
when the reader of stdout went away (``| head``), as for a tool that SIGPIPE ended.

A command runs torch on one thread unless ``OMP_NUM_THREADS`` is set (:func:`_one_torch_thread`);
``main`` called from Python gives its caller's thread count back.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import shlex
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["EXIT_ERROR", "EXIT_NO_MATCH", "EXIT_PIPE_CLOSED", "SUBCOMMANDS", "build_parser", "main"]

# Exit codes, as grep's: a script tells "nothing matched" from "the command failed".
#: ``trainvitals query`` found no row (the header is still written; stderr says why).
EXIT_NO_MATCH = 1
#: Bad arguments (argparse exits 2 too), a missing or wrong file, an unwritable ``--output``.
EXIT_ERROR = 2
#: The reader of stdout went away (``| head``): what the shell reports for a tool that
#: SIGPIPE ended (128 + 13), as grep's, not an error of the command.
EXIT_PIPE_CLOSED = 141
_EXIT_CODES = (
    "exit status: 0 when rows were written, 1 when nothing matched (the header alone is "
    "written and stderr says why), 2 on an error (bad arguments, a missing or wrong file), "
    "141 when the reader of stdout stopped early (`| head`)"
)


# ------------------------------------------------------------------------------------ query


def _add_query_arguments(p: argparse.ArgumentParser) -> None:
    from trainvitals.stats.moments import DERIVED

    p.epilog = _EXIT_CODES  # (argparse reads it when the help is printed)
    p.add_argument(
        "run_dir",
        help="run folder holding tensor_stats.jsonl (or the file itself; a folder whose "
        "subfolders, up to two levels down, hold exactly one, such as a logger's version_0/, "
        "reads that one)",
    )
    p.add_argument(
        "--kind",
        default="grad",
        choices=["param", "grad", "activation", "dgrad"],
        help="param (weights), grad (their gradients), activation (module inputs/outputs), "
        "dgrad (gradients flowing back into those); default: grad",
    )
    p.add_argument(
        "--group",
        default=None,
        help="tensors to merge: a glob over names ('layers.*.mlp.*'), or a regex (prefix 're:' "
        "or any pattern with \\ ^ $ ( ) + | { }); default all",
    )
    p.add_argument(
        "--stat",
        default="kurtosis",
        help=f"comma-separated statistics, or 'all': {', '.join(DERIVED)}; default: kurtosis",
    )
    p.add_argument("--steps", default=None, help="'100:200' (inclusive), '100:', ':200' or '150'")
    p.add_argument(
        "--by",
        default=None,
        help="regex with one capture group; merge each captured value separately "
        "(e.g. 'layers\\.(\\d+)\\.' for per-layer rows); tensors it does not match are left out",
    )
    p.add_argument("--per-tensor", action="store_true", help="one row per tensor, no merging")
    p.add_argument(
        "--format",
        default="table",
        choices=["table", "csv", "json"],
        help="table (aligned text), csv or json (one object per row); default: table",
    )
    p.add_argument("--output", "-o", default=None, help="write to this file instead of stdout")


def _run_query(args: argparse.Namespace) -> int:
    from trainvitals.report import query

    stat = (
        args.stat if args.stat == "all" else [s.strip() for s in args.stat.split(",") if s.strip()]
    )
    rows = query(
        args.run_dir,
        kind=args.kind,
        group=args.group,
        stat=stat,
        steps=args.steps,
        by=args.by,
        per_tensor=args.per_tensor,
    )
    if not rows:
        reason, not_stats = _why_empty(args)
        if not_stats:
            raise ValueError(reason)
    text = _format(rows, args.format, stat)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)  # as `trainvitals report -o` does
        out.write_text(text, encoding="utf-8", newline="")
    else:
        sys.stdout.write(text)
        sys.stdout.flush()  # (a closed pipe raises here, inside main, not at exit)
    if not rows:
        print(f"trainvitals query: no match: {reason}", file=sys.stderr)
        return EXIT_NO_MATCH
    return 0


def _why_empty(args: argparse.Namespace) -> tuple[str, bool]:
    """Why a query gave no rows, found by reading the file once more (only then): the message,
    and whether the file holds no tensor-statistics record at all (a wrong file: an error)."""
    from trainvitals.report.query import (
        matcher,
        parse_steps,
        read_tensor_stats,
        tensor_stats_path,
    )
    from trainvitals.report.sources import name_a_few

    first, last = parse_steps(args.steps)
    match = matcher(args.group)
    by_used = args.by is not None and not args.per_tensor  # (query compiled it already)
    spans: dict[str, tuple[int, int]] = {}
    in_steps = grouped = False
    # tensor names of the kind's last record holding any in the steps asked for (none: the
    # steps' measurements failed)
    names: list[str] = []
    with warnings.catch_warnings():  # the query already warned about skipped lines
        warnings.simplefilter("ignore")
        for rec in read_tensor_stats(args.run_dir):
            kind, step = rec.get("kind"), int(rec["step"])
            lo, hi = spans.get(kind, (step, step))
            spans[kind] = (min(lo, step), max(hi, step))
            if kind != args.kind or (first is not None and step < first):
                continue
            if last is not None and step > last:
                continue
            in_steps = True
            if rec["tensors"]:  # (a step whose measurement failed holds none)
                names = list(rec["tensors"])
            grouped = grouped or any(match(n) for n in rec["tensors"])
    if not spans:
        given = Path(args.run_dir)
        path = tensor_stats_path(given)
        if _holds_no_whole_line(path):
            # (a run that has not logged yet, or whose first line was cut: "is it a
            # tensor_stats.jsonl file?" of the very file the monitor writes misled)
            return (
                f"{path} holds no line yet: TensorStatsMonitor writes one per logging step "
                "and kind (none logged so far, or only a line cut by a crash)",
                True,
            )
        if given.is_file():
            return _query_of_a_wrong_file(Path(args.run_dir)), True
        return (
            f"{args.run_dir} holds no tensor-statistics record (is it a tensor_stats.jsonl "
            "file? `trainvitals report` reads the metrics files)",
            True,
        )
    held = ", ".join(f"{k} steps {lo}-{hi}" for k, (lo, hi) in sorted(spans.items()))
    if args.kind not in spans:
        return f"no {args.kind!r} records (the file holds {held})", False
    if not in_steps:
        return f"no {args.kind!r} records in steps {args.steps} (the file holds {held})", False
    if not names:
        where = f" in steps {args.steps}" if args.steps is not None else ""
        return f"the {args.kind!r} records{where} hold no tensor (not measured)", False
    if not grouped:
        sample = name_a_few(names, 3)
        return f"no {args.kind!r} tensor name matches --group {args.group!r} ({sample})", False
    if by_used:
        return f"no tensor name of --group {args.group!r} matches --by {args.by!r}", False
    return "no matching tensors", False


def _holds_no_whole_line(path: Path) -> bool:
    """Whether ``path`` holds no line end after any text: empty or blank, or its only text is
    a line cut by a crash (or still being written). Read in blocks."""
    text = False  # text seen: the next line end closes a whole line
    with open(path, "rb") as f:
        while block := f.read(1 << 16):
            if not text:
                rest = block.lstrip()
                if not rest:
                    continue
                text, block = True, rest
            if b"\n" in block:
                return False
    return True


def _format(rows: list[dict[str, Any]], fmt: str, stat: str | list[str]) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=1) + "\n"
    if rows:
        columns = list(rows[0])
    else:  # the header alone, with the columns asked for (a CSV reader still finds them)
        from trainvitals.stats.moments import DERIVED

        columns = ["step", "kind", "group", "tensors", *(DERIVED if stat == "all" else stat)]
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow(
                {
                    k: "" if v is None else (repr(v) if isinstance(v, float) else v)
                    for k, v in r.items()
                }
            )
        return buf.getvalue()
    from trainvitals.report.query import format_value

    cells = [[format_value(r[c]) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- report


def _add_report_arguments(p: argparse.ArgumentParser) -> None:
    from trainvitals.report.html import DEFAULT_MAX_POINTS

    p.epilog = "exit status: 0 when the report was written, 2 on an error"
    p.add_argument(
        "run_dir",
        help="run folder: metrics.jsonl (or TensorBoard event files, or a metrics.csv) and/or "
        "tensor_stats.jsonl, found in it or below it (a metrics file goes to --metrics)",
    )
    p.add_argument(
        "--output", "-o", default=None, help="the HTML file to write (default RUN_DIR/report.html)"
    )
    p.add_argument(
        "--metrics",
        default=None,
        help="the scalars: a JSONL file, a TensorBoard event file or folder, or a metrics CSV "
        "(default: metrics.jsonl, else event files, else metrics.csv, in RUN_DIR or under it)",
    )
    p.add_argument(
        "--keys",
        action="append",
        default=None,
        help="glob over metric keys to include, e.g. 'moe/*' (repeat for several; default all)",
    )
    p.add_argument("--steps", default=None, help="'100:200' (inclusive), '100:', ':200' or '150'")
    p.add_argument(
        "--max-points",
        type=int,
        default=DEFAULT_MAX_POINTS,
        help="most points drawn per line; longer series keep each bucket's min and max "
        f"(default {DEFAULT_MAX_POINTS})",
    )
    p.add_argument("--title", default=None, help="page title (default: the run folder's name)")


def _run_report(args: argparse.Namespace) -> int:
    from trainvitals.report.html import write_report

    if Path(args.run_dir).is_file():
        raise NotADirectoryError(_report_of_a_file(Path(args.run_dir), args.metrics))
    path = write_report(
        args.run_dir,
        args.output,
        metrics=args.metrics,
        keys=args.keys,
        steps=args.steps,
        max_points=args.max_points,
        title=args.title,
    )
    print(path)
    return 0


def _report_of_a_file(path: Path, metrics: str | None) -> str:
    """What to run instead of ``trainvitals report FILE``: the report takes a run folder, and a
    metrics file goes to ``--metrics`` (its folder is the run folder: the report is written
    there and its ``tensor_stats.jsonl`` is read)."""
    from trainvitals.report.query import TENSOR_STATS_FILE

    folder = shlex.quote(str(path.parent))
    head = f"{path} is a file, not a run folder"
    if path.name == TENSOR_STATS_FILE and metrics is None:
        return f"{head}: run `trainvitals report {folder}` (the folder holding it)"
    given = shlex.quote(str(path if metrics is None else Path(metrics)))
    return (
        f"{head}: a metrics file (JSONL, TensorBoard event file, CSV) goes to --metrics, "
        f"run `trainvitals report {folder} --metrics {given}`"
    )


def _query_of_a_wrong_file(path: Path) -> str:
    """What to run instead of ``trainvitals query FILE`` when FILE holds no tensor-statistics
    record (a metrics file, say)."""
    from trainvitals.report.query import TENSOR_STATS_FILE

    folder = shlex.quote(str(path.parent))
    todo = (
        f"the tensor statistics of its folder: `trainvitals query {folder}`; "
        if (path.parent / TENSOR_STATS_FILE).is_file() and path.name != TENSOR_STATS_FILE
        else f"`trainvitals query` reads the {TENSOR_STATS_FILE} of TensorStatsMonitor; "
    )
    return (
        f"{path} holds no tensor-statistics record: {todo}a metrics file is read by "
        f"`trainvitals report {folder} --metrics {shlex.quote(str(path))}`"
    )


# ------------------------------------------------------------------------------------ main

SUBCOMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {
    "query": (
        "exact statistics of tensor groups from tensor_stats.jsonl",
        _add_query_arguments,
        _run_query,
    ),
    "report": (
        "a self-contained HTML report of a run: its metrics and tensor statistics",
        _add_report_arguments,
        _run_report,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    from trainvitals import __version__

    parser = argparse.ArgumentParser(
        prog="trainvitals",
        description="Read trainvitals run files back.",
        epilog="exit status: 0 on success, 1 when `query` matched nothing, 2 on an error, 141 "
        "when the reader of stdout stopped early",
    )
    parser.add_argument("--version", action="version", version=f"trainvitals {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    original = warnings.formatwarning
    warnings.formatwarning = _short_warning  # type: ignore[assignment]
    try:
        with warnings.catch_warnings(), _one_torch_thread():
            warnings.simplefilter("default")
            return int(args._run(args))
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE_CLOSED
    except (ValueError, TypeError, OSError) as exc:  # OSError: `-o` naming a folder, say
        print(f"trainvitals {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except (OverflowError, RecursionError) as exc:
        # (what a contrived file can still raise where no reader names it, a number beyond a
        # C type or JSON nested past the recursion limit: one line, not a traceback)
        print(f"trainvitals {args.command}: error: unreadable input: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        warnings.formatwarning = original


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch's intra-op threads at 1 while a command runs, as they were after it (``main``
    called from a Python program leaves its count as it found it), unless ``OMP_NUM_THREADS``
    is set (the user's choice, which torch follows). The commands' torch work is merges of
    moments a chunk of records at a time (``combine_moments`` over ~10^4-10^5 rows): too small
    to gain from threads, and where the cores are busy (a training node, a shared login host)
    a second thread waits for a core at every operation. Measured on a busy 2-core host: one
    merge of 25,600 rows 1.1 ms with 1 thread against 43 ms with 2 (min of 20), a chunk of
    the report's merges 48 against 84 ms (min; medians 73 against 716 ms)."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _silence_stdout() -> None:
    """Point stdout at the null device: Python flushes it at exit, and the rest of the
    output would raise BrokenPipeError once more there (the Python docs' note on SIGPIPE)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass  # (a stdout without a file descriptor: nothing is flushed to a pipe at exit)


def _short_warning(message: Any, category: Any, *args: Any, **kwargs: Any) -> str:
    return f"warning: {message}\n"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
