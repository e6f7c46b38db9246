"""MoEMetricsMonitor, audit 20: a ``moe_layer_freq`` that makes a recording router's layer dense.

The tracker's mean over the MoE layers sums every layer slot and divides by the MoE layers
(Megatron's ``v.sum() / num_moe_layers``). A model whose MoE blocks are 1 and 3 (Qwen-MoE's
``decoder_sparse_step=2``: ``(i + 1) % 2 == 0``) given to a monitor with ``moe_layer_freq=2``
(Megatron's ``i % 2 == 0``: layers 0 and 2) wrote ``load_balancing_loss_layer_0`` and ``_2`` as
0.0 (layers without a router) and no key for the real layers; ``[1, 1, 0, 0]`` wrote a
load-balancing loss of 2.01 at balance (layer 3's value added, not counted). Now a ValueError at
run start names the layers; a matching pattern writes the float64 values of the routers."""

from __future__ import annotations

import math

import pytest
import torch

from tests.callbacks.test_moe_metrics_monitor import capture_router_inputs, ref_losses
from tests.helpers.moe_models import LOSS_COEFFS, VOCAB, fresh_tracker_fixture, tiny_moe_lm
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.callbacks import MoEMetricsMonitor
from trainvitals.moe.tiny_model import random_token_batches

fresh_tracker = fresh_tracker_fixture()

ROUTED = [0, 1, 0, 1]  # blocks 1 and 3 are MoE (a sparse step of 2 counted from 1)


def one_step(moe_layer_freq):
    from trainvitals.adapters.loop import Vitals

    model = tiny_moe_lm(0, num_layers=4, moe_layer_freq=ROUTED, **LOSS_COEFFS)
    captured = capture_router_inputs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    monitor = MoEMetricsMonitor(per_layer_logging=True, moe_layer_freq=moe_layer_freq)
    batch = next(random_token_batches(1, batch_size=2, seq_len=8, vocab_size=VOCAB, seed=3))
    with Vitals([monitor], writer=writer, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        vitals.batch(batch)
        model(batch["input_ids"], batch["labels"]).loss.backward()
        opt.step()
    return writer.rows, captured


@pytest.mark.parametrize("freq", [2, [1, 0, 1, 0], [1, 1, 0, 0]])
def test_a_pattern_that_makes_a_routed_layer_dense_raises_at_run_start(freq):
    with pytest.raises(ValueError, match=r"moe_layer_freq=.*makes layers \[.*3\].*dense") as err:
        one_step(freq)
    assert "moe_layer_freq=[0, 1, 0, 1]" in str(err.value)  # the routers' own pattern


@pytest.mark.parametrize("freq", [None, [0, 1, 0, 1], [1, 1, 1, 1]])
def test_a_pattern_covering_the_routed_layers_writes_their_float64_values(freq):
    """The routers' pattern, or one with extra MoE layers that nothing records (left out, as
    a layer skipped by layer-drop), gives each layer's value and their mean, float64."""
    rows, captured = one_step(freq)
    expected = {}
    for layer, x, w in captured:
        for name, value in ref_losses(x, w).items():
            expected[f"moe/{name}_layer_{layer}"] = value
    for name in ("load_balancing_loss", "z_loss"):
        expected[f"moe/{name}"] = math.fsum(expected[f"moe/{name}_layer_{i}"] for i in (1, 3)) / 2
    assert set(rows[0]) == set(expected)
    for key, value in expected.items():
        assert rows[0][key] == pytest.approx(value, rel=1e-5), key
