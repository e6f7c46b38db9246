"""MoEMetricsTracker on 4 gloo ranks: dp x tp reductions against a float64 computation on all
ranks' values, one coalesced collective per group and stage, a pipeline stage without MoE
layers (no flag, no hang), data-parallel ranks without records for a layer under
mean_over_records (left out of the average, not averaged in as 0), and mismatched
configurations raising on every rank."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers.dist import run_distributed

NUM_LAYERS = 4
MICRO = 2


def _value(rank: int, name: str, layer: int, micro: int) -> float:
    """A deterministic value per rank, metric, layer (1-based) and micro-batch."""
    return 0.1 + 0.37 * rank + 0.11 * layer + 0.05 * micro + 0.3 * len(name)


def _dp_tp_body(rank: int, world_size: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from trainvitals.distributed import ProcessGroups, collective_counter
    from trainvitals.moe import MoEMetricsTracker

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    groups = ProcessGroups.from_device_mesh(mesh)
    tracker = MoEMetricsTracker()
    for micro in range(MICRO):
        for layer in range(1, NUM_LAYERS + 1):
            for name in ("load_balancing_loss", "tokens_loss"):  # SUM over tp, AVG over dp
                v = torch.tensor(_value(rank, name, layer, micro))
                tracker.record(name, v, layer, NUM_LAYERS, reduce_group=groups.tp)
            v = torch.tensor(_value(rank, "z_loss", layer, micro))  # AVG over tp, AVG over dp
            tracker.record("z_loss", v, layer, NUM_LAYERS, avg_group=groups.tp)
            v = torch.tensor(_value(rank, "global_loss", layer, micro))  # SUM over dp only
            tracker.record(
                "global_loss", v, layer, NUM_LAYERS, reduce_group=groups.dp, needs_dp_avg=False
            )
    before = dict(collective_counter)
    rows: dict[str, float] = {}

    class W:
        def add_scalars(self, mapping, step):
            rows.update(mapping)

    totals: dict[str, float] = {}
    tracker.report(1 / MICRO, 5, W(), per_layer_logging=True, total_loss_dict=totals, groups=groups)
    counts = {k: collective_counter[k] - before.get(k, 0) for k in collective_counter}
    # a second report with nothing recorded: zeros, same collectives
    tracker.report(1.0, 6, None, groups=groups)
    return {"rows": rows, "counts": counts, "coords": mesh.get_coordinate()}


def _all_body(rank: int, world_size: int) -> dict:
    """Every scenario in one set of 4 processes (spawning costs ~20 s on the shared machine)."""
    return {
        "dp_tp": _dp_tp_body(rank, world_size),
        "pipeline": _pipeline_body(rank, world_size),
        "unrecorded": _unrecorded_body(rank, world_size),
        **{kind: _mismatch_body(rank, world_size, kind) for kind in MISMATCHES},
    }


MISMATCHES = {
    "num_layers": "has 4 layer slots on rank 0 but 6 on rank 2",
    "reduce_group": "reduce_group of 2 ranks is used by ranks [0] only",
    "track_names": "different track_names",
    "dp_group": "the dp group of 4 ranks is used by ranks [0, 1] only",
    "needs_dp_avg": "needs_dp_avg=True on rank 0 but False on rank 2",
}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_body, 4, timeout=180)


def test_dp_x_tp_reductions_match_float64_and_use_one_collective_per_group_and_stage(results):
    results = [r["dp_tp"] for r in results]
    coords = {r: tuple(res["coords"]) for r, res in enumerate(results)}  # rank -> (dp, tp)
    ranks_of_dp = {d: [r for r, c in coords.items() if c[0] == d] for d in (0, 1)}

    def per_layer(name: str, rank: int) -> np.ndarray:
        return np.array(
            [
                sum(_value(rank, name, layer, m) for m in range(MICRO)) / MICRO
                for layer in range(1, NUM_LAYERS + 1)
            ]
        )

    for rank, res in enumerate(results):
        tp_peers = ranks_of_dp[coords[rank][0]]
        dp_peers = [r for r, c in coords.items() if c[1] == coords[rank][1]]
        row = res["rows"]
        # SUM over tp, then AVG over dp: the mean over dp replicas of the tp-summed values.
        for name in ("load_balancing_loss", "tokens_loss"):
            expected = np.mean(
                [sum(per_layer(name, r) for r in ranks_of_dp[d]) for d in (0, 1)], axis=0
            )
            assert row[f"moe/{name}"] == pytest.approx(expected.mean(), rel=1e-6)
            for i in range(NUM_LAYERS):
                assert row[f"moe/{name}_layer_{i}"] == pytest.approx(expected[i], rel=1e-6)
        expected = np.mean(
            [np.mean([per_layer("z_loss", r) for r in ranks_of_dp[d]], axis=0) for d in (0, 1)],
            axis=0,
        )
        assert row["moe/z_loss"] == pytest.approx(expected.mean(), rel=1e-6)
        # SUM over this rank's dp group, no dp average.
        expected = sum(per_layer("global_loss", r) for r in dp_peers)
        assert row["moe/global_loss"] == pytest.approx(expected.mean(), rel=1e-6)
        assert len(tp_peers) == 2
        # one all_gather_object; all_reduce: tp SUM (2 metrics coalesced), dp SUM, tp AVG, dp AVG
        assert res["counts"] == {"all_gather_object": 1, "all_reduce": 4}


def _pipeline_body(rank: int, world_size: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from trainvitals.distributed import ProcessGroups, collective_counter
    from trainvitals.moe import MoEMetricsTracker

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    groups = ProcessGroups.from_device_mesh(mesh)
    stage = mesh.get_coordinate()[0]
    tracker = MoEMetricsTracker()
    out = []
    for step in range(2):
        if stage == 0:  # the first stage holds layers 1-2 (MoE); stage 1 is dense: no record
            for layer in (1, 2):
                for name in ("load_balancing_loss", "z_loss"):
                    v = _value(rank, name, layer, step)
                    tracker.record(name, torch.tensor(v), layer, NUM_LAYERS)
        rows: dict[str, float] = {}

        class W:
            def add_scalars(self, mapping, s, rows=rows):
                rows.update(mapping)

        before = dict(collective_counter)
        log = tracker.report(
            1.0, step, W(), per_layer_logging=True, moe_layer_freq=[1, 1, 0, 0], groups=groups
        )
        counts = {k: collective_counter[k] - before.get(k, 0) for k in collective_counter}
        out.append({"rows": rows, "log": log, "counts": counts})
    return {"steps": out, "stage": stage, "dp": mesh.get_coordinate()[1]}


def test_pipeline_stage_without_moe_layers_needs_no_flag_and_gets_the_values(results):
    results = [r["pipeline"] for r in results]
    stage0 = [r for r, res in enumerate(results) if res["stage"] == 0]
    for step in range(2):
        for name in ("load_balancing_loss", "z_loss"):
            # SUM over pp (stage 1 adds zeros), AVG over the dp ranks of stage 0.
            layers = np.array(
                [np.mean([_value(r, name, layer, step) for r in stage0]) for layer in (1, 2)]
            )
            for res in results:  # every rank, with or without MoE layers, has the values
                row = res["steps"][step]["rows"]
                assert row[f"moe/{name}"] == pytest.approx(layers.sum() / 2, rel=1e-6)
                assert row[f"moe/{name}_layer_0"] == pytest.approx(layers[0], rel=1e-6)
                assert row[f"moe/{name}_layer_1"] == pytest.approx(layers[1], rel=1e-6)
                assert f"moe/{name}_layer_2" not in row
        for res in results:
            assert res["steps"][step]["counts"] == {"all_gather_object": 1, "all_reduce": 2}
            assert res["steps"][step]["log"] == results[0]["steps"][step]["log"]


def _mismatch_body(rank: int, world_size: int, kind: str) -> str:
    import torch
    import torch.distributed as dist

    from trainvitals.distributed import ProcessGroups, world_group
    from trainvitals.moe import MoEMetricsTracker

    tracker = MoEMetricsTracker()
    if kind == "num_layers":
        tracker.record("load_balancing_loss", torch.tensor(1.0), 1, 4 if rank < 2 else 6)
    elif kind == "reduce_group":
        pair = dist.new_group([0, 1])
        dist.new_group([2, 3])
        if rank == 0:  # rank 1 never records it: Megatron would hang in the collective
            tracker.record("z_loss", torch.tensor(1.0), 1, 2, reduce_group=pair)
    elif kind in ("track_names", "dp_group"):
        tracker.record("z_loss", torch.tensor(1.0), 1, 2)
    elif kind == "needs_dp_avg":
        tracker.record("z_loss", torch.tensor(1.0), 1, 2, needs_dp_avg=rank != 2)
    try:
        tracker.report(
            1.0,
            0,
            track_names=["z_loss"] if kind == "track_names" and rank == 3 else None,
            groups=ProcessGroups(dp=world_group() if kind != "dp_group" or rank < 2 else None),
        )
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_mismatched_configuration_is_an_error_on_every_rank(results, kind):
    match = MISMATCHES[kind]
    messages = [r[kind] for r in results]
    assert all(match in m for m in messages), messages
    assert len(set(messages)) == 1  # the same message everywhere


# ---------------------------------------------------------------------- ranks without records

# mean_over_records, 3 layers on a (dp=2, tp=2) mesh (rank = 2 * dp + tp): per metric and rank,
# how many values each 1-based layer records (0: every forward of that rank had no token).
UNRECORDED = {
    "z_loss": {  # AVG over dp ({0, 2} and {1, 3})
        0: {1: 2, 2: 1, 3: 0},
        1: {1: 1, 2: 0, 3: 0},
        2: {1: 3, 2: 0, 3: 0},  # layer 2 of dp group {0, 2}: rank 0 only
        3: {1: 1, 2: 2, 3: 0},  # layer 2 of dp group {1, 3}: rank 3 only; layer 3: nobody
    },
    "load_balancing_loss": {  # SUM over tp ({0, 1}, {2, 3}), then AVG over dp
        0: {1: 2, 2: 1, 3: 1},
        1: {1: 2, 2: 1, 3: 0},  # layer 3 of replica 0: rank 0's share only (ranks 1 and 3
        2: {1: 1, 2: 0, 3: 1},  # hold a replica's value without a record of their own)
        3: {1: 1, 2: 0, 3: 0},  # layer 2: replica 1 recorded nothing
    },
    "avg_loss": {  # AVG over the tp members that recorded, then over dp
        0: {1: 1, 2: 1, 3: 1},
        1: {1: 1, 2: 0, 3: 0},
        2: {1: 2, 2: 0, 3: 0},  # layer 2 of replica 1: rank 3's only
        3: {1: 1, 2: 1, 3: 0},  # layer 3: replica 1 recorded nothing
    },
    "global_loss": {  # SUM over dp, no dp average: the ranks' shares, unchanged
        0: {1: 1, 2: 1, 3: 0},
        1: {1: 1, 2: 0, 3: 0},
        2: {1: 1, 2: 0, 3: 0},
        3: {1: 1, 2: 1, 3: 0},
    },
}
# (pp=2, dp=2) mesh (rank = 2 * pp + dp): stage 0 holds layers 1-2, stage 1 layers 3-4.
UNRECORDED_PP = {0: {1: 2, 2: 1}, 1: {1: 1}, 2: {3: 2}, 3: {3: 1, 4: 3}}


def _record_counts(tracker, name, rank, counts, num_layers, **kw) -> None:
    import torch

    for layer, n in counts.items():
        for micro in range(n):
            tracker.record(
                name, torch.tensor(_value(rank, name, layer, micro)), layer, num_layers, **kw
            )


def _unrecorded_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from trainvitals.distributed import ProcessGroups, collective_counter
    from trainvitals.moe import MoEMetricsTracker

    class W:
        def __init__(self) -> None:
            self.rows: dict[str, float] = {}

        def add_scalars(self, mapping, step):
            self.rows.update(mapping)

    out: dict = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    groups = ProcessGroups.from_device_mesh(mesh)
    tracker = MoEMetricsTracker()
    kwargs = {
        "z_loss": {},
        "load_balancing_loss": {"reduce_group": groups.tp},
        "avg_loss": {"avg_group": groups.tp},
        "global_loss": {"reduce_group": groups.dp, "needs_dp_avg": False},
    }
    for name, per_rank in UNRECORDED.items():
        _record_counts(tracker, name, rank, per_rank[rank], 3, **kwargs[name])
    writer = W()
    before = dict(collective_counter)
    tracker.report(1.0, 0, writer, per_layer_logging=True, groups=groups, mean_over_records=True)
    counts = {k: collective_counter[k] - before.get(k, 0) for k in collective_counter}
    out["dp_tp"] = {"rows": writer.rows, "counts": counts}

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    groups = ProcessGroups.from_device_mesh(mesh)
    tracker = MoEMetricsTracker()
    _record_counts(tracker, "load_balancing_loss", rank, UNRECORDED_PP[rank], 4)
    steps = []
    for step in range(2):  # the second report: nothing recorded anywhere
        writer = W()
        before = dict(collective_counter)
        tracker.report(
            1.0, step, writer, per_layer_logging=True, groups=groups, mean_over_records=True
        )
        counts = {k: collective_counter[k] - before.get(k, 0) for k in collective_counter}
        steps.append({"rows": writer.rows, "counts": counts})
    out["pp_dp"] = steps
    return out


def _rank_means(name: str, rank: int, counts: dict[int, int]) -> dict[int, float]:
    """float64 mean of each layer's records on ``rank`` (0.0 where it recorded nothing)."""
    return {
        layer: math.fsum(_value(rank, name, layer, m) for m in range(n)) / n if n else 0.0
        for layer, n in counts.items()
    }


def test_a_data_parallel_rank_without_records_for_a_layer_counts_for_nothing(results):
    """mean_over_records: a rank whose router recorded nothing for a layer (no token in any of
    its forwards) is left out of the data-parallel average instead of entering it as 0 (which
    halved the layer's value on 2 ranks), after the tp SUM / tp AVG of its replica, and a layer
    no rank recorded stays 0. No collective is added."""
    means = {
        name: {r: _rank_means(name, r, per_rank[r]) for r in per_rank}
        for name, per_rank in UNRECORDED.items()
    }
    recorded = {
        name: {r: {layer for layer, n in per_rank[r].items() if n} for r in per_rank}
        for name, per_rank in UNRECORDED.items()
    }
    replicas = {0: (0, 1), 1: (2, 3)}  # dp coordinate -> its tp ranks
    # rel=1e-6: the tracker adds the records in float32 (its vectors), the means here are float64
    for rank, res in enumerate(r["unrecorded"]["dp_tp"] for r in results):
        row = res["rows"]
        tp = rank % 2
        dp_peers = (tp, 2 + tp)  # the ranks this rank averages with
        for layer in (1, 2, 3):
            i = layer - 1
            # z_loss: the mean of the dp peers that recorded the layer
            vals = [means["z_loss"][r][layer] for r in dp_peers if layer in recorded["z_loss"][r]]
            expected = math.fsum(vals) / len(vals) if vals else 0.0
            assert row[f"moe/z_loss_layer_{i}"] == pytest.approx(expected, rel=1e-6), (rank, i)
            # tp SUM, tp AVG: per replica, then the mean over the replicas with a record
            # (avg_loss: the mean over the replica's ranks that recorded the layer)
            for name in ("load_balancing_loss", "avg_loss"):
                per_replica = []
                for ranks in replicas.values():
                    with_records = [r for r in ranks if layer in recorded[name][r]]
                    if not with_records:
                        continue
                    if name == "load_balancing_loss":  # tp SUM
                        per_replica.append(math.fsum(means[name][r][layer] for r in ranks))
                    else:  # tp AVG over the members that recorded
                        vals = [means[name][r][layer] for r in with_records]
                        per_replica.append(math.fsum(vals) / len(vals))
                expected = math.fsum(per_replica) / len(per_replica) if per_replica else 0.0
                key = f"moe/{name}_layer_{i}"
                assert row[key] == pytest.approx(expected, rel=1e-6), (rank, key)
            # the dp SUM of the shares, no average: unchanged
            expected = math.fsum(means["global_loss"][r][layer] for r in dp_peers)
            assert row[f"moe/global_loss_layer_{i}"] == pytest.approx(expected, rel=1e-6)
        for name in UNRECORDED:
            layers = [row[f"moe/{name}_layer_{i}"] for i in range(3)]
            assert row[f"moe/{name}"] == pytest.approx(math.fsum(layers) / 3, rel=1e-6)
        # the documented cases, by hand: rank 0 alone recorded z_loss layer 2 in its dp group
        if rank == 0:
            assert row["moe/z_loss_layer_1"] == float(np.float32(_value(0, "z_loss", 2, 0)))
            assert row["moe/z_loss_layer_2"] == 0.0  # no rank recorded layer 3
        # one all_gather_object; all_reduce: tp SUM, dp SUM (global_loss), tp AVG, dp
        assert res["counts"] == {"all_gather_object": 1, "all_reduce": 4}


def test_pipeline_stages_carry_which_dp_ranks_recorded_each_layer(results):
    """(pp=2, dp=2), mean_over_records: each stage's layers reach every rank through the
    pipeline SUM with the flags of the ranks that recorded them, so the data-parallel ranks of
    the stage without the layer divide by the same number of recording ranks as the stage that
    holds it; a second report with nothing recorded is all zeros. Same collectives as before."""
    means = {r: _rank_means("load_balancing_loss", r, UNRECORDED_PP[r]) for r in range(4)}
    expected = [
        (means[0][1] + means[1][1]) / 2,  # both dp ranks of stage 0
        means[0][2],  # rank 1 recorded no layer 2
        (means[2][3] + means[3][3]) / 2,
        means[3][4],  # rank 2 recorded no layer 4
    ]
    for res in (r["unrecorded"]["pp_dp"] for r in results):
        row = res[0]["rows"]
        for i, value in enumerate(expected):
            assert row[f"moe/load_balancing_loss_layer_{i}"] == pytest.approx(value, rel=1e-6)
        assert row["moe/load_balancing_loss"] == pytest.approx(math.fsum(expected) / 4, rel=1e-6)
        assert all(v == 0.0 for v in res[1]["rows"].values())
        assert len(res[1]["rows"]) == 5
        for step in res:  # one all_gather_object; all_reduce: pp SUM, dp
            assert step["counts"] == {"all_gather_object": 1, "all_reduce": 2}
