"""The Lightning side of the callbacks under Trainer entry points other than one plain fit:
an evaluation (validate/test/predict) restored from a checkpoint between two fits of one
trainer, and a second fit on a trainer whose first fit ended with a validation."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.scripts.vitals_testing import FakeClock, RecordingWriter
from trainvitals.adapters.jsonl import read_jsonl
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor

SEQ = 6
VOCAB = 16
BATCH = 3


TRAIN_SECONDS = 1.0  # per training batch, on the fake clock
VAL_SECONDS = 50.0  # per validation batch


def _module(pl, clock: FakeClock | None = None, batches: int = 40):
    clock = clock or FakeClock()

    class TinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(VOCAB, 8)
            self.head = nn.Linear(8, VOCAB)

        def _loss(self, batch):
            ids = batch["input_ids"]
            return nn.functional.cross_entropy(
                self.head(self.emb(ids)).flatten(0, 1), ids.flatten()
            )

        def training_step(self, batch, batch_idx):
            clock.t += TRAIN_SECONDS
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):
            clock.t += VAL_SECONDS
            return self._loss(batch)

        def test_step(self, batch, batch_idx):
            return self._loss(batch)

        def predict_step(self, batch, batch_idx):
            return self._loss(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def _loader(self, n):
            g = torch.Generator().manual_seed(n)
            data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,), generator=g)} for _ in range(n)]
            return torch.utils.data.DataLoader(data, batch_size=BATCH)

        def train_dataloader(self):
            return self._loader(batches * BATCH)

        def val_dataloader(self):
            return self._loader(2 * BATCH)

        test_dataloader = predict_dataloader = val_dataloader

    return TinyLM()


@pytest.mark.parametrize("evaluation", ["validate", "test", "predict"])
def test_an_evaluation_from_an_earlier_checkpoint_keeps_the_counters_of_the_next_fit(
    tmp_path, evaluation
):
    # trainer.validate/test/predict(ckpt_path=) restore the callbacks' state from the
    # checkpoint but leave the trainer's global_step where the fit stopped: the next fit on
    # the same trainer went on at step 6 with the counters of step 3 (time/samples 12 for 21).
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    writer = RecordingWriter()
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        logger=False,
        callbacks=[RuntimeMonitor(writer=writer), checkpoints],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
    )
    module = _module(pl)
    trainer.fit(module)
    getattr(trainer, evaluation)(module, ckpt_path=str(tmp_path / "ckpt" / "step=3.ckpt"))
    trainer.fit_loop.epoch_loop.max_steps = 10
    trainer.fit(module)

    assert trainer.global_step == 10
    for step in range(10):  # one batch of BATCH samples of SEQ tokens per optimizer step
        row = writer.rows[step]
        assert row["time/batches"] == step + 1, (step, row)
        assert row["time/samples"] == BATCH * (step + 1), (step, row)
        assert row["time/tokens"] == BATCH * SEQ * (step + 1), (step, row)


def test_a_fit_from_a_checkpoint_still_restores_the_counters(tmp_path):
    # the counterpart: fit(ckpt_path=) on a fresh trainer and callback goes on from the
    # checkpoint's counters (an evaluation's restore skipped, a fit's not)
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    def make(writer, max_steps, **kwargs):
        return pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            logger=False,
            callbacks=[RuntimeMonitor(writer=writer), *kwargs.pop("extra", [])],
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            log_every_n_steps=1,
            default_root_dir=tmp_path,
            **kwargs,
        )

    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}"
    )
    make(RecordingWriter(), 3, extra=[checkpoints]).fit(_module(pl))
    writer = RecordingWriter()
    trainer = make(writer, 5, enable_checkpointing=False)
    module = _module(pl)
    ckpt = str(tmp_path / "ckpt" / "step=3.ckpt")
    trainer.validate(module, ckpt_path=ckpt)  # (skipped: its restore is not a fit's)
    trainer.fit(module, ckpt_path=ckpt)
    assert sorted(writer.rows) == [3, 4]
    for step in (3, 4):
        assert writer.rows[step]["time/samples"] == BATCH * (step + 1)


@pytest.mark.parametrize("interval", [4, 2])
def test_a_second_fit_keeps_the_totals_the_first_fit_wrote_at_its_end(tmp_path, interval):
    # The first fit (6 steps, one epoch) ends with a validation: RuntimeMonitor writes its
    # totals at step 6, the step the second fit starts at. That fit continues the same run, so
    # those lines stay: its writer was told to resume at step 6 and dropped them, and with
    # an interval of 4 the second fit did not write step 6 again (its totals were gone).
    pl = pytest.importorskip("lightning.pytorch")
    clock = FakeClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        callbacks=[RuntimeMonitor(clock=clock)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        log_every_n_steps=interval,
        default_root_dir=tmp_path,
    )
    module = _module(pl, clock, batches=6)
    with warnings.catch_warnings():
        # (replacing a line the second fit writes again is no news: no warning)
        warnings.filterwarnings("error", "JsonlSink", RuntimeWarning)
        trainer.fit(module)
        trainer.fit_loop.max_epochs = 2
        trainer.fit(module)
    assert trainer.global_step == 12

    records = read_jsonl(tmp_path / "metrics.jsonl")
    steps = [r["step"] for r in records]
    assert steps == sorted(set(range(0, 12, interval)) | {6, 12})  # each step once
    rows = {r["step"]: r["metrics"] for r in records}
    for step, row in rows.items():
        # a fit's end (after its validation): the totals only, of the steps before it
        end = step == 12 or (step == 6 and step % interval != 0)
        if end:
            assert set(row) == {"time/train_hours", "time/validation_hours", "time/total_hours"}
        trained = step if end else step + 1
        validations = (step >= 6) + (step >= 12)
        train, val = TRAIN_SECONDS * trained, VAL_SECONDS * validations
        assert row["time/train_hours"] == pytest.approx(train / 3600, rel=1e-12), step
        assert row["time/validation_hours"] == pytest.approx(val / 3600, rel=1e-12), step
        assert row["time/total_hours"] == pytest.approx((train + val) / 3600, rel=1e-12), step
