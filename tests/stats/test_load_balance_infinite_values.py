"""Quantiles and across-layer aggregates of values that can be infinite (the aux loss of a
diverged router): equal order statistics give their value, as ``np.median`` does, not
``inf + (inf - inf) * 0 = NaN``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from tests.callbacks.test_load_balance_monitor import AuxGate, _aux_gate_output
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor
from trainvitals.stats.load_balance import (
    aggregate_across_layers,
    aggregate_across_layers_host,
    aggregate_across_layers_lists,
    nanquantile,
    nanquantile_host,
)

INF = math.inf
CASES = [
    [INF],
    [INF, INF],
    [1.0, INF, INF],
    [1.0, 2.0, INF],
    [2.0, INF, 1.0, INF, 3.0],
    [1.5, 0.5, 2.0],
]


def _expected(values: list[float]) -> list[float]:
    """Independent: mean, numpy median (which handles inf), min, max."""
    v = np.asarray(values, dtype=np.float64)
    return [float(np.mean(v)), float(np.median(v)), float(v.min()), float(v.max())]


@pytest.mark.parametrize("values", CASES)
def test_aggregates_of_infinite_values_match_numpy_median(values: list[float]) -> None:
    expected = _expected(values)
    padded = [*values, math.nan]  # a layer with no value is left out
    got_lists = aggregate_across_layers_lists(padded)
    got_device = aggregate_across_layers(torch.tensor([padded], dtype=torch.float64))[0].tolist()
    got_host = aggregate_across_layers_host(np.array([padded]))[0].tolist()
    # numpy path above the small-input size: many rows of the same values
    got_big = aggregate_across_layers_host(np.array([padded] * 600))
    for got in (got_lists, got_device, got_host, *got_big.tolist()):
        np.testing.assert_array_equal(got, expected, err_msg=str(values))


def test_quantiles_with_equal_infinite_neighbours() -> None:
    # sorted [1, 2, inf, inf, inf]: positions 0, 1, 2, 3, 4 (exact) and 0.5, 3.5 between
    x = [INF, 1.0, INF, 2.0, INF, math.nan]
    qs = [0.0, 0.125, 0.25, 0.5, 0.75, 0.875, 1.0]
    expected = [1.0, 1.5, 2.0, INF, INF, INF, INF]
    np.testing.assert_array_equal(nanquantile(torch.tensor([x]), qs)[0].tolist(), expected)
    np.testing.assert_array_equal(nanquantile_host(np.array([x]), qs)[0].tolist(), expected)


def test_monitor_writes_infinite_aux_median_not_nan() -> None:
    """One layer whose aux loss overflowed to inf and one finite, one without aux loss: the
    moe/aux_loss_* aggregates are numpy's over the layers that report one."""
    aux_per_layer = [[INF, None, 1.25], [INF, INF, 1.5]]  # two steps, three layers
    model = nn.Module()
    model.layers = nn.ModuleList([nn.ModuleDict({"gate": AuxGate()}) for _ in range(3)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", extractors=[(AuxGate, _aux_gate_output)])
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    for per_layer in aux_per_layer:
        vitals.batch()
        loss = torch.zeros(())
        for block, value in zip(model.layers, per_layer, strict=True):
            gate = block["gate"]
            gate.counts = torch.tensor([1.0, 2.0, 3.0, 4.0])
            gate.aux = None if value is None else torch.tensor(value, dtype=torch.float64)
            loss = loss + gate(torch.randn(3, 2)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    for step, per_layer in enumerate(aux_per_layer):
        row = writer.rows[step]
        known = [v for v in per_layer if v is not None]
        expected = dict(zip(("mean", "median", "min", "max"), _expected(known), strict=True))
        for agg, value in expected.items():
            assert row[f"moe/aux_loss_{agg}"] == value, (step, agg, row[f"moe/aux_loss_{agg}"])
        assert row["moe/layer_0/aux_loss"] == INF
