"""How a batch's samples and tokens are found when the loop does not say (the driver's
``vitals.batch(batch)``, a Lightning batch): checked against counts made by hand."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from trainvitals import RuntimeMonitor, ThroughputMonitor
from trainvitals.adapters import FanoutWriter, JsonlSink
from trainvitals.adapters.context import infer_batch_size, infer_num_tokens
from trainvitals.adapters.jsonl import read_jsonl
from trainvitals.adapters.loop import Vitals


@dataclass
class TextBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


@dataclass
class Nested:
    step_seed: int
    text: TextBatch
    extra: list = field(default_factory=list)


def _run(batches, tmp_path):
    """Train a tiny embedding model on ``batches`` (one step each) under the driver with
    ThroughputMonitor and RuntimeMonitor logging every step; the rows written."""
    ticks = itertools.count()

    def clock() -> float:
        return float(next(ticks))

    model = torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = FanoutWriter([JsonlSink(tmp_path / "m.jsonl")], background=False)
    monitors = [
        ThroughputMonitor(clock=clock, warmup_steps=0),
        RuntimeMonitor(clock=clock, warmup_steps=0, max_steps=len(batches)),
    ]
    vitals = Vitals(monitors, writer=writer, log_every_n_steps=1)
    vitals.attach(model, optimizer)
    with vitals:
        for batch, ids in batches:
            vitals.batch(batch)
            model(ids).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    writer.close()
    return {row["step"]: row["metrics"] for row in read_jsonl(tmp_path / "m.jsonl")}


def test_a_dataclass_batch_is_counted_by_its_fields(tmp_path):
    """A batch held in a dataclass (nested too) had no count at all: samples and tokens
    ``None``, so no sample or token rate and no ``time/samples``; Lightning's own
    ``extract_batch_size`` reads dataclass fields."""
    ids = torch.randint(0, 16, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.long)
    assert infer_batch_size(TextBatch(ids, mask)) == 3
    assert infer_num_tokens(TextBatch(ids, mask)) == 15
    nested = Nested(0, TextBatch(ids, mask))
    assert infer_batch_size(nested) == 3
    assert infer_num_tokens(nested) == 15
    assert infer_batch_size(TextBatch) is None  # the class, not a batch

    shapes = [(3, 5), (2, 7), (4, 2)]
    batches = []
    for b, s in shapes:
        ids = torch.randint(0, 16, (b, s))
        batches.append((Nested(0, TextBatch(ids, torch.ones_like(ids))), ids))
    rows = _run(batches, tmp_path)
    samples = tokens = 0
    for step, (b, s) in enumerate(shapes):
        samples, tokens = samples + b, tokens + b * s
        assert rows[step]["time/samples"] == samples
        assert rows[step]["time/tokens"] == tokens
    # the window (all three steps, one clock tick apart per reading) holds every count
    last = rows[len(shapes) - 1]
    assert last["throughput/tokens_per_sec"] / last["throughput/samples_per_sec"] == (
        tokens / samples
    )


def test_integer_labels_after_a_float_input_are_not_tokens(tmp_path):
    """Integer tensors that are not the batch's input were counted as tokens: class labels
    ``[B, 1]`` after float features (4 "tokens" for 4 samples), multi-hot labels after
    images (2 * 80 = 160), a flattened ``uint8`` image ``[B, 784]`` (3136 pixels). Token
    ids are what ``nn.Embedding`` takes (int64/int32) and are the batch's input."""
    x = torch.randn(4, 3)
    assert infer_num_tokens((x, torch.zeros(4, 1, dtype=torch.long))) is None
    pixels = torch.randn(2, 3, 8, 8)
    multi_hot = torch.zeros(2, 80, dtype=torch.long)
    assert infer_num_tokens({"pixel_values": pixels, "labels": multi_hot}) is None
    flat = torch.randint(0, 256, (4, 784), dtype=torch.uint8)
    assert infer_num_tokens((flat, torch.zeros(4, dtype=torch.long))) is None
    assert infer_batch_size((flat, torch.zeros(4, dtype=torch.long))) == 4

    # token ids are still found: after a bool mask, after 1-d per-sample values, as int32
    ids = torch.randint(0, 16, (3, 5))
    assert infer_num_tokens((torch.ones(3, 5, dtype=torch.bool), ids)) == 15
    assert infer_num_tokens({"idx": torch.arange(3), "tokens": ids}) == 15
    assert infer_num_tokens((ids.int(), torch.zeros(3, 1, dtype=torch.long))) == 15
    assert infer_num_tokens({"input_ids": ids, "pixel_values": pixels}) == 15

    # under the driver: samples counted, no token rate nor total written (no wrong number)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 16, (4, 1))
        batches.append(((torch.randn(4, 3), ids), ids))
    rows = _run(batches, tmp_path)
    for step in range(3):
        assert rows[step]["time/samples"] == 4 * (step + 1)
        assert "time/tokens" not in rows[step]
        assert "throughput/tokens_per_sec" not in rows[step]
        assert "throughput/samples_per_sec" in rows[step]
