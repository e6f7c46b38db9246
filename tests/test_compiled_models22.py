"""Callbacks on ``torch.compile``'d models: compilations stay bounded, the compiled graph is
kept on steps that do not log, and the numbers equal an uncompiled float64 reference.

Compilations and compiled calls are counted with a counting backend (deterministic, no
inductor): each compiled graph is one call of the backend, each run of one a call of what it
returns.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.compiled_models import ResidualBlock
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor, ThroughputMonitor
from trainvitals.stats.moments import FIELDS


class CountingBackend:
    def __init__(self) -> None:
        self.compiles = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.compiles += 1
        forward = gm.forward

        def run(*args: object) -> object:
            self.calls += 1
            return forward(*args)

        return run


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ResidualBlock(), ResidualBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def _compiled(model: nn.Module, how: str, backend: CountingBackend) -> nn.Module:
    if how == "whole":
        return torch.compile(model, backend=backend)
    for block in model.layers:  # torchtitan style: each transformer block
        block.compile(backend=backend)
    return model


def _inputs(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(6, 8, generator=gen) for _ in range(n)]


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("how", ["whole", "block"])
def test_flop_measurement_leaves_the_model_compiled(how: str) -> None:
    # The first step ran under FlopCounterMode, a dispatch mode under which Dynamo skips a
    # frame and marks its code to be skipped for good: the compiled model ran eagerly for
    # the whole run (0 compiled calls on every step). Now torch.compile is off for that step
    # only (force_eager stance), and every later step runs the compiled graph.
    torch.manual_seed(0)
    model = TwoBlocks()
    backend = CountingBackend()
    run = _compiled(model, how, backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = ThroughputMonitor(measure_flops=True, window_size=2)
    calls = []
    with Vitals([monitor], writer=RecordingWriter(), log_every_n_steps=1) as vitals:
        vitals.attach(run, opt)
        for x in _inputs(5):
            before = backend.calls
            vitals.batch(x)
            run(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            calls.append(backend.calls - before)
    graphs = 1 if how == "whole" else 2  # compiled graphs run per forward
    assert calls == [0] + [graphs] * 4, calls
    assert backend.compiles == graphs
    # the count of the measured (eager) step, independently: per Linear [m, k] -> [m, n],
    # forward 2mkn, weight gradient 2mkn, input gradient 2mkn (x itself needs none)
    m = 6
    linear = [(8, 16), (16, 8)] * 2
    want = sum(6 * m * k * n for k, n in linear) - 2 * m * 8 * 16
    assert monitor._measured == ("samples", want / m)


def _reference_sites(model: nn.Module, x: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """Every site's activation and dgrad of one micro-batch, uncompiled, in float64."""
    ref = copy.deepcopy(model).double()
    seen: dict[str, torch.Tensor] = {}
    h = x.double()
    for i, block in enumerate(ref.layers):
        a = block.fc1(h)
        r = torch.relu(a)
        b = block.fc2(r)
        seen |= {
            f"layers.{i}.fc1/input0": h,
            f"layers.{i}.fc1/output0": a,
            f"layers.{i}.fc2/input0": r,
            f"layers.{i}.fc2/output0": b,
        }
        h = h + b
    wrt = {s: t for s, t in seen.items() if t.requires_grad}  # (the input x needs none)
    grads = torch.autograd.grad(h.pow(2).mean(), list(wrt.values()))
    return {
        "activation": {s: t.detach().reshape(-1) for s, t in seen.items()},
        "dgrad": {s: g.reshape(-1) for s, g in zip(wrt, grads, strict=True)},
    }


def _moments64(t: torch.Tensor) -> list[float]:
    mean = t.mean()
    d = t - mean
    return [t.numel(), mean, *(d.pow(p).sum() for p in (2, 3, 4)), t.min(), t.max()]


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("how", ["whole", "block"])
def test_activation_sites_of_a_model_compiled_at_a_step_that_does_not_log(
    tmp_path: Path, how: str
) -> None:
    # A run resumed at step 1 (or any run whose first compiled forward does not log): the
    # model was compiled without the monitor's forward hooks, and Dynamo does not guard on
    # hooks, so the hooks added at the logging steps were never called: every activation and
    # dgrad record was empty (whole model) or held only the sites outside the compiled
    # blocks (none here). A compiled model now has its hooks from run start, gated by a host
    # flag: every site is measured, exactly, with no compilation after the first step.
    torch.manual_seed(0)
    model = TwoBlocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs = _inputs(12)
    with Vitals([], writer=RecordingWriter()) as first:  # step 0, uncompiled, then resumed
        first.attach(model, opt)
        first.batch(xs[0])
        model(xs[0]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        state = first.state_dict()
    backend = CountingBackend()
    run = _compiled(model, how, backend)
    monitor = TensorStatsMonitor(kinds=("activation", "dgrad"), kernel="eager")
    want: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    compiles = []
    with Vitals([monitor], writer=RecordingWriter(), run_dir=tmp_path, log_every_n_steps=3) as v:
        v.attach(run, opt)
        with pytest.warns(UserWarning, match="no state for TensorStatsMonitor"):
            v.load_state_dict(state)
        for step in range(1, 12):
            before = backend.compiles
            x = xs[step]
            if step % 3 == 0:
                want[step] = _reference_sites(model, x)
            v.batch(x)
            run(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            compiles.append(backend.compiles - before)
    # compiled once, at the first step (graphs split at the hooks), never again
    assert compiles[0] > 0 and compiles[1:] == [0] * 10, compiles
    lines = [json.loads(s) for s in (tmp_path / "tensor_stats.jsonl").read_text().splitlines()]
    assert [(r["step"], r["kind"]) for r in lines] == [
        (s, k) for s in (3, 6, 9) for k in ("activation", "dgrad")
    ]
    for r in lines:
        expected = want[r["step"]][r["kind"]]
        assert sorted(r["tensors"]) == sorted(expected), (r["step"], r["kind"])
        for site, t in expected.items():
            got = r["tensors"][site]
            assert len(got) == len(FIELDS)
            ref = [float(v) for v in _moments64(t)]
            assert got[0] == ref[0] and got[7] == 0, site
            torch.testing.assert_close(
                torch.tensor(got[1:7], dtype=torch.float64),
                torch.tensor(ref[1:], dtype=torch.float64),
                rtol=1e-5,
                atol=1e-9,
                msg=f"{r['kind']} {site} at step {r['step']}",
            )
