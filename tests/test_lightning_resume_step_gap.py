"""The logging decision of the first batch of a Lightning fit that continues an earlier one
(``fit(ckpt_path=)``, a second ``fit`` on the same trainer) under manual optimization with two
optimizers stepped per batch: ``global_step`` advances by 2 per batch there, so the batch at the
resume point is 2 steps past the previous one, as in an uninterrupted run. Taking it as 1 step
lost the multiple of the interval just before the resume point (``log_every_n_steps=3``,
resumed at step 10: step 9's point, logged by the batch at 10 in an uninterrupted run)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.scripts.vitals_testing import (
    RecordingWriter,
    manual_optimization_module,
    quiet_trainer,
)
from trainvitals.callbacks.norm_monitor import NormMonitor

EVERY = 3
SAMPLES = 10  # 5 batches of 2 per epoch: 10 optimizer steps per epoch (2 per batch)
EPOCHS = 3


def _expected_steps(starts: list[int], every: int) -> list[int]:
    """Each multiple of ``every`` up to the last batch start is logged by the first batch
    starting at or after it (docs/callbacks.md, manual optimization)."""
    return sorted({min(s for s in starts if s >= m) for m in range(0, starts[-1] + 1, every)})


def _module():
    torch.manual_seed(0)
    module = manual_optimization_module([nn.Linear(3, 1), nn.Linear(3, 1)], SAMPLES)
    # the same data at every fit (the helper draws it when the fit asks for the dataloader)
    data = torch.randn(SAMPLES, 3, generator=torch.Generator().manual_seed(1))
    module.train_dataloader = lambda: torch.utils.data.DataLoader(data, batch_size=2)
    return module


def _trainer(pl, callbacks, tmp, **kwargs):
    return quiet_trainer(
        pl.__name__,
        callbacks=callbacks,
        devices=1,
        default_root_dir=str(tmp),
        log_every_n_steps=EVERY,
        **kwargs,
    )


def _uninterrupted(pl, tmp) -> dict[int, dict[str, float]]:
    writer = RecordingWriter()
    _trainer(pl, [NormMonitor(writer=writer)], tmp / "full", max_epochs=EPOCHS).fit(_module())
    return writer.rows


@pytest.mark.parametrize("how", ["ckpt_path", "second_fit"])
def test_first_batch_after_resume_keeps_the_two_step_gap(tmp_path, how):
    import lightning.pytorch as pl

    full = _uninterrupted(pl, tmp_path)
    starts = list(range(0, EPOCHS * SAMPLES, 2))  # batch starts: 0, 2, 4, ..., 28
    expected = _expected_steps(starts, EVERY)
    assert expected == [0, 4, 6, 10, 12, 16, 18, 22, 24, 28]
    assert sorted(full) == expected

    writer = RecordingWriter()
    module = _module()
    trainer = _trainer(pl, [NormMonitor(writer=writer)], tmp_path / "a", max_epochs=1)
    trainer.fit(module)
    assert trainer.global_step == SAMPLES  # the resume point: step 10, one epoch
    assert sorted(writer.rows) == [0, 4, 6]
    if how == "ckpt_path":
        ckpt = tmp_path / "epoch0.ckpt"
        trainer.save_checkpoint(ckpt)
        writer = RecordingWriter()
        resumed = _trainer(pl, [NormMonitor(writer=writer)], tmp_path / "b", max_epochs=EPOCHS)
        resumed.fit(_module(), ckpt_path=ckpt)
    else:  # the same trainer, module and callback go on with a larger epoch limit
        trainer.fit_loop.max_epochs = EPOCHS
        trainer.fit(module)
    second = {s: row for s, row in writer.rows.items() if s >= SAMPLES}
    assert sorted(second) == [s for s in expected if s >= SAMPLES]
    # the resumed run's values are the uninterrupted run's, step 10 included
    for step, row in second.items():
        assert row.keys() == full[step].keys()
        for key, value in row.items():
            assert value == pytest.approx(full[step][key], rel=1e-6, abs=1e-9), (step, key)


def test_a_checkpoint_without_the_record_resumes_with_a_gap_of_one(tmp_path):
    """A checkpoint saved without trainvitals' record (an older one): the gap is unknown and
    taken as 1, as before (the multiple just before the resume point is not logged)."""
    import lightning.pytorch as pl

    trainer = _trainer(pl, [NormMonitor(writer=RecordingWriter())], tmp_path, max_epochs=1)
    trainer.fit(_module())
    ckpt = tmp_path / "epoch0.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=True)  # plain ints: weights_only reads it
    assert state["trainvitals_lightning"] == {"batch_start_step": SAMPLES - 2, "step_gap": 2}
    del state["trainvitals_lightning"]
    torch.save(state, ckpt)
    writer = RecordingWriter()
    _trainer(pl, [NormMonitor(writer=writer)], tmp_path, max_epochs=2).fit(
        _module(), ckpt_path=ckpt
    )
    assert sorted(writer.rows) == [12, 16, 18]
