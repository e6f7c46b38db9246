"""The run limits in the Lightning run context (``ctx.max_steps``, ``ctx.max_epochs``,
``ctx.num_training_batches``) follow the trainer during the fit: a dataloader reloaded with
another length at an epoch's start (``reload_dataloaders_every_n_epochs``) and a limit changed
mid-run (``trainer.fit_loop.epoch_loop.max_steps``). They were the values of the fit's start."""

from __future__ import annotations

import torch
from torch import nn

from tests.scripts.vitals_testing import RecordingWriter, quiet_trainer

BATCHES = {0: 4, 1: 6, 2: 3}  # batches of the dataloader loaded for each epoch


def test_context_limits_follow_the_trainer(tmp_path):
    import lightning.pytorch as pl

    from trainvitals.callbacks.base import VitalsCallback

    class Probe(VitalsCallback):
        def __init__(self) -> None:
            super().__init__(writer=RecordingWriter())
            self.seen: dict[int, tuple] = {}

        def step_end(self, ctx):
            self.seen[ctx.step] = (ctx.max_steps, ctx.max_epochs, ctx.num_training_batches)

    class Raise(pl.Callback):
        """Raises the step limit after step 2 and the epoch limit after the first epoch."""

        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                trainer.fit_loop.epoch_loop.max_steps = 20

        def on_train_epoch_end(self, trainer, *args):
            trainer.fit_loop.max_epochs = 3

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            n = BATCHES[self.trainer.current_epoch]
            return torch.utils.data.DataLoader(torch.randn(2 * n, 3), batch_size=2)

    probe = Probe()
    trainer = quiet_trainer(
        callbacks=[Raise(), probe],  # (Raise's batch end runs before the probe's)
        devices=1,
        default_root_dir=str(tmp_path),
        log_every_n_steps=1,
        max_steps=10,
        max_epochs=2,
        reload_dataloaders_every_n_epochs=1,
    )
    trainer.fit(Module())
    assert trainer.global_step == sum(BATCHES.values())
    # step s ends in epoch 0 for s < 4, then epoch 1 (6 batches), then epoch 2 (3 batches)
    expected = {}
    for step in range(sum(BATCHES.values())):
        epoch = 0 if step < 4 else 1 if step < 10 else 2
        expected[step] = (
            10 if step < 2 else 20,  # raised at the end of the batch of step 2
            2 if epoch == 0 else 3,  # raised at the end of epoch 0
            BATCHES[epoch],
        )
    assert probe.seen == expected
