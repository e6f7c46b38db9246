"""Session 21 audit of ``trainvitals query`` / ``report``: a chunk of records held for a merge is
bounded by its tensors too, not only by its number of records (records of many tensors held
the whole file: ~700 MB above the interpreter for the report of a 200 MB file), with the same
numbers as the raw tensors in float64; an empty ``tensor_stats.jsonl`` is said to be empty."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainvitals.cli import main
from trainvitals.report import query, render_report
from trainvitals.stats.moments import FIELDS, fused_moments, moments_to_rows

query_module = importlib.import_module("trainvitals.report.query")
html_module = importlib.import_module("trainvitals.report.html")

NAMES = [f"model.layers.{i}.mlp.w{j}.weight" for i in range(3) for j in range(2)]


def tensors_at(step: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([step, seed])
    return [rng.normal(k, 1 + k, size=30 + 5 * k) for k in range(len(NAMES))]


def write_stats(path: Path, logged: list[tuple[int, int]]) -> dict[int, list[np.ndarray]]:
    """``grad`` lines as ``TensorStatsMonitor`` writes them for the ``(step, seed)`` of
    ``logged`` in file order; returns each step's tensors a reader must show (the later line
    of a repeated step wins)."""
    shown: dict[int, list[np.ndarray]] = {}
    lines = []
    for step, seed in logged:
        arrays = tensors_at(step, seed)
        rows = moments_to_rows(fused_moments([torch.from_numpy(a) for a in arrays]))
        rec: dict[str, Any] = {"version": 1, "step": step, "kind": "grad", "time": 1e9 + step}
        rec.update(fields=list(FIELDS), tensors=dict(zip(NAMES, rows, strict=True)))
        lines.append(json.dumps(rec, separators=(",", ":")))
        shown[step] = arrays
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return shown


def pooled(arrays: list[np.ndarray]) -> dict[str, float]:
    x = np.concatenate(arrays)
    d = x - x.mean()
    m2 = float(np.mean(d**2))
    return {
        "count": float(x.size),
        "mean": float(x.mean()),
        "rms": math.sqrt(float(np.mean(x**2))),
        "kurtosis": float(np.mean(d**4)) / m2**2,
        "min": float(x.min()),
        "max": float(x.max()),
    }


def spy_merges(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[int]:
    """The tensors of the records of each merge ``module`` calls (its ``merge_grouped``)."""
    sizes: list[int] = []
    real = module.merge_grouped

    def merge(latest: dict[int, dict[str, Any]], *args: Any) -> Any:
        sizes.append(sum(len(rec["tensors"]) for rec in latest.values()))
        return real(latest, *args)

    monkeypatch.setattr(module, "merge_grouped", merge)
    return sizes


def test_a_chunk_is_bounded_by_its_tensors_with_the_raw_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 steps of 6 tensors, a resumed run repeating steps 4 and 5: with at most 14 tensors
    held, the query merged all 12 records (72 tensors) at once before; now at most 3 records
    (fewer than 14 + 6 tensors) at a time, a replaced step counted once, and every number is
    the float64 statistic of the tensors of the step's later line."""
    logged = [(s, 0) for s in range(12)]
    logged[6:6] = [(4, 1), (5, 1)]  # resumed at 4, then on
    shown = write_stats(tmp_path / "tensor_stats.jsonl", logged)
    monkeypatch.setattr(query_module, "CHUNK_TENSORS", 14, raising=False)
    sizes = spy_merges(monkeypatch, query_module)
    rows = query(tmp_path, kind="grad", stat=["count", "mean", "rms", "kurtosis", "min", "max"])
    assert sizes and max(sizes) < 14 + len(NAMES)
    assert [r["step"] for r in rows] == list(range(12))
    for row in rows:
        want = pooled(shown[row["step"]])
        assert row["tensors"] == len(NAMES)
        for stat, value in want.items():
            assert row[stat] == pytest.approx(value, rel=1e-12), (row["step"], stat)


def test_the_report_holds_a_chunk_of_few_tensors_with_the_raw_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report's merges (a chunk per kind) are bounded likewise, and its table of the last
    step shows the raw tensors' statistics."""
    shown = write_stats(tmp_path / "tensor_stats.jsonl", [(s, 0) for s in range(10)])
    monkeypatch.setattr(query_module, "CHUNK_TENSORS", 14, raising=False)
    sizes = spy_merges(monkeypatch, html_module)
    text = render_report(tmp_path)
    assert max(sizes) < 14 + len(NAMES) and sum(sizes) == 10 * len(NAMES)
    want = pooled(shown[9])
    row = text.split('<table class="tensors-layers grad">', 1)[1].split("</tr>")[1]
    for stat in ("count", "mean", "rms", "kurtosis", "min", "max"):
        cell = row.split(f'data-col="{stat}" data-value="', 1)[1].split('"', 1)[0]
        assert float(cell) == pytest.approx(want[stat], rel=1e-12), stat


def test_an_empty_file_is_said_to_hold_no_line_yet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that has not logged yet: the message said "is it a tensor_stats.jsonl file?" of
    the very file the monitor writes; now it says the file holds no line yet (exit status 2,
    one line on stderr, for the folder and for the file)."""
    path = tmp_path / "tensor_stats.jsonl"
    path.write_text("\n", encoding="utf-8")
    for given in (tmp_path, path):
        assert main(["query", str(given)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"{path} holds no line yet" in err
        assert "is it a tensor_stats.jsonl file" not in err


def test_a_tensor_named_with_a_superscript_digit_is_queried_and_reported(tmp_path: Path) -> None:
    """A ``ParameterDict`` key ``w1²`` (a digit, then a character ``str.isdigit`` accepts and
    ``int`` refuses): ``query --per-tensor`` and ``report`` failed with "invalid literal for
    int() with base 10: '²'" (exit status 2); now they sort it as ``w`` 1 ``²`` and show its
    gradient's statistics, those of the raw gradients in float64."""
    from trainvitals import TensorStatsMonitor
    from trainvitals.adapters.loop import Vitals

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.ParameterDict(
                {
                    "w1²": torch.nn.Parameter(torch.randn(5)),
                    "w2": torch.nn.Parameter(torch.randn(5)),
                }
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.p["w1²"] * self.p["w2"]).sum()

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: dict[int, dict[str, np.ndarray]] = {}
    with Vitals(
        [TensorStatsMonitor(kinds=["grad"], kernel="eager")], run_dir=tmp_path, log_every_n_steps=1
    ) as vitals:
        vitals.attach(model, opt)
        for step in range(2):
            x = torch.randn(5)
            vitals.batch(x)
            model(x).backward()
            grads[step] = {n: p.grad.double().numpy().copy() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
    out = tmp_path / "rows.json"
    assert main(["query", str(tmp_path), "--per-tensor", "--stat", "mean,max", "--format", "json",
                 "-o", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["step"], r["group"]) for r in rows] == [
        (s, n) for s in (0, 1) for n in ("p.w1²", "p.w2")
    ]
    for r in rows:
        g = grads[r["step"]][r["group"]]
        assert r["mean"] == pytest.approx(float(g.mean()), rel=1e-12)
        assert r["max"] == float(g.max())
    assert "p.w1²" in render_report(tmp_path)


def test_attention_counts_non_finite_tensors_of_lines_without_fields(tmp_path: Path) -> None:
    """A line without ``fields`` (the version-1 order, which the readers default to): the query
    counted its tensor's 3 non-finite elements, and the report's Attention said no tensor was
    ever non-finite; now it lists the tensor with the count of the file."""
    line = {"version": 1, "step": 4, "kind": "grad", "time": 1.0}
    line["tensors"] = {"a.w": [4, 0.5, 1.0, 0.0, 0.5, 0.0, 1.0, 3]}
    (tmp_path / "tensor_stats.jsonl").write_text(json.dumps(line) + "\n", encoding="utf-8")
    assert query(tmp_path, stat="nonfinite") == [
        {"step": 4, "kind": "grad", "group": "*", "tensors": 1, "nonfinite": 3}
    ]
    attention = render_report(tmp_path).split('<section id="attention">', 1)[1]
    attention = attention.split("</section>", 1)[0]
    assert "No metric and no tensor was ever NaN" not in attention
    assert "tensor (grad): a.w" in attention
    assert 'data-col="first step" data-value="4.0"' in attention
    assert 'data-col="most non-finite elements" data-value="3.0"' in attention


def test_a_long_output_name_is_written_and_a_failed_write_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-o`` of a 250-character name (a file system takes 255): the hidden file written first
    was named longer, and the report failed with "File name too long" of that hidden name; now
    it is written. A write that fails (a full disk) names the file asked for, not the hidden
    one beside it."""
    write_stats(tmp_path / "tensor_stats.jsonl", [(0, 0)])
    out = tmp_path / ("r" * 245 + ".html")
    assert main(["report", str(tmp_path), "-o", str(out)]) == 0
    assert "tensor statistics: grad" in out.read_text(encoding="utf-8")
    capsys.readouterr()
    real = Path.write_text

    def full_disk(self: Path, *args: Any, **kwargs: Any) -> int:
        if self.name.startswith("."):
            raise OSError(28, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    asked = tmp_path / "page.html"
    assert main(["report", str(tmp_path), "-o", str(asked)]) == 2
    err = capsys.readouterr().err
    assert err == f"trainvitals report: error: [Errno 28] No space left on device: '{asked}'\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, "tensor_stats.jsonl"])


def test_steps_pairs_take_integers_of_any_type_and_refuse_others(tmp_path: Path) -> None:
    """``steps=(1.5, 2)`` was compared as is (step 2 shown, 1 not) and ``(None, "5")`` failed
    with "'<' not supported"; now both are a ``TypeError`` naming ``steps``, and numpy
    integers are read as ints (the rows of the raw tensors of steps 1 and 2)."""
    shown = write_stats(tmp_path / "tensor_stats.jsonl", [(s, 0) for s in range(4)])
    for bad in ((1.5, 2), (None, "5"), (True, 2)):
        with pytest.raises(TypeError, match=r"steps: a \(first, last\) pair of ints or None"):
            query(tmp_path, steps=bad)
    rows = query(tmp_path, stat=["mean", "kurtosis"], steps=(np.int64(1), np.int32(2)))
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        want = pooled(shown[row["step"]])
        assert row["mean"] == pytest.approx(want["mean"], rel=1e-12)
        assert row["kurtosis"] == pytest.approx(want["kurtosis"], rel=1e-12)
