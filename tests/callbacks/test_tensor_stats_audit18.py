"""TensorStatsMonitor, audit 18: a parameter fed to a site, and an instance reused for a new run.

Values are checked against float64 statistics of the tensors the test captures itself.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from tests.scripts.vitals_testing import RecordingWriter
from tests.stats.test_moments import assert_matches, reference
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor
from trainvitals.stats.moments import FIELDS, derive, moments_from_dicts


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check(line: dict, want: dict[str, torch.Tensor]) -> None:
    """Each named tensor of ``want`` is in ``line``, with every statistic of its float64 values."""
    names = sorted(want)
    assert set(names) <= set(line["tensors"]), (sorted(line["tensors"]), names)
    rows = [dict(zip(FIELDS, line["tensors"][n], strict=True)) for n in names]
    got = derive(moments_from_dicts(rows))
    for i, n in enumerate(names):
        assert_matches(got, i, reference(want[n]), f"{line['kind']} {line['step']} {n}")


class LatentQueries(nn.Module):
    """A Perceiver-style block: learned latents (a parameter) are the input of ``q_proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(6, 8))
        self.q_proj = nn.Linear(8, 8)
        self.k_proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(self.latents)
        return (q @ self.k_proj(x).T).softmax(-1).sum(0)


def test_a_parameter_fed_to_a_site_is_measured_at_every_logging_step(tmp_path: Path) -> None:
    # The hooks keep their tensors for a batched reduction at step end, which came after the
    # optimizer's step: the latents, changed in place by it, looked modified since their hook,
    # and q_proj/input0 was left out of the first logging step with a warning about an
    # in-place change the model never made.
    torch.manual_seed(0)
    model = LatentQueries()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    monitor = TensorStatsMonitor(kinds=["activation"], kernel="eager")
    latents: dict[int, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "modified in place" warning
        with Vitals(
            [monitor], writer=RecordingWriter(), run_dir=tmp_path, log_every_n_steps=1
        ) as v:
            v.attach(model, opt)
            g = torch.Generator().manual_seed(1)
            for step in range(2):
                latents[step] = model.latents.detach().double().clone()
                x = torch.randn(5, 8, generator=g)
                v.batch(x)
                model(x).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
    lines = _lines(tmp_path / "tensor_stats.jsonl")
    assert [(r["step"], r["kind"]) for r in lines] == [(0, "activation"), (1, "activation")]
    assert not torch.equal(latents[0], latents[1])  # the optimizer did change them
    for r in lines:
        _check(r, {"q_proj/input0": latents[r["step"]]})


class Distill(nn.Module):
    """A frozen teacher run under no_grad and a student trained against it."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Linear(4, 4).requires_grad_(False)
        self.student = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(x)
        return (self.student(x) - target).pow(2).sum()


def _one_step(
    run_dir: Path, monitor: TensorStatsMonitor, model: nn.Module, x: torch.Tensor
) -> None:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with Vitals([monitor], writer=RecordingWriter(), run_dir=run_dir, log_every_n_steps=1) as v:
        v.attach(model, opt)
        v.batch(x)
        model(x).sum().backward()
        opt.step()


def test_an_instance_reused_for_another_model_measures_that_models_sites(tmp_path: Path) -> None:
    # What the monitor learns about sites is kept by site index. Reused for a second run (the
    # base class warns, and runs on), it read the first model's as the second's: site 0 had
    # trained with autograd on there, so the teacher's no_grad forward (site 0 here) was taken
    # for a generation pass and left out of the file, silently.
    monitor = TensorStatsMonitor(kinds=["activation"], kernel="eager")
    torch.manual_seed(0)
    _one_step(
        tmp_path / "a", monitor, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.randn(3, 4)
    )
    model = Distill()
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = {
            "teacher/input0": x.double(),
            "teacher/output0": model.teacher(x).double(),
            "student/input0": x.double(),
            "student/output0": model.student(x).double(),
        }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*this instance already ran", RuntimeWarning)
        _one_step(tmp_path / "b", monitor, model, x)
    [line] = _lines(tmp_path / "b" / "tensor_stats.jsonl")
    assert sorted(line["tensors"]) == sorted(want)
    _check(line, want)
