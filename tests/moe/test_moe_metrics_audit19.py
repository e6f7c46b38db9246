"""MoEMetricsMonitor / MoEMetricsTracker, audit 19: a MoE layer that nothing recorded in the
logging interval (its router got no token, or the block was skipped by layer-drop) has no value.
It gets no per-layer key and is left out of the mean over the MoE layers, on one process, across
pipeline stages (the stage holding the layer decides) and across data-parallel ranks (a layer
one rank recorded is that rank's value). Before, it was written as 0 and averaged in as 0: four
layers at 1.0 with one unrecorded gave 0.75. Numbers against float64 router losses recomputed
here from the routers' own inputs and weights."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from tests.callbacks.test_moe_metrics_monitor import ref_losses
from tests.helpers.dist import torchrun
from tests.helpers.moe_models import LOSS_COEFFS, VOCAB, fresh_tracker_fixture, tiny_moe_lm
from tests.scripts.moe_audit19_unrouted_layer import Blocks, record_router_inputs
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.callbacks import MoEMetricsMonitor
from trainvitals.moe import MoEMetricsTracker

fresh_tracker = fresh_tracker_fixture()

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "moe_audit19_unrouted_layer.py"
NAMES = ("load_balancing_loss", "z_loss")


def expected_rows(ranks_seen: list[list], owner_decides: bool) -> dict[int, dict[str, float]]:
    """Per step: each layer's mean over its records on each rank, then over the ranks that
    recorded it (``owner_decides``: the one pipeline stage that holds it); the metric is the
    mean over the layers with a record. Layers without a record have no key."""
    per_rank: dict[tuple[int, int, str, int], list[float]] = defaultdict(list)
    for rank, seen in enumerate(ranks_seen):
        for step, layer, x, w in seen:
            f64 = torch.float64
            losses = ref_losses(torch.tensor(x, dtype=f64), torch.tensor(w, dtype=f64))
            for name in NAMES:
                per_rank[(step, layer, name, rank)].append(losses[name])
    layer_means: dict[tuple[int, int, str], list[float]] = defaultdict(list)
    for (step, layer, name, _rank), values in per_rank.items():
        layer_means[(step, layer, name)].append(math.fsum(values) / len(values))
    rows: dict[int, dict[str, float]] = defaultdict(dict)
    for (step, layer, name), means in sorted(layer_means.items()):
        if owner_decides:
            assert len(means) == 1
        rows[step][f"moe/{name}_layer_{layer}"] = math.fsum(means) / len(means)
    for row in rows.values():
        for name in NAMES:
            layers = [v for k, v in row.items() if k.startswith(f"moe/{name}_layer_")]
            row[f"moe/{name}"] = math.fsum(layers) / len(layers)
    return dict(rows)


def check(rows: dict, expected: dict) -> None:
    assert sorted(rows) == sorted(expected)
    for step, row in expected.items():
        assert sorted(rows[step]) == sorted(row), step
        for key, value in row.items():
            assert rows[step][key] == pytest.approx(value, rel=1e-5), (step, key)


@pytest.mark.parametrize("case", ["pp", "dp"])
def test_two_ranks_leave_a_layer_without_records_out_of_the_mean_and_the_keys(case, tmp_path):
    """``pp``: at step 1 the second stage skips block 3, so only blocks 0-2 have a value;
    ``dp``: at step 1 both ranks skip block 3 and rank 0 block 2 (block 2 is rank 1's value)."""
    torchrun(SCRIPT, str(tmp_path), case, nproc=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = expected_rows([res["seen"] for res in results], owner_decides=case == "pp")
    assert "moe/load_balancing_loss_layer_3" not in expected[1]
    assert "moe/load_balancing_loss_layer_3" in expected[0]
    for res in results:
        rows = {int(step): row for step, row in res["rows"].items()}
        check(rows, expected)


def test_one_process_a_skipped_block_has_no_key_and_is_not_averaged_in():
    """The loop driver on one process: block 1 is skipped at step 1 (layer-drop); step 1's mean
    is over blocks 0 and 2 (was divided by 3, with block 1 written as 0)."""
    from trainvitals.adapters.loop import Vitals

    full = tiny_moe_lm(0, num_layers=3, moe_layer_freq=[1, 1, 1], **LOSS_COEFFS)
    model = Blocks(full, [0, 1, 2])
    step = [0]
    seen = record_router_inputs(model, step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    vitals = Vitals([MoEMetricsMonitor(per_layer_logging=True)], writer=writer, log_every_n_steps=1)
    vitals.attach(model, opt)
    gen = torch.Generator().manual_seed(3)
    for s in range(2):
        step[0] = s
        model.skip = {1} if s == 1 else set()
        for _ in range(2):
            x = torch.randint(0, VOCAB, (2, 6), generator=gen)
            vitals.batch(x)
            model(x).backward()
        opt.step()
        opt.zero_grad()
    vitals.close()
    expected = expected_rows([seen], owner_decides=True)
    assert sorted(k for k in expected[1] if "_layer_" in k) == [
        f"moe/{n}_layer_{i}" for n in NAMES for i in (0, 2)
    ]
    check(writer.rows, expected)


def test_tracker_skip_unrecorded_layers_divides_by_the_recorded_moe_layers_only():
    """Four layers, three recorded 1.0 (one of them twice): mean 1.0 (0.75 with the unrecorded
    layer as 0, which the default and Megatron write); a layer recorded as 0.0 (a real dropped
    fraction) is a value and counts; dense slots stay out; percentiles are unchanged."""
    tracker = MoEMetricsTracker()
    for layer in (1, 2, 2, 4):
        tracker.record("load_balancing_loss", torch.tensor(1.0), layer, num_layers=5)
    tracker.record("dropped_token_fraction", torch.tensor(0.0), 1, num_layers=5)
    tracker.record("dropped_token_fraction", torch.tensor(0.6), 2, num_layers=5)
    kwargs = dict(
        per_layer_logging=True,
        moe_layer_freq=[1, 1, 1, 1, 0],
        percentiles={"load_balancing_loss": [0.5]},
        mean_over_records=True,
    )
    writer = RecordingWriter()
    tracker.report(1.0, 0, writer, skip_unrecorded_layers=True, **kwargs)
    assert writer.rows[0] == {
        "moe/load_balancing_loss": 1.0,
        "moe/load_balancing_loss_p50": 1.0,
        "moe/load_balancing_loss_layer_0": 1.0,
        "moe/load_balancing_loss_layer_1": 1.0,
        "moe/load_balancing_loss_layer_3": 1.0,
        "moe/dropped_token_fraction": pytest.approx(0.3),
        "moe/dropped_token_fraction_layer_0": 0.0,
        "moe/dropped_token_fraction_layer_1": pytest.approx(0.6),
    }
    # without it: Megatron's zeros in the per-layer keys and the mean
    for layer in (1, 2, 2, 4):
        tracker.record("load_balancing_loss", torch.tensor(1.0), layer, num_layers=5)
    writer = RecordingWriter()
    tracker.report(1.0, 1, writer, track_names="load_balancing_loss", **kwargs)
    assert writer.rows[1]["moe/load_balancing_loss"] == 0.75
    assert writer.rows[1]["moe/load_balancing_loss_layer_2"] == 0.0
    with pytest.raises(ValueError, match="skip_unrecorded_layers=True needs mean_over_records"):
        tracker.report(1.0, 2, skip_unrecorded_layers=True)
    with pytest.raises(TypeError, match="skip_unrecorded_layers"):
        tracker.report(1.0, 2, mean_over_records=True, skip_unrecorded_layers=1)  # type: ignore[arg-type]
