"""The plain-loop driver's default process groups are looked up when the run starts, not only
when the driver is built: a torchrun script that builds its callbacks and ``Vitals`` before
``init_process_group`` must still sum its global figures over every rank."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed
from tests.helpers.moe_models import VOCAB, RoutingMaps, tiny_moe_lm
from tests.scripts.vitals_testing import FakeClock, RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import LoadBalanceMonitor, ThroughputMonitor
from trainvitals.distributed import ProcessGroups, group_size

STEPS, MICRO_BATCHES, WINDOW = 3, 2, 2


def _samples(step: int, micro_batch: int, rank: int) -> int:
    """Sequences in a micro-batch: different on each rank, step and micro-batch."""
    return 2 + (step + micro_batch) % 3 + 3 * rank


def _seq_len(rank: int) -> int:
    return 5 + 3 * rank


def _train(vitals: Vitals, model: torch.nn.Module, opt: Any, clock: FakeClock, rank: int):
    """Yields after each optimizer step; the fake clock moves 1 s per micro-batch."""
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        for micro_batch in range(MICRO_BATCHES):
            ids = torch.randint(
                0, VOCAB, (_samples(step, micro_batch, rank), _seq_len(rank)), generator=gen
            )
            vitals.batch(ids)
            clock.t += 1.0
            model(ids, labels=ids).loss.backward()
        yield step
        opt.step()
        opt.zero_grad()


def _driver_before_the_group(rank: int, world_size: int, tmp: str, init_at: str) -> dict:
    # As a torchrun script that builds model, callbacks and driver before init_process_group.
    dist.destroy_process_group()
    clock = FakeClock()
    monitors = [
        ThroughputMonitor(window_size=WINDOW, warmup_steps=0, clock=clock),
        LoadBalanceMonitor(mode="detailed"),
    ]
    writer = RecordingWriter()
    vitals = Vitals(monitors, writer=writer, log_every_n_steps=1)
    model = tiny_moe_lm(seed=0)
    routing = RoutingMaps(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # groups given: the caller's, kept (trivial: each rank reports its own figures)
    own_clock = FakeClock()
    own_writer = RecordingWriter()
    own = Vitals(
        [ThroughputMonitor(window_size=WINDOW, warmup_steps=0, clock=own_clock)],
        writer=own_writer,
        groups=ProcessGroups(),
        log_every_n_steps=1,
    )
    own_model = tiny_moe_lm(seed=1)
    own_opt = torch.optim.SGD(own_model.parameters(), lr=0.1)
    if init_at == "after_attach":
        vitals.attach(model, opt)
        own.attach(own_model, own_opt)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store-late", rank=rank, world_size=world_size
    )
    if init_at == "after_build":
        vitals.attach(model, opt)
        own.attach(own_model, own_opt)
    loads = []
    for _ in _train(vitals, model, opt, clock, rank):
        loads.append(routing.take()[0])
    vitals.close()
    for _ in _train(own, own_model, own_opt, own_clock, rank):
        pass
    own.close()
    return {
        "rows": writer.rows,
        "own_rows": own_writer.rows,
        "loads": np.stack(loads),  # [step, layer, expert], this rank's routing maps
        "labels": monitors[1].capture.layer_labels,
        "dp_size": group_size(vitals.ctx.groups.dp),
        "own_dp_size": group_size(own.ctx.groups.dp),
    }


def _window_counts(step: int, rank: int) -> tuple[int, int, float]:
    """Samples and tokens of ``rank`` in the throughput window at ``step``, and its seconds."""
    window = range(max(0, step - WINDOW + 1), step + 1)
    samples = sum(_samples(s, mb, rank) for s in window for mb in range(MICRO_BATCHES))
    return samples, samples * _seq_len(rank), float(MICRO_BATCHES * len(window))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("init_at", ["after_build", "after_attach"])
def test_driver_built_before_init_process_group_sums_over_the_ranks(tmp_path, init_at) -> None:
    results = run_distributed(
        _driver_before_the_group, 2, args=(str(tmp_path), init_at), timeout=100
    )
    for step in range(STEPS):
        counts = [_window_counts(step, rank) for rank in range(2)]
        seconds = counts[0][2]
        all_samples = sum(c[0] for c in counts)
        all_tokens = sum(c[1] for c in counts)
        for rank, result in enumerate(results):
            row = result["rows"][step]
            assert row["throughput/samples_per_sec"] == pytest.approx(all_samples / seconds)
            assert row["throughput/tokens_per_sec"] == pytest.approx(all_tokens / seconds)
            samples, tokens, _ = counts[rank]
            assert row["throughput/device/samples_per_sec"] == pytest.approx(samples / seconds)
            assert row["throughput/device/tokens_per_sec"] == pytest.approx(tokens / seconds)
            own_row = result["own_rows"][step]
            assert own_row["throughput/samples_per_sec"] == pytest.approx(samples / seconds)
            assert own_row["throughput/tokens_per_sec"] == pytest.approx(tokens / seconds)
        # expert loads: each rank's routing maps counted by the test's own hooks, summed
        loads = sum(r["loads"][step] for r in results)
        for result in results:
            assert len(result["labels"]) == loads.shape[0]  # every router's layer written
            row = result["rows"][step]
            for layer, label in enumerate(result["labels"]):
                written = [
                    row[f"moe/layer_{label}/tokens_per_expert/{e}"] for e in range(loads.shape[1])
                ]
                assert written == pytest.approx(loads[layer].tolist(), rel=1e-12)
    # the world group as data parallel by default; groups given stay the caller's
    assert [r["dp_size"] for r in results] == [2, 2]
    assert [r["own_dp_size"] for r in results] == [1, 1]
