"""MoEMetricsTracker's ``avg_group`` step with ``mean_over_records`` on 2 gloo ranks: the mean over
the members of the group that recorded the layer (a member without records is not averaged in
as 0), in the same one collective; without ``mean_over_records`` Megatron's AVG over the group
size."""

from __future__ import annotations

import pytest

from tests.helpers.dist import run_distributed

# rank -> {layer (1-based): value recorded}; layer 3 recorded by nobody
RECORDS = {0: {1: 4.0, 2: 1.0}, 1: {2: 3.0}}


class _Writer:
    def __init__(self) -> None:
        self.rows: dict[str, float] = {}

    def add_scalars(self, mapping, step) -> None:
        self.rows.update(mapping)


def _body(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    from trainvitals.distributed import ProcessGroups, collective_counter
    from trainvitals.moe import MoEMetricsTracker

    group = dist.new_group([0, 1])
    out = {}
    for mean_over_records in (True, False):
        tracker = MoEMetricsTracker()
        for layer, value in RECORDS[rank].items():
            tracker.record("avg_loss", torch.tensor(value), layer, 3, avg_group=group)
        writer = _Writer()
        before = dict(collective_counter)
        tracker.report(
            1.0,
            0,
            writer,
            per_layer_logging=True,
            groups=ProcessGroups(),
            mean_over_records=mean_over_records,
        )
        counts = {k: collective_counter[k] - before.get(k, 0) for k in collective_counter}
        out[mean_over_records] = {"rows": writer.rows, "counts": counts}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_body, 2, timeout=120)


def test_avg_group_mean_is_over_the_members_that_recorded(results):
    for res in results:  # the same values on both ranks
        rows = res[True]["rows"]
        # layer 1: rank 0 alone recorded 4.0 -> 4.0 (not (4 + 0) / 2 = 2.0)
        assert rows["moe/avg_loss_layer_0"] == 4.0
        # layer 2: both recorded -> (1 + 3) / 2
        assert rows["moe/avg_loss_layer_1"] == 2.0
        assert rows["moe/avg_loss_layer_2"] == 0.0  # nobody recorded layer 3
        assert rows["moe/avg_loss"] == pytest.approx((4.0 + 2.0 + 0.0) / 3)
        # one all_gather_object, one all-reduce for the avg_group (flags ride along)
        assert res[True]["counts"] == {"all_gather_object": 1, "all_reduce": 1}


def test_without_mean_over_records_avg_group_is_megatrons_avg_over_the_group_size(results):
    for res in results:
        rows = res[False]["rows"]
        assert rows["moe/avg_loss_layer_0"] == 2.0  # (4 + 0) / 2
        assert rows["moe/avg_loss_layer_1"] == 2.0
        assert res[False]["counts"] == {"all_gather_object": 1, "all_reduce": 1}
