"""NormMonitor's non-finite gradient warnings: the first logging step of a run is warned, the
later ones are counted and summed up once at the run's end (not one warning per logging step),
and a logging step counts once however many ``step()`` calls write it."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import RecordingWriter
from tests.scripts.vitals_testing import quiet_trainer
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.norm_monitor import NormMonitor


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        # trainable, in no optimizer: its gradient goes NaN at the chosen steps while the
        # weights the optimizer updates stay finite
        self.probe = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean() + self.probe.sum() * 0.0


def _run(monitor: NormMonitor, steps: range, bad: set[int], *, state=None, every: int = 1):
    """``_Net`` trained over ``steps``; at the steps in ``bad`` the probe's gradient holds a
    NaN. Returns the rows written, the NaN/Inf warnings, the reference count of non-finite
    gradient tensors per step (read from the gradients) and the driver's state at the end."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.net.parameters(), lr=0.1)
    writer = RecordingWriter()
    reference: dict[int, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([monitor], writer=writer, log_every_n_steps=every) as vitals:
            vitals.attach(model, opt)
            if state is not None:
                vitals.load_state_dict(state)
            for step in steps:
                vitals.batch(torch.randn(2, 4))
                model(torch.randn(2, 4)).backward()
                if step in bad:
                    model.probe.grad[1] = math.nan
                reference[step] = sum(
                    not bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                )
                opt.step()
                model.zero_grad()
            state_out = vitals.state_dict()
    messages = [str(w.message) for w in caught if "NaN/Inf" in str(w.message)]
    return writer.steps, messages, reference, state_out


def test_a_diverged_run_warns_once_and_sums_up_at_the_end():
    # Before: one warning per logging step with a NaN gradient (25 here; each names its
    # step, so Python's warning filter does not collapse them).
    monitor = NormMonitor()
    rows, messages, reference, _ = _run(monitor, range(30), set(range(5, 30)))
    # the numbers written are unchanged: each step's count of non-finite gradient tensors
    assert {s: r["l2_norm/grad/nonfinite_count"] for s, r in rows.items()} == reference
    assert all(math.isnan(rows[s]["l2_norm/grad/global"]) for s in range(5, 30))
    assert len(messages) == 2
    assert "hold NaN/Inf at step 5: probe" in messages[0]
    assert "at 25 logging steps of this run, from step 5 to step 29" in messages[1]
    assert "in all" not in messages[1]  # (nothing counted before this run)
    assert monitor.state_dict() == {
        "first_nonfinite_step": 5,
        "first_nonfinite_names": ["probe"],
        "nonfinite_logging_steps": 25,
    }


def test_intermittent_nonfinite_steps_with_an_interval():
    # NaN at steps 3, 4, 8, 13: logging every 4 steps sees 4 and 8 only
    monitor = NormMonitor()
    rows, messages, reference, _ = _run(monitor, range(16), {3, 4, 8, 13}, every=4)
    assert sorted(rows) == [0, 4, 8, 12]
    assert {s: r["l2_norm/grad/nonfinite_count"] for s, r in rows.items()} == {
        s: reference[s] for s in rows
    }
    assert len(messages) == 2
    assert "at step 4: probe" in messages[0]
    assert "at 2 logging steps of this run, from step 4 to step 8" in messages[1]
    assert monitor.nonfinite_logging_steps == 2


def test_a_single_nonfinite_step_gets_no_summary():
    monitor = NormMonitor()
    _, messages, _, _ = _run(monitor, range(6), {2})
    assert len(messages) == 1 and "at step 2: probe" in messages[0]
    assert monitor.nonfinite_logging_steps == 1


def test_a_resumed_run_warns_at_its_own_first_step_and_the_count_continues():
    first = NormMonitor()
    _, messages, _, state = _run(first, range(10), set(range(3, 10)))
    assert len(messages) == 2 and "at 7 logging steps" in messages[1]
    resumed = NormMonitor()
    _, messages, _, _ = _run(resumed, range(10, 20), {12, 15, 16}, state=state)
    assert len(messages) == 2
    assert "at step 12: probe" in messages[0]
    assert "at 3 logging steps of this run, from step 12 to step 16" in messages[1]
    assert "10 in all since step 3" in messages[1]
    assert resumed.state_dict() == {
        "first_nonfinite_step": 3,
        "first_nonfinite_names": ["probe"],
        "nonfinite_logging_steps": 10,
    }


def test_an_instance_reused_for_another_run_warns_again():
    monitor = NormMonitor()
    _, messages, _, _ = _run(monitor, range(6), {1, 2, 3})
    assert len(messages) == 2
    _, messages, _, _ = _run(monitor, range(6), {4, 5})
    assert len(messages) == 2
    assert "at step 4: probe" in messages[0]
    assert "at 2 logging steps of this run, from step 4 to step 5" in messages[1]
    assert monitor.nonfinite_logging_steps == 5


def test_a_step_written_twice_counts_once(tmp_path):
    # One optimizer stepped twice per Lightning batch (manual optimization), an Inf gradient
    # at its first step(): both step()s write the batch's step. Before: the count of logging
    # steps with NaN/Inf gradients was 6 for the 3 logging steps, and each was warned twice.
    pl = pytest.importorskip("lightning.pytorch")
    batches = 3

    class LitTwice(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
            self.bad_steps: set[int] = set()

        def training_step(self, batch, batch_idx):
            (x,) = batch
            opt = self.optimizers()
            for k in range(2):
                opt.zero_grad()
                self.manual_backward(self.net(x * (1 + k)).pow(2).mean())
                if k == 0:
                    self.net[0].bias.grad[0] = math.inf
                opt.step()

        def on_before_optimizer_step(self, optimizer):
            if not all(bool(torch.isfinite(p.grad).all()) for p in self.parameters()):
                self.bad_steps.add(self.trainer.global_step)
            for p in self.parameters():
                p.grad.nan_to_num_(posinf=0.0)  # (after the callbacks: the update stays finite)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(4 * batches, 6, generator=g))
    module = LitTwice()
    writer = RecordingWriter()
    monitor = NormMonitor(writer=writer)
    trainer = quiet_trainer(
        devices=1,
        max_epochs=1,
        log_every_n_steps=1,
        callbacks=[monitor],
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    messages = [str(w.message) for w in caught if "NaN/Inf" in str(w.message)]
    logged = sorted(writer.steps)
    assert logged == [0, 2, 4]
    # the batch's step counts the step() calls (0, 2, 4): the batches' steps seen bad
    assert sorted(module.bad_steps) == [0, 2, 4]
    assert monitor.nonfinite_logging_steps == len(logged)
    assert all(writer.steps[s]["l2_norm/grad/nonfinite_count"] == 1 for s in logged)
    assert len(messages) == 2
    assert "at step 0: net.0.bias" in messages[0]
    assert "at 3 logging steps of this run, from step 0 to step 4" in messages[1]
