"""Resume on another parallel layout: what a checkpoint's per-rank state means after it.

A checkpoint keeps one copy of the callbacks' state (rank 0's); per-rank parts of it (the
measured flops of every rank, ``ThroughputMonitor``'s ``measured_by_rank``) are indexed by the
saving run's ranks. Restored on ranks that do other work (a data-parallel run resumed under
tensor parallelism: each rank now runs half of every matmul), a rank's figure is not its own.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.helpers.dist import run_distributed

IN, OUT, TOKENS, SECONDS = 8, 8, 6, 2.0


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _train(rank: int, world: int, run_dir: str, tp: bool, save: bool) -> dict:
    """Two steps of a bias-free linear layer under the driver with ``measure_flops``: the whole
    ``IN x OUT`` matrix on each rank (data parallel), or, ``tp``, this rank's column shard
    ``IN x OUT / world`` (tensor parallel: the ranks share one token stream). ``save``: store
    the state (rank 0's copy) in ``run_dir``; else resume from it."""
    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import ThroughputMonitor
    from trainvitals.distributed import ProcessGroups, world_group

    clock = _Clock()
    monitor = ThroughputMonitor(
        clock=clock, window_size=1, warmup_steps=0, measure_flops=True, peak_flops=1e9
    )
    groups = ProcessGroups(tp=world_group()) if tp else ProcessGroups(dp=world_group())
    torch.manual_seed(rank)
    model = torch.nn.Linear(IN, OUT // world if tp else OUT, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = RecordingWriter()
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1, groups=groups)
    vitals.attach(model, opt)
    path = os.path.join(run_dir, "vitals.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not save:
            vitals.load_state_dict(torch.load(path, weights_only=True))
        for _ in range(2):
            x = torch.randn(TOKENS, IN)
            vitals.batch({"x": x}, batch_size=TOKENS, num_tokens=TOKENS)
            clock.t += SECONDS
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    if save:
        state = vitals.state_dict()  # (collective: on every rank)
        if rank == 0:
            torch.save(state, path)
    vitals.close()
    return {
        "device": writer.key("throughput/device/flops_per_sec"),
        "global": writer.key("throughput/flops_per_sec"),
        "warnings": [str(w.message) for w in caught],
    }


def _save_then_resume(rank: int, world: int, run_dir: str) -> dict:
    _train(rank, world, run_dir, tp=False, save=True)
    torch.distributed.barrier()
    return _train(rank, world, run_dir, tp=True, save=False)


def test_measured_flops_are_not_restored_onto_another_parallel_layout(tmp_path):
    # Saved on 2 data-parallel ranks, each running the whole 8 x 8 layer, resumed on the same
    # 2 ranks under tensor parallelism, each running an 8 x 4 shard. A bias-free linear layer
    # whose input needs no gradient runs 2 * IN * out flops per token forward and as many for
    # its weight gradient. Restoring each rank's own entry of the checkpoint (same world size)
    # gave the shard the whole layer's figure: device and global flops twice the work done.
    world = 2
    results = run_distributed(_save_then_resume, world, args=(str(tmp_path),), timeout=90)
    shard = 4.0 * IN * (OUT // world)  # flops per token of one rank's shard
    for rank, res in enumerate(results):
        assert res["device"], f"rank {rank} wrote no device flops"
        for step, value in res["device"].items():
            assert value == pytest.approx(shard * TOKENS / SECONDS, rel=1e-12), (rank, step)
        # the ranks share one token stream: the layer's flops are the shards' sum
        for step, value in res["global"].items():
            assert value == pytest.approx(world * shard * TOKENS / SECONDS, rel=1e-12), step
        assert any("not restored (measured again)" in w for w in res["warnings"]), rank
