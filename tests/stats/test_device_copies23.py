"""trainvitals._device: the pinned, non-blocking host-to-device copies of indices (CUDA) are
plain copies elsewhere, and take a device given as a string, as the ``torch.tensor(...,
device=...)`` calls they replaced did (``stats.norms.local_sq_norms(..., device="cpu")``
raised AttributeError after the change)."""

from __future__ import annotations

import pytest
import torch

from trainvitals._device import host_to_device, index_on
from trainvitals.stats.norms import local_sq_norms


def test_a_device_given_as_a_string() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, generator=g), torch.randn(3, 4, generator=g), None]
    got = local_sq_norms(tensors, device="cpu")
    want = [float(t.double().square().sum()) if t is not None else 0.0 for t in tensors]
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(want, rel=1e-6)  # (float32 inputs)
    index = index_on([2, 0], "cpu")
    assert index.dtype == torch.long and index.tolist() == [2, 0]
    flags = host_to_device(torch.tensor([True, False]), "cpu")
    assert flags.dtype == torch.bool and flags.tolist() == [True, False]
