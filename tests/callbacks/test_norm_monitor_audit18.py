"""NormMonitor audit (session 18): the cost of the per-tensor sums of squares.

- On an accelerator the sums come from ``torch._foreach_norm``, whose fused kernel only takes a
  list of tensors of one dtype, all dense; any other list falls back to one norm per tensor (a
  launch per parameter at every logging step). A model mixing dtypes (bf16 weights, float32
  norms or router) must be measured with one call per dtype. There is no GPU here: the
  accelerator path runs on ``meta`` tensors (the calls only), and on CPU tensors with the
  CPU row kernel switched off (the calls and the numbers, against float64).
- On CPU a low-precision tensor is converted to float32 to be normed; the tail of its rows
  must not keep that whole copy alive until every tensor is measured.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.norm_monitor import NormMonitor
from trainvitals.stats import norms as norms_module
from trainvitals.stats.norms import local_sq_norms


def _spy_foreach_norm(monkeypatch: pytest.MonkeyPatch) -> list[list[torch.Tensor]]:
    calls: list[list[torch.Tensor]] = []
    original = torch._foreach_norm

    def spy(tensors, *args, **kwargs):
        calls.append(list(tensors))
        return original(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", spy)
    return calls


def _fused_kernel_takes(call: list[torch.Tensor]) -> bool:
    """CUDA's ``_foreach_norm`` fast path requires one dtype and one device, every tensor
    dense (contiguous ones are): a list of contiguous tensors of one dtype qualifies, and a
    non-contiguous tensor (perhaps not dense) must not be in a list with contiguous ones,
    which it would take to the slow path with it."""
    first = call[0]
    return all(
        t.dtype == first.dtype
        and t.device == first.device
        and t.is_contiguous() == first.is_contiguous()
        for t in call
    )


def test_meta_tensors_of_several_dtypes_take_one_foreach_call_per_dtype(monkeypatch):
    calls = _spy_foreach_norm(monkeypatch)
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, torch.float32]
    tensors = [torch.empty(64, 32, device="meta", dtype=d) for d in dtypes]
    out = local_sq_norms(tensors)
    assert out.shape == (5,) and out.dtype == torch.float64
    assert all(_fused_kernel_takes(c) for c in calls), [[t.dtype for t in c] for c in calls]
    assert sorted(len(c) for c in calls) == [1, 2, 2]  # bf16 x2, float32 x2, float16


def test_accelerator_path_groups_by_dtype_and_keeps_every_value_in_place(monkeypatch):
    # the accelerator path (``_foreach_norm``, float64 output) on CPU tensors
    monkeypatch.setattr(norms_module, "_row_kernel", lambda device: False)
    calls = _spy_foreach_norm(monkeypatch)
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(40, 30, generator=g).to(torch.bfloat16),
        torch.randn(17, generator=g),
        None,  # a parameter without a gradient
        torch.randn(0, 4),  # a zero-size parameter
        torch.randn(30, 20, generator=g).t(),  # float32, not contiguous
        torch.randn(5, 5, generator=g).to(torch.float16),
        torch.randn(9, generator=g, dtype=torch.float64),
        torch.randn(3, 3, generator=g) * 1e20,  # float32 squares overflow: float64 output
        torch.randn(7, generator=g).to(torch.bfloat16),
    ]
    got = local_sq_norms(tensors).tolist()
    expected = [0.0 if t is None else float(t.double().square().sum()) for t in tensors]
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a == pytest.approx(b, rel=1e-12, abs=0.0), i
    assert all(_fused_kernel_takes(c) for c in calls), [[t.dtype for t in c] for c in calls]
    # bf16, float32 (contiguous), float32 (transposed), float16, float64
    assert len(calls) == 5


class _MixedPrecisionNet(nn.Module):
    """bf16 linear layers around a float32 LayerNorm and a float32 router (the parameters some
    models keep in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16).to(torch.bfloat16)
        self.norm = nn.LayerNorm(16)
        self.router = nn.Linear(16, 4)
        self.down = nn.Linear(16, 8).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.up(x.to(torch.bfloat16)).float())
        return self.down(h.to(torch.bfloat16)).float().sum() + self.router(h).square().mean()


def test_monitor_on_a_mixed_dtype_model_measures_each_dtype_in_one_call(monkeypatch):
    monkeypatch.setattr(norms_module, "_row_kernel", lambda device: False)
    torch.manual_seed(0)
    model = _MixedPrecisionNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = RecordingWriter()
    with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        vitals.batch(torch.zeros(4, 8))
        model(torch.randn(4, 8)).backward()
        params = [p.detach().double() for p in model.parameters()]
        grads = [p.grad.double() for p in model.parameters()]
        calls = _spy_foreach_norm(monkeypatch)
        opt.step()
        monkeypatch.undo()
        opt.zero_grad()
    row = writer.steps[0]
    expected_param = math.sqrt(sum(float(p.square().sum()) for p in params))
    expected_grad = math.sqrt(sum(float(g.square().sum()) for g in grads))
    assert row["l2_norm/param/global"] == pytest.approx(expected_param, rel=1e-12)
    assert row["l2_norm/grad/global"] == pytest.approx(expected_grad, rel=1e-12)
    # parameters and gradients, each in bf16 or float32: one call per dtype
    assert sorted(len(c) for c in calls) == [8, 8]
    assert all(_fused_kernel_takes(c) for c in calls), [[t.dtype for t in c] for c in calls]


def test_cpu_tails_of_converted_tensors_do_not_keep_the_whole_copy(monkeypatch):
    calls = _spy_foreach_norm(monkeypatch)
    g = torch.Generator().manual_seed(0)
    # 1000 x 1001 elements: 977 rows of 1024 and a tail of 552, in bf16 (converted to float32)
    # and as a non-contiguous float32 tensor (copied by reshape)
    tensors = [
        torch.randn(1000, 1001, generator=g).to(torch.bfloat16),
        torch.randn(1000, 1001, generator=g).to(torch.float16),
        torch.randn(1001, 1000, generator=g).t(),
    ]
    got = local_sq_norms(tensors).tolist()
    for a, t in zip(got, tensors, strict=True):
        assert a == pytest.approx(float(t.double().square().sum()), rel=1e-6)
    tails = [t for c in calls for t in c]
    assert [t.numel() for t in tails] == [552, 552, 552]
    # each tail holds its own 552 floats, not the 4 MB float32 copy it came from
    held = [t.untyped_storage().nbytes() for t in tails]
    assert held == [552 * 4] * 3
