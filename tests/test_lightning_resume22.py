"""Lightning resume with callbacks added, renamed or paired (``fit(ckpt_path=)``).

Lightning restores a callback from ``checkpoint["callbacks"][callback.state_key]`` and, when that
key is missing, from ``callback._legacy_state_key`` (meant for checkpoints before Lightning 1.5,
whose keys were the callback's type: ``Callback._legacy_state_key`` returns ``type(self)``,
which never matches a string key). ``VitalsCallback._legacy_state_key`` returned the class name,
which is every unnamed instance's ``state_key``: a callback given a name of its own and added on
resume, beside an unnamed one of the same class, was restored from the unnamed one's state (its
consumed counts and clocks started at the other monitor's).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.scripts.vitals_testing import FakeClock, RecordingWriter, quiet_trainer
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor

SECONDS = 2.0  # the fake clock's seconds per training batch
BATCH = 3  # samples per batch


def _module(pl, clock: FakeClock):
    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            clock.t += SECONDS
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            data = torch.randn(20 * BATCH, 2, generator=torch.Generator().manual_seed(1))
            return torch.utils.data.DataLoader(data, batch_size=BATCH)

    return Tiny()


def _fit(pl, tmp, callbacks, clock, max_steps, ckpt_path=None):
    trainer = quiet_trainer(
        pl.__name__,
        callbacks=callbacks,
        devices=1,
        max_steps=max_steps,
        log_every_n_steps=1,
        default_root_dir=str(tmp),
    )
    trainer.fit(_module(pl, clock), ckpt_path=ckpt_path)
    return trainer


def test_a_named_callback_added_on_resume_does_not_take_an_unnamed_ones_state(tmp_path):
    import lightning.pytorch as pl

    saved_steps, resumed_steps = 4, 7
    clock = FakeClock()
    trainer = _fit(pl, tmp_path, [RuntimeMonitor(clock=clock)], clock, saved_steps)
    ckpt = tmp_path / "saved.ckpt"
    trainer.save_checkpoint(ckpt)
    assert list(torch.load(ckpt, weights_only=False)["callbacks"]) == ["RuntimeMonitor"]

    kept_rows, added_rows = RecordingWriter(), RecordingWriter()
    kept = RuntimeMonitor(clock=clock, writer=kept_rows)
    added = RuntimeMonitor(clock=clock, time_unit="seconds", writer=added_rows)
    added.state_key = "runtime_added"  # not in the checkpoint: a new monitor
    _fit(pl, tmp_path, [kept, added], clock, resumed_steps, ckpt_path=ckpt)

    last = resumed_steps - 1
    # independent counts: one batch of BATCH samples and SECONDS seconds per optimizer step
    resumed_batches = resumed_steps - saved_steps
    assert kept_rows.rows[last]["time/batches"] == resumed_steps  # restored: the run's
    assert kept_rows.rows[last]["time/samples"] == resumed_steps * BATCH
    # the added monitor counts from the resume only (it counted from the other's state: 7, 21,
    # 14 s)
    assert added_rows.rows[last]["time/batches"] == resumed_batches
    assert added_rows.rows[last]["time/samples"] == resumed_batches * BATCH
    assert added_rows.rows[last]["time/train_seconds"] == pytest.approx(resumed_batches * SECONDS)
