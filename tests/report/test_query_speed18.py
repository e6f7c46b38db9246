"""Reading only what is asked (session 18): ``query`` and ``read_tensor_stats(kinds=, first=,
last=)`` pass over the lines of other kinds and of steps outside ``--steps`` without parsing
them, and the report's ``metrics.jsonl`` reader appends each point to its key's arrays with
one lookup. Every record, row and point is checked against a slow independent reading
(``json.loads`` of every line) of files with the edge cases: a line of another kind naming the
asked kind in its tensor names, a tensor named ``kind``, a repeated ``kind`` key (plain and
spelt with an escape), a line cut mid-file and a last line cut by a crash, a resumed run's
repeated steps, a line of a newer version, a line with spaces, and ``--steps`` bounds; the
warnings are those of a reading of every line."""

from __future__ import annotations

import importlib
import json
import math
import random
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainvitals.adapters.jsonl import decode_value
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor
from trainvitals.report import query, read_tensor_stats
from trainvitals.report.query import matcher, merge_records, parse_steps
from trainvitals.report.sources import load_metrics
from trainvitals.stats.moments import DERIVED, FIELDS

query_module = importlib.import_module("trainvitals.report.query")

KINDS = ("param", "grad", "activation", "dgrad")
NAMES = [f"model.layers.{i}.mlp.{p}.weight" for i in range(3) for p in ("up", "down")]
#: tensor names of the param lines that hold the other kinds' names
DECOYS = ["model.grad_proj.weight", "activation.dgrad", "grad"]


def vector(rng: random.Random) -> list[float | int | None]:
    n = rng.randint(1, 50)
    lo, hi = -rng.random() * 3, rng.random() * 3
    return [n, rng.gauss(0, 1), n * rng.random(), rng.gauss(0, 1), n * 3 * rng.random(), lo, hi, 0]


def line(step: int, kind: str, rng: random.Random, names: list[str] | None = None) -> str:
    """A line as ``TensorStatsMonitor`` writes it (compact, ``micro_batches`` last for the
    activation kinds)."""
    names = NAMES + DECOYS if names is None and kind == "param" else names or NAMES
    rec: dict[str, Any] = {"version": 1, "step": step, "kind": kind, "time": 1e9 + step}
    rec.update(fields=list(FIELDS), tensors={n: vector(rng) for n in names})
    if kind in ("activation", "dgrad"):
        rec["micro_batches"] = 2
    return json.dumps(rec, separators=(",", ":"))


def write_edge_cases(path: Path) -> None:
    rng = random.Random(18)
    lines = []
    for step in range(10):
        lines += [line(step, kind, rng) for kind in KINDS]
        if step == 3:  # a param line cut mid-file, then the next append on a line of its own
            lines.append(line(step, "param", rng)[:150])
    # a param line with a tensor named "kind", and param lines repeating their "kind" key
    # (json.loads keeps the last one: these are grad records)
    lines.append(line(4, "param", rng, [*NAMES, "kind"]))
    lines.append(line(4, "param", rng)[:-1] + ',"kind":"grad"}')
    lines.append(line(5, "param", rng)[:-1] + ',"\\u006bind":"grad"}')
    lines.append(line(5, "dgrad", rng, [*NAMES, 'x."kind":"grad"']))  # a quote in a name
    # a resumed run: steps 6..8 again, every kind
    for step in (6, 7, 8):
        lines += [line(step, kind, rng) for kind in KINDS]
    lines.append(line(9, "param", rng).replace('{"version":1,', '{"version":2,'))  # newer
    rec = json.loads(line(10, "grad", rng))
    lines.append(json.dumps(rec))  # spaces after the separators
    lines.append(line(10, "activation", rng, [*NAMES, "café"]))  # an escape in a name
    lines.append(line(11, "dgrad", rng))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n" + line(12, "param", rng)[:200])  # cut by a crash


def slow_latest(path: Path, kind: str, first: int | None, last: int | None) -> dict[int, dict]:
    """The records of ``kind`` in ``first..last``, later lines winning: ``json.loads`` of every
    line, version 1 only."""
    latest: dict[int, dict] = {}
    for raw in path.read_bytes().splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        step = rec["step"]
        if rec["version"] != 1 or rec["kind"] != kind:
            continue
        if (first is None or step >= first) and (last is None or step <= last):
            latest[step] = rec
    return latest


def read_recorded(path: Path, **kwargs: Any) -> tuple[list[dict], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = list(read_tensor_stats(path, **kwargs))
    return records, [str(w.message) for w in caught]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("steps", [None, "3:7", "7", ":4", "9:"])
def test_filtered_reading_gives_the_records_of_reading_every_line(
    tmp_path: Path, kind: str, steps: str | None
) -> None:
    path = tmp_path / "tensor_stats.jsonl"
    write_edge_cases(path)
    first, last = parse_steps(steps)
    expected = slow_latest(path, kind, first, last)
    assert expected  # (every case has records)

    records, messages = read_recorded(path, kinds=(kind,), first=first, last=last)
    got: dict[int, dict] = {}
    for rec in records:  # (records of other kinds and steps may come too: the caller filters)
        step = rec["step"]
        if (
            rec["kind"] == kind
            and (first is None or step >= first)
            and (last is None or step <= last)
        ):
            got[step] = rec
    assert got == expected
    # the lines not passed over were read and warned about as in a reading of every line
    _, every_line = read_recorded(path)
    assert messages == every_line
    assert any("cut by a crash" in m for m in messages)
    assert any("unreadable line (line 17)" in m for m in messages)
    assert any("schema version 2" in m for m in messages)

    rows = query(path, kind=kind, stat="all", steps=steps)
    assert rows == merge_records(expected, kind, list(DERIVED), matcher(None), None, False)
    for row in rows:  # and two numbers from the records by hand
        parts = list(expected[row["step"]]["tensors"].values())
        n = math.fsum(p[0] for p in parts)
        assert row["count"] == n
        assert row["mean"] == pytest.approx(math.fsum(p[0] * p[1] for p in parts) / n, rel=1e-12)


def test_the_repeated_kind_keys_are_grad_records(tmp_path: Path) -> None:
    """The param lines that repeat ``kind`` are read (not passed over as param lines)."""
    path = tmp_path / "tensor_stats.jsonl"
    write_edge_cases(path)
    steps = {r["step"]: sorted(r["tensors"]) for r in slow_latest(path, "grad", 4, 5).values()}
    assert steps == {4: sorted(NAMES + DECOYS), 5: sorted(NAMES + DECOYS)}
    rows = query(path, kind="grad", stat="count", steps="4:5")
    n = len(NAMES + DECOYS)
    assert [(r["step"], r["tensors"]) for r in rows] == [(4, n), (5, n)]


def _monitor_run(run_dir: Path, steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kernel="eager", summaries=False)
    with Vitals([monitor], run_dir=run_dir, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        for _ in range(steps):
            x = torch.randn(3, 4)
            vitals.batch(x)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize(("kind", "steps"), [("grad", None), ("activation", "2:3"), ("param", "4")])
def test_lines_the_query_does_not_keep_are_not_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, steps: str | None
) -> None:
    """A file of the real monitor: only the asked kind's lines in the steps asked are parsed,
    and the rows are those of the records of every line parsed."""
    _monitor_run(tmp_path, 6)
    path = tmp_path / "tensor_stats.jsonl"
    written = [json.loads(raw) for raw in path.read_bytes().splitlines()]
    assert sorted({r["kind"] for r in written}) == sorted(KINDS)
    first, last = parse_steps(steps)
    expected = slow_latest(path, kind, first, last)
    parsed: list[bytes] = []

    def loads(raw: bytes) -> Any:
        parsed.append(raw)
        return json.loads(raw)

    monkeypatch.setattr(query_module, "json", types.SimpleNamespace(loads=loads))
    rows = query(tmp_path, kind=kind, stat="all", steps=steps)
    assert rows == merge_records(expected, kind, list(DERIVED), matcher(None), None, False)
    assert len(rows) == len(expected) > 0
    assert len(parsed) == len(expected)  # (one line a step and kind here)
    assert {(r["step"], r["kind"]) for r in map(json.loads, parsed)} == {
        (s, kind) for s in expected
    }


# ------------------------------------------------------------------------- metrics.jsonl


def write_metrics(path: Path) -> None:
    rng = random.Random(7)
    lines = []
    for step in [*range(10), 5, 6, 7, 12]:  # repeated steps: values logged after a flush
        metrics: dict[str, Any] = {k: rng.gauss(0, 1) for k in ("a/x", "a/y", "b/z")}
        if step % 4 == 1:
            metrics["b/z"] = "NaN"
            metrics["late/key"] = rng.randint(-5, 5)  # an integer value
        lines.append(json.dumps({"step": step, "time": 1e9 + step, "metrics": metrics}))
    path.write_text("\n".join(lines) + '\n{"step":13,"time":1.0,"metrics":{"a/x":1.', "utf-8")


def slow_points(path: Path, keep: Any, first: int | None, last: int | None) -> dict[str, list]:
    """key -> [(step, value)] in step order, the last line of a step winning."""
    out: dict[str, dict[int, float]] = {}
    for raw in path.read_bytes().splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        step = rec["step"]
        if (first is not None and step < first) or (last is not None and step > last):
            continue
        for key, value in rec["metrics"].items():
            if keep(key):
                out.setdefault(key, {})[step] = decode_value(value)
    return {k: sorted(v.items()) for k, v in out.items()}


@pytest.mark.parametrize(("first", "last"), [(None, None), (3, 7), (6, None), (None, 5)])
def test_metrics_points_are_those_of_reading_every_line(
    tmp_path: Path, first: int | None, last: int | None
) -> None:
    path = tmp_path / "metrics.jsonl"
    write_metrics(path)
    asked: list[str] = []

    def keep(key: str) -> bool:
        asked.append(key)
        return not key.startswith("a/")

    with pytest.warns(RuntimeWarning, match="the last line is truncated"):
        src = load_metrics(path, keep, first, last)
    # each key asked once (a refused key was asked again on every line)
    assert sorted(asked) == sorted(set(asked))
    expected = slow_points(path, keep, first, last)
    got = {k: list(zip(v.steps, v.values, strict=True)) for k, v in src.values.items()}
    assert list(got) == list(expected)  # (keys in the order first seen)
    for key, points in expected.items():  # (NaN == NaN as the same float)
        assert [(s, repr(v)) for s, v in got[key]] == [(s, repr(v)) for s, v in points], key
    shown = [
        r
        for r in map(json.loads, path.read_text().splitlines()[:-1])
        if (first is None or r["step"] >= first) and (last is None or r["step"] <= last)
    ]
    assert list(src.times) == [r["time"] for r in shown]
    if first is None and last is None:
        assert src.description.endswith("(14 lines)")
    else:  # (the lines of other steps are passed over: not counted)
        assert src.description.endswith(f"({len(shown)} lines in the steps shown)")
