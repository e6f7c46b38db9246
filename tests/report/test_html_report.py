"""``trainvitals report``: the HTML report against the run's raw lines and float64 on pooled data."""

from __future__ import annotations

import csv
import importlib
import json
import math
import random
import re
import statistics
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.report.test_query_cli import LAYERS, check_row, make_tensors, write_run
from trainvitals.adapters import FanoutWriter, JsonlSink, TensorBoardSink
from trainvitals.cli import main
from trainvitals.report import query, render_report, write_report
from trainvitals.report.html import MAX_LINES, decimate, family_of

STEPS = 1000
SPIKE_STEP, NAN_STEP, INF_STEP = 777, 500, 3
NAN_TENSOR = "model.layers.4.mlp.fc1.weight"


class Page(HTMLParser):
    """The parts of the report the tests read: charts (their lines and marks), tables (cells
    with their exact data-value), links and anything that would load from elsewhere."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.charts: dict[str, dict] = {}
        self.tables: dict[str, list[list[dict]]] = {}
        self.links: list[str] = []
        self.external: list[str] = []
        self._chart: dict | None = None
        self._table: list | None = None
        self._cell: dict | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag in ("script", "link", "img", "iframe") or "src" in a:
            self.external.append(tag)
        if tag == "a":
            self.links.append(a.get("href", ""))
        if tag == "svg":
            self._chart = {"lines": {}, "nonfinite": None, "circles": {}, "cells": {}}
            assert a["data-key"] not in self.charts, f"two charts for {a['data-key']}"
            self.charts[a["data-key"]] = self._chart
        elif tag == "polyline" and self._chart is not None:
            pts = [tuple(map(float, p.split(","))) for p in a["points"].split()]
            self._chart["lines"][a["data-label"]] = pts
        elif tag == "rect" and self._chart is not None and "data-expert" in a:
            self._chart["cells"][(a["data-layer"], int(a["data-expert"]))] = a
        elif tag == "circle" and self._chart is not None:
            self._chart["circles"][a["data-label"]] = (float(a["cx"]), float(a["cy"]))
        elif tag == "path" and a.get("class") == "nonfinite":
            self._chart["nonfinite"] = int(a["data-steps"])
        elif tag == "table":
            self._table = self.tables.setdefault(a["class"], [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = {
                "col": a.get("data-col"),
                "value": a.get("data-value"),
                "text": "",
                "head": tag == "th",
            }
            self._table[-1].append(self._cell)

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._chart = None
        elif tag == "table":
            self._table = None
        elif tag in ("td", "th"):
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell["text"] += data

    def rows(self, cls: str) -> dict[str, dict[str, float | None]]:
        """Tables of class ``cls`` as {first cell's text: {column: exact value}} (header rows
        skipped)."""
        out = {}
        for row in self.tables[cls]:
            if row[0]["head"]:
                continue
            assert row[0]["text"] not in out, f"{row[0]['text']} twice in {cls}"
            out[row[0]["text"]] = {
                c["col"]: (float(c["value"]) if c["value"] else None) for c in row[1:]
            }
        return out


# ------------------------------------------------------------------------------ decimate


@pytest.mark.parametrize("n", [1, 599, 600, 601, 10_007])
def test_decimate_keeps_the_envelope(n: int) -> None:
    rng = random.Random(n)
    points = [(s, rng.gauss(0, 1) + (50.0 if s % 997 == 13 else 0.0)) for s in range(n)]
    out = decimate(points, 600)
    assert len(out) <= 600
    if n <= 600:
        assert out == points
        return
    assert set(out) <= set(points) and out == sorted(out)
    assert max(v for _, v in out) == max(v for _, v in points)
    assert min(v for _, v in out) == min(v for _, v in points)
    # every point lies inside the drawn envelope near it (within two buckets of steps): plain
    # striding, which drops one-step spikes, fails this
    width = 2 * math.ceil(n / 300)
    kept = sorted(out)
    for s, v in points:
        near = [w for t, w in kept if abs(t - s) <= width]
        assert min(near) <= v <= max(near), (s, v)


def test_decimate_rejects_too_few_points() -> None:
    with pytest.raises(ValueError, match="max_points"):
        decimate([(0, 1.0)], 1)


# --------------------------------------------------------------------------- a whole run


def metric_value(key: str, step: int) -> float:
    """The metrics of the test run: a loss with a spike and a NaN, per-layer families, an inf."""
    if key == "train/loss":
        if step == NAN_STEP:
            return math.nan
        return 1000.0 if step == SPIKE_STEP else 5.0 * math.exp(-step / 300) + 0.01 * (step % 7)
    if key == "time/remaining_hours":
        return math.inf if step == INF_STEP else (STEPS - step) / 3600
    layer = int(re.search(r"\d+", key).group())  # type: ignore[union-attr]
    return 0.1 * layer + 0.001 * ((step * (layer + 3)) % 11)


METRIC_KEYS = ["train/loss", "time/remaining_hours"] + [
    f"moe/layer_{i}/cv" for i in range(LAYERS)
]  # layer_2 ... layer_11: numeric order matters


def tensors_with_a_nan(step: int) -> dict[str, torch.Tensor]:
    tensors = make_tensors(step)
    if step == 20:
        tensors[NAN_TENSOR] = tensors[NAN_TENSOR].clone()
        tensors[NAN_TENSOR][0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    return tensors


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("run")
    with FanoutWriter([JsonlSink(run_dir / "metrics.jsonl")]) as writer:
        for step in range(STEPS):
            writer.add_scalars({k: metric_value(k, step) for k in METRIC_KEYS}, step)
    data = write_run(run_dir, [0, 10, 20, 30], tensors_with_a_nan)
    return run_dir, data


def raw_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The metrics file read with json alone (not the package's reader)."""
    spell = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
    out: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for k, v in rec["metrics"].items():
            out.setdefault(k, {})[rec["step"]] = spell[v] if isinstance(v, str) else v
    return {k: sorted(v.items()) for k, v in out.items()}


def test_metric_tables_equal_the_raw_lines(run: tuple[Path, dict]) -> None:
    run_dir, _ = run
    page = Page(render_report(run_dir))
    rows = page.rows("metrics")
    raw = raw_metrics(run_dir)
    assert set(rows) == set(raw) == set(METRIC_KEYS)
    for key, pts in raw.items():
        finite = [v for _, v in pts if math.isfinite(v)]
        row = rows[key]
        assert row["last step"] == pts[-1][0] and row["last"] == pts[-1][1]
        assert row["min"] == min(finite) and row["max"] == max(finite)
        assert row["mean"] == pytest.approx(sum(finite) / len(finite), rel=1e-12)
        assert row["steps"] == len(pts)
        assert row["non-finite"] == sum(not math.isfinite(v) for _, v in pts)
    # sections in numeric layer order, not string order
    order = [r[0]["text"] for r in page.tables["metrics"] if r[0]["text"].startswith("moe/")]
    assert [r[0]["text"] for r in page.tables["metrics"] if r[0]["head"]] == ["key"] * 3
    assert order == [f"moe/layer_{i}/cv" for i in range(LAYERS)]


def test_charts_one_per_family_with_spike_and_nonfinite_marks(run: tuple[Path, dict]) -> None:
    run_dir, _ = run
    page = Page(render_report(run_dir, max_points=200))
    metric_charts = {k for k in page.charts if not k.startswith(("grad/", "param/"))}
    assert metric_charts == {"train/loss", "time/remaining_hours", "moe/layer_*/cv"}
    assert family_of("moe/layer_11/cv") == "moe/layer_*/cv"
    family = page.charts["moe/layer_*/cv"]["lines"]  # 12 keys: their min, median, max
    assert list(family) == [f"{w} of {LAYERS}" for w in ("min", "median", "max")]
    assert all(len(pts) <= 200 for pts in family.values())

    (loss,) = page.charts["train/loss"]["lines"].values()
    assert len(loss) <= 200
    # the spike is the highest point, drawn at its own step (plot: x 62..372 over steps 0..999)
    top = min(loss, key=lambda p: p[1])
    assert top[0] == pytest.approx(62 + 310 * SPIKE_STEP / (STEPS - 1), abs=0.06)
    assert sorted(p[1] for p in loss)[1] > top[1] + 50  # nothing else near it
    assert page.charts["train/loss"]["nonfinite"] == 1
    assert page.charts["time/remaining_hours"]["nonfinite"] == 1
    assert page.charts["moe/layer_*/cv"]["nonfinite"] is None


def test_a_large_family_is_drawn_as_its_min_median_max(run: tuple[Path, dict]) -> None:
    run_dir, _ = run
    page = Page(render_report(run_dir, max_points=2 * STEPS))  # no thinning: a point per step
    lines = page.charts["moe/layer_*/cv"]["lines"]
    keys = [f"moe/layer_{i}/cv" for i in range(LAYERS)]
    want = {
        "min": [min(metric_value(k, s) for k in keys) for s in range(STEPS)],
        "median": [statistics.median(metric_value(k, s) for k in keys) for s in range(STEPS)],
        "max": [max(metric_value(k, s) for k in keys) for s in range(STEPS)],
    }
    y0, y1 = min(want["min"]), max(want["max"])
    for what, values in want.items():
        pts = lines[f"{what} of {LAYERS}"]
        assert [x for x, _ in pts] == pytest.approx(
            [62 + 310 * s / (STEPS - 1) for s in range(STEPS)], abs=0.06
        )
        # back from pixels (plot: y 8..120 for y1..y0), to within the 0.1 px rounding
        got = [y1 - (py - 8) * (y1 - y0) / 112 for _, py in pts]
        assert got == pytest.approx(values, abs=0.06 * (y1 - y0) / 112)


def test_attention_lists_every_nonfinite_metric_and_tensor(run: tuple[Path, dict]) -> None:
    run_dir, _ = run
    att = Page(render_report(run_dir)).rows("attention")
    assert att == {
        "metric: train/loss": {
            "first step": NAN_STEP,
            "steps": 1,
            "most non-finite elements": None,
        },
        "metric: time/remaining_hours": {
            "first step": INF_STEP,
            "steps": 1,
            "most non-finite elements": None,
        },
        f"tensor (grad): {NAN_TENSOR}": {
            "first step": 20,
            "steps": 1,
            "most non-finite elements": 3,
        },
    }


def test_tensor_tables_equal_float64_on_pooled_data(run: tuple[Path, dict]) -> None:
    run_dir, data = run
    page = Page(render_report(run_dir))
    last = data[30]
    layers = page.rows("tensors-layers grad")
    stats = ["mean", "std", "rms", "skewness", "kurtosis", "min", "max"]
    pooled = torch.cat([t.reshape(-1) for t in last.values()])
    check_row(layers["all"], pooled, stats)
    assert layers["all"]["tensors"] == len(last) and layers["all"]["count"] == pooled.numel()
    for i in range(LAYERS):
        names = [n for n in last if n.startswith(f"model.layers.{i}.")]
        check_row(layers[str(i)], torch.cat([last[n].reshape(-1) for n in names]), stats)
        assert layers[str(i)]["tensors"] == 3
    each = page.rows("tensors-each grad")
    assert set(each) == set(last)
    for name, t in last.items():
        check_row(each[name], t.reshape(-1), stats)
    # the merged charts have a point per logged step; step 20's NaN tensor is excluded from its
    # moments and counted
    chart = page.charts["grad/all/nonfinite"]
    (line,) = chart["lines"].values()
    assert len(line) == 4
    assert set(page.charts) >= {"grad/all/rms", "grad/all/kurtosis", "grad/layer_*/kurtosis"}
    # (more layers than MAX_LINES: a band of min, median and max over the layers, as the
    # metric families get; tests/report/test_report_scale21.py checks the band's numbers)
    assert LAYERS > MAX_LINES
    assert list(page.charts["grad/layer_*/rms"]["lines"]) == [
        f"{w} of {LAYERS}" for w in ("min", "median", "max")
    ]


def test_report_is_self_contained(run: tuple[Path, dict]) -> None:
    run_dir, _ = run
    text = render_report(run_dir)
    page = Page(text)
    assert page.external == []
    assert page.links and all(h.startswith("#") for h in page.links)
    assert "http://" not in text and "https://" not in text


def test_keys_and_steps_select(run: tuple[Path, dict]) -> None:
    run_dir, _ = run
    page = Page(render_report(run_dir, keys=["moe/*", "train/*"], steps="100:199"))
    rows = page.rows("metrics")
    assert set(rows) == {"train/loss"} | {f"moe/layer_{i}/cv" for i in range(LAYERS)}
    assert all(r["steps"] == 100 for r in rows.values())
    assert rows["train/loss"]["last step"] == 199
    assert "tensors-layers grad" not in page.tables  # no tensor step in 100..199
    with pytest.raises(ValueError, match="steps"):
        render_report(run_dir, steps="9:1")
    with pytest.raises(TypeError, match="keys"):
        render_report(run_dir, keys=[3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_points"):
        render_report(run_dir, max_points=1)
    with pytest.warns(RuntimeWarning, match=r"no metric within keys \['nomatch/\*'\]"):
        page = Page(render_report(run_dir, keys="nomatch/*"))
    assert "metrics" not in page.tables
    with pytest.warns(RuntimeWarning, match="no metric within steps 5000:"):
        render_report(run_dir, steps="5000:")


def test_missing_files_and_truncated_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="holds no metrics"):
        render_report(tmp_path)
    with pytest.raises(FileNotFoundError, match="no run folder"):
        render_report(tmp_path / "nope")
    write_run(tmp_path, [0, 1])  # tensor statistics only: still a report
    assert "metrics" not in Page(render_report(tmp_path)).tables
    with FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")]) as writer:
        writer.add_scalars({"train/loss": 1.0}, 0)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "time": 0, "metrics": {"train/lo')
    with pytest.warns(RuntimeWarning, match="truncated"):
        page = Page(render_report(tmp_path))
    assert page.rows("metrics")["train/loss"]["steps"] == 1


def test_cli_writes_the_report(
    run: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = run
    out = tmp_path / "sub" / "r.html"
    done = subprocess.run(
        [sys.executable, "-m", "trainvitals", "report", str(run_dir), "-o", str(out),
         "--keys", "train/*", "--max-points", "50"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    page = Page(out.read_text())
    assert set(page.rows("metrics")) == {"train/loss"}
    assert all(len(p) <= 50 for p in page.charts["train/loss"]["lines"].values())
    # the error in-process: the subprocess above proved the entry point exits with main's status
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "error: no run folder" in capsys.readouterr().err
    default = write_report(run_dir)
    assert default == run_dir / "report.html" and default.read_text().startswith("<!doctype html>")
    assert not list(run_dir.glob(".*.tmp"))


@pytest.mark.parametrize("fmt", ["tensorboard", "csv"])
def test_metrics_from_tensorboard_or_lightning_csv(tmp_path: Path, fmt: str) -> None:
    """A Lightning or Accelerate run with no JSONL: the scalars come from the TensorBoard
    event files (float32) or the CSVLogger file found under the run folder."""
    steps = range(0, 300, 3)
    keys = ["train/loss", "moe/layer_2/cv", "moe/layer_10/cv"]
    values = {k: {s: metric_value(k, s) for s in steps} for k in keys}
    values["train/loss"][150] = math.nan
    logs = tmp_path / "lightning_logs" / "version_0"
    if fmt == "tensorboard":
        with FanoutWriter([TensorBoardSink(logs)]) as writer:
            for s in steps:
                writer.add_scalars({k: values[k][s] for k in keys}, s)
        want = {k: {s: float(np.float32(v)) for s, v in pts.items()} for k, pts in values.items()}
    else:
        logs.mkdir(parents=True)
        with open(logs / "metrics.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["epoch", "step", *keys])
            for s in steps:  # Lightning leaves a cell empty where a key was not logged
                w.writerow(
                    [0, s, *(repr(values[k][s]) if s % 2 or k == keys[0] else "" for k in keys)]
                )
        want = {
            k: {s: v for s, v in pts.items() if s % 2 or k == keys[0]} for k, pts in values.items()
        }
    write_run(logs, [0, 3])  # tensor_stats.jsonl lands in the logger's folder
    page = Page(render_report(logs))
    rows = page.rows("metrics")
    assert set(rows) == set(keys)
    for key, pts in want.items():
        finite = [v for v in pts.values() if math.isfinite(v)]
        assert rows[key]["last"] == pts[max(pts)] and rows[key]["steps"] == len(pts)
        assert rows[key]["min"] == min(finite) and rows[key]["max"] == max(finite)
        assert rows[key]["non-finite"] == sum(not math.isfinite(v) for v in pts.values())
    assert list(page.charts["moe/layer_*/cv"]["lines"]) == ["2", "10"]
    assert "tensors-layers grad" in page.tables
    # found from the run's root as well (both files), and named explicitly
    root = Page(render_report(tmp_path))
    assert set(root.rows("metrics")) == set(keys) and "tensors-layers grad" in root.tables
    source = logs if fmt == "tensorboard" else logs / "metrics.csv"
    assert set(Page(render_report(tmp_path, metrics=source)).rows("metrics")) == set(keys)


def test_edge_cases_single_step_constant_all_nan_and_markup_in_keys(tmp_path: Path) -> None:
    odd = 'odd/<b>"&</b>'
    with FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")]) as writer:
        writer.add_scalars({"a/flat": 2.5, "a/nan": math.nan, odd: 1.0}, 7)
    text = render_report(tmp_path)
    assert "<b>" not in text  # names are escaped, never markup
    page = Page(text)
    rows = page.rows("metrics")
    assert rows[odd]["last"] == 1.0
    assert math.isnan(rows["a/nan"]["min"]) and rows["a/nan"]["non-finite"] == 1
    assert rows["a/flat"] == {
        "last": 2.5, "last step": 7, "min": 2.5, "max": 2.5, "mean": 2.5,
        "steps": 1, "non-finite": 0,
    }  # fmt: skip
    # one step: a point in the middle of the plot; an all-NaN key: no line, one red tick
    assert page.charts["a/flat"]["circles"]["a/flat"] == (62 + 310 / 2, pytest.approx(64.0))
    assert page.charts["a/nan"]["lines"] == {} and page.charts["a/nan"]["nonfinite"] == 1
    assert "no finite value" in text


def test_expert_load_heatmaps_equal_the_logged_tokens(tmp_path: Path) -> None:
    """LoadBalanceMonitor's detailed keys become two heatmaps: the last step and all steps."""
    layers, experts, steps = 3, 4, [0, 2, 4]

    def tokens(layer: int, e: int, step: int) -> float:
        if (layer, e, step) == (1, 3, 4):
            return 0.0  # dead at the last step
        return 100.0 + 10 * e + step + (300.0 if (layer, e) == (2, 0) else 0.0)

    with FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")]) as writer:
        for step in steps:
            writer.add_scalars(
                {
                    f"moe/layer_{layer}/tokens_per_expert/{e}": tokens(layer, e, step)
                    for layer in range(layers)
                    for e in range(experts)
                },
                step,
            )
    page = Page(render_report(tmp_path))
    for key, pick in (
        ("expert-load/step-4", lambda layer, e: tokens(layer, e, 4)),
        ("expert-load/all", lambda layer, e: sum(tokens(layer, e, s) for s in steps)),
    ):
        cells = page.charts[key]["cells"]
        assert set(cells) == {(str(i), e) for i in range(layers) for e in range(experts)}
        for layer in range(layers):
            mean = sum(pick(layer, e) for e in range(experts)) / experts
            for e in range(experts):
                a = cells[(str(layer), e)]
                assert float(a["data-tokens"]) == pick(layer, e)
                assert float(a["data-util"]) == pytest.approx(pick(layer, e) / mean, rel=1e-12)
    last = page.charts["expert-load/step-4"]["cells"]
    assert last[("1", 3)]["fill"] == "#000000"  # dead: black
    assert float(last[("2", 0)]["data-util"]) > 2  # overloaded: blue side of the scale
    red, _, blue = (int(last[("2", 0)]["fill"][i : i + 2], 16) for i in (1, 3, 5))
    assert blue > red
    assert "expert-load/step-4" not in Page(render_report(tmp_path, keys=["train/*"])).charts


def test_tensor_file_read_in_chunks_equals_the_query_and_later_lines_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report reduces tensor_stats.jsonl a few records at a time (bounded memory): with
    chunks of 3 records, a resumed run's repeated steps (appended later, other values) and a
    NaN tensor, every per-step number equals what query() computes over the whole file, and
    the page is the one a single chunk gives."""
    import trainvitals.report.html as report_html

    def with_nans(step: int) -> dict[str, torch.Tensor]:  # NaN/inf at steps 5 and 8
        tensors = make_tensors(step)
        if step in (5, 8):
            tensors[NAN_TENSOR] = tensors[NAN_TENSOR].clone()
            tensors[NAN_TENSOR][0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
        return tensors

    first = write_run(tmp_path, list(range(10)), with_nans)
    resumed = {s: make_tensors(100 + s) for s in (4, 5, 6, 9)}  # resumed from step 4 (and 9)
    lines = (tmp_path / "tensor_stats.jsonl").read_text()
    write_run(tmp_path, list(resumed), lambda s: resumed[s])
    (tmp_path / "tensor_stats.jsonl").write_text(
        lines + (tmp_path / "tensor_stats.jsonl").read_text()
    )
    kinds = {k: report_html._KindStats(k) for k in report_html.KINDS}
    query_module = importlib.import_module("trainvitals.report.query")
    monkeypatch.setattr(query_module, "CHUNK_RECORDS", 3)
    for rec in report_html.read_tensor_stats(tmp_path):
        kinds[rec["kind"]].add(int(rec["step"]), rec)
        assert len(kinds[rec["kind"]].chunks._pending) < 3  # records held: fewer than a chunk
    grad = kinds["grad"]
    grad.flush()
    assert grad.steps == set(first) and grad.last_step == 9

    merged = query(tmp_path, kind="grad", stat="all")
    assert [r["step"] for r in merged] == sorted(grad.merged) == list(range(10))
    for row in merged:
        got = grad.merged[row["step"]]
        for stat in ("rms", "kurtosis", "skewness", "nonfinite"):
            assert got[stat] == pytest.approx(row[stat], rel=1e-12), (row["step"], stat)
        assert got["abs_max"] == max(abs(row["min"]), abs(row["max"]))
    # the resumed steps carry the later values: step 5's rms is that of the resumed tensors
    pooled = torch.cat([t.reshape(-1).double() for t in resumed[5].values()])
    assert grad.merged[5]["rms"] == pytest.approx(pooled.square().mean().sqrt().item(), rel=1e-9)
    per_layer = query(tmp_path, kind="grad", stat=["rms", "kurtosis"], by=r"layers\.(\d+)\.")
    assert sum(len(v) for v in grad.layers.values()) == len(per_layer)
    for row in per_layer:
        got = grad.layers[row["step"]][row["group"]]
        assert got["rms"] == pytest.approx(row["rms"], rel=1e-12)
        assert got["kurtosis"] == pytest.approx(row["kurtosis"], rel=1e-12)
    # step 5's NaN/inf went with its first line; step 8's stays
    assert grad.nonfinite == {8: {NAN_TENSOR: 3.0}}
    assert merged[8]["nonfinite"] == 3 and merged[5]["nonfinite"] == 0

    made = re.compile(r"Made [^<]*\.")
    small = made.sub("", render_report(tmp_path))
    each = Page(small).rows("tensors-each grad")  # the last step's tables: its later line
    for row in query(tmp_path, kind="grad", stat="rms", steps=9, per_tensor=True):
        assert each[row["group"]]["rms"] == pytest.approx(row["rms"], rel=1e-12)
    assert each[NAN_TENSOR]["rms"] == pytest.approx(
        resumed[9][NAN_TENSOR].double().square().mean().sqrt().item(), rel=1e-9
    )
    monkeypatch.setattr(query_module, "CHUNK_RECORDS", 10_000)
    assert small == made.sub("", render_report(tmp_path))


def test_expert_utilization_is_over_the_layers_own_experts(tmp_path: Path) -> None:
    """Layers with different expert counts: each layer's utilization is its expert's tokens
    over that layer's mean tokens per expert (LoadBalanceMonitor's definition), not over the
    mean across the union of every layer's expert columns."""
    counts = {0: 8, 1: 4}  # layer -> experts

    def tokens(layer: int, e: int) -> float:
        return 10.0 * (layer + 1) + 3.0 * e

    with FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")]) as writer:
        for step in range(3):
            writer.add_scalars(
                {
                    f"moe/layer_{layer}/tokens_per_expert/{e}": tokens(layer, e)
                    for layer, n in counts.items()
                    for e in range(n)
                },
                step,
            )
    page = Page(render_report(tmp_path))
    for key in ("expert-load/step-2", "expert-load/all"):
        cells = page.charts[key]["cells"]
        for layer, n in counts.items():
            mean = math.fsum(tokens(layer, e) for e in range(n)) / n
            for e in range(n):
                util = float(cells[(str(layer), e)]["data-util"])
                assert util == pytest.approx(tokens(layer, e) / mean, rel=1e-12), (key, layer, e)
        assert cells[("1", 7)]["data-tokens"] == "nan"  # not an expert of layer 1: grey
        assert cells[("1", 7)]["fill"] == "#cccccc"


def test_activation_sites_are_grouped_by_their_layer(tmp_path: Path) -> None:
    """Sites of numbered modules (`0/input0` in an nn.Sequential, `layers.3/output0` in a
    ModuleList of Linear layers) belong to that layer in the per-layer table, as the
    parameters `0.weight`, `layers.3.weight` do."""

    def sites(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return {
            "0/input0": torch.randn(16, 4, generator=g),
            "0/output0": 3 + torch.randn(16, 8, generator=g) ** 3,
            "2/input0": torch.randn(16, 8, generator=g).relu(),
            "2/output0": torch.randn(16, 2, generator=g),
            "layers.3/output0": 0.1 * torch.randn(16, 5, generator=g),
            "head/output0": torch.randn(16, 3, generator=g),  # no layer
        }

    data = write_run(tmp_path, [0, 1], sites)
    path = tmp_path / "tensor_stats.jsonl"
    path.write_text(path.read_text().replace('"kind": "grad"', '"kind": "activation"'))
    rows = Page(render_report(tmp_path)).rows("tensors-layers activation")
    assert list(rows) == ["all", "0", "2", "3"]
    for layer, names in {"0": ["0/input0", "0/output0"], "2": ["2/input0", "2/output0"]}.items():
        pooled = torch.cat([data[1][n].reshape(-1) for n in names])
        assert rows[layer]["tensors"] == len(names)
        check_row(
            {k: rows[layer][k] for k in ("mean", "std", "rms", "skewness", "kurtosis")},
            pooled,
            ["mean", "std", "rms", "skewness", "kurtosis"],
        )


def test_the_pages_step_span_is_that_of_the_steps_shown(tmp_path: Path) -> None:
    """The header's "steps A to B" is the span of what the page shows: with --steps, the
    tensor records kept (not the whole file's span, as before when the run had no metrics),
    and with metrics too, the span of both together."""
    write_run(tmp_path, [0, 100, 150, 200, 900])
    span = re.compile(r'<p class="meta">steps (\d+) to (\d+)[;,]')
    assert span.search(render_report(tmp_path)).groups() == ("0", "900")
    assert span.search(render_report(tmp_path, steps="100:200")).groups() == ("100", "200")
    assert span.search(render_report(tmp_path, steps="120:")).groups() == ("150", "900")
    with FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")]) as writer:
        for step in (120, 130):
            writer.add_scalars({"train/loss": 1.0}, step)
    assert span.search(render_report(tmp_path, steps="100:200")).groups() == ("100", "200")
    assert span.search(render_report(tmp_path, steps="125:140")).groups() == ("130", "130")


def test_the_wall_time_in_the_header_is_that_of_the_steps_shown(tmp_path: Path) -> None:
    """With --steps, "of wall time" spans the metric lines of those steps, not the whole
    file (before: the run's whole wall time beside the span of the steps asked for)."""
    times = {0: 1000.0, 100: 2000.0, 200: 6000.0, 300: 20000.0}  # Unix seconds
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, t in times.items():
            f.write(json.dumps({"step": step, "time": t, "metrics": {"train/loss": 1.0}}) + "\n")
    wall = re.compile(r"steps (\d+) to (\d+), ([0-9:]+) of wall time;")

    def header(**options: object) -> tuple[str, ...]:
        match = wall.search(render_report(tmp_path, **options))
        assert match is not None
        return match.groups()

    assert header() == ("0", "300", "5:16:40")  # 19,000 s
    assert header(steps="100:200") == ("100", "200", "1:06:40")  # 4,000 s
    assert header(steps=":100") == ("0", "100", "0:16:40")  # 1,000 s


def _lightning_version(logs: Path, version: int, steps: list[int], tensor_stats: bool) -> Path:
    """``logs/version_<version>`` as a Lightning TensorBoardLogger run leaves it: event files of
    ``train/loss`` at ``steps`` and, with ``tensor_stats``, the monitor's file of those steps."""
    folder = logs / f"version_{version}"
    with FanoutWriter([TensorBoardSink(folder)]) as writer:
        for s in steps:
            writer.add_scalars({"train/loss": float(version)}, s)
    if tensor_stats:
        write_run(folder, steps)
    return folder


def _read_from(text: str) -> tuple[str, str]:
    """(the span, the sources) the report's header line names."""
    m = re.search(r'<p class="meta">(steps \d+ to \d+)[^;]*; .*?Read from (.*?)\. Made', text)
    assert m is not None, text[:2000]
    return m.group(1), m.group(2)


def test_a_folder_of_several_runs_names_them_instead_of_reporting_the_oldest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # lightning_logs/ after a second fit: version_0 (steps 0-3) and version_1 (steps 6-9)
    logs = tmp_path / "lightning_logs"
    old = _lightning_version(logs, 0, [0, 3], tensor_stats=True)
    new = _lightning_version(logs, 1, [6, 9], tensor_stats=True)
    with pytest.raises(FileNotFoundError, match="2 run folders below") as err:
        render_report(logs)
    assert str(old) in str(err.value) and str(new) in str(err.value)
    # the CLI, in-process (test_cli_writes_the_report runs the real entry point)
    status = main(["report", str(logs)])
    err = capsys.readouterr().err
    assert status == 2 and str(new) in err, err
    assert not (logs / "report.html").exists()
    # the run folder named: that run's files only
    span, sources = _read_from(render_report(new))
    assert span == "steps 6 to 9" and str(new / "tensor_stats.jsonl") in sources
    assert str(old) not in sources
    # metrics= naming one run's files: the tensor statistics of that same run
    span, sources = _read_from(render_report(logs, metrics=new))
    assert span == "steps 6 to 9" and str(new / "tensor_stats.jsonl") in sources


def test_metrics_and_tensor_stats_of_different_runs_are_not_mixed(tmp_path: Path) -> None:
    # version_0 ran without TensorStatsMonitor, version_1 with it: the metrics found first
    # (version_0's) and the only tensor statistics (version_1's) are of different runs
    logs = tmp_path / "lightning_logs"
    old = _lightning_version(logs, 0, [0, 3], tensor_stats=False)
    new = _lightning_version(logs, 1, [6, 9], tensor_stats=True)
    with pytest.raises(FileNotFoundError, match="different run folders") as err:
        render_report(logs)
    assert str(old) in str(err.value) and str(new) in str(err.value)
    span, sources = _read_from(render_report(new))
    assert span == "steps 6 to 9" and str(old) not in sources


def test_a_negative_token_count_is_a_grey_cell_not_a_crash(tmp_path: Path) -> None:
    """A negative value under a tokens-per-expert key (a -1 "not measured" sentinel, another
    metric of that name) gave a negative utilization whose log2 raised ValueError: math domain
    error, and no report at all. It is drawn grey (not a count); the other cells keep their
    numbers."""
    logged = {0: 30.0, 1: 50.0, 2: -1.0}
    with FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")]) as writer:
        writer.add_scalars({f"moe/layer_0/tokens_per_expert/{e}": v for e, v in logged.items()}, 3)
    cells = Page(render_report(tmp_path)).charts["expert-load/step-3"]["cells"]
    mean = sum(logged.values()) / 3
    assert cells[("0", 2)]["fill"] == "#cccccc"
    for e in (0, 1):
        assert float(cells[("0", e)]["data-util"]) == pytest.approx(logged[e] / mean, rel=1e-12)
        assert cells[("0", e)]["fill"] not in ("#cccccc", "#000000")
