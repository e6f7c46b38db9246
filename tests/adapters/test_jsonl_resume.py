"""Resuming into an existing JSONL file: symlinked files, and the checkpoint step."""

from __future__ import annotations

import json
import logging
import os
import stat
import warnings

import pytest

from tests.adapters.conftest import read_tensorboard
from trainvitals.adapters import FanoutWriter, JsonlSink, TensorBoardSink, read_jsonl


def _log_run(path, steps, value, *, resume_at: int | None = None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the drop / move-aside notices
        with FanoutWriter([JsonlSink(path)], rank=0) as writer:
            if resume_at is not None:
                writer.resume_at(resume_at)
            for step in steps:
                writer.add_scalars({"loss": value(step)}, step)


def _losses(path) -> list[tuple[int, float]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # lines of other tools, if any
        return [(r["step"], r["metrics"]["loss"]) for r in read_jsonl(path)]


@pytest.fixture
def linked(tmp_path):
    """``run/metrics.jsonl`` -> ``shared/metrics.jsonl`` (users point it at shared storage)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "shared").mkdir()
    target = tmp_path / "shared" / "metrics.jsonl"
    link = tmp_path / "run" / "metrics.jsonl"
    link.symlink_to(target)
    return link, target


@pytest.mark.parametrize("rewritten", [False, True])
def test_a_resume_through_a_symlink_rewrites_the_target_and_keeps_the_link(
    linked, rewritten: bool
) -> None:
    link, target = linked
    _log_run(link, range(6), lambda s: float(s))
    if rewritten:  # a line of a dropped step before a kept line: the file is rewritten
        with open(target, "a") as f:
            f.write(json.dumps({"note": "another tool"}) + "\n")
    target.chmod(0o640)  # shared storage: group-readable, chosen by the user
    _log_run(link, range(3, 5), lambda s: 100.0 + s)
    assert link.is_symlink() and os.readlink(link) == str(target)
    expected = [(0, 0.0), (1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0)]
    assert _losses(target) == expected
    assert (json.dumps({"note": "another tool"}) in target.read_text()) is rewritten
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in link.parent.iterdir()) == ["metrics.jsonl"]  # no temp left
    assert sorted(p.name for p in target.parent.iterdir()) == ["metrics.jsonl"]


def test_a_new_run_through_a_symlink_moves_the_target_aside_and_keeps_the_link(linked) -> None:
    link, target = linked
    _log_run(link, range(3), lambda s: 1.0 + s)
    _log_run(link, range(2), lambda s: 10.0 + s)  # a new run, from step 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert _losses(target) == [(0, 10.0), (1, 11.0)]
    # the earlier run is kept on the shared storage, next to the file it was
    earlier = target.parent / "metrics.jsonl.1"
    assert not earlier.is_symlink()
    assert _losses(earlier) == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert sorted(p.name for p in link.parent.iterdir()) == ["metrics.jsonl"]


def _rollback_scenario(path, *, declare: bool) -> list[tuple[int, float]]:
    """A run logging every 10 steps checkpoints at step 120, diverges (loss spikes at 130 and
    140) and is stopped at 195. It is rolled back to the checkpoint with a lower learning rate
    and logs every 50 steps. Returns what the resumed timeline really holds."""
    interrupted = {s: (1e4 if s in (130, 140) else 10.0 - s / 100) for s in range(0, 200, 10)}
    _log_run(path, sorted(interrupted), interrupted.__getitem__)
    resumed_steps = [150, 200, 250]  # the first step the resumed run logs is not its checkpoint
    _log_run(path, resumed_steps, lambda s: 5.0 - s / 100, resume_at=120 if declare else None)
    return [(s, interrupted[s]) for s in range(0, 120, 10)] + [
        (s, 5.0 - s / 100) for s in resumed_steps
    ]


def test_a_run_resumed_at_its_checkpoint_drops_every_later_line_of_the_interrupted_run(
    tmp_path,
) -> None:
    path = tmp_path / "metrics.jsonl"
    expected = _rollback_scenario(path, declare=True)
    assert _losses(path) == expected  # the spike at 130, 140 was not this timeline's
    # undeclared, the sink can only guess from its first step (150): 120..140 stay, as documented
    undeclared = tmp_path / "undeclared.jsonl"
    _rollback_scenario(undeclared, declare=False)
    assert [s for s, _ in _losses(undeclared)] == [*range(0, 150, 10), 150, 200, 250]


def test_resume_at_warns_once_the_sink_dropped_lines_and_keeps_steps_below_the_first_write(
    tmp_path,
) -> None:
    path = tmp_path / "metrics.jsonl"
    _log_run(path, range(10), float)
    # declared resume at 7, but the run logs step 5 first: 5 and 6 would be duplicated
    with (
        pytest.warns(RuntimeWarning, match=r"dropped 5 line\(s\) of steps >= 5"),
        FanoutWriter([JsonlSink(path)], rank=0) as writer,
    ):
        writer.resume_at(7)
        writer.add_scalar("loss", 50.0, 5)
    assert _losses(path) == [(s, float(s)) for s in range(5)] + [(5, 50.0)]


def test_resume_at_zero_is_a_new_run_whatever_step_it_logs_first(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    _log_run(path, range(0, 100, 10), float)
    _log_run(path, [49, 99], lambda s: -float(s), resume_at=0)  # (step + 1) % 50 == 0 logging
    assert _losses(path) == [(49, -49.0), (99, -99.0)]
    assert _losses(tmp_path / "metrics.jsonl.1") == [(s, float(s)) for s in range(0, 100, 10)]


def test_resume_at_checks_its_step_and_is_ignored_with_a_warning_once_values_were_logged(
    tmp_path,
) -> None:
    writer = FanoutWriter([JsonlSink(tmp_path / "m.jsonl")], rank=1)  # checked on every rank
    with pytest.raises(TypeError, match="step must be an int"):
        writer.resume_at(1.5)
    with pytest.raises(ValueError, match="step must be >= 0"):
        writer.resume_at(-1)
    writer.close()
    sink = JsonlSink(tmp_path / "m.jsonl")
    with FanoutWriter([sink], rank=0) as writer:
        writer.resume_at(3)
        writer.resume_at(3)  # several callbacks sharing the writer: no warning
        writer.add_scalar("loss", 1.0, 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            writer.resume_at(3)
        assert caught == []
        with pytest.warns(RuntimeWarning, match=r"resume_at\(4\) after values were logged"):
            writer.resume_at(4)
    assert sink._resume_step == 3


def _tensorboard_run(logdir) -> None:
    """An interrupted run: steps 0, 10, ..., 190 of "loss" (value = step) in ``logdir``."""
    with FanoutWriter([TensorBoardSink(logdir)], rank=0) as writer:
        for step in range(0, 200, 10):
            writer.add_scalar("loss", float(step), step)


def test_resume_at_hides_the_interrupted_runs_later_tensorboard_events(tmp_path) -> None:
    logdir = tmp_path / "tb"
    _tensorboard_run(logdir)  # (the resumed sink waits for the next second: files sort by it)
    with FanoutWriter([TensorBoardSink(logdir)], rank=0) as writer:
        writer.resume_at(120)
        for step in (150, 200):
            writer.add_scalar("loss", -float(step), step)
    expected = {s: float(s) for s in range(0, 120, 10)} | {150: -150.0, 200: -200.0}
    assert read_tensorboard(logdir) == {"loss": expected}


@pytest.mark.parametrize("thread_safe", [True, False])
def test_a_flush_after_resume_at_drops_the_abandoned_lines_before_any_write(
    tmp_path, thread_safe, caplog
) -> None:
    # A run that rolled back to step 5 and is killed after a flush, before its next logging
    # step: the file must already read as the steps below 5 (checked with the writer still
    # open, as a killed process leaves it), on a worker thread and on the training thread.
    path = tmp_path / "metrics.jsonl"
    _log_run(path, range(10), float)
    sink = JsonlSink(path)
    sink.thread_safe = thread_safe
    writer = FanoutWriter([sink], rank=0)
    writer.resume_at(5)
    # the lines after the declared checkpoint step: an ordinary resume, logged at INFO
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, "trainvitals"):
        warnings.simplefilter("error", RuntimeWarning)
        assert writer.flush(timeout=30)
    assert [
        r.levelno for r in caplog.records if "dropped 5 line(s) of steps >= 5" in r.message
    ] == [logging.INFO]
    assert _losses(path) == [(s, float(s)) for s in range(5)]
    writer.add_scalar("loss", 50.0, 7)  # the first write after that drops nothing more
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        writer.close()
    assert _losses(path) == [(s, float(s)) for s in range(5)] + [(7, 50.0)]


def test_a_close_after_resume_at_without_a_write_hides_later_tensorboard_events(
    tmp_path,
) -> None:
    # SummaryWriter(purge_step=N) writes its purge marker when it is created: a sink that
    # opens it at close hides the abandoned steps although the run logged nothing more.
    logdir = tmp_path / "tb"
    _tensorboard_run(logdir)  # (the resumed sink waits for the next second: files sort by it)
    with FanoutWriter([TensorBoardSink(logdir)], rank=0) as writer:
        writer.resume_at(120)
    assert read_tensorboard(logdir) == {"loss": {s: float(s) for s in range(0, 120, 10)}}


def test_a_close_after_resume_at_without_a_write_cuts_the_jsonl_file(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    _log_run(path, range(10), float)
    _log_run(path, [], float, resume_at=3)
    assert _losses(path) == [(s, float(s)) for s in range(3)]
    _log_run(path, [], float, resume_at=0)  # a new run that logged nothing: not the old one's
    assert not path.exists()
    assert _losses(tmp_path / "metrics.jsonl.1") == [(s, float(s)) for s in range(3)]
