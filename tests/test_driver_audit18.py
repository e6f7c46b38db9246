"""Three gaps of the driver and the Lightning callbacks: ``accelerator.free_memory()`` with a
driver still attached (it kept running its callbacks on the next training's gradients), a
Lightning fit resumed from a checkpoint taken inside an accumulation window (the carried
micro-batches were lost from every count), and a multi-rank driver that nothing closed (its
close ran after the writer's, and what it logged was dropped)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import torchrun
from tests.scripts.vitals_testing import FakeClock, RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import NormMonitor, RuntimeMonitor, ThroughputMonitor
from trainvitals.callbacks.base import VitalsCallback

ROOT = Path(__file__).resolve().parents[1]
TWO_RANK_GAN = ROOT / "tests" / "scripts" / "two_rank_gan_end.py"


class _Events(VitalsCallback):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []

    def before_optimizer_step(self, ctx):
        self.events.append(("grads", ctx.step))

    def step_end(self, ctx):
        self.events.append(("end", ctx.step))

    def run_end(self, ctx):
        self.events.append(("run_end", ctx.step))


# ---------------------------------------------------------------- 1. accelerator.free_memory()


def test_free_memory_closes_the_driver_of_the_freed_training():
    """Two trainings on one accelerator, ``free_memory()`` between them (as Accelerate's docs
    say). The first driver, never closed (an attempt that failed), stayed attached to the
    accelerator's clipping: at the second training's first ``clip_grad_norm_`` it was shown
    gradients and its NormMonitor wrote a row at its step 2 from the freed model. Now
    ``free_memory()`` closes it: its run ends at step 2 and it sees nothing of the second
    training, whose own norms are those computed by hand."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)

    def training(steps: int, free_first: bool):
        if free_first:
            accelerator.free_memory()
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        writer, events = RecordingWriter(), _Events()
        callbacks = [NormMonitor(), events]
        vitals = Vitals(callbacks, writer=writer, accelerator=accelerator, log_every_n_steps=1)
        vitals.attach(model, optimizer)
        norms = []
        for _ in range(steps):
            x = torch.randn(4, 3)
            vitals.batch(x)
            accelerator.backward(model(x).pow(2).mean())
            grads = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
            norms.append(grads.norm().item())
            accelerator.clip_grad_norm_(model.parameters(), 0.01)
            optimizer.step()
            optimizer.zero_grad()
        return vitals, writer, events, norms

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (NormMonitor on the freed model, before the fix)
        _, first_rows, first_events, _ = training(2, free_first=False)
        _, rows, events, norms = training(3, free_first=True)
    assert first_events.events == [("grads", 0), ("end", 0), ("grads", 1), ("end", 1),
                                   ("run_end", 2)]  # fmt: skip
    assert sorted(first_rows.rows) == [0, 1]
    assert rows.key("l2_norm/grad/global") == pytest.approx(dict(enumerate(norms)), rel=1e-6)
    accelerator.end_training()
    assert events.events[-1] == ("run_end", 3)
    # every wrapper of both drivers is gone: the accelerator's own methods again
    assert not {"clip_grad_norm_", "unscale_gradients", "free_memory"} & set(vars(accelerator))


# ---------------------------------------------------------------- 2. Lightning, inside a window

ACC = 4  # micro-batches per optimizer step
SIZES = [2 + i % 3 for i in range(12)]  # 3 optimizer steps of micro-batches of varied size


def _lightning_run(tmp_path: Path, save_at: int | None = None, ckpt: Path | None = None):
    import lightning.pytorch as pl

    clock = FakeClock()
    trained: list[tuple[int, int]] = []  # (batch_idx, samples) of each batch trained

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            clock.t += 1.0
            trained.append((batch_idx, len(batch)))
            return self.lin(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(1)
            data = [torch.randn(s, 3, generator=generator) for s in SIZES]
            return torch.utils.data.DataLoader(data, batch_size=None)

    class Save(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == save_at:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    rows = RecordingWriter()
    callbacks = [
        RuntimeMonitor(clock=clock, writer=rows, max_steps=len(SIZES) // ACC),
        ThroughputMonitor(clock=clock, writer=rows),
        Save(),
    ]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        log_every_n_steps=1, accumulate_grad_batches=ACC, max_epochs=1, callbacks=callbacks,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Lightning: the dataloader is not resumable)
        trainer.fit(Module(), ckpt_path=ckpt)
    return rows, trained


@pytest.mark.parametrize("save_at", [5, 6])
def test_lightning_resume_inside_an_accumulation_window_counts_the_carried_micro_batches(
    tmp_path, save_at
):
    """A checkpoint after micro-batch 5 (or 6) of 12, inside step 1's window (batches 4-7):
    Lightning resumes at the next micro-batch and steps at the window's end, so step 1 holds
    the 2 (3) micro-batches trained before the checkpoint. They were lost from the counts:
    ``time/batches`` 6 (5) at step 1 instead of 8, ``time/samples`` short by their 7 (9)
    samples, and every later cumulative count short by as much. Now the checkpoint carries
    their sizes and the resumed fit tells them first: the counts of the batches trained, by
    hand. (Lightning restarts a dataloader that is not resumable from its start, with the
    batch index going on: the samples are summed over what each fit trained.)"""
    _, before = _lightning_run(tmp_path, save_at=save_at)
    rows, after = _lightning_run(tmp_path, ckpt=tmp_path / "mid.ckpt")
    assert [i for i, _ in after] == list(range(save_at + 1, len(SIZES)))  # on, mid-window
    trained = before[: save_at + 1] + after
    for step in (1, 2):
        n = ACC * (step + 1)
        assert rows.rows[step]["time/batches"] == n
        assert rows.rows[step]["time/samples"] == sum(size for _, size in trained[:n])
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=True)["trainvitals_lightning"]
    carried = saved["micro_batches_in_step"]
    assert len(carried) == save_at + 1 - ACC
    # as told: int samples (an int was written as a float before), no tokens (a float batch)
    assert [sizes["RuntimeMonitor"] for sizes in carried] == [
        [size, None] for _, size in before[ACC : save_at + 1]
    ]
    assert all(type(sizes["RuntimeMonitor"][0]) is int for sizes in carried)


def test_lightning_checkpoint_between_steps_carries_no_micro_batch(tmp_path):
    """A checkpoint right after a step (batch 7 stepped): nothing to carry; the counts go on
    from the restored state alone."""
    _, before = _lightning_run(tmp_path, save_at=7)
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=True)["trainvitals_lightning"]
    assert "micro_batches_in_step" not in saved
    rows, after = _lightning_run(tmp_path, ckpt=tmp_path / "mid.ckpt")
    assert [i for i, _ in after] == list(range(8, 12))
    assert rows.rows[2]["time/batches"] == 12
    assert rows.rows[2]["time/samples"] == sum(size for _, size in before[:8] + after)


# ---------------------------------------------------------------- 3. never closed, two ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("end", ["never_closed", "never_closed_validate"])
def test_a_driver_nothing_closed_writes_its_close_before_the_writer_closes(tmp_path, end):
    """Two ranks, several optimizers, nothing closes the driver. Its close at exit (which ends
    the last batch's step, and writes the time of a validation after the last logging step)
    ran after the writers' own exit hook had closed rank 0's writer: step 2 (``train``), or
    the run-end row at step 3 (``validate``), was dropped with "values logged after close()".
    Now the drivers close first: every row is written, samples summed over both ranks."""
    proc = torchrun(TWO_RANK_GAN, str(tmp_path), "several", end)
    assert "after close()" not in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    per_step = sum(2 + 3 * r for r in (0, 1))
    got = {r["step"]: r["metrics"] for r in rows}
    for s in range(3):
        assert (got[s]["time/batches"], got[s]["time/samples"]) == (
            2.0 * (s + 1),
            per_step * (s + 1),
        )
    if end == "never_closed_validate":
        assert set(got[3]) == {"time/train_hours", "time/validation_hours", "time/total_hours"}
        assert got[3]["time/total_hours"] >= got[2]["time/total_hours"]
    else:
        assert sorted(got) == [0, 1, 2]
