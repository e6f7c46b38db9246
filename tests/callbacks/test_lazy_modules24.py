"""A model with lazy modules (``nn.LazyLinear``: parameters without values until the first
forward). Before, NormMonitor's run start read their size (``numel()`` of an
``UninitializedParameter`` raises ``ValueError``), and the callback guard takes a ValueError at
run start for a configuration error: the user's run was stopped, strict mode or not. Now a lazy
parameter is left out until it materialises (the same object, filled in place by the first
forward) and then measured exactly; one that never materialises (an unused lazy module) is
left out without a word, by NormMonitor and by TensorStatsMonitor."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import NormMonitor, TensorStatsMonitor


class _Lazy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.LazyLinear(6)
        self.second = torch.nn.Linear(6, 1)
        self.unused = torch.nn.LazyLinear(3)  # never called: never materialised

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _norm64(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


@pytest.mark.parametrize("strict", ["1", "0"])
def test_lazy_parameters_join_the_norms_and_tensor_stats_when_materialised(
    tmp_path, monkeypatch, strict
):
    monkeypatch.setenv("TRAINVITALS_STRICT", strict)
    torch.manual_seed(0)
    model = _Lazy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    monitors = [
        NormMonitor(per_param="*"),
        TensorStatsMonitor(kinds=["param", "grad"], kernel="eager"),
    ]
    measured = ("first.weight", "first.bias", "second.weight", "second.bias")
    seen: list[dict[str, dict[str, torch.Tensor]]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals(monitors, writer=writer, run_dir=tmp_path, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            for _ in range(2):
                x = torch.randn(5, 4)
                vitals.batch(x)
                model(x).pow(2).sum().backward()
                named = dict(model.named_parameters())
                seen.append(
                    {
                        "param": {n: named[n].detach().clone() for n in measured},
                        "grad": {n: named[n].grad.detach().clone() for n in measured},
                    }
                )
                opt.step()
                opt.zero_grad()
    messages = [
        str(w.message)
        for w in caught
        if "trainvitals" in str(w.filename) or "Monitor" in str(w.message)
    ]
    assert not messages, messages
    lines = [
        json.loads(line) for line in (tmp_path / "tensor_stats.jsonl").read_text().splitlines()
    ]
    for step, tensors in enumerate(seen):
        row = writer.rows[step]
        for kind in ("param", "grad"):
            # (tensors under 8192 elements are normed in float32: docs/norms.md, below 5e-7)
            assert row[f"l2_norm/{kind}/global"] == pytest.approx(
                _norm64(tensors[kind].values()), rel=1e-6
            )
        for name in measured:
            assert row[f"l2_norm/grad/{name}"] == pytest.approx(
                _norm64([tensors["grad"][name]]), rel=1e-6
            )
        assert not [k for k in row if "unused" in k]
        by_kind = {rec["kind"]: rec for rec in lines if rec["step"] == step}
        for kind in ("param", "grad"):
            assert set(by_kind[kind]["tensors"]) == set(measured)
            for name in measured:
                values = tensors[kind][name].double().reshape(-1)
                count, mean = by_kind[kind]["tensors"][name][:2]
                assert count == values.numel()
                assert mean == pytest.approx(float(values.mean()), rel=1e-5, abs=1e-7)
