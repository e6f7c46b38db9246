"""One test that runs every callback (Composer's registry-driven style).

For each callback in ``trainvitals.callbacks`` it trains the tiny MoE model for a few optimizer
steps with gradient accumulation under the driver and checks that the callback:

* writes only on logging steps (0, 2, 4 with an interval of 2);
* writes only keys that its docstring's key table documents;
* keeps a ``state_dict`` that survives ``torch.save``/``torch.load`` and loads back;
* runs with every other callback at once under Lightning, into real backends.
"""

from __future__ import annotations

import inspect
import math
import re

import pytest
import torch

import trainvitals
from trainvitals import callbacks as tv_callbacks
from trainvitals.adapters import FanoutWriter, JsonlSink
from trainvitals.adapters.jsonl import read_jsonl
from trainvitals.adapters.loop import Vitals
from trainvitals.moe import TinyMoELM, destroy_moe_metrics_tracker

CALLBACK_NAMES = sorted(tv_callbacks._MODULES)
STEPS = 5
INTERVAL = 2
MICRO_BATCHES = 2


def _model() -> TinyMoELM:
    torch.manual_seed(0)
    return TinyMoELM(
        vocab_size=32,
        hidden_size=16,
        num_layers=3,
        num_experts=4,
        top_k=2,
        ffn_hidden_size=16,
        num_heads=2,
        max_seq_len=16,
    )


def _batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 32, (2, 9), generator=generator)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def _documented_key_patterns(cls: type) -> list[re.Pattern[str]]:
    """Every ``area/metric`` literal in the class docstring as a regex: ``<name>`` and
    ``{name}`` are wildcards, ``{a,b,c}`` is one of the alternatives."""
    doc = inspect.getdoc(cls) or ""
    literals = re.findall(r"``([A-Za-z0-9_./<>{},\-]+/[A-Za-z0-9_./<>{},\-]+)``", doc)
    return [documented_key_pattern(literal) for literal in literals]


def documented_key_pattern(literal: str) -> re.Pattern[str]:
    """A documented key as a regex: ``{a,b}`` is one of the alternatives, ``{x}``/``<x>`` any
    non-empty text."""
    regex = ""
    for part in re.split(r"(<[^>]*>|\{[^}]*\})", literal):
        if part.startswith("{") and "," in part:
            regex += "(" + "|".join(re.escape(a) for a in part[1:-1].split(",")) + ")"
        elif part[:1] in ("<", "{"):
            regex += ".+"
        else:
            regex += re.escape(part)
    return re.compile(f"^{regex}$")


def _run_driver(callbacks: list, tmp_path) -> tuple[list[dict], Vitals]:
    destroy_moe_metrics_tracker()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    writer = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")], background=False)
    generator = torch.Generator().manual_seed(1)
    vitals = Vitals(callbacks, writer=writer, log_every_n_steps=INTERVAL, run_dir=tmp_path)
    vitals.attach(model, optimizer)
    with vitals:
        for _ in range(STEPS):
            for _ in range(MICRO_BATCHES):
                batch = _batch(generator)
                vitals.batch(batch)
                loss = model(batch["input_ids"], labels=batch["labels"]).loss
                (loss / MICRO_BATCHES).backward()
            optimizer.step()
            optimizer.zero_grad()
    writer.close()
    return read_jsonl(tmp_path / "metrics.jsonl"), vitals


def test_every_public_callback_is_registered():
    assert set(CALLBACK_NAMES) == set(trainvitals._CALLBACKS)
    for name in CALLBACK_NAMES:
        cls = getattr(trainvitals, name)
        assert isinstance(cls(), tv_callbacks.VitalsCallback)


@pytest.mark.parametrize("name", CALLBACK_NAMES)
def test_callback_under_driver(name, tmp_path):
    cls = getattr(tv_callbacks, name)
    kwargs = {"warmup_steps": 0} if "warmup_steps" in inspect.signature(cls).parameters else {}
    callback = cls(**kwargs)
    rows, vitals = _run_driver([callback], tmp_path)

    steps_written = sorted({row["step"] for row in rows})
    assert steps_written, f"{name} wrote nothing in {STEPS} steps"
    assert set(steps_written) <= set(range(0, STEPS, INTERVAL)), steps_written

    patterns = _documented_key_patterns(cls)
    assert patterns, f"{name}'s docstring has no key table"
    for row in rows:
        for key, value in row["metrics"].items():
            assert any(p.match(key) for p in patterns), f"{name} wrote undocumented key {key!r}"
            assert isinstance(value, float | int)
            assert not math.isnan(value), f"{name} wrote NaN for {key}"

    state = vitals.state_dict()
    path = tmp_path / "state.pt"
    torch.save(state, path)
    restored = cls(**kwargs)
    Vitals([restored], writer=FanoutWriter([], background=False)).load_state_dict(
        torch.load(path, weights_only=False)
    )
    assert restored.state_dict().keys() == callback.state_dict().keys()


def test_all_callbacks_together_under_lightning(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    destroy_moe_metrics_tracker()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()

        def training_step(self, batch, batch_idx):
            return self.model(batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    generator = torch.Generator().manual_seed(2)
    data = [_batch(generator) for _ in range(2 * STEPS * MICRO_BATCHES)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    callbacks = [getattr(tv_callbacks, name)() for name in CALLBACK_NAMES]
    trainer = pl.Trainer(
        max_steps=STEPS,
        accumulate_grad_batches=MICRO_BATCHES,
        log_every_n_steps=INTERVAL,
        accelerator="cpu",
        devices=1,
        logger=[TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")],
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Module(), loader)

    csv_files = list((tmp_path / "csv").rglob("metrics.csv"))
    assert len(csv_files) == 1
    header = csv_files[0].read_text().splitlines()[0].split(",")
    for prefix in ("moe/", "l2_norm/", "memory/", "throughput/", "time/", "tensor_stats/"):
        assert any(column.startswith(prefix) for column in header), (prefix, header)
    assert list(tmp_path.rglob("tensor_stats.jsonl")), "TensorStatsMonitor wrote no JSONL"
