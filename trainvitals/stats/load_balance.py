"""Expert load-balance statistics of a mixture-of-experts model: pure tensor math, no I/O.

Input: ``loads``, a ``[L, E]`` tensor with the number of token-to-expert assignments each of the
``E`` experts of each of the ``L`` MoE layers received (a token routed to ``k`` experts counts
once for each). Everything is computed on the tensor's device, in float64, batched over layers
(no Python loop over layers), and nothing is moved to the host.

Definitions (per layer, with ``n_e`` the load of expert ``e``, ``N = sum_e n_e``, ``m = N / E``):

==============================  =====================================================================
metric                          definition
==============================  =====================================================================
``utilization[e]``              ``n_e / m``: 1 = fair share, >1 overloaded, 0 dead (NeMo Automodel)
``cv``                          ``std(n) / m`` with the POPULATION std (divide by ``E``), equal to the
                                std of the utilizations. See "Which std" below.
``dead_expert_frac``            fraction of experts with ``n_e == 0``
``expert_diversity``            ``exp(H) / E`` with ``H = -sum_e p_e log p_e``, ``p_e = n_e / N``,
                                ``0 log 0 = 0``: the effective number of experts as a fraction of
                                ``E`` (1 = uniform; ``k/E`` when only ``k`` experts are used evenly)
``max_overload_factor``         ``max_e n_e / m`` (= the largest utilization)
``utilization_{min,p25,...}``   quantiles of the layer's utilizations
==============================  =====================================================================

Which std: the ``E`` loads are the whole population of the layer's experts, not a sample from a
larger one, so the population standard deviation (``correction=0``) is the natural one; with it
``cv`` is exactly the standard deviation of the utilization ratios and is 0 at perfect balance.
NeMo Automodel uses the sample std (``n - 1``); its value is ours times ``sqrt(E / (E - 1))``
(1.6% larger at ``E = 32``, 0.8% at ``E = 64``).

Quantiles: linear interpolation between order statistics (``torch.quantile``'s default, numpy's
``"linear"``), so the median of an even count is the mean of the two middle values. NeMo takes
``sorted[n // 4]`` for p25 and ``sorted[3n // 4]`` for p75 (no interpolation); the two agree
up to one order statistic. Where the two order statistics are equal the quantile is their
value, infinite ones included: the median of ``[1, inf, inf]`` is ``inf`` (``np.median``'s),
where ``torch.quantile`` and ``np.quantile`` compute ``inf + (inf - inf) * 0 = NaN``. This
matters for the across-layer aggregates of values that can be infinite (the aux losses of
diverged routers); utilizations of finite loads are finite.

Two paths compute the same definitions: :func:`load_balance_stats` on the loads' device with
torch kernels, and :func:`load_balance_stats_host` on a host ``numpy`` float64 array. A
``[layers, experts]`` load matrix is tiny, so once it is on the host (a monitor brings it there
in its one device-to-host transfer anyway) the host path is about ten times cheaper than the
~35 small device kernels; it uses the same formulas (the same interpolation, the same
``0 log 0 = 0``) in float64, so the two agree to a few ulps. The host path breaks ties of the
top/bottom ``k`` by the lowest flat index (``torch.topk`` leaves their order unspecified).

A layer whose loads are all zero (it routed no tokens in the step, e.g. it did not run) has no
balance to speak of: its metrics are NaN and it is left out of the across-layer aggregates
(NaN-aware mean/median/min/max), instead of reporting a misleading ``cv = 0``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainvitals._device import host_to_device

__all__ = [
    "LAYER_METRICS",
    "UTILIZATION_QUANTILES",
    "LoadBalanceStats",
    "aggregate_across_layers",
    "aggregate_across_layers_host",
    "aggregate_across_layers_lists",
    "load_balance_stats",
    "load_balance_stats_host",
    "load_balance_stats_lists",
    "nanquantile",
    "nanquantile_host",
]

# Quantiles of the utilization ratios: (key suffix, q).
UTILIZATION_QUANTILES: tuple[tuple[str, float], ...] = (
    ("min", 0.0),
    ("p25", 0.25),
    ("median", 0.5),
    ("p75", 0.75),
    ("max", 1.0),
)

# Per-layer scalar metrics, in the order of LoadBalanceStats.per_layer's rows.
LAYER_METRICS: tuple[str, ...] = (
    "cv",
    "dead_expert_frac",
    "expert_diversity",
    "max_overload_factor",
    *(f"utilization_{name}" for name, _ in UTILIZATION_QUANTILES),
)

# Across-layer aggregates, in the order of aggregate_across_layers' columns.
AGGREGATES: tuple[str, ...] = ("mean", "median", "min", "max")


@dataclass
class LoadBalanceStats:
    """The statistics of one ``[L, E]`` load tensor; every field is a float64 device tensor
    (from :func:`load_balance_stats`), a float64 ``numpy`` array, int64 for the indices (from
    :func:`load_balance_stats_host`), or (nested) lists of Python floats, ints for the
    indices (from :func:`load_balance_stats_lists`).

    Attributes:
        utilization: ``[L, E]`` load / fair share; NaN rows for layers with no tokens.
        per_layer: ``[len(LAYER_METRICS), L]``, row ``i`` is metric ``LAYER_METRICS[i]``.
        aggregates: ``[len(LAYER_METRICS), 4]`` mean, median, min, max over the active layers
            of each per-layer metric (NaN when no layer is active).
        utilization_quantiles: ``[5]`` min, p25, median, p75, max of the utilizations of all
            experts of all active layers together (NeMo's ``moe/expert_utilization_*``).
        top_values, top_indices: the ``top_k`` highest utilizations overall and their flat
            indices ``layer_pos * E + expert`` (``-inf`` values mark padding from inactive
            layers; drop non-finite values).
        bottom_values, bottom_indices: the same for the ``top_k`` lowest (``+inf`` padding).
    """

    utilization: torch.Tensor
    per_layer: torch.Tensor
    aggregates: torch.Tensor
    utilization_quantiles: torch.Tensor
    top_values: torch.Tensor
    top_indices: torch.Tensor
    bottom_values: torch.Tensor
    bottom_indices: torch.Tensor


def load_balance_stats(loads: torch.Tensor, top_k: int = 5) -> LoadBalanceStats:
    """Load-balance statistics of ``loads`` (``[L, E]``, non-negative counts), batched over
    layers, on the loads' device, without host synchronisation.

    Example::

        loads = torch.tensor([[10.0, 10, 10, 10], [40, 0, 0, 0]])
        s = load_balance_stats(loads, top_k=1)
        s.per_layer[LAYER_METRICS.index("cv")]   # tensor([0.0000, 1.7321])
    """
    if not isinstance(loads, torch.Tensor):
        raise TypeError(
            f"loads must be a torch.Tensor of shape [layers, experts], got {type(loads).__name__}"
        )
    if loads.ndim != 2 or loads.shape[0] == 0 or loads.shape[1] == 0:
        raise ValueError(
            f"loads must have shape [layers, experts] with both > 0, got {tuple(loads.shape)}"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative int, got {top_k!r}")
    x = loads.detach().to(torch.float64)
    num_experts = x.shape[1]
    nan = float("nan")

    total = x.sum(dim=1)  # [L]
    active = total > 0  # [L]
    fair = torch.where(active, total / num_experts, 1.0)
    utilization = torch.where(active[:, None], x / fair[:, None], nan)  # [L, E]

    # std(loads) / mean(loads) == std(utilization): population std, see the module docstring.
    cv = utilization.std(dim=1, correction=0)
    dead = torch.where(active, (x == 0).sum(dim=1).to(torch.float64) / num_experts, nan)
    p = x / torch.where(active, total, 1.0)[:, None]
    entropy = -torch.special.xlogy(p, p).sum(dim=1)
    diversity = torch.where(active, entropy.exp() / num_experts, nan)
    qs = [q for _, q in UTILIZATION_QUANTILES]
    layer_quantiles = nanquantile(utilization, qs).T  # [5, L]; inactive layers stay NaN
    max_overload = layer_quantiles[-1]

    per_layer = torch.cat([torch.stack([cv, dead, diversity, max_overload]), layer_quantiles])
    aggregates = aggregate_across_layers(per_layer)
    utilization_quantiles = nanquantile(utilization.reshape(-1), qs)

    flat = utilization.reshape(-1)
    k = min(top_k, flat.numel())
    top_values, top_indices = torch.topk(torch.where(flat.isnan(), -math.inf, flat), k)
    bottom_values, bottom_indices = torch.topk(
        torch.where(flat.isnan(), math.inf, flat), k, largest=False
    )
    return LoadBalanceStats(
        utilization=utilization,
        per_layer=per_layer,
        aggregates=aggregates,
        utilization_quantiles=utilization_quantiles,
        top_values=top_values,
        top_indices=top_indices,
        bottom_values=bottom_values,
        bottom_indices=bottom_indices,
    )


def aggregate_across_layers(values: torch.Tensor) -> torch.Tensor:
    """Mean, median, min and max over the last dim, ignoring NaN (inactive layers).

    ``values`` is ``[M, L]`` (M metrics over L layers); returns ``[M, 4]`` float64 with columns
    ``AGGREGATES``; a row that is all NaN gives NaN. The median interpolates (even counts give
    the mean of the two middle values, not the lower one as ``torch.median`` would).
    """
    v = values.to(torch.float64)
    if v.ndim == 1:
        v = v[None]
    isnan = v.isnan()
    empty = isnan.all(dim=-1)
    mean = torch.nanmean(v, dim=-1)
    median = nanquantile(v, [0.5])[..., 0]
    vmin = torch.where(empty, math.nan, torch.where(isnan, math.inf, v).amin(dim=-1))
    vmax = torch.where(empty, math.nan, torch.where(isnan, -math.inf, v).amax(dim=-1))
    return torch.stack([mean, median, vmin, vmax], dim=-1)


def nanquantile(x: torch.Tensor, qs: list[float]) -> torch.Tensor:
    """Quantiles ``qs`` of the last dim of ``x`` ignoring NaN, linear interpolation (the rule of
    ``torch.nanquantile`` and numpy's default; equal order statistics give their value, so an
    infinite one gives ``inf``, not NaN): shape ``[..., len(qs)]``, NaN for an all-NaN row.

    Written with one sort and two gathers instead of ``torch.nanquantile``, which is several
    times slower on small CPU tensors and, given a tensor of quantiles on a GPU, checks their
    range with a device-to-host read.
    """
    s = torch.sort(x, dim=-1).values  # NaN sort last
    n = (~x.isnan()).sum(dim=-1, keepdim=True)  # [..., 1]
    q = host_to_device(torch.tensor(qs, dtype=torch.float64), x.device)
    pos = (n - 1).clamp(min=0).to(torch.float64) * q  # [..., Q]
    lo = pos.floor()
    lo_v = s.gather(-1, lo.long())
    hi_v = s.gather(-1, pos.ceil().long())
    # Equal order statistics give their value: inf + (inf - inf) * f would be NaN.
    out = torch.where(hi_v == lo_v, lo_v, lo_v + (hi_v - lo_v) * (pos - lo))
    return torch.where(n == 0, math.nan, out)


# ---------------------------------------------------------------------------- host (numpy) path


def load_balance_stats_host(loads: np.ndarray, top_k: int = 5) -> LoadBalanceStats:
    """:func:`load_balance_stats` of a host ``[L, E]`` array, in float64 ``numpy``.

    The same definitions and formulas as the device path (see the module docstring), for loads
    already on the host: a few tens of microseconds for a ``[layers, experts]`` matrix instead
    of ~35 small device kernels. Every field of the result is a ``numpy`` array (float64;
    int64 indices). Ties in the top/bottom ``k`` go to the lowest flat index.

    Example::

        s = load_balance_stats_host(np.array([[10.0, 10, 10, 10], [40, 0, 0, 0]]), top_k=1)
        s.per_layer[LAYER_METRICS.index("cv")]   # array([0.        , 1.73205081])
    """
    if isinstance(loads, torch.Tensor) or not isinstance(loads, np.ndarray):
        raise TypeError(
            f"loads must be a numpy array of shape [layers, experts], got {type(loads).__name__}"
        )
    if loads.ndim != 2 or loads.shape[0] == 0 or loads.shape[1] == 0:
        raise ValueError(
            f"loads must have shape [layers, experts] with both > 0, got {tuple(loads.shape)}"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative int, got {top_k!r}")
    x = np.asarray(loads, dtype=np.float64)
    num_layers, num_experts = x.shape
    if x.size <= _SMALL:
        return _as_numpy(_stats_small(x.tolist(), top_k))
    nan = math.nan

    # Written with few numpy calls (each costs a microsecond or two on arrays this small) and
    # without invalid operations (no warnings to silence): an inactive row is divided by 1 and
    # then set to NaN, and ``0 log 0`` is ``0 * log(1)``.
    total = x.sum(axis=1)  # [L]
    active = total > 0
    inactive = ~active
    fair = np.where(active, total / num_experts, 1.0)
    utilization = x / fair[:, None]  # [L, E]
    utilization[inactive] = nan

    cv = utilization.std(axis=1)  # population std (ddof=0); NaN rows stay NaN
    dead = (x == 0).sum(axis=1) / num_experts
    p = x / np.where(active, total, 1.0)[:, None]
    entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=1)
    diversity = np.exp(entropy) / num_experts
    dead[inactive] = nan
    diversity[inactive] = nan
    # Every active row has E values and every inactive row none, so the interpolation
    # positions are the same for all rows (NaN rows give NaN): ``nanquantile``'s formula.
    qs = [q for _, q in UTILIZATION_QUANTILES]
    layer_quantiles = _interpolate(np.sort(utilization, axis=1), num_experts, qs).T  # [5, L]
    per_layer = np.empty((len(LAYER_METRICS), num_layers))
    per_layer[0], per_layer[1], per_layer[2], per_layer[3] = (
        cv,
        dead,
        diversity,
        layer_quantiles[-1],
    )
    per_layer[4:] = layer_quantiles
    # The inactive layers are exactly the NaN columns: aggregate the active ones.
    num_active = int(active.sum())
    if num_active == 0:
        aggregates = np.full((len(LAYER_METRICS), len(AGGREGATES)), nan)
    else:
        v = np.sort(per_layer[:, active], axis=1)
        aggregates = np.empty((len(LAYER_METRICS), len(AGGREGATES)))
        aggregates[:, 0] = v.sum(axis=1) / num_active
        aggregates[:, 1] = _interpolate(v, num_active, [0.5])[:, 0]
        aggregates[:, 2] = v[:, 0]
        aggregates[:, 3] = v[:, -1]
    flat = utilization.reshape(-1)
    ordered = np.sort(flat)  # NaN last
    utilization_quantiles = (
        _interpolate(ordered, num_active * num_experts, qs) if num_active else np.full(len(qs), nan)
    )

    k = min(top_k, flat.size)
    # Stable sorts: ties in order of the flat index, lowest first.
    low_first = np.where(np.isnan(flat), math.inf, flat)
    bottom_indices = np.argsort(low_first, kind="stable")[:k]
    bottom_values = low_first[bottom_indices]
    high_first = np.where(np.isnan(flat), -math.inf, flat)
    top_indices = np.argsort(-high_first, kind="stable")[:k]
    top_values = high_first[top_indices]
    return LoadBalanceStats(
        utilization=utilization,
        per_layer=per_layer,
        aggregates=aggregates,
        utilization_quantiles=utilization_quantiles,
        top_values=top_values,
        top_indices=top_indices.astype(np.int64),
        bottom_values=bottom_values,
        bottom_indices=bottom_indices.astype(np.int64),
    )


def load_balance_stats_lists(loads: Sequence[Sequence[float]], top_k: int = 5) -> LoadBalanceStats:
    """:func:`load_balance_stats_host` for loads given as Python rows (``L`` lists of ``E``
    floats, e.g. from one ``.tolist()`` of the device tensor), with every field a (nested)
    list of Python floats (ints for the indices), ready to be zipped with key strings.

    Computed on Python floats up to 2048 loads, with numpy above (then converted): the same
    float64 results as :func:`load_balance_stats_host`.
    """
    if isinstance(loads, torch.Tensor | np.ndarray) or not isinstance(loads, Sequence):
        raise TypeError(
            f"loads must be a list of rows (layers) of floats (experts), got {type(loads).__name__}"
        )
    widths = {len(row) for row in loads}
    if not loads or len(widths) != 1 or 0 in widths:
        raise ValueError(
            "loads must be [layers, experts] rows of the same non-zero length, with at least one row"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative int, got {top_k!r}")
    rows = [[float(v) for v in row] for row in loads]
    if len(rows) * len(rows[0]) <= _SMALL:
        return _stats_small(rows, top_k)
    stats = load_balance_stats_host(np.array(rows, dtype=np.float64), top_k=top_k)
    return LoadBalanceStats(
        utilization=stats.utilization.tolist(),
        per_layer=stats.per_layer.tolist(),
        aggregates=stats.aggregates.tolist(),
        utilization_quantiles=stats.utilization_quantiles.tolist(),
        top_values=stats.top_values.tolist(),
        top_indices=stats.top_indices.tolist(),
        bottom_values=stats.bottom_values.tolist(),
        bottom_indices=stats.bottom_indices.tolist(),
    )


def aggregate_across_layers_lists(values: Sequence[float]) -> list[float]:
    """:func:`aggregate_across_layers` of one row of Python floats: ``[mean, median, min,
    max]`` of its non-NaN values (NaN when there are none)."""
    return _aggregate_small([float(v) for v in values])


# Up to this many loads, :func:`load_balance_stats_host` works on Python floats: a numpy call
# costs microseconds (more with the caches cold after a backward pass) and would dominate.
_SMALL = 2048


def _stats_small(rows: list[list[float]], top_k: int) -> LoadBalanceStats:
    """:func:`load_balance_stats_host` on Python floats (the same formulas, float64); the
    fields are (nested) lists. Written for few bytecodes (list comprehensions, cached
    quantile positions, one transpose): it runs on every logging step, with cold caches."""
    nan, log = math.nan, math.log
    num_experts = len(rows[0])
    positions = _cached_positions(num_experts, _QS)
    inactive = [nan] * len(LAYER_METRICS)
    utilization: list[list[float]] = []
    layer_values: list[list[float]] = []  # per layer, the LAYER_METRICS values
    active_utilization: list[float] = []
    for row in rows:
        total = sum(row)
        if not total > 0:
            utilization.append([nan] * num_experts)
            layer_values.append(inactive)
            continue
        fair = total / num_experts
        u = [v / fair for v in row]
        utilization.append(u)
        active_utilization += u
        mean = sum(u) / num_experts
        cv = math.sqrt(sum([(a - mean) * (a - mean) for a in u]) / num_experts)
        dead = row.count(0.0) / num_experts  # == comparison, as v == 0
        entropy = -sum([p * log(p) for p in [v / total for v in row] if p > 0])
        ordered = sorted(u)
        quantiles = [ordered[lo] + (ordered[hi] - ordered[lo]) * f for lo, hi, f in positions]
        layer_values.append([cv, dead, math.exp(entropy) / num_experts, quantiles[-1], *quantiles])
    per_layer = [list(metric) for metric in zip(*layer_values, strict=True)]
    aggregates = [_aggregate_small(metric) for metric in per_layer]
    ordered_all = sorted(active_utilization)
    n_all = len(ordered_all)
    utilization_quantiles = (
        [
            ordered_all[lo] + (ordered_all[hi] - ordered_all[lo]) * f
            for lo, hi, f in _cached_positions(n_all, _QS)
        ]
        if n_all
        else [nan] * len(_QS)
    )
    if not top_k:
        return LoadBalanceStats(
            utilization, per_layer, aggregates, utilization_quantiles, [], [], [], []
        )
    flat = [v for u in utilization for v in u]
    if n_all == len(flat):  # every layer active: no NaN to push to the ends
        low_first = high_first = flat
    else:
        inf = math.inf
        low_first = [inf if v != v else v for v in flat]
        high_first = [-inf if v != v else v for v in flat]
    k = min(top_k, len(flat))
    # Stable sorts (reverse=True keeps the order of equal keys): ties go to the lowest flat
    # index.
    bottom = sorted(range(len(flat)), key=low_first.__getitem__)[:k]
    top = sorted(range(len(flat)), key=high_first.__getitem__, reverse=True)[:k]
    return LoadBalanceStats(
        utilization=utilization,
        per_layer=per_layer,
        aggregates=aggregates,
        utilization_quantiles=utilization_quantiles,
        top_values=[high_first[i] for i in top],
        top_indices=top,
        bottom_values=[low_first[i] for i in bottom],
        bottom_indices=bottom,
    )


def _as_numpy(stats: LoadBalanceStats) -> LoadBalanceStats:
    """The list fields of :func:`_stats_small` as float64 (int64 indices) numpy arrays."""
    return LoadBalanceStats(
        utilization=np.array(stats.utilization, dtype=np.float64),
        per_layer=np.array(stats.per_layer, dtype=np.float64),
        aggregates=np.array(stats.aggregates, dtype=np.float64),
        utilization_quantiles=np.array(stats.utilization_quantiles, dtype=np.float64),
        top_values=np.array(stats.top_values, dtype=np.float64),
        top_indices=np.array(stats.top_indices, dtype=np.int64),
        bottom_values=np.array(stats.bottom_values, dtype=np.float64),
        bottom_indices=np.array(stats.bottom_indices, dtype=np.int64),
    )


def _aggregate_small(values: list[float]) -> list[float]:
    """Mean, median, min, max of the non-NaN ``values`` (NaN when there are none)."""
    finite = [v for v in values if v == v]
    n = len(finite)
    if n == 0:
        return [math.nan] * len(AGGREGATES)
    mean = sum(finite) / n  # in layer order, as torch.nanmean
    finite.sort()
    return [mean, _lerp(finite, _cached_positions(n, _MEDIAN)[0]), finite[0], finite[-1]]


def _positions(n: int, qs: list[float]) -> list[tuple[int, int, float]]:
    """``(lo, hi, pos - lo)`` of each quantile of ``n`` sorted values (:func:`nanquantile`)."""
    out = []
    for q in qs:
        pos = float(max(n - 1, 0)) * q
        lo = math.floor(pos)
        out.append((lo, math.ceil(pos), pos - lo))
    return out


_QS = tuple(q for _, q in UTILIZATION_QUANTILES)
_MEDIAN = (0.5,)
_POSITIONS: dict[tuple[int, tuple[float, ...]], list[tuple[int, int, float]]] = {}


def _cached_positions(n: int, qs: tuple[float, ...]) -> list[tuple[int, int, float]]:
    """:func:`_positions`, cached: the same few ``n`` (experts, layers) come back every step."""
    out = _POSITIONS.get((n, qs))
    if out is None:
        if len(_POSITIONS) > 4096:
            _POSITIONS.clear()
        out = _POSITIONS[(n, qs)] = _positions(n, list(qs))
    return out


def _lerp(ordered: list[float], position: tuple[int, int, float]) -> float:
    lo, hi, frac = position
    low, high = ordered[lo], ordered[hi]
    # Equal order statistics give their value: inf + (inf - inf) * frac would be NaN.
    return low if high == low else low + (high - low) * frac


def aggregate_across_layers_host(values: np.ndarray) -> np.ndarray:
    """:func:`aggregate_across_layers` of a host array: ``[M, L]`` -> ``[M, 4]`` float64
    (mean, median, min, max over the last axis ignoring NaN; NaN for an all-NaN row)."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 1:
        v = v[None]
    if v.size <= _SMALL:
        return np.array([_aggregate_small(row) for row in v.tolist()], dtype=np.float64)
    isnan = np.isnan(v)
    count = (~isnan).sum(axis=-1)
    empty = count == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(isnan, 0.0, v).sum(axis=-1) / count
    median = nanquantile_host(v, [0.5])[..., 0]
    vmin = np.where(empty, math.nan, np.where(isnan, math.inf, v).min(axis=-1))
    vmax = np.where(empty, math.nan, np.where(isnan, -math.inf, v).max(axis=-1))
    return np.stack([mean, median, vmin, vmax], axis=-1)


def nanquantile_host(x: np.ndarray, qs: list[float]) -> np.ndarray:
    """:func:`nanquantile` of a host array, with the same interpolation formula (so the same
    float64 results): quantiles ``qs`` of the last axis ignoring NaN, ``[..., len(qs)]``, NaN
    for an all-NaN row. No warning for all-NaN rows (``np.nanquantile`` warns)."""
    x = np.asarray(x, dtype=np.float64)
    s = np.sort(x, axis=-1)  # NaN sort last
    n = (~np.isnan(x)).sum(axis=-1, keepdims=True)
    pos = np.maximum(n - 1, 0).astype(np.float64) * np.asarray(qs, dtype=np.float64)
    lo = np.floor(pos)
    lo_v = np.take_along_axis(s, lo.astype(np.int64), axis=-1)
    hi_v = np.take_along_axis(s, np.ceil(pos).astype(np.int64), axis=-1)
    with np.errstate(invalid="ignore"):
        # Equal order statistics give their value: inf + (inf - inf) * f would be NaN.
        out = np.where(hi_v == lo_v, lo_v, lo_v + (hi_v - lo_v) * (pos - lo))
    return np.where(n == 0, math.nan, out)


def _interpolate(s: np.ndarray, n: int, qs: list[float]) -> np.ndarray:
    """Quantiles ``qs`` of the first ``n`` values of each sorted row of ``s`` (last axis), with
    :func:`nanquantile`'s float64 formula: ``[..., len(qs)]``."""
    pos = np.asarray(qs, dtype=np.float64) * float(max(n - 1, 0))
    lo = np.floor(pos)
    lo_v = s[..., lo.astype(np.int64)]
    hi_v = s[..., np.ceil(pos).astype(np.int64)]
    with np.errstate(invalid="ignore"):
        # Equal order statistics give their value: inf + (inf - inf) * f would be NaN.
        return np.where(hi_v == lo_v, lo_v, lo_v + (hi_v - lo_v) * (pos - lo))
