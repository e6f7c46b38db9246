"""Two Accelerate ranks (torchrun, CPU) train a generator and a discriminator for 3 steps under
the driver, each rank with its own batch size (2 and 5), then end in one of three ways.

Usage: ``torchrun --nproc_per_node 2 two_rank_gan_end.py OUT OPTIMIZERS END`` with OPTIMIZERS
``one`` (only the generator's optimizer attached and stepped) or ``several``, and END
``rank0_end_training`` (``if accelerator.is_main_process: accelerator.end_training()``),
``never_closed`` (neither ``vitals.close()`` nor ``end_training()``: closed at exit) or
``never_closed_validate`` (the same after a validation). Writes ``OUT/metrics.jsonl``.
"""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from trainvitals.adapters.accelerate import Vitals
from trainvitals.callbacks import RuntimeMonitor, ThroughputMonitor

out, several, end = Path(sys.argv[1]), sys.argv[2] == "several", sys.argv[3]
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
torch.manual_seed(0)
gen, dis = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
model = torch.nn.Sequential(gen, dis)
opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
opt_d = torch.optim.SGD(dis.parameters(), lr=0.1)
model, opt_g, opt_d = accelerator.prepare(model, opt_g, opt_d)
callbacks = [RuntimeMonitor(max_steps=3), ThroughputMonitor(warmup_steps=0)]
vitals = Vitals(callbacks, accelerator=accelerator, run_dir=out, log_every_n_steps=1)
vitals.attach(model, [opt_g, opt_d] if several else opt_g)
for _ in range(3):
    x = torch.randn(2 + 3 * rank, 4)
    vitals.batch(x)
    accelerator.backward(model(x).pow(2).mean())
    opt_g.step()
    opt_g.zero_grad()
    if several:
        opt_d.step()
        opt_d.zero_grad()
if end == "rank0_end_training":
    if accelerator.is_main_process:
        accelerator.end_training()  # rank 0 only: a common pattern
elif end == "never_closed_validate":
    with vitals.validating():
        pass
