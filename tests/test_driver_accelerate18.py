"""The Vitals driver handed Accelerate-prepared objects but no ``accelerator=`` (session 18):
it finds the ``Accelerator`` that prepared them, so ``accelerator.clip_grad_norm_`` and fp16
unscaling are seen as when it is given; when none can be found it warns."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    reset()  # (an earlier test of this process may have left a state with another precision)
    yield
    reset()


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_prepared_objects_without_accelerator_show_unclipped_unscaled_gradients(
    precision, fresh_accelerate_state
):
    """A real Accelerator on CPU, gradient_accumulation_steps=2, ``clip_grad_norm_`` to 1e-6
    on every step, and the driver not given the accelerator: NormMonitor's global gradient norm
    is the float64 norm of the gradients before clipping (and, under fp16 with a GradScaler,
    after unscaling), the norm ``clip_grad_norm_`` returns. Without the accelerator the driver
    saw the clipped gradients at the optimizer's step (1e-6 instead of about 0.19)."""
    import torch
    from accelerate import Accelerator

    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, mixed_precision=precision)
    if precision == "fp16":
        # Accelerate's fp16 GradScaler, set up by hand on CPU as it is on CUDA
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        accelerator.native_amp = True
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    writer = RecordingWriter()
    vitals = Vitals([NormMonitor()], writer=writer, log_every_n_steps=1)
    vitals.attach(model, optimizer)

    expected: list[float] = []  # float64 norm before clipping, unscaled
    returned: list[float] = []  # what clip_grad_norm_ measured
    scale = 1.0
    for _ in range(6):
        x = torch.randn(3, 4)
        vitals.batch(x)
        with accelerator.accumulate(model):
            loss = model(x).float().pow(2).mean()
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                if accelerator.scaler is not None:
                    scale = float(accelerator.scaler.get_scale())
                grads = [p.grad.double() / scale for p in model.parameters()]
                expected.append(float(sum(g.pow(2).sum() for g in grads).sqrt()))
                returned.append(float(accelerator.clip_grad_norm_(model.parameters(), 1e-6)))
            optimizer.step()
            optimizer.zero_grad()
    vitals.close()

    assert vitals.step == 3
    norms = writer.key("l2_norm/grad/global")
    assert sorted(norms) == [0, 1, 2]
    for step, norm in norms.items():
        assert expected[step] > 0.1  # far from the clipped 1e-6
        assert norm == pytest.approx(expected[step], rel=1e-6)
        assert norm == pytest.approx(returned[step], rel=1e-6)
    assert vitals.ctx.accelerator is accelerator
    assert vitals.ctx.accumulate_grad_batches == 2


def test_prepared_optimizer_whose_accelerator_is_gone_warns_with_the_fix(
    fresh_accelerate_state,
):
    """The accelerator that prepared the optimizer no longer exists (nothing can be found):
    attach() warns, naming ``accelerator=``, and still attaches."""
    import torch
    from accelerate import Accelerator

    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    del accelerator
    gc.collect()
    vitals = Vitals([NormMonitor()], writer=RecordingWriter())
    with pytest.warns(RuntimeWarning, match=r"Vitals\(callbacks, accelerator=accelerator\)"):
        vitals.attach(model, optimizer)
    assert vitals.ctx.accelerator is None
    vitals.close()


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_plain_objects_and_a_given_accelerator_are_left_alone(fresh_accelerate_state):
    """A plain model and optimizer (accelerate imported, nothing prepared) look nothing up and
    warn nothing; a given accelerator is kept, with the accumulation steps the caller set."""
    import torch
    from accelerate import Accelerator

    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals = Vitals([NormMonitor()], writer=RecordingWriter())
    vitals.attach(model, optimizer)
    assert vitals.ctx.accelerator is None and vitals.ctx.framework == "loop"
    vitals.close()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model, optimizer = accelerator.prepare(model, optimizer)
    vitals = Vitals([NormMonitor()], writer=RecordingWriter(), accumulate_grad_batches=3)
    vitals.attach(model, optimizer)  # found, but the caller's accumulation steps are kept
    assert vitals.ctx.accelerator is accelerator
    assert vitals.ctx.accumulate_grad_batches == 3
    vitals.close()
