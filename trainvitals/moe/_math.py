"""Small tensor helpers for the MoE tracker and router. Pure math: no I/O, no collectives."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def quantiles_of_positive(values: torch.Tensor, qs: Sequence[float]) -> torch.Tensor:
    """Linear-interpolation quantiles (``torch.quantile``'s default) of the positive entries of
    the 1-d tensor ``values``, computed without a host synchronisation.

    ``torch.quantile(values[values > 0], q)`` needs the number of positive entries on the host
    (boolean indexing); here the positive entries are sorted to the front (the others become
    ``+inf``) and the interpolation indices are computed on the device. Returns a tensor of
    ``len(qs)`` values, ``nan`` where there is no positive entry.

    Infinite entries: between two equal neighbours (``+inf`` and ``+inf``) the quantile is that
    value, and toward ``+inf`` it is ``+inf`` (``torch.quantile``'s ``lerp`` gives NaN there,
    and the tracker leaves a NaN percentile out as if no layer were positive).
    """
    values = values.reshape(-1)
    positive = values > 0
    n = positive.sum()
    ordered = torch.sort(torch.where(positive, values, torch.full_like(values, math.inf))).values
    q = torch.tensor(list(qs), dtype=values.dtype, device=values.device)
    pos = q * (n - 1).clamp(min=0).to(values.dtype)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    low = ordered[lo]
    high = ordered[hi]
    # Equal neighbours (lo == hi, or two +inf entries whose difference is nan) give low; with
    # no positive entry (n == 0, every entry +inf here) the result is masked to nan below.
    step = torch.where((hi > lo) & (high != low), high - low, torch.zeros_like(low))
    out = low + step * (pos - lo.to(pos.dtype))
    return torch.where(n > 0, out, torch.full_like(out, math.nan))


def quantiles_of_positive_host(values: Sequence[float], qs: Sequence[float]) -> list[float]:
    """:func:`quantiles_of_positive` of host floats (after the report's one transfer), with the
    same float64 formula: ``low + (high - low) * (pos - lo)``, ``pos = q * (n - 1)`` over the
    sorted positive entries (equal neighbours, two ``+inf`` included, give their value); ``nan``
    for each ``q`` when no entry is positive."""
    ordered = sorted(x for x in values if x > 0)
    n = len(ordered)
    if n == 0:
        return [math.nan] * len(qs)
    out = []
    for q in qs:
        pos = float(q) * float(n - 1)
        lo = math.floor(pos)
        hi = math.ceil(pos)
        low = ordered[lo]
        high = ordered[hi]
        # (high == low: also two +inf entries, whose inf - inf would be a nan percentile)
        out.append(low + (high - low) * (pos - lo) if high != low else low)
    return out
