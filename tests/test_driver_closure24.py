"""The driver with ``optimizer.step(closure)`` (LBFGS, and SGD/Adam given a closure: the
pattern torch documents for LBFGS). The closure's backward runs inside ``step()``, after the
optimizer's step pre-hook; the driver showed the gradients in that pre-hook, so every
``l2_norm/grad/*`` written at step s was step s-1's gradient (none at step 0, with a warning
that no parameter had a gradient). Now they are shown after the closure's first call, as
Lightning runs ``on_before_optimizer_step`` after its closure: the gradients and weights the
step uses, against a float64 computation of the test's own. A loop that does not call
``vitals.batch()`` has its forwards counted as micro-batches: LBFGS's second and third
evaluations of the closure inside one ``step()`` are the same micro-batch (before, each was
taken for a new step, its gradients having been shown: six steps logged for three)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import NormMonitor, RuntimeMonitor


def _norm64(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "lbfgs":  # (max_iter 3: the closure runs three times per step)
        return torch.optim.LBFGS(params, lr=0.5, max_iter=3)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("name", ["sgd", "lbfgs"])
@pytest.mark.parametrize("keyword", [False, True])
@pytest.mark.parametrize("calls_batch", [True, False])
def test_norms_are_of_the_gradients_the_closure_makes(name, keyword, calls_batch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = _optimizer(name, model.parameters())
    writer = RecordingWriter()
    first_call: dict[int, tuple[float, float]] = {}
    losses: list[tuple[float, float]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitors = [NormMonitor(), RuntimeMonitor()]
        with Vitals(monitors, writer=writer, log_every_n_steps=1, max_steps=4) as vitals:
            vitals.attach(model, opt)
            for step in range(4):
                x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
                if calls_batch:
                    vitals.batch(x)

                def closure(x=x, step=step) -> torch.Tensor:
                    opt.zero_grad()
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    params = list(model.parameters())
                    first_call.setdefault(
                        step,
                        (_norm64(p.grad for p in params), _norm64(params)),
                    )
                    return loss

                returned = opt.step(closure=closure) if keyword else opt.step(closure)
                # (the closure's loss still reaches the optimizer and the caller)
                with torch.no_grad():  # (not a training forward: not a micro-batch)
                    losses.append((float(returned), float(model(x).pow(2).mean())))
    assert not [str(w.message) for w in caught if "gradient" in str(w.message)]
    for step in range(4):
        grad_norm, param_norm = first_call[step]
        row = writer.rows[step]
        # (tensors under 8192 elements are normed in float32: docs/norms.md, below 5e-7)
        assert row["l2_norm/grad/global"] == pytest.approx(grad_norm, rel=1e-6)
        assert row["l2_norm/param/global"] == pytest.approx(param_norm, rel=1e-6)
        assert row["time/batches"] == step + 1  # one micro-batch per step
    assert sorted(writer.rows) == [0, 1, 2, 3]
    # the optimizer descended with the closure it was given (the loss after each step is
    # below the one the closure returned at its first call)
    assert all(after < before for before, after in losses)
