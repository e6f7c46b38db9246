"""Exact global L2 norms of parameters and gradients under every parallel layout.

The global L2 norm of a set of tensors is ``sqrt(sum_t sum_i t_i**2)`` over the *logical*
tensors of the model, each counted once:

* a plain tensor is either the whole tensor or a data-parallel replica (DDP): its local sum of
  squares is the tensor's, and it is not reduced across ranks (summing replicas would multiply
  the norm by ``sqrt(world_size)``);
* a ``DTensor`` (FSDP2, tensor parallel) holds one shard: its local sum of squares is summed
  over the process groups of its ``Shard``/``Partial`` mesh dims only, never over ``Replicate``
  dims (:func:`trainvitals.distributed.shard_groups`); this is Megatron-LM's
  ``calc_params_l2_norm`` rule "DTensor: sum only over Shard dims";
* tied or shared parameters (the same ``Parameter`` object, or two tensors over the same
  memory) are counted once.

Per-tensor local sums of squares are computed without reading anything back to the host
(one host-to-device copy of an index, pinned and non-blocking on CUDA), accumulated beyond the input
precision: on accelerators with the fused multi-tensor ``torch._foreach_norm`` (float64
output; one call per device and dtype, the lists its fused kernel takes; not exercised by
the CPU test suite); on CPU, where torch's norm kernel accumulates
each row sequentially in float32 (a relative error of ~1e-4 at 5M elements, measured), as
float32 norms of 1024-element rows combined in float64 (~1e-8 measured); tensors below 8192
elements are normed whole in float32, all in one call (<5e-7 measured). The per-tensor
vector is then reduced with one collective per distinct group
(:func:`trainvitals.distributed.all_reduce_by_groups`).

A tensor holding NaN or Inf has a non-finite sum of squares (NaN and Inf propagate through the
squares and the sums), so non-finite detection needs no extra pass over the data. On CPU a
sum of squares outside float32's range (a finite tensor whose float32 squares overflow,
elements above ~5e17, or whose squares are subnormal, elements below ~1e-19) is redone in
float64, so a finite tensor is never reported as non-finite and a tiny one does not read 0
(torch's own norms read ``inf`` and 0 there); on accelerators the limit is that of the fused
kernel's accumulation type (at least float32: a tensor norm above ~1e19 reads ``inf``).

No I/O, no framework imports; collectives only through :mod:`trainvitals.distributed`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from trainvitals._device import index_on
from trainvitals.distributed import (
    all_reduce_by_groups,
    group_size,
    local_tensor,
    partial_groups,
    shard_groups,
    unique_by_identity,
)

__all__ = [
    "WRAPPER_PREFIXES",
    "canonical_name",
    "canonical_named_parameters",
    "dedupe_named_tensors",
    "group_named_tensors",
    "has_no_values",
    "is_flat_shard",
    "keep_sharded_parameters",
    "local_sq_norms",
    "optimized_ids",
    "reduce_sq_norms",
    "sharding_groups",
    "stored_values",
    "sums_by_group",
    "unwrap_model",
]

# Module-path components that wrappers insert between the user's model and its parameters:
# DDP / DataParallel / Accelerate (``module``, only as a leading component), torch.compile
# (``_orig_mod``), FSDP1 (``_fsdp_wrapped_module``), activation checkpointing
# (``_checkpoint_wrapped_module``), Lightning's strategy wrapper (``_forward_module``).
WRAPPER_PREFIXES: tuple[str, ...] = ("module", "_orig_mod", "_forward_module")
_WRAPPER_COMPONENTS = frozenset(
    {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module"}
)

_CPU_ROW = 1024
# Tensors below this many elements are normed whole, all in one ``_foreach_norm`` call.
_CPU_SMALL = 8 * _CPU_ROW


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP / DataParallel / ``torch.compile`` wrappers."""
    for _ in range(16):
        inner = None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            inner = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            inner = model._orig_mod
        if inner is None:
            return model
        model = inner
    return model


def canonical_name(name: str) -> str:
    """The parameter's name in the original module: wrapper components removed.

    ``module._orig_mod.layers.0.weight`` -> ``layers.0.weight``;
    ``layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.weight`` -> ``layers.0.weight``.
    A ``module`` component is only removed at the front (it can be a real submodule name).
    """
    parts = name.split(".")
    while len(parts) > 1 and parts[0] in WRAPPER_PREFIXES:
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_COMPONENTS)


def canonical_named_parameters(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """Every parameter of ``model`` under its canonical names (a tied one under each)."""
    return [(canonical_name(n), p) for n, p in model.named_parameters(remove_duplicate=False)]


def has_no_values(tensor: Any) -> bool:
    """Whether ``tensor`` has no values to read yet: on the ``meta`` device (deferred
    initialisation never materialised) or a lazy module's ``UninitializedParameter`` (its
    first forward has not run; even ``numel()`` raises). Such a parameter keeps its identity
    when it materialises, so callers leave it out until then."""
    return tensor.is_meta or is_lazy(tensor)


def is_flat_shard(tensor: Any) -> bool:
    """Whether ``tensor`` is an FSDP1 flat shard: a ``FlatParameter`` (``_is_flat_param``) or,
    under ``use_orig_params=True``, an original parameter viewing its piece of one
    (``_fsdp_flattened``, torch's ``_set_fsdp_flattened``): this rank's part, not a whole
    tensor."""
    return bool(
        getattr(tensor, "_is_flat_param", False) or getattr(tensor, "_fsdp_flattened", False)
    )


def keep_sharded_parameters(
    named: Sequence[tuple[str, Any]], before: dict[str, Any], optimized: set[int]
) -> list[tuple[str, Any]]:
    """``named`` (name, parameter) with, under a name whose registered tensor is not the one
    found there ``before``, the earlier one kept when it is a ``DTensor`` the optimizers hold
    (``optimized``: their parameters' ids) and the new one is in no optimizer.

    FSDP2 registers its unsharded parameters in place of the sharded ``DTensor`` s from
    forward to backward, and after backward too under ``set_reshard_after_backward(False)``
    (gradient accumulation): at the optimizer step the registered ones have no gradient, while
    the sharded ones hold the gradients and are what the optimizer updates. A parameter a user
    put in place of another is taken (given to an optimizer or not: the model computes with
    it), and so is one added during the run (a LoRA adapter)."""
    out = []
    for name, p in named:
        old = before.get(name)
        if (
            old is not None
            and old is not p
            and id(p) not in optimized
            and id(old) in optimized
            and local_tensor(old) is not old
        ):
            p = old
        out.append((name, p))
    return out


def optimized_ids(optimizers: Iterable[Any]) -> set[int]:
    """The ids of the parameters ``optimizers`` update."""
    return {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}


def _memory_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    # DTensors are deduplicated by identity only: the aliasing of local shards could differ
    # between ranks, and every rank must keep the same list (the collectives depend on it).
    if local_tensor(tensor) is not tensor:
        return None
    local = tensor
    if has_no_values(local) or local.numel() == 0:
        return None
    try:
        ptr = local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (
        str(local.device),
        ptr,
        local.storage_offset(),
        tuple(local.shape),
        tuple(local.stride()),
        local.dtype,
    )


def dedupe_named_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """Drop repeats: the same tensor object, or a plain tensor viewing exactly the same memory
    (same storage, offset, shape, stride and dtype) as an earlier one. The first name wins."""
    return [(name, tensor) for name, tensor, _ in group_named_tensors(named)]


def group_named_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor, tuple[str, ...]]]:
    """:func:`dedupe_named_tensors` with, for each tensor kept, every name it goes by (its
    first name, then the names of its repeats: ``lm_head.weight`` of an embedding tied to
    ``embed_tokens.weight``)."""
    by_id: dict[int, list[str]] = {}
    by_memory: dict[tuple[Any, ...], list[str]] = {}
    out: list[tuple[str, torch.Tensor, list[str]]] = []
    for name, tensor in named:
        names = by_id.get(id(tensor))
        if names is None:
            key = _memory_key(tensor)
            names = None if key is None else by_memory.get(key)
            if names is None:
                names = []
                out.append((name, tensor, names))
                if key is not None:
                    by_memory[key] = names
            by_id[id(tensor)] = names
        if name not in names:
            names.append(name)
    return [(name, tensor, tuple(names)) for name, tensor, names in out]


def sharding_groups(tensor: torch.Tensor) -> tuple[Any, ...]:
    """The groups a per-tensor sum of squares of ``tensor`` must be summed over: its ``Shard``
    (and ``_StridedShard``) mesh dims, never ``Replicate`` nor ``Partial`` ones (see
    :func:`local_sq_norms` for ``Partial``)."""
    return shard_groups(tensor, include_partial=False)


@torch.no_grad()  # no autograd records, and no per-tensor detach() needed
def local_sq_norms(
    tensors: Sequence[torch.Tensor | None], device: torch.device | None = None
) -> torch.Tensor:
    """Per-tensor sums of squares of the rank-local data, as one float64 vector.

    ``None`` entries (parameters without a gradient) give 0. The result lives on ``device``
    (default: the device of the first tensor, CPU when there is none); nothing is read back to
    the host (the results' index goes to the device in one pinned, non-blocking copy: from
    pageable memory CUDA made it wait for the queued backward).

    A ``Partial`` DTensor's logical value is the sum of its local tensors, whose squares do not
    sum: such tensors are first summed elementwise over their partial groups (one collective per
    distinct group, only when some tensor is ``Partial``; every rank has the same placements).
    A rank-local failure before those collectives (out of memory) still joins them, with a
    flag, and raises after them: no rank is left waiting, and on the other ranks the
    ``Partial`` tensors' entries are ``-inf`` ("not measured": their values lack a part).
    """
    partials = _partial_plan(tensors)  # host metadata only; the same on every rank
    failure: Exception | None = None
    try:
        locals_: list[torch.Tensor | None] = [
            None if t is None else _real_view(local_tensor(t)) for t in tensors
        ]
    except Exception as exc:
        # Rank-local (say, out of memory): this rank still joins the Partial collectives,
        # with a "failed" flag, and raises after them, so that no rank waits in them.
        failure, locals_ = exc, []
    unmeasured = _resolve_partials(tensors, partials, locals_, failed=failure is not None)
    if failure is not None:
        raise failure
    locals_ = [None if t is None else _real_view(stored_values(t)) for t in locals_]
    if device is None:
        device = next((t.device for t in locals_ if t is not None), torch.device("cpu"))
    out = torch.zeros(len(locals_), dtype=torch.float64, device=device)
    # CPU tensors go together (_cpu_sq_norms handles any mix). On an accelerator one
    # ``_foreach_norm`` call per (device, dtype, contiguous or not): its fused kernel takes
    # only a list of one dtype whose tensors are all dense (contiguous ones are), and any
    # other list falls back to one ``linalg.vector_norm`` per tensor (one launch each);
    # torch's ``clip_grad_norm_`` groups by device and dtype alike.
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(locals_):
        if t is not None and t.numel() > 0:
            if _row_kernel(t.device):
                key: tuple[Any, ...] = (t.device,)
            else:
                key = (t.device, t.dtype, t.is_contiguous())
            groups.setdefault(key, []).append(i)
    order: list[int] = []
    values: list[torch.Tensor] = []
    for key, idx in groups.items():
        group = [locals_[i] for i in idx]
        if _row_kernel(key[0]):
            sq = _cpu_sq_norms(group)  # type: ignore[arg-type]
        else:
            norms = torch._foreach_norm(group, 2, dtype=torch.float64)  # type: ignore[arg-type]
            sq = torch.stack(norms).square()
        order += idx
        values.append(sq.to(device))
    if order:  # (one index for every group: one host-to-device copy)
        out.index_copy_(0, index_on(order, device), torch.cat(values))
    for idx, flag in unmeasured:
        # a Partial tensor some rank could not contribute to: "not measured" (-inf), which is
        # what that rank's caller reports for all of its tensors
        index = index_on(idx, device)
        marked = torch.where(flag.to(device) > 0, -math.inf, out.index_select(0, index))
        out.index_copy_(0, index, marked)
    return out


def _row_kernel(device: torch.device) -> bool:
    """Whether tensors on ``device`` are normed by :func:`_cpu_sq_norms` (CPU), rather than by
    ``torch._foreach_norm`` with float64 output."""
    return device.type == "cpu"


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def stored_values(tensor: torch.Tensor) -> torch.Tensor:
    """A sparse tensor's stored values, each element once, as a strided tensor (the tensor
    itself when it is strided): the norm, and with the implicit zeros the moments, of a sparse
    gradient (``nn.Embedding(sparse=True)``), which has no norm or moment kernel of its own.
    A COO gradient is coalesced first: it usually repeats indices (one entry per looked-up
    token) and the squares of the parts do not sum to the square of the sum.
    """
    if tensor.layout == torch.sparse_coo:
        return tensor.coalesce().values()
    if tensor.layout in _COMPRESSED:
        return tensor.values()
    return tensor


def _real_view(tensor: torch.Tensor) -> torch.Tensor:
    """A strided complex tensor as real numbers (``[..., 2]``: real and imaginary parts), whose
    sum of squares is the complex one's (``|z|**2 = re**2 + im**2``); other tensors as they are.
    Without it the conversion to float32 below drops the imaginary parts."""
    if tensor.is_complex() and tensor.layout == torch.strided:
        return torch.view_as_real(tensor.resolve_conj())
    return tensor


@dataclass
class _PartialItem:
    index: int  # position in the tensors
    groups: tuple[Any, ...]  # its Partial mesh dims' groups
    average: bool  # reduce_op "avg": the logical value is the mean of the local tensors
    numel: int  # elements of its real view


def _partial_plan(tensors: Sequence[torch.Tensor | None]) -> list[_PartialItem]:
    """The ``Partial`` DTensors among ``tensors``, from host metadata only (placements, local
    shapes): nothing here allocates, so every rank gets the same plan, and an unsupported
    ``reduce_op`` raises on every rank before any collective."""
    plan = []
    for i, t in enumerate(tensors):
        groups = () if t is None else partial_groups(t)
        if not groups:
            continue
        ops = {str(getattr(p, "reduce_op", "sum")) for p in t.placements if p.is_partial()}
        if not ops <= {"sum", "avg"}:
            raise ValueError(f"cannot take the norm of a Partial DTensor with reduce_op {ops}")
        local = local_tensor(t)
        numel = local.numel() * (2 if local.is_complex() else 1)
        plan.append(_PartialItem(i, groups, "avg" in ops, numel))
    return plan


def _resolve_partials(
    tensors: Sequence[torch.Tensor | None],
    plan: list[_PartialItem],
    locals_: list[torch.Tensor | None],
    *,
    failed: bool,
) -> list[tuple[list[int], torch.Tensor]]:
    """Replace each ``Partial`` local tensor in ``locals_`` by its logical value (the sum, or
    mean, over its partial groups), one collective per distinct group.

    Every rank issues the same collectives whatever fails on it: a rank that could not build
    its inputs (``failed``, or an error here) sends zeros and a "failed" flag, one element
    added to each group's collective. Returns, per pattern of groups, the positions of its
    tensors and the summed flags (> 0: some rank failed, the values are incomplete), without
    a host sync; the caller marks those tensors "not measured".
    """
    if not plan:
        return []
    device = local_tensor(tensors[plan[0].index]).device  # type: ignore[arg-type]
    failure: Exception | None = None
    values: list[torch.Tensor] = []
    if not failed:
        try:
            values = [locals_[item.index].to(torch.float64) for item in plan]  # type: ignore[union-attr]
        except Exception as exc:  # rank-local (out of memory): join the collectives below
            failure, values = exc, []
    broken = failed or failure is not None
    if broken:
        # (placeholders of the collective's size: should even they not fit, nothing is left
        # to send and the other ranks wait, as before)
        values = [torch.zeros(item.numel, dtype=torch.float64, device=device) for item in plan]
    patterns: dict[tuple[int, ...], tuple[tuple[Any, ...], list[int]]] = {}
    for k, item in enumerate(plan):
        patterns.setdefault(tuple(id(g) for g in item.groups), (item.groups, []))[1].append(k)
    groups = unique_by_identity(g for item in plan for g in item.groups)
    flag = torch.full((1,), float(broken), dtype=torch.float64, device=device)
    items = [(v, item.groups) for v, item in zip(values, plan, strict=True)]
    reduced = all_reduce_by_groups(items + [(flag, (g,)) for g in groups], "sum")
    if failure is not None:
        raise failure
    if broken:
        return []  # the caller raises: all of this rank's values are "not measured"
    flags = {id(g): f for g, f in zip(groups, reduced[len(plan) :], strict=True)}
    for item, value in zip(plan, reduced[: len(plan)], strict=True):
        if item.average:
            for g in item.groups:
                value = value / group_size(g)
        locals_[item.index] = value
    unmeasured = []
    for pattern, members in patterns.values():
        failed_ranks = torch.stack([flags[id(g)] for g in pattern]).sum()
        unmeasured.append(([plan[k].index for k in members], failed_ranks))
    return unmeasured


def _cpu_sq_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    # A large tensor is viewed as rows of _CPU_ROW elements (no copy) and normed row by row in
    # float32, and the rows' squares are summed per tensor in float64:
    # a row is short enough for float32 accumulation to stay exact to ~1e-7 (torch's CPU norm
    # accumulates a row sequentially: ~1e-4 relative at 5M elements, measured), and the dim-1
    # reduction runs at the speed of one ``torch.sum`` pass over memory (3.3 ms for 26M floats
    # on 2 threads, measured; ``_foreach_norm`` over 32K pieces: 5.5 ms and 4.6e-5 relative
    # error when over whole tensors, ``dtype=torch.float64``: 13x slower). Small tensors
    # (below _CPU_SMALL elements: biases, norm weights; <5e-7 relative in float32 at that
    # length, measured) and the tails of large ones go through one ``_foreach_norm``, so they
    # cost no per-tensor operation. Low-precision tensors are converted to float32 first (a temporary copy of
    # one tensor at a time).
    row_norms: list[torch.Tensor] = []
    row_owner: list[int] = []
    row_counts: list[int] = []
    pieces: list[torch.Tensor] = []
    piece_owner: list[int] = []
    norm = torch.linalg.vector_norm
    for i, t in enumerate(tensors):
        dtype = t.dtype
        n = t.numel()
        if n < _CPU_SMALL or dtype == torch.float64:  # float64: exact enough as it is
            pieces.append(t if dtype in (torch.float32, torch.float64) else t.float())
            piece_owner.append(i)
            continue
        c = n // _CPU_ROW
        if dtype == torch.float32 and n == c * _CPU_ROW and t.is_contiguous():
            body = t.view(c, _CPU_ROW)  # the common case: whole rows, one view, no slicing
        else:
            flat = t.reshape(-1)
            if dtype != torch.float32:
                flat = flat.float()
            body = flat[: c * _CPU_ROW].view(c, _CPU_ROW)
            if n > c * _CPU_ROW:
                tail = flat[c * _CPU_ROW :]
                if flat.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
                    # a view of a temporary copy (a low-precision or non-contiguous tensor)
                    # would keep the whole copy alive until every tensor is measured
                    tail = tail.clone()
                pieces.append(tail)
                piece_owner.append(i)
        row_norms.append(norm(body, 2, 1))
        row_owner.append(i)
        row_counts.append(c)
    out = torch.zeros(len(tensors), dtype=torch.float64)
    if row_norms:
        sq = torch.cat(row_norms).double().square_()
        # per-tensor sums of consecutive rows: one segmented reduction (3x cheaper than an
        # index built with repeat_interleave and index_add_)
        per_tensor = torch.segment_reduce(sq, "sum", lengths=torch.tensor(row_counts))
        out.index_add_(0, torch.tensor(row_owner), per_tensor)
    if pieces:
        sq = torch.stack(torch._foreach_norm(pieces, 2)).double().square_()
        out.index_add_(0, torch.tensor(piece_owner), sq)
    _redo_out_of_float32_range(tensors, out)
    return out


# Below this many times its element count, a float32 sum of squares may have lost more than
# ~1e-7 of itself to subnormal squares (elements below ~1e-19; half a subnormal step,
# 7e-46, lost per element at most).
_F32_SUBNORMAL_SQ = 1.5e-38


def _redo_out_of_float32_range(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    """Redo in float64 the sums of squares that float32 could not hold: ``inf`` from a finite
    tensor (elements above ~1.8e19, or a 1024-element row above ~5.8e17: the squares overflow),
    and the tiny ones (elements below ~1e-19, whose squares are subnormal or 0 in float32: a
    tensor of elements below ~1e-23 reads 0). torch's own norms share both limits
    (``clip_grad_norm_`` returns ``inf`` for such a gradient), but a finite gradient is not
    a NaN/Inf one, and a float64 sum holds either. Rare, so the float64 pass costs nothing
    on ordinary steps: one comparison over the per-tensor vector (CPU: no device sync), and
    an ``any()`` pass over an all-zero tensor. A tensor holding Inf is ``inf`` again."""
    limit = torch.tensor([t.numel() * _F32_SUBNORMAL_SQ for t in tensors], dtype=torch.float64)
    suspect = (out == math.inf) | (out < limit)
    if not bool(suspect.any()):
        return
    norm = torch.linalg.vector_norm
    for i in suspect.nonzero().flatten().tolist():
        t = tensors[i]
        if t.dtype == torch.float64 or (out[i] == 0 and not bool(t.any())):
            continue  # float64 already, or truly zero
        out[i] = norm(t, 2, dtype=torch.float64).square()


def reduce_sq_norms(sq_norms: torch.Tensor, groups: Sequence[tuple[Any, ...]]) -> torch.Tensor:
    """Sum entry ``i`` of ``sq_norms`` over the groups ``groups[i]`` (``()``: not reduced).

    Entries sharing a group travel in one coalesced collective per distinct group, whatever the
    number of entries; with no non-trivial group nothing is issued. Every rank must pass the
    same structure (same length, same group pattern), which holds when ranks iterate the same
    model's parameters in the same order.
    """
    if len(groups) != sq_norms.numel():
        raise ValueError(
            f"groups must have one entry per sum of squares ({sq_norms.numel()}), got {len(groups)}"
        )
    patterns: dict[tuple[int, ...], tuple[tuple[Any, ...], list[int]]] = {}
    for i, gs in enumerate(groups):
        if gs:
            patterns.setdefault(tuple(id(g) for g in gs), (gs, []))[1].append(i)
    if not patterns:
        return sq_norms
    items = []
    indices = []
    for gs, idx in patterns.values():
        index = index_on(idx, sq_norms.device)
        items.append((sq_norms.index_select(0, index), gs))
        indices.append(index)
    reduced = all_reduce_by_groups(items, "sum", dtype=torch.float64)
    out = sq_norms.clone()
    for index, values in zip(indices, reduced, strict=True):
        out.index_copy_(0, index, values.to(out.device))
    return out


def sums_by_group(
    rows: torch.Tensor, index: torch.Tensor, size: int, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum the columns of ``rows`` (``[k, n]``, one column per tensor) into ``size`` groups:
    column ``j`` goes to group ``index[j]`` (``size`` or more: no group). Returns ``[k, size]``
    float64 sums, and with ``mask`` (bool per column) those of the masked columns apart:
    ``(unmasked, masked)``. On the device: no host sync."""
    rows = rows.to(torch.float64)
    k = rows.shape[0]
    index = index.to(rows.device).clamp(max=size)  # (the spare column ``size`` is dropped)
    out = torch.zeros(k, size + 1, dtype=torch.float64, device=rows.device)
    if mask is None:
        return out.index_add_(1, index, rows)[:, :size], None
    mask = mask.to(rows.device)
    zero = torch.zeros((), dtype=torch.float64, device=rows.device)
    # (where, not a product: a NaN or -inf of the other kind must not leak into a sum)
    masked = torch.zeros_like(out).index_add_(1, index, torch.where(mask, rows, zero))
    out.index_add_(1, index, torch.where(mask, zero, rows))
    return out[:, :size], masked[:, :size]
