"""Expert load-balance statistics of a mixture-of-experts model: pure tensor math, no I/O.

Input: ``loads``, a ``[L, E]`` tensor with the number of token-to-expert assignments each of the
``E`` experts of each of the ``L`` MoE layers received (a token routed to ``k`` experts counts
once for each). Everything is computed on the tensor's device, in float64, batched over layers
(no Python loop over layers), and nothing is moved to the host.

Definitions (per layer, with ``n_e`` the load of expert ``e``, ``N = sum_e n_e``, ``m = N / E``):

============================  =====================================================================
metric                        definition
============================  =====================================================================
``utilization[e]``            ``n_e / m``: 1 = fair share, >1 overloaded, 0 dead (NeMo Automodel)
``cv``                        ``std(n) / m`` with the POPULATION std (divide by ``E``), equal to the
                              std of the utilizations. See "Which std" below.
``dead_expert_frac``          fraction of experts with ``n_e == 0``
``expert_diversity``          ``exp(H) / E`` with ``H = -sum_e p_e log p_e``, ``p_e = n_e / N``,
                              ``0 log 0 = 0``: the effective number of experts as a fraction of
                              ``E`` (1 = uniform; ``k/E`` when only ``k`` experts are used evenly)
``max_overload_factor``       ``max_e n_e / m`` (= the largest utilization)
``utilization_{min,p25,...}`` quantiles of the layer's utilizations
============================  =====================================================================

Which std: the ``E`` loads are the whole population of the layer's experts, not a sample from a
larger one, so the population standard deviation (``correction=0``) is the natural one; with it
``cv`` is exactly the standard deviation of the utilization ratios and is 0 at perfect balance.
NeMo Automodel uses the sample std (``n - 1``); its value is ours times ``sqrt(E / (E - 1))``
(1.6% larger at ``E = 32``, 0.8% at ``E = 64``).

Quantiles: linear interpolation between order statistics (``torch.quantile``'s default, numpy's
``"linear"``), so the median of an even count is the mean of the two middle values. NeMo takes
``sorted[n // 4]`` for p25 and ``sorted[3n // 4]`` for p75 (no interpolation); the two agree
up to one order statistic.

A layer whose loads are all zero (it routed no tokens in the step, e.g. it did not run) has no
balance to speak of: its metrics are NaN and it is left out of the across-layer aggregates
(NaN-aware mean/median/min/max), instead of reporting a misleading ``cv = 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "LAYER_METRICS",
    "UTILIZATION_QUANTILES",
    "LoadBalanceStats",
    "aggregate_across_layers",
    "load_balance_stats",
    "nanquantile",
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
    """The statistics of one ``[L, E]`` load tensor; every field is a float64 device tensor.

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
    ``torch.nanquantile`` and numpy's default): shape ``[..., len(qs)]``, NaN for an all-NaN row.

    Written with one sort and two gathers instead of ``torch.nanquantile``, which is several
    times slower on small CPU tensors and, given a tensor of quantiles on a GPU, checks their
    range with a device-to-host read.
    """
    s = torch.sort(x, dim=-1).values  # NaN sort last
    n = (~x.isnan()).sum(dim=-1, keepdim=True)  # [..., 1]
    q = torch.tensor(qs, dtype=torch.float64).to(x.device, non_blocking=True)
    pos = (n - 1).clamp(min=0).to(torch.float64) * q  # [..., Q]
    lo = pos.floor()
    lo_v = s.gather(-1, lo.long())
    hi_v = s.gather(-1, pos.ceil().long())
    out = lo_v + (hi_v - lo_v) * (pos - lo)
    return torch.where(n == 0, math.nan, out)
