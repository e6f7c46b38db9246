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
