"""``trainvitals query`` of a folder whose only ``tensor_stats.jsonl`` lies in a subfolder (a
Lightning logger's ``<name>/version_0/``) reads that file, as ``trainvitals report`` of the same
folder does; before, the query refused with "1 found in or below ...: give one of them"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.report.test_report_audit21 import NAMES, pooled, write_stats
from trainvitals.cli import main
from trainvitals.report import query


def test_a_folder_whose_only_file_is_below_it_is_queried_from_that_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "runs" / "tb" / "version_0"
    run.mkdir(parents=True)
    shown = write_stats(run / "tensor_stats.jsonl", [(0, 0), (1, 0)])
    top = tmp_path / "runs"
    rows = query(top, stat=["count", "mean", "kurtosis"], group="*.layers.1.*")
    members = [NAMES.index(n) for n in NAMES if ".layers.1." in n]
    for row in rows:
        want = pooled([shown[row["step"]][i] for i in members])
        for stat in ("count", "mean", "kurtosis"):
            assert row[stat] == pytest.approx(want[stat], rel=1e-9, abs=1e-12)
    assert [r["step"] for r in rows] == [0, 1]
    # the CLI too, with the same rows as a query of the file itself
    assert main(["query", str(top), "--stat", "mean", "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert main(["query", str(run), "--stat", "mean", "--format", "json"]) == 0
    assert got == json.loads(capsys.readouterr().out) and len(got) == 2


def test_a_second_file_below_or_one_moved_aside_still_leaves_the_choice_to_the_user(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    top = tmp_path / "runs"
    first = top / "tb" / "version_0"
    first.mkdir(parents=True)
    write_stats(first / "tensor_stats.jsonl", [(0, 0)])
    aside = top / "tensor_stats.jsonl.1"  # an earlier run of the top folder, moved aside
    aside.write_text((first / "tensor_stats.jsonl").read_text())
    assert main(["query", str(top)]) == 2
    err = capsys.readouterr().err
    assert "2 found" in err and str(aside) in err, err
    aside.unlink()
    second = top / "tb" / "version_1"
    second.mkdir()
    write_stats(second / "tensor_stats.jsonl", [(0, 1)])
    assert main(["query", str(top)]) == 2
    err = capsys.readouterr().err
    assert "2 found" in err and str(second / "tensor_stats.jsonl") in err, err


def test_a_folder_named_like_the_file_below_is_not_taken_for_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    top = tmp_path / "runs"
    (top / "x" / "tensor_stats.jsonl").mkdir(parents=True)  # a folder, not a run's file
    assert main(["query", str(top)]) == 2
    err = capsys.readouterr().err
    assert f"no tensor statistics file at {top / 'tensor_stats.jsonl'}; 1 found" in err, err
