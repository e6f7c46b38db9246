"""ThroughputMonitor, review 24: the global flops and MFU leave out micro-batches that did not
train (Lightning's ``training_step`` returning None) also after a checkpoint, after a resume
and on several ranks; no device read for the sizes of such a micro-batch; a warning when, under
context parallelism, the token count was read off the whole batch."""

from __future__ import annotations

import math
import traceback
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.scripts.vitals_testing import FakeClock, NullWriter, RecordingWriter, quiet_trainer
from trainvitals import RuntimeMonitor, ThroughputMonitor

pl = pytest.importorskip("lightning.pytorch")

WINDOW, FPT, PEAK = 4, 10.0, 1000.0
SKIP = {3}  # global steps whose training_step returns None (no backward)
CKPT_AT = 5  # ModelCheckpoint(every_n_train_steps=5): after steps 0..4


def _seq(i: int) -> int:
    return 3 + i % 4  # tokens per sample of batch i


def _dt(step: int) -> float:
    return 1.0 + step % 3  # seconds the fake clock moves in step ``step``


class _Module(pl.LightningModule):
    """One linear layer; each training_step moves the clock by ``_dt(global_step)`` and notes
    ``truth[global_step] = (tokens, seconds, trained)``; steps in SKIP return None."""

    def __init__(self, clock: FakeClock, truth: dict[int, tuple[int, float, bool]]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.clock, self.truth = clock, truth

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        self.clock.t += _dt(step)
        self.truth[step] = (batch["input_ids"].numel(), _dt(step), step not in SKIP)
        if step in SKIP:
            return None
        return self.layer(batch["x"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = [
            {"input_ids": torch.zeros(2, _seq(i), dtype=torch.long), "x": torch.randn(2, 3)}
            for i in range(6)
        ]
        return torch.utils.data.DataLoader(data, batch_size=None)


def _fit(max_steps: int, tmp: Path, ckpt_path: Path | None = None, save: bool = False):
    """A single-process fit: ``(rows, truth)``; ``save``: a checkpoint after step CKPT_AT - 1."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    clock, truth, writer = FakeClock(), {}, RecordingWriter()
    monitor = ThroughputMonitor(
        window_size=WINDOW, clock=clock, writer=writer, flops_per_token=FPT, peak_flops=PEAK
    )
    callbacks: list = [monitor]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=tmp, every_n_train_steps=CKPT_AT, save_top_k=-1))
    trainer = quiet_trainer(
        max_steps=max_steps,
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=save,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Module(clock, truth), ckpt_path=ckpt_path)
    return writer.rows, truth


def _expected(entries: list[tuple[int, float, bool]]) -> dict[str, float]:
    """Rates of a window of ``(tokens, seconds, trained)`` entries of one process (float64)."""
    seconds = math.fsum(s for _, s, _ in entries)
    tokens = math.fsum(t for t, _, _ in entries)
    flops = FPT * math.fsum(t for t, _, trained in entries if trained)
    return {
        "throughput/tokens_per_sec": tokens / seconds,
        "throughput/flops_per_sec": flops / seconds,
        "throughput/device/flops_per_sec": flops / seconds,
        "throughput/mfu": flops / seconds / PEAK,
        "throughput/device/mfu": flops / seconds / PEAK,
    }


def _check(rows, truth, windows) -> None:
    """Every row against the window of entries ``windows[step]`` (steps of ``truth``)."""
    assert sorted(rows) == sorted(windows)
    for step, window in windows.items():
        expected = _expected([truth[s] for s in window])
        got = {k: rows[step].get(k) for k in expected}
        assert got == pytest.approx(expected, rel=1e-12), (step, window)


def _run_with_checkpoint(tmp_path: Path):
    rows, truth = _fit(9, tmp_path, save=True)
    (ckpt,) = tmp_path.glob(f"*step={CKPT_AT}.ckpt")
    return rows, truth, ckpt


def test_untrained_micro_batches_add_no_flops_after_a_checkpoint_and_a_resume(tmp_path):
    """A checkpoint made the window's entries global, and the global flops then counted the
    tokens of the step that did not train (step 3): flops_per_sec 1.25x the trained work at
    steps 5 and 6 here, the device keys right; the same after a resume (steps 6 and 7)."""
    rows, truth, ckpt = _run_with_checkpoint(tmp_path)
    assert sorted(truth) == list(range(9)) and not truth[3][2]
    # warm-up: step 0 out of the window
    _check(rows, truth, {s: list(range(max(1, s - WINDOW + 1), s + 1)) for s in range(1, 9)})
    # 1.25x: the skipped step is in the window of steps 5 and 6, which follow the checkpoint
    assert rows[5]["throughput/flops_per_sec"] < FPT * rows[5]["throughput/tokens_per_sec"]

    # Resumed: the checkpoint's window holds steps 1-4 (written alone at step 5, the
    # resumed first step, which is warm-up).
    rows_b, truth_b = _fit(9, tmp_path, ckpt_path=ckpt)
    truth_b = {**{s: truth[s] for s in range(1, CKPT_AT)}, **truth_b}
    eligible = [1, 2, 3, 4, 6, 7, 8]
    windows = {s: [e for e in eligible if e <= s][-WINDOW:] for s in range(CKPT_AT, 9)}
    _check(rows_b, truth_b, windows)

    # A checkpoint saved before the state kept the untrained counts loads: its restored
    # entries are taken as trained in the global flops (the skipped step's tokens counted, as
    # before), the device keys stay exact (each entry's own flops are in its record)
    state = torch.load(ckpt, weights_only=False)
    (key,) = [k for k, v in state["callbacks"].items() if "window" in v]
    del state["callbacks"][key]["untrained"]
    old = tmp_path / "old" / "old.ckpt"
    old.parent.mkdir()
    torch.save(state, old)
    rows_c, truth_c = _fit(9, tmp_path / "old", ckpt_path=old)
    assert sorted(rows_c) == sorted(windows)
    for step, window in windows.items():
        exact = _expected([{**truth, **truth_c}[s] for s in window])
        as_trained = _expected([(*{**truth, **truth_c}[s][:2], True) for s in window])
        for k, v in exact.items():
            expected = as_trained[k] if k in ("throughput/flops_per_sec", "throughput/mfu") else v
            assert rows_c[step][k] == pytest.approx(expected, rel=1e-12), (step, k)


def _resume_on_two_ranks(rank: int, world_size: int, state: dict) -> dict:
    from trainvitals.adapters.loop import Vitals

    clock, writer = FakeClock(), RecordingWriter()
    monitor = ThroughputMonitor(
        window_size=WINDOW, clock=clock, flops_per_token=FPT, peak_flops=PEAK
    )
    monitor.load_state_dict(state)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, optimizer)
    for _ in range(3):
        vitals.batch({"input_ids": torch.zeros(1 + rank, 5, dtype=torch.long)})
        clock.t += 1.5
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    vitals.close()
    return writer.rows


def test_untrained_micro_batches_restored_on_two_ranks_add_no_flops(tmp_path):
    """The single-process checkpoint (its window holding the step that did not train)
    resumed on 2 gloo ranks: the restored entries' global counts are its own, the skipped
    step's tokens in them; its flops must stay out of the global flops and MFU."""
    _, truth, ckpt = _run_with_checkpoint(tmp_path)
    state = torch.load(ckpt, weights_only=False)
    (monitor_state,) = [v for v in state["callbacks"].values() if "window" in v]
    rows = run_distributed(_resume_on_two_ranks, 2, args=(monitor_state,), timeout=120)[0]
    # Driver step 2: the window holds restored steps 3 and 4 (world 1) and live steps 1 and
    # 2 (world 2: 1x5 and 2x5 tokens a step), step 0 being the warm-up.
    restored = [truth[3], truth[4]]
    seconds = math.fsum(s for _, s, _ in restored) + 2 * 1.5
    tokens = math.fsum(t for t, _, _ in restored) + 2 * (5 + 10)
    flops = FPT * (math.fsum(t for t, _, trained in restored if trained) + 2 * (5 + 10))
    device_flops = FPT * (math.fsum(t for t, _, trained in restored if trained) + 2 * 5)
    device_seconds = math.fsum(s for _, s, _ in restored) + 2 * 1.5 * 2
    expected = {
        "throughput/tokens_per_sec": tokens / seconds,
        "throughput/flops_per_sec": flops / seconds,
        "throughput/mfu": flops / (device_seconds * PEAK),
        "throughput/device/flops_per_sec": device_flops / seconds,
        "throughput/device/mfu": device_flops / seconds / PEAK,
    }
    assert {k: rows[2].get(k) for k in expected} == pytest.approx(expected, rel=1e-12)


def test_skipped_batches_read_no_device_tensor_on_non_logging_steps():
    """num_tokens_fn returning a 0-d tensor (attention_mask.sum(), on the GPU a device
    tensor) and batches whose training_step returns None: ``tokens or 0`` asked the tensor
    for its truth value (a device sync on CUDA) at every such batch (3 calls here)."""
    calls: list[str] = []
    original = torch.Tensor.__bool__
    logging = [False]

    def counting_bool(self):
        caller = traceback.extract_stack(limit=2)[0]
        if "trainvitals" in caller.filename and not logging[0]:
            calls.append(f"{caller.filename}:{caller.lineno}")
        return original(self)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            logging[0] = self.trainer.global_step % 100 == 0
            if batch_idx % 3 == 1:
                return None
            return self.layer(batch["x"]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            data = [
                {"attention_mask": torch.ones(2, 4, dtype=torch.long), "x": torch.randn(2, 3)}
                for _ in range(9)
            ]
            return torch.utils.data.DataLoader(data, batch_size=None)

    monitor = ThroughputMonitor(
        writer=NullWriter(),
        num_tokens_fn=lambda b: b["attention_mask"].sum(),
        log_every_n_steps=100,
    )
    trainer = quiet_trainer(max_steps=9, callbacks=[monitor])
    torch.Tensor.__bool__ = counting_bool
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Module())
    finally:
        torch.Tensor.__bool__ = original
    assert trainer.global_step == 9
    assert calls == []
    # (the skipped batches' tokens still count as read: 9 batches of 8 tokens)
    assert float(monitor.state_dict()["totals"]["tokens"]) == 72.0


def _cp_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from trainvitals.adapters.loop import Vitals
    from trainvitals.distributed import ProcessGroups

    groups = ProcessGroups.from_device_mesh(
        init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    )
    out = {}
    variants = {  # batch() arguments, the monitors' num_tokens_fn
        "inferred": ({}, None),
        "given": ({"num_tokens": 4}, None),  # this rank's slice of the 8-token sequence
        "given_tensor": ({"num_tokens": torch.tensor(4)}, None),
        "given_fn": ({}, lambda b: 4),
    }
    for name, (kwargs, fn) in variants.items():
        clock, writer = FakeClock(), RecordingWriter()
        callbacks = [
            ThroughputMonitor(clock=clock, window_size=4, num_tokens_fn=fn),
            RuntimeMonitor(clock=clock, time_unit="seconds", num_tokens_fn=fn),
        ]
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        vitals = Vitals(callbacks, writer=writer, log_every_n_steps=3, groups=groups)
        vitals.attach(model, optimizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                vitals.batch({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, **kwargs)
                clock.t += 1.0
                model(torch.randn(2, 3)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            vitals.close()
        out[name] = {
            "warned": sorted(
                str(w.message).split(":")[0]
                for w in caught
                if "context-parallel ranks" in str(w.message)
            ),
            "tokens": writer.rows[3]["time/tokens"],
        }
    return out


def test_context_parallel_tokens_read_off_the_batch_are_warned_about():
    """Mesh (dp=1, cp=2): tokens are summed over the cp ranks, so each must count its own
    slice. Told the whole 8-token sequence, each rank counted 8 (time/tokens 64 for 4 steps
    of one 8-token sequence: 2x), silently; now both monitors warn once. A count given
    (num_tokens=, a 0-d tensor, num_tokens_fn) is not warned about, and is right."""
    for result in run_distributed(_cp_body, 2, timeout=120):
        assert result["inferred"]["warned"] == ["RuntimeMonitor", "ThroughputMonitor"]
        assert result["inferred"]["tokens"] == 2 * 4 * 8  # what the warning is about
        for name in ("given", "given_tensor", "given_fn"):
            assert result[name]["warned"] == []
            assert result[name]["tokens"] == 4 * 8  # 4 steps of one 8-token sequence
