"""The JSONL file: schema, exact floats, NaN/Inf spelling, truncated lines, appending."""

from __future__ import annotations

import json
import math
import random
import struct
import warnings

import pytest

from trainvitals.adapters import FanoutWriter, JsonlSink, iter_jsonl, metric_history, read_jsonl


def _random_doubles(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:  # arbitrary bit patterns: every exponent, subnormals included
        v = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        if math.isfinite(v):
            out.append(v)
    return out


def test_lines_follow_the_documented_schema(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    with FanoutWriter([JsonlSink(path)], rank=0) as writer:
        writer.add_scalars({"a": 1.5, "nan": float("nan"), "inf": math.inf, "ninf": -math.inf}, 3)
        writer.add_scalar("a", 2, 4)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert set(first) == {"step", "time", "metrics"}
    assert first["step"] == 3 and isinstance(first["time"], float)
    assert first["metrics"] == {"a": 1.5, "nan": "NaN", "inf": "Infinity", "ninf": "-Infinity"}
    assert "NaN" not in lines[0].replace('"NaN"', "")  # no bare NaN literal anywhere
    assert json.loads(lines[1])["metrics"] == {"a": 2.0}


def test_values_round_trip_bit_exactly(tmp_path) -> None:
    values = [*_random_doubles(2000, seed=1), 0.0, -0.0, 5e-324, 1.7976931348623157e308]
    path = tmp_path / "m.jsonl"
    with FanoutWriter([JsonlSink(path)], rank=0) as writer:
        writer.add_scalars({f"k{i}": v for i, v in enumerate(values)}, 0)
        writer.add_scalars({"nan": math.nan, "inf": math.inf, "ninf": -math.inf}, 1)
    records = read_jsonl(path)
    got = records[0]["metrics"]
    assert [struct.pack("<d", got[f"k{i}"]) for i in range(len(values))] == [
        struct.pack("<d", v) for v in values
    ]
    last = records[1]["metrics"]
    assert math.isnan(last["nan"]) and last["inf"] == math.inf and last["ninf"] == -math.inf


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    with FanoutWriter([JsonlSink(path)], rank=0) as writer:
        for step in range(3):
            writer.add_scalar("loss", float(step), step)
    full = path.read_bytes()
    path.write_bytes(full + b'{"step":3,"time":1.0,"metrics":{"lo')  # killed mid-line
    with pytest.warns(RuntimeWarning, match="last line is truncated"):
        records = read_jsonl(path)
    assert [r["step"] for r in records] == [0, 1, 2]
    with pytest.warns(RuntimeWarning, match="truncated"):
        assert read_jsonl(path, strict=True) == records  # a truncated tail is not an error


def test_a_complete_last_line_without_newline_is_kept(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step":0,"time":1.0,"metrics":{"a":1.0}}')
    assert read_jsonl(path) == [{"step": 0, "time": 1.0, "metrics": {"a": 1.0}}]


def test_appending_after_a_truncated_line_drops_it(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step":0,"time":1.0,"metrics":{"a":1.0}}\n{"step":1,"ti')
    with (
        pytest.warns(RuntimeWarning, match=r"dropped 1 line\(s\) of steps >= 1"),
        FanoutWriter([JsonlSink(path)], rank=0) as writer,  # a resumed run appends
    ):
        writer.add_scalar("a", 5.0, 1)
        writer.add_scalar("a", 6.0, 2)
    records = read_jsonl(path, strict=True)  # nothing left that does not parse
    assert [(r["step"], r["metrics"]["a"]) for r in records] == [(0, 1.0), (1, 5.0), (2, 6.0)]


def _log_run(path, steps, value) -> None:
    with FanoutWriter([JsonlSink(path)], rank=0) as writer:
        for step in steps:
            writer.add_scalars({"loss": value(step), "lr": 1e-3 * step}, step)


def test_a_resumed_run_replaces_the_steps_it_logs_again(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    # the first run checkpoints after step 10, goes on to step 15 and is killed mid-line
    _log_run(path, range(16), lambda s: 10.0 - s)
    with open(path, "a") as f:
        f.write('{"step":16,"time":1.0,"metrics":{"lo')
    # the resumed run starts again at step 11 and (killed again) gets to step 12 only
    with pytest.warns(RuntimeWarning, match=r"dropped 6 line\(s\) of steps >= 11"):
        _log_run(path, range(11, 13), lambda s: 100.0 + s)
    records = read_jsonl(path, strict=True)
    expected = [(s, 10.0 - s) for s in range(11)] + [(s, 100.0 + s) for s in (11, 12)]
    assert [(r["step"], r["metrics"]["loss"]) for r in records] == expected
    # steps 13..15 of the interrupted timeline are gone, not shown as this run's values
    assert metric_history(records, "loss") == expected


def test_resuming_keeps_earlier_lines_in_order_wherever_the_dropped_ones_are(tmp_path) -> None:
    lines = [
        {"step": 0, "time": 1.0, "metrics": {"a": 0.0}},
        {"step": 5, "time": 2.0, "metrics": {"a": 5.0}},  # dropped, in the middle of the file
        {"step": 2, "time": 3.0, "metrics": {"a": 2.0}},  # (an older writer's duplicates)
        {"step": 7, "time": 4.0, "metrics": {"a": 7.0}},
        {"step": 1, "time": 5.0, "metrics": {"a": 1.0}},  # complete, its newline lost
    ]
    # spaced JSON (not the sink's own compact form), a blank line, no final newline
    text = "".join(json.dumps(r) + "\n" for r in lines[:4]) + "\n" + json.dumps(lines[4])
    for first, rewritten in ((3, True), (8, False)):
        path = tmp_path / f"m{first}.jsonl"
        path.write_text(text)
        kept = [(r["step"], r["metrics"]["a"]) for r in lines if r["step"] < first]
        dropped = len(lines) - len(kept)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _log_run(path, [first], lambda s: 30.0)
        assert [str(w.message).count(f"dropped {dropped} line") for w in caught] == (
            [1] if dropped else []
        )
        got = [
            (r["step"], r["metrics"].get("a", r["metrics"].get("loss"))) for r in read_jsonl(path)
        ]
        assert got == [*kept, (first, 30.0)], rewritten


def test_a_new_run_moves_the_earlier_file_aside_and_keeps_foreign_lines(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    _log_run(path, range(3), lambda s: 1.0 + s)
    with pytest.warns(RuntimeWarning, match=r"held an earlier run; moved it to metrics\.jsonl\.1"):
        _log_run(path, range(2), lambda s: 10.0 + s)  # a new run, from step 0
    assert [r["metrics"]["loss"] for r in read_jsonl(path)] == [10.0, 11.0]
    earlier = tmp_path / "metrics.jsonl.1"
    assert [r["metrics"]["loss"] for r in read_jsonl(earlier)] == [1.0, 2.0, 3.0]
    # a resume (first step > 0) keeps lines that are not records, whatever they hold
    note = json.dumps({"note": "written by another tool", "step": 9})
    with open(path, "a") as f:
        f.write(note + "\n")
    with pytest.warns(RuntimeWarning, match=r"dropped 1 line"):
        _log_run(path, [1], lambda s: 20.0)
    lines = path.read_text().splitlines()
    assert note in lines
    assert [(r["step"], r["metrics"]["loss"]) for r in read_jsonl(path)] == [(0, 10.0), (1, 20.0)]


def test_a_path_that_is_not_a_regular_file_is_appended_to_without_reading_it(tmp_path) -> None:
    import os
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []

    def read() -> None:
        with open(fifo) as f:
            got.extend(f.read().splitlines())

    reader = threading.Thread(target=read)
    reader.start()
    writer = FanoutWriter([JsonlSink(fifo)], rank=0, close_timeout=10)
    for step in range(3):
        writer.add_scalar("a", float(step), step + 5)  # a resumed step: no reading, no drop
    writer.close()
    reader.join(10)
    assert [json.loads(line)["step"] for line in got] == [5, 6, 7]
    assert writer.status()["jsonl"]["missed"] == 0


def test_metric_history_merges_lines_of_one_step(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    with FanoutWriter([JsonlSink(path)], rank=0) as writer:
        writer.add_scalar("a", 1.0, 0)
        writer.flush()
        writer.add_scalar("a", 2.0, 0)  # a second batch of step 0 wins
        writer.add_scalar("b", 3.0, 1)
        writer.add_scalar("a", 4.0, 2)
    records = read_jsonl(path)
    assert len(records) == 4
    assert metric_history(records, "a") == [(0, 2.0), (2, 4.0)]
    assert metric_history(records, "b") == [(1, 3.0)]


def test_iter_jsonl_yields_the_records_of_read_jsonl_one_at_a_time(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    with FanoutWriter([JsonlSink(path)], rank=0) as writer:
        for step in range(4):
            writer.add_scalars({"a": float(step), "b": math.nan}, step)
    lines = path.read_bytes().split(b"\n")
    lines.insert(2, b'{"step":')  # a broken line between complete ones
    path.write_bytes(b"\n".join(lines) + b'{"step":9,"ti')  # and a truncated tail
    records = iter_jsonl(path)
    assert next(records)["step"] == 0  # one record, before the rest of the file is read
    with pytest.warns(RuntimeWarning) as caught:
        rest = list(records)
    assert [r["step"] for r in rest] == [1, 2, 3]
    assert all(math.isnan(r["metrics"]["b"]) for r in rest)
    text = [str(w.message) for w in caught]
    assert any("do not parse: [3]" in t for t in text)
    assert any("last line is truncated" in t for t in text)
    with pytest.warns(RuntimeWarning) as caught_again:
        assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2, 3]
    assert [str(w.message) for w in caught_again] == text
    with pytest.raises(ValueError, match="do not parse"):
        list(iter_jsonl(path, strict=True))


def test_resume_after_a_crash_in_a_file_with_windows_line_endings(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    # steps 0..150 written elsewhere with CRLF, a blank line, then a crash cut inside "é"
    earlier = [{"step": s, "time": 1.0, "metrics": {"κλ/é": s / 7}} for s in range(151)]
    text = "".join(json.dumps(r) + "\r\n" for r in earlier) + "\r\n"
    cut = '{"step":151,"time":1.0,"metrics":{"é'.encode()[:-1]
    path.write_bytes(text.encode() + cut)
    # resumed from the checkpoint of step 100, twice (the first resumed run dies at step 120)
    with pytest.warns(RuntimeWarning, match=r"dropped 52 line\(s\) of steps >= 100"):
        _log_run(path, range(100, 121), lambda s: 1000.0 + s)
    with pytest.warns(RuntimeWarning, match=r"dropped 11 line\(s\) of steps >= 110"):
        _log_run(path, range(110, 116), lambda s: 2000.0 + s)
    records = read_jsonl(path, strict=True)
    want = [(s, s / 7) for s in range(100)]
    want += [(s, 1000.0 + s) for s in range(100, 110)] + [(s, 2000.0 + s) for s in range(110, 116)]
    got = [(r["step"], r["metrics"].get("κλ/é", r["metrics"].get("loss"))) for r in records]
    assert got == want


def test_every_new_run_keeps_each_earlier_file(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    for run in range(4):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _log_run(path, range(2), lambda s, run=run: 10.0 * run + s)
    # metrics.jsonl.1 is the oldest run; no earlier run is overwritten
    names = ["metrics.jsonl.1", "metrics.jsonl.2", "metrics.jsonl.3", path.name]
    for run, name in enumerate(names):
        losses = [r["metrics"]["loss"] for r in read_jsonl(tmp_path / name)]
        assert losses == [10.0 * run, 10.0 * run + 1], name
