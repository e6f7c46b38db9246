"""trainvitals.report.sources: a resumed run's repeated steps, read from every format, keep the
value read last, in step order, against a dict built independently from the same lines."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from trainvitals.report.sources import StepValues, load_metrics


def reference(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    latest: dict[int, float] = {}
    for step, value in points:
        latest[step] = value  # a later point of a step replaces the earlier one
    return sorted(latest.items())


def same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return len(a) == len(b) and all(
        sa == sb and (va == vb or (math.isnan(va) and math.isnan(vb)))
        for (sa, va), (sb, vb) in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("seed", range(6))
def test_step_values_keep_the_last_value_of_each_step_in_order(seed: int) -> None:
    rng = random.Random(seed)
    points: list[tuple[int, float]] = []
    step = 0
    for _ in range(rng.randint(1, 400)):
        # mostly increasing; sometimes a resume back to an earlier step, or a step repeated
        step = rng.choice([step + 1, step + 1, step, max(0, step - rng.randint(1, 30))])
        points.append((step, rng.choice([rng.gauss(0, 1), math.nan, math.inf])))
    sv = StepValues()
    for s, v in points:
        sv.append(s, v)
    sv.finish()
    want = reference(points)
    assert same(list(zip(sv.steps, sv.values, strict=True)), want)
    for s, v in want[:: max(1, len(want) // 7)]:
        got = sv.get(s, -1.0)
        assert got == v or (math.isnan(got) and math.isnan(v))
    assert sv.get(want[-1][0] + 1, -1.0) == -1.0


def test_load_metrics_from_a_resumed_jsonl_keeps_the_later_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [(s, {"train/loss": float(s), "lr": 0.1}) for s in range(10)]
    lines += [(s, {"train/loss": 100.0 + s}) for s in range(6, 12)]  # resumed from step 6
    path.write_text(
        "".join(json.dumps({"step": s, "time": 0.0, "metrics": m}) + "\n" for s, m in lines)
    )
    src = load_metrics(path, lambda key: key != "lr", 2, None)
    assert set(src.values) == {"train/loss"}
    loss = src.values["train/loss"]
    want = reference([(s, m["train/loss"]) for s, m in lines if s >= 2])
    assert list(zip(loss.steps, loss.values, strict=True)) == want
    assert want[4] == (6, 106.0) and want[-1] == (11, 111.0)


def tensorboard_points(src_values: dict, key: str) -> list[tuple[int, float]]:
    points = src_values[key]
    return list(zip(points.steps, points.values, strict=True))


def test_tensorboard_resume_hides_the_steps_purged_by_the_resumed_run(tmp_path: Path) -> None:
    # A run logged steps 0..9 to TensorBoard, was resumed from its step-5 checkpoint into the
    # same folder (TensorBoardSink opens SummaryWriter(purge_step=5)) and logged steps 5, 6.
    # TensorBoard hides the first run's steps >= 5; the report must show the same timeline,
    # not the abandoned steps 7..9 behind the resumed ones.
    pytest.importorskip("tensorboard")
    from trainvitals.adapters import FanoutWriter, TensorBoardSink

    first = [(s, float(s)) for s in range(10)]
    resumed = [(s, 100.0 + s) for s in range(5, 7)]
    for start, points in ((0, first), (5, resumed)):
        writer = FanoutWriter([TensorBoardSink(tmp_path / "tb")])
        writer.resume_at(start)
        for step, value in points:
            writer.add_scalar("train/loss", value, step)
        writer.close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    want = reference([p for p in first if p[0] < 5] + resumed)  # [(0, 0.0) .. (6, 106.0)]
    src = load_metrics(tmp_path, lambda key: True, None, None)
    assert tensorboard_points(src.values, "train/loss") == want
    assert len(src.times) == len(want)  # the purged steps' wall times are gone too


def test_tensorboard_double_precision_values_are_read(tmp_path: Path) -> None:
    # TensorBoardSink(double_precision=True) stores float64 tensors of the scalars plugin,
    # which EventAccumulator.Scalars() does not return: the report read no metric at all.
    pytest.importorskip("tensorboard")
    from trainvitals.adapters import FanoutWriter, TensorBoardSink

    points = [(s, 1.0 / 3.0 + s * 1e-9) for s in range(4)]  # not representable in float32
    writer = FanoutWriter([TensorBoardSink(tmp_path / "tb", double_precision=True)])
    for step, value in points:
        writer.add_scalars({"train/loss": value, "lr": 0.1}, step)
    writer.close()
    src = load_metrics(tmp_path / "tb", lambda key: key != "lr", None, None)
    assert set(src.values) == {"train/loss"}
    assert tensorboard_points(src.values, "train/loss") == points  # exact: float64 kept
    assert "float64 values" in src.description
