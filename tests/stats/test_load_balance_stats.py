"""stats/load_balance against independent float64 numpy formulas on the whole load matrix."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from trainvitals.stats.load_balance import (
    AGGREGATES,
    LAYER_METRICS,
    UTILIZATION_QUANTILES,
    aggregate_across_layers,
    load_balance_stats,
)


def _reference(loads: np.ndarray) -> dict[str, np.ndarray]:
    """Per-layer metrics computed row by row with numpy, float64."""
    rows = {name: [] for name in LAYER_METRICS}
    for row in loads.astype(np.float64):
        if row.sum() == 0:
            for name in LAYER_METRICS:
                rows[name].append(np.nan)
            continue
        e = row.size
        mean = row.mean()
        util = row / (row.sum() / e)
        p = row[row > 0] / row.sum()
        rows["cv"].append(np.std(row, ddof=0) / mean)
        rows["dead_expert_frac"].append(np.count_nonzero(row == 0) / e)
        rows["expert_diversity"].append(np.exp(-(p * np.log(p)).sum()) / e)
        rows["max_overload_factor"].append(row.max() / mean)
        for name, q in UTILIZATION_QUANTILES:
            rows[f"utilization_{name}"].append(np.quantile(util, q))
    return {k: np.array(v) for k, v in rows.items()}


@pytest.mark.parametrize("shape", [(1, 4), (3, 8), (12, 16), (5, 7)])
def test_per_layer_and_aggregates_match_numpy(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(shape))
    loads = rng.integers(0, 50, size=shape).astype(np.float64)
    loads[0, 0] = 0.0  # at least one dead expert
    if shape[0] > 2:
        loads[1] = 0.0  # an inactive layer: NaN and left out of the aggregates
        loads[2, :] = [100.0] + [0.0] * (shape[1] - 1)  # all tokens on one expert
    s = load_balance_stats(torch.tensor(loads, dtype=torch.float32), top_k=3)
    ref = _reference(loads)
    for i, name in enumerate(LAYER_METRICS):
        np.testing.assert_allclose(
            s.per_layer[i].numpy(), ref[name], rtol=1e-12, atol=1e-12, err_msg=name
        )
        active = ref[name][~np.isnan(ref[name])]
        expected = [active.mean(), np.median(active), active.min(), active.max()]
        np.testing.assert_allclose(s.aggregates[i].numpy(), expected, rtol=1e-12, err_msg=name)

    with np.errstate(invalid="ignore"):
        util = loads / (loads.sum(1, keepdims=True) / shape[1])
    active_util = util[loads.sum(1) > 0].reshape(-1)
    np.testing.assert_allclose(
        s.utilization_quantiles.numpy(),
        [np.quantile(active_util, q) for _, q in UTILIZATION_QUANTILES],
        rtol=1e-12,
    )
    # top / bottom experts overall: the values are the k largest / smallest utilizations and
    # the indices point at experts that have them.
    k = min(3, active_util.size)
    np.testing.assert_allclose(s.top_values[:k].numpy(), np.sort(active_util)[::-1][:k], rtol=1e-12)
    np.testing.assert_allclose(s.bottom_values[:k].numpy(), np.sort(active_util)[:k], rtol=1e-12)
    flat = util.reshape(-1)
    np.testing.assert_allclose(
        flat[s.top_indices[:k].numpy()], s.top_values[:k].numpy(), rtol=1e-12
    )
    np.testing.assert_allclose(
        flat[s.bottom_indices[:k].numpy()], s.bottom_values[:k].numpy(), rtol=1e-12
    )


def test_known_values_and_nemo_conversion() -> None:
    loads = torch.tensor([[10.0, 10, 10, 10], [40, 0, 0, 0], [30, 10, 0, 0]])
    s = load_balance_stats(loads)
    cv = s.per_layer[LAYER_METRICS.index("cv")].numpy()
    # perfectly balanced: cv 0, diversity 1; one expert takes all: cv sqrt(E-1), diversity 1/E
    assert cv[0] == 0.0
    assert cv[1] == pytest.approx(np.sqrt(3.0))
    div = s.per_layer[LAYER_METRICS.index("expert_diversity")].numpy()
    assert div[0] == pytest.approx(1.0) and div[1] == pytest.approx(0.25)
    # NeMo's sample-std CV is ours times sqrt(E / (E - 1))
    row = loads[2].double().numpy()
    assert np.std(row, ddof=1) / row.mean() == pytest.approx(cv[2] * np.sqrt(4 / 3))


def test_median_of_even_count_interpolates() -> None:
    out = aggregate_across_layers(torch.tensor([[1.0, 2.0, 10.0, 20.0, float("nan")]]))
    assert out.shape == (1, len(AGGREGATES))
    np.testing.assert_allclose(out[0].numpy(), [8.25, 6.0, 1.0, 20.0])
    assert torch.isnan(aggregate_across_layers(torch.full((2, 3), float("nan")))).all()


def test_all_layers_inactive_gives_nan_not_zero() -> None:
    s = load_balance_stats(torch.zeros(2, 4), top_k=2)
    assert torch.isnan(s.per_layer).all()
    assert torch.isnan(s.aggregates).all()
    assert torch.isinf(s.top_values).all() and torch.isinf(s.bottom_values).all()


def test_bad_input() -> None:
    with pytest.raises(TypeError, match="loads"):
        load_balance_stats([[1, 2]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[layers, experts\]"):
        load_balance_stats(torch.ones(4))
    with pytest.raises(ValueError, match="top_k"):
        load_balance_stats(torch.ones(2, 4), top_k=-1)


def test_nanquantile_matches_numpy() -> None:
    from trainvitals.stats.load_balance import nanquantile

    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 9))
    x[rng.random(size=x.shape) < 0.3] = np.nan
    x[2] = np.nan  # an all-NaN row
    x[3, 1:] = np.nan  # a single value
    qs = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = np.nanquantile(x, qs, axis=-1).T
    np.testing.assert_allclose(
        nanquantile(torch.tensor(x), qs).numpy(), expected, rtol=1e-12, atol=1e-15
    )


# ------------------------------------------------------------------ the host (numpy) path


def _host_cases() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    cases = []
    for shape in [(1, 1), (1, 4), (3, 8), (4, 8), (12, 16), (5, 7), (64, 64)]:
        loads = rng.integers(0, 50, size=shape).astype(np.float64)
        loads[0, 0] = 0.0
        if shape[0] > 2:
            loads[1] = 0.0  # inactive layer
            loads[2, :] = [100.0] + [0.0] * (shape[1] - 1)
        cases.append(loads)
    cases.append(np.zeros((3, 4)))  # nothing routed
    cases.append(np.full((4, 8), 5.0))  # perfect balance, all ties
    return cases


@pytest.mark.parametrize("case", range(9))
def test_host_path_matches_device_path_and_numpy(case: int) -> None:
    """load_balance_stats_host (Python floats up to 2048 loads, numpy above) agrees with the
    device path to a few ulps and with the independent numpy reference."""
    from trainvitals.stats.load_balance import load_balance_stats_host

    loads = _host_cases()[case]
    top_k = 5
    host = load_balance_stats_host(loads, top_k=top_k)
    dev = load_balance_stats(torch.tensor(loads), top_k=top_k)
    for field in ("utilization", "per_layer", "aggregates", "utilization_quantiles"):
        got = getattr(host, field)
        assert isinstance(got, np.ndarray) and got.dtype == np.float64, field
        np.testing.assert_allclose(
            got, getattr(dev, field).numpy(), rtol=1e-13, atol=0, equal_nan=True, err_msg=field
        )
    ref = _reference(loads)
    for i, name in enumerate(LAYER_METRICS):
        np.testing.assert_allclose(
            host.per_layer[i], ref[name], rtol=1e-12, atol=1e-12, err_msg=name
        )
    # Top/bottom k: the same values as torch.topk; ties go to the lowest flat index.
    k = min(top_k, loads.size)
    assert host.top_indices.dtype == np.int64 and host.top_indices.shape == (k,)
    np.testing.assert_array_equal(host.top_values, dev.top_values.numpy())
    np.testing.assert_array_equal(host.bottom_values, dev.bottom_values.numpy())
    flat = host.utilization.reshape(-1)
    high = np.where(np.isnan(flat), -np.inf, flat)
    low = np.where(np.isnan(flat), np.inf, flat)
    np.testing.assert_array_equal(high[host.top_indices], host.top_values)
    np.testing.assert_array_equal(low[host.bottom_indices], host.bottom_values)
    np.testing.assert_array_equal(host.top_indices, np.argsort(-high, kind="stable")[:k])
    np.testing.assert_array_equal(host.bottom_indices, np.argsort(low, kind="stable")[:k])


def test_host_path_all_ties_lowest_index_first() -> None:
    from trainvitals.stats.load_balance import load_balance_stats_host

    s = load_balance_stats_host(np.full((2, 4), 3.0), top_k=3)
    assert s.top_indices.tolist() == [0, 1, 2]
    assert s.bottom_indices.tolist() == [0, 1, 2]
    assert s.per_layer[LAYER_METRICS.index("cv")].tolist() == [0.0, 0.0]


def test_host_path_bad_input_and_no_warnings() -> None:
    from trainvitals.stats.load_balance import load_balance_stats_host

    with pytest.raises(TypeError, match="loads"):
        load_balance_stats_host(torch.ones(2, 4))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="loads"):
        load_balance_stats_host([[1, 2]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[layers, experts\]"):
        load_balance_stats_host(np.ones(4))
    with pytest.raises(ValueError, match="top_k"):
        load_balance_stats_host(np.ones((2, 4)), top_k=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inactive layers must not warn (0/0, log 0, all-NaN)
        for loads in (np.zeros((2, 3)), np.zeros((64, 64)), np.eye(64)):
            load_balance_stats_host(loads, top_k=2)


@pytest.mark.parametrize("shape", [(3, 7), (2, 1500)])
def test_host_aggregates_and_nanquantile_match_device(shape: tuple[int, int]) -> None:
    from trainvitals.stats.load_balance import (
        aggregate_across_layers_host,
        nanquantile,
        nanquantile_host,
    )

    rng = np.random.default_rng(3)
    x = rng.normal(size=shape)
    x[rng.random(size=x.shape) < 0.3] = np.nan
    x[1] = np.nan  # an all-NaN row
    qs = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = aggregate_across_layers_host(x)
        quantiles = nanquantile_host(x, qs)
    np.testing.assert_allclose(
        got, aggregate_across_layers(torch.tensor(x)).numpy(), rtol=1e-13, equal_nan=True
    )
    np.testing.assert_array_equal(quantiles, nanquantile(torch.tensor(x), qs).numpy())
    assert aggregate_across_layers_host(x[0]).shape == (1, len(AGGREGATES))


@pytest.mark.parametrize("case", range(9))
def test_lists_path_equals_host_path(case: int) -> None:
    """load_balance_stats_lists (what LoadBalanceMonitor uses) gives the host path's floats."""
    from trainvitals.stats.load_balance import (
        aggregate_across_layers_host,
        aggregate_across_layers_lists,
        load_balance_stats_host,
        load_balance_stats_lists,
    )

    loads = _host_cases()[case]
    got = load_balance_stats_lists(loads.tolist(), top_k=4)
    want = load_balance_stats_host(loads, top_k=4)
    for field in (
        "utilization",
        "per_layer",
        "aggregates",
        "utilization_quantiles",
        "top_values",
        "top_indices",
        "bottom_values",
        "bottom_indices",
    ):
        value = getattr(got, field)
        assert isinstance(value, list), field
        np.testing.assert_array_equal(np.array(value), getattr(want, field), err_msg=field)
    assert all(isinstance(i, int) for i in got.top_indices + got.bottom_indices)
    row = got.per_layer[0]
    np.testing.assert_array_equal(
        aggregate_across_layers_lists(row), aggregate_across_layers_host(np.array(row))[0]
    )
    with pytest.raises(TypeError, match="loads"):
        load_balance_stats_lists(loads)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same non-zero length"):
        load_balance_stats_lists([[1.0, 2.0], [3.0]])
    with pytest.raises(ValueError, match="top_k"):
        load_balance_stats_lists([[1.0]], top_k=-2)
