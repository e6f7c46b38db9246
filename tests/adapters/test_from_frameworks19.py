"""FanoutWriter.from_accelerator: the last steps reach the trackers before they finish."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.adapters.conftest import RecordingSink, read_comet_archive
from trainvitals.adapters import CometSink, FanoutWriter, TrackerSink

N_STEPS = 5


def _finish_recording_tracker_class():
    """An Accelerate tracker recording its ``log`` calls and its ``finish`` in one list."""
    from accelerate.tracking import GeneralTracker

    class FinishRecordingTracker(GeneralTracker):
        name = "finish_recording"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.events: list[tuple[str, dict[str, Any], int | None]] = []

        @property
        def tracker(self):
            return self

        def log(self, values, step=None, **kwargs):
            self.events.append(("log", dict(values), step))

        def finish(self):
            self.events.append(("finish", {}, None))

    return FinishRecordingTracker


@pytest.mark.timeout(300)
def test_end_training_before_close_keeps_the_last_steps(tmp_path, monkeypatch) -> None:
    # A script ending with accelerator.end_training() and closing the writer afterwards (or
    # never: the exit hook does): end_training() finishes every tracker first. The Comet
    # experiment it ends dropped the steps still on their way (steps 3 and 4 here, the
    # experiment is written from the training thread at the writer's next call), the custom
    # tracker got them after its finish().
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    monkeypatch.chdir(tmp_path)
    custom = _finish_recording_tracker_class()()
    try:
        accelerator = Accelerator(log_with=["comet_ml", custom], project_dir=str(tmp_path))
        accelerator.init_trackers("acc19", init_kwargs={"comet_ml": {"online": False}})
        writer = FanoutWriter.from_accelerator(accelerator)
        assert [type(s) for s in writer.sinks] == [CometSink, TrackerSink]
        for step in range(N_STEPS):
            accelerator.log({"loop/x": float(step)}, step=step)
            writer.add_scalars({"vitals/x": 10.0 * step}, step)
        accelerator.end_training()
        writer.close()
        assert "finish" not in vars(custom)  # the class's own method again
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    assert all(s["missed"] == 0 for s in writer.status().values()), writer.status()
    expected = {step: 10.0 * step for step in range(N_STEPS)}
    got = read_comet_archive(tmp_path / "comet")
    assert got["vitals/x"] == expected
    assert got["loop/x"] == {step: float(step) for step in range(N_STEPS)}
    # every step reached the custom tracker before its finish(), in step order
    kinds = [kind for kind, _, _ in custom.events]
    assert kinds.count("finish") == 1 and kinds[-1] == "finish"
    ours = [(step, values) for kind, values, step in custom.events if "vitals/x" in values]
    assert ours == [(step, {"vitals/x": v}) for step, v in expected.items()]


def test_flush_before_finish_only_where_the_writer_delivers() -> None:
    sink = RecordingSink()
    seen_at_finish: list[list[int]] = []

    def finish() -> None:
        seen_at_finish.append([step for step, _, _ in sink.steps])

    tracker = SimpleNamespace(finish=finish)
    other = FanoutWriter([RecordingSink()], rank=1)  # another rank: delivers nothing
    other.flush_before_finish(tracker)
    assert vars(tracker)["finish"] is finish
    writer = FanoutWriter([sink], rank=0)
    writer.flush_before_finish(tracker)
    assert vars(tracker)["finish"] is not finish
    writer.add_scalar("a", 1.0, 0)
    writer.add_scalar("a", 2.0, 1)  # the open step: delivered by the flush before finish()
    tracker.finish()
    assert seen_at_finish == [[0, 1]]
    writer.close()
    assert vars(tracker)["finish"] is finish  # taken back at close()
    other.close()
