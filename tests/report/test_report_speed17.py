"""The vectorised reading of ``tensor_stats.jsonl`` (``query``, the HTML report): every number
against an independent float64 computation from the tensors' elements, on a file with
NaN/inf elements, ``null`` moments, fields in another order, a resumed run's repeated steps,
groups, ``by`` captures and step ranges; and the work it saves (a list of tensor names
matched once, not once per line; one merge per chunk for the report)."""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainvitals._natural import natural_key
from trainvitals.report import html as report_html
from trainvitals.report import query, read_tensor_stats, render_report

query_module = importlib.import_module("trainvitals.report.query")

FIELDS = ["count", "mean", "m2", "m3", "m4", "min", "max", "nonfinite"]
OTHER_ORDER = ["max", "nonfinite", "count", "m2", "mean", "extra", "m4", "m3", "min"]
KINDS = ("param", "grad")
LAYERS = (0, 1, 2, 10)
NAMES = [f"model.layers.{layer}.{part}.weight" for layer in LAYERS for part in ("mlp.up", "attn.q")]
NAMES += ["embed.weight", "model.layers.3.mlp.up/output0"]
EMPTY = "model.layers.1.attn.q.weight"  # all of its elements non-finite at every 3rd step
OVERFLOWED = ("grad", 7, "model.layers.2.mlp.up.weight")  # its m2 written as null


def elements(rng: random.Random, name: str, step: int) -> list[float]:
    """A tensor's elements: a few to a few dozen, offset and scaled per tensor, sometimes with
    NaN/inf among them."""
    n = rng.randint(1, 40)
    # |mean| / std up to ~30: the merge's rounding (d_k = mean_k - mean) stays below 1e-12
    offset = rng.choice([0.0, 0.5, -3.0])
    scale = rng.choice([0.1, 1.0, 7.0])
    xs = [offset + scale * rng.gauss(0.0, 1.0) for _ in range(n)]
    if rng.random() < 0.2:
        xs += rng.sample([math.nan, math.inf, -math.inf], rng.randint(1, 3))
    if name == EMPTY and step % 3 == 0:
        xs = [math.nan, math.inf]
    rng.shuffle(xs)
    return xs


def moments(xs: list[float]) -> dict[str, Any]:
    """A tensor's moments from its elements, in float64 with correctly rounded sums, as the
    file holds them (``null`` for no finite element's min/max)."""
    fin = [x for x in xs if math.isfinite(x)]
    n = len(fin)
    mean = math.fsum(fin) / n if n else 0.0
    return {
        "count": n,
        "mean": mean,
        **{f"m{k}": math.fsum((x - mean) ** k for x in fin) for k in (2, 3, 4)},
        "min": min(fin) if fin else None,
        "max": max(fin) if fin else None,
        "nonfinite": len(xs) - n,
    }


def write_file(path: Path, seed: int, steps: list[int]) -> dict[tuple[str, int], dict[str, list]]:
    """Lines of ``steps`` for each kind (every other line with its fields in another order and
    an extra field), appended to ``path``; returns (kind, step) -> name -> elements."""
    rng = random.Random(seed)
    data: dict[tuple[str, int], dict[str, list]] = {}
    with open(path, "a", encoding="utf-8") as f:
        for step in steps:
            for kind in KINDS:
                names = [n for n in NAMES if rng.random() < 0.85 or n == EMPTY]
                data[(kind, step)] = {n: elements(rng, n, step) for n in names}
                order = OTHER_ORDER if (step + len(kind)) % 2 else FIELDS
                tensors = {}
                for n, xs in data[(kind, step)].items():
                    m = moments(xs) | {"extra": 1.5}
                    if (kind, step, n) == OVERFLOWED:
                        m["m2"] = None
                    tensors[n] = [m[field] for field in order]
                line = {"version": 1, "step": step, "kind": kind, "time": 0.0}
                line |= {"fields": order, "tensors": tensors}
                f.write(json.dumps(line) + "\n")
    return data


class Run(dict):
    """(kind, step) -> name -> elements of the lines that win, and the run folder (``.path``)."""

    path: Path


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Run:
    """A run logged steps 0-11, resumed from step 6 with other values (steps 6-14): the later
    lines win. Chunks of 4 records: the repeated steps fall in later chunks than the first."""
    path = tmp_path / "tensor_stats.jsonl"
    data = Run(write_file(path, 0, list(range(12))))
    data |= write_file(path, 1, list(range(6, 15)))
    data.path = tmp_path
    monkeypatch.setattr(query_module, "CHUNK_RECORDS", 4)
    return data


def pooled(xs: list[float]) -> dict[str, float | None]:
    """Every statistic of ``query`` from the pooled elements, in float64 with correctly
    rounded sums (undefined: None)."""
    fin = [x for x in xs if math.isfinite(x)]
    n = len(fin)
    out: dict[str, float | None] = {"count": n, "nonfinite": len(xs) - n}
    if not n:
        return (
            out
            | dict.fromkeys(("mean", "var", "std", "l2", "rms", "min", "max"), None)
            | {"l2": 0.0}
        )
    mean = math.fsum(fin) / n
    m2, m3, m4 = (math.fsum((x - mean) ** k for x in fin) for k in (2, 3, 4))
    sumsq = math.fsum(x * x for x in fin)
    out |= {"mean": mean, "var": m2 / n, "std": math.sqrt(m2 / n), "l2": math.sqrt(sumsq)}
    out |= {"rms": math.sqrt(sumsq / n), "min": min(fin), "max": max(fin)}
    if m2 > 0:
        out |= {"skewness": math.sqrt(n) * m3 / m2**1.5, "kurtosis": n * m4 / m2**2}
        out["excess_kurtosis"] = out["kurtosis"] - 3.0  # type: ignore[operator]
    return out


def check(row: dict[str, Any], parts: list[list[float]], where: Any) -> None:
    xs = [x for p in parts for x in p]
    want = pooled(xs)
    scale = max((abs(x) for x in xs if math.isfinite(x)), default=1.0)
    for stat, got in row.items():
        if stat in ("step", "kind", "group", "tensors"):
            continue
        exp = want.get(stat)
        if exp is None:
            assert got is None, (where, stat, got)
            continue
        assert got is not None, (where, stat)
        # skewness and the mean may cancel to ~0: absolute against the data's scale
        tol = 1e-12 * (scale**2 if stat == "var" else 1.0 if "kurt" in stat else scale)
        assert math.isclose(got, exp, rel_tol=1e-12, abs_tol=tol), (where, stat, got, exp)
        if stat in ("count", "nonfinite"):
            assert type(got) is int and got == exp, (where, stat)
        if stat in ("min", "max"):
            assert got == exp, (where, stat)  # picked, not computed


def tainted(kind: str, step: int, names: list[str]) -> bool:
    """A group holding the tensor whose m2 is null: its M2-based statistics are undefined."""
    return (kind, step, OVERFLOWED[2]) == OVERFLOWED and OVERFLOWED[2] in names


M2_STATS = ("var", "std", "l2", "rms", "skewness", "kurtosis", "excess_kurtosis")


def expect_groups(
    data: dict, kind: str, label_of: Any, steps: range
) -> dict[tuple[int, str], list[str]]:
    out: dict[tuple[int, str], list[str]] = {}
    for step in steps:
        for name in data.get((kind, step), {}):
            label = label_of(name)
            if label is not None:
                out.setdefault((step, label), []).append(name)
    return out


CASES = [  # (query arguments, label of a name or None: left out)
    ({}, lambda n: "*"),
    ({"by": r"layers\.(\d+)\."}, lambda n: m.group(1) if (m := re.search(r"layers\.(\d+)\.", n)) else None),
    (
        {"group": "*.mlp.*", "by": r"^model\.layers\.(\d+)\.mlp|embed", "steps": "4:9"},
        lambda n: (m.group(1) if (m := re.search(r"^model\.layers\.(\d+)\.mlp", n)) else None)
        if ".mlp." in n
        else None,
    ),
    ({"group": "re:attn|embed", "steps": "10:"}, lambda n: "*" if re.search("attn|embed", n) else None),
    ({"per_tensor": True, "steps": ":5"}, lambda n: n),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("kind", KINDS)
def test_query_matches_float64_of_the_elements(run: Run, case: int, kind: str) -> None:
    args, label_of = CASES[case]
    first, last = query_module.parse_steps(args.get("steps"))
    steps = range(first or 0, (14 if last is None else last) + 1)
    rows = query(run.path, kind=kind, stat="all", **args)
    want = expect_groups(run, kind, label_of, steps)
    assert [(r["step"], r["group"]) for r in rows] == sorted(
        want, key=lambda k: (k[0], natural_key(k[1]), k[1])
    )
    for row in rows:
        names = want[(row["step"], row["group"])]
        assert row["tensors"] == len(names) and row["kind"] == kind
        if tainted(kind, row["step"], names):
            assert all(row[s] is None for s in M2_STATS), row
            row = {k: v for k, v in row.items() if k not in M2_STATS}
        check(row, [run[(kind, row["step"])][n] for n in names], (kind, args, row["step"]))


def test_report_charts_and_tables_match_float64_of_the_elements(run: Run) -> None:
    """The report's per-step numbers (all tensors, per layer) and its last step's tables."""
    kinds = {k: report_html._KindStats(k) for k in report_html.KINDS}
    for rec in read_tensor_stats(run.path):
        kinds[rec["kind"]].add(rec["step"], rec)
    for kind in KINDS:
        ks = kinds[kind]
        ks.flush()
        assert sorted(ks.merged) == list(range(15))
        for step in range(15):
            tensors = run[(kind, step)]
            got = ks.merged[step]
            want = pooled([x for xs in tensors.values() for x in xs])
            assert got["nonfinite"] == want["nonfinite"]
            assert got["abs_max"] == max(abs(want["min"]), abs(want["max"]))  # type: ignore[arg-type]
            if not tainted(kind, step, list(tensors)):
                for stat in ("rms", "kurtosis", "skewness"):
                    assert math.isclose(got[stat], want[stat], rel_tol=1e-12, abs_tol=1e-12)
            layers = expect_groups(
                run, kind, lambda n: m.group(1) if (m := re.search(r"\.(\d+)\.", n)) else None,
                range(step, step + 1),
            )  # fmt: skip
            assert set(ks.layers[step]) == {g for _, g in layers}
            for (_, g), names in layers.items():
                want = pooled([x for n in names for x in tensors[n]])
                if tainted(kind, step, names):
                    assert math.isnan(ks.layers[step][g]["rms"])
                    continue
                for stat in ("rms", "kurtosis"):
                    w = want.get(stat)
                    got_v = ks.layers[step][g][stat]
                    assert math.isnan(got_v) if w is None else math.isclose(got_v, w, rel_tol=1e-12)
            bad = {n: float(len(xs) - sum(map(math.isfinite, xs))) for n, xs in tensors.items()}
            assert ks.nonfinite.get(step, {}) == {n: c for n, c in bad.items() if c}
    page = render_report(run.path)
    for name, xs in run[("grad", 14)].items():  # the last step's table of each tensor
        cells = re.search(
            rf'<table class="tensors-each grad">.*?<td class=name>{re.escape(name)}</td>(.*?)</tr>',
            page,
        )
        assert cells is not None, name
        values = dict(re.findall(r'data-col="([^"]*)" data-value="([^"]*)"', cells.group(1)))
        want = pooled(xs)
        assert float(values["count"]) == want["count"]
        if want["count"]:
            assert math.isclose(float(values["rms"]), want["rms"], rel_tol=1e-12)  # type: ignore[arg-type]
            assert float(values["min"]) == want["min"]


def test_null_and_nan_moments_of_a_line(tmp_path: Path) -> None:
    """``null`` min/max (no finite element) are the identity of the merge; a NaN written in
    the file (Python's json reads it) stays NaN, as ``float()`` kept it: the group's min is
    undefined, its max not."""
    line = {
        "version": 1, "step": 3, "kind": "grad", "time": 0.0, "fields": FIELDS,
        "tensors": {
            "a": [2, 1.0, 2.0, 0.0, 2.0, 0.0, 2.0, 0],
            "b": [0, 0.0, 0.0, 0.0, 0.0, None, None, 4],
            "c": [1, 5.0, 0.0, 0.0, 0.0, None, 5.0, 0],
        },
    }  # fmt: skip
    (tmp_path / "tensor_stats.jsonl").write_text(json.dumps(line) + "\n")
    [ab] = query(tmp_path, kind="grad", stat="all", group="[ab]")
    assert (ab["min"], ab["max"], ab["count"], ab["nonfinite"], ab["tensors"]) == (
        0.0,
        2.0,
        2,
        4,
        2,
    )
    (tmp_path / "tensor_stats.jsonl").write_text(json.dumps(line).replace("null", "NaN", 1) + "\n")
    [ab] = query(tmp_path, kind="grad", stat="all", group="[ab]")
    assert ab["min"] is None and ab["max"] == 2.0  # (b's min NaN; its max null: identity)
    [c] = query(tmp_path, kind="grad", stat=["min", "max", "mean"], group="c")
    assert (c["min"], c["max"], c["mean"]) == (None, 5.0, 5.0)


def test_names_are_matched_once_per_list_not_once_per_line(tmp_path: Path) -> None:
    """A run writes the same tensors at every step: their names are matched (and labelled)
    once for all the lines of a merge, not once per line (4 lines of 3 tensors: 3 calls)."""
    records = {
        step: {"step": step, "kind": "grad", "fields": FIELDS,
               "tensors": {n: [1, float(step), 0.0, 0.0, 0.0, 1.0, 1.0, 0] for n in "xyz"}}
        for step in range(4)
    }  # fmt: skip
    calls: list[str] = []

    def match(name: str) -> bool:
        calls.append(name)
        return name != "y"

    rows = query_module.merge_records(records, "grad", ["mean", "count"], match, None, False)
    assert [(r["step"], r["mean"], r["count"], r["tensors"]) for r in rows] == [
        (s, float(s), 2, 2) for s in range(4)
    ]
    assert sorted(calls) == ["x", "y", "z"]


def test_report_merges_each_chunk_once(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """All tensors and each layer of a chunk of records in one combine_moments call (two
    before), and the same numbers as two merges of their own."""
    calls = []
    combine = query_module.combine_moments

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return combine(*args, **kwargs)

    monkeypatch.setattr(query_module, "combine_moments", counted)
    ks = report_html._KindStats("grad")
    records = [r for r in read_tensor_stats(run.path) if r["kind"] == "grad"]
    for rec in records:
        ks.add(rec["step"], rec)
    ks.flush()
    # 21 lines in file order, chunks of 4: 0-3, 4-7, 8-11, then the resumed 6-9, 10-13, 14
    assert len(calls) == 6
    latest = {r["step"]: r for r in records}
    everything = query_module.matcher(None)
    alone = query_module.merge_records(latest, "grad", ["rms"], everything, None, False)
    layers = query_module.merge_records(
        latest, "grad", ["rms", "kurtosis"], everything, report_html.LAYER_NUMBER, False
    )
    assert [repr(math.nan if r["rms"] is None else r["rms"]) for r in alone] == [
        repr(ks.merged[s]["rms"]) for s in range(15)
    ]
    for r in layers:
        got = ks.layers[r["step"]][r["group"]]
        for stat in ("rms", "kurtosis"):
            assert repr(got[stat]) == repr(math.nan if r[stat] is None else r[stat])


def test_layers_of_one_natural_key_in_one_order_whatever_the_hash_seed(tmp_path: Path) -> None:
    """Layer labels "01" and "1" sort alike by their numbers; the report gives them one order
    ("01" first) in every process, where it followed the string hashing of each (two reports
    of one run differed with PYTHONHASHSEED 0 and 3)."""
    line = {"version": 1, "step": 0, "kind": "grad", "time": 0.0, "fields": FIELDS,
            "tensors": {f"layers.{lab}.w": [2, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 0]
                        for lab in ("1", "01", "2")}}  # fmt: skip
    (tmp_path / "tensor_stats.jsonl").write_text(json.dumps(line) + "\n")
    code = (
        "import sys, re\nfrom trainvitals.report import render_report\n"
        "page = render_report(sys.argv[1])\n"
        'print(re.findall(r\'data-label="(layer [^"]*)"\', page))'
    )
    env = dict(os.environ)
    orders = set()
    for seed in ("0", "3", "5"):  # (3 and 5 put "1" first before)
        env["PYTHONHASHSEED"] = seed
        done = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        orders.add(done.stdout.strip())
    assert orders == {str(["layer 01", "layer 1", "layer 2"] * 2)}
