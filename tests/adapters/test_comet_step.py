"""A Comet experiment shared with the loop keeps the loop's current step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from tests.adapters.conftest import QUIET_COMET, read_comet_archive
from trainvitals.adapters import CometSink, FanoutWriter


def test_the_loops_metrics_without_a_step_stay_at_the_loops_step(tmp_path) -> None:
    """The loop sets the experiment's step at each step and logs without a step (as with
    ``accelerator.log(values)``); the sink delivers the previous step meanwhile."""
    import comet_ml

    experiment = comet_ml.OfflineExperiment(
        offline_directory=str(tmp_path / "comet"), **QUIET_COMET
    )
    writer = FanoutWriter([CometSink(experiment)], rank=0)
    for step in range(4):
        experiment.set_step(step)
        writer.end_step()  # a new step: the previous one is handed over (the driver does this)
        assert writer.flush()  # ... and delivered by now
        experiment.log_metric("loop/loss", 10.0 + step)  # at the experiment's current step
        writer.add_scalar("vitals/norm", 0.5 * step, step)
    writer.close()
    experiment.end()
    got = read_comet_archive(tmp_path / "comet")
    assert got["loop/loss"] == {step: 10.0 + step for step in range(4)}
    assert got["vitals/norm"] == {step: 0.5 * step for step in range(4)}


class _CometLikeExperiment:
    """Comet's step semantics (``Experiment._log_metrics``/``_log_metric``): a given step
    becomes ``curr_step``; a metric without a step is logged at ``curr_step``."""

    def __init__(self) -> None:
        self.curr_step: int | None = None
        self.logged: list[tuple[str, float, int | None]] = []

    def log_metric(self, name: str, value: float, step: int | None = None) -> None:
        if step is not None:
            self.curr_step = step
        self.logged.append((name, value, self.curr_step))

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None, **_: Any) -> None:
        for name, value in metrics.items():
            self.log_metric(name, value, step=step)


def test_a_loop_that_never_set_a_step_is_left_without_one() -> None:
    experiment = _CometLikeExperiment()
    writer = FanoutWriter([CometSink(experiment)], rank=0, background=False)
    writer.add_scalar("vitals/norm", 2.0, 7)
    writer.flush()
    experiment.log_metric("loop/epoch_time", 3.0)
    writer.close()
    assert experiment.logged == [("vitals/norm", 2.0, 7), ("loop/epoch_time", 3.0, None)]
    assert experiment.curr_step is None


def test_the_step_is_put_back_also_when_comet_fails() -> None:
    experiment = _CometLikeExperiment()
    experiment.curr_step = 5
    sink = CometSink(experiment)

    def failing_log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
        experiment.curr_step = step  # Comet sets the step before it logs
        raise ConnectionError("comet unavailable")

    experiment.log_metrics = failing_log_metrics  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):  # the writer retries it
        sink.write(4, {"vitals/norm": 1.0}, 0.0)
    assert experiment.curr_step == 5
