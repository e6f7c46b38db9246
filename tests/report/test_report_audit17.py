"""The HTML report on metrics near float64's limits: a diverged run's values (``exp(loss)`` near
``1e308``) are what the report is opened for, and must neither end it with a traceback nor be
drawn or summarised wrong."""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from pathlib import Path

from trainvitals.cli import main
from trainvitals.report import render_report

BIG = 1.5e308


def _write_metrics(run: Path, rows: list[dict[str, float]]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "metrics.jsonl", "w", encoding="utf-8") as f:
        for step, metrics in enumerate(rows):
            encoded = {
                k: (v if math.isfinite(v) else {math.inf: "Infinity"}.get(v, "NaN"))
                for k, v in metrics.items()
            }
            f.write(json.dumps({"step": step, "time": 1.0 + step, "metrics": encoded}) + "\n")


def _cells(page: str, key: str) -> dict[str, str]:
    row = re.search(rf"<tr><td class=name>{re.escape(key)}</td>(.*?)</tr>", page)
    assert row is not None, key
    return dict(re.findall(r'data-col="([^"]*)" data-value="([^"]*)"', row.group(1)))


def test_mean_of_values_whose_sum_overflows(tmp_path: Path) -> None:
    # ppl: two finite values whose sum is beyond float64's range, then inf (left out of the
    # mean); swing: a partial sum overflows although the total fits (math.fsum raises there)
    ppl = [1e308, BIG, math.inf, 2.0]
    swing = [1e308, 1e308, -1e308, 3.0]
    _write_metrics(
        tmp_path / "run", [{"ppl": p, "swing": s} for p, s in zip(ppl, swing, strict=True)]
    )
    assert main(["report", str(tmp_path / "run"), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    for key, values in (("ppl", ppl), ("swing", swing)):
        finite = [v for v in values if math.isfinite(v)]
        exact = float(sum(map(Fraction, finite)) / len(finite))
        cells = _cells(page, key)
        assert float(cells["mean"]) == exact, key
        assert float(cells["min"]) == min(finite) and float(cells["max"]) == max(finite)
    assert float(_cells(page, "ppl")["non-finite"]) == 1


def _chart_of(page: str, key: str) -> str:
    for svg in re.findall(r'<svg class="chart".*?</svg>', page):
        if f'data-key="{key}"' in svg:
            return svg
    raise AssertionError(f"no chart {key}")


def test_band_median_of_huge_values_is_finite(tmp_path: Path) -> None:
    # eleven keys of one family: drawn as min / median / max across them; the middle pair of
    # an even count of finite values is averaged, and (a + b) / 2 overflowed to inf, which
    # the chart marked as a non-finite step
    values = {f"w{i}": 1e308 if i % 2 else BIG for i in range(12)}
    _write_metrics(tmp_path, [values, values])
    page = render_report(tmp_path)
    svg = _chart_of(page, "w*")
    assert 'class="nonfinite"' not in svg
    assert 'data-label="median of 12"' in svg
    ordered = sorted(values.values())
    exact = float((Fraction(ordered[5]) + Fraction(ordered[6])) / 2)
    assert math.isfinite(exact)
    # the y axis spans the finite values drawn: the median lies inside it, so min and max label it
    labels = re.findall(r'class="ax">([^<]*)</text>', svg)
    assert labels[:2] == ["1.5e+308", "1e+308"]


def _ys(svg: str) -> list[float]:
    line = re.search(r'<polyline points="([^"]*)"', svg)
    assert line is not None
    return [float(p.split(",")[1]) for p in line.group(1).split()]


def test_chart_of_values_near_float64_limits(tmp_path: Path) -> None:
    # x: y1 - y0 overflowed to inf (every finite point drawn at the top, the extremes at nan);
    # y: a finite span, but ph * (y1 - v) overflowed (points at inf) above 1.6e306
    _write_metrics(
        tmp_path,
        [{"x": -1.7e308, "y": 0.0}, {"x": 1.7e308, "y": 1e307}, {"x": 0.0, "y": 5e306}],
    )
    page = render_report(tmp_path)
    # plot area: top 8, height 150 - 8 - 30 = 112 (html._chart's layout)
    top, bottom = 8.0, 8.0 + 112.0
    for key in ("x", "y"):
        assert _ys(_chart_of(page, key)) == [bottom, top, (top + bottom) / 2], key
