"""Exact per-tensor moments: count, mean, central sums M2, M3, M4, min, max, non-finite count.

Why central sums and not raw power sums
---------------------------------------
Megatron-LM PR #5492 logs raw power sums ``sum x^k`` (k = 1..4) per tensor, accumulated in
float32, and derives variance and kurtosis from them later. That cancels catastrophically
whenever ``|mean| >> std``: for a LayerNorm weight ``1 + 0.01*randn(4096)`` the kurtosis comes
out near 47.7 instead of 3.0. We keep its idea (statistics that combine over any group of
tensors, micro-batches and ranks) but store central moments, which combine exactly.

The representation is a float64 tensor with :data:`NUM_FIELDS` entries on its last dim, in the
order of :data:`FIELDS`::

    count      number of finite elements
    mean       mean of the finite elements
    m2, m3, m4 central sums  sum (x - mean)^k  over the finite elements
    min, max   of the finite elements (+inf / -inf when there are none)
    nonfinite  number of NaN / +-inf elements (excluded from everything else)

How the moments of one tensor are computed (one pass over memory)
-----------------------------------------------------------------
A large tensor is viewed as rows ("chunks") of :data:`CHUNK` contiguous elements. For each row,
in the tensor's precision (float32 for float32/bf16/fp16, float64 for float64):

1. the row mean ``s`` (a shift that is within rounding of the row's own mean, so the next step
   never cancels), then
2. the shifted power sums ``S_k = sum (x - s)^k`` for k = 1..4, plus the row's min and max.

A row is small (1024 elements), so the float32 sums of step 2 carry a relative error of about
1e-7 (longer rows were measured: 4096 loses a visible part of the 1e-4 budget of the excess
kurtosis in the compiled kernel, whose lanes accumulate sequentially), and the row is read from
cache for its second loop. The compiled CPU kernel fuses both loops over a row into one outer
loop (one pass over memory); the eager kernel works on blocks of rows that stay in the CPU
cache (:func:`_rows_eager_fast`). Each row is then turned into exact central moments in
float64::

    n, mean = n, s + S1/n
    M2 = S2 - S1^2/n
    M3 = S3 - 3 S1 S2/n + 2 S1^3/n^2
    M4 = S4 - 4 S1 S3/n + 6 S1^2 S2/n^2 - 3 S1^4/n^3

(``S1`` is only the rounding residue of ``s``; the corrections are tiny and well-conditioned).
The rows' central moments are merged in float64 (below); the compiled CPU kernel does this
inside its own graph and returns one part per tensor. Tensors smaller than :data:`SMALL_NUMEL`
and the tail rows of large tensors are not worth a kernel launch each: they are reduced
together in float64, two-pass (mean, then central sums), which is exact to float64: on CPU the
pieces of each length as one dense matrix, elsewhere (and for pieces with a NaN/inf) one
concatenated buffer with a segment index and ``index_add_``. On accelerators with the compiled
kernel (the CUDA default) tensors are bucketed (:meth:`MomentAccumulator.add_bucketed`): there
every tensor goes whole, padded with NaN to whole rows, through the masked row kernel, small
ones and tails too (float32 shifted sums per row: within 5e-6 relative of float64 in the worst
case measured, a skewness; the budget is 1e-4), which saves the host the segment path.

The eager CPU kernel skips the shift where it is not needed (:func:`_blocks_eager`): the
formulas above hold for any shift, and with ``s = 0`` (raw power sums) they lose to
cancellation only a factor that grows with ``|mean| / std``. A block (2 MiB) whose
``|mean| <= std`` keeps its raw sums, with ATen's cascaded float32 sums over the whole block
(about 1e-8 relative, measured at 512K elements): the error of M2 is then at most twice, and
that of M4 at most ``(1 + |mean|/std)^4 <= 16`` times the sums' own (Cauchy-Schwarz on the
expansion of ``(x - mean + mean)^4``), far inside the 1e-4 budget. The check is made in float64
on every block after the pass; a block that fails it is recomputed with per-row shifts, and a
tensor whose first row already has ``|mean| > 2 std`` (a LayerNorm weight, an offset
activation) goes to the shifted kernel directly. That drops the shift's two passes (mean and
subtraction) of the nine the shifted kernel makes over each block.

Range: the float32 powers ``(x - s)^4`` underflow into subnormals when the spread is below
about 1e-10 (a kurtosis of 0.02 instead of 3 at std 1e-12, measured) and overflow above about
1e9. A tensor whose float32 sums are not finite, or whose rows have a mean square below 2^-64,
is recomputed in float64 (:func:`_rows_exact`; float32 values to the fourth power fit float64's
range), as is a tensor holding a NaN or inf (then masked). On accelerators the masked
compiled kernel runs without a host sync, so it cannot send a tensor elsewhere: it scales each
row's deviations by a power of two instead (:func:`_rows_masked`), which makes its powers
range-safe at the cost of one more reduction per row (in registers on a GPU).

How moments combine (tensors, rows, micro-batches, ranks)
---------------------------------------------------------
Many parts with ``(n_k, mean_k, M2_k, M3_k, M4_k)`` combine in one vectorised step (the
multi-part form of the pairwise update of Chan et al. 1979 and Pébay 2008, "Formulas for robust,
one-pass parallel computation of covariances and arbitrary-order statistical moments", Sandia
SAND2008-6212, eq. 3.1): with ``n = sum n_k``, ``mean = sum n_k mean_k / n`` and
``d_k = mean_k - mean``, expanding ``(x - mean)^p = ((x - mean_k) + d_k)^p`` inside each part and
using ``sum_part (x - mean_k) = 0`` gives::

    M2 = sum M2_k + n_k d_k^2
    M3 = sum M3_k + 3 d_k M2_k + n_k d_k^3
    M4 = sum M4_k + 4 d_k M3_k + 6 d_k^2 M2_k + n_k d_k^4

This is an identity, not an approximation: merging is exact up to float64 rounding, in any order
and grouping, and every term is a central quantity, so nothing cancels when ``|mean| >> std``.
The same function merges rows into tensors, tensors into groups (the query tool), micro-batches
into a step and the gathered per-rank moments of a sharded tensor.

Derived statistics (:func:`derive`): population variance ``M2/n`` (divide by ``n``, not
``n - 1``: these are whole tensors, not samples), std, ``L2 = sqrt(M2 + n mean^2)`` (the norm of
the finite elements), ``RMS = L2 / sqrt(n)``, skewness ``sqrt(n) M3 / M2^1.5``, Pearson kurtosis
``n M4 / M2^2`` (3 for a normal distribution) and excess kurtosis (kurtosis - 3). Skewness and
kurtosis are NaN for a constant tensor (``M2 == 0``).

Non-finite elements: on accelerators the compiled kernel masks them element by element (no
host sync). On CPU, and in the eager kernel, rows are reduced unmasked (masking doubles the
compute there); a NaN or inf shows in the min/max, and only such tensors are recomputed with
masking, a check that reads one flag back to the host (free on CPU; callers run this on logging
steps only).

Nothing here does I/O or talks to other ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch

from trainvitals._device import host_to_device

__all__ = [
    "CHUNK",
    "DERIVED",
    "FIELDS",
    "NUM_FIELDS",
    "SMALL_NUMEL",
    "MomentAccumulator",
    "combine_moments",
    "derive",
    "empty_moments",
    "fused_moments",
    "merge_moments",
    "moments_from_dicts",
    "moments_to_dicts",
    "moments_to_rows",
    "partial_moments",
    "tensor_moments",
]

FIELDS = ("count", "mean", "m2", "m3", "m4", "min", "max", "nonfinite")
NUM_FIELDS = len(FIELDS)
COUNT, MEAN, M2, M3, M4, MIN, MAX, NONFINITE = range(NUM_FIELDS)

DERIVED = (
    "count",
    "mean",
    "var",
    "std",
    "l2",
    "rms",
    "skewness",
    "kurtosis",
    "excess_kurtosis",
    "min",
    "max",
    "nonfinite",
)

#: Row length of the chunked kernel (elements). A power of two (the shift ``sum / CHUNK`` is
#: exact); :func:`_body_moments_fused` spells it and its inverse as literals.
CHUNK = 1024
#: Tensors with fewer elements go to the batched float64 path (except in the accelerators'
#: buckets, which take every tensor whole: :meth:`MomentAccumulator.add_bucketed`).
SMALL_NUMEL = 8 * CHUNK
# Elements per eager block (2 MiB of float32): the eager kernels reuse two work buffers of this
# size, so they allocate nothing per tensor, and a block and its temporaries stay in the CPU cache
# while the operations on it run. Measured on a 2-core VM (32 MiB L3): against 256K-element
# blocks, 512K are 11% faster on 2 threads and 6% on 1 (fewer fixed costs per operation); 1M
# are 16% faster on 2 threads but 3% on 1, and 2M slower (out of cache).
_EAGER_BLOCK = 512 * 1024
# The same on an accelerator (the eager fallback when compilation fails): no cache to stay in,
# and every operation is a kernel launch of ~5-7 us, so blocks of 8M elements (two work buffers
# of 32 MiB float32); at 512K, 117M values in 121 tensors took ~2700 launches (H100, measured).
_DEVICE_EAGER_BLOCK = 8 * 1024 * 1024
# Rows (float32 sums) with a mean square below this (a std below 2^-32 = 2.3e-10) are recomputed
# in float64: their fourth powers fall into float32's subnormal range (below 2^-126) and lose
# precision. Measured without the check, both CPU kernels, 1M values: kurtosis off by ~1e-7
# at std 1e-10, 5e-6 at 3e-11, 1e-3 at 1e-11 (normal data; heavy tails: 4e-7 and 4e-5).
_TINY_VAR = 2.0**-64

# Elements per bucket of :meth:`MomentAccumulator.add_bucketed` (accelerators, compiled kernel):
# 32M (128 MiB of float32) bounds the extra memory of a logging step; 117M values in 121
# tensors make 4 buckets and one call for the embedding.
_BUCKET_NUMEL = 1 << 25

Kernel = Literal["auto", "compile", "eager"]


# ----------------------------------------------------------------------------------- basics


def empty_moments(*shape: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The moments of no elements (the identity of :func:`combine_moments`), shape
    ``(*shape, NUM_FIELDS)``."""
    out = torch.zeros(*shape, NUM_FIELDS, dtype=torch.float64, device=device)
    out[..., MIN] = math.inf
    out[..., MAX] = -math.inf
    return out


def combine_moments(
    parts: torch.Tensor,
    index: torch.Tensor | None = None,
    num_groups: int | None = None,
    dim: int = 0,
) -> torch.Tensor:
    """Merge moments exactly (see the module docstring for the formulas).

    Args:
        parts: float64 moments, ``[..., NUM_FIELDS]``.
        index: optional 1-D group index into ``num_groups`` groups, along ``dim`` (which must
            then be 0 and ``parts`` 2-D): part ``k`` goes to group ``index[k]``. Without it, all
            parts along ``dim`` are merged into one.
        num_groups: number of groups (required with ``index``).
        dim: the dim to merge over when ``index`` is None.

    Returns:
        ``[num_groups, NUM_FIELDS]`` with ``index``, else ``parts`` with ``dim`` removed.
    """
    if not isinstance(parts, torch.Tensor) or parts.shape[-1:] != (NUM_FIELDS,):
        raise ValueError(f"parts must be a tensor [..., {NUM_FIELDS}] of moments")
    parts = parts.to(torch.float64)
    if index is None:
        if dim < 0:
            dim += parts.ndim
        if dim == parts.ndim - 1:
            raise ValueError("dim must not be the fields dim")
        moved = parts.movedim(dim, 0)
        flat = moved.reshape(moved.shape[0], -1, NUM_FIELDS)  # [K, G, F]
        k, g = flat.shape[0], flat.shape[1]
        idx = torch.arange(g, device=parts.device).repeat(k)
        out = combine_moments(flat.reshape(k * g, NUM_FIELDS), idx, g)
        return out.reshape(*moved.shape[1:])
    if parts.ndim != 2 or index.ndim != 1 or index.shape[0] != parts.shape[0]:
        raise ValueError("with index, parts must be [K, NUM_FIELDS] and index [K]")
    if num_groups is None:
        raise ValueError("num_groups is required with index")
    index = index.to(device=parts.device, dtype=torch.long)
    n_k = parts[:, COUNT]
    has = n_k > 0
    mean_k = torch.where(has, parts[:, MEAN], 0.0)
    out = empty_moments(num_groups, device=parts.device)
    n = out[:, COUNT].index_add_(0, index, n_k)
    total = torch.zeros(num_groups, dtype=torch.float64, device=parts.device)
    total.index_add_(0, index, n_k * mean_k)
    mean = torch.where(n > 0, total / n.clamp_min(1.0), 0.0)
    # Refine the mean once: the weighted average above can lose a few ulps against |mean|;
    # adding back the average residual makes sum n_k d_k = 0 to float64 precision.
    d = torch.where(has, mean_k - mean[index], 0.0)
    resid = torch.zeros_like(total).index_add_(0, index, n_k * d)
    mean = mean + torch.where(n > 0, resid / n.clamp_min(1.0), 0.0)
    d = torch.where(has, mean_k - mean[index], 0.0)
    m2_k = torch.where(has, parts[:, M2], 0.0)
    m3_k = torch.where(has, parts[:, M3], 0.0)
    m4_k = torch.where(has, parts[:, M4], 0.0)
    d2 = d * d
    out[:, MEAN] = mean
    out[:, M2].index_add_(0, index, m2_k + n_k * d2)
    out[:, M3].index_add_(0, index, m3_k + 3.0 * d * m2_k + n_k * d2 * d)
    out[:, M4].index_add_(0, index, m4_k + 4.0 * d * m3_k + 6.0 * d2 * m2_k + n_k * d2 * d2)
    out[:, MIN] = out[:, MIN].scatter_reduce(0, index, parts[:, MIN], "amin", include_self=True)
    out[:, MAX] = out[:, MAX].scatter_reduce(0, index, parts[:, MAX], "amax", include_self=True)
    out[:, NONFINITE].index_add_(0, index, parts[:, NONFINITE])
    return out


def merge_moments(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise exact merge of two (broadcastable) moment tensors ``[..., NUM_FIELDS]``."""
    a, b = torch.broadcast_tensors(a.to(torch.float64), b.to(torch.float64))
    return combine_moments(torch.stack([a, b]), dim=0)


def derive(moments: torch.Tensor) -> dict[str, torch.Tensor]:
    """Derived statistics of moments ``[..., NUM_FIELDS]`` (float64), one tensor per name in
    :data:`DERIVED`. Variance is the population variance (``M2 / n``)."""
    m = moments.to(torch.float64)
    n = m[..., COUNT]
    safe_n = n.clamp_min(1.0)
    nan = torch.full_like(n, math.nan)
    mean = torch.where(n > 0, m[..., MEAN], nan)
    m2 = m[..., M2].clamp_min(0.0)
    var = torch.where(n > 0, m2 / safe_n, nan)
    sumsq = m2 + n * m[..., MEAN] ** 2
    l2 = sumsq.sqrt()
    rms = torch.where(n > 0, (sumsq / safe_n).sqrt(), nan)
    pos = m2 > 0
    safe_m2 = torch.where(pos, m2, 1.0)
    skew = torch.where(pos, n.sqrt() * m[..., M3] / safe_m2**1.5, nan)
    kurt = torch.where(pos, n * m[..., M4] / (safe_m2 * safe_m2), nan)
    return {
        "count": n,
        "mean": mean,
        "var": var,
        "std": var.sqrt(),
        "l2": l2,
        "rms": rms,
        "skewness": skew,
        "kurtosis": kurt,
        "excess_kurtosis": kurt - 3.0,
        "min": torch.where(n > 0, m[..., MIN], nan),
        "max": torch.where(n > 0, m[..., MAX], nan),
        "nonfinite": m[..., NONFINITE],
    }


def moments_to_rows(moments: torch.Tensor) -> list[list[float | int | None]]:
    """Rows of moments (a host tensor ``[T, NUM_FIELDS]``) as JSON-ready lists in the order of
    :data:`FIELDS`; non-finite values (min/max of no elements, overflowed sums) become
    ``None``, counts become ints. This is the ``tensors`` value format of ``tensor_stats.jsonl``."""
    isfinite = math.isfinite
    out: list[list[float | int | None]] = []
    for n, mean, m2, m3, m4, mn, mx, bad in moments.detach().to("cpu", torch.float64).tolist():
        out.append(
            [
                int(n) if isfinite(n) else None,
                mean if isfinite(mean) else None,
                m2 if isfinite(m2) else None,
                m3 if isfinite(m3) else None,
                m4 if isfinite(m4) else None,
                mn if isfinite(mn) else None,
                mx if isfinite(mx) else None,
                int(bad) if isfinite(bad) else None,
            ]
        )
    return out


def moments_to_dicts(moments: torch.Tensor) -> list[dict[str, float | None]]:
    """Rows of moments (a host tensor ``[T, NUM_FIELDS]``) as JSON-ready dicts; non-finite
    values (min/max of no elements, overflowed sums) become ``None``."""
    return [dict(zip(FIELDS, row, strict=True)) for row in moments_to_rows(moments)]


def moments_from_dicts(rows: Sequence[dict[str, float | None]]) -> torch.Tensor:
    """Inverse of :func:`moments_to_dicts`: ``None`` min/max become the identity (+-inf), any
    other ``None`` becomes NaN."""
    out = empty_moments(len(rows))
    for i, row in enumerate(rows):
        for j, name in enumerate(FIELDS):
            v = row.get(name)
            if v is None:
                if name in ("min", "max"):
                    continue
                v = math.nan
            out[i, j] = float(v)
    return out


# ----------------------------------------------------------------------------------- kernels


def _rows_masked(x2: torch.Tensor) -> torch.Tensor:
    """Per-row shifted sums of ``x2`` ``[C, B]`` with non-finite elements masked.

    Returns ``[8, C]`` float64: n_finite, shift, S1, S2, S3, S4, min, max (one contiguous
    vector per field). This is the function ``torch.compile`` fuses into one kernel (the loops
    over a row in one pass); on accelerators it runs without a host sync, so it cannot send
    a tensor elsewhere when its float32 powers would under- or overflow. Instead each row's
    deviations are scaled by a power of two that brings the largest of them near 1 (exact: it
    changes no digit) and the sums are unscaled in float64, whose range holds the fourth power
    of any float32.
    """
    xf = x2 if x2.dtype == torch.float64 else x2.float()
    fin = torch.isfinite(xf)
    zero = torch.zeros((), dtype=xf.dtype, device=xf.device)
    n = fin.sum(1).to(xf.dtype)
    shift = torch.where(fin, xf, zero).sum(1, keepdim=True) / n.clamp_min(1.0).unsqueeze(1)
    y = torch.where(fin, xf - shift, zero)
    f64 = torch.float64
    unscale = torch.ones((), dtype=f64, device=xf.device)
    if xf.dtype != f64:
        # log2(0) = -inf for a constant row: clamped, and 0 * 2^126 is still 0
        e = torch.floor(torch.log2(y.abs().amax(1))).clamp(-126.0, 127.0)
        y = y * torch.exp2(-e).unsqueeze(1)
        unscale = torch.exp2(e.to(f64))
    y2 = y * y
    mn = torch.where(fin, xf, math.inf).amin(1)
    mx = torch.where(fin, xf, -math.inf).amax(1)
    return torch.stack(
        [
            n.to(f64),
            shift.squeeze(1).to(f64),
            y.sum(1).to(f64) * unscale,
            y2.sum(1).to(f64) * unscale**2,
            (y2 * y).sum(1).to(f64) * unscale**3,
            (y2 * y2).sum(1).to(f64) * unscale**4,
            mn.to(f64),
            mx.to(f64),
        ],
        0,
    )


def _body_moments_fused(x2: torch.Tensor) -> torch.Tensor:
    """The CPU compiled kernel: the moments of a whole body ``x2`` ``[C, CHUNK]`` (assumed
    finite; a NaN/inf shows in its min/max), returned as ONE float64 vector ``[6]``: mean, M2,
    M3, M4, min, max (the count is ``C * CHUNK``, known to the caller).

    Two loop nests. The first is :func:`_rows_masked` without the mask, written so that
    inductor fuses both loops over a row into one outer loop (the row is read from memory once; its second read
    hits L1): it returns the row *sums*, not the shift, because a pointwise output between the
    two reductions splits the loop nest; the shift ``sum / CHUNK`` is exact (``CHUNK`` is a
    power of two), so the float64 code below rebuilds it bit for bit. The second nest converts
    the C rows to float64 central moments and merges them (the equal-count case of
    :func:`combine_moments`, mean refined once), so the per-row float64 work costs a compiled
    loop over C instead of ~20 eager operations over all rows.

    ``1/CHUNK`` is written as a literal: a module-level float would become a graph input
    (dynamo does not specialise floats), converted to a tensor at every call; that and the
    constant outputs left out cost ~8 us of the ~45 us fixed cost of a call (measured)."""
    xf = x2 if x2.dtype == torch.float64 else x2.float()
    rs = xf.sum(1)
    y = xf - rs.unsqueeze(1) * 0.0009765625  # 1 / CHUNK
    y2 = y * y
    s1, s2, s3, s4 = y.sum(1), y2.sum(1), (y2 * y).sum(1), (y2 * y2).sum(1)
    mn, mx = xf.amin(1), xf.amax(1)
    f64 = torch.float64
    s1, s2, s3, s4 = s1.to(f64), s2.to(f64), s3.to(f64), s4.to(f64)
    a = s1 * 0.0009765625  # the residue of each row's shift
    a2 = a * a
    mean_r = (rs * 0.0009765625).to(f64) + a
    m2 = s2 - s1 * a
    m3 = s3 - 3.0 * a * s2 + 2.0 * s1 * a2
    m4 = s4 - 4.0 * a * s3 + 6.0 * a2 * s2 - 3.0 * s1 * a2 * a
    mean = mean_r.mean()
    mean = mean + (mean_r - mean).mean()
    d = mean_r - mean
    d2 = d * d
    b = 1024.0  # CHUNK
    return torch.stack(
        [
            mean,
            (m2 + b * d2).sum(),
            (m3 + 3.0 * d * m2 + b * d2 * d).sum(),
            (m4 + 4.0 * d * m3 + 6.0 * d2 * m2 + b * d2 * d2).sum(),
            mn.amin().to(f64),
            mx.amax().to(f64),
        ]
    )


def _rows_eager_fast(x2: torch.Tensor, work: list[torch.Tensor]) -> torch.Tensor:
    """Eager rows ``[8, C]`` (n, shift, S1..S4, min, max) of an ``x2`` ``[C, B]`` assumed finite
    (min and max are those of a block of rows, repeated over its rows: they merge to the same).

    The rows go in blocks of about :data:`_EAGER_BLOCK` elements (2 MiB of float32) through two
    reusable work buffers of that size, so each block is read from memory once (by the row
    mean) and every later pass over it, and over its temporaries, hits the CPU cache: per block
    one subtraction ``d = x - shift`` and one product ``d2 = d*d`` are written, and
    ``S1 = sum d``, ``S2 = sum d2``, ``S4 = |d2|^2`` (a norm: one read, no temporary),
    ``S3 = sum d2*d`` (the product overwrites ``d``) and the block's min/max are reduced from
    cache. Nothing is allocated per block."""
    c, b = x2.shape
    dtype = torch.float64 if x2.dtype == torch.float64 else torch.float32
    out = torch.empty(8, c, dtype=dtype, device=x2.device)
    out[0] = b
    block = _EAGER_BLOCK if x2.device.type == "cpu" else _DEVICE_EAGER_BLOCK
    rows = max(1, min(c, block // b))
    if not work or work[0].numel() < rows * b:
        work[:] = [torch.empty(rows * b, dtype=dtype, device=x2.device) for _ in range(2)]
    for start in range(0, c, rows):
        xb = x2[start : start + rows]
        r = xb.shape[0]
        end = start + r
        if xb.dtype != dtype:
            xb = xb.to(dtype)
        d = work[0][: r * b].view(r, b)
        d2 = work[1][: r * b].view(r, b)
        shift = out[1, start:end]
        torch.mean(xb, 1, out=shift)
        torch.sub(xb, shift.unsqueeze(1), out=d)
        torch.sum(d, 1, out=out[2, start:end])
        torch.mul(d, d, out=d2)
        torch.sum(d2, 1, out=out[3, start:end])
        torch.linalg.vector_norm(d2, 2, 1, out=out[5, start:end])
        torch.mul(d2, d, out=d)
        torch.sum(d, 1, out=out[4, start:end])
        mn, mx = torch.aminmax(xb)
        out[6, start:end] = mn
        out[7, start:end] = mx
    out[5].square_()
    return out


def _blocks_eager(body: torch.Tensor, work: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """Eager rows ``[8, K]`` of a CPU body ``[C, B]`` assumed finite: one column of raw power
    sums (shift 0) per block of about :data:`_EAGER_BLOCK` elements, for the blocks whose
    ``|mean| <= std``; every other block as per-row shifted rows of :func:`_rows_eager_fast`
    (see the module docstring for why that bound keeps the 1e-4 budget). Also returns whether
    some part needs :func:`_rows_exact` (:func:`_needs_exact`), found in the same look at the
    sums.

    Per block, from the CPU cache after the first read: its min/max, ``S1 = sum x``,
    ``x^2`` written once and summed (``S2``) and normed per row (``S4``: the row norms of all
    blocks are squared and summed per block once, after the loop), ``x^3`` written and summed
    (``S3``): seven operations, against nine with a shift, and fewer passes over memory-sized
    data (no subtraction written). The first one reads memory, so the costliest (min/max) goes
    first and overlaps the load. Nothing else runs per block: the block sums are stacked and
    read back to the host once per tensor (free on CPU), checked in Python and turned into
    the result in one tensor construction. The work per tensor around the loop (about 10% of
    the kernel on the 49 large tensors of a 110M-parameter model, measured) is kept to a few
    small operations."""
    c, b = body.shape
    rpb = max(1, min(c, _EAGER_BLOCK // b))
    head = body[0].float()
    # |mean| > 2 std on the first row, i.e. mean^2 > 4 (q/b - mean^2) with q = sum x^2: an
    # offset tensor, go shifted directly (a heuristic: float32 sum and dot are plenty for it)
    if 5.0 * float(head.sum()) ** 2 > 4.0 * b * float(head.dot(head)):
        rows = _rows_eager_fast(body, work)
        return rows, bool(_needs_exact(rows).any())
    dtype = torch.float64 if body.dtype == torch.float64 else torch.float32
    block = rpb * b
    if len(work) < 2 or work[0].numel() < block or work[0].dtype != dtype:
        work[:] = [torch.empty(block, dtype=dtype, device=body.device) for _ in range(2)]
    x2_full, x3_full = work[0][:block], work[1][:block]
    nblocks = -(-c // rpb)
    row_norms = torch.empty(nblocks, rpb, dtype=dtype, device=body.device)
    last_rows = c - (nblocks - 1) * rpb
    if last_rows < rpb:  # the rows past the body's end, in the last block, add nothing
        row_norms[-1, last_rows:] = 0.0
    blocks = body.reshape(-1).split(block)
    sums: list[torch.Tensor] = []
    for x, norms in zip(blocks, row_norms, strict=True):
        k = x.numel()
        if x.dtype != dtype:
            x = x.to(dtype)
        x2, x3 = (x2_full, x3_full) if k == block else (x2_full[:k], x3_full[:k])
        mn, mx = torch.aminmax(x)
        s1 = x.sum()
        torch.mul(x, x, out=x2)
        s2 = x2.sum()
        torch.linalg.vector_norm(x2.view(-1, b), 2, 1, out=norms[: k // b])
        torch.pow(x, 3, out=x3)
        s3 = x3.sum()
        sums += (s1, s2, s3, mn, mx)
    per_block = torch.stack(sums).view(nblocks, 5).tolist()  # S1, S2, S3, min, max
    s4s = row_norms.square_().sum(1).tolist()
    counts = [block] * (nblocks - 1) + [last_rows * b]  # elements per block
    keep: list[bool] = []
    flagged = False
    tiny = _underflow_var(dtype)
    columns: list[list[float]] = []
    for (s1, s2, s3, mn, mx), s4, n in zip(per_block, s4s, counts, strict=True):
        values = (s1, s2, s3, s4, mn, mx)
        exact = _part_needs_exact(values, n, s2, mn, mx, tiny)
        # |mean| <= std  <=>  mean^2 <= M2/n = S2/n - mean^2  <=>  2 S1^2 <= n S2. A block that
        # needs the exact path (NaN/inf, overflow, underflow) is not recomputed shifted first.
        kept = exact or 2.0 * s1 * s1 <= n * s2
        keep.append(kept)
        flagged = flagged or exact
        if kept:
            columns.append([float(n), 0.0, *values])
    # float32 values round-trip through Python floats unchanged
    out = torch.tensor(columns, dtype=dtype, device=body.device).t().reshape(8, len(columns))
    if all(keep):
        return out, flagged
    parts = [out]
    for i, kept in enumerate(keep):
        if not kept:
            rows = _rows_eager_fast(body[i * rpb : (i + 1) * rpb], work)
            flagged = flagged or bool(_needs_exact(rows).any())
            parts.append(rows)
    return torch.cat(parts, 1), flagged


def _rows_exact(body: torch.Tensor) -> torch.Tensor:
    """Masked rows ``[8, C]`` of ``body`` computed in float64, block by block: the slow path
    for a tensor holding a NaN/inf, or whose float32 powers under- or overflow."""
    step = max(1, _EAGER_BLOCK // body.shape[1])
    return torch.cat(
        [_rows_masked(body[s : s + step].to(torch.float64)) for s in range(0, body.shape[0], step)],
        1,
    )


def _needs_exact(rows: torch.Tensor) -> torch.Tensor:
    """Per column of rows ``[8, K]`` (n, shift, S1..S4, min, max): True where a NaN/inf was met,
    the sums overflowed, or float32 fourth powers would underflow (mean square below
    :data:`_TINY_VAR` in a part that is not constant; a constant row inside a varying block of
    the shifted kernel is flagged too, which costs time, never precision)."""
    bad = ~torch.isfinite(rows[2:]).all(0)
    if rows.dtype != torch.float64:  # (a sum of squares that underflowed to 0 counts too)
        bad |= (rows[3] < rows[0] * _TINY_VAR) & (rows[7] > rows[6])
    return bad


def _part_needs_exact(
    values: Sequence[float],
    count: int,
    spread: float,
    mn: float,
    mx: float,
    tiny: float,
) -> bool:
    """The rule of :func:`_needs_exact` for one part read back as Python floats (the check made
    per call, where a dozen tensor operations would cost ~40 us and this ~1 us): ``values``
    not all finite, or ``spread`` (a sum of squares, S2 or M2) below ``count * tiny`` in a part
    that is not constant (``tiny``: :func:`_underflow_var` of the sums' dtype)."""
    return not all(math.isfinite(v) for v in values) or (spread < count * tiny and mx > mn)


def _body_needs_exact(
    bodies: torch.Tensor, counts: torch.Tensor, tiny: torch.Tensor
) -> torch.Tensor:
    """:func:`_needs_exact` for whole-body moments ``[K, 6]`` (mean, M2, M3, M4, min, max) of
    the compiled CPU kernel, their element counts ``[K]`` and the mean square below which each
    underflows ``[K]`` (:func:`_underflow_var` of each body's tensor dtype)."""
    underflow = (bodies[:, 1] < counts * tiny) & (bodies[:, 5] > bodies[:, 4])
    return ~torch.isfinite(bodies).all(1) | underflow


def _underflow_var(dtype: torch.dtype) -> float:
    """The mean square below which the sums of a tensor of ``dtype`` lose precision:
    :data:`_TINY_VAR` for float32 sums (float32, bf16, fp16 tensors), 0 for float64, whose
    fourth powers do not underflow."""
    return 0.0 if dtype == torch.float64 else _TINY_VAR


def _body(flat: torch.Tensor) -> torch.Tensor:
    """The whole rows of a flat tensor, ``[numel // CHUNK, CHUNK]`` (a view; the tail is left
    out)."""
    c = flat.numel() // CHUNK
    return flat[: c * CHUNK].view(c, CHUNK)


def _rows_to_moments(rows: torch.Tensor, b: int) -> torch.Tensor:
    """Rows ``[8, C]`` of (n, shift, S1..S4, min, max) -> float64 central moments
    ``[C, NUM_FIELDS]``; ``b`` is the row length (for the non-finite count ``b - n``, clamped at
    0: a row of :func:`_body_moments_fused` stands for many finite rows, ``n >= b``)."""
    rows = rows.to(torch.float64)
    n, shift, s1, s2, s3, s4, mn, mx = rows.unbind(0)
    a = s1 / n.clamp_min(1.0)  # the residue of the shift
    a2 = a * a
    return torch.stack(
        [
            n,
            shift + a,
            s2 - s1 * a,
            s3 - 3.0 * a * s2 + 2.0 * s1 * a2,
            s4 - 4.0 * a * s3 + 6.0 * a2 * s2 - 3.0 * s1 * a2 * a,
            mn,
            mx,
            (b - n).clamp_min(0.0),
        ],
        1,
    )


class _Compiled:
    """Lazily compiled row kernels; falls back to eager for good on any failure.

    Two variants: :func:`_rows_masked` (non-finite elements masked element by element: no
    host sync, used on accelerators, where the kernel is bound by memory and masking is free)
    and :func:`_body_moments_fused` (used on CPU, where masking doubles the compute; a
    non-finite element shows in the min/max and that tensor is recomputed masked, a check that
    costs nothing on CPU). Both are compiled with ``dynamic=True``: once per dtype, never per
    tensor size.
    """

    def __init__(self) -> None:
        self._fns: dict[bool, object] = {}
        self.failed: str | None = None
        self._lock = threading.Lock()

    def __call__(self, x2: torch.Tensor, masked: bool = True) -> torch.Tensor | None:
        if self.failed is not None:
            return None
        try:
            with self._lock:
                fn = self._fns.get(masked)
                if fn is None:
                    kernel = _rows_masked if masked else _body_moments_fused
                    fn = torch.compile(kernel, dynamic=True)
                    self._fns[masked] = fn
                with _plain_state(x2.device):
                    return fn(x2)  # type: ignore[operator]
        except Exception as exc:  # compiler missing, unsupported backend, ...
            self.failed = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"trainvitals: torch.compile of the moments kernel failed ({self.failed}); "
                "using the eager kernel",
                RuntimeWarning,
                stacklevel=3,
            )
            return None


@contextlib.contextmanager
def _plain_state(device: torch.device) -> Any:
    """Autograd and autocast off around a compiled call. Dynamo guards a compiled function on
    that global state, and the kernel is called from hooks in every one (forward hooks: autograd
    on, autocast on under AMP; gradient hooks: both off; the parameters in between): each
    state met was one more compilation per dtype, and one run with bf16 autocast hit Dynamo's
    recompile limit (8) within three logging steps, after which the kernel ran uncompiled
    (measured, CPU). Neither changes what the kernel computes (its inputs are detached, and it
    casts to float32/float64 itself)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        available = getattr(torch.amp, "is_autocast_available", lambda kind: kind == "cpu")
        for kind in dict.fromkeys((device.type, "cpu")):
            if available(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))
        yield


_compiled = _Compiled()
_eager_work: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}


def _use_compile(kernel: Kernel, device: torch.device) -> bool:
    if kernel == "eager":
        return False
    if kernel == "compile":
        return _compiled.failed is None
    # auto: compiled where Triton/inductor is the natural choice (CUDA); on CPU the eager
    # kernel avoids a compile of many seconds at the first logging step.
    return device.type == "cuda" and _compiled.failed is None


def _bucketing(kernel: Kernel, device: torch.device) -> bool:
    """Whether tensors known together are reduced in buckets (:meth:`MomentAccumulator.add_many`):
    on an accelerator with the compiled kernel, whose per-call host cost is the bottleneck. (On
    CPU the per-call cost is a small share of the kernel's time, and a copy into a bucket is a
    pass over memory.)"""
    return device.type != "cpu" and _use_compile(kernel, device)


def _small_moments(
    pieces: list[torch.Tensor], owner: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments of many small 1-D pieces at once, exact to float64 (two-pass).

    On CPU, pieces of equal length (a model's many norm weights and biases share a few sizes)
    are stacked into dense float64 matrices ``[k, length]`` and reduced row-wise: a handful of
    dense operations per distinct length, no segment index (3-5x cheaper than the index path on
    CPU). A row holding a NaN/inf shows it in its min/max and goes, with every piece whose
    length occurs once, to the masked segment path (:func:`_segment_moments`). Elsewhere the
    segment path runs for all pieces: it needs no host sync."""
    if pieces[0].device.type != "cpu" or len(pieces) < 2:
        return _segment_moments(pieces, owner)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(pieces):
        by_len.setdefault(p.numel(), []).append(i)
    outs: list[torch.Tensor] = []
    owners: list[int] = []
    rest: list[int] = []
    for length, idx in by_len.items():
        if len(idx) < 2:
            rest += idx
            continue
        x = torch.stack([pieces[i] for i in idx]).to(torch.float64)
        mean = x.mean(1, keepdim=True)
        y = x - mean
        y2 = y * y
        mn, mx = x.amin(1), x.amax(1)
        n = torch.full_like(mn, length)
        rows = torch.stack(
            [n, mean.squeeze(1), y.sum(1), y2.sum(1), (y2 * y).sum(1), (y2 * y2).sum(1), mn, mx]
        )
        good = (torch.isfinite(mn) & torch.isfinite(mx)).tolist()
        keep = [j for j, ok in enumerate(good) if ok]
        rest += [idx[j] for j, ok in enumerate(good) if not ok]
        if len(keep) == len(idx):
            outs.append(_rows_to_moments(rows, length))
            owners += [owner[i] for i in idx]
        elif keep:
            outs.append(_rows_to_moments(rows[:, keep], length))
            owners += [owner[idx[j]] for j in keep]
    if rest:
        m, o = _segment_moments([pieces[i] for i in rest], [owner[i] for i in rest])
        outs.append(m)
        owners += o.tolist()
    return torch.cat(outs), torch.tensor(owners, device=pieces[0].device)


@dataclasses.dataclass
class _Bucket:
    """One dtype's bucket being filled by :meth:`MomentAccumulator._bucketed`: the pieces to
    concatenate (tensors and their NaN pads), per member ``(item, rows, pad, piece)``, and the
    rows so far (kept, not summed over the members at every put: that grew with the square of
    the tensors, 0.9 s of host time for 8000 small ones)."""

    pieces: list[torch.Tensor] = dataclasses.field(default_factory=list)
    members: list[tuple[int, int, int, torch.Tensor]] = dataclasses.field(default_factory=list)
    rows: int = 0


_nan_pads: dict[tuple[torch.device, torch.dtype], dict[int, torch.Tensor]] = {}


def _nan_pad(device: torch.device, dtype: torch.dtype, size: int) -> torch.Tensor:
    """``size`` (< :data:`CHUNK`) NaN of ``dtype`` on ``device``: views of one cached row, kept
    per size (a lookup costs the host less than a slice)."""
    views = _nan_pads.get((device, dtype))
    if views is None:
        views = _nan_pads[(device, dtype)] = {
            CHUNK: torch.full((CHUNK,), math.nan, dtype=dtype, device=device)
        }
    pad = views.get(size)
    if pad is None:
        pad = views[size] = views[CHUNK][:size]
    return pad


def _owners(slots: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
    """``slots[i]`` repeated ``counts[i]`` times, on ``device``: the repeat on the device with
    its size given (a device ``repeat_interleave`` without it reads the size back: a sync)."""
    if device.type == "cpu":
        return torch.repeat_interleave(torch.tensor(slots), torch.tensor(counts))
    return torch.repeat_interleave(
        host_to_device(torch.tensor(slots), device),
        host_to_device(torch.tensor(counts), device),
        output_size=sum(counts),
    )


def _segment_moments(
    pieces: list[torch.Tensor], owner: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments of small 1-D pieces, exact to float64: two-pass over one concatenated buffer
    with a segment index, non-finite elements masked (no host sync)."""
    device = pieces[0].device
    lengths = host_to_device(torch.tensor([p.numel() for p in pieces]), device)
    k = len(pieces)
    flat = torch.cat([p.reshape(-1) for p in pieces]).to(torch.float64)
    # (the size given: a device repeat_interleave would read it back, a sync)
    seg = torch.repeat_interleave(torch.arange(k, device=device), lengths, output_size=flat.numel())
    fin = torch.isfinite(flat)
    n = torch.zeros(k, dtype=torch.float64, device=device).index_add_(0, seg, fin.double())
    xz = torch.where(fin, flat, 0.0)
    mean = torch.zeros(k, dtype=torch.float64, device=device).index_add_(0, seg, xz)
    mean = mean / n.clamp_min(1.0)
    y = torch.where(fin, flat - mean[seg], 0.0)
    y2 = y * y
    acc = torch.zeros(k, 4, dtype=torch.float64, device=device)
    acc.index_add_(0, seg, torch.stack([y, y2, y2 * y, y2 * y2], 1))
    inf = torch.full((k,), math.inf, dtype=torch.float64, device=device)
    mn = inf.scatter_reduce(0, seg, torch.where(fin, flat, math.inf), "amin")
    mx = (-inf).scatter_reduce(0, seg, torch.where(fin, flat, -math.inf), "amax")
    out = _rows_to_moments(torch.stack([n, mean, *acc.unbind(1), mn, mx], 0), 0)
    out[:, NONFINITE] = lengths.to(torch.float64) - n
    return out, host_to_device(torch.tensor(owner), device)


def fused_moments(tensors: Sequence[torch.Tensor], *, kernel: Kernel = "auto") -> torch.Tensor:
    """Moments of each tensor in ``tensors`` (float64 ``[len(tensors), NUM_FIELDS]``).

    One pass over each large tensor's memory (rows of :data:`CHUNK` elements), all small tensors
    and tails batched into one float64 reduction (on an accelerator with the compiled kernel:
    into the buckets of rows, padded), every part merged exactly.

    Args:
        tensors: floating-point tensors on one device (any shape, any float dtype; DTensors
            must be passed as their local tensors).
        kernel: ``"compile"`` (``torch.compile`` of the row kernel, falling back to eager if
            compilation fails), ``"eager"``, or ``"auto"`` (compiled on CUDA, eager elsewhere).

    Example:
        >>> m = fused_moments([torch.randn(4096, 1024), 1 + 0.01 * torch.randn(4096)])
        >>> derive(m)["kurtosis"]   # about [3.0, 3.0]
    """
    parts, owner = partial_moments(tensors, kernel=kernel)
    return combine_moments(parts, owner, len(tensors))


def partial_moments(
    tensors: Sequence[torch.Tensor], *, kernel: Kernel = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The un-merged parts behind :func:`fused_moments`: float64 moments of rows and segments
    ``[K, NUM_FIELDS]`` and the index of the tensor each part belongs to ``[K]``.

    Parts from many calls can be concatenated (re-indexed) and merged once with
    :func:`combine_moments`.
    """
    tensors = list(tensors)
    acc = MomentAccumulator(len(tensors), kernel=kernel)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"tensors[{i}] must be a floating-point tensor, got {t.dtype}")
        if i and t.device != tensors[0].device:
            raise ValueError(f"all tensors must be on one device; tensors[{i}] is on {t.device}")
    if tensors and _bucketing(kernel, tensors[0].device):
        acc.add_bucketed(tensors)
    else:
        for i, t in enumerate(tensors):
            acc.add(i, t, check_finite=False, copy_small=False)
    acc.fix_nonfinite(tensors)
    return acc.parts()


class MomentAccumulator:
    """Moments of many slots (tensors, or sites seen once per micro-batch), merged exactly.

    :meth:`add` runs the row kernel on a large tensor right away (its data need not live on)
    and keeps the raw rows; a small tensor is kept as a flat copy. :meth:`result` converts every
    row, reduces every small piece in one batched float64 pass and merges all parts per slot, a
    fixed number of operations however many tensors were added. This is what forward and
    gradient hooks use: each hook costs one kernel call.

    Example:
        >>> acc = MomentAccumulator(2)
        >>> x = torch.randn(64, 64)
        >>> acc.add(0, torch.randn(4096, 1024)); acc.add(0, torch.randn(10)); acc.add(1, x)
        >>> acc.result()     # [2, NUM_FIELDS]
    """

    def __init__(self, num_slots: int, *, kernel: Kernel = "auto") -> None:
        if kernel not in ("auto", "compile", "eager"):
            raise ValueError(f"kernel must be 'auto', 'compile' or 'eager', got {kernel!r}")
        self.num_slots = num_slots
        self.kernel = kernel
        # three kinds of parts: raw rows [8, C] (eager and masked kernels), whole-body moments
        # [6] of the CPU compiled kernel with their element count, and small flat tensors
        self._rows: list[torch.Tensor] = []
        self._row_slot: list[int] = []
        # index in _rows -> NaN elements padded into that part's last row (bucketed parts)
        self._row_pad: dict[int, int] = {}
        self._bodies: list[torch.Tensor | None] = []  # None: replaced by masked rows
        self._body_slot: list[int] = []
        self._body_count: list[int] = []
        # (is_body, position) of parts from an unmasked kernel, not yet checked for NaN/inf
        self._unchecked: list[tuple[bool, int]] = []
        self._small: list[torch.Tensor] = []
        self._small_slot: list[int] = []
        # id(key) -> (weakref to key, its version, [(part list, index)]): a tensor seen at
        # several slots (one input feeding the q, k and v projections) is reduced once
        self._seen: dict[int, tuple[Any, int, list[tuple[str, int]]]] = {}

    def add(
        self,
        slot: int,
        tensor: torch.Tensor,
        *,
        check_finite: bool = True,
        key: torch.Tensor | None = None,
        copy_small: bool = True,
    ) -> None:
        """Fold ``tensor`` (floating point, any shape) into ``slot``.

        With the eager kernel, ``check_finite`` looks at the tensor's min/max right away (one
        flag read back to the host) and recomputes it with masking if it holds a NaN or inf;
        pass ``False`` and call :meth:`fix_nonfinite` once for a batch of tensors instead (the
        CPU eager kernel has read its sums back anyway, so it acts at once either way).
        ``key``: the tensor object ``tensor`` was taken from (e.g. before ``detach()``); adding
        the same, unmodified key again reuses the first reduction instead of reading the data.
        ``copy_small``: keep a copy of a small tensor (its data may change before
        :meth:`result`, e.g. an in-place activation); ``False`` when it will not.
        """
        if key is not None:
            seen = self._seen.get(id(key))
            if seen is not None and seen[0]() is key and seen[1] == key._version:
                self._replay(slot, seen[2])
                return
            before = {w: len(getattr(self, f"_{w}")) for w in ("rows", "bodies", "small")}
            self._add(slot, tensor, check_finite, copy_small)
            entries = [
                (w, i) for w, n in before.items() for i in range(n, len(getattr(self, f"_{w}")))
            ]
            self._remember(key, entries)
            return
        self._add(slot, tensor, check_finite, copy_small)

    def _add(self, slot: int, tensor: torch.Tensor, check_finite: bool, copy_small: bool) -> None:
        flat = tensor.detach().reshape(-1)
        if flat.numel() < SMALL_NUMEL:
            if flat.numel():
                copy = copy_small and flat.data_ptr() == tensor.data_ptr()
                self._small.append(flat.clone() if copy else flat)
                self._small_slot.append(slot)
            return
        body = _body(flat)
        c = body.shape[0]
        if flat.numel() > c * CHUNK:
            tail = flat[c * CHUNK :]
            self._small.append(tail.clone() if copy_small else tail)
            self._small_slot.append(slot)
        rows = None
        masked = flat.device.type != "cpu"
        if _use_compile(self.kernel, flat.device):
            rows = _compiled(body, masked)
            if rows is not None and not masked:  # the CPU kernel: the moments of the body
                if not check_finite:
                    self._unchecked.append((True, len(self._bodies)))
                else:
                    _, m2, _, _, mn, mx = values = rows.tolist()
                    tiny = _underflow_var(flat.dtype)
                    if _part_needs_exact(values, c * CHUNK, m2, mn, mx, tiny):
                        self._rows.append(_rows_exact(body))
                        self._row_slot.append(slot)
                        return
                self._bodies.append(rows)
                self._body_slot.append(slot)
                self._body_count.append(c * CHUNK)
                return
        if rows is None:
            self._add_eager_rows(slot, body, check_finite)
            return
        self._rows.append(rows)  # the masked kernel's: non-finite and range handled inside
        self._row_slot.append(slot)

    def _add_eager_rows(self, slot: int, body: torch.Tensor, check_finite: bool) -> None:
        """The eager kernel's rows of ``body`` ``[C, CHUNK]`` into ``slot``: recomputed exactly
        at once if they show a NaN/inf or a float32 range problem, or with ``check_finite``
        false left to :meth:`fix_nonfinite` (on CPU the kernel has read its sums back anyway,
        so it acts at once either way)."""
        cdtype = torch.float64 if body.dtype == torch.float64 else torch.float32
        work = _eager_work.setdefault((body.device, cdtype), [])
        flagged: bool | None = None  # known without another look: the CPU eager kernel's
        if body.device.type == "cpu":  # raw block sums need a host read: CPU only (free)
            rows, flagged = _blocks_eager(body, work)
        else:
            rows = _rows_eager_fast(body, work)
        if flagged is None and not check_finite:  # deferred to one batched check
            self._unchecked.append((False, len(self._rows)))
        elif flagged if flagged is not None else bool(_needs_exact(rows).any()):
            rows = _rows_exact(body)
        self._rows.append(rows)
        self._row_slot.append(slot)

    def add_bucketed(self, tensors: Sequence[torch.Tensor]) -> None:
        """Fold ``tensors[i]`` into slot ``i`` for every ``i``, on an accelerator with the
        compiled (masked) kernel: tensors of one dtype are concatenated whole (each padded with
        NaN to whole rows) into buckets of up to :data:`_BUCKET_NUMEL` elements, one compiled
        call per bucket.

        Why: a compiled call costs ~120-170 us of host time on an H100 (guards, the runtime
        wrapper, the launch), several times the kernel's own time for a tensor of a few million
        elements; 121 tensors of 117M values took 8 ms of host time for 2 ms on the device
        (measured, torch 2.11). The copy into a bucket is one ``torch.cat`` per bucket, a pass
        the device makes at full bandwidth; a tensor of a bucket's size or more is reduced where
        it is. Should compilation fail, the eager kernel's tails are kept as views: the tensors
        must then live until :meth:`parts`, and :meth:`fix_nonfinite` is to be called with
        them."""
        self._bucketed(list(enumerate(tensors)), check_finite=False, copy_small=False)

    def add_many(self, items: Sequence[tuple[int, torch.Tensor, torch.Tensor | None]]) -> None:
        """``add(slot, tensor, key=key)`` for each ``(slot, tensor, key)``, at once: on an
        accelerator with the compiled kernel the tensors are bucketed as in
        :meth:`add_bucketed` (one compiled call per bucket instead of one per tensor), small
        tensors and tails copied (their data may change before :meth:`result`), a key seen
        before (here or in an earlier call, unmodified) reduced once. Elsewhere one ``add``
        each."""
        if not items:
            return
        if not _bucketing(self.kernel, items[0][1].device):
            for slot, tensor, key in items:
                self.add(slot, tensor, key=key)
            return
        fresh: list[tuple[int, torch.Tensor]] = []
        keys: list[torch.Tensor | None] = []
        first: dict[int, int] = {}  # id(key) -> its position in fresh
        repeats: list[tuple[int, int]] = []  # (slot, position in fresh)
        for slot, tensor, key in items:
            if key is not None:
                seen = self._seen.get(id(key))
                if seen is not None and seen[0]() is key and seen[1] == key._version:
                    self._replay(slot, seen[2])
                    continue
                at = first.get(id(key))
                if at is not None and keys[at] is key:
                    repeats.append((slot, at))
                    continue
                first[id(key)] = len(fresh)
            fresh.append((slot, tensor))
            keys.append(key)
        entries = self._bucketed(fresh, check_finite=True, copy_small=True)
        for key, made in zip(keys, entries, strict=True):
            if key is not None:
                self._remember(key, made)
        for slot, at in repeats:
            self._replay(slot, entries[at])

    def _remember(self, key: torch.Tensor, entries: list[tuple[str, int]]) -> None:
        """Note the parts ``key``'s reduction made, for an add of it unmodified to reuse."""
        with contextlib.suppress(TypeError):  # not weak-referenceable: no reuse
            self._seen[id(key)] = (weakref.ref(key), key._version, entries)

    def _replay(self, slot: int, entries: list[tuple[str, int]]) -> None:
        """Add to ``slot`` the parts an earlier add of the same tensor made (``entries``)."""
        for where, idx in entries:
            if where == "rows":
                if (False, idx) in self._unchecked:
                    self._unchecked.append((False, len(self._rows)))
                if idx in self._row_pad:
                    self._row_pad[len(self._rows)] = self._row_pad[idx]
                self._rows.append(self._rows[idx])
                self._row_slot.append(slot)
            elif where == "bodies":
                if (True, idx) in self._unchecked:
                    self._unchecked.append((True, len(self._bodies)))
                self._bodies.append(self._bodies[idx])
                self._body_slot.append(slot)
                self._body_count.append(self._body_count[idx])
            else:
                self._small.append(self._small[idx])
                self._small_slot.append(slot)

    def _bucketed(
        self, items: list[tuple[int, torch.Tensor]], *, check_finite: bool, copy_small: bool
    ) -> list[list[tuple[str, int]]]:
        """:meth:`add_bucketed` of ``(slot, tensor)`` items; returns the parts each item made
        (``("rows"|"small", index)``), for :meth:`add_many`'s reuse of a tensor seen again.

        Each tensor goes into its dtype's bucket whole, flattened and padded with NaN to whole
        rows of :data:`CHUNK` (the masked kernel leaves NaN out; the pad is taken off the row's
        non-finite count in :meth:`parts`): no tail or small tensor is left for the float64
        segment path, and a tensor costs the host one view and one cached pad, not the four
        views and the segment reduction of its body and tail. A tensor whose whole rows fill a
        bucket alone is reduced where it is, its tail padded into the bucket. The bucket's
        ``torch.cat`` copies the data, so nothing need live on. ``check_finite``: rows of the
        eager fallback (compilation failed) are checked at once (one read back per tensor)
        instead of left to :meth:`fix_nonfinite`."""
        made: list[list[tuple[str, int]]] = [[] for _ in items]
        buckets: dict[torch.dtype, _Bucket] = {}

        def keep(k: int, rows: torch.Tensor, pad: int) -> None:
            made[k].append(("rows", len(self._rows)))
            if pad:
                self._row_pad[len(self._rows)] = pad
            self._rows.append(rows)
            self._row_slot.append(items[k][0])

        def fallback(k: int, piece: torch.Tensor) -> None:
            """Compilation failed: the eager kernel for the piece's whole rows, the small
            path for the rest."""
            slot = items[k][0]
            n = piece.numel()
            whole = 0 if n < SMALL_NUMEL else n - n % CHUNK
            if whole:
                made[k].append(("rows", len(self._rows)))
                self._add_eager_rows(slot, piece[:whole].view(-1, CHUNK), check_finite)
            if n > whole:
                made[k].append(("small", len(self._small)))
                rest = piece[whole:]
                self._small.append(rest.clone() if copy_small else rest)
                self._small_slot.append(slot)

        def run(bucket: _Bucket) -> None:
            pieces, members = bucket.pieces, bucket.members
            x2 = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(-1, CHUNK)
            rows = _compiled(x2, True)
            if rows is None:
                for k, _, _, piece in members:
                    fallback(k, piece)
                return
            for (k, _, pad, _), part in zip(
                members, rows.split([m[1] for m in members], 1), strict=True
            ):
                keep(k, part, pad)

        def put(k: int, piece: torch.Tensor) -> None:
            """``piece`` (flat, not empty) padded into its dtype's bucket."""
            n = piece.numel()
            rows = -(-n // CHUNK)
            pad = rows * CHUNK - n
            bucket = buckets.setdefault(piece.dtype, _Bucket())
            if bucket.members and (bucket.rows + rows) * CHUNK > _BUCKET_NUMEL:
                run(bucket)
                bucket = buckets[piece.dtype] = _Bucket()
            bucket.rows += rows
            bucket.pieces.append(piece)
            if pad:
                bucket.pieces.append(_nan_pad(piece.device, piece.dtype, pad))
            bucket.members.append((k, rows, pad, piece))

        with torch.no_grad():  # (so no detach() per tensor: one host op less each)
            for k, (_, tensor) in enumerate(items):
                flat = tensor.reshape(-1)
                n = flat.numel()
                if not n:
                    continue
                if n < _BUCKET_NUMEL:
                    put(k, flat)
                    continue
                body = _body(flat)  # a bucket's size alone: reduced where it is
                rows = _compiled(body, True)
                if rows is None:
                    fallback(k, flat)
                    continue
                keep(k, rows, 0)
                if n > body.numel():
                    put(k, flat[body.numel() :])
            for bucket in buckets.values():
                if bucket.members:
                    run(bucket)
        return made

    def fix_nonfinite(self, tensors: Sequence[torch.Tensor]) -> None:
        """After ``add(i, tensors[i], check_finite=False)`` calls: recompute, in float64 and with
        masking, the tensors with a NaN or inf or whose float32 sums under- or overflowed (one
        check over all rows and one over all compiled bodies, each one flag read back to the
        host; the per-tensor flags are only looked at when something needs it)."""
        if not self._unchecked:
            return
        flagged: list[bool] = [False] * len(self._unchecked)
        row_at = [k for k, (is_body, _) in enumerate(self._unchecked) if not is_body]
        body_at = [k for k, (is_body, _) in enumerate(self._unchecked) if is_body]
        by_dtype: dict[torch.dtype, list[int]] = {}  # float32 and float64 rows apart: a
        for k in row_at:  # concatenation would make float32 rows float64 and skip their check
            by_dtype.setdefault(self._rows[self._unchecked[k][1]].dtype, []).append(k)
        for ks in by_dtype.values():
            parts = [self._rows[self._unchecked[k][1]] for k in ks]
            bad = _needs_exact(torch.cat(parts, 1))
            if bool(bad.any()):
                for k, part in zip(ks, bad.split([p.shape[1] for p in parts]), strict=True):
                    flagged[k] = bool(part.any())
        if body_at:
            js = [self._unchecked[k][1] for k in body_at]
            bodies = torch.stack([self._bodies[j] for j in js])  # type: ignore[misc]
            counts = torch.tensor([self._body_count[j] for j in js], dtype=torch.float64)
            tiny = torch.tensor(
                [_underflow_var(tensors[self._body_slot[j]].dtype) for j in js],
                dtype=torch.float64,
            )
            bad = _body_needs_exact(bodies, counts.to(bodies.device), tiny.to(bodies.device))
            if bool(bad.any()):
                for k, flag in zip(body_at, bad.tolist(), strict=True):
                    flagged[k] = flag
        for (is_body, j), flag in zip(self._unchecked, flagged, strict=True):
            if not flag:
                continue
            slot = self._body_slot[j] if is_body else self._row_slot[j]
            rows = _rows_exact(_body(tensors[slot].detach().reshape(-1)))
            if is_body:  # exact rows replace it; None keeps the other positions valid
                self._bodies[j] = None  # type: ignore[call-overload]
                self._rows.append(rows)
                self._row_slot.append(slot)
            else:
                self._rows[j] = rows
        self._unchecked = []

    @property
    def empty(self) -> bool:
        """Whether nothing was added (its :meth:`result` is all identity rows)."""
        return not (self._rows or self._bodies or self._small)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The un-merged parts ``[K, NUM_FIELDS]`` and their slots ``[K]``."""
        parts: list[torch.Tensor] = []
        owners: list[torch.Tensor] = []
        device = (self._rows or self._bodies or self._small or [torch.empty(0)])[0].device
        keep = [i for i, b in enumerate(self._bodies) if b is not None]
        if keep:
            # whole-body moments: mean, M2, M3, M4, min, max, with their counts, no non-finite
            m = torch.stack([self._bodies[i] for i in keep]).to(torch.float64)
            counts = [self._body_count[i] for i in keep]
            count = host_to_device(torch.tensor(counts, dtype=torch.float64), device)
            parts.append(
                torch.cat([count.unsqueeze(1), m, torch.zeros_like(count).unsqueeze(1)], 1)
            )
            owners.append(host_to_device(torch.tensor([self._body_slot[i] for i in keep]), device))
        if self._rows:
            all_rows = torch.cat(self._rows, 1)  # float32 rows (float64 if any tensor was float64)
            rows = _rows_to_moments(all_rows, CHUNK)
            widths = [r.shape[1] for r in self._rows]
            if self._row_pad:  # the NaN padding of bucketed parts is not the tensor's
                ends = list(itertools.accumulate(widths))
                at = sorted(self._row_pad)
                fix = torch.tensor(
                    [[ends[i] - 1 for i in at], [-self._row_pad[i] for i in at]], dtype=torch.long
                )
                fix = host_to_device(fix, device)
                rows[:, NONFINITE].index_add_(0, fix[0], fix[1].to(torch.float64))
            parts.append(rows)
            owners.append(_owners(self._row_slot, widths, device))
        if self._small:
            m, owner = _small_moments(self._small, self._small_slot)
            parts.append(m)
            owners.append(owner)
        if not parts:
            return empty_moments(0, device=device), torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat(parts), torch.cat(owners)

    def result(self) -> torch.Tensor:
        """Merged moments per slot, ``[num_slots, NUM_FIELDS]`` float64 (empty slots hold the
        identity: count 0)."""
        parts, owner = self.parts()
        return combine_moments(parts, owner, self.num_slots)


def tensor_moments(tensor: torch.Tensor, *, kernel: Kernel = "auto") -> torch.Tensor:
    """Moments of one tensor (float64 ``[NUM_FIELDS]``)."""
    return fused_moments([tensor], kernel=kernel)[0]
