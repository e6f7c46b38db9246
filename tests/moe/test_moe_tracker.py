"""MoEMetricsTracker in one process: aggregation, percentiles, per-layer keys, total_loss_dict,
console string, clearing, host transfers, writers and argument errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.moe import (
    MoEMetricsTracker,
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
    set_moe_metrics_tracker,
)


class SummaryWriterLike:
    """TensorBoard's SummaryWriter signatures: add_scalars(main_tag, dict, step) groups runs,
    so the tracker must use add_scalar for it."""

    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}
        self.add_scalars_calls = 0

    def add_scalar(self, tag, scalar_value, global_step=None, walltime=None):
        self.scalars[tag] = (float(scalar_value), global_step)

    def add_scalars(self, main_tag, tag_scalar_dict, global_step=None, walltime=None):
        self.add_scalars_calls += 1


def _record_random(tracker, name, num_layers, layers, micro_batches, seed):
    """Record random values; return the float64 [micro_batches, num_layers] array recorded."""
    rng = np.random.default_rng(seed)
    table = np.zeros((micro_batches, num_layers))
    for m in range(micro_batches):
        for layer in layers:  # 1-based layer numbers
            v = rng.uniform(0.1, 3.0)
            table[m, layer - 1] = v
            tracker.record(name, torch.tensor(v, dtype=torch.float32), layer, num_layers)
    return table


def test_report_mean_percentiles_per_layer_match_independent_computation():
    tracker = MoEMetricsTracker()
    table = _record_random(tracker, "load_balancing_loss", 6, range(1, 7), 3, seed=0)
    other = _record_random(tracker, "load_imbalance", 6, [1, 3, 5], 3, seed=1)
    writer = Recorder()
    log = tracker.report(
        loss_scale=1 / 3,
        iteration=7,
        writer=writer,
        per_layer_logging=True,
        percentiles={"load_balancing_loss": [0.25, 0.5, 0.95], "load_imbalance": [0.5]},
    )
    row = writer.rows[7]
    per_layer = table.sum(axis=0) / 3
    assert row["moe/load_balancing_loss"] == pytest.approx(per_layer.mean(), rel=1e-6)
    for q in (0.25, 0.5, 0.95):
        expected = np.quantile(per_layer[per_layer > 0], q)
        assert row[f"moe/load_balancing_loss_p{int(q * 100)}"] == pytest.approx(expected, rel=1e-6)
    for i in range(6):
        assert row[f"moe/load_balancing_loss_layer_{i}"] == pytest.approx(per_layer[i], rel=1e-6)
    # load_imbalance: only layers 1, 3, 5 recorded; the mean is over all 6 (moe_layer_freq
    # not given: every layer is MoE), the percentile over the non-zero ones.
    other_layer = other.sum(axis=0) / 3
    assert row["moe/load_imbalance"] == pytest.approx(other_layer.sum() / 6, rel=1e-6)
    assert row["moe/load_imbalance_p50"] == pytest.approx(
        np.median(other_layer[other_layer > 0]), rel=1e-6
    )
    # Console: metrics not ending in "loss", Megatron's format, no per-layer keys.
    assert log == (
        f" load_balancing_loss_p25: {row['moe/load_balancing_loss_p25']:.2f} |"
        f" load_balancing_loss_p50: {row['moe/load_balancing_loss_p50']:.2f} |"
        f" load_balancing_loss_p95: {row['moe/load_balancing_loss_p95']:.2f} |"
        f" load_imbalance: {row['moe/load_imbalance']:.2f} |"
        f" load_imbalance_p50: {row['moe/load_imbalance_p50']:.2f} |"
    )


def test_moe_layer_freq_int_list_and_mtp_count_layers_and_select_per_layer_keys():
    tracker = MoEMetricsTracker()
    # 6 transformer layers + 1 MTP layer; MoE every second layer: slots 0, 2, 4 and 6 (MTP).
    table = _record_random(tracker, "z_loss", 7, [1, 3, 5, 7], 2, seed=2)
    writer = Recorder()
    tracker.report(
        0.5, 1, writer, per_layer_logging=True, num_layers=6, moe_layer_freq=2, mtp_num_layers=1
    )
    per_layer = table.sum(axis=0) / 2
    row = writer.rows[1]
    assert row["moe/z_loss"] == pytest.approx(per_layer.sum() / 4, rel=1e-6)
    assert sorted(k for k in row if "_layer_" in k) == [
        f"moe/z_loss_layer_{i}" for i in (0, 2, 4, 6)
    ]

    table = _record_random(tracker, "z_loss", 7, [2, 3], 1, seed=3)
    tracker.report(
        1.0, 2, writer, per_layer_logging=True, moe_layer_freq=[0, 1, 1, 0, 0, 0], mtp_num_layers=1
    )
    row = writer.rows[2]
    assert row["moe/z_loss"] == pytest.approx(table.sum() / 3, rel=1e-6)  # 2 + 1 MTP layers
    assert sorted(k for k in row if "_layer_" in k) == [f"moe/z_loss_layer_{i}" for i in (1, 2, 6)]


def test_total_loss_dict_receives_this_reports_values_and_does_not_grow():
    tracker = MoEMetricsTracker()
    totals: dict[str, float] = {}
    expected = []
    for it in range(5):
        t1 = _record_random(tracker, "load_balancing_loss", 2, [1, 2], 1, seed=10 + it)
        t2 = _record_random(tracker, "dropped_token_fraction", 2, [1, 2], 1, seed=20 + it)
        log = tracker.report(1.0, it, total_loss_dict=totals)
        expected.append(t1.sum() / 2)
        assert set(totals) == {"load_balancing_loss"}
        assert totals["load_balancing_loss"] == pytest.approx(t1.sum() / 2, rel=1e-6)
        assert log == f" dropped_token_fraction: {t2.sum() / 2:.2f} |"
    # replaced, not summed over the five reports
    assert totals["load_balancing_loss"] != pytest.approx(sum(expected), rel=1e-3)


def test_values_are_zeroed_after_report_and_entries_kept():
    tracker = MoEMetricsTracker()
    tracker.record("a_loss", torch.tensor(2.0), 1, 2)
    tracker.report(1.0, 0)
    assert set(tracker.metrics) == {"a_loss"}
    assert torch.count_nonzero(tracker.metrics["a_loss"].values) == 0
    tracker.record("a_loss", torch.tensor(4.0), 2, 2)
    totals: dict[str, float] = {}
    tracker.report(1.0, 1, total_loss_dict=totals)
    assert totals["a_loss"] == pytest.approx(2.0)  # 4 / 2 layers, not (2 + 4) / 2


def test_track_names_reports_only_those_and_clears_all():
    tracker = MoEMetricsTracker()
    tracker.record("a", torch.tensor(1.0), 1, 1)
    tracker.record("b", torch.tensor(3.0), 1, 1)
    writer = Recorder()
    tracker.report(1.0, 0, writer, track_names="b")
    assert writer.rows[0] == {"moe/b": 3.0}
    assert float(tracker.metrics["a"].values.sum()) == 0.0


def test_percentile_without_nonzero_layer_is_not_written():
    tracker = MoEMetricsTracker()
    tracker.ensure_initialized("x", 3, device="cpu")
    writer = Recorder()
    tracker.report(1.0, 0, writer, percentiles={"x": [0.5]})
    assert writer.rows[0] == {"moe/x": 0.0}


def test_nan_mean_and_layer_value_are_written_not_dropped():
    # A diverged router records NaN: the mean and that layer's value must say so (the writers
    # carry NaN); only a percentile over no non-zero layer is left out.
    tracker = MoEMetricsTracker()
    values = [math.nan, 1.5, 0.5]
    for layer, v in enumerate(values, start=1):
        tracker.record("load_balancing_loss", torch.tensor(v), layer, 3)
    writer = Recorder()
    losses: dict[str, float] = {}
    tracker.report(
        0.5,
        0,
        writer,
        per_layer_logging=True,
        total_loss_dict=losses,
        percentiles={"load_balancing_loss": [0.5]},
    )
    row = writer.rows[0]
    assert math.isnan(row["moe/load_balancing_loss"])
    assert math.isnan(losses["load_balancing_loss"])
    assert math.isnan(row["moe/load_balancing_loss_layer_0"])
    assert row["moe/load_balancing_loss_layer_1"] == 0.5 * 1.5
    # median of the positive (so non-NaN) layers, float64
    finite = [0.5 * v for v in values if v > 0]
    assert row["moe/load_balancing_loss_p50"] == pytest.approx(float(np.median(finite)))


def test_layers_of_plus_and_minus_inf_give_a_nan_mean_not_a_failed_report():
    # A signed metric recorded by the user whose layers diverged both ways: the mean over the
    # layers is NaN (inf - inf, as a device sum gives). math.fsum raised ValueError ("-inf +
    # inf in fsum"), which ended the report before anything was written or cleared.
    tracker = MoEMetricsTracker()
    for layer, v in enumerate([math.inf, -math.inf, 2.0], start=1):
        tracker.record("logit_drift", torch.tensor(v), layer, 3)
    writer = Recorder()
    tracker.report(1.0, 0, writer, per_layer_logging=True)
    row = writer.rows[0]
    assert math.isnan(row["moe/logit_drift"])
    assert row["moe/logit_drift_layer_0"] == math.inf
    assert row["moe/logit_drift_layer_1"] == -math.inf
    assert row["moe/logit_drift_layer_2"] == 2.0
    assert tracker.metrics["logit_drift"].values.tolist() == [0.0, 0.0, 0.0]


def test_one_host_transfer_per_report(monkeypatch):
    tracker = MoEMetricsTracker()
    for name in ("a_loss", "b", "c"):
        _record_random(tracker, name, 4, [1, 2, 3, 4], 2, seed=5)
    calls = {"tolist": 0, "item": 0, "cpu": 0}
    for method in calls:
        original = getattr(torch.Tensor, method)

        def counting(self, *a, _m=method, _o=original, **k):
            calls[_m] += 1
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, counting)
    writer = Recorder()
    tracker.report(
        0.5, 3, writer, per_layer_logging=True, percentiles={"a_loss": [0.5, 0.9], "b": [0.1]}
    )
    assert calls == {"tolist": 1, "item": 0, "cpu": 0}
    assert len(writer.rows[3]) == 3 + 3 + 3 * 4


def test_record_does_not_synchronise_or_keep_the_graph(monkeypatch):
    tracker = MoEMetricsTracker()
    w = torch.tensor(2.0, requires_grad=True)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("record called .item()"))
    tracker.record("a", w * 3, 1, 1)
    assert not tracker.metrics["a"].values.requires_grad


def test_summary_writer_shaped_writer_gets_add_scalar_per_key():
    tracker = MoEMetricsTracker()
    tracker.record("load_balancing_loss", torch.tensor(1.25), 1, 2)
    tracker.record("load_balancing_loss", torch.tensor(0.75), 2, 2)
    writer = SummaryWriterLike()
    tracker.report(1.0, 11, writer, per_layer_logging=True)
    assert writer.add_scalars_calls == 0
    assert writer.scalars == {
        "moe/load_balancing_loss": (1.0, 11),
        "moe/load_balancing_loss_layer_0": (1.25, 11),
        "moe/load_balancing_loss_layer_1": (0.75, 11),
    }


def test_real_tensorboard_summary_writer(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    tracker = MoEMetricsTracker()
    tracker.record("z_loss", torch.tensor(3.0), 1, 1)
    writer = SummaryWriter(str(tmp_path))
    tracker.report(1.0, 4, writer)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    (event,) = acc.Scalars("moe/z_loss")
    assert (event.step, event.value) == (4, 3.0)


def test_real_fanout_writer_with_jsonl_sink(tmp_path):
    # imported, not importorskip'd: a broken trainvitals.adapters must fail here, not skip
    import json

    from trainvitals.adapters import FanoutWriter, JsonlSink

    path = tmp_path / "metrics.jsonl"
    writer = FanoutWriter([JsonlSink(path)])
    tracker = MoEMetricsTracker()
    tracker.record("load_balancing_loss", torch.tensor(1.5), 1, 2)
    tracker.record("load_balancing_loss", torch.tensor(0.5), 2, 2)
    tracker.report(1.0, 2, writer, per_layer_logging=True)
    writer.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    values = {
        (rec["step"], k): v
        for rec in records
        for k, v in rec["metrics"].items()
        if k.startswith("moe/")
    }
    assert values == {
        (2, "moe/load_balancing_loss"): (1.5 + 0.5) / 2,
        (2, "moe/load_balancing_loss_layer_0"): 1.5,
        (2, "moe/load_balancing_loss_layer_1"): 0.5,
    }


def test_snapshot_restore_keeps_training_values_apart():
    tracker = MoEMetricsTracker()
    tracker.record("a", torch.tensor(1.0), 1, 1)
    snap = tracker._snapshot()
    tracker.record("a", torch.tensor(5.0), 1, 1)
    tracker.record("b", torch.tensor(5.0), 1, 1)
    tracker._restore(snap)
    assert float(tracker.metrics["a"].values[0]) == 1.0
    assert float(tracker.metrics["b"].values[0]) == 0.0


def test_global_tracker_get_set_destroy():
    destroy_moe_metrics_tracker()
    first = get_moe_metrics_tracker()
    assert get_moe_metrics_tracker() is first
    mine = MoEMetricsTracker()
    set_moe_metrics_tracker(mine)
    assert get_moe_metrics_tracker() is mine
    destroy_moe_metrics_tracker()
    assert get_moe_metrics_tracker() is not mine
    with pytest.raises(TypeError, match="tracker"):
        set_moe_metrics_tracker(object())  # type: ignore[arg-type]
    destroy_moe_metrics_tracker()


def test_layer_number_none_is_skipped():
    tracker = MoEMetricsTracker()
    tracker.record("a", torch.tensor(1.0), None, 4)
    assert "a" not in tracker.metrics


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": "", "value": 1.0, "layer_number": 1, "num_layers": 2}, TypeError, "name"),
        (
            {"name": "a", "value": 1.0, "layer_number": 3, "num_layers": 2},
            ValueError,
            "layer_number",
        ),
        (
            {"name": "a", "value": 1.0, "layer_number": 0, "num_layers": 2},
            ValueError,
            "layer_number",
        ),
        ({"name": "a", "value": 1.0, "layer_number": 1, "num_layers": 0}, ValueError, "num_layers"),
        (
            {"name": "a", "value": torch.ones(2), "layer_number": 1, "num_layers": 2},
            ValueError,
            "scalar",
        ),
        ({"name": "a", "value": "x", "layer_number": 1, "num_layers": 2}, TypeError, "value"),
    ],
)
def test_record_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        MoEMetricsTracker().record(**kwargs)


def test_record_with_a_different_num_layers_is_an_error():
    tracker = MoEMetricsTracker()
    tracker.record("a", torch.tensor(1.0), 1, 4)
    with pytest.raises(ValueError, match="num_layers=4"):
        tracker.record("a", torch.tensor(1.0), 1, 6)
    with pytest.raises(ValueError, match="num_layers=4"):
        tracker.ensure_initialized("a", 6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss_scale": "1"}, TypeError, "loss_scale"),
        ({"loss_scale": math.inf}, ValueError, "loss_scale"),
        ({"iteration": 1.5}, TypeError, "iteration"),
        ({"track_names": 3}, TypeError, "track_names"),
        ({"num_layers": 0}, ValueError, "num_layers"),
        ({"moe_layer_freq": 0}, ValueError, "moe_layer_freq"),
        ({"moe_layer_freq": [1, 2]}, TypeError, "moe_layer_freq"),
        ({"moe_layer_freq": [1, 0, 1], "num_layers": 2}, ValueError, "moe_layer_freq"),
        ({"mtp_num_layers": -1}, ValueError, "mtp_num_layers"),
        ({"percentiles": {"a": [1.5]}}, ValueError, "percentiles"),
        ({"groups": "dp"}, TypeError, "groups"),
        ({"num_layers": 3}, ValueError, "layer slots"),
    ],
)
def test_report_rejects_bad_arguments_and_keeps_values(kwargs, error, match):
    tracker = MoEMetricsTracker()
    tracker.record("a", torch.tensor(1.0), 1, 2)
    args = {"loss_scale": 1.0, "iteration": 0, **kwargs}
    with pytest.raises(error, match=match):
        tracker.report(**args)
    assert float(tracker.metrics["a"].values[0]) == 1.0


def test_host_quantiles_of_positive_equal_device_ones() -> None:
    """The report's host percentiles use the device formula: bitwise the same floats."""
    from trainvitals.moe._math import quantiles_of_positive, quantiles_of_positive_host

    rng = np.random.default_rng(5)
    qs = [0.0, 0.05, 0.25, 0.5, 0.95, 0.99, 1.0]
    for n in range(1, 40):
        values = rng.choice([0.0, -1.0, 0.5, 2.0], size=n) * rng.random(n)
        device = quantiles_of_positive(torch.tensor(values, dtype=torch.float64), qs).tolist()
        host = quantiles_of_positive_host(values.tolist(), qs)
        assert len(host) == len(qs)
        for a, b in zip(device, host, strict=True):
            assert (math.isnan(a) and math.isnan(b)) or a == b, (values, qs)


def test_report_writes_through_tensorboard_style_add_scalars_every_time() -> None:
    """A writer whose add_scalars is TensorBoard's (main_tag, ...) gets add_scalar calls on
    every report, also after the signature check was cached."""

    class TBLike:
        def __init__(self) -> None:
            self.scalars: list[tuple[str, float, int]] = []

        def add_scalars(self, main_tag: str, values: dict, step: int) -> None:
            raise AssertionError("must not be called with a dict of keys")

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.append((tag, value, step))

    tracker = MoEMetricsTracker()
    writer = TBLike()
    for step in range(3):
        tracker.record("z_loss", torch.tensor(2.0 + step), 1, num_layers=1)
        tracker.report(loss_scale=1.0, iteration=step, writer=writer)
    assert writer.scalars == [
        ("moe/z_loss", 2.0, 0),
        ("moe/z_loss", 3.0, 1),
        ("moe/z_loss", 4.0, 2),
    ]


def test_percentile_keys_name_each_quantile_exactly_and_never_collide():
    # int(q * 100) (Megatron's name) truncates the float product: 0.29 -> p28, and 0.999 would
    # overwrite 0.99 as p99. Each quantile gets its own key and value (linear interpolation over
    # the positive layers, as numpy's default quantile).
    tracker = MoEMetricsTracker()
    values = [0.3, 1.7, 0.9, 2.4, 1.1, 0.2, 3.5]
    for layer, v in enumerate(values, start=1):
        tracker.record("load_balancing_loss", torch.tensor(v), layer, len(values))
    qs = [0.29, 0.5, 0.99, 0.999]
    writer = Recorder()
    tracker.report(1.0, 0, writer, percentiles={"load_balancing_loss": qs})
    row = writer.rows[0]
    recorded = np.array(values, dtype=np.float32).astype(np.float64)  # as the tensors hold them
    expected_keys = ["p29", "p50", "p99", "p99.9"]
    for q, suffix in zip(qs, expected_keys, strict=True):
        key = f"moe/load_balancing_loss_{suffix}"
        assert row[key] == pytest.approx(float(np.quantile(recorded, q)), rel=1e-12), key
    assert row["moe/load_balancing_loss_p99.9"] > row["moe/load_balancing_loss_p99"]


def test_percentiles_sharing_a_key_raise_and_repeats_are_dropped():
    from trainvitals.moe.tracker import _check_percentiles

    assert _check_percentiles({"x": [0.5, 0.5, 0.9]}) == {"x": [0.5, 0.9]}
    with pytest.raises(ValueError, match="share a key"):
        _check_percentiles({"x": [0.5, 0.5 + 1e-14]})


# ---------------------------------------------------------------------- mean over records


def test_mean_over_records_divides_each_layer_by_its_own_record_count():
    """A layer recorded three times (three router forwards), one once, one never: each layer's
    value is the mean of its records, times loss_scale; a layer without records stays 0. The
    default (Megatron's loss_scale alone) is unchanged: the sum times loss_scale."""
    records = {1: [0.5, 1.25, 2.0], 2: [3.0], 3: []}  # 1-based layer -> values recorded
    expected = {1: (0.5 + 1.25 + 2.0) / 3, 2: 3.0, 3: 0.0}
    for mean_over_records, scale in ((True, 1.0), (True, 0.5), (False, 0.5)):
        tracker = MoEMetricsTracker()
        for layer, values in records.items():
            for v in values:
                tracker.record("load_balancing_loss", torch.tensor(v), layer, 3)
        writer = Recorder()
        kwargs = {"mean_over_records": True} if mean_over_records else {}
        tracker.report(scale, 0, writer, per_layer_logging=True, **kwargs)
        row = writer.rows[0]
        per_layer = {
            i: (expected[i] if mean_over_records else math.fsum(records[i])) * scale
            for i in records
        }
        for i, value in per_layer.items():
            assert row[f"moe/load_balancing_loss_layer_{i - 1}"] == pytest.approx(value, rel=1e-7)
        assert row["moe/load_balancing_loss"] == pytest.approx(
            math.fsum(per_layer.values()) / 3, rel=1e-7
        )
        # the counts are cleared with the values: the next report counts its own records
        tracker.record("load_balancing_loss", torch.tensor(4.0), 1, 3)
        tracker.report(1.0, 1, writer, per_layer_logging=True, mean_over_records=True)
        assert writer.rows[1]["moe/load_balancing_loss_layer_0"] == 4.0
    with pytest.raises(TypeError, match="mean_over_records"):
        MoEMetricsTracker().report(1.0, 0, mean_over_records=1)  # type: ignore[arg-type]


def test_snapshot_restore_keeps_the_record_counts_apart():
    """What is recorded between a snapshot and its restore (validation) leaves no count
    behind: the mean is over the training records only."""
    tracker = MoEMetricsTracker()
    tracker.record("z_loss", torch.tensor(1.0), 1, 1)
    snap = tracker._snapshot()
    for _ in range(3):
        tracker.record("z_loss", torch.tensor(9.0), 1, 1)
    tracker._restore(snap)
    tracker.record("z_loss", torch.tensor(3.0), 1, 1)
    totals: dict[str, float] = {}
    tracker.report(1.0, 0, total_loss_dict=totals, mean_over_records=True)
    assert totals["z_loss"] == 2.0  # (1 + 3) / 2


# Per rank: values recorded (one per router forward) into layer 1 of a 1-layer metric.
_DP_VALUES = {0: [1.0, 2.0], 1: [4.0, 5.0, 6.0]}  # z_loss, AVG over data parallel
_SHARES = {0: [0.25, 0.75], 1: [0.5, 1.0]}  # a share of each forward's loss, SUM over dp
_PP_VALUES = {0: [0.5, 1.5, 2.5], 1: [3.25]}  # rank r holds layer r + 1 of 2


def _mean_over_records_body(rank: int, world_size: int) -> dict:
    import torch

    from trainvitals.distributed import ProcessGroups, collective_counter, world_group
    from trainvitals.moe import MoEMetricsTracker

    world = world_group()
    out: dict = {}

    class W:
        def __init__(self) -> None:
            self.rows: dict[str, float] = {}

        def add_scalars(self, mapping, step):
            self.rows.update(mapping)

    # pipeline: each stage divides its own layer by its own count before the SUM
    tracker = MoEMetricsTracker()
    for v in _PP_VALUES[rank]:
        tracker.record("load_balancing_loss", torch.tensor(v), rank + 1, 2)
    writer = W()
    tracker.report(
        1.0,
        0,
        writer,
        per_layer_logging=True,
        groups=ProcessGroups(pp=world),
        mean_over_records=True,
    )
    out["pp"] = writer.rows

    # data parallel, a reduce_group SUM, with and without the division: the same collectives
    for mean_over_records in (True, False):
        tracker = MoEMetricsTracker()
        for v in _DP_VALUES[rank]:
            tracker.record("z_loss", torch.tensor(v), 1, 1)
        for v in _SHARES[rank]:
            tracker.record(
                "global_load_balancing_loss",
                torch.tensor(v),
                1,
                1,
                reduce_group=world,
                needs_dp_avg=False,
            )
        writer = W()
        before = dict(collective_counter)
        tracker.report(
            1.0, 1, writer, groups=ProcessGroups(dp=world), mean_over_records=mean_over_records
        )
        counts = {
            k: v - before.get(k, 0) for k, v in collective_counter.items() if v != before.get(k, 0)
        }
        out[f"dp_{mean_over_records}"] = {"rows": writer.rows, "counts": counts}

    # ranks that disagree raise on every rank, before any tensor collective
    tracker.record("z_loss", torch.tensor(1.0), 1, 1)
    try:
        tracker.report(1.0, 2, groups=ProcessGroups(dp=world), mean_over_records=rank == 0)
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_mean_over_records_on_two_ranks_divides_before_the_reductions():
    """Each rank divides its sums by its own counts, then the reductions run as before, with
    no new collective: under pipeline parallelism each layer's mean comes from its stage;
    data parallel averages the ranks' means; a reduce_group sums the ranks' mean shares."""
    from tests.helpers.dist import run_distributed

    results = run_distributed(_mean_over_records_body, 2, timeout=120)
    mean = {
        r: {k: math.fsum(v) / len(v) for k, v in d.items()}
        for r, d in (("pp", _PP_VALUES), ("dp", _DP_VALUES), ("share", _SHARES))
    }
    for res in results:
        pp = res["pp"]
        assert pp["moe/load_balancing_loss_layer_0"] == pytest.approx(mean["pp"][0], rel=1e-7)
        assert pp["moe/load_balancing_loss_layer_1"] == pytest.approx(mean["pp"][1], rel=1e-7)
        assert pp["moe/load_balancing_loss"] == pytest.approx(
            (mean["pp"][0] + mean["pp"][1]) / 2, rel=1e-7
        )
        dp = res["dp_True"]
        assert dp["rows"]["moe/z_loss"] == pytest.approx(
            (mean["dp"][0] + mean["dp"][1]) / 2, rel=1e-7
        )
        assert dp["rows"]["moe/global_load_balancing_loss"] == pytest.approx(
            mean["share"][0] + mean["share"][1], rel=1e-7
        )
        sums = res["dp_False"]
        assert sums["rows"]["moe/z_loss"] == pytest.approx(
            (sum(_DP_VALUES[0]) + sum(_DP_VALUES[1])) / 2, rel=1e-7
        )
        assert dp["counts"] == sums["counts"] == {"all_gather_object": 1, "all_reduce": 2}
        assert "different mean_over_records" in res["error"]
