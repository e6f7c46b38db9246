"""Session 19 audit of ``trainvitals report`` / ``query``: the report's ``--steps`` passes over
the ``tensor_stats.jsonl`` lines of other steps unparsed (as ``query`` does) and shows the
numbers of the raw tensors; the CLI runs its merges on one torch thread (its caller's count
left as it was); every area's section has an ``id`` of its own (names in any script)."""

from __future__ import annotations

import html
import importlib
import json
import math
import re
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainvitals.cli import main
from trainvitals.report import render_report
from trainvitals.stats.moments import FIELDS, fused_moments, moments_to_rows

query_module = importlib.import_module("trainvitals.report.query")

NAMES = [f"model.layers.{i}.mlp.w{j}.weight" for i in range(3) for j in range(2)]
KINDS = ("param", "grad", "activation", "dgrad")


def tensors_at(step: int, kind: str, seed: int) -> list[np.ndarray]:
    """The float64 tensors of a step and kind (``seed``: a resumed run logs other values)."""
    rng = np.random.default_rng([step, KINDS.index(kind), seed])
    return [rng.normal(k, 1 + k, size=40 + 8 * k) for k in range(len(NAMES))]


def write_stats(path: Path, logged: list[tuple[int, int]]) -> dict[tuple[int, str], list]:
    """``tensor_stats.jsonl`` as ``TensorStatsMonitor`` writes it (compact, ``micro_batches``
    for the activation kinds) for the ``(step, seed)`` of ``logged`` in file order, every
    kind; returns the tensors of each (step, kind) a reader must show (the last line wins)."""
    shown: dict[tuple[int, str], list] = {}
    lines = []
    for step, seed in logged:
        for kind in KINDS:
            arrays = tensors_at(step, kind, seed)
            rows = moments_to_rows(fused_moments([torch.from_numpy(a) for a in arrays]))
            rec: dict[str, Any] = {"version": 1, "step": step, "kind": kind, "time": 1e9 + step}
            rec.update(fields=list(FIELDS), tensors=dict(zip(NAMES, rows, strict=True)))
            if kind in ("activation", "dgrad"):
                rec["micro_batches"] = 1
            lines.append(json.dumps(rec, separators=(",", ":")))
            shown[(step, kind)] = arrays
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return shown


def pooled(arrays: list[np.ndarray]) -> dict[str, float]:
    """Statistics of the elements of ``arrays`` pooled, in float64 from the raw values."""
    x = np.concatenate(arrays)
    d = x - x.mean()
    m2 = float(np.mean(d**2))
    return {
        "count": float(x.size),
        "mean": float(x.mean()),
        "std": math.sqrt(m2),
        "rms": math.sqrt(float(np.mean(x**2))),
        "skewness": float(np.mean(d**3)) / m2**1.5,
        "kurtosis": float(np.mean(d**4)) / m2**2,
        "min": float(x.min()),
        "max": float(x.max()),
    }


def test_report_steps_parses_only_the_lines_of_its_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``render_report(steps=...)`` read every line of ``tensor_stats.jsonl`` with
    ``json.loads`` (all 40 here), where ``trainvitals query --steps`` passes over those of
    other steps: now only the lines of the steps asked are parsed, and the tables show the
    statistics of the raw tensors of the last step asked (a resumed run's later line)."""
    # steps 0..8 by 2, then a resume at 4 logging 4..12 with other values: 10 x 4 kinds lines
    logged = [(s, 0) for s in range(0, 10, 2)] + [(s, 1) for s in (4, 6, 8, 10, 12)]
    shown = write_stats(tmp_path / "tensor_stats.jsonl", logged)
    parsed: list[bytes] = []

    def loads(raw: bytes) -> Any:
        parsed.append(raw)
        return json.loads(raw)

    monkeypatch.setattr(query_module, "json", types.SimpleNamespace(loads=loads))
    page = render_report(tmp_path, steps="4:6")
    in_steps = [(s, k) for s, _ in logged if 4 <= s <= 6 for k in KINDS]
    assert sorted((r["step"], r["kind"]) for r in map(json.loads, parsed)) == sorted(in_steps)
    assert f"tensor_stats.jsonl ({len(in_steps)} lines in the steps shown)" in page
    for kind in KINDS:
        section = re.search(rf'<section id="t-{kind}".*?</section>', page, re.S)
        assert section is not None
        row = re.search(r"<tr><td class=name>all</td>(.*?)</tr>", section.group(0))
        assert row is not None
        got = dict(re.findall(r'data-col="([^"]*)" data-value="([^"]*)"', row.group(1)))
        for stat, want in pooled(shown[(6, kind)]).items():
            assert float(got[stat]) == pytest.approx(want, rel=1e-12, abs=1e-12), (kind, stat)
        assert f"{kind} <small>2 steps," in section.group(0)


def test_cli_runs_on_one_torch_thread_and_restores_the_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI's merges ran on torch's default thread count (the cores): on a busy 2-core
    host a merge of 25,600 rows took 43 ms with 2 threads against 1.1 ms with 1. ``main`` now
    runs a command on one thread and gives its caller back its own count; a set
    ``OMP_NUM_THREADS`` is the user's choice and is kept."""
    write_stats(tmp_path / "tensor_stats.jsonl", [(0, 0), (1, 0)])
    seen: list[int] = []
    combine = query_module.combine_moments

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return combine(*args, **kwargs)

    monkeypatch.setattr(query_module, "combine_moments", recording)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = tmp_path / "rows.csv"
        assert main(["query", str(tmp_path), "--stat", "mean", "-o", str(out)]) == 0
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2  # (the caller's count, as it was)
        assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 0
        assert set(seen) == {1}
        assert torch.get_num_threads() == 2
        seen.clear()
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert main(["query", str(tmp_path), "--stat", "mean", "-o", str(out)]) == 0
        assert seen and set(seen) == {2}
    finally:
        torch.set_num_threads(before)


def test_every_area_has_its_own_section_id(tmp_path: Path) -> None:
    """An area's ``id`` kept ASCII letters and digits only: ``α/x`` and ``β/x`` were both
    ``m--``, ``a b`` and ``a-b`` both ``m-a-b``, and the link of the second area led to the
    first's section."""
    areas = ["α", "β", "損失", "a b", "a-b", "a-b-2", "train"]
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "time": 1.0, "metrics": {f"{a}/x": 1.0 for a in areas}}) + "\n",
        encoding="utf-8",
    )
    page = render_report(tmp_path)
    ids = re.findall(r'<section id="([^"]*)" class="area" data-area="([^"]*)"', page)
    assert sorted(html.unescape(a) for _, a in ids) == sorted(areas)
    assert len({i for i, _ in ids}) == len(ids), ids
    links = dict(re.findall(r'<a href="#(m-[^"]*)">([^<]*)</a>', page))
    assert {html.unescape(links[i]) for i, _ in ids} == set(areas)
    for i, area in ids:  # each link leads to its own area's section
        assert links[i] == area
