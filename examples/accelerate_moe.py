"""trainvitals in a Hugging Face Accelerate script: three added lines (marked ``# vitals``),
plus two optional ones: ``register_for_checkpointing`` (counters and windows survive a
``save_state``/``load_state``) and ``vitals.close()`` (flushes the writer; a ``with Vitals(...)``
block does it too).

    python examples/accelerate_moe.py --run-dir runs/accelerate --steps 100
    torchrun --standalone --nproc_per_node 2 examples/accelerate_moe.py --run-dir runs/accelerate_2ranks   # two CPU ranks (gloo)

(Give each run its own ``--run-dir``: Accelerate's TensorBoard tracker adds an event file to
the folder, and two runs in one folder are read back as one, by TensorBoard and by
``trainvitals report``.)

(``accelerate launch --num_processes 2 --cpu`` starts one process: with ``--cpu`` Accelerate's
launcher ignores ``--num_processes``. ``accelerate launch --multi_gpu --num_processes 2
--num_machines 1 --mixed_precision no --dynamo_backend no examples/accelerate_moe.py ...``
starts two, on a machine without a GPU too: the script's ``Accelerator(cpu=True)`` runs them on
CPU over gloo.)

The callbacks write into the Accelerate trackers (here TensorBoard), with tensor values
converted to numbers (Accelerate's own trackers drop tensors silently); gradients are seen
after ``accelerator.clip_grad_norm_`` unscales them and before it clips them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator

from trainvitals import (
    LoadBalanceMonitor,
    MoEMetricsMonitor,
    NormMonitor,
    RuntimeMonitor,
    ThroughputMonitor,
)
from trainvitals.adapters.accelerate import Vitals
from trainvitals.moe import TinyMoELM, set_aux_loss_backward_scale
from trainvitals.moe.tiny_model import RandomTokenDataset
from trainvitals.report import write_report


def positive_int(text: str) -> int:
    """An argparse type (``--accumulate 0`` ended in a ZeroDivisionError inside Accelerate)."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Command lines kept as written, and each option's default."""


def main(argv: list[str] | None = None) -> None:
    # --help shows the docstring's command lines (how to start two ranks) and the defaults
    first, rest = __doc__.replace("``", "`").split("\n\n", 1)
    parser = argparse.ArgumentParser(description=first, epilog=rest, formatter_class=HelpFormatter)
    parser.add_argument(
        "--run-dir",
        default="runs/accelerate",
        type=Path,
        help="Accelerate's project_dir: the TensorBoard event files and report.html",
    )
    parser.add_argument("--steps", default=100, type=positive_int, help="optimizer steps")
    parser.add_argument(
        "--accumulate", default=2, type=positive_int, help="micro-batches per optimizer step"
    )
    parser.add_argument(
        "--log-every", default=10, type=positive_int, help="optimizer steps between logged values"
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=args.accumulate,
        log_with="tensorboard",
        project_dir=args.run_dir,
    )
    accelerator.init_trackers("trainvitals-accelerate")
    model = TinyMoELM(vocab_size=64, hidden_size=64, num_layers=4, num_experts=8, top_k=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = RandomTokenDataset(num_samples=4096, seq_len=32, vocab_size=64, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # accelerator.backward divides the loss by the accumulation steps (and, under fp16, goes
    # through accelerator.scaler): the routers' injected aux-loss gradients the same way
    set_aux_loss_backward_scale(
        1 / accelerator.gradient_accumulation_steps, grad_scaler=accelerator.scaler
    )

    vitals = Vitals(  # vitals
        [
            MoEMetricsMonitor(),
            LoadBalanceMonitor(),
            NormMonitor(),
            ThroughputMonitor(),
            RuntimeMonitor(),
        ],
        accelerator=accelerator,
        log_every_n_steps=args.log_every,
        run_dir=args.run_dir,
        max_steps=args.steps,
    )
    vitals.attach(model, optimizer)  # vitals
    accelerator.register_for_checkpointing(vitals)

    steps_done = 0
    while steps_done < args.steps:
        for batch in loader:
            vitals.batch(batch)  # vitals
            with accelerator.accumulate(model):
                loss = model(batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                accelerator.unwrap_model(model).moe_step_end()
                steps_done += 1
                if steps_done >= args.steps:
                    break
    vitals.close()
    accelerator.end_training()
    if accelerator.is_main_process:
        print(f"logs in {args.run_dir} (tensorboard --logdir {args.run_dir})")
        print(f"HTML report: {write_report(args.run_dir)}")  # from the TensorBoard event files


if __name__ == "__main__":
    main()
