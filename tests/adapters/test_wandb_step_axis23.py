"""WandbSink with a step axis (``step_metric``): a metric that the loop itself names like the
axis (``trainer/global_step`` given to the writer with another value) was overwritten by the
sink's step in the row, without a word. It is now escaped like W&B's own keys (``_step``), so
the row keeps both: the axis with the writer's step, the metric under its escaped name."""

from __future__ import annotations

import pytest

from tests.adapters.conftest import offline_wandb_run, read_wandb_offline
from trainvitals.adapters import FanoutWriter
from trainvitals.adapters.sinks.wandb import WandbSink

pytest.importorskip("wandb")


@pytest.mark.parametrize("shared_step", [False, True])
def test_a_metric_named_as_the_step_axis_is_kept(tmp_path, shared_step: bool) -> None:
    axis = "trainer/global_step"
    run = offline_wandb_run(tmp_path, "tv")
    sink = WandbSink(run, step_metric=axis, shared_step=shared_step)
    escaped = sink.map_key(axis)
    assert escaped != axis
    try:
        with FanoutWriter([sink], rank=0) as writer:
            for step in range(3):
                # the loop's own counter, one ahead of the writer's step (Lightning's logging)
                writer.add_scalars({axis: float(step + 1), "vitals/x": step / 3}, step)
    finally:
        run.finish()
    rows = [r for r in read_wandb_offline(tmp_path) if "vitals/x" in r]
    assert [(r[axis], r[escaped], r["vitals/x"]) for r in rows] == [
        (s, s + 1, s / 3) for s in range(3)
    ]
