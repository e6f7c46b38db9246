"""ThroughputMonitor/RuntimeMonitor audit: micro-batches that did not train (Lightning's
training_step returning None) in the flops, the validation after the last logging step, and
the remaining time over a training dataloader of unknown length."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from tests.scripts.vitals_testing import FakeClock, RecordingWriter, quiet_trainer
from trainvitals import RuntimeMonitor, ThroughputMonitor

pl = pytest.importorskip("lightning.pytorch")

BATCHES, BATCH_SIZE = 8, 2


class _Rows(IterableDataset):
    """Rows of 3 features without ``__len__``: Lightning's ``num_training_batches`` is inf."""

    def __init__(self, n: int) -> None:
        self.data = torch.randn(n, 3)

    def __iter__(self):
        yield from self.data


class _Module(pl.LightningModule):
    """One linear layer; every training batch moves ``clock`` by ``forward`` seconds, then, when
    it trains (batch index not in ``skip``), by ``backward`` more; a validation batch by
    ``val`` seconds."""

    def __init__(self, clock, *, skip=(), iterable=False, forward=1.0, backward=2.0, val=0.0):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.clock, self.skip, self.iterable = clock, set(skip), iterable
        self.forward_s, self.backward_s, self.val_s = forward, backward, val

    def training_step(self, batch, batch_idx):
        self.clock.t += self.forward_s
        if batch_idx in self.skip:
            return None  # Lightning: no backward for this batch
        self.clock.t += self.backward_s
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.clock.t += self.val_s

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = _Rows(BATCHES * BATCH_SIZE) if self.iterable else TensorDataset(torch.randn(16, 3))
        collate = None if self.iterable else (lambda rows: torch.stack([r[0] for r in rows]))
        return DataLoader(data, batch_size=BATCH_SIZE, collate_fn=collate)

    def val_dataloader(self):
        return DataLoader(torch.randn(1, 3), batch_size=1)


def _fit(module, callbacks, **trainer_kwargs):
    trainer = quiet_trainer(callbacks=callbacks, log_every_n_steps=1, **trainer_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return trainer


@pytest.mark.parametrize("accumulate", [1, 2])
def test_batches_whose_training_step_returned_none_add_no_flops(accumulate):
    """training_step returning None: no backward, yet Lightning advances global_step. The batch
    was read (samples count) but trained nothing: its samples times flops_per_sample were in
    the flops and MFU keys, which came out twice the trained work here (MFU 0.1, not 0.05)."""
    clock = FakeClock()
    writer = RecordingWriter()
    skip = range(1, BATCHES, 2)  # every other batch
    flops_per_sample, peak = 10.0, 100.0
    monitor = ThroughputMonitor(
        clock=clock,
        window_size=100,
        warmup_steps=0,
        flops_per_sample=flops_per_sample,
        peak_flops=peak,
        writer=writer,
    )
    trainer = _fit(
        _Module(clock, skip=skip),
        [monitor],
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    assert trainer.global_step == BATCHES // accumulate  # skipped batches still step
    row = writer.rows[trainer.global_step - 1]
    seconds = BATCHES * 1.0 + (BATCHES - len(skip)) * 2.0  # forward of all, backward of half
    samples = BATCHES * BATCH_SIZE
    trained = (BATCHES - len(skip)) * BATCH_SIZE
    assert row["throughput/samples_per_sec"] == pytest.approx(samples / seconds)  # data read
    assert row["throughput/seconds_per_step"] == pytest.approx(seconds / trainer.global_step)
    flops_per_sec = trained * flops_per_sample / seconds
    assert row["throughput/flops_per_sec"] == pytest.approx(flops_per_sec)
    assert row["throughput/device/flops_per_sec"] == pytest.approx(flops_per_sec)
    assert row["throughput/mfu"] == pytest.approx(flops_per_sec / peak)
    assert row["throughput/device/mfu"] == pytest.approx(flops_per_sec / peak)


def test_measure_flops_skips_a_first_step_that_did_not_train():
    """measure_flops counts the first step's forward and backward; a first step whose batch
    returned None (here before its forward) counted 0 flops, and the measurement was given up
    for the whole run (measured None, no flops keys). A step with an untrained batch is now
    left for the next one, whose count is that of a trained batch."""
    from trainvitals.stats.flops import measure_flops

    clock = FakeClock()
    writer = RecordingWriter()
    monitor = ThroughputMonitor(clock=clock, warmup_steps=0, measure_flops=True, writer=writer)
    module = _Module(clock, skip={0})
    trainer = _fit(module, [monitor], max_steps=3, num_sanity_val_steps=0, limit_val_batches=0)
    x = torch.randn(BATCH_SIZE, 3)
    layer = torch.nn.Linear(3, 1)
    per_sample = measure_flops(lambda: layer(x).pow(2).mean().backward()) / BATCH_SIZE
    assert trainer.global_step == 3
    assert monitor.state_dict()["measured"] == ["samples", pytest.approx(per_sample)]
    # steps 0 (untrained, no flops), 1 and 2 (trained): 1 + 3 + 3 seconds
    row = writer.rows[2]
    assert row["throughput/flops_per_sec"] == pytest.approx(2 * BATCH_SIZE * per_sample / 7.0)


def test_validation_after_the_last_logging_step_is_written_at_the_end():
    """Lightning validates at the end of each epoch, after its last step logged: the last
    epoch's validation was in no written time/validation or time/total (20 s of 30 s here)."""
    clock = FakeClock()
    writer = RecordingWriter()
    monitor = RuntimeMonitor(clock=clock, warmup_steps=0, time_unit="seconds", writer=writer)
    module = _Module(clock, forward=1.0, backward=0.0, val=10.0)
    trainer = _fit(module, [monitor], max_epochs=3, num_sanity_val_steps=0)
    steps = 3 * BATCHES
    assert trainer.global_step == steps
    assert writer.rows[steps - 1]["time/validation_seconds"] == 20.0  # two of three so far
    assert writer.rows[steps] == {
        "time/train_seconds": float(steps),
        "time/validation_seconds": 30.0,
        "time/total_seconds": steps + 30.0,
    }


def test_driver_final_evaluation_is_written_at_close():
    """The plain loop's final evaluation after its last step: written at close, at the step
    after the last one."""
    from trainvitals.adapters.loop import Vitals

    clock = FakeClock()
    writer = RecordingWriter()
    monitor = RuntimeMonitor(clock=clock, max_steps=3, time_unit="seconds", writer=writer)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    for _ in range(3):
        x = torch.randn(2, 3)
        vitals.batch(x)
        clock.t += 1.0
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    with vitals.validating():
        clock.t += 5.0
    vitals.close()
    assert writer.rows[2]["time/validation_seconds"] == 0.0
    assert writer.rows[3] == {
        "time/train_seconds": 3.0,
        "time/validation_seconds": 5.0,
        "time/total_seconds": 8.0,
    }


def test_remaining_time_over_an_iterable_dataset_once_its_first_epoch_ended():
    """An IterableDataset without __len__ and max_epochs: Lightning's num_training_batches is
    inf, so no horizon and no time/remaining for the whole run, although every epoch after
    the first has a known length (that of the first)."""
    clock = FakeClock()
    writer = RecordingWriter()
    monitor = RuntimeMonitor(clock=clock, warmup_steps=0, time_unit="seconds", writer=writer)
    module = _Module(clock, iterable=True, forward=1.0, backward=0.0)
    epochs = 3
    trainer = _fit(
        module, [monitor], max_epochs=epochs, num_sanity_val_steps=0, limit_val_batches=0
    )
    assert trainer.num_training_batches == float("inf")
    steps = epochs * BATCHES
    assert trainer.global_step == steps
    remaining = writer.key("time/remaining_seconds")
    # 1 s per step; from the first step of the second epoch on, the steps left
    assert remaining == {s: float(steps - s - 1) for s in range(BATCHES, steps)}
    # kept in the checkpoint (a resume mid-epoch, past the first, knows it too)
    assert monitor.state_dict()["epoch_batches"] == BATCHES
