"""Audit 19 of the Lightning integration: the callbacks' checkpoint state on several ranks.

Lightning (and Accelerate's ``save_state``) keeps one copy of a callback's state, rank 0's,
and restores it on every rank. ``ThroughputMonitor``'s ``totals`` were this rank's own counts:
the checkpoint held rank 0's alone (not the run's), and after a resume every other rank went on
from rank 0's counts. They are summed over the ranks when the state is taken, as the window's
entries are (in the same collective), so the copy on every rank is the run's.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.scripts.vitals_testing import FakeClock, RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor

MICRO_BATCHES = 2


def _samples(rank: int, step: int, micro: int) -> int:
    return 2 + 3 * rank + (step + micro) % 2  # rank 1 sees more samples than rank 0


def _seq(rank: int) -> int:
    return 3 + rank  # and longer sequences


def _train(vitals: Vitals, model: torch.nn.Module, opt, clock: FakeClock, steps, rank: int):
    for step in steps:
        for micro in range(MICRO_BATCHES):
            ids = torch.randint(0, 8, (_samples(rank, step, micro), _seq(rank)))
            vitals.batch({"input_ids": ids})
            clock.t += 1.0
            model(ids).sum().backward()
        opt.step()
        opt.zero_grad()


def _resume_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    torch.manual_seed(rank)
    model = torch.nn.Embedding(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = FakeClock()
    first = Vitals(
        [ThroughputMonitor(window_size=3, clock=clock)],
        writer=RecordingWriter(),
        log_every_n_steps=2,
    )
    first.attach(model, opt)
    with first:
        _train(first, model, opt, clock, range(4), rank)
        state = first.state_dict()  # on every rank (collective), as a checkpoint takes it
    saved = [state]
    dist.broadcast_object_list(saved, src=0)  # the checkpoint's one copy: rank 0's
    second = Vitals(
        [ThroughputMonitor(window_size=3, clock=clock)],
        writer=RecordingWriter(),
        log_every_n_steps=2,
    )
    second.attach(model, opt)
    second.load_state_dict(saved[0])
    with second:
        _train(second, model, opt, clock, range(4, 7), rank)
        resumed = second.state_dict()
    return {
        "saved": saved[0]["callbacks"]["ThroughputMonitor"]["totals"],
        "resumed": resumed["callbacks"]["ThroughputMonitor"]["totals"],
    }


def _expected(steps: range) -> dict[str, float]:
    samples = [_samples(r, s, m) for r in range(2) for s in steps for m in range(MICRO_BATCHES)]
    tokens = [
        _samples(r, s, m) * _seq(r) for r in range(2) for s in steps for m in range(MICRO_BATCHES)
    ]
    return {
        "steps": float(len(steps)),
        "batches": float(2 * MICRO_BATCHES * len(steps)),
        "samples": float(sum(samples)),
        "tokens": float(sum(tokens)),
    }


@pytest.mark.timeout(180)
def test_throughput_totals_in_rank_0s_checkpoint_are_the_runs_on_every_rank_after_a_resume():
    results = run_distributed(_resume_body, world_size=2, timeout=150)
    for result in results:
        # rank 0's copy holds both ranks' micro-batches, samples and tokens (it held rank 0's:
        # samples 2+3+2+3+... = 20 of the 64 both ranks saw in 4 steps)
        assert result["saved"] == _expected(range(4))
        # and every rank goes on from the run's totals, not from rank 0's counts
        assert result["resumed"] == _expected(range(7))
