"""A trainable parameter left on the meta device (deferred initialisation never materialised,
unused in the forward) has no values: NormMonitor and TensorStatsMonitor leave it out with one
warning and measure the rest exactly. Before, reading it (``.item()`` of a meta tensor) failed
their hook and disabled them for the run: no norms and no tensor statistics at all."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import NormMonitor, TensorStatsMonitor


class _WithLazyWeight(torch.nn.Module):
    def __init__(self, lazy_first: bool) -> None:
        super().__init__()
        if lazy_first:
            self.lazy = torch.nn.Parameter(torch.empty(3, device="meta"))
        self.lin = torch.nn.Linear(4, 2)
        if not lazy_first:
            self.lazy = torch.nn.Parameter(torch.empty(3, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _norm64(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


@pytest.mark.parametrize("lazy_first", [True, False])
def test_meta_parameters_are_left_out_of_norms_and_tensor_stats(tmp_path, lazy_first):
    torch.manual_seed(0)
    model = _WithLazyWeight(lazy_first)
    opt = torch.optim.SGD(model.lin.parameters(), lr=0.1)
    writer = RecordingWriter()
    monitors = [NormMonitor(), TensorStatsMonitor(kinds=["param", "grad"], kernel="eager")]
    seen = {}
    vitals = Vitals(monitors, writer=writer, run_dir=tmp_path, log_every_n_steps=1)
    with pytest.warns(RuntimeWarning, match="meta device") as record, vitals:
        vitals.attach(model, opt)
        x = torch.randn(5, 4)
        vitals.batch(x)
        model(x).pow(2).sum().backward()
        seen["param"] = [p.detach().clone() for p in model.lin.parameters()]
        seen["grad"] = [p.grad.detach().clone() for p in model.lin.parameters()]
        opt.step()
        opt.zero_grad()
    assert not [w for w in record if "disabled" in str(w.message)]
    row = writer.rows[0]
    # (tensors under 8192 elements are normed in float32: docs/norms.md, below 5e-7)
    assert row["l2_norm/param/global"] == pytest.approx(_norm64(seen["param"]), rel=1e-6)
    assert row["l2_norm/grad/global"] == pytest.approx(_norm64(seen["grad"]), rel=1e-6)
    lines = [
        json.loads(line) for line in (tmp_path / "tensor_stats.jsonl").read_text().splitlines()
    ]
    by_kind = {rec["kind"]: rec for rec in lines if rec["step"] == 0}
    for kind in ("param", "grad"):
        assert set(by_kind[kind]["tensors"]) == {"lin.weight", "lin.bias"}
        weight = seen[kind][0].double().reshape(-1)
        count, mean = by_kind[kind]["tensors"]["lin.weight"][:2]
        assert count == weight.numel()
        assert mean == pytest.approx(float(weight.mean()), rel=1e-6)
