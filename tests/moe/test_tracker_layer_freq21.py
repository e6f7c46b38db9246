"""``MoEMetricsTracker.report(moe_layer_freq=...)`` called directly (the monitor checks the
routers' layers at run start; a Megatron-style loop calls the tracker itself): a layer the
argument calls dense that holds a record was summed into the mean over the MoE layers (4 layers
of 1.1..1.4 with ``moe_layer_freq=2``: a "mean" of 2.5) and its per-layer key left out."""

from __future__ import annotations

import pytest

from trainvitals.moe.tracker import MoEMetricsTracker


class Rows:
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def add_scalars(self, mapping, step):
        self.rows[step] = dict(mapping)


def _recorded(layers: list[int], value_of=lambda layer: 1.0 + layer / 10) -> MoEMetricsTracker:
    tracker = MoEMetricsTracker()
    for layer in layers:  # (Megatron's layer numbers: 1-based)
        tracker.record("load_balancing_loss", value_of(layer), layer, 4)
    return tracker


def test_records_in_layers_called_dense_are_an_error_naming_them():
    tracker = _recorded([1, 2, 3, 4])
    writer = Rows()
    with pytest.raises(
        ValueError, match=r"moe_layer_freq .*'load_balancing_loss' at layers \[1, 3\]"
    ):
        tracker.report(1.0, 0, writer, per_layer_logging=True, moe_layer_freq=2)
    assert writer.rows == {}  # nothing written
    # kept, as for any refused argument: a corrected call reports this interval once
    tracker.report(1.0, 1, writer, per_layer_logging=True)
    assert writer.rows[1]["moe/load_balancing_loss"] == pytest.approx(1.25, rel=1e-6)
    tracker.report(1.0, 2, writer)  # (then zeroed, as after any report)
    assert writer.rows[2]["moe/load_balancing_loss"] == 0.0


@pytest.mark.parametrize("freq", [2, [1, 0, 1, 0]])
def test_records_in_the_moe_layers_only_report_their_mean(freq):
    values = {1: 1.1, 3: 1.3}  # layers 0 and 2 (0-based) are the MoE ones
    tracker = _recorded(list(values), values.get)
    writer = Rows()
    tracker.report(1.0, 0, writer, per_layer_logging=True, moe_layer_freq=freq)
    row = writer.rows[0]
    assert row["moe/load_balancing_loss"] == pytest.approx(sum(values.values()) / 2, rel=1e-6)
    assert sorted(row) == [
        "moe/load_balancing_loss",
        "moe/load_balancing_loss_layer_0",
        "moe/load_balancing_loss_layer_2",
    ]


def test_a_zero_recorded_in_a_dense_layer_is_seen_through_the_record_counts():
    # mean_over_records: the counts travel with the values, so a recorded 0.0 is a record
    tracker = _recorded([1, 2], {1: 1.1, 2: 0.0}.get)
    with pytest.raises(ValueError, match=r"at layers \[1\]"):
        tracker.report(1.0, 0, Rows(), moe_layer_freq=2, mean_over_records=True)
