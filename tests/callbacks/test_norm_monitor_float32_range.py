"""NormMonitor and local_sq_norms on CPU for tensors whose float32 squares leave float32's
range: exploding (finite) gradients are not non-finite, vanishing ones do not read 0.

torch's own norms (``clip_grad_norm_``, ``get_total_norm``) read ``inf`` for a float32 tensor
whose sum of squares passes ~3.4e38 and 0 for one whose elements are below ~1e-23; the
references here are float64 sums.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.norm_monitor import NormMonitor
from trainvitals.stats.norms import local_sq_norms


def _sq64(t: torch.Tensor) -> float:
    return float(t.double().square().sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e18, 1e30, 1e-21, 1e-30])
def test_sums_of_squares_outside_float32_range_equal_float64(dtype, scale):
    g = torch.Generator().manual_seed(0)
    shapes = [(100,), (20000,), (96, 128), (3, 5000)]  # small, rows + tail, whole rows, strided
    tensors = [torch.randn(s, generator=g) * scale for s in shapes]
    tensors[3] = tensors[3].t()  # not contiguous
    tensors = [t.to(dtype) for t in tensors]
    refs = [_sq64(t) for t in tensors]
    got = local_sq_norms(tensors).tolist()
    for value, ref in zip(got, refs, strict=True):
        assert math.isfinite(value) and ref > 0
        assert value == pytest.approx(ref, rel=1e-6, abs=0)


def test_infinite_nan_and_zero_tensors_keep_their_values():
    big = torch.full((20000,), 1e20)
    inf = big.clone()
    inf[7] = math.inf
    nan = big.clone()
    nan[3] = math.nan
    zero = torch.zeros(20000)
    tiny_small = torch.full((10,), 1e-25)
    got = local_sq_norms([big, inf, nan, zero, tiny_small]).tolist()
    assert got[0] == pytest.approx(_sq64(big), rel=1e-9)
    assert got[1] == math.inf
    assert math.isnan(got[2])
    assert got[3] == 0.0
    assert got[4] == pytest.approx(_sq64(tiny_small), rel=1e-9, abs=0)


def _run(fill: float, extra: float | None = None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = RecordingWriter()
    monitor = NormMonitor(per_param="*.weight")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([monitor], writer=writer, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            vitals.batch(torch.zeros(2, 128))
            model(torch.randn(2, 128)).sum().backward()
            for p in model.parameters():
                p.grad.fill_(fill)
            if extra is not None:
                model[1].bias.grad[0] = extra
            ref = math.sqrt(sum(_sq64(p.grad) for p in model.parameters()))
            per = {"0.weight": math.sqrt(_sq64(model[0].weight.grad))}
            opt.step()
            opt.zero_grad()
    messages = [str(w.message) for w in caught if "NaN/Inf" in str(w.message)]
    return writer.steps[0], monitor, ref, per, messages


def test_exploding_finite_gradients_are_not_counted_as_nonfinite():
    # 1e18 in each of the 16384 elements of 0.weight: a float32 sum of squares overflows
    # (1.6e40), the gradient is finite
    row, monitor, ref, per, messages = _run(1e18)
    assert row["l2_norm/grad/nonfinite_count"] == 0
    assert row["l2_norm/grad/global"] == pytest.approx(ref, rel=1e-7, abs=0)
    assert row["l2_norm/grad/0.weight"] == pytest.approx(per["0.weight"], rel=1e-7, abs=0)
    assert messages == []
    assert monitor.first_nonfinite_step is None


def test_a_real_inf_next_to_exploding_gradients_is_counted_alone():
    row, monitor, _, _, messages = _run(1e18, extra=math.inf)
    assert row["l2_norm/grad/nonfinite_count"] == 1
    assert row["l2_norm/grad/global"] == math.inf
    assert len(messages) == 1 and ": 1.bias (parameter order)" in messages[0]
    assert monitor.first_nonfinite_names == ["1.bias"]


def test_vanishing_gradients_do_not_read_zero():
    # 1e-24: squares of 1e-48 are below float32's smallest subnormal (1.4e-45)
    row, _, ref, per, _ = _run(1e-24)
    assert ref > 0
    assert row["l2_norm/grad/global"] == pytest.approx(ref, rel=1e-7, abs=0)
    assert row["l2_norm/grad/0.weight"] == pytest.approx(per["0.weight"], rel=1e-7, abs=0)
    assert row["l2_norm/grad/nonfinite_count"] == 0
