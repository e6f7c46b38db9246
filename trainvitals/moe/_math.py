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
    # lo == hi gives high - low == 0 (or nan for inf - inf, masked below when n == 0).
    out = low + torch.where(hi > lo, high - low, torch.zeros_like(low)) * (pos - lo.to(pos.dtype))
    return torch.where(n > 0, out, torch.full_like(out, math.nan))
