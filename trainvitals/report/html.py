"""A self-contained HTML report of a run: ``trainvitals report RUN_DIR``.

One HTML file, no JavaScript, no network: inline CSS and inline SVG charts, so it can be
mailed, attached to a ticket or opened on a machine with no internet. It reads what the run
wrote:

* the run's scalar metrics (``metrics.jsonl``, the :class:`~trainvitals.adapters.JsonlSink`
  file; else TensorBoard event files or a Lightning ``metrics.csv``; in the run folder or under
  it, see :mod:`trainvitals.report.sources`): one chart per metric family and a table of every
  key (last value, finite min / max / mean, non-finite count);
* ``tensor_stats.jsonl`` (the :class:`~trainvitals.callbacks.TensorStatsMonitor` file) in the
  run folder or, if not there, the one under it (several under it, a folder of several runs:
  an error naming them, see :func:`_tensor_stats_path`): per kind, the statistics of all
  tensors merged exactly, per layer over the steps, and a table per layer and per tensor at
  the last step (the same exact merging as :func:`trainvitals.report.query`). A file written
  by a newer trainvitals, none of whose lines this one reads, is an error saying to upgrade
  when the run has no metrics; beside metrics, the page shows them with that message in its
  Attention section (and warns it), without tensor statistics.

For MoE runs logged with ``LoadBalanceMonitor(mode="detailed")``, heatmaps of every expert's
utilization per layer (last step, and all steps summed) come next.

An "Attention" section at the top lists every metric that was ever NaN or infinite and every
tensor that held non-finite elements, with the first step it happened.

Charts:

* A *family* is the set of keys that differ only in their integers (``moe/layer_0/cv``,
  ``moe/layer_1/cv``, ...: family ``moe/layer_*/cv``); it gets one chart with a line per
  member, on one y scale, or, above :data:`MAX_LINES` members (tokens per expert of every
  layer), three lines: the min, median and max across its keys at each step. A key with no
  integers, or alone in its family, gets a chart of its own. The per-layer tensor charts
  (RMS, kurtosis) have a line per layer, banded the same way above :data:`MAX_LINES` layers.
* Long series are thinned for drawing by keeping, in each of ``max_points / 2`` buckets of
  consecutive steps, the smallest and the largest value (:func:`decimate`): a one-step spike is
  never dropped, unlike taking every k-th point. The tables use every value.
* NaN and infinite values are not drawn as points (they have no place on a y axis): red ticks
  under the plot mark the steps where a member was non-finite.

Example::

    from trainvitals.report import write_report
    path = write_report("runs/demo")          # runs/demo/report.html
"""

from __future__ import annotations

import datetime as _dt
import functools
import html
import math
import os
import re
import statistics
import sys
import warnings
from array import array
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from trainvitals._natural import natural_key, natural_order
from trainvitals.moe.capture import LAYER_NUMBER
from trainvitals.report.query import (
    KINDS,
    TENSOR_STATS_FILE,
    Grouping,
    NewerVersionError,
    StepChunks,
    format_value,
    gc_paused,
    matcher,
    merge_grouped,
    merge_records,
    parse_steps,
    read_tensor_stats,
)
from trainvitals.report.sources import (
    StepValues,
    find_metrics,
    holds_values,
    load_metrics,
    name_a_few,
)
from trainvitals.stats.moments import FIELDS

__all__ = ["DEFAULT_MAX_POINTS", "decimate", "family_of", "render_report", "write_report"]

DEFAULT_MAX_POINTS = 600
# A family of more keys than this is drawn as its min / median / max across keys per step.
MAX_LINES = 10
_DIGITS = re.compile(r"\d+")
# Sections in this order first (the rest alphabetically): what a trainer looks at first.
_AREA_ORDER = ("train", "l2_norm", "moe", "load_balance", "tensor_stats", "throughput", "time")
_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
# Anchors of a perceptually ordered ramp (viridis) for a chart of more lines than _PALETTE
# (none since families and per-layer charts above MAX_LINES are banded: min / median / max).
_RAMP = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
_TENSOR_STATS = ("rms", "kurtosis", "skewness", "abs_max", "nonfinite")
_TABLE_STATS = ("count", "mean", "std", "rms", "skewness", "kurtosis", "min", "max", "nonfinite")
# what the merge of each chunk must derive for _TENSOR_STATS (abs_max comes from min and max)
_CHART_MERGE = ("rms", "kurtosis", "skewness", "min", "max", "nonfinite")
_LAYER_STATS = ("rms", "kurtosis")  # charted per layer over the steps


# ------------------------------------------------------------------------------- series


def decimate(points: Sequence[tuple[int, float]], max_points: int) -> list[tuple[int, float]]:
    """At most ``max_points`` of ``points`` (``(step, value)`` in step order, finite values):
    all of them when they fit, else the smallest and largest value of each of
    ``max_points // 2`` buckets of consecutive points, in step order. The extremes of every
    bucket, hence of the whole series, are kept: a spike of one step stays on the chart."""
    if max_points < 2:
        raise ValueError(f"max_points must be at least 2, got {max_points}")
    n = len(points)
    if n <= max_points:
        return list(points)
    buckets = max_points // 2
    out: list[tuple[int, float]] = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        lo_at = hi_at = lo
        for i in range(lo + 1, hi):
            v = points[i][1]
            if v < points[lo_at][1]:
                lo_at = i
            if v > points[hi_at][1]:
                hi_at = i
        out.append(points[min(lo_at, hi_at)])
        if hi_at != lo_at:
            out.append(points[max(lo_at, hi_at)])
    return out


def family_of(key: str) -> str:
    """The family of a key: its integers replaced by ``*`` (``moe/layer_3/cv`` ->
    ``moe/layer_*/cv``)."""
    return _DIGITS.sub("*", key)


class _Series:
    """One metric: its points in step order, one per step (a later line wins within a step),
    never changed."""

    def __init__(self, points: StepValues) -> None:
        self.points = points

    def ordered(self) -> list[tuple[int, float]]:
        """``(step, value)`` pairs, made when a chart is drawn and dropped after it (kept for
        every metric, the pairs would cost ten times the arrays they come from)."""
        return list(zip(self.points.steps, self.points.values, strict=True))

    @functools.cached_property
    def summary(self) -> dict[str, Any]:
        steps, values = self.points.steps, self.points.values
        finite = [v for v in values if math.isfinite(v)]
        bad = [s for s, v in zip(steps, values, strict=True) if not math.isfinite(v)]
        return {
            "first_step": steps[0],
            "last_step": steps[-1],
            "last": values[-1],
            "min": min(finite) if finite else math.nan,
            "max": max(finite) if finite else math.nan,
            "mean": _mean(finite),
            "points": len(steps),
            "nonfinite": len(bad),
            "first_nonfinite": bad[0] if bad else None,
        }


def _fsum(values: Sequence[float]) -> float:
    """The correctly rounded sum of finite ``values`` (``math.fsum``), ``+-inf`` where that sum
    is beyond float64's range. ``math.fsum`` raises ``OverflowError`` when a partial sum
    overflows, even where the total fits (``[1e308, 1e308, -1e308]``): a diverged run's
    ``exp(loss)`` near ``1e308`` logged twice ended the report with a traceback. Then the
    values are summed divided by a power of two above ``2 * len(values)`` (exact, bar
    subnormals), which no partial sum can overflow, and scaled back."""
    try:
        return math.fsum(values)
    except OverflowError:
        scale = 2.0 ** (len(values).bit_length() + 1)
        return math.fsum(v / scale for v in values) * scale  # (inf where the sum is)


def _mean(values: Sequence[float]) -> float:
    """The mean of finite ``values`` (NaN for none), also where their sum is beyond float64's
    range (:func:`_fsum`): ``1e308`` and ``1.5e308`` average ``1.25e308``."""
    n = len(values)
    if not n:
        return math.nan
    try:
        return math.fsum(values) / n
    except OverflowError:
        scale = 2.0 ** (n.bit_length() + 1)
        return math.fsum(v / scale for v in values) / n * scale


def _median(ordered: Sequence[float]) -> float:
    """The median of sorted finite values: ``statistics.median``, whose ``(a + b) / 2`` of the
    middle pair is ``inf`` when ``a + b`` overflows (then ``a / 2 + b / 2``, which cannot)."""
    mid = statistics.median(ordered)
    if math.isinf(mid):
        n = len(ordered)
        mid = ordered[n // 2 - 1] / 2 + ordered[n // 2] / 2
    return mid


# -------------------------------------------------------------------------------- drawing


def _value_attr(v: Any) -> str:
    """The exact value for machines (``data-value``): repr of the float, '' for none."""
    if v is None:
        return ""
    return repr(float(v)) if isinstance(v, float | int) else html.escape(str(v))


def _color(i: int, n: int) -> str:
    if n <= len(_PALETTE):
        return _PALETTE[i % len(_PALETTE)]
    t = i / (n - 1) * (len(_RAMP) - 1)
    k = min(int(t), len(_RAMP) - 2)
    f = t - k
    a, b = _RAMP[k], _RAMP[k + 1]
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b, strict=True))


def _chart(
    title: str,
    lines: Sequence[tuple[str, list[tuple[int, float]]]],
    max_points: int,
    width: int = 380,
    height: int = 150,
) -> str:
    """An inline SVG line chart of ``lines`` (label, [(step, value)]); non-finite values become
    red ticks under the plot."""
    left, right, top, bottom = 62, 8, 8, 30
    pw, ph = width - left - right, height - top - bottom
    finite = [(lab, [(s, v) for s, v in pts if math.isfinite(v)]) for lab, pts in lines]
    bad_steps = sorted({s for _, pts in lines for s, v in pts if not math.isfinite(v)})
    all_steps = [s for _, pts in lines for s, _ in pts]
    values = [v for _, pts in finite for _, v in pts]
    out = [
        f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'data-key="{html.escape(title)}" role="img"><title>{html.escape(title)}</title>'
    ]
    if not all_steps:
        return out[0] + "</svg>"
    x0, x1 = min(all_steps), max(all_steps)
    if values:
        y0, y1 = min(values), max(values)
        if y0 == y1:  # a flat line: give it a band around the value (within float64's range)
            pad = abs(y0) * 0.05 or 1.0
            y0, y1 = max(y0 - pad, -sys.float_info.max), min(y1 + pad, sys.float_info.max)
    else:
        y0, y1 = 0.0, 1.0
    span = y1 - y0  # inf for values from below -9e307 to above 9e307: then of halves
    halves = math.isinf(span)

    def px(s: float) -> float:
        return left + (pw * (s - x0) / (x1 - x0) if x1 > x0 else pw / 2)

    def py(v: float) -> float:
        # (the fraction first: ph * (y1 - v) overflowed to inf for spans above 1.6e306)
        if halves:  # ((y1 - v) / inf put every point at the top, and the extremes at nan)
            return top + ph * ((y1 / 2 - v / 2) / (y1 / 2 - y0 / 2))
        return top + ph * ((y1 - v) / span)

    out.append(
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>'
    )
    for v, y in ((y1, top), (y0, top + ph)):
        out.append(
            f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" class="ax">{format_value(v)}</text>'
        )
    out.append(f'<text x="{left}" y="{height - 16}" class="ax">{x0}</text>')
    out.append(f'<text x="{left + pw}" y="{height - 16}" text-anchor="end" class="ax">{x1}</text>')
    if not values:
        out.append(
            f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" class="ax">'
            "no finite value</text>"
        )
    for i, (label, pts) in enumerate(finite):
        color = _color(i, len(finite))
        shown = decimate(pts, max_points)
        attrs = f'data-label="{html.escape(label)}" stroke="{color}"'
        if len(shown) == 1:
            s, v = shown[0]
            out.append(
                f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="2.5" fill="{color}" {attrs}/>'
            )
        elif shown:
            coords = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in shown)
            out.append(
                f'<polyline points="{coords}" fill="none" stroke-width="1.2" {attrs}>'
                f"<title>{html.escape(label)}</title></polyline>"
            )
    if bad_steps:
        ticks = decimate([(s, 0.0) for s in bad_steps], max_points)  # at most max_points
        ys, ye = top + ph + 2, top + ph + 9
        marks = "".join(f"M{px(s):.1f} {ys}V{ye}" for s, _ in ticks)
        out.append(
            f'<path d="{marks}" stroke="#d62728" stroke-width="1.5" class="nonfinite" '
            f'data-steps="{len(bad_steps)}"><title>non-finite at '
            f"{_count(len(bad_steps), 'step')}, first {bad_steps[0]}</title></path>"
        )
    if len(finite) > 1:
        legend = _legend(finite)
        out.append(f'<text x="{left}" y="{height - 3}" class="legend">{legend}</text>')
    out.append("</svg>")
    return "".join(out)


def _legend(lines: Sequence[tuple[str, Any]]) -> str:
    n = len(lines)
    if n > len(_PALETTE):  # a ramp: name its two ends
        return (
            f'<tspan fill="{_color(0, n)}">{html.escape(lines[0][0])}</tspan> … '
            f'<tspan fill="{_color(n - 1, n)}">{html.escape(lines[-1][0])}</tspan> '
            f"({_count(n, 'line')})"
        )
    return " ".join(
        f'<tspan fill="{_color(i, n)}">{html.escape(label)}</tspan>'
        for i, (label, _) in enumerate(lines)
    )


def _count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun, singular for exactly one ("1 line", "2 lines", "0 lines")."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _table(cls: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A table whose first column names the row and whose other cells carry their exact value
    in ``data-value``."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for j, v in enumerate(row):
            if j == 0:
                cells.append(f"<td class=name>{html.escape(str(v))}</td>")
                continue
            bad = isinstance(v, float) and not math.isfinite(v)
            cells.append(
                f'<td data-col="{html.escape(columns[j])}" data-value="{_value_attr(v)}"'
                f"{' class=bad' if bad else ''}>{format_value(v)}</td>"
            )
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="{cls}"><tr>{head}</tr>{"".join(body)}</table>'


# ------------------------------------------------------------------------------- sections


def _area(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else "(no area)"


def _area_rank(area: str) -> tuple:
    return (_AREA_ORDER.index(area), "") if area in _AREA_ORDER else (len(_AREA_ORDER), area)


def _anchor(area: str, taken: set[str]) -> str:
    """The ``id`` of an area's section (``m-<area>``, a run of other characters than letters,
    digits, ``_`` and ``-`` as one ``-``; letters of any script kept), not one of ``taken``
    (then ``-2``, ``-3``, ...), added to it. ASCII letters alone made every area named in
    another script one id (``α/x`` and ``β/x``: ``m--``), as ``a b`` and ``a-b`` were: the
    link of the second led to the first."""
    base = "m-" + re.sub(r"[^\w-]+", "-", area)
    anchor, n = base, 1
    while anchor in taken:
        n += 1
        anchor = f"{base}-{n}"
    taken.add(anchor)
    return anchor


def _metrics_sections(series: dict[str, _Series], max_points: int) -> tuple[list[str], list[str]]:
    """(navigation links, HTML sections) for the metrics, one section per area."""
    by_area: dict[str, list[str]] = {}
    for key in series:
        by_area.setdefault(_area(key), []).append(key)
    nav, parts = [], []
    anchors: set[str] = set()
    for area in sorted(by_area, key=_area_rank):
        keys = sorted(by_area[area], key=natural_key)
        families: dict[str, list[str]] = {}
        for key in keys:
            families.setdefault(family_of(key), []).append(key)
        charts = []
        for fam, members in families.items():
            if len(members) == 1:
                title, lines = members[0], [(members[0], series[members[0]].ordered())]
            elif len(members) <= MAX_LINES:
                title = fam
                lines = [(_member_label(m), series[m].ordered()) for m in members]
            else:
                title = fam
                lines = _band([(series[m].points.steps, series[m].points.values) for m in members])
            charts.append(
                f'<div class="card">{_chart_title(title)}{_chart(title, lines, max_points)}</div>'
            )
        rows = []
        for key in keys:
            sm = series[key].summary
            rows.append(
                [key, sm["last"], sm["last_step"], sm["min"], sm["max"], sm["mean"],
                 sm["points"], sm["nonfinite"]]
            )  # fmt: skip
        table = _table(
            "metrics",
            ["key", "last", "last step", "min", "max", "mean", "steps", "non-finite"],
            rows,
        )
        anchor = html.escape(_anchor(area, anchors))
        nav.append(f'<a href="#{anchor}">{html.escape(area)}</a>')
        parts.append(
            f'<section id="{anchor}" class="area" data-area="{html.escape(area)}">'
            f"<h2>{html.escape(area)} <small>{_count(len(keys), 'key')}</small></h2>"
            f'<div class="grid">{"".join(charts)}</div>'
            f"<details><summary>table of the {_count(len(keys), 'key')} (min, max and mean over "
            f"finite values)</summary>{table}</details></section>"
        )
    return nav, parts


def _band(
    members: Sequence[tuple[Sequence[int], Sequence[float]]],
) -> list[tuple[str, list[tuple[int, float]]]]:
    """Lines ``min``, ``median``, ``max`` across ``members`` (each its steps and its values)
    at each step (finite values; a step where some member was non-finite gets a NaN on the
    ``max`` line, so it is marked). A family of more than :data:`MAX_LINES` metric keys is
    drawn so, and so are the per-layer tensor charts of more than that many layers."""
    by_step: dict[int, list[float]] = {}
    for steps, values in members:
        for step, v in zip(steps, values, strict=True):
            by_step.setdefault(step, []).append(v)
    lo, mid, hi = [], [], []
    for step in sorted(by_step):
        vals = sorted(v for v in by_step[step] if math.isfinite(v))
        if not vals:
            lo.append((step, math.nan))
            mid.append((step, math.nan))
            hi.append((step, math.nan))
            continue
        lo.append((step, vals[0]))
        mid.append((step, _median(vals)))
        hi.append((step, vals[-1] if len(vals) == len(by_step[step]) else math.nan))
    n = len(members)
    return [(f"min of {n}", lo), (f"median of {n}", mid), (f"max of {n}", hi)]


def _member_label(key: str) -> str:
    nums = _DIGITS.findall(key)
    return "/".join(nums)


def _chart_title(title: str) -> str:
    return f'<div class="ct">{html.escape(title)}</div>'


_TOKENS_KEY = re.compile(r"^moe/layer_([^/]+)/tokens_per_expert/(\d+)$")


def _expert_load_section(series: dict[str, _Series]) -> tuple[list[str], str]:
    """Heatmaps of ``moe/layer_<l>/tokens_per_expert/<e>`` (LoadBalanceMonitor, detailed
    mode): each expert's utilization, its tokens over its layer's mean per expert, at the last
    step that logged them and over every step shown. ``([], "")`` without such keys."""
    cells: dict[tuple[str, int], _Series] = {}
    for key, ser in series.items():
        m = _TOKENS_KEY.match(key)
        if m:
            cells[(m.group(1), int(m.group(2)))] = ser
    if not cells:
        return [], ""
    layers = sorted({lab for lab, _ in cells}, key=natural_order)
    experts = sorted({e for _, e in cells})
    last = max(ser.points.steps[-1] for ser in cells.values())

    def at_last(ser: _Series) -> float:
        return ser.points.get(last, math.nan)

    def summed(ser: _Series) -> float:
        return _fsum([v for v in ser.points.values if math.isfinite(v)])

    maps = [
        (f"expert-load/step-{last}", f"step {last}", at_last),
        ("expert-load/all", "all steps shown, tokens summed", summed),
    ]
    body = []
    for key, caption, pick in maps:
        grid = {
            lab: {e: pick(cells[(lab, e)]) if (lab, e) in cells else math.nan for e in experts}
            for lab in layers
        }
        body.append(
            f'<div class="card"><div class="ct">{html.escape(caption)}</div>'
            f"{_heatmap(key, layers, experts, grid)}</div>"
        )
    legend = (
        "utilization = an expert's tokens / its layer's mean tokens per expert (1 = balanced); "
        '<span style="color:#b2182b">red: starved (1/4 and below)</span>, white: balanced, '
        '<span style="color:#2166ac">blue: overloaded (4x and above)</span>, black: no token '
        "(dead), grey: not logged. Hover a cell for its numbers."
    )
    return ['<a href="#expert-load">expert load</a>'], (
        '<section id="expert-load"><h2>Expert load <small>'
        f"{_count(len(layers), 'layer')} x {_count(len(experts), 'expert')}</small></h2>"
        f'<p class="meta">{legend}</p><div class="grid wide">{"".join(body)}</div></section>'
    )


def _heatmap(
    key: str, layers: Sequence[str], experts: Sequence[int], grid: dict[str, dict[int, float]]
) -> str:
    cw = max(4, min(16, 640 // max(1, len(experts))))
    ch = max(6, min(16, 480 // max(1, len(layers))))
    left, top = 56, 4
    width, height = left + cw * len(experts) + 4, top + ch * len(layers) + 18
    out = [
        f'<svg class="heatmap" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" data-key="{html.escape(key)}" role="img">'
    ]
    for i, lab in enumerate(layers):
        row = grid[lab]
        finite = [v for v in row.values() if math.isfinite(v)]
        # over the layer's own experts (those logged), as LoadBalanceMonitor defines it: the
        # columns are every layer's experts, and a layer with fewer would be diluted
        mean = _mean(finite)
        y = top + i * ch
        out.append(
            f'<text x="{left - 4}" y="{y + ch - 1}" text-anchor="end" class="ax">'
            f"layer {html.escape(lab)}</text>"
        )
        for j, e in enumerate(experts):
            tokens = row[e]
            util = tokens / mean if math.isfinite(tokens) and mean > 0 else math.nan
            out.append(
                f'<rect x="{left + j * cw}" y="{y}" width="{cw}" height="{ch}" '
                f'fill="{_load_color(tokens, util)}" data-layer="{html.escape(lab)}" '
                f'data-expert="{e}" data-tokens="{_value_attr(tokens)}" '
                f'data-util="{_value_attr(util)}"><title>layer {html.escape(lab)}, expert {e}: '
                f"{format_value(tokens)} tokens, utilization {format_value(util)}</title></rect>"
            )
    out.append(
        f'<text x="{left}" y="{height - 4}" class="ax">expert {experts[0]}</text>'
        f'<text x="{left + cw * len(experts)}" y="{height - 4}" text-anchor="end" class="ax">'
        f"expert {experts[-1]}</text></svg>"
    )
    return "".join(out)


def _load_color(tokens: float, util: float) -> str:
    if not math.isfinite(tokens) or tokens < 0:
        return "#cccccc"  # not logged (or NaN; a negative count is no count either)
    if tokens == 0:
        return "#000000"  # a dead expert
    if not (math.isfinite(util) and util > 0):  # (log2 of a negative: a crash of the report)
        return "#cccccc"
    t = max(-1.0, min(1.0, math.log2(util) / 2))  # 1/4 .. 4 -> -1 .. 1
    white, end = (247, 247, 247), ((178, 24, 43) if t < 0 else (33, 102, 172))
    return "#" + "".join(
        f"{round(w + (c - w) * abs(t)):02x}" for w, c in zip(white, end, strict=True)
    )


class _StepStats:
    """What the report keeps of one step of one kind, in float64 arrays: ``merged``, the
    :data:`_TENSOR_STATS` of all tensors (None: the step holds none); ``labels``, its layers
    (one tuple shared by the steps of the same layers) and ``values``, their
    :data:`_LAYER_STATS`, layer after layer; ``nonfinite``, tensor -> count (nonzero only).
    A dict per layer and step (``{"rms": ..., "kurtosis": ...}``) cost ~250 bytes a layer,
    ~170 MB for 80 layers x 4 kinds x 2,000 steps; 16 bytes here (docs/benchmarks.md,
    session 21)."""

    __slots__ = ("labels", "merged", "nonfinite", "values")

    def __init__(self, nonfinite: dict[str, float]) -> None:
        self.merged: array | None = None
        self.labels: tuple[str, ...] = ()
        self.values = _NO_VALUES
        self.nonfinite = nonfinite


_NO_VALUES = array("d")  # (shared by the steps without layers; never appended to)


class _KindStats:
    """One kind's tensor statistics, reduced while ``tensor_stats.jsonl`` is read (a
    :class:`StepChunks`: memory holds a chunk of records, not the file): per step the charted
    statistics of all tensors merged and of each layer and the tensors with non-finite
    elements, and the record of the last step holding tensors whole (for its tables: a last
    step whose record holds none would show empty ones)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.steps: set[int] = set()
        self.last_step: int | None = None  # of the tables: the last step with tensors
        self.last_record: dict[str, Any] | None = None
        self.chunks = StepChunks(self._reduce)
        everything = matcher(None)
        # (kept for the whole file: each plans a list of tensor names once, not once per line)
        self._all = Grouping(everything, None, False)
        self._by_layer = Grouping(everything, LAYER_NUMBER, False)
        self._labels: dict[tuple[str, ...], tuple[str, ...]] = {}  # one tuple per list of layers

    def add(self, step: int, rec: dict[str, Any]) -> None:
        self.steps.add(step)
        if rec.get("tensors") and (self.last_step is None or step >= self.last_step):
            self.last_step, self.last_record = step, rec
        self.chunks.add(step, rec)

    def flush(self) -> None:
        self.chunks.flush()

    def _reduce(self, records: dict[int, dict[str, Any]]) -> dict[int, _StepStats]:
        out = {step: _StepStats(_nonfinite_counts(rec)) for step, rec in records.items()}
        # all tensors and each layer in one merge (the numbers of two merges of their own)
        merged, layers = merge_grouped(
            records, self.kind, [(_CHART_MERGE, self._all), (_LAYER_STATS, self._by_layer)]
        )
        for r in merged:
            out[r["step"]].merged = array("d", [_stat(r, s) for s in _TENSOR_STATS])
        labels: dict[int, list[str]] = {}
        for r in layers:  # (in step order, then the layers' order)
            step = r["step"]
            labels.setdefault(step, []).append(r["group"])
            st = out[step]
            if st.values is _NO_VALUES:
                st.values = array("d")
            st.values.extend([_stat(r, s) for s in _LAYER_STATS])
        for step, names in labels.items():
            key = tuple(names)
            out[step].labels = self._labels.setdefault(key, key)
        return out

    def layer_series(self) -> dict[str, tuple[list[int], list[array]]]:
        """layer -> (its steps; per stat of :data:`_LAYER_STATS`, its values, float64), in
        step order, for the steps holding that layer. (The steps in a list: a record's step
        is any JSON integer, and an int64 array refused one of 2**63.)"""
        results = self.chunks.results
        out: dict[str, tuple[list[int], list[array]]] = {}
        width = len(_LAYER_STATS)
        for step in sorted(results):
            st = results[step]
            for j, g in enumerate(st.labels):
                found = out.get(g)
                if found is None:
                    found = out[g] = ([], [array("d") for _ in _LAYER_STATS])
                found[0].append(step)
                for k, values in enumerate(found[1]):
                    values.append(st.values[j * width + k])
        return out

    @property
    def merged(self) -> dict[int, dict[str, float]]:
        """step -> charted stat -> value, for the steps with tensors."""
        return {
            s: dict(zip(_TENSOR_STATS, v.merged, strict=True))
            for s, v in self.chunks.results.items()
            if v.merged is not None
        }

    @property
    def layers(self) -> dict[int, dict[str, dict[str, float]]]:
        """step -> layer -> stat -> value, for the steps with layered tensors (made from the
        arrays when asked for: the report itself reads :meth:`layer_series`)."""
        width = len(_LAYER_STATS)
        return {
            s: {
                g: dict(zip(_LAYER_STATS, v.values[j * width : (j + 1) * width], strict=True))
                for j, g in enumerate(v.labels)
            }
            for s, v in self.chunks.results.items()
            if v.labels
        }

    @property
    def nonfinite(self) -> dict[int, dict[str, float]]:
        """step -> tensor -> non-finite count, for the steps with any."""
        return {s: v.nonfinite for s, v in self.chunks.results.items() if v.nonfinite}


def _nonfinite_counts(rec: dict[str, Any]) -> dict[str, float]:
    """The tensors of a record with non-finite elements, and how many."""
    # (no ``fields``: the version-1 order, as read_tensor_stats and the merge read it; ``[]``
    # here hid the tensors' non-finite counts from Attention, which said none ever was)
    fields = rec.get("fields", FIELDS)
    if "nonfinite" not in fields:
        return {}
    col = fields.index("nonfinite")
    return {name: float(v[col]) for name, v in rec["tensors"].items() if v[col]}


def _tensor_sections(
    kinds: dict[str, _KindStats], max_points: int
) -> tuple[list[str], list[str], list[list[Any]]]:
    """(navigation links, HTML sections, attention rows) for ``tensor_stats.jsonl``."""
    nav, parts, attention = [], [], []
    everything = matcher(None)
    stats = list(_TABLE_STATS)
    for kind in KINDS:
        ks = kinds[kind]
        ks.flush()
        if not ks.steps:
            continue
        last_step = ks.last_step
        charts = []
        merged = ks.merged
        for stat in _TENSOR_STATS:
            pts = [(step, merged[step][stat]) for step in sorted(merged)]
            if stat == "nonfinite" and not any(v for _, v in pts):
                continue
            title = f"{kind}/all/{stat}"
            charts.append(
                f'<div class="card">{_chart_title(title)}'
                f"{_chart(title, [('all', pts)], max_points)}</div>"
            )
        per_layer = ks.layer_series()
        layers = sorted(per_layer, key=natural_order)
        if len(layers) > 1:
            for k, stat in enumerate(_LAYER_STATS):
                if len(layers) <= MAX_LINES:
                    lines = [
                        (f"layer {g}", list(zip(per_layer[g][0], per_layer[g][1][k], strict=True)))
                        for g in layers
                    ]
                else:  # (a line per layer: 80 layers drew 80 lines no one tells apart)
                    lines = _band([(per_layer[g][0], per_layer[g][1][k]) for g in layers])
                title = f"{kind}/layer_*/{stat}"
                charts.append(
                    f'<div class="card">{_chart_title(title)}{_chart(title, lines, max_points)}'
                    "</div>"
                )
        last = {} if last_step is None or ks.last_record is None else {last_step: ks.last_record}
        cols = ["tensors", *_TABLE_STATS]
        all_rows = [
            ["all", *(_cell(r, c) for c in cols)]
            for r in merge_records(last, kind, stats, everything, None, False)
        ]
        layer_rows = [
            [r["group"], *(_cell(r, c) for c in cols)]
            for r in merge_records(last, kind, stats, everything, LAYER_NUMBER, False)
        ]
        tensor_rows = [
            [r["group"], *(_cell(r, c) for c in cols[1:])]
            for r in merge_records(last, kind, stats, everything, None, True)
        ]
        anchor = f"t-{kind}"
        nav.append(f'<a href="#{anchor}">tensors: {kind}</a>')
        if last_step is None:
            tables = '<p class="meta">No step of this kind holds tensors.</p>'
        else:
            tables = (
                f"<h3>step {last_step}: all tensors and per layer</h3>"
                + _table(f"tensors-layers {kind}", ["group", *cols], all_rows + layer_rows)
                + f"<details><summary>step {last_step}: "
                + ("each of the " if len(tensor_rows) != 1 else "the ")
                + f"{_count(len(tensor_rows), 'tensor')}</summary>"
                + _table(f"tensors-each {kind}", ["tensor", *cols[1:]], tensor_rows)
                + "</details>"
            )
        parts.append(
            f'<section id="{anchor}" class="tensors" data-kind="{kind}">'
            f"<h2>tensor statistics: {kind} <small>{_count(len(ks.steps), 'step')}, "
            f"{_count(len(tensor_rows), 'tensor')}</small></h2>"
            f'<div class="grid">{"".join(charts)}</div>{tables}</section>'
        )
        attention += _tensor_attention(ks.nonfinite, kind)
    return nav, parts, attention


def _stat(row: dict[str, Any], stat: str) -> float:
    if stat == "abs_max":
        lo, hi = row["min"], row["max"]
        if lo is None or hi is None:
            return math.nan
        return max(abs(lo), abs(hi))
    v = row[stat]
    return math.nan if v is None else float(v)


def _cell(row: dict[str, Any], col: str) -> Any:
    v = row[col]
    return math.nan if v is None and col not in ("count", "nonfinite", "tensors") else v


def _tensor_attention(nonfinite: dict[int, dict[str, float]], kind: str) -> list[list[Any]]:
    """Rows (what, name, first step, steps, worst count) for tensors with non-finite elements,
    from :attr:`_KindStats.nonfinite`."""
    seen: dict[str, list[int]] = {}
    worst: dict[str, float] = {}
    for step in sorted(nonfinite):
        for name, n in nonfinite[step].items():
            seen.setdefault(name, []).append(step)
            worst[name] = max(worst.get(name, 0.0), n)
    return [
        [f"tensor ({kind})", name, steps[0], len(steps), worst[name]]
        for name, steps in sorted(seen.items(), key=lambda kv: natural_key(kv[0]))
    ]


# --------------------------------------------------------------------------------- report

_CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:16px 24px;color:#222}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px;border-bottom:1px solid #ddd}
h2 small,h3{font-weight:normal;color:#666}h3{font-size:13px}
nav a{margin-right:10px}.meta{color:#555}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(390px,1fr));gap:10px}
.grid.wide{grid-template-columns:repeat(auto-fill,minmax(720px,1fr))}
.card{border:1px solid #e3e3e3;border-radius:6px;padding:4px 6px;background:#fff}
.ct{font-family:ui-monospace,monospace;font-size:12px;overflow-wrap:anywhere}
.chart .ax,.heatmap .ax{font-size:10px;fill:#666}.chart .legend{font-size:10px}
table{border-collapse:collapse;margin:6px 0;font-size:12px}
td,th{border:1px solid #e3e3e3;padding:2px 6px;text-align:right}
td.name{text-align:left;font-family:ui-monospace,monospace}
td.bad{color:#c00;font-weight:bold}.ok{color:#2a7}.warn{color:#c00}
"""


def render_report(
    run_dir: str | os.PathLike[str],
    *,
    metrics: str | os.PathLike[str] | None = None,
    keys: str | Sequence[str] | None = None,
    steps: str | tuple[int | None, int | None] | int | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
    title: str | None = None,
) -> str:
    """The HTML text of the report of ``run_dir`` (see the module docstring).

    Args:
        run_dir: the run folder.
        metrics: where the scalars are: a JSONL file, a TensorBoard event file or folder, or a
            metrics CSV (default: found in the run folder, see
            :mod:`trainvitals.report.sources`; a relative path is taken from the current
            directory).
        keys: glob(s) over metric keys to include (``"moe/*"``, ``["train/*", "l2_norm/*"]``);
            default all. Tensor statistics are not filtered by it.
        steps: ``"100:200"`` (inclusive), ``"100:"``, ``":200"``, ``"150"`` or None for all
            (the ``tensor_stats.jsonl`` lines of other steps are passed over unparsed, as by
            :func:`~trainvitals.report.query.read_tensor_stats` with ``first`` and ``last``).
        max_points: the most points drawn per line (see :func:`decimate`).
        title: the page title (default: the run folder's name).

    Raises:
        FileNotFoundError: ``run_dir`` holds neither metrics nor tensor statistics, or is a
            folder of several runs (see :func:`_tensor_stats_path`).
        ValueError: bad ``steps``, ``max_points``; and
            :class:`~trainvitals.report.query.NewerVersionError` (a ``ValueError``): the run
            has no metrics and its ``tensor_stats.jsonl`` was written by a newer trainvitals
            (none of its lines readable here: upgrade). Beside metrics, that file is not an
            error: the page shows the metrics and the message (also warned, RuntimeWarning).
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"no run folder at {run}")
    if not isinstance(max_points, int) or isinstance(max_points, bool) or max_points < 2:
        raise ValueError(f"max_points must be an integer >= 2, got {max_points!r}")
    first, last = parse_steps(steps)
    globs = [keys] if isinstance(keys, str) else list(keys) if keys is not None else None
    if globs is not None and not all(isinstance(g, str) for g in globs):
        raise TypeError(f"keys must be a glob or a list of globs, got {keys!r}")

    def keep(key: str) -> bool:
        return globs is None or any(fnmatchcase(key, g) for g in globs)

    if metrics is not None:
        metrics_path: Path | None = Path(metrics)
        if not metrics_path.exists():
            raise FileNotFoundError(f"no metrics file at {metrics_path}")
    else:
        metrics_path = find_metrics(run)
    stats_path = _tensor_stats_path(run, metrics_path, metrics_given=metrics is not None)
    if metrics_path is None and not stats_path.exists():
        raise FileNotFoundError(
            f"{run} holds no metrics (metrics.jsonl, TensorBoard event files, metrics.csv) and "
            f"no {TENSOR_STATS_FILE}"
        )

    with gc_paused():  # millions of parsed containers, none in a cycle
        sources: list[str] = []
        series: dict[str, _Series] = {}
        times: Sequence[float] = ()
        if metrics_path is not None:
            source = load_metrics(metrics_path, keep, first, last)
            series = {key: _Series(points) for key, points in source.values.items()}
            times = source.times
            sources.append(html.escape(source.description))
        kinds = {kind: _KindStats(kind) for kind in KINDS}
        tensor_steps: list[int] = []  # the first and last step of the records shown
        newer = ""  # the tensor statistics file is of a newer trainvitals: why it is not shown
        lines = 0  # the tensor-statistics records of the steps shown, of any kind
        if stats_path.exists():
            try:
                # (the lines of steps outside first..last are passed over unparsed where their
                # start tells their step: read_tensor_stats, as `trainvitals query --steps`)
                for rec in read_tensor_stats(stats_path, first=first, last=last):
                    step = int(rec["step"])
                    if (first is not None and step < first) or (last is not None and step > last):
                        continue  # (a line read whole, not passed over: still not shown)
                    lines += 1
                    ks = kinds.get(rec.get("kind"))  # type: ignore[arg-type]
                    if ks is not None:
                        ks.add(step, rec)
                        tensor_steps = (
                            [min(tensor_steps[0], step), max(tensor_steps[1], step)]
                            if tensor_steps
                            else [step, step]
                        )
            except NewerVersionError as exc:
                # (raised once the whole file was read, none of it readable: no record kept)
                if metrics_path is None:
                    raise  # a page with nothing on it: the error says to upgrade
                # the metrics are still worth a page, with the reason the tensors are missing
                newer = str(exc)
                warnings.warn(newer, RuntimeWarning, stacklevel=2)
            sources.append(
                f"{html.escape(str(stats_path))} "
                + (
                    "(not read: of a newer trainvitals)"
                    if newer
                    else f"({_count(lines, 'line')}{' in the steps shown' * (steps is not None)})"
                )
            )

        if not series and not tensor_steps and not newer:
            filtered = globs is not None or first is not None or last is not None
            _nothing_to_report(metrics_path, stats_path, filtered=filtered, counted=lines)
        if metrics_path is not None and not series:
            wanted = [f"keys {globs}"] * (globs is not None) + [f"steps {steps}"] * (
                steps is not None
            )
            warnings.warn(
                f"{source.description}: no metric "
                + (f"within {' and '.join(wanted)}" if wanted else "values"),
                RuntimeWarning,
                stacklevel=2,
            )
        load_nav, load_html = _expert_load_section(series)
        nav, sections = _metrics_sections(series, max_points)
        nav = load_nav + nav
        t_nav, t_sections, t_attention = _tensor_sections(kinds, max_points)
    attention = [
        ["metric", key, sm["first_nonfinite"], sm["nonfinite"], None]
        for key, s in sorted(series.items(), key=lambda kv: natural_key(kv[0]))
        if (sm := s.summary)["nonfinite"]
    ] + t_attention
    if attention:
        att = _table(
            "attention",
            ["what", "first step", "steps", "most non-finite elements"],
            [
                [f"{what}: {name}", first_step, n, most]
                for what, name, first_step, n, most in attention
            ],
        )
        att_html = (
            f'<p class="warn">{_count(len(attention), "metric or tensor", "metrics or tensors")} '
            f"{'was' if len(attention) == 1 else 'were'} NaN or infinite at some step.</p>{att}"
        )
    else:
        att_html = '<p class="ok">No metric and no tensor was ever NaN or infinite.</p>'
    if newer:
        att_html = (
            f'<p class="warn" id="newer-format">No tensor statistics: {html.escape(newer)}.</p>'
            + att_html.replace("No metric and no tensor was", "No metric was")
        )

    # the span of what the page shows: the metrics and the tensor records within --steps
    ends = [s for ser in series.values() for s in (ser.points.steps[0], ser.points.steps[-1])]
    ends += tensor_steps
    # (nothing within --steps/--keys: no span, and no bare "; " opening the line)
    span = f"steps {min(ends)} to {max(ends)}" if ends else ""
    if ends and len(times) > 1:
        span += f", {(_dt.timedelta(seconds=round(max(times) - min(times))))} of wall time"
    span += "; " if span else ""
    name = title if title is not None else run.resolve().name
    links = "".join(['<a href="#attention">attention</a>', *nav, *t_nav])
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>trainvitals report: {html.escape(name)}</title><style>{_CSS}</style></head><body>"
        f"<h1>trainvitals report: {html.escape(name)}</h1>"
        f'<p class="meta">{span}{len(series)} metric keys. Read from '
        f"{'; '.join(sources)}. Made {now}.</p>"
        f"<nav>{links}</nav>"
        f'<section id="attention"><h2>Attention</h2>{att_html}</section>'
        f"{load_html}"
        f"{''.join(sections)}{''.join(t_sections)}</body></html>\n"
    )


def _nothing_to_report(
    metrics_path: Path | None, stats_path: Path, *, filtered: bool, counted: int
) -> None:
    """Raise ``ValueError`` when the run's files hold nothing readable (``render_report`` found
    nothing to show): an empty ``metrics.jsonl`` or ``tensor_stats.jsonl``, or one holding only
    a line cut by a crash, made an empty page (exit 0) where ``trainvitals query`` says the
    file holds no line yet (exit 2). Returns when it showed nothing only because of ``keys``
    or ``steps`` (the files hold values outside them: the page says so). ``counted``: the
    tensor-statistics records read, of any kind (all of them when not ``filtered``)."""
    metrics_held = metrics_path is not None and filtered and holds_values(metrics_path)
    stats_held = stats_path.exists() and (counted > 0 or (filtered and _holds_a_record(stats_path)))
    if metrics_held or stats_held:
        return
    empty = [str(p) for p in (metrics_path, stats_path if stats_path.exists() else None) if p]
    what = " and ".join(
        ["no metric value"] * (metrics_path is not None)
        + ["no tensor-statistics record"] * stats_path.exists()
    )
    raise ValueError(
        f"nothing to report yet: {' and '.join(empty)} {'hold' if len(empty) > 1 else 'holds'} "
        f"{what} (none logged so far, or only a line cut by a crash)"
    )


def _holds_a_record(path: Path) -> bool:
    with warnings.catch_warnings():  # (its unreadable lines were warned about already)
        warnings.simplefilter("ignore")
        records = read_tensor_stats(path)
        try:
            return next(records, None) is not None
        finally:
            records.close()  # type: ignore[attr-defined]


def _tensor_stats_path(run: Path, metrics_path: Path | None, *, metrics_given: bool) -> Path:
    """The ``tensor_stats.jsonl`` of the run in ``run`` (``run / TENSOR_STATS_FILE``, which may
    not exist). Not in ``run`` itself: the one below it (a logger's folder, Lightning's
    ``lightning_logs/version_0``). A folder of several runs (``lightning_logs/`` holding
    ``version_0`` and ``version_1``) is ambiguous, and reporting one of them silently (the
    oldest, first in name order) would show an old run as the current one; as
    ``trainvitals query`` does, that is an error naming the folders found, unless ``metrics=``
    names a file in exactly one of them. Also an error: the only file below and the metrics
    found below are of different folders (two runs mixed on one page)."""
    here = run / TENSOR_STATS_FILE
    if here.exists():
        return here
    found = sorted(run.rglob(TENSOR_STATS_FILE))
    if not found:
        return here
    owners: list[Path] = []
    below = False  # the metrics were found in a subfolder (a logger's), not in the run folder
    if metrics_path is not None:
        where, top = metrics_path.resolve(), run.resolve()
        owners = [f for f in found if f.parent.resolve() in (where, *where.parents)]
        # (a TensorBoard source is the folder holding the event files, the others a file)
        below = not metrics_given and (where.parent if where.is_file() else where) != top
    if len(found) == 1:
        if below and not owners:
            raise FileNotFoundError(
                f"{run} holds the metrics of {metrics_path} and the tensor statistics of "
                f"{found[0]}, of different run folders; give the run folder "
                f"({found[0].parent}), and --metrics for metrics kept elsewhere"
            )
        return found[0]
    if metrics_given and len(owners) == 1:
        return owners[0]
    names = name_a_few(f.parent for f in found)
    raise FileNotFoundError(
        f"{run} holds no {TENSOR_STATS_FILE} and {len(found)} run folders below it hold one: "
        f"{names}; give one of them as the run folder"
    )


def write_report(
    run_dir: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Path:
    """Write :func:`render_report` of ``run_dir`` to ``output`` (default
    ``<run_dir>/report.html``), replacing it whole (written aside, then renamed), and return
    its path. ``options`` are those of :func:`render_report`, and so are the errors raised
    (see its Raises), before anything is written."""
    text = render_report(run_dir, **options)
    path = Path(output) if output is not None else Path(run_dir) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    # (the name cut: an --output name of 240 characters gave a hidden name beyond the 255 a
    # file system takes, "File name too long", of a file the user never named)
    tmp = path.with_name(f".{path.name[:200]}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)  # (`-o` naming a folder) leave no hidden file behind
        if exc.filename == str(tmp):  # (name the file asked for, not the hidden one beside it)
            raise type(exc)(exc.errno, exc.strerror, str(path)) from None
        raise
    return path
