"""The JSONL metrics file: a new run not told ``resume_at`` whose steps start above 0, and
lines that overflow a float."""

from __future__ import annotations

import warnings

import pytest

from trainvitals.adapters import FanoutWriter, JsonlSink, read_jsonl


def _log_run(path, steps, value) -> list[str]:
    """Log ``loss`` at ``steps`` through a writer built by the user (no ``resume_at``); the
    warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with FanoutWriter([JsonlSink(path)], rank=0) as writer:
            for step in steps:
                writer.add_scalar("loss", value(step), step)
    return [str(w.message) for w in caught]


def _losses(path) -> list[tuple[int, float]]:
    return [(r["step"], r["metrics"]["loss"]) for r in read_jsonl(path, strict=True)]


def test_a_second_run_logging_from_step_1_keeps_the_first_runs_file(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    # a loop counting its steps from 1 (Lightning's global_step after the first update), run
    # twice in the same folder: every record of the first run is at or after the second
    # run's first step, so no resume would keep any of them
    _log_run(path, range(1, 6), lambda s: 100.0 + s)
    messages = _log_run(path, range(1, 4), lambda s: 200.0 + s)
    assert any("moved it to metrics.jsonl.1" in m for m in messages), messages
    assert _losses(path) == [(1, 201.0), (2, 202.0), (3, 203.0)]
    assert _losses(tmp_path / "metrics.jsonl.1") == [(s, 100.0 + s) for s in range(1, 6)]
    # a resume (a record below the first step) still drops only the steps it logs again
    messages = _log_run(path, [3, 4], lambda s: 300.0 + s)
    assert any("dropped 1 line(s) of steps >= 3" in m for m in messages), messages
    assert _losses(path) == [(1, 201.0), (2, 202.0), (3, 303.0), (4, 304.0)]
    assert not (tmp_path / "metrics.jsonl.2").exists()


def test_lines_that_overflow_a_float_are_skipped_and_do_not_block_a_resume(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    huge = "1" + "0" * 400  # an integer JSON number beyond float64: float() overflows
    path.write_text(
        '{"step":0,"time":1.0,"metrics":{"loss":1.5}}\n'
        '{"step":Infinity,"time":1.0,"metrics":{"loss":2.5}}\n'  # json.loads reads Infinity
        f'{{"step":1,"time":1.0,"metrics":{{"loss":{huge}}}}}\n'
        '{"step":2,"time":1.0,"metrics":{"loss":3.5}}\n'
    )
    with pytest.warns(RuntimeWarning, match=r"skipped 2 line\(s\) that do not parse: \[2, 3\]"):
        assert [(r["step"], r["metrics"]["loss"]) for r in read_jsonl(path)] == [
            (0, 1.5),
            (2, 3.5),
        ]
    # a run resuming at step 2 drops step 2 only and keeps the lines it cannot read
    messages = _log_run(path, [2], lambda s: 30.0)
    assert any("dropped 1 line(s) of steps >= 2" in m for m in messages), messages
    with pytest.warns(RuntimeWarning, match=r"\[2, 3\]"):
        assert [(r["step"], r["metrics"]["loss"]) for r in read_jsonl(path)] == [
            (0, 1.5),
            (2, 30.0),
        ]
