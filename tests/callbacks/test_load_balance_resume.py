"""LoadBalanceMonitor across restores: a rollback in the middle of a step, and a resumed run."""

from __future__ import annotations

import json

import pytest
import torch

from tests.callbacks.test_load_balance_monitor import VOCAB, MapRecorder, check_row, tiny_lm
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor


@pytest.fixture(autouse=True)
def _fresh_moe_tracker():
    """TinyMoELM's routers record into the global MoE tracker: start each test without one."""
    from trainvitals.moe import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    yield
    destroy_moe_metrics_tracker()


def test_rollback_mid_step_does_not_count_the_abandoned_micro_batches() -> None:
    """A loop that restores a checkpoint in the middle of a step (a loss spike seen after two
    micro-batches) replays that step from its start: the step's loads are those of the
    replayed micro-batches only, as the driver documents, not those plus the abandoned ones."""
    model = tiny_lm(num_layers=2)
    maps = MapRecorder(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=2)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    gen = torch.Generator().manual_seed(3)

    def micro_batch() -> None:
        x = torch.randint(0, VOCAB, (2, 6), generator=gen)
        vitals.batch(x)
        model(x, labels=x).loss.backward()

    micro_batch()
    opt.step()
    opt.zero_grad()
    checkpoint = json.loads(json.dumps(vitals.state_dict()))  # after step 0
    maps.take()
    # step 1: two micro-batches, then the loop rolls back to the checkpoint of step 1
    micro_batch()
    micro_batch()
    opt.zero_grad()
    vitals.load_state_dict(checkpoint)
    maps.take()  # the abandoned micro-batches
    micro_batch()  # the replayed step 1: one micro-batch
    loads, aux = maps.take()
    opt.step()
    vitals.close()
    assert loads.sum() == 2 * 2 * 12  # one micro-batch of 2 x 6 tokens, top-2, two layers
    check_row(writer.rows[1], loads, ["0", "1"], aux, top_k=2)
