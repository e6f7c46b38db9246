"""Two JSONL sinks of one process given one path (two ``Vitals`` drivers on one ``run_dir``:
each makes its own ``metrics.jsonl`` sink). The second to write moves the first one's file
aside, as it does with an earlier run's; the first goes on writing into the moved file. Before,
the warning said the file "held an earlier run", which hid that half of this run's metrics
were in ``metrics.jsonl.1`` (a report of the run folder reads ``metrics.jsonl``). Now it says
that another open sink of this process writes there and how to give each its own file; the
sequential case (the first closed) keeps its earlier-run wording."""

from __future__ import annotations

import warnings

from trainvitals.adapters import FanoutWriter, JsonlSink
from trainvitals.adapters.jsonl import read_jsonl


def _messages(caught) -> list[str]:
    return [str(w.message) for w in caught if "JsonlSink" in str(w.message)]


def test_a_second_open_sink_on_one_path_says_so(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = FanoutWriter([JsonlSink(path)])
    second = FanoutWriter([JsonlSink(path)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            first.add_scalars({"a/x": float(step)}, step)
            first.flush()
            second.add_scalars({"b/y": 10.0 + step}, step)
            second.flush()
        first.close()
        second.close()
    messages = _messages(caught)
    assert len(messages) == 1, messages
    assert "another open JsonlSink of this process" in messages[0]
    assert "metrics.jsonl.1" in messages[0]
    # every line of each writer is whole, in its own file
    moved = read_jsonl(tmp_path / "metrics.jsonl.1")
    kept = read_jsonl(path)
    assert [(r["step"], r["metrics"]) for r in moved] == [(s, {"a/x": float(s)}) for s in range(3)]
    assert [(r["step"], r["metrics"]) for r in kept] == [(s, {"b/y": 10.0 + s}) for s in range(3)]


def test_an_earlier_closed_sinks_file_is_an_earlier_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with FanoutWriter([JsonlSink(path)]) as writer:
        writer.add_scalars({"a/x": 1.0}, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with FanoutWriter([JsonlSink(path)]) as writer:
            writer.add_scalars({"a/x": 2.0}, 0)
    messages = _messages(caught)
    assert len(messages) == 1 and "held an earlier run" in messages[0], messages
    assert "another open" not in messages[0]
    assert [r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl.1")] == [{"a/x": 1.0}]
    assert [r["metrics"] for r in read_jsonl(path)] == [{"a/x": 2.0}]
