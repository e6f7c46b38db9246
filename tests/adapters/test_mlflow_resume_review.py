"""Review of the writer's SummaryWriter-style arguments (commit 5ccc64a): a step given twice,
as ``step``/the positional step and as ``global_step=``, raises as the other doubled names do,
instead of the first silently winning."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from trainvitals.adapters import FanoutWriter
from trainvitals.adapters.sinks.base import Sink


class _Recording(Sink):
    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, dict[str, float]]] = []

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self.steps.append((step, dict(metrics)))


def test_a_step_given_twice_raises_and_logs_nothing() -> None:
    sink = _Recording()
    writer = FanoutWriter([sink])
    with pytest.raises(TypeError, match="global_step"):
        writer.add_scalar("x", 1.0, 3, global_step=4)  # SummaryWriter raises here too
    with pytest.raises(TypeError, match="global_step"):
        writer.add_scalar("x", 1.0, step=3, global_step=3)
    with pytest.raises(TypeError, match="global_step"):
        writer.add_scalars({"y": 2.0}, 5, global_step=6)
    # one name of the step: as before
    writer.add_scalar("x", 1.0, global_step=7)
    writer.add_scalar(tag="z", scalar_value=2.0, global_step=8)
    writer.add_scalars({"y": 3.0}, global_step=9)
    writer.add_scalars("loss", {"train": 4.0}, 10)
    writer.add_scalars("loss", {"train": 5.0}, global_step=11)
    writer.add_scalars(main_tag="loss", tag_scalar_dict={"val": 6.0}, global_step=12)
    writer.close()
    assert sink.steps == [
        (7, {"x": 1.0}),
        (8, {"z": 2.0}),
        (9, {"y": 3.0}),
        (10, {"loss/train": 4.0}),
        (11, {"loss/train": 5.0}),
        (12, {"loss/val": 6.0}),
    ]
