"""Audit 17 of MoEMetricsMonitor and the MoE tracker: a router that records nothing (no layer
number) must not change which layers the mean is over, and a percentile over layers that are
all +inf is +inf, not left out. Numbers against float64 router losses recomputed here from the
routers' own inputs and weights."""

from __future__ import annotations

import math

import pytest
import torch

from tests.callbacks.test_moe_metrics_monitor import PATTERN, ref_losses, tiny_model
from tests.helpers.moe_models import EXPERTS, HIDDEN, TOPK, VOCAB, fresh_tracker_fixture
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.callbacks import MoEMetricsMonitor
from trainvitals.moe import (
    MoEMetricsTracker,
    TopKRouter,
)
from trainvitals.moe._math import quantiles_of_positive, quantiles_of_positive_host
from trainvitals.moe.tiny_model import random_token_batches

fresh_tracker = fresh_tracker_fixture()


def test_a_router_that_records_nothing_does_not_turn_dense_layers_into_moe_layers():
    """A TopKRouter without a layer number (a side router) records nothing. It made the
    monitor's default layer pattern fall back to "every layer", so the mean over the 2 MoE
    layers of [1, 0, 1] was divided by 3 (0.67 at balance 1.0) and a per-layer key of the
    dense block 1 was written as 0."""
    from trainvitals.adapters.loop import Vitals

    model = tiny_model()  # blocks 0 and 2 are MoE, block 1 dense
    side = TopKRouter(HIDDEN, EXPERTS, TOPK, aux_loss_type="aux_loss", aux_loss_coeff=0.01)
    model.side_router = side  # no layer_number: records nothing
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter) and module is not side:
            layer = int(name.split(".")[1])

            def hook(mod, args, out, layer=layer):
                if mod.training and torch.is_grad_enabled():
                    x = args[0].detach().double().reshape(-1, HIDDEN)
                    seen.append((layer, x, mod.weight.detach().double().clone()))

            module.register_forward_hook(hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    writer = RecordingWriter()
    vitals = Vitals([MoEMetricsMonitor(per_layer_logging=True)], writer=writer, log_every_n_steps=2)
    vitals.attach(model, opt)
    for batch in random_token_batches(2, batch_size=2, seq_len=8, vocab_size=VOCAB, seed=1):
        vitals.batch(batch)
        side(torch.randn(4, HIDDEN))  # a training forward of the side router
        model(batch["input_ids"], batch["labels"]).loss.backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    # steps 0 (logged) and 1 (the run-end report), one forward of each MoE router per step
    assert sorted(writer.rows) == [0, 1]
    assert len(seen) == 2 * sum(PATTERN)
    for step in (0, 1):
        per_layer: dict[str, dict[int, float]] = {}
        for layer, x, w in seen[step * 2 : step * 2 + 2]:
            for name, value in ref_losses(x, w).items():
                per_layer.setdefault(name, {})[layer] = value
        expected = {}
        for name, layers in per_layer.items():
            assert sorted(layers) == [0, 2]
            expected[f"moe/{name}"] = math.fsum(layers.values()) / 2  # the 2 MoE layers
            for layer, value in layers.items():
                expected[f"moe/{name}_layer_{layer}"] = value
        row = writer.rows[step]
        assert set(row) == set(expected)  # no key of the dense block 1
        for key, value in expected.items():
            assert row[key] == pytest.approx(value, rel=1e-4), (step, key)
        assert 0.9 < row["moe/load_balancing_loss"] < 1.5  # 1.0 at balance, not 2/3 of it


def test_pattern_from_routers_ignores_routers_that_record_nothing():
    """The stages' (layer_number, num_layers) pairs: an unnumbered router (None, None), or one
    numbered without a vector length (which records nothing either), is not a MoE layer and
    does not hide the others' pattern."""
    from trainvitals.callbacks.moe_metrics_monitor import _pattern_from_routers

    routers = [(1, 4), (None, None), (3, 4), (2, None)]
    assert _pattern_from_routers(routers, None, None) == [1, 0, 1, 0]
    assert _pattern_from_routers(routers, 4, None) == [1, 0, 1, 0]
    assert _pattern_from_routers([(None, None)], None, None) is None


def test_percentile_of_layers_that_are_all_plus_inf_is_written_as_inf():
    """Two diverged layers (+inf each): their median is +inf. The interpolation computed
    inf + (inf - inf) * 0.5 = NaN, and the report leaves a NaN percentile out as if no layer
    were positive, so the key vanished while the mean and the layers said inf."""
    tracker = MoEMetricsTracker()
    for layer in (1, 2):
        tracker.record("z_loss", torch.tensor(math.inf), layer, num_layers=2)
    rows: dict[str, float] = {}

    class Writer:
        def add_scalars(self, mapping: dict[str, float], step: int) -> None:
            rows.update(mapping)

    tracker.report(1.0, 0, Writer(), per_layer_logging=True, percentiles={"z_loss": [0.25, 0.5]})
    assert rows == {
        "moe/z_loss": math.inf,
        "moe/z_loss_p25": math.inf,
        "moe/z_loss_p50": math.inf,
        "moe/z_loss_layer_0": math.inf,
        "moe/z_loss_layer_1": math.inf,
    }


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([math.inf, math.inf], 0.5, math.inf),
        ([2.0, math.inf, math.inf], 0.75, math.inf),
        ([0.0, math.inf, math.inf, -1.0], 0.3, math.inf),
    ],
)
def test_quantiles_between_two_plus_inf_entries_are_inf_on_host_and_device(values, q, expected):
    assert quantiles_of_positive_host(values, [q]) == [expected]
    device = quantiles_of_positive(torch.tensor(values, dtype=torch.float64), [q]).tolist()
    assert device == [expected]
