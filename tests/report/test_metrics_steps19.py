"""``iter_jsonl(first=, last=)`` and the report's ``--steps``: the ``metrics.jsonl`` lines of
other steps are passed over unparsed (a report of the last steps of a long run parsed every
line), and what is shown equals a full read filtered by hand."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from trainvitals.adapters import JsonlSink
from trainvitals.adapters.jsonl import iter_jsonl, read_jsonl
from trainvitals.report.sources import load_metrics

jsonl_module = importlib.import_module("trainvitals.adapters.jsonl")


def _write_run(path: Path) -> None:
    """Steps 0..29 by JsonlSink, a resumed run's steps 20..24 again (later lines win), and one
    hand-written line of another layout (``time`` first) at step 3."""
    sink = JsonlSink(path)
    for step in range(30):
        sink.write(step, {"train/loss": 1.0 / (step + 1), "nan/key": float("nan")}, 100.0 + step)
    sink.close()
    with path.open("a", encoding="utf-8") as f:
        for step in range(20, 25):
            row = {"step": step, "time": 200.0 + step, "metrics": {"train/loss": -float(step)}}
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
        f.write(json.dumps({"time": 1.0, "step": 3, "metrics": {"train/loss": 7.0}}) + "\n")


def _counting_loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = json.loads

    def loads(raw, *args, **kwargs):
        calls.append(1)
        return real(raw, *args, **kwargs)

    monkeypatch.setattr(jsonl_module.json, "loads", loads)
    return calls


def test_iter_jsonl_passes_over_lines_of_other_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_run(path)
    every = read_jsonl(path)
    calls = _counting_loads(monkeypatch)
    got = list(iter_jsonl(path, first=21, last=23))
    # 3 sink lines + 3 resumed lines in 21..23, + the line of another layout (always parsed)
    assert len(calls) == 7
    assert [r for r in got if 21 <= r["step"] <= 23] == [r for r in every if 21 <= r["step"] <= 23]
    assert {r["step"] for r in got} - set(range(21, 24)) == {3}  # the caller filters that one
    calls.clear()
    assert list(iter_jsonl(path)) == every and len(calls) == len(every)  # unfiltered: all


def test_report_metrics_of_the_steps_shown_equal_a_full_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "metrics.jsonl"
    _write_run(path)
    expected: dict[int, float] = {}
    for r in read_jsonl(path):  # later lines win
        if 18 <= r["step"] <= 22:
            expected[r["step"]] = r["metrics"]["train/loss"]
    calls = _counting_loads(monkeypatch)
    source = load_metrics(path, lambda key: True, 18, 22)
    assert len(calls) == 5 + 3 + 1  # steps 18..22, the resumed 20..22, the other layout
    loss = source.values["train/loss"]
    shown = dict(zip(loss.steps, loss.values, strict=True))
    assert shown == expected
    assert "(8 lines in the steps shown)" in source.description
