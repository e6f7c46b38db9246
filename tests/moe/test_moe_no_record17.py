"""MoEMetricsMonitor leaves out a metric that nothing recorded in the logging interval.

A step whose micro-batches all skip the model (a Lightning ``training_step`` returning None
before the forward, a frozen MoE part, another monitor that reported the same tracker first)
runs no router: the tracker holds zeros with zero record counts. The monitor wrote
``moe/load_balancing_loss = 0.0``, ``moe/z_loss = 0.0`` and 0.0 per layer there, which is no
value of these metrics (1.0 is perfect balance). Now none of the metric's keys is written at
that step; the other steps keep their values, checked against float64 router losses recomputed
here from the routers' own inputs and weights. In one process and on 2 gloo ranks (data
parallel), where the ranks' forwards differ per step: both, one, or neither rank records.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from tests.callbacks.test_moe_metrics_monitor import (
    PATTERN,
    capture_router_inputs,
    ref_losses,
    step_collectives,
    tiny_model,
)
from tests.helpers.dist import run_distributed
from tests.helpers.moe_models import HIDDEN, VOCAB, fresh_tracker_fixture
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.callbacks import MoEMetricsMonitor
from trainvitals.moe import (
    MoEMetricsTracker,
    TopKRouter,
    set_moe_metrics_tracker,
)
from trainvitals.moe.tiny_model import random_token_batches

MOE_LAYERS = [i for i, m in enumerate(PATTERN) if m]
NAMES = ("load_balancing_loss", "z_loss")
QS = [0.5, 1.0]
MICRO = 2  # micro-batches per optimizer step


fresh_tracker = fresh_tracker_fixture()


def run_driver(forward_steps: set[int], steps: int, log_every: int, groups=None) -> dict:
    """The loop driver over ``steps`` optimizer steps of ``MICRO`` micro-batches; the model
    runs only in ``forward_steps`` (the other steps' micro-batches skip it). Returns the rows
    written, the float64 losses of every router forward as ``(step, layer, {name: value})``
    and the collectives of each step."""
    from trainvitals.adapters.loop import Vitals

    model = tiny_model()  # the same weights on every rank, as under DDP
    current = {"step": 0}
    forwards: list[tuple[int, int, dict[str, float]]] = []
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter):
            layer = int(name.split(".")[1])

            def hook(mod, args, out, layer=layer):
                if mod.training and torch.is_grad_enabled():
                    x = args[0].detach().double().reshape(-1, HIDDEN)
                    w = mod.weight.detach().double()
                    forwards.append((current["step"], layer, ref_losses(x, w)))

            module.register_forward_hook(hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    writer = RecordingWriter()
    monitor = MoEMetricsMonitor(per_layer_logging=True, percentiles=dict.fromkeys(NAMES, QS))
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=log_every, groups=groups)
    vitals.attach(model, opt)
    rank = torch.distributed.get_rank() if groups is not None else 0
    batches = random_token_batches(steps * MICRO, 2, 8, VOCAB, seed=3 + rank)
    counts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            current["step"] = step
            for _ in range(MICRO):
                batch = next(batches)
                vitals.batch(batch)
                if step in forward_steps:
                    (model(batch["input_ids"], batch["labels"]).loss / MICRO).backward()
            # opt.step(): the driver's step_end (and a logging step's report) runs there
            counts.append(step_collectives(opt))
        vitals.close()
    return {
        "rows": writer.rows,
        "forwards": forwards,
        "counts": counts,
        "warnings": [str(w.message) for w in caught],
        "last_losses": monitor.last_losses,
    }


def expected_row(per_rank_forwards: list[list], window: list[int]) -> dict[str, float] | None:
    """The float64 row of a report covering optimizer steps ``window``: per layer, each rank's
    mean over its forwards, averaged over the ranks that recorded it; the metric the mean over
    the MoE layers, the quantiles over them (numpy's linear interpolation). ``None`` when no
    rank ran a forward in the window."""
    per_layer: dict[str, dict[int, float]] = {n: {} for n in NAMES}
    for name in NAMES:
        for layer in MOE_LAYERS:
            rank_means = []
            for forwards in per_rank_forwards:
                vals = [f[name] for s, lay, f in forwards if s in window and lay == layer]
                if vals:
                    rank_means.append(math.fsum(vals) / len(vals))
            if rank_means:
                per_layer[name][layer] = math.fsum(rank_means) / len(rank_means)
    if not any(per_layer[n] for n in NAMES):
        return None
    row = {}
    for name, layers in per_layer.items():
        assert sorted(layers) == MOE_LAYERS  # every MoE layer ran whenever the model ran
        values = [layers[i] for i in MOE_LAYERS]
        row[f"moe/{name}"] = math.fsum(values) / len(MOE_LAYERS)
        for q in QS:
            row[f"moe/{name}_p{int(q * 100)}"] = float(np.quantile(values, q))
        for i in MOE_LAYERS:
            row[f"moe/{name}_layer_{i}"] = layers[i]
    return row


def check_rows(rows: dict[int, dict[str, float]], expected: dict[int, dict[str, float] | None]):
    written = {step for step, row in expected.items() if row is not None}
    assert sorted(rows) == sorted(written), "a logging step without any record wrote keys"
    for step, row in expected.items():
        if row is None:
            continue
        assert set(rows[step]) == set(row), step
        for key, value in row.items():
            assert rows[step][key] == pytest.approx(value, rel=1e-5), (step, key)
        assert 0.9 < rows[step]["moe/load_balancing_loss"] < 2.0  # 1.0 at balance


def test_one_process_an_interval_without_moe_forward_writes_no_moe_key():
    """6 steps logged every 2 (steps 0, 2, 4, and 5 at run end): the model runs in steps 0, 3
    and 4 only, so the interval of step 2 (steps 1-2) and the run-end report of step 5 have
    no record: nothing at 2 and 5 (0.0 everywhere before), float64 values at 0 and 4."""
    res = run_driver({0, 3, 4}, steps=6, log_every=2)
    windows = {0: [0], 2: [1, 2], 4: [3, 4], 5: [5]}
    expected = {step: expected_row([res["forwards"]], w) for step, w in windows.items()}
    assert expected[2] is None and expected[5] is None
    check_rows(res["rows"], expected)
    assert res["last_losses"] == {}  # the run-end report had nothing to hand on
    unrecorded = [m for m in res["warnings"] if "no router recorded" in m]
    assert len(unrecorded) == 1 and "load_balancing_loss, z_loss" in unrecorded[0]
    assert not [m for m in res["warnings"] if "nothing was recorded" in m]


def test_two_monitors_sharing_one_tracker_keep_the_first_reports_values():
    """Two monitors on one tracker and one writer: the first report clears the tracker, so the
    second found only zero counts and overwrote the step's values with 0.0."""
    from trainvitals.adapters.loop import Vitals

    model = tiny_model()
    captured = capture_router_inputs(model)  # (layer, input, weight) of each training forward
    first, second = MoEMetricsMonitor(), MoEMetricsMonitor(per_layer_logging=True)
    second.state_key = "moe_second"
    writer = RecordingWriter()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vitals = Vitals([first, second], writer=writer, log_every_n_steps=1).attach(model, opt)
        batch = next(random_token_batches(1, 2, 8, VOCAB, seed=5))
        vitals.batch(batch)
        model(batch["input_ids"], batch["labels"]).loss.backward()
        opt.step()
        opt.zero_grad()
        vitals.close()
    seen = [(layer, ref_losses(x, w)) for layer, x, w in captured]
    assert sorted(layer for layer, _ in seen) == MOE_LAYERS
    expected = {
        f"moe/{name}": math.fsum(f[name] for _, f in seen) / len(MOE_LAYERS) for name in NAMES
    }
    assert writer.rows[0] == pytest.approx(expected, rel=1e-5)  # no per-layer key, no 0.0


# ---------------------------------------------------------------------- 2 gloo ranks

# optimizer steps in which each rank runs the model (logged every step): both ranks, rank 0
# alone, neither, rank 1 alone, neither (the last step: the run-end report has nothing either)
FORWARD_STEPS = {0: {0, 1}, 1: {0, 3}}
STEPS = 5


def _two_rank_body(rank: int, world_size: int) -> dict:
    from trainvitals.distributed import ProcessGroups, world_group

    set_moe_metrics_tracker(MoEMetricsTracker())
    return run_driver(FORWARD_STEPS[rank], STEPS, 1, groups=ProcessGroups(dp=world_group()))


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_two_rank_body, 2, timeout=240)


def test_two_ranks_write_nothing_where_no_rank_recorded(two_ranks):
    """Step 1: rank 0 alone recorded, its value is written (rank 1 counts for nothing); steps 2
    and 4: no rank recorded, no key (0.0 before); every rank issues the same collectives at
    every logging step (one object gather, one all-reduce: the has-records flags ride in it)."""
    forwards = [res["forwards"] for res in two_ranks]
    expected = {step: expected_row(forwards, [step]) for step in range(STEPS)}
    assert [step for step, row in expected.items() if row is None] == [2, 4]
    for rank, res in enumerate(two_ranks):
        rows = res["rows"]
        check_rows(rows, expected)
        assert res["counts"] == [{"all_gather_object": 1, "all_reduce": 1}] * STEPS, rank
    # the steps one rank recorded are that rank's values, not halved by the other's zeros
    alone = expected_row([forwards[0]], [1])
    assert two_ranks[0]["rows"][1] == pytest.approx(alone, rel=1e-5)


def test_tracker_skip_unrecorded_leaves_out_only_the_metric_without_any_record():
    """The tracker's own switch: of two metrics, the one recorded in this report alone is
    written (its layer without records stays 0); the other loses every key and its stale
    ``total_loss_dict`` entry. Without ``skip_unrecorded`` the report is Megatron's zeros."""
    tracker = MoEMetricsTracker()
    for name in ("a_loss", "b_loss"):
        tracker.record(name, torch.tensor(2.0), 1, num_layers=2)
    totals: dict[str, float] = {}
    tracker.report(1.0, 0, total_loss_dict=totals, mean_over_records=True, skip_unrecorded=True)
    assert totals == {"a_loss": 1.0, "b_loss": 1.0}  # (2.0 + 0) / 2 layers
    tracker.record("a_loss", torch.tensor(3.0), 2, num_layers=2)
    tracker.record("a_loss", torch.tensor(5.0), 2, num_layers=2)
    writer = RecordingWriter()
    tracker.report(
        1.0,
        1,
        writer,
        per_layer_logging=True,
        total_loss_dict=totals,
        percentiles={"b_loss": [0.5]},
        mean_over_records=True,
        skip_unrecorded=True,
    )
    assert writer.rows == {
        1: {"moe/a_loss": 2.0, "moe/a_loss_layer_0": 0.0, "moe/a_loss_layer_1": 4.0}
    }
    assert totals == {"a_loss": 2.0}
    assert tracker._last_unrecorded == ["b_loss"]
    writer = RecordingWriter()
    tracker.report(1.0, 2, writer, mean_over_records=True)
    assert writer.rows == {2: {"moe/a_loss": 0.0, "moe/b_loss": 0.0}}
    with pytest.raises(ValueError, match="needs mean_over_records"):
        tracker.report(1.0, 3, skip_unrecorded=True)
    with pytest.raises(TypeError, match="skip_unrecorded"):
        tracker.report(1.0, 3, mean_over_records=True, skip_unrecorded=1)  # type: ignore[arg-type]
