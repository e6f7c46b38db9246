"""Accelerate + Vitals under ``torchrun --nproc_per_node 2``: gradient accumulation, unequal
batches per rank, ``register_for_checkpointing`` save (phase 1) and load (phase 2).

Usage: torchrun --nproc_per_node 2 tests/scripts/accelerate_vitals.py OUT_DIR PHASE
Writes OUT_DIR/rank<r>_phase<p>.json with the values the callbacks wrote.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from tests.scripts.vitals_testing import FakeClock, RecordingWriter
from trainvitals.adapters.accelerate import Vitals
from trainvitals.callbacks.memory_monitor import MemoryMonitor
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor

SEQ = 4
ACC = 2
STEPS_PER_PHASE = 10


def step_seconds(step: int) -> float:
    return 1.0 + step % 3


def batch_size(rank: int) -> int:
    return 2 + 3 * rank


def main(out_dir: str, phase: int) -> None:
    out = Path(out_dir)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACC, project_dir=str(out))
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Linear(SEQ, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    bs = batch_size(rank)
    data = [{"input_ids": torch.randint(0, 9, (SEQ,))} for _ in range(bs * ACC * 25)]
    loader = torch.utils.data.DataLoader(data, batch_size=bs)  # not prepared: rank's own size

    clock = FakeClock(t=1000.0 * phase)
    writer = RecordingWriter()
    vitals = Vitals(
        [
            ThroughputMonitor(window_size=3, warmup_steps=0, clock=clock),
            RuntimeMonitor(clock=clock, max_steps=2 * STEPS_PER_PHASE),
            MemoryMonitor(),
        ],
        accelerator=accelerator,
        writer=writer,
        log_every_n_steps=2,
    )
    vitals.attach(model, optimizer)
    accelerator.register_for_checkpointing(vitals)
    if phase == 2:
        accelerator.load_state(str(out / "ckpt"))
    target = STEPS_PER_PHASE * phase
    for batch in loader:
        if vitals.step >= target:
            break
        vitals.batch(batch)
        with accelerator.accumulate(model):
            clock.t += step_seconds(vitals.step)
            loss = model(batch["input_ids"].float()).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    if phase == 1:
        accelerator.save_state(str(out / "ckpt"))
    vitals.close()
    (out / f"rank{rank}_phase{phase}.json").write_text(
        json.dumps({"step": vitals.step, "rows": {str(k): v for k, v in writer.rows.items()}})
    )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
