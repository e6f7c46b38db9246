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


class _SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as github.com/davda54/sam's README uses it (written for
    this test): the loop's backward at w, then step(closure) moves the weights to
    w + rho * g / |g|, runs the closure there, puts w back and steps the base optimizer."""

    def __init__(self, params, rho: float = 0.5, lr: float = 0.1) -> None:
        super().__init__(params, {"rho": rho})
        self.base = torch.optim.SGD(self.param_groups, lr=lr)

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        scale = self.param_groups[0]["rho"] / (
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            + 1e-12
        )
        kept = []
        for group in self.param_groups:
            for p in group["params"]:
                kept.append(p.detach().clone())
                p.add_(p.grad * scale)
        self.zero_grad()
        with torch.enable_grad():
            closure()
        for p, w in zip((p for g in self.param_groups for p in g["params"]), kept, strict=True):
            p.copy_(w)
        self.base.step()


def test_sam_shows_the_loops_gradients_at_the_unperturbed_weights():
    """SAM's loop makes the step's gradients before step(); the closure re-evaluates them at
    weights step() perturbed first (not a micro-batch of its own)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = _SAM(model.parameters())
    writer = RecordingWriter()
    seen = []
    with Vitals(
        [NormMonitor(), RuntimeMonitor()], writer=writer, log_every_n_steps=1, max_steps=3
    ) as vitals:
        vitals.attach(model, opt)
        for _ in range(3):
            x = torch.randn(16, 8)
            model(x).pow(2).mean().backward()
            params = list(model.parameters())
            seen.append((_norm64(p.grad for p in params), _norm64(params)))
            opt.step(lambda x=x: model(x).pow(2).mean().backward())
            opt.zero_grad()
    for step, (grad_norm, param_norm) in enumerate(seen):
        row = writer.rows[step]
        assert row["l2_norm/grad/global"] == pytest.approx(grad_norm, rel=1e-6)
        assert row["l2_norm/param/global"] == pytest.approx(param_norm, rel=1e-6)
        assert row["time/batches"] == step + 1


@pytest.mark.parametrize("name", ["sgd", "lbfgs"])
@pytest.mark.parametrize("calls_batch", [True, False])
def test_micro_batches_inside_the_closure_count_once_per_step(name, calls_batch):
    """A closure that runs 3 micro-batches (``vitals.batch()`` inside it, as the docs say:
    before each forward); LBFGS calls it 3 times per step: 3 micro-batches per step, one step
    per step() (before: 6 steps logged for 3 and every call's micro-batches counted, or one
    micro-batch per step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = _optimizer(name, model.parameters())
    writer = RecordingWriter()
    first_call: dict[int, float] = {}
    with Vitals(
        [NormMonitor(), RuntimeMonitor()], writer=writer, log_every_n_steps=1, max_steps=3
    ) as vitals:
        vitals.attach(model, opt)
        for step in range(3):
            xs = [torch.randn(4, 8) for _ in range(3)]

            def closure(xs=xs, step=step) -> torch.Tensor:
                opt.zero_grad()
                total = torch.zeros(())
                for x in xs:
                    if calls_batch:
                        vitals.batch(x)
                    loss = model(x).pow(2).mean() / 3
                    loss.backward()
                    total = total + loss.detach()
                first_call.setdefault(step, _norm64(p.grad for p in model.parameters()))
                return total

            opt.step(closure)
    assert sorted(writer.rows) == [0, 1, 2]
    for step in range(3):
        row = writer.rows[step]
        assert row["time/batches"] == 3 * (step + 1)
        if calls_batch:
            assert row["time/samples"] == 12 * (step + 1)
        assert row["l2_norm/grad/global"] == pytest.approx(first_call[step], rel=1e-6)


def test_two_optimizers_each_stepped_with_its_closure():
    """Each optimizer's gradients are those its own closure makes (the second one's closure
    runs after the first optimizer's update)."""
    torch.manual_seed(0)
    first, second = nn.Linear(8, 4), nn.Linear(4, 1)
    model = nn.Sequential(first, second)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, second)]
    writer = RecordingWriter()
    expected = []
    with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1) as vitals:
        vitals.attach(model, opts)
        for _ in range(3):
            x = torch.randn(8, 8)
            vitals.batch(x)

            def closure(x=x) -> torch.Tensor:
                for o in opts:
                    o.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss

            opts[0].step(closure)
            shown = [p.grad.clone() for p in first.parameters()]
            opts[1].step(closure)
            expected.append(_norm64(shown + [p.grad for p in second.parameters()]))
    for step, norm in enumerate(expected):
        assert writer.rows[step]["l2_norm/grad/global"] == pytest.approx(norm, rel=1e-6)


class _Subclass(torch.optim.SGD):
    def step(self, closure=None):  # (a subclass adding something around the parent's step)
        return super().step(closure)


def test_a_subclass_calling_super_step_is_one_step():
    """torch hooks each optimizer class's step(); once the parent class has an instance, a
    subclass's super().step() runs the hooks again inside the outer step: it was counted as a
    second step (6 steps logged for 3)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # (the parent hooked)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = _Subclass(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    norms = []
    with Vitals(
        [NormMonitor(), RuntimeMonitor()], writer=writer, log_every_n_steps=1, max_steps=3
    ) as vitals:
        vitals.attach(model, opt)
        for _ in range(3):
            x = torch.randn(4, 8)
            vitals.batch(x)
            model(x).pow(2).mean().backward()
            norms.append(_norm64(p.grad for p in model.parameters()))
            opt.step()
            opt.zero_grad()
        assert vitals.step == 3
    assert sorted(writer.rows) == [0, 1, 2]
    for step, norm in enumerate(norms):
        assert writer.rows[step]["l2_norm/grad/global"] == pytest.approx(norm, rel=1e-6)
        assert writer.rows[step]["time/batches"] == step + 1


def test_lbfgs_after_other_steps_with_gradients_zeroed_in_place():
    """Two plain steps of another optimizer on the same parameters, then LBFGS steps, the
    loop zeroing in place (``zero_grad(set_to_none=False)``) and calling ``batch()`` before
    ``step()``: the gradients LBFGS's closure makes, one micro-batch per step (gradients
    left from the earlier steps, or zeroed ones, were taken for the step's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    writer = RecordingWriter()
    shown: list[float] = []
    with Vitals(
        [NormMonitor(), RuntimeMonitor()], writer=writer, log_every_n_steps=1, max_steps=4
    ) as vitals:
        vitals.attach(model, [adam, lbfgs])
        for step in range(4):
            x = torch.randn(16, 8)
            vitals.batch(x)
            if step < 2:
                model(x).pow(2).mean().backward()
                shown.append(_norm64(p.grad for p in model.parameters()))
                adam.step()
                adam.zero_grad(set_to_none=False)
                continue
            calls: list[float] = []

            def closure(x=x, calls=calls) -> torch.Tensor:
                lbfgs.zero_grad()
                loss = model(x).pow(2).mean()
                loss.backward()
                calls.append(_norm64(p.grad for p in model.parameters()))
                return loss

            lbfgs.step(closure)
            lbfgs.zero_grad(set_to_none=False)
            shown.append(calls[0])
    assert sorted(writer.rows) == [0, 1, 2, 3]
    for step, norm in enumerate(shown):
        row = writer.rows[step]
        assert row["l2_norm/grad/global"] == pytest.approx(norm, rel=1e-6)
        assert row["time/batches"] == step + 1
