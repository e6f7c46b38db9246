"""LoadBalanceMonitor audit 20: forwards inside validation are not counted, also when the loop
validates with the model in training mode and autograd on (no ``model.eval()`` /
``torch.no_grad()``), which the router hooks alone cannot tell from a training forward.

The expected values are computed here in float64 from the routers' own routing maps (test
hooks that record the training micro-batches only)."""

from __future__ import annotations

import pytest
import torch

from tests.callbacks.test_load_balance_monitor import (  # noqa: F401 (an autouse fixture)
    _fresh_moe_tracker,
    check_row,
)
from tests.helpers.moe_models import RoutingMaps, tiny_moe_lm
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor

VOCAB = 32


@pytest.mark.parametrize("every", [1, 2])
def test_validation_in_training_mode_is_not_counted(every: int) -> None:
    model = tiny_moe_lm(0, vocab_size=VOCAB)
    maps = RoutingMaps(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=2)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=every).attach(model, opt)
    gen = torch.Generator().manual_seed(3)

    def validate() -> None:
        # the model stays in training mode with autograd on: only validating() says what it is
        maps.recording = False
        with vitals.validating():
            model(torch.randint(0, VOCAB, (4, 9), generator=gen))
        maps.recording = True

    expected = {}
    for step in range(4):
        for micro_batch in range(2):
            x = torch.randint(0, VOCAB, (2, 6), generator=gen)
            vitals.batch(x)
            model(x, labels=x).loss.backward()
            if micro_batch == 0:
                validate()  # in the middle of the step: counting resumes after it
        expected[step] = maps.take()
        opt.step()
        opt.zero_grad()
        validate()  # between steps, before a logging step and before a non-logging one
    vitals.close()

    assert sorted(writer.rows) == list(range(0, 4, every))
    for step, row in writer.rows.items():
        loads, aux = expected[step]
        # top-2 of the 2 micro-batches of 2 x 6 tokens, in every layer: no validation token
        assert (loads.sum(1) == 2 * 2 * 12).all()
        assert sum(row[f"moe/layer_0/tokens_per_expert/{e}"] for e in range(4)) == 48
        check_row(row, loads, ["0", "1", "2"], aux, top_k=2)
