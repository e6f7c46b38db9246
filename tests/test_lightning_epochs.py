"""The Lightning adapter across epoch boundaries: ``batch_idx`` restarts at 0 every epoch, so a
batch is told from the one before it by the epoch too, not by ``(global_step, batch_idx)``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.scripts.vitals_testing import FakeClock, RecordingWriter, quiet_trainer
from trainvitals.callbacks.base import VitalsCallback
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor


class _MicroBatchProbe(VitalsCallback):
    """Records ``ctx.micro_batches_in_step`` at each optimizer step's end."""

    def __init__(self) -> None:
        super().__init__(log_every_n_steps=1)
        self.at_end: dict[int, int] = {}

    def step_end(self, ctx) -> None:
        self.at_end[ctx.step] = ctx.micro_batches_in_step


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_one_batch_per_epoch_stepping_every_other_epoch_counts_both_micro_batches(
    tmp_path, package
):
    """Manual optimization, one batch per epoch (a one-batch loader, as ``overfit_batches=1`` or
    ``limit_train_batches=1`` give), one ``optimizer.step()`` every second batch: each step
    has two micro-batches. Before, the second epoch's batch had the same ``(global_step,
    batch_idx)`` as the first and was taken for the same batch seen by another callback: one
    micro-batch per step, so RuntimeMonitor kept the horizon of max_epochs x batches (8 steps
    for the 4 the run makes) and wrote time/remaining of 14, 12, 10, 8 s where 6, 4, 2, 0 s
    were left. Each step is now two micro-batches: that horizon is known not to hold in
    optimizer steps (no max_steps), so no time/remaining is written, as documented."""
    pl = pytest.importorskip(package)
    clock = FakeClock()

    class EveryOtherEpoch(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.lin = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            clock.t += 1.0
            opt = self.optimizers()
            self.manual_backward(self.lin(batch).pow(2).mean())
            if self.current_epoch % 2 == 1:
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(2, 3), batch_size=2)

    writer = RecordingWriter()
    probe = _MicroBatchProbe()
    monitor = RuntimeMonitor(writer=writer, clock=clock, warmup_steps=0, log_every_n_steps=1)
    trainer = quiet_trainer(
        package,
        callbacks=[monitor, probe],
        max_epochs=8,
        devices=1,
        default_root_dir=str(tmp_path),
        log_every_n_steps=1,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(EveryOtherEpoch())

    assert trainer.global_step == 4
    assert probe.at_end == {0: 2, 1: 2, 2: 2, 3: 2}
    assert any("does not step once per batch" in str(w.message) for w in caught)
    assert sorted(writer.rows) == [0, 1, 2, 3]
    for step, row in writer.rows.items():
        assert row["time/batches"] == 2 * (step + 1)
        assert row["time/train_hours"] == pytest.approx(2.0 * (step + 1) / 3600, rel=1e-12)
        assert "time/remaining_hours" not in row
