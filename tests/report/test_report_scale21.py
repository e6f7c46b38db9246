"""Session 21: the report at the scale of a large model. Per-layer tensor charts of more than
``MAX_LINES`` layers are banded (min / median / max across layers per step) as the metric
families are; each step's per-layer results are kept in arrays, with the numbers of the raw
tensors in float64; contrived files (a step of 2**63, JSON nested past the recursion limit, a
CSV step of ``inf``) give one error line and exit 2, or are skipped, not a traceback."""

from __future__ import annotations

import importlib
import json
import math
import statistics
from array import array
from pathlib import Path

import numpy as np
import pytest
import torch

from trainvitals.cli import main
from trainvitals.report import query
from trainvitals.stats.moments import FIELDS, fused_moments, moments_to_rows

html_module = importlib.import_module("trainvitals.report.html")

LAYERS = 40
STEPS = (0, 1, 2)
NAMES = [f"model.layers.{i}.mlp.weight" for i in range(LAYERS)]


def tensors_at(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(step)
    return [rng.normal(0.1 * k, 1 + k / 7, size=20 + k) for k in range(LAYERS)]


def write_run(run: Path) -> dict[int, list[np.ndarray]]:
    """``grad`` lines of 40 layers (one tensor each) for :data:`STEPS`, as the monitor writes
    them; returns each step's tensors."""
    run.mkdir(parents=True, exist_ok=True)
    shown = {}
    with open(run / "tensor_stats.jsonl", "w") as f:
        for step in STEPS:
            arrays = tensors_at(step)
            rows = moments_to_rows(fused_moments([torch.from_numpy(a) for a in arrays]))
            line = {"version": 1, "step": step, "kind": "grad", "time": 1.0 + step}
            line.update(fields=list(FIELDS), tensors=dict(zip(NAMES, rows, strict=True)))
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
            shown[step] = arrays
    return shown


def by_hand(x: np.ndarray) -> dict[str, float]:
    """rms and kurtosis (population, non-excess) of one tensor's elements, float64."""
    x = x.astype(np.float64)
    d = x - x.mean()
    return {
        "rms": math.sqrt(float(np.mean(x * x))),
        "kurtosis": float(np.mean(d**4)) / float(np.mean(d**2)) ** 2,
    }


def charted(monkeypatch: pytest.MonkeyPatch, run: Path) -> dict[str, list]:
    """The lines handed to each chart of the report of ``run``, by title."""
    seen: dict[str, list] = {}
    chart = html_module._chart

    def spy(title, lines, max_points, *args, **kwargs):
        seen[title] = lines
        return chart(title, lines, max_points, *args, **kwargs)

    monkeypatch.setattr(html_module, "_chart", spy)
    html_module.render_report(run)
    return seen


def test_layer_charts_of_more_layers_than_max_lines_are_banded(tmp_path, monkeypatch):
    shown = write_run(tmp_path / "run")
    monkeypatch.setattr(html_module, "MAX_LINES", LAYERS - 1)
    seen = charted(monkeypatch, tmp_path / "run")
    for stat in ("rms", "kurtosis"):
        lines = seen[f"grad/layer_*/{stat}"]
        assert [label for label, _ in lines] == [
            f"{w} of {LAYERS}" for w in ("min", "median", "max")
        ]
        for pick, (_, pts) in zip((min, statistics.median, max), lines, strict=True):
            assert [s for s, _ in pts] == list(STEPS)
            for step, got in pts:
                want = pick([by_hand(x)[stat] for x in shown[step]])
                assert got == pytest.approx(want, rel=1e-12)
    # the page: three lines in each per-layer chart, not one per layer
    page = html_module.render_report(tmp_path / "run")
    start = page.index('data-key="grad/layer_*/rms"')
    assert page[start : page.index("</svg>", start)].count("<polyline") == 3


def test_layer_charts_up_to_max_lines_keep_a_line_per_layer(tmp_path, monkeypatch):
    shown = write_run(tmp_path / "run")
    monkeypatch.setattr(html_module, "MAX_LINES", LAYERS)
    seen = charted(monkeypatch, tmp_path / "run")
    for stat in ("rms", "kurtosis"):
        lines = seen[f"grad/layer_*/{stat}"]
        assert [label for label, _ in lines] == [f"layer {i}" for i in range(LAYERS)]
        for i, (_, pts) in enumerate(lines):
            assert [s for s, _ in pts] == list(STEPS)
            for step, got in pts:
                assert got == pytest.approx(by_hand(shown[step][i])[stat], rel=1e-12)


def test_per_layer_results_are_arrays_with_the_raw_tensors_numbers(tmp_path):
    shown = write_run(tmp_path / "run")
    ks = html_module._KindStats("grad")
    for rec in html_module.read_tensor_stats(tmp_path / "run"):
        ks.add(rec["step"], rec)
    ks.flush()
    results = ks.chunks.results
    # one float64 array per step, not a dict per layer; one tuple of labels for every step
    assert all(type(results[s].values) is array for s in STEPS)
    assert all(results[s].labels is results[STEPS[0]].labels for s in STEPS)
    series = ks.layer_series()
    assert sorted(series, key=int) == [str(i) for i in range(LAYERS)]
    for i in range(LAYERS):
        steps, (rms, kurt) = series[str(i)]
        assert list(steps) == list(STEPS)
        for j, step in enumerate(STEPS):
            want = by_hand(shown[step][i])
            assert rms[j] == pytest.approx(want["rms"], rel=1e-12)
            assert kurt[j] == pytest.approx(want["kurtosis"], rel=1e-12)
            # the mapping view the tables and callers read gives the same numbers
            assert ks.layers[step][str(i)] == {"rms": rms[j], "kurtosis": kurt[j]}


def test_a_tensor_step_beyond_int64_is_still_reported(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    with open(run / "tensor_stats.jsonl", "a") as f:
        rows = moments_to_rows(fused_moments([torch.ones(3), torch.ones(3)]))
        line = {"version": 1, "step": 2**63, "kind": "grad", "fields": list(FIELDS)}
        line["tensors"] = dict(zip(NAMES[:2], rows, strict=True))
        f.write(json.dumps(line, separators=(",", ":")) + "\n")
    page = html_module.render_report(run)
    assert f"steps 0 to {2**63}" in page


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("metrics.jsonl", '{"step":' + str(2**63) + ',"time":1.0,"metrics":{"a":1.0}}\n', "64-bit"),
        ("metrics.jsonl", '{"step":1,"time":1.0,"metrics":{"a":' + DEEP + "}}\n", "nested"),
        ("metrics.jsonl", '{"step":1,"time":1.0,"metrics":{"a":1.0}}\n' + DEEP + "\n", "nested"),
        ("metrics.csv", "step,a\n1,1.0\n1e30,2.0\n", "64-bit"),
    ],
)
def test_report_of_a_contrived_metrics_file_is_one_error_line(tmp_path, capsys, name, text, says):
    (tmp_path / name).write_text(text)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("trainvitals report: error: ") and says in err[0]
    assert str(tmp_path / name) in err[0]
    assert not (tmp_path / "report.html").exists()


def test_a_csv_step_of_inf_is_skipped(tmp_path, capsys):
    (tmp_path / "metrics.csv").write_text("step,a\n1,1.5\ninf,2.0\n2,2.5\n")
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "steps 1 to 2" in page and 'data-value="2.5"' in page


def test_deeply_nested_tensor_line_is_skipped_not_a_traceback(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run)
    text = (run / "tensor_stats.jsonl").read_text()
    deep = '{"version":1,"step":9,"kind":"grad","tensors":{"a":' + DEEP + "}}\n"
    (run / "tensor_stats.jsonl").write_text(deep + text)
    with pytest.warns(RuntimeWarning, match="unreadable line"):
        rows = query(run, stat="rms", by=r"layers\.(\d+)\.")
    assert [r["step"] for r in rows] == [s for s in STEPS for _ in range(LAYERS)]
    # a file of that line alone: no record, the CLI's one error line (after the warning)
    (run / "tensor_stats.jsonl").write_text(deep)
    with pytest.warns(RuntimeWarning, match="unreadable line"):
        assert main(["query", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("trainvitals query: error: ") and "no tensor-statistics" in err[-1]
