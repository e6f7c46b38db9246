"""trainvitals.report.query and the ``trainvitals query`` CLI against float64 on pooled data."""

from __future__ import annotations

import csv
import importlib
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.stats.test_moments import REL, reference
from trainvitals.cli import main
from trainvitals.report import parse_steps, query, read_tensor_stats, render_report
from trainvitals.stats.moments import DERIVED, FIELDS, fused_moments, moments_to_dicts

LAYERS = 12


def make_tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = {}
    for layer in range(LAYERS):
        scale = 0.01 * (layer + 1) * (step + 1)
        out[f"model.layers.{layer}.mlp.fc1.weight"] = scale * torch.randn(64, 32, generator=g) ** 3
        out[f"model.layers.{layer}.mlp.fc2.weight"] = 1 + scale * torch.randn(32, 64, generator=g)
        out[f"model.layers.{layer}.attn.qkv.weight"] = scale * torch.randn(96, 32, generator=g)
    out["model.norm.weight"] = 1 + 0.01 * torch.randn(32, generator=g)
    return out


def write_run(
    run_dir: Path,
    steps: list[int],
    tensors_for: Callable[[int], dict[str, torch.Tensor]] = make_tensors,
) -> dict[int, dict[str, torch.Tensor]]:
    """A tensor_stats.jsonl as the monitor writes it (schema version 1), with the tensors
    ``tensors_for(step)`` at each step."""
    data = {s: tensors_for(s) for s in steps}
    with open(run_dir / "tensor_stats.jsonl", "w") as f:
        for step, tensors in data.items():
            rows = moments_to_dicts(fused_moments(list(tensors.values())))
            line = {
                "version": 1,
                "step": step,
                "kind": "grad",
                "time": 0.0,
                "fields": list(FIELDS),
                "tensors": {n: [r[k] for k in FIELDS] for n, r in zip(tensors, rows, strict=True)},
            }
            f.write(json.dumps(line) + "\n")
    return data


def check_row(row: dict, pooled: torch.Tensor, stats: list[str]) -> None:
    ref = reference(pooled)
    for s in stats:
        floor = (
            1e-6 * ref["rms"]
            if s == "mean"
            else 1e-6
            if s in ("skewness", "excess_kurtosis")
            else 0
        )
        assert abs(row[s] - ref[s]) <= REL * abs(ref[s]) + floor, (row, s, ref[s])


def test_query_by_layer_merges_exactly(tmp_path: Path) -> None:
    data = write_run(tmp_path, [0, 10, 20, 30])
    rows = query(
        tmp_path,
        kind="grad",
        group="model.layers.*.mlp.*",
        stat="all",
        steps="10:20",
        by=r"layers\.(\d+)\.",
    )
    assert [(r["step"], r["group"]) for r in rows] == [
        (s, str(i)) for s in (10, 20) for i in range(LAYERS)
    ]
    for r in rows:
        names = [
            f"model.layers.{r['group']}.mlp.fc1.weight",
            f"model.layers.{r['group']}.mlp.fc2.weight",
        ]
        pooled = torch.cat([data[r["step"]][n].reshape(-1) for n in names])
        assert r["tensors"] == 2
        check_row(r, pooled, list(DERIVED))


def test_query_regex_group_and_all_tensors(tmp_path: Path) -> None:
    data = write_run(tmp_path, [0, 5])
    rows = query(
        tmp_path / "tensor_stats.jsonl",
        kind="grad",
        group=r"re:layers\.(1[0-1]|[2-3])\.attn",
        stat=["kurtosis", "l2"],
    )
    assert [r["step"] for r in rows] == [0, 5]
    for r in rows:
        names = [f"model.layers.{i}.attn.qkv.weight" for i in (2, 3, 10, 11)]
        check_row(r, torch.cat([data[r["step"]][n].reshape(-1) for n in names]), ["kurtosis", "l2"])
        assert r["tensors"] == 4 and r["group"] == "*"
    everything = query(tmp_path, kind="grad", stat="kurtosis", steps="5")
    pooled = torch.cat([t.reshape(-1) for t in data[5].values()])
    check_row(everything[0], pooled, ["kurtosis"])
    per = query(tmp_path, kind="grad", group="*norm*", stat="mean", per_tensor=True)
    assert [r["group"] for r in per] == ["model.norm.weight"] * 2
    assert query(tmp_path, kind="param") == []


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    write_run(tmp_path, [0, 1])
    before = query(tmp_path, stat="kurtosis")
    with open(tmp_path / "tensor_stats.jsonl", "a") as f:
        f.write('{"version": 1, "step": 2, "kind": "grad", "tensors": {"model.lay')
    with pytest.warns(RuntimeWarning, match="last line"):
        after = query(tmp_path, stat="kurtosis")
    assert after == before


def test_later_duplicate_step_wins_and_unknown_version_is_skipped(tmp_path: Path) -> None:
    write_run(tmp_path, [0])
    lines = (tmp_path / "tensor_stats.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    rec["tensors"] = {"model.norm.weight": rec["tensors"]["model.norm.weight"]}
    future = dict(rec, version=99)
    with open(tmp_path / "tensor_stats.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n" + json.dumps(future) + "\n")
    with pytest.warns(RuntimeWarning, match="version 99"):
        rows = query(tmp_path, stat="count")
    assert rows == [{"step": 0, "kind": "grad", "group": "*", "tensors": 1, "count": 32}]


# the console script `pip install -e .` installs next to the interpreter ([project.scripts])
SCRIPT = Path(sys.executable).with_name("trainvitals")


def run_cli(*args: str, installed_script: bool = False) -> subprocess.CompletedProcess:
    """A real entry point in a subprocess: `python -m trainvitals`, or the installed
    `trainvitals` script. Each one imports torch (about 2 s): the cases that only need the
    exit status `main` returns call `main([...])` in-process instead."""
    if installed_script:
        assert SCRIPT.is_file(), f"no installed trainvitals script at {SCRIPT}"
    command = [str(SCRIPT)] if installed_script else [sys.executable, "-m", "trainvitals"]
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_subprocess_csv_json_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path, [0, 100, 150, 200, 250])
    with open(tmp_path / "tensor_stats.jsonl", "a") as f:
        f.write('{"version": 1, "step": 300, "kind": "gr')  # cut by a crash
    api = query(
        tmp_path,
        kind="grad",
        group="model.layers.*.mlp.*",
        stat=["kurtosis", "rms"],
        steps="100:200",
        by=r"layers\.(\d+)\.",
    )
    out_csv = tmp_path / "k.csv"
    base = [
        "query",
        str(tmp_path),
        "--kind",
        "grad",
        "--group",
        "model.layers.*.mlp.*",
        "--stat",
        "kurtosis,rms",
    ]
    base += ["--steps", "100:200", "--by", r"layers\.(\d+)\."]
    res = run_cli(*base, "--format", "csv", "--output", str(out_csv))
    assert res.returncode == 0, res.stderr
    assert "last line" in res.stderr
    with open(out_csv) as f:
        got = list(csv.DictReader(f))
    assert len(got) == len(api) == 3 * LAYERS
    for g, a in zip(got, api, strict=True):
        assert int(g["step"]) == a["step"] and g["group"] == a["group"]
        assert float(g["kurtosis"]) == a["kurtosis"] and float(g["rms"]) == a["rms"]
    # the other formats in-process (the subprocess above proved the entry point)
    with pytest.warns(RuntimeWarning, match="last line"):
        assert main([*base, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == api
    with pytest.warns(RuntimeWarning, match="last line"):
        assert main(base) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "kind", "group", "tensors", "kurtosis", "rms"]
    assert len(lines) == 1 + 3 * LAYERS
    assert lines[1].split()[:3] == ["100", "grad", "0"] and lines[12].split()[2] == "11"


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path, [0])
    assert main(["query", str(tmp_path), "--stat", "kurt"]) == 2
    assert "stat must be" in capsys.readouterr().err
    assert main(["query", str(tmp_path), "--steps", "a:b"]) == 2
    assert main(["query", str(tmp_path / "nope")]) == 2
    assert main(["query", str(tmp_path), "--by", r"layers\.\d+"]) == 2
    assert "capture group" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])


def test_parse_steps() -> None:
    assert parse_steps("100:200") == (100, 200)
    assert parse_steps("100:") == (100, None)
    assert parse_steps(":7") == (None, 7)
    assert parse_steps("5") == (5, 5)
    assert parse_steps(None) == (None, None)
    with pytest.raises(ValueError, match="after"):
        parse_steps("9:3")


def test_query_on_a_monitor_run(tmp_path: Path) -> None:
    from tests.callbacks.test_tensor_stats_monitor import Net, Recorder, batches
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = {}
    with Vitals(
        [TensorStatsMonitor(kinds=["grad"], kernel="eager")],
        writer=Recorder(),
        run_dir=tmp_path,
        log_every_n_steps=1,
    ) as vitals:
        vitals.attach(model, opt)
        ids = batches(1)[0]
        vitals.batch(ids)
        model(ids).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    rows = query(tmp_path, kind="grad", group="layers.*", by=r"layers\.(\d+)\.", stat="kurtosis")
    for r in rows:
        pooled = torch.cat(
            [g.reshape(-1) for n, g in grads.items() if n.startswith(f"layers.{r['group']}.")]
        )
        check_row(r, pooled, ["kurtosis"])
    assert [r["group"] for r in rows] == ["0", "1"]


def test_read_tensor_stats_names_each_unreadable_line(tmp_path: Path) -> None:
    write_run(tmp_path, [0, 1])
    path = tmp_path / "tensor_stats.jsonl"
    good = path.read_text().splitlines()
    future = json.dumps({"version": 99, "step": 2, "kind": "grad"})
    path.write_text("\n".join([good[0], "{not json", future, "", good[1], '{"cut', "", ""]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = list(read_tensor_stats(tmp_path))
    assert [r["step"] for r in records] == [0, 1]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3, messages
    assert "unreadable line (line 2)" in messages[0]
    assert "line 3 has schema version 99" in messages[1]
    assert "unreadable line (last line: cut by a crash, or still being written" in messages[2]


def test_query_reads_in_chunks_and_a_later_line_of_a_step_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    query_module = importlib.import_module("trainvitals.report.query")
    write_run(tmp_path, [0, 1, 2, 3, 4, 5])
    lines = (tmp_path / "tensor_stats.jsonl").read_text()
    resumed = write_run(tmp_path, [2, 3], lambda s: make_tensors(50 + s))  # resumed at step 2
    (tmp_path / "tensor_stats.jsonl").write_text(
        lines + (tmp_path / "tensor_stats.jsonl").read_text()
    )
    args = {"kind": "grad", "stat": "all", "by": r"layers\.(\d+)\."}
    monkeypatch.setattr(query_module, "CHUNK_RECORDS", 2)
    chunked = query(tmp_path, **args)
    monkeypatch.setattr(query_module, "CHUNK_RECORDS", 10_000)
    assert chunked == query(tmp_path, **args)
    assert [r["step"] for r in chunked] == sorted(r["step"] for r in chunked)
    assert len(chunked) == 6 * LAYERS
    for row in chunked:
        if row["step"] == 3:  # the resumed line's tensors, not the first line's
            layer = f"model.layers.{row['group']}."
            pooled = torch.cat(
                [t.reshape(-1) for n, t in resumed[3].items() if n.startswith(layer)]
            )
            check_row(row, pooled, ["mean", "std", "kurtosis"])


def test_gc_paused_restores_the_collector_state_also_on_error() -> None:
    import gc

    from trainvitals.report.query import gc_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("a read failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_a_later_line_with_no_matching_tensor_removes_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The later line of a repeated step replaces the earlier one also when it gives no row
    (here: it holds no layer tensor), also across chunks."""
    query_module = importlib.import_module("trainvitals.report.query")
    monkeypatch.setattr(query_module, "CHUNK_RECORDS", 2)
    write_run(tmp_path, [0, 1, 2, 3])
    lines = (tmp_path / "tensor_stats.jsonl").read_text()
    write_run(tmp_path, [1], lambda s: {"model.norm.weight": make_tensors(s)["model.norm.weight"]})
    (tmp_path / "tensor_stats.jsonl").write_text(
        lines + (tmp_path / "tensor_stats.jsonl").read_text()
    )
    rows = query(tmp_path, kind="grad", stat="rms", by=r"layers\.(\d+)\.")
    assert sorted({r["step"] for r in rows}) == [0, 2, 3]
    assert len(rows) == 3 * LAYERS


def test_a_wrong_file_gives_a_few_warnings_and_an_error(tmp_path: Path) -> None:
    # a metrics file given to `query`: every line parses but none is a tensor-statistics record
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(40)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(read_tensor_stats(path)) == []
    messages = [str(w.message) for w in caught]
    assert len(messages) == 6, messages  # five lines named, then one count
    assert [f"line {i} has schema version None" in m for i, m in enumerate(messages[:5], 1)] == [
        True
    ] * 5
    assert "35 more lines skipped" in messages[5]
    res = run_cli("query", str(path))  # a subprocess: the CLI's own warning output
    assert res.returncode == 2
    assert "holds no tensor-statistics record" in res.stderr
    assert res.stderr.count("warning:") == 6, res.stderr


def test_cli_says_why_a_query_is_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path, [0, 5, 9])
    cases = [
        (
            ["--steps", "100:200"],
            "no 'grad' records in steps 100:200 (the file holds grad steps 0-9)",
        ),
        (["--kind", "param"], "no 'param' records (the file holds grad steps 0-9)"),
        (["--group", "decoder.*"], "no 'grad' tensor name matches --group 'decoder.*'"),
        (["--group", "*fc1*", "--by", r"blocks\.(\d+)"], "matches --by"),
    ]
    for extra, reason in cases:
        assert main(["query", str(tmp_path), *extra]) == 1  # no match, as grep's 1
        captured = capsys.readouterr()
        assert reason in captured.err, (extra, captured.err)
        # the header alone, with the column of the stat asked for (kurtosis by default)
        assert captured.out.split() == ["step", "kind", "group", "tensors", "kurtosis"]
    args = ["--group", "decoder.*", "--stat", "mean,std", "--format", "csv"]
    assert main(["query", str(tmp_path), *args]) == 1
    assert capsys.readouterr().out == "step,kind,group,tensors,mean,std\n"
    assert main(["query", str(tmp_path), "--steps", "5"]) == 0  # not empty: no message
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.splitlines()[1].split()[:3] == ["5", "grad", "*"]


def test_cli_output_folders_are_made_and_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path, [0])
    out = tmp_path / "new" / "deeper" / "kurt.csv"
    assert main(["query", str(tmp_path), "--format", "csv", "-o", str(out)]) == 0
    assert out.read_text().splitlines()[0] == "step,kind,group,tensors,kurtosis"
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    from trainvitals import __version__

    assert capsys.readouterr().out.strip() == f"trainvitals {__version__}"


def test_negative_steps_are_rejected() -> None:
    for bad in ("-5", "5:-1", "-3:", (-1, 4)):
        with pytest.raises(ValueError, match="counted from 0"):
            parse_steps(bad)
    assert main(["query", "unused", "--steps", "-5"]) == 2


def test_table_cells_spell_out_missing_and_non_finite_values():
    from trainvitals.report.query import format_value

    assert format_value(None) == "-"
    nonfinite = (float("nan"), float("inf"), float("-inf"))
    assert [format_value(v) for v in nonfinite] == ["NaN", "inf", "-inf"]
    assert format_value(2.0 / 3.0) == "0.666667"
    assert format_value(12) == "12"


def test_by_with_an_optional_group_leaves_out_names_it_does_not_capture(tmp_path: Path) -> None:
    """A `by` regex that matches a name without its group taking part (here `norm`) leaves
    that tensor out, as one that does not match at all, instead of failing on its None label."""
    data = write_run(tmp_path, [0, 3])
    rows = query(tmp_path, kind="grad", stat=["kurtosis", "rms"], by=r"layers\.(\d+)\.|norm")
    assert [(r["step"], r["group"]) for r in rows] == [
        (s, str(i)) for s in (0, 3) for i in range(LAYERS)
    ]
    for r in rows:
        prefix = f"model.layers.{r['group']}."
        pooled = torch.cat(
            [t.reshape(-1) for n, t in data[r["step"]].items() if n.startswith(prefix)]
        )
        check_row(r, pooled, ["kurtosis", "rms"])


def test_cli_output_errors_are_clear_and_leave_nothing_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`-o` naming a folder: exit 2 with the system's message, no traceback, and no hidden
    temporary report file left next to it."""
    write_run(tmp_path, [0])
    folder = tmp_path / "out"
    folder.mkdir()
    for args in (["query", str(tmp_path)], ["report", str(tmp_path)]):
        status = main([*args, "-o", str(folder)])  # a traceback would raise out of main
        err = capsys.readouterr().err
        assert status == 2, err
        assert f"trainvitals {args[0]}: error:" in err and "directory" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tensor_stats.jsonl"]


def test_records_without_step_or_tensors_are_skipped_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Version-1 lines missing `tensors` or an integer `step` (not written by the monitor) are
    skipped with a warning naming them; the other lines still give their exact rows, and a
    file of only such lines is a clear CLI error."""
    data = write_run(tmp_path, [0, 4])
    path = tmp_path / "tensor_stats.jsonl"
    good = path.read_text().splitlines()
    short = json.loads(good[0])
    short["step"] = 3
    name = next(iter(short["tensors"]))
    short["tensors"][name] = short["tensors"][name][:-2]  # a vector cut short
    broken = [
        json.dumps({"version": 1, "step": 2, "kind": "grad"}),
        json.dumps({"version": 1, "step": "3", "kind": "grad", "tensors": {}}),
        json.dumps(short),
    ]
    path.write_text("\n".join([good[0], *broken, good[1]]) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = query(tmp_path, stat="kurtosis")
    messages = [str(w.message) for w in caught]
    assert any("line 2 has no 'tensors'" in m for m in messages), messages
    assert any("line 3 has no integer 'step'" in m for m in messages), messages
    assert any("line 4 has a moment vector that does not match" in m for m in messages), messages
    assert [r["step"] for r in rows] == [0, 4]
    for r in rows:
        check_row(r, torch.cat([t.reshape(-1) for t in data[r["step"]].values()]), ["kurtosis"])
    path.write_text("\n".join(broken) + "\n")
    with pytest.warns(RuntimeWarning, match=r"line \d has "):  # (the lines skipped above)
        status = main(["query", str(tmp_path)])  # a traceback would raise out of main
    err = capsys.readouterr().err
    assert status == 2 and "holds no tensor-statistics record" in err, err


def test_cli_exit_status_tells_no_match_from_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As grep: 0 with rows, 1 with none (a reason on stderr, the header alone on stdout or
    in the `-o` file), 2 on an error. A script can tell the three apart by the status."""
    write_run(tmp_path, [0, 5])
    # the real entry points exit with the status main returns: `python -m trainvitals` (0) and
    # the installed `trainvitals` script (1); test_a_wrong_file_... has `python -m`'s 2
    ok = run_cli("query", str(tmp_path), "--steps", "5", "--format", "json")
    assert ok.returncode == 0, ok.stderr
    assert [r["step"] for r in json.loads(ok.stdout)] == [5] and ok.stderr == ""
    out = tmp_path / "none.csv"
    args = ["query", str(tmp_path), "--kind", "param", "--format", "csv", "-o", str(out)]
    res = run_cli(*args, installed_script=True)
    assert res.returncode == 1 and res.stdout == "" and "no 'param' records" in res.stderr
    assert out.read_text() == "step,kind,group,tensors,kurtosis\n"
    # the other cases in-process, through the same main
    for extra in (["--group", "decoder.*"], ["--kind", "dgrad"], ["--steps", "6:9"]):
        status = main(["query", str(tmp_path), *extra, "--format", "csv"])
        captured = capsys.readouterr()
        assert status == 1, (extra, status, captured.err)
        assert captured.out == "step,kind,group,tensors,kurtosis\n"
        assert captured.err.startswith("trainvitals query: no match: "), captured.err
    with pytest.raises(SystemExit) as bad_kind:  # argparse's error
        main(["query", str(tmp_path), "--kind", "nope"])
    assert bad_kind.value.code == 2
    assert "error" in capsys.readouterr().err
    assert main(["query", str(tmp_path), "--steps", "x"]) == 2  # the query's error
    assert "error" in capsys.readouterr().err
    assert main(["query", str(tmp_path / "missing")]) == 2
    with pytest.raises(SystemExit) as helped:
        main(["query", "--help"])
    assert helped.value.code == 0
    helptext = capsys.readouterr().out
    assert "1 when nothing matched" in helptext and "2 on an error" in helptext


def test_cli_says_when_the_records_hold_no_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step whose measurement failed is written with no tensor; a query of only such steps
    says so (not that its --group, which was not given, matched nothing) and exits 1."""
    write_run(tmp_path, [0, 1])
    rec = json.loads((tmp_path / "tensor_stats.jsonl").read_text().splitlines()[1])
    with open(tmp_path / "tensor_stats.jsonl", "a") as f:
        f.write(json.dumps(dict(rec, step=2, tensors={})) + "\n")
    assert main(["query", str(tmp_path), "--steps", "2"]) == 1
    err = capsys.readouterr().err
    assert "the 'grad' records in steps 2 hold no tensor" in err and "--group" not in err, err
    assert main(["query", str(tmp_path), "--steps", "1:2", "--group", "x.*"]) == 1
    assert "no 'grad' tensor name matches --group 'x.*' (model.layers.0" in capsys.readouterr().err


def test_cli_reader_closing_the_pipe_is_not_an_error(tmp_path: Path) -> None:
    """`trainvitals query ... | head`: a reader that stops early is not an error of the query
    (exit 2 broke `set -o pipefail` scripts); exit 141 (as grep ended by SIGPIPE), quietly."""
    write_run(tmp_path, [0, 1, 2])
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainvitals", "query", str(tmp_path), "--per-tensor"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the query writes: its write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == "", err


def test_a_folder_of_several_runs_is_an_error_naming_their_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # lightning_logs/ holds one folder per run (version_0, version_1), and a run folder keeps an
    # earlier run's file moved aside (tensor_stats.jsonl.1): which one to read is the user's
    # choice, so the error (exit 2) names them instead of only the file that is not there.
    logs = tmp_path / "lightning_logs"
    runs = [logs / "version_0", logs / "version_1", logs / "exp" / "version_0"]
    for run in runs:
        run.mkdir(parents=True)
        write_run(run, [0])
    (runs[0] / "tensor_stats.jsonl").rename(runs[0] / "tensor_stats.jsonl.1")
    assert main(["query", str(logs)]) == 2
    err = capsys.readouterr().err
    want = [runs[1] / "tensor_stats.jsonl", runs[2] / "tensor_stats.jsonl"]
    assert f"no tensor statistics file at {logs / 'tensor_stats.jsonl'}; 2 found" in err, err
    assert all(str(f) in err for f in want), err
    assert main(["query", str(runs[0])]) == 2  # only the file moved aside
    assert (
        f"1 found in or below {runs[0]}: {runs[0] / 'tensor_stats.jsonl.1'}"
        in capsys.readouterr().err
    )
    assert main(["query", str(runs[1])]) == 0  # a named run reads as usual
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["query", str(empty)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"at {empty / 'tensor_stats.jsonl'}")


def test_a_record_without_a_kind_string_is_skipped_not_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A line with no `kind` (or a list for one) made a query that matched nothing exit 2 with
    "'<' not supported between instances of 'NoneType' and 'str'" (its no-match message sorts
    the kinds found) instead of 1 and the reason, and a list kind broke the report
    ("unhashable type"). Such lines are skipped with a warning naming them."""
    data = write_run(tmp_path, [0, 4])
    path = tmp_path / "tensor_stats.jsonl"
    good = path.read_text().splitlines()
    no_kind, list_kind = json.loads(good[0]), json.loads(good[0])
    del no_kind["kind"]
    list_kind["kind"] = ["grad"]
    path.write_text(
        "\n".join([good[0], json.dumps(no_kind), json.dumps(list_kind), good[1]]) + "\n"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = main(["query", str(tmp_path), "--kind", "param"])
        err = capsys.readouterr().err
        assert status == 1, err
        assert "no 'param' records (the file holds grad steps 0-4)" in err, err
        rows = query(tmp_path, stat="kurtosis")
        assert "tensor statistics: grad" in render_report(tmp_path)
    messages = [str(w.message) for w in caught]
    for line in (2, 3):
        assert any(f"line {line} has no 'kind' string" in m for m in messages), messages
    assert [r["step"] for r in rows] == [0, 4]
    for r in rows:
        check_row(r, torch.cat([t.reshape(-1) for t in data[r["step"]].values()]), ["kurtosis"])
