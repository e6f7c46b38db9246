"""FlopCounterSession around a torch.compile'd model: the count, and no Dynamo warnings."""

from __future__ import annotations

import warnings

import pytest
import torch

from trainvitals.stats.flops import FlopCounterSession

# Linear(8,16) -> ReLU -> Linear(16,4), input without grad: forward 2(8*16 + 16*4) per sample;
# backward: layer 2 grad input and grad weight 2 * 2*16*4, layer 1 grad weight 2*8*16.
PER_SAMPLE = 2 * (8 * 16 + 16 * 4) + 2 * 2 * 16 * 4 + 2 * 8 * 16


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_forward_backward_counted_without_dynamo_warnings(backend):
    # (aot_eager: the stock FlopCounterMode's module tracker raised inside the forward,
    # AttributeError from register_multi_grad_hook, which ended the run)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend=backend)
    session = FlopCounterSession()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session.start()
        try:
            compiled(torch.randn(3, 8)).sum().backward()
        finally:
            flops = session.stop()
    assert flops == 3 * PER_SAMPLE
    dynamo = [str(w.message) for w in caught if "Dynamo" in str(w.message)]
    assert dynamo == []  # Dynamo traces the mode's __torch_dispatch__: no cache lookups there
