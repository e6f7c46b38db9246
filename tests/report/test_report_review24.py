"""Review 24 (R4): a run folder with nothing readable in it (an empty ``metrics.jsonl``, an
empty ``tensor_stats.jsonl``, a file holding one line cut by a crash) is an error of
``trainvitals report`` as of ``trainvitals query`` (exit status 2, one line saying the file holds
nothing yet); ``report`` wrote an empty page opening with a bare "; " and exited 0."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trainvitals.cli import main
from trainvitals.report import render_report

# what a crash leaves of a first line: no line end
_CUT_METRICS = '{"step":0,"time":1.0,"metrics":{"a":1'
_CUT_STATS = '{"version":1,"step":0,"kind":"grad","fie'

FOLDERS = {
    "empty metrics.jsonl": {"metrics.jsonl": ""},
    "empty tensor_stats.jsonl": {"tensor_stats.jsonl": ""},
    "metrics.jsonl with a cut line": {"metrics.jsonl": _CUT_METRICS},
    "tensor_stats.jsonl with a cut line": {"tensor_stats.jsonl": _CUT_STATS},
    "both empty": {"metrics.jsonl": "\n", "tensor_stats.jsonl": ""},
}


@pytest.mark.parametrize("folder", FOLDERS)
def test_nothing_readable_is_an_error_of_report_and_query(
    folder: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = FOLDERS[folder]
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert not out.exists()
    error = [line for line in err.splitlines() if line.startswith("trainvitals report: error")]
    assert len(error) == 1 and "Traceback" not in err
    assert "nothing to report yet" in error[0]
    for name in files:
        assert str(tmp_path / name) in error[0]
    with pytest.raises(ValueError, match="nothing to report yet"):
        render_report(tmp_path)
    # and query, as before: exit 2, one error line
    assert main(["query", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if line.startswith("trainvitals query: error")]
    assert len(error) == 1 and "Traceback" not in err
    stats = tmp_path / "tensor_stats.jsonl"
    if stats.exists():  # the file the monitor writes, holding no whole line: said so
        assert f"{stats} holds no line yet" in error[0]
        assert "is it a tensor_stats.jsonl file" not in error[0]
    else:
        assert "no tensor statistics file" in error[0]


def _metrics(path: Path, steps: range) -> None:
    path.write_text(
        "".join(
            json.dumps({"step": s, "time": 1000.0 + s, "metrics": {"train/loss": 0.5 * s}}) + "\n"
            for s in steps
        ),
        encoding="utf-8",
    )


def test_files_holding_values_make_a_page_without_a_bare_separator(
    tmp_path: Path,
) -> None:
    """The files hold values, none within ``--steps`` or ``--keys``: a page saying so (warned),
    as before; its header opened with "; " (no span)."""
    _metrics(tmp_path / "metrics.jsonl", range(10))
    for options in ({"steps": "50:"}, {"keys": "nomatch/*"}):
        with pytest.warns(RuntimeWarning, match="no metric within"):
            page = render_report(tmp_path, **options)
        meta = re.search(r'<p class="meta">([^<]*)</p>', page)
        assert meta is not None and meta.group(1).startswith("0 metric keys. Read from ")
    # with something shown, the span opens the line as before
    meta = re.search(r'<p class="meta">([^<]*)</p>', render_report(tmp_path, steps="2:4"))
    assert meta is not None and meta.group(1).startswith("steps 2 to 4, 0:00:02 of wall time; ")
    # only a file with nothing readable is refused: whole lines before a cut one are shown
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(_CUT_METRICS)
    with pytest.warns(RuntimeWarning, match="truncated"):
        page = render_report(tmp_path)
    assert "1 metric keys" in page and "steps 0 to 9" in page
