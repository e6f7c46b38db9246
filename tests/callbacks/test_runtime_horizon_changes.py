"""RuntimeMonitor under a real Lightning Trainer whose horizon changes mid-run: ``max_steps`` or
``max_epochs`` changed by a callback, and ``reload_dataloaders_every_n_epochs`` loading a
dataloader of another length. ``time/remaining_*`` must be the rate the monitor itself reports
times the optimizer steps left to the horizon as it stands at that step."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from tests.scripts.vitals_testing import FakeClock, RecordingWriter, quiet_trainer
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor


def _module(clock: FakeClock, lengths: list[int]):
    """A tiny module; epoch ``e`` trains on ``lengths[e]`` samples in batches of 1 (the last
    length for later epochs); each batch moves the clock by a varying amount."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            clock.t += 0.5 + 0.25 * (batch_idx % 3)
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            n = lengths[min(self.trainer.current_epoch, len(lengths) - 1)]
            return DataLoader(TensorDataset(torch.randn(n, 3)), batch_size=1)

    return Module()


def _fit(
    lengths: list[int], extra_callbacks: list, **trainer_kwargs
) -> tuple[RecordingWriter, int]:
    clock = FakeClock()
    writer = RecordingWriter()
    monitor = RuntimeMonitor(clock=clock, writer=writer, time_unit="seconds")
    trainer = quiet_trainer(
        callbacks=[*extra_callbacks, monitor], log_every_n_steps=1, **trainer_kwargs
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_module(clock, lengths))
    return writer, trainer.global_step


def _assert_remaining(writer: RecordingWriter, horizon_at: dict[int, int]) -> None:
    """``time/remaining_seconds`` at each logged step ``s`` is the monitor's own
    ``time/seconds_per_step`` times the steps left after it to ``horizon_at[s]``."""
    remaining = writer.key("time/remaining_seconds")
    per_step = writer.key("time/seconds_per_step")
    assert remaining, "no estimate written"
    assert set(remaining) == set(per_step)
    for step, value in remaining.items():
        left = max(horizon_at[step] - (step + 1), 0)
        assert value == pytest.approx(per_step[step] * left, rel=1e-12, abs=1e-12), (
            step,
            horizon_at[step],
        )


@pytest.mark.parametrize(
    ("limit", "start", "changed_to", "after_step"),
    [
        ("max_steps", 20, 12, 5),  # lowered: the run stops at 12
        ("max_steps", 8, 14, 3),  # raised: the run goes on to 14
        ("max_epochs", 4, 2, 2),  # 4 epochs of 5 batches, then 2 (10 steps)
    ],
)
def test_a_limit_changed_mid_run_moves_the_horizon(limit, start, changed_to, after_step):
    """A callback changes the run's limit at the end of step ``after_step`` (before the
    monitor's own step_end runs: it comes first in the callback list). Lightning stops at
    the new limit, and every estimate from that step on counts down to it."""
    import lightning.pytorch as pl

    batches = 5 if limit == "max_epochs" else 100

    class ChangeLimit(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == after_step + 1:
                if limit == "max_steps":
                    trainer.fit_loop.epoch_loop.max_steps = changed_to
                else:
                    trainer.fit_loop.max_epochs = changed_to

    kwargs = {"max_steps": start} if limit == "max_steps" else {"max_epochs": start}
    writer, steps = _fit([batches], [ChangeLimit()], **kwargs)
    final = changed_to if limit == "max_steps" else changed_to * batches
    assert steps == final  # Lightning followed the change
    before = start if limit == "max_steps" else start * batches
    horizon_at = {s: before if s < after_step else final for s in range(steps)}
    _assert_remaining(writer, horizon_at)
    assert writer.key("time/remaining_seconds")[steps - 1] == 0.0


@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("lengths", [[8, 4, 4], [4, 10, 7]])
def test_a_reloaded_dataloader_of_another_length_moves_the_horizon(lengths, accumulate):
    """``reload_dataloaders_every_n_epochs=1`` with a dataloader whose length changes per epoch:
    the horizon is the steps before the epoch in progress plus the epochs left (this one
    included) at this epoch's steps per epoch; the last step has 0 left."""
    epochs = len(lengths)
    writer, steps = _fit(
        lengths,
        [],
        max_epochs=epochs,
        reload_dataloaders_every_n_epochs=1,
        accumulate_grad_batches=accumulate,
    )
    # independent: an epoch of n batches has ceil(n / accumulate) optimizer steps
    per_epoch = [math.ceil(n / accumulate) for n in lengths]
    assert steps == sum(per_epoch)
    horizon_at: dict[int, int] = {}
    first = 0
    for epoch, n in enumerate(per_epoch):
        for s in range(first, first + n):
            horizon_at[s] = first + (epochs - epoch) * n
        first += n
    _assert_remaining(writer, horizon_at)
    assert writer.key("time/remaining_seconds")[steps - 1] == 0.0
