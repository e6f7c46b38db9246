"""The report beside a tensor_stats.jsonl of a newer trainvitals (the metrics still shown), and
moment vectors holding an integer too large for a float (the line skipped, not a traceback)."""

from __future__ import annotations

import html
import json
import math
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.report.test_html_report import Page
from tests.report.test_query_robustness import NEWER, check_rows, line, moments, tensors_at
from trainvitals.adapters import FanoutWriter, JsonlSink
from trainvitals.cli import main
from trainvitals.report import query, read_tensor_stats, render_report, write_report
from trainvitals.report.query import SUPPORTED_VERSIONS

LOSSES = [2.0, 1.5, 1.25, 1.125]


def write_metrics(run_dir: Path) -> None:
    with FanoutWriter([JsonlSink(run_dir / "metrics.jsonl")]) as writer:
        for step, loss in enumerate(LOSSES):
            writer.add_scalars({"train/loss": loss}, step)


# ------------------------------------------------------------ newer tensor file beside metrics


def test_report_shows_the_metrics_beside_a_tensor_file_of_a_newer_trainvitals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_metrics(tmp_path)
    stats = tmp_path / "tensor_stats.jsonl"
    stats.write_text("".join(line(s, version=NEWER) + "\n" for s in range(3)))
    want = (
        f"{stats} was written by a newer trainvitals (schema version {NEWER}; this one reads "
        f"up to version {max(SUPPORTED_VERSIONS)}): upgrade trainvitals to read it"
    )

    with pytest.warns(RuntimeWarning) as caught:
        page_text = render_report(tmp_path)
    assert want in [str(w.message) for w in caught]
    page = Page(page_text)
    # the metrics, as written
    row = page.rows("metrics")["train/loss"]
    assert row["last"] == LOSSES[-1] and row["last step"] == len(LOSSES) - 1
    assert row["steps"] == len(LOSSES)
    assert row["min"] == min(LOSSES) and row["max"] == max(LOSSES)
    assert row["mean"] == pytest.approx(statistics.fmean(LOSSES), rel=1e-15)
    assert "train/loss" in page.charts
    # the message on the page, in the Attention section; no tensor statistics
    attention = page_text.split('<section id="attention">', 1)[1].split("</section>", 1)[0]
    assert html.escape(want) in attention
    assert not any(key.startswith(("grad", "tensor")) for key in page.charts), page.charts

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert write_report(tmp_path, tmp_path / "w.html") == tmp_path / "w.html"
    assert html.escape(want) in (tmp_path / "w.html").read_text()

    # the CLI: exit 0, the page written, the message printed as a warning (a process of its
    # own: in this one pytest records the warnings instead of their being printed)
    out = tmp_path / "report.html"
    done = subprocess.run(
        [sys.executable, "-m", "trainvitals", "report", str(tmp_path), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert f"warning: {want}" in done.stderr.splitlines(), done.stderr
    assert Page(out.read_text()).rows("metrics")["train/loss"]["last"] == LOSSES[-1]
    # `trainvitals query` reads only the tensor file: still the error
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["query", str(tmp_path)]) == 2
    assert f"trainvitals query: error: {want}" in capsys.readouterr().err


def test_report_of_a_newer_tensor_file_alone_is_still_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tensor_stats.jsonl").write_text(line(0, version=NEWER) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="written by a newer trainvitals"):
            render_report(tmp_path)
        assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 2
    assert "upgrade trainvitals" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


# ----------------------------------------------------------- integers too large for a float

#: The smallest integer magnitude float() refuses: halfway between the largest float,
#: (2 - 2**-52) * 2**1023, and 2**1024, which round-half-even takes up to 2**1024 (overflow).
INT_LIMIT = 2**1024 - 2**970
FIELD = ["count", "mean", "m2", "m3", "m4", "min", "max", "nonfinite"]


def huge_line(step: int, field: str, value: int, null_min: bool = False) -> str:
    """The line of ``step`` with ``value`` (an integer, written as its digits) in ``field`` of
    the first tensor (and ``null`` as that tensor's min where ``null_min``)."""
    vectors = {n: moments(t) for n, t in tensors_at(step).items()}
    first = vectors["a.weight"]
    first[FIELD.index(field)] = value
    if null_min:
        first[FIELD.index("min")] = None
    return line(step, tensors=vectors)


def test_limit_is_where_float_overflows() -> None:
    # the test's own boundary, checked against float() itself
    assert float(INT_LIMIT - 1) == sys.float_info.max
    for v in (INT_LIMIT, -INT_LIMIT, 10**400):
        with pytest.raises(OverflowError):
            float(v)


@pytest.mark.parametrize(
    ("field", "value", "null_min"),
    [
        ("m4", 10**400, False),  # a 401-digit literal: json gives an int (1e400 would be inf)
        ("count", 10**400, False),
        ("nonfinite", 10**400, False),  # the report's non-finite table converts it too
        ("mean", -(10**400), True),  # with a null in the line
        ("m2", INT_LIMIT, False),  # the smallest that overflows
    ],
    ids=["m4", "count", "nonfinite", "mean-with-null", "at-the-limit"],
)
def test_a_moment_vector_with_an_integer_too_large_for_a_float_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: int, null_min: bool
) -> None:
    lines = [line(0), huge_line(1, field, value, null_min), line(2)]
    text = "\n".join(lines) + "\n"
    assert str(abs(value)) in text  # written as an integer literal
    assert any(
        type(x) is int and abs(x) == abs(value) for x in json.loads(lines[1])["tensors"]["a.weight"]
    )
    (tmp_path / "tensor_stats.jsonl").write_text(text)

    with pytest.warns(RuntimeWarning) as caught:
        rows = query(tmp_path, stat=["mean", "kurtosis"])
    check_rows(rows, [0, 2])  # the other lines, exactly
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'tensor_stats.jsonl'}: line 2 has a moment vector element too large for a "
        "float"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [r["step"] for r in read_tensor_stats(tmp_path)] == [0, 2]
        # the CLI: rows of steps 0 and 2, no traceback
        assert main(["query", str(tmp_path), "--stat", "mean"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert [r.split()[0] for r in out[1:]] == ["0", "2"]
        page = tmp_path / "report.html"
        assert main(["report", str(tmp_path), "-o", str(page)]) == 0
        assert page.exists()
    capsys.readouterr()


def test_integers_that_fit_a_float_are_read(tmp_path: Path) -> None:
    # just under the limit (float() gives the largest float), and above a C long (2**70): kept
    lines = [line(0), huge_line(1, "m4", INT_LIMIT - 1), huge_line(2, "m4", 2**70)]
    (tmp_path / "tensor_stats.jsonl").write_text("\n".join(lines) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no line skipped
        recs = list(read_tensor_stats(tmp_path))
        rows = query(tmp_path, stat=["mean", "var"])
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:  # the mean does not use m4: exact as from the elements
        x = [float(v) for t in tensors_at(r["step"]).values() for v in t.double().reshape(-1)]
        assert r["mean"] == pytest.approx(math.fsum(x) / len(x), rel=1e-9, abs=1e-12)
