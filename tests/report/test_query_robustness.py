"""tensor_stats.jsonl readers and writer against files they did not expect: a file of a newer
format, a corrupted moment vector, two monitors given one file."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor
from trainvitals.cli import main
from trainvitals.report import query, read_tensor_stats
from trainvitals.report.query import SUPPORTED_VERSIONS

FIELDS = ["count", "mean", "m2", "m3", "m4", "min", "max", "nonfinite"]
NEWER = max(SUPPORTED_VERSIONS) + 1


def moments(x: torch.Tensor) -> list[float | int]:
    """The file's vector of ``x``, computed here in float64 from its definition."""
    x = x.double().reshape(-1)
    d = x - x.mean()
    return [
        x.numel(),
        float(x.mean()),
        float((d**2).sum()),
        float((d**3).sum()),
        float((d**4).sum()),
        float(x.min()),
        float(x.max()),
        0,
    ]


def tensors_at(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"a.weight": torch.randn(50, generator=g) ** 3, "b.weight": torch.rand(30, generator=g)}


def line(step: int, version: int = 1, tensors: dict[str, list] | None = None) -> str:
    if tensors is None:
        tensors = {n: moments(t) for n, t in tensors_at(step).items()}
    rec = {"version": version, "step": step, "kind": "grad", "time": 0.0, "fields": FIELDS}
    return json.dumps({**rec, "tensors": tensors})


def pooled_kurtosis(step: int) -> tuple[float, float]:
    """(mean, Pearson kurtosis) of all tensors of ``step`` pooled, straight from the elements."""
    x = torch.cat([t.double().reshape(-1) for t in tensors_at(step).values()])
    d = x - x.mean()
    return float(x.mean()), float(x.numel() * (d**4).sum() / (d**2).sum() ** 2)


def check_rows(rows: list[dict], steps: list[int]) -> None:
    assert [r["step"] for r in rows] == steps
    for r in rows:
        mean, kurt = pooled_kurtosis(r["step"])
        assert r["tensors"] == 2
        assert r["mean"] == pytest.approx(mean, rel=1e-9, abs=1e-12)
        assert r["kurtosis"] == pytest.approx(kurt, rel=1e-9)


# ------------------------------------------------------------------------- newer format


def test_a_file_of_a_newer_format_says_upgrade(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tensor_stats.jsonl").write_text(
        "".join(line(s, version=NEWER) + "\n" for s in range(3))
    )
    want = (
        f"written by a newer trainvitals (schema version {NEWER}; this one reads up to "
        f"version {max(SUPPORTED_VERSIONS)}): upgrade trainvitals"
    )
    with pytest.warns(RuntimeWarning, match="newer trainvitals"), pytest.raises(ValueError) as e:
        list(read_tensor_stats(tmp_path))
    assert want in str(e.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["query", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert want in err and "holds no tensor-statistics record" not in err, err
        # the report: an error too, not a page without the tensor statistics and exit 0
        out = tmp_path / "report.html"
        assert main(["report", str(tmp_path), "-o", str(out)]) == 2
        assert want in capsys.readouterr().err
        assert not out.exists()


def test_a_file_with_some_lines_of_a_newer_format_still_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [line(0), line(1, version=NEWER), line(2)]
    (tmp_path / "tensor_stats.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.warns(RuntimeWarning) as caught:
        rows = query(tmp_path, stat=["mean", "kurtosis"])
    check_rows(rows, [0, 2])
    assert [str(w.message).split(": ", 1)[1] for w in caught] == [
        f"line 2 has schema version {NEWER} (written by a newer trainvitals); this reader "
        f"supports {SUPPORTED_VERSIONS}"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 0
    capsys.readouterr()


def test_lines_of_no_known_version_are_still_a_wrong_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a version that is not a newer integer (older, missing, a string): not "upgrade"
    lines = [line(0, version=0), line(1).replace('"version": 1', '"version": "2"')]
    (tmp_path / "tensor_stats.jsonl").write_text("\n".join(lines) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert list(read_tensor_stats(tmp_path)) == []
        assert main(["query", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no tensor-statistics record" in err and "newer" not in err, err


# ------------------------------------------------------------------------- corrupted vectors


@pytest.mark.parametrize(
    "bad",
    [
        '"x"',  # a hand-edited value
        "true",  # JSON true is not a number (Python would read it as 1)
        "[1.0]",  # a nested list
        '{"v": 1}',
    ],
)
def test_a_moment_vector_with_a_non_number_skips_that_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    good = moments(tensors_at(1)["a.weight"])
    broken = {"a.weight": good, "b.weight": moments(tensors_at(1)["b.weight"])}
    text = line(1, tensors=broken)
    # the mean of b.weight replaced by the bad element, the rest of the line intact
    mean_b = json.dumps(broken["b.weight"][1])
    assert text.count(mean_b) == 1
    text = text.replace(mean_b, bad)
    (tmp_path / "tensor_stats.jsonl").write_text("\n".join([line(0), text, line(2)]) + "\n")
    with pytest.warns(RuntimeWarning) as caught:
        rows = query(tmp_path, stat=["mean", "kurtosis"])
    check_rows(rows, [0, 2])
    assert [str(w.message).split(": ", 1)[1] for w in caught] == [
        "line 2 has a moment vector element that is not a number or null"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["query", str(tmp_path), "--stat", "kurtosis"]) == 0
        assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 0
    assert "error" not in capsys.readouterr().err


def test_null_elements_are_still_read(tmp_path: Path) -> None:
    # null is the file's non-finite value (min/max of no finite element): not skipped
    empty = [0, 0.0, 0.0, 0.0, 0.0, None, None, 0]
    tensors = {**{n: moments(t) for n, t in tensors_at(0).items()}, "c.weight": empty}
    (tmp_path / "tensor_stats.jsonl").write_text(line(0, tensors=tensors) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = query(tmp_path, stat=["count", "min"], per_tensor=True)
    assert [(r["group"], r["count"]) for r in rows] == [
        ("a.weight", 50),
        ("b.weight", 30),
        ("c.weight", 0),
    ]
    assert rows[2]["min"] is None
    assert rows[0]["min"] == pytest.approx(float(tensors_at(0)["a.weight"].min()))


def test_fields_holding_a_non_string_skip_that_line(tmp_path: Path) -> None:
    bad = json.loads(line(1))
    bad["fields"] = [*FIELDS[:-1], ["nonfinite"]]  # a list in a set(): a TypeError before
    text = "\n".join([line(0), json.dumps(bad), line(2)]) + "\n"
    (tmp_path / "tensor_stats.jsonl").write_text(text)
    with pytest.warns(RuntimeWarning, match="line 2 has a moment vector that does not match"):
        rows = query(tmp_path, stat=["mean", "kurtosis"])
    check_rows(rows, [0, 2])


# ------------------------------------------------------------------------- two monitors


def _run(run_dir: Path, monitors: list[TensorStatsMonitor], steps: int = 2) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, m in enumerate(monitors):
        m.state_key = f"tensor_stats_{i}"  # (the driver refuses two equal state keys)
    with Vitals(monitors, run_dir=run_dir, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        for _ in range(steps):
            x = torch.randn(3, 4)
            vitals.batch(x)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()


def _steps(path: Path) -> list[tuple[int, str]]:
    return [(r["step"], r["kind"]) for r in map(json.loads, path.read_text().splitlines())]


def test_two_monitors_with_one_file_is_an_error_at_run_start(tmp_path: Path) -> None:
    first = TensorStatsMonitor(kinds=["grad"], kernel="eager")
    second = TensorStatsMonitor(kinds=["param"], kernel="eager")
    path = tmp_path / "tensor_stats.jsonl"
    with pytest.raises(ValueError, match="already written by another TensorStatsMonitor") as e:
        _run(tmp_path, [first, second])
    assert str(path) in str(e.value) and "filename=" in str(e.value)
    assert not path.exists() or path.read_text() == ""  # no step written twice
    # the failed run released the first monitor's claim: a new run of the two, with
    # distinct files, works, one line per step and kind in each
    second = TensorStatsMonitor(kinds=["param"], kernel="eager", filename="params.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (first: "this instance already ran")
        _run(tmp_path, [first, second])
    assert _steps(path) == [(0, "grad"), (1, "grad")]
    assert _steps(tmp_path / "params.jsonl") == [(0, "param"), (1, "param")]


def test_a_later_run_in_the_same_folder_may_use_the_file(tmp_path: Path) -> None:
    # the first run ended: its monitor (still referenced here) no longer holds the file
    first = TensorStatsMonitor(kinds=["grad"], kernel="eager")
    _run(tmp_path, [first])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("held an earlier run; moved it to ...")
        _run(tmp_path, [TensorStatsMonitor(kinds=["grad"], kernel="eager")])
        _run(tmp_path, [first])  # and the same instance again (it warns: reused)
    assert _steps(tmp_path / "tensor_stats.jsonl") == [(0, "grad"), (1, "grad")]
    assert _steps(tmp_path / "tensor_stats.jsonl.1") == [(0, "grad"), (1, "grad")]
    assert _steps(tmp_path / "tensor_stats.jsonl.2") == [(0, "grad"), (1, "grad")]


def test_a_run_that_never_ended_does_not_block_the_next_one(tmp_path: Path) -> None:
    # A notebook cell that raised before close(): its monitor (still referenced, its run never
    # ended) holds the file; the next run's monitor of another run takes it over.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    abandoned = TensorStatsMonitor(kinds=["grad"], kernel="eager")
    vitals = Vitals([abandoned], run_dir=tmp_path, log_every_n_steps=1)
    vitals.attach(model, opt)
    x = torch.randn(3, 4)
    vitals.batch(x)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    assert abandoned._claimed is not None  # never closed: still claimed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("held an earlier run; moved it to ...")
        _run(tmp_path, [TensorStatsMonitor(kinds=["grad"], kernel="eager")])
    assert _steps(tmp_path / "tensor_stats.jsonl") == [(0, "grad"), (1, "grad")]
    del vitals
