"""Odd but legal inputs and I/O faults that must not crash a run nor write wrong numbers."""

from __future__ import annotations

import errno
import io
import json
import warnings

import torch

from trainvitals.adapters import FanoutWriter, JsonlSink
from trainvitals.adapters.context import infer_batch_size, infer_num_tokens
from trainvitals.adapters.jsonl import read_jsonl
from trainvitals.adapters.loop import Vitals
from trainvitals.adapters.sinks import jsonl as jsonl_sink
from trainvitals.callbacks.base import VitalsCallback


def test_token_count_is_of_2d_integer_tensors_only():
    """An MNIST-style batch (uint8 images [N, 28, 28], int64 labels [N]) has no tokens; it
    counted every pixel (4 * 28 * 28 = 3136 "tokens"), as did a bool mask [N, S]; the docs
    say "the first 2-d integer tensor"."""
    images = torch.randint(0, 256, (4, 28, 28), dtype=torch.uint8)
    labels = torch.randint(0, 10, (4,))
    assert infer_batch_size((images, labels)) == 4
    assert infer_num_tokens((images, labels)) is None
    mask = torch.ones(4, 8, dtype=torch.bool)
    assert infer_num_tokens((mask, torch.randn(4, 8))) is None
    ids = torch.randint(0, 32, (3, 5))
    assert infer_num_tokens((mask, ids)) == 15  # the first 2-d integer tensor: the ids
    assert infer_num_tokens({"input_ids": torch.zeros(2, 3, 4, dtype=torch.long)}) == 24


def test_a_batch_that_holds_itself_is_counted_and_does_not_end_the_run():
    """A list holding itself before its tensor: the search recursed until RecursionError,
    raised from vitals.batch() (outside the callbacks' guard), ending the run."""
    ids = torch.randint(0, 32, (2, 6))
    batch: list = []
    batch.append(batch)
    batch.append(ids)
    assert infer_batch_size(batch) == 2
    assert infer_num_tokens(batch) == 12

    seen: list[tuple[int | None, int | None]] = []

    class Sizes(VitalsCallback):
        def micro_batch_start(self, ctx, info):
            seen.append((info.batch_size, info.num_tokens))

    model = torch.nn.Embedding(32, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals = Vitals([Sizes()], writer=FanoutWriter([], background=False))
    vitals.attach(model, optimizer)
    with vitals:
        for _ in range(2):
            vitals.batch(batch)
            model(batch[1]).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert seen == [(2, 12), (2, 12)]


class _FullDisk(io.FileIO):
    """A file whose first ``fail`` writes hit a full disk (ENOSPC), as the OS reports it."""

    fail = 0

    def write(self, data):  # type: ignore[override]
        if _FullDisk.fail > 0:
            _FullDisk.fail -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def _open_on_full_disk(path, mode="r", buffering=-1, encoding=None, **kwargs):
    """``open`` of the sink's module, over a :class:`_FullDisk` file: unbuffered binary as
    asked, else with Python's own buffered text layers on top (as ``open`` builds them)."""
    raw = _FullDisk(path, mode.replace("b", "").replace("t", "") or "r")
    if "b" in mode and buffering == 0:
        return raw
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding=encoding or "utf-8")


def test_a_disk_full_write_is_retried_into_one_line_per_step(tmp_path, monkeypatch):
    """The disk is full while step 1 is written, then has room again: the writer retries that
    step. Buffered, the failed line stayed in the file object's buffer and was written with the
    retried one: step 1 appeared 3 times in the file (and two blank lines)."""
    monkeypatch.setattr(jsonl_sink, "open", _open_on_full_disk, raising=False)
    path = tmp_path / "metrics.jsonl"
    writer = FanoutWriter([JsonlSink(path)], background=False, retry_backoff=(0.0, 0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the writer's retry warning)
        for step in range(4):
            if step == 1:
                _FullDisk.fail = 2
            writer.add_scalars({"loss": float(step) / 2}, step)
            writer.flush()
        writer.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if line] == [0, 1, 2, 3]
    assert all(lines)
    rows = read_jsonl(path)
    assert [row["metrics"]["loss"] for row in rows] == [0.0, 0.5, 1.0, 1.5]
