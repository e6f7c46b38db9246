"""RuntimeMonitor audit: the per-step rate after a resume from a checkpoint taken inside an
accumulation window (a validation every 5 batches under accumulate_grad_batches=3)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from tests.scripts.vitals_testing import FakeClock, RecordingWriter, quiet_trainer
from trainvitals import RuntimeMonitor

pl = pytest.importorskip("lightning.pytorch")

BATCHES, ACC, VAL_EVERY = 10, 3, 5  # steps end after batches 2, 5, 8, 9 of each epoch


def _seconds(epoch: int, batch_idx: int) -> float:
    """Training seconds of one batch (the fake clock moves by it in training_step)."""
    return 0.5 + 0.25 * ((3 * batch_idx + epoch) % 5)


class _Module(pl.LightningModule):
    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.clock = clock

    def training_step(self, batch, batch_idx):
        self.clock.t += _seconds(self.current_epoch, batch_idx)
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.clock.t += 7.0  # validation time: not in the rate

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(torch.randn(2 * BATCHES, 3), batch_size=2)

    def val_dataloader(self):
        return DataLoader(torch.randn(2, 3), batch_size=2)


class _SaveAtFirstValidation(pl.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_validation_end(self, trainer, pl_module):
        if not self.path.exists():
            trainer.save_checkpoint(self.path)


def _fit(clock, writer, warmup, ckpt_path=None, extra=()):
    monitor = RuntimeMonitor(clock=clock, writer=writer, warmup_steps=warmup, time_unit="seconds")
    trainer = quiet_trainer(
        callbacks=[monitor, *extra],
        log_every_n_steps=2,
        max_epochs=2,
        accumulate_grad_batches=ACC,
        val_check_interval=VAL_EVERY,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Module(clock), ckpt_path=ckpt_path)


def _step_seconds() -> list[float]:
    """Training seconds of each optimizer step of the run, float64 by hand."""
    out = []
    for epoch in range(2):
        window: list[float] = []
        for i in range(BATCHES):
            window.append(_seconds(epoch, i))
            if (i + 1) % ACC == 0 or i == BATCHES - 1:
                out.append(sum(window))
                window = []
    return out


@pytest.mark.parametrize("warmup", [1, 0])
def test_rate_after_a_resume_inside_an_accumulation_window(tmp_path, warmup):
    """The checkpoint of the validation after batch 4 falls inside step 1 (batches 3-5).
    Batches 3 and 4 ran before it, batch 5 after the resume. With the default warm-up the
    resumed step 1 is left out of the rate, yet its first two batches' seconds were in the
    checkpoint's rate: seconds_per_step at step 2 was 6.0 (batches 3, 4 and step 2 over one
    step) instead of 3.5 (step 2 alone). With warmup_steps=0 the resumed step counts whole
    (its part before the checkpoint included): the uninterrupted run's numbers."""
    ckpt = tmp_path / "mid_window.ckpt"
    _fit(FakeClock(), RecordingWriter(), warmup, extra=[_SaveAtFirstValidation(ckpt)])
    writer = RecordingWriter()
    _fit(FakeClock(50_000.0), writer, warmup, ckpt_path=ckpt)

    steps = _step_seconds()
    horizon = len(steps)
    # counted in the rate: the resumed process's steps after its warm-up (steps 0 and 1, the
    # first process's, were its warm-up step and the step in progress at the checkpoint)
    first = 1 + warmup if warmup else 0
    per_step = writer.key("time/seconds_per_step")
    remaining = writer.key("time/remaining_seconds")
    assert sorted(per_step) == [2, 4, 6]
    for step, got in per_step.items():
        counted = steps[first : step + 1]
        expected = sum(counted) / len(counted)
        assert got == pytest.approx(expected, rel=1e-12), step
        assert remaining[step] == pytest.approx((horizon - step - 1) * expected, rel=1e-12)
    # the clock keys are not the rate's: the whole run's training and validation time
    train = writer.key("time/train_seconds")
    assert train[6] == pytest.approx(sum(steps[:7]), rel=1e-12)
