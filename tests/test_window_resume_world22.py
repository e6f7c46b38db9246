"""A checkpoint taken inside a gradient-accumulation window, resumed on another number of ranks.

The checkpoint carries the sizes of the open step's micro-batches per rank (its "carried"
rows), told again to the callbacks when the resumed run goes on inside that window. Resumed on
another world size, every new rank replayed rank 0's row: the other old ranks' micro-batches
were lost (2 ranks -> 1: ``time/batches`` 10 for 11 at the restored step), or rank 0's counted
once per new rank (1 -> 2: 8 for 7). Now the new rank 0 replays every old rank's rows and the
other ranks none: the step's batches, samples and tokens summed over the ranks are those run.
Expected counts are summed here, independently, over every micro-batch each process ran.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import RuntimeMonitor, ThroughputMonitor

ACC = 2  # micro-batches per optimizer step
N = 8  # micro-batches per rank of the whole run: 4 steps
SPLIT = 5  # the checkpoint after micro-batch 5: step 2 holds 1 of its 2
KEYS = ("time/batches", "time/samples", "time/tokens")


def _samples(run: str, rank: int, i: int) -> int:
    # ranks' micro-batches differ in size, and the resumed run's from the saving run's
    return 2 + i % 3 + 4 * rank + (1 if run == "after" else 0)


def _seq(run: str, rank: int) -> int:
    return 3 + rank + (2 if run == "after" else 0)


def _fixed(run: str, rank: int, i: int) -> int:
    return _samples(run, rank, 0)  # (under Lightning every batch of a rank has one size)


def _expected(old: int, new: int, first: int, last: int, size=_samples) -> dict:
    """Cumulative batches, samples and tokens at the end of each step from ``first`` to
    ``last``: sums over every micro-batch that the ``old`` ranks ran before the checkpoint and
    the ``new`` ranks after it."""

    def counts(end: int) -> list[float]:
        ran = [("before", r, i) for r in range(old) for i in range(min(SPLIT, end))]
        ran += [("after", r, i) for r in range(new) for i in range(SPLIT, end)]
        return [
            float(len(ran)),
            float(sum(size(*m) for m in ran)),
            float(sum(size(*m) * _seq(m[0], m[1]) for m in ran)),
        ]

    return {s: counts(ACC * (s + 1)) for s in range(first, last + 1)}


# ---------------------------------------------------------------- the driver (Vitals)


def _driver(writer: RecordingWriter) -> tuple[Vitals, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Embedding(16, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callbacks = [RuntimeMonitor(max_steps=N // ACC), ThroughputMonitor(warmup_steps=0)]
    vitals = Vitals(callbacks, writer=writer, log_every_n_steps=1, accumulate_grad_batches=ACC)
    return vitals.attach(model, optimizer), model, optimizer


def _train(run: str, rank: int, micro_batches: range, state: dict | None = None) -> dict:
    """Micro-batches ``micro_batches`` of this rank under a fresh driver (restored from
    ``state`` first, if given); the state taken at the end (on every rank) and rank 0's rows."""
    writer = RecordingWriter()
    vitals, model, optimizer = _driver(writer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if state is not None:
            vitals.load_state_dict(state)
    for i in micro_batches:
        ids = torch.randint(0, 16, (_samples(run, rank, i), _seq(run, rank)))
        vitals.batch({"input_ids": ids})
        model(ids).sum().backward()
        if i % ACC == ACC - 1:
            optimizer.step()
            optimizer.zero_grad()
    state = vitals.state_dict()  # (collective: on every rank)
    vitals.close()
    return {
        "state": state,
        "rows": {s: [writer.rows[s][k] for k in KEYS] for s in sorted(writer.rows)},
        "totals": vitals.state_dict()["callbacks"]["ThroughputMonitor"]["totals"],
        "warnings": [str(w.message) for w in caught],
    }


def _save_on_ranks(rank: int, world_size: int) -> dict:
    return _train("before", rank, range(SPLIT))["state"]


def _resume_on_ranks(rank: int, world_size: int, state: dict) -> dict:
    out = _train("after", rank, range(SPLIT, N), state)
    del out["state"]
    return out


def _check_driver(result: dict, old_world: int, new_world: int) -> None:
    expected = _expected(old_world, new_world, SPLIT // ACC, N // ACC - 1)
    assert result["rows"] == expected
    batches, samples, tokens = expected[N // ACC - 1]
    # ThroughputMonitor's totals (summed over the ranks when the state is taken): the run's
    assert result["totals"] == {
        "steps": float(N // ACC),
        "batches": batches,
        "samples": samples,
        "tokens": tokens,
    }


@pytest.mark.timeout(120)
def test_driver_window_saved_on_two_ranks_resumed_on_one():
    # rank 0's copy of the state, as a checkpoint keeps it (every rank's rows gathered into it)
    state = run_distributed(_save_on_ranks, world_size=2, timeout=90)[0]
    result = _train("after", 0, range(SPLIT, N), state)
    # before: rank 1's carried micro-batch was lost (time/batches 10 for 11 at step 2)
    _check_driver(result, old_world=2, new_world=1)
    assert any(
        w.startswith("Vitals.load_state_dict: ") and "on 2 ranks, this run has 1" in w
        for w in result["warnings"]
    ), result["warnings"]


@pytest.mark.timeout(120)
def test_driver_window_saved_on_one_rank_resumed_on_two():
    state = _train("before", 0, range(SPLIT))["state"]
    results = run_distributed(_resume_on_ranks, world_size=2, args=(state,), timeout=90)
    # before: rank 0's carried micro-batch was counted on both new ranks (8 for 7 at step 2)
    _check_driver(results[0], old_world=1, new_world=2)
    for rank, result in enumerate(results):
        # (the totals are summed on every rank: each holds the run's)
        assert result["totals"] == results[0]["totals"], rank
        assert any(
            "on 1 rank, this run has 2" in w and "samples and tokens summed" in w
            for w in result["warnings"]
        ), (rank, result["warnings"])


def test_rank_0s_sizes_stand_for_every_old_rank_without_the_rows():
    """Saved on 3 ranks without the gathered rows (no callback whose state is collective): the
    checkpoint holds rank 0's sizes and the world size. Restored in one process, each old
    rank's micro-batch is counted (as rank 0's sizes), not rank 0's alone; an older checkpoint
    without the world size keeps rank 0's row."""
    from trainvitals.adapters.loop import _own_window

    window = [{"RuntimeMonitor": [2, 6]}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _own_window({"micro_batches_in_step": window, "world_size": 3}) == window * 3
    assert any("on 3 ranks, this run has 1" in str(w.message) for w in caught)
    assert _own_window({"micro_batches_in_step": window}) == window
    assert _own_window({"micro_batches_in_step": window, "world_size": 1}) == window


# ---------------------------------------------------------------- Lightning


def _fit(pl, tmp: str, run: str, rank: int, devices: int, max_steps: int, ckpt=None) -> dict:
    """A fit of ``devices`` ranks (DDP over the initialised gloo group when more than one);
    the first (``ckpt`` None) saves a checkpoint inside step 2's window, after micro-batch 5."""
    bs, seq = _samples(run, rank, 0), _seq(run, rank)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(16, 2)

        def training_step(self, batch, batch_idx):
            return self.emb(batch["input_ids"]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            # every batch of a rank the same size (Lightning restarts a dataloader that is not
            # resumable from its start; the batch index goes on)
            data = [{"input_ids": torch.randint(0, 16, (seq,))} for _ in range(N * bs)]
            return torch.utils.data.DataLoader(data, batch_size=bs)

    class Save(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == SPLIT - 1 and ckpt is None:
                trainer.save_checkpoint(f"{tmp}/mid.ckpt")  # (every rank: collective state)

    writer = RecordingWriter()
    callbacks = [RuntimeMonitor(writer=writer), ThroughputMonitor(warmup_steps=0), Save()]
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp, log_every_n_steps=1,
        accumulate_grad_batches=ACC, max_steps=max_steps, use_distributed_sampler=False,
        callbacks=callbacks,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Module(), ckpt_path=ckpt)
    return {
        "rows": {s: [writer.rows[s][k] for k in KEYS] for s in sorted(writer.rows)},
        "warnings": [str(w.message) for w in caught],
    }


def _lightning_save(rank: int, world_size: int, tmp: str) -> dict:
    import lightning.pytorch as pl

    return _fit(pl, tmp, "before", rank, world_size, max_steps=3)


def _lightning_resume(rank: int, world_size: int, tmp: str) -> dict:
    import lightning.pytorch as pl

    return _fit(pl, tmp, "after", rank, world_size, max_steps=N // ACC, ckpt=f"{tmp}/mid.ckpt")


@pytest.mark.timeout(180)
def test_lightning_window_saved_on_two_devices_resumed_on_one(tmp_path):
    import lightning.pytorch as pl

    run_distributed(_lightning_save, world_size=2, args=(str(tmp_path),), timeout=150)
    result = _fit(pl, str(tmp_path), "after", 0, 1, N // ACC, ckpt=f"{tmp_path}/mid.ckpt")
    # before: time/batches 10, 12 at steps 2, 3 (true 11, 13), rank 1's samples lost
    assert result["rows"] == _expected(2, 1, SPLIT // ACC, N // ACC - 1, _fixed)
    assert any(
        w.startswith("trainvitals (Lightning fit(ckpt_path=)): ") and "on 2 ranks" in w
        for w in result["warnings"]
    ), result["warnings"]


@pytest.mark.timeout(180)
def test_lightning_window_saved_on_one_device_resumed_on_two(tmp_path):
    import lightning.pytorch as pl

    _fit(pl, str(tmp_path), "before", 0, 1, max_steps=3)
    results = run_distributed(_lightning_resume, world_size=2, args=(str(tmp_path),), timeout=150)
    # before: time/batches 8, 12 at steps 2, 3 (true 7, 11)
    assert results[0]["rows"] == _expected(1, 2, SPLIT // ACC, N // ACC - 1, _fixed)
