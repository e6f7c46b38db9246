"""Process groups and the coalesced collectives every reduction in trainvitals goes through.

No other module calls ``torch.distributed`` collectives. Every helper here:

* is a no-op (returns its input) when ``torch.distributed`` is not initialised or the group has
  one member, so single-process runs pay nothing;
* flattens all tensors of one call into one buffer and issues exactly one collective, whatever
  the number of tensors (the design's "at most one collective per reduction kind per group");
* counts the collectives it issues in :data:`collective_counter`, so tests and benchmarks can
  check that count;
* carries one extra element, a "missing" mark, so that a rank whose callback failed part-way
  through a step can still take part in the step's remaining collectives
  (:func:`replay_missing`) and the other ranks learn that this step's values are incomplete
  (:class:`PeerRankFailed`) instead of waiting forever or pairing this step's collective with
  the failed rank's next one.

A group argument of ``None`` means "no group": nothing to reduce over (not the world group,
which would silently multiply replicated values by the world size, the review bug of
Megatron-LM PR #5492). Pass :func:`world_group` explicitly for the world.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import math
import pickle
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
import torch.distributed as dist

ReduceOpName = Literal["sum", "avg", "max", "min"]

_OPS = ("sum", "avg", "max", "min")

# Number of collectives issued, per op kind ("all_reduce", "all_gather", "all_gather_object").
collective_counter: collections.Counter[str] = collections.Counter()

# Longest wait of :func:`_let_worker_release` (normally microseconds): it never hangs a run,
# and after one wait this long it is turned off for the process.
_RELEASE_TIMEOUT_S = 1.0
_release_wait_off = False


class PeerRankFailed(RuntimeError):
    """A collective reached with a "missing" mark from another rank: that rank's callback
    failed earlier in the same hook and issued the rest of its collectives through
    :func:`replay_missing`. Raised on the other ranks, after the collective, where the mark can
    be read without a host sync: always for :func:`all_gather_objects`, and for CPU (gloo)
    tensor collectives. On accelerators tensor results are set to NaN instead ("not
    measured"; floating dtypes)."""


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as issued by the helpers below: what :func:`replay_missing` needs to
    issue the same collective again (``numel``: elements of the flattened inputs, without the
    mark and the NaN flags of MAX/MIN)."""

    kind: Literal["all_reduce", "all_gather", "all_gather_object"]
    group: Any
    numel: int = 0
    dtype: torch.dtype | None = None
    op: str = "sum"


# The calls issued inside :func:`recording_collectives` (None outside), and whether the
# helpers are replaying for a failed callback (they send the mark and never raise).
_journal: list[CollectiveCall] | None = None
_replaying = False


@contextlib.contextmanager
def recording_collectives() -> Iterator[list[CollectiveCall]]:
    """Collect the :class:`CollectiveCall` of every collective issued inside the block (the
    callback guard records each hook, to complete a failed call's collectives later)."""
    global _journal
    outer, calls = _journal, []
    _journal = calls
    try:
        yield calls
    finally:
        _journal = outer


def replay_missing(calls: Sequence[CollectiveCall]) -> None:
    """Issue ``calls`` with the "missing" mark and placeholder values: the collectives a
    callback that failed part-way would have issued (the rest of the same hook's calls at the
    previous step with the same collectives). Every other member of each group gets
    :class:`PeerRankFailed` (or NaN results on accelerators) from it, so no rank waits and
    no result mixes this step with the next."""
    global _replaying
    _replaying = True
    try:
        for call in calls:
            if call.kind == "all_gather_object":
                all_gather_objects(None, call.group)
                continue
            placeholder = torch.zeros(call.numel, dtype=call.dtype)
            if call.kind == "all_reduce":
                all_reduce_coalesced([placeholder], call.op, call.group, dtype=call.dtype)  # type: ignore[arg-type]
            else:
                all_gather_coalesced([placeholder], call.group, dtype=call.dtype)
    finally:
        _replaying = False


def _record(call: CollectiveCall) -> None:
    if _journal is not None:
        _journal.append(call)


def _mark(device: torch.device, dtype: torch.dtype, op: str = "sum") -> torch.Tensor:
    """The mark element: 1 when replaying (-1 under MIN, so that it survives the reduction),
    else 0; any non-zero result means some member was missing."""
    value = (-1 if op == "min" else 1) if _replaying else 0
    return torch.full((1,), value, dtype=dtype, device=device)


def _check_mark(
    flags: torch.Tensor, values: torch.Tensor, what: str, *, host: bool | None = None
) -> torch.Tensor:
    """``values`` as they are when every ``flags`` entry is 0. Otherwise, unless this rank is
    the one replaying: raise :class:`PeerRankFailed` when the flags are on the host (``host``,
    by default whether they are on the CPU: reading them is free there), or set ``values`` to
    NaN on an accelerator (no host sync; floating dtypes only)."""
    if _replaying:
        return values
    if flags.device.type == "cpu" if host is None else host:
        if bool(flags.any()):
            raise _peer_failed(what)
        return values
    if values.is_floating_point():
        return torch.where(flags.any(), math.nan, values)
    return values


def _peer_failed(what: str) -> PeerRankFailed:
    return PeerRankFailed(
        f"another rank took part in this {what} with a 'missing' mark (its callback failed "
        "earlier in the same hook or state_dict); its values are left out"
    )


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_group() -> Any:
    """The default (world) process group, or ``None`` when not distributed."""
    return dist.group.WORLD if is_distributed() else None


def group_size(group: Any) -> int:
    if group is None or not is_distributed():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    if group is None or not is_distributed():
        return 0
    return dist.get_rank(group)


def _member_group_size(group: Any, what: str) -> int:
    """:func:`group_size`, or a ``ValueError`` when this rank is not a member of ``group``
    (``dist.new_group`` returns such a group to the ranks it leaves out: its size reads -1,
    and torch skips a collective on it with a warning), raised on this rank only, before any
    collective (the members do not wait for it)."""
    size = group_size(group)
    if size < 1:
        raise ValueError(
            f"{what}: rank {dist.get_rank()} is not a member of the group passed; pass a group "
            "holding this rank (every rank its own group of the layout)"
        )
    return size


def global_rank() -> int:
    """Global rank: from torch.distributed when initialised, else the launcher's RANK env var."""
    if is_distributed():
        return dist.get_rank()
    import os

    return int(os.environ.get("RANK", "0"))


def launch_rank() -> int | None:
    """This process's global rank as far as it can be told now; ``None`` when it is known
    only not to be rank 0.

    The process group's rank when it is initialised. Before that, the launcher's environment:

    * ``RANK`` (torchrun, Accelerate, DeepSpeed set it);
    * else, when ``WORLD_SIZE`` is above 1, Lightning's own launcher, which sets
      ``LOCAL_RANK`` and ``NODE_RANK`` (or ``GROUP_RANK``) but not ``RANK``: its global rank is
      ``NODE_RANK * processes per node + LOCAL_RANK`` (Lightning's strategies), and processes
      per node is not in the environment. So a non-zero ``LOCAL_RANK`` on node 0 is the rank
      itself, and on another node the rank is unknown (``None``) but not 0;
    * else 0. A single process (no ``WORLD_SIZE`` above 1) is rank 0 whatever else its
      environment holds: a ``LOCAL_RANK`` left over, or ``SLURM_PROCID`` of one task of a
      SLURM sweep (each task its own run), would otherwise silence it. (A multi-process
      SLURM job's processes deliver after their process group exists: its rank then.)
    """
    if is_distributed():
        return dist.get_rank()
    import os

    def read(name: str) -> int | None:
        value = os.environ.get(name, "").strip()
        return int(value) if value.lstrip("-").isdigit() else None

    rank = read("RANK")
    if rank is not None:
        return rank
    if (read("WORLD_SIZE") or 1) > 1:
        local = read("LOCAL_RANK") or 0
        node = read("NODE_RANK")
        node = read("GROUP_RANK") if node is None else node
        if local > 0 or (node or 0) > 0:  # not the first process of the first node
            return local if not node else None
    return 0


def _torch_op(op: str) -> dist.ReduceOp:
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    op: ReduceOpName = "sum",
    group: Any = None,
    *,
    dtype: torch.dtype | None = torch.float64,
) -> list[torch.Tensor]:
    """All-reduce ``tensors`` over ``group`` in one collective.

    The tensors are flattened into one buffer of ``dtype`` (float64 by default, so sums of many
    float32 values and integer counts up to 2**53 stay exact; ``None``: the inputs' common
    dtype, a ``ValueError`` when they differ), reduced, and split back into tensors of the
    original shapes, in ``dtype``. ``avg`` is a sum divided by the group size (gloo has no
    AVG) and needs a floating ``dtype``. A floating ``dtype`` narrower than float32 (float16,
    bfloat16) is summed (``sum``, ``avg``) as float32 and the result cast back once: in its own
    dtype the sum overflowed (four float16 30000.0 averaged to inf) and was rounded at each
    step of the reduction. A ``group`` this rank is not a member of: ``ValueError`` on this
    rank, before any collective. ``max``/``min`` return NaN where any rank has NaN, as
    ``torch.amax``/``amin`` of the stacked inputs do. Returns new tensors; the inputs are not
    modified.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")
    tensors = list(tensors)
    if not tensors:
        return []
    dtype = _buffer_dtype(tensors, dtype, "all_reduce_coalesced")
    if op == "avg" and not dtype.is_floating_point:
        # raised on every rank before the collective (an in-place division of an integer
        # buffer raised after it, on multi-rank runs only)
        raise ValueError(f"all_reduce_coalesced: op 'avg' needs a floating dtype, got {dtype}")
    size = _member_group_size(group, "all_reduce_coalesced")
    if size == 1:
        # Always new tensors, as promised: callers may modify the result in place.
        return [t.detach().to(dtype=dtype, copy=True) for t in tensors]
    device = _collective_device(group, tensors[0].device)
    # bool and unsigned buffers cannot carry MIN's mark (-1) and would lose it (min(0, 255)
    # is 0), and an 8-bit SUM of the marks wraps to 0 at 256 replaying ranks: those are reduced
    # as int64, exact for their values (cast back, a sum wraps as the dtype's own sum would)
    narrow = dtype.itemsize == 1 or (op == "min" and not dtype.is_signed)
    wire = torch.int64 if narrow and not dtype.is_floating_point else dtype
    if dtype.is_floating_point and dtype.itemsize < 4 and op in ("sum", "avg"):
        # float16's max is 65504: the sum of an average overflows where the average fits
        wire = torch.float32
    # values become ``dtype`` first, then the wire's int64: cast straight to int64, a float
    # 0.5 asked for as bool was 0 (False), an int 200 asked for as int8 won a MAX over 5
    # (it is -56 in int8), and -1 and 1 as bool summed to 0 (False)
    parts = [t.detach().reshape(-1).to(device=device, dtype=dtype).to(wire) for t in tensors]
    numel = sum(p.numel() for p in parts)
    # gloo's MAX/MIN keep a NaN only when it is already in the accumulator (a NaN of the last
    # rank is dropped: measured), so a "not measured" NaN would turn into another rank's
    # value: carry "NaN here" per element (+1 under MAX, -1 under MIN) in the same collective
    nan_flags = op in ("max", "min") and dtype.is_floating_point
    if nan_flags:
        isnan = torch.cat(parts).isnan().to(wire)
        parts.append(isnan if op == "max" else -isnan)
    buffer = torch.cat([*parts, _mark(device, wire, op)])
    uses = _use_count(buffer)
    dist.all_reduce(buffer, op=_torch_op("sum" if op == "avg" else op), group=group)
    _let_worker_release([(buffer, uses)])
    collective_counter["all_reduce"] += 1
    _record(CollectiveCall("all_reduce", group, numel, dtype, op))
    values = _check_mark(buffer[-1:], buffer[:numel], "all_reduce")
    if nan_flags:
        values = torch.where(buffer[numel:-1] != 0, math.nan, values)
    if op == "avg":
        values /= size
    out = []
    offset = 0
    for t in tensors:
        n = t.numel()
        out.append(values[offset : offset + n].view(t.shape).to(t.device, dtype))
        offset += n
    return out


def _buffer_dtype(tensors: list[torch.Tensor], dtype: torch.dtype | None, what: str) -> torch.dtype:
    """``dtype``, or for ``None`` the inputs' one dtype: one buffer of the first tensor's
    dtype would silently round the others (an int64 count above 2**24 through float32)."""
    if dtype is not None:
        return dtype
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(
            f"{what}: dtype=None needs tensors of one dtype, got {sorted(map(str, dtypes))}; "
            "pass the dtype of the buffer"
        )
    return tensors[0].dtype


def all_gather_coalesced(
    tensors: Sequence[torch.Tensor],
    group: Any = None,
    *,
    dtype: torch.dtype | None = torch.float64,
) -> list[torch.Tensor]:
    """Gather ``tensors`` from every member of ``group`` in one collective.

    Returns, for each input of shape ``S``, a tensor of shape ``[group_size, *S]`` whose row ``r``
    is rank ``r``'s value, in ``dtype`` (float64 by default: int64 values above 2**53 round;
    ``None``: the inputs' one dtype, a ``ValueError`` when they differ). Every rank must pass
    tensors of the same shapes (agree on them first with :func:`all_gather_objects` when they
    can differ). A ``group`` this rank is not a member of: ``ValueError`` (as
    :func:`all_reduce_coalesced`; :func:`all_gather_objects` too).
    """
    tensors = list(tensors)
    if not tensors:
        return []
    dtype = _buffer_dtype(tensors, dtype, "all_gather_coalesced")
    size = _member_group_size(group, "all_gather_coalesced")
    if size == 1:
        return [t.detach().to(dtype=dtype, copy=True).unsqueeze(0) for t in tensors]
    device = _collective_device(group, tensors[0].device)
    parts = [t.detach().reshape(-1).to(device=device, dtype=dtype) for t in tensors]
    rows = _gather_rows(torch.cat([*parts, _mark(device, dtype)]), group, size)
    collective_counter["all_gather"] += 1
    _record(CollectiveCall("all_gather", group, rows.shape[1] - 1, dtype))
    rows = _check_mark(rows[:, -1], rows[:, :-1], "all_gather")
    out = []
    offset = 0
    for t in tensors:
        n = t.numel()
        out.append(rows[:, offset : offset + n].reshape(size, *t.shape).to(t.device))
        offset += n
    return out


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Gather one picklable object from every member of ``group`` (one collective).

    Used before tensor collectives so that ranks agree on names and sizes instead of hanging on
    mismatched buffers. An object that cannot be pickled raises ``TypeError`` on every member,
    after the collective (raising before it on that rank alone would leave the others waiting).
    """
    size = _member_group_size(group, "all_gather_objects")
    if size == 1:
        return [obj]
    # torch.distributed.all_gather_object's protocol (sizes, then padded pickles), done here so
    # that its tensors get the release of _let_worker_release like every other collective.
    device = _collective_device(group, torch.device("cpu"))
    try:
        payload = pickle.dumps((_replaying, obj, None))
    except Exception as exc:  # PicklingError, TypeError, AttributeError (a lambda), ...
        payload = pickle.dumps((_replaying, None, f"{type(exc).__name__}: {exc}"))
    sizes = _gather_rows(torch.tensor([len(payload)], device=device), group, size)
    lengths: list[int] = sizes.view(-1).tolist()  # one read back, not one per rank
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    rows = _gather_rows(padded.to(device), group, size).cpu()
    collective_counter["all_gather_object"] += 1
    _record(CollectiveCall("all_gather_object", group))
    marked = [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]
    if not _replaying and any(missing for missing, _, _ in marked):  # on the host already
        raise _peer_failed("all_gather_object")
    failed = [(r, error) for r, (_, _, error) in enumerate(marked) if error is not None]
    if failed and not _replaying:  # a replaying rank goes on with the rest of its replay
        r, error = failed[0]
        raise TypeError(
            f"all_gather_objects: the object of rank {r} of the group cannot be pickled ({error})"
        )
    return [value for _, value, _ in marked]


def _gather_rows(local: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """``[size, n]``: row ``r`` is rank ``r``'s 1-d ``local`` (one blocking all_gather)."""
    gathered = torch.empty(size * local.numel(), dtype=local.dtype, device=local.device)
    uses = (_use_count(local), _use_count(gathered))
    # all_gather_single is the new name (torch >= 2.13 deprecates all_gather_into_tensor).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, local, group=group)
    _let_worker_release(list(zip((local, gathered), uses, strict=True)))
    return gathered.view(size, local.numel())


def _use_count(tensor: torch.Tensor) -> int:
    """References to the tensor's implementation (C++ holders and views included; 0 where
    this torch has no ``Tensor._use_count``, which turns :func:`_let_worker_release` off)."""
    count = getattr(tensor, "_use_count", None)
    return int(count()) if count is not None else 0


def _let_worker_release(tensors: Sequence[tuple[torch.Tensor, int]]) -> None:
    """After a blocking collective on CPU tensors, wait until the backend's worker thread has
    dropped its references to them (each ``(tensor, use count before the collective)``).

    Why: gloo runs a collective on a worker thread that lets go of the work, and with it of
    the tensors, a moment *after* waking the caller. Were the caller to free the tensors first,
    the worker would own the last reference and have to take the GIL to free their Python
    objects; if the interpreter is shutting down by then (the process group is still alive
    when a script ends: the model's DDP wrapper holds it), Python ends that thread inside a
    C++ frame and the process aborts with "terminate called without an active exception",
    after the job's work is done (seen as a rare SIGABRT of torchrun jobs: our worker's stack
    ended in ``ProcessGroupGloo::runLoop`` -> ``TensorImpl::decref_pyobject`` ->
    ``PyEval_AcquireThread``; pytorch/pytorch#190489, PR #179291). Waiting here makes the
    caller's release the last one, made with the GIL held. Normally the references are gone
    already or within microseconds; the wait is bounded by :data:`_RELEASE_TIMEOUT_S`, and
    turned off (with a warning) after a wait that long.
    CUDA tensors are not waited for (NCCL's watchdog frees its works asynchronously)."""
    global _release_wait_off
    if _release_wait_off:
        return
    deadline = None
    for tensor, uses in tensors:
        if tensor.device.type != "cpu":
            continue
        while _use_count(tensor) > uses:
            now = time.monotonic()
            if deadline is None:
                deadline = now + _RELEASE_TIMEOUT_S
            elif now > deadline:
                # something else keeps a reference (a debug wrapper?): waiting would cost this
                # much at every collective, so stop waiting for the rest of the process
                _release_wait_off = True
                warnings.warn(
                    "trainvitals: a collective's tensors stayed referenced by the backend for "
                    f"{_RELEASE_TIMEOUT_S} s; no longer waiting for their release",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
            time.sleep(1e-5)  # gives the worker the CPU


def _collective_device(group: Any, fallback: torch.device) -> torch.device:
    """gloo reduces CPU tensors, nccl CUDA tensors: pick the device the backend wants."""
    backend = dist.get_backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    if fallback.type == "cpu" and torch.cuda.is_available() and "nccl" in str(backend):
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


# --------------------------------------------------------------------------------------------
# DTensor placements


def shard_groups(tensor: torch.Tensor, *, include_partial: bool = True) -> tuple[Any, ...]:
    """The process groups of the mesh dims over which ``tensor`` (a DTensor) is sharded.

    A sum over a DTensor's elements is the local sum all-reduced over exactly these groups, one
    after the other; ``Replicate`` dims are left out so replicas are never counted twice. Every
    other placement is a shard: ``Shard`` and also ``_StridedShard`` (FSDP2 over a
    tensor-parallel dim; not a ``Shard`` subclass and ``is_shard()`` is False in recent torch).
    ``Partial`` placements are included by default (the logical tensor is the sum of the
    locals, so a *linear* sum of elements sums too); pass ``include_partial=False`` for
    nonlinear statistics such as sums of squares, and reduce the :func:`partial_groups` of the
    local data first. A plain tensor returns ``()``: it is either the whole tensor or a replica
    (DDP).
    """
    shards, partials = _placement_groups(tensor)
    return shards + partials if include_partial else shards


def partial_groups(tensor: torch.Tensor) -> tuple[Any, ...]:
    """The groups of the mesh dims where ``tensor`` (a DTensor) is ``Partial`` (``()`` if none):
    its logical value is the sum of the local tensors over these groups."""
    return _placement_groups(tensor)[1]


def _is_plain(tensor: Any) -> bool:
    """A plain tensor or Parameter, certainly not a DTensor (a Parameter made from a DTensor
    keeps the DTensor type). The callbacks ask about every parameter and gradient at every
    logging step: this answers without the DTensor import look-ups."""
    return type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter


def replicate_groups(tensor: torch.Tensor) -> tuple[Any, ...]:
    """The groups of the mesh dims where ``tensor`` (a DTensor) is ``Replicate`` (``()`` if
    none, or a plain tensor): every rank of such a group holds the same values."""
    if _is_plain(tensor) or not callable(getattr(tensor, "to_local", None)):
        return ()
    return groups_by_placement(tensor.device_mesh, tensor.placements)[2]


def _placement_groups(tensor: torch.Tensor) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    if _is_plain(tensor):
        return (), ()
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - very old torch
        return (), ()
    if not isinstance(tensor, DTensor):
        return (), ()
    # (every parameter and gradient at every logging step: no group look-up for Replicate dims)
    shards, partials, _ = groups_by_placement(tensor.device_mesh, tensor.placements, replicas=False)
    return shards, partials


def groups_by_placement(
    mesh: Any, placements: Sequence[Any], *, replicas: bool = True
) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
    """(shard, partial, replicate) groups of a DTensor layout: each mesh dim's group, by its
    placement (``replicas=False``: the replicate groups are not looked up, ``()``). Every
    placement other than ``Partial`` and ``Replicate`` is a shard (``Shard``,
    ``_StridedShard``, ...)."""
    from torch.distributed.tensor.placement_types import Partial, Replicate

    found: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
    for dim, placement in enumerate(placements):
        kind = 2 if isinstance(placement, Replicate) else 1 if isinstance(placement, Partial) else 0
        if kind == 2 and not replicas:
            continue
        found[kind].append(mesh.get_group(dim) if mesh.ndim > 1 else mesh.get_group())
    return tuple(found[0]), tuple(found[1]), tuple(found[2])


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a DTensor (the tensor itself otherwise)."""
    if _is_plain(tensor):
        return tensor
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def all_reduce_by_groups(
    items: Sequence[tuple[torch.Tensor, tuple[Any, ...]]],
    op: ReduceOpName = "sum",
    *,
    dtype: torch.dtype = torch.float64,
) -> list[torch.Tensor]:
    """Reduce each tensor over its own tuple of groups, with one collective per distinct group.

    ``items`` pairs a tensor with the groups it must be reduced over (typically
    :func:`shard_groups` of the DTensor it came from). All tensors that need a group of the
    same ranks (and backend) are reduced in one coalesced collective, on the first such group
    object: two equal meshes built separately (``init_device_mesh`` twice) have different group
    objects for the same ranks, and cost no second collective. Groups are processed in a fixed
    order (first appearance) so every rank issues the same sequence. A tensor is reduced once
    per distinct group, however often its tuple names it. ``avg`` is not allowed (an average
    over a sequence of groups is rarely what is meant); use ``sum`` and divide.
    """
    if op == "avg":
        raise ValueError("all_reduce_by_groups supports sum, max and min, not avg")
    results = [t.detach().to(dtype) for t, _ in items]
    # Order groups by first appearance: the same on every rank because ranks iterate the same
    # parameters in the same order. Every member of a group sees the same groups coincide
    # (they are the same rank set on each of them), so all pick the same group object.
    memo: dict[int, Any] = {}
    keyed = [{group_key(g, memo) for g in groups} for _, groups in items]
    first: dict[Any, Any] = {}
    for _, groups in items:
        for g in groups:
            first.setdefault(group_key(g, memo), g)
    for key, g in first.items():
        idx = [i for i, keys in enumerate(keyed) if key in keys]
        reduced = all_reduce_coalesced([results[i] for i in idx], op, g, dtype=dtype)
        for i, r in zip(idx, reduced, strict=True):
            results[i] = r
    return results


def group_key(group: Any, memo: dict[int, Any] | None = None) -> Any:
    """What a collective on ``group`` reduces over: its backend and sorted global ranks, read
    from the local group table (no collective; ``memo`` caches it per object for one call).
    Objects that are not process groups this rank can look up key by identity."""
    if memo is None:
        memo = {}
    key = memo.get(id(group))
    if key is None:
        try:
            if group is None or not is_distributed():
                raise TypeError("no group")
            ranks = tuple(sorted(dist.get_process_group_ranks(group)))
            key = ("ranks", str(dist.get_backend(group)), ranks)
        except Exception:
            key = ("id", id(group))
        memo[id(group)] = key
    return key


# --------------------------------------------------------------------------------------------
# ProcessGroups

_MESH_DIM_ALIASES: dict[str, str] = {
    "dp": "dp",
    "data_parallel": "dp",
    "dp_shard": "dp_shard",
    "dp_replicate": "dp_replicate",
    "fsdp": "dp_shard",
    "ddp": "dp_replicate",
    "tp": "tp",
    "tensor_parallel": "tp",
    "pp": "pp",
    "pipeline_parallel": "pp",
    "ep": "ep",
    "expert_parallel": "ep",
    "cp": "cp",
    "context_parallel": "cp",
    # Sequence parallelism shards each sequence over the dim's ranks, which then route
    # different tokens: for token counts and per-rank metrics it is context parallelism.
    # Megatron-LM sums the router's tokens_per_expert over tp_cp because its SP shards the
    # sequence over the tp group (nvidia-references.md, "Router"); Ulysses/ALST ("sp" in
    # Accelerate's ParallelismConfig) shards it over its own dim.
    "sp": "cp",
    "sequence_parallel": "cp",
}
# torchtitan's derived dims (torchtitan/distributed/parallel_dims.py): the flattened ones it
# puts on its world mesh (dp, dp_shard_cp, dp_cp, ep) and the dims of the meshes it
# unflattens from a one-dim "world" mesh (batch, loss, fsdp, efsdp, etp). dp_shard_in_ep is part
# of ep on the world mesh (dp_shard = dp_shard_mod_ep x dp_shard_in_ep) but the experts' FSDP dim
# on the EP mesh of the versions that unflatten it; the ranks tell which. etp (expert tensor
# parallel, the last dim of the sparse mesh (pp, dp_replicate, efsdp, ep, etp) of some versions)
# names no group of ours: its ranks are the tp ranks or this rank alone. In the meshes
# unflattened from "world", "fsdp" is dp_shard x cp flattened (read as dp_shard_cp there,
# see _TORCHTITAN_FSDP); elsewhere it is a plain dp_shard dim.
_TORCHTITAN_DIMS: dict[str, str] = {
    "batch": "dp",
    "dp_cp": "dp_cp",
    "loss": "dp_cp",
    "loss_mesh": "dp_cp",
    "dp_shard_cp": "dp_shard_cp",
    "dp_shard_in_ep": "ep_or_edp_part",
    "dp_shard_mod_ep": "ep_or_edp_part",
    "efsdp": "ep_or_edp_part",
    "etp": "etp",
}
# torchtitan's dense mesh (pp, dp_replicate, fsdp, tp) sizes "fsdp" dp_shard x cp
# (torchtitan/distributed/parallel_dims.py of early 2026, build_mesh: fsdp = dp_shard * cp)
_TORCHTITAN_FSDP = {"fsdp": "dp_shard_cp"}
# Roles that several mesh dims may share: their dims are flattened into one group.
_MULTI_DIM_ROLES = frozenset({"cp", "ep_or_edp_part"})
# Set by from_device_mesh for torchtitan's expert region: the ranks that ep and edp may span
# (dp_cp x tp), checked by ProcessGroups._check_layout instead of dp_cp.
_EXPERT_REGION: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "trainvitals_expert_region", default=None
)


@dataclass
class ProcessGroups:
    """The process groups of the parallel layout in use.

    Each field is a ``torch.distributed`` process group or ``None`` (trivial: this rank alone).
    ``dp`` is the whole data-parallel group (replicate x shard); ``dp_cp`` the data- and
    context-parallel ranks together (the ranks that see different tokens), defaulting to ``dp``
    when there is no context parallelism. ``ep`` is a subgroup of ``dp_cp`` (Megatron-LM's layout:
    expert-parallel ranks route different tokens to each other's experts), so sums of tokens
    over ``dp_cp`` include every expert-parallel rank; torchtitan's ``ep`` read by
    :meth:`from_device_mesh` may also borrow tensor-parallel ranks (they share their router
    input), and is checked against ``dp_cp`` x ``tp`` there. Hand-built groups must lie inside
    ``dp_cp``. ``edp`` (expert data
    parallel, Megatron-LM's expert-data-parallel group ``expt_dp``) holds the ranks that hold the same
    experts but see different tokens: when ``dp_cp`` is larger than ``ep`` (a ``("dp", "ep")``
    mesh of shape ``(2, 2)``: four token streams, each ``ep`` group of two routes only its own
    two streams' tokens to its experts), an expert's tokens are spread over ``edp``. ``None``
    (the default) means trivial, right when ``ep`` spans all of ``dp_cp``. A single process
    means every group is ``None``. Hand-built groups are checked when made, from the local
    group table (no collective): ``dp``, ``cp``, ``ep`` and ``edp`` outside ``dp_cp``, or
    ``ep`` and ``edp`` sharing ranks, raise ``ValueError`` (``ProcessGroups(ep=G)`` without
    ``dp`` would sum tokens over this rank alone).

    Example::

        groups = ProcessGroups.from_device_mesh(mesh)      # dims ("dp", "tp")
        tokens = all_reduce_coalesced([local_tokens], "sum", groups.dp_cp)[0]
    """

    dp: Any = None
    tp: Any = None
    pp: Any = None
    ep: Any = None
    cp: Any = None
    dp_cp: Any = None
    edp: Any = None

    def __post_init__(self) -> None:
        if self.dp_cp is None:
            if group_size(self.cp) > 1:
                # the ranks that see different tokens span dp x cp, a group only the caller can
                # build (on every rank): without it, token sums would cover one rank's tokens
                raise ValueError(
                    "ProcessGroups: cp (context parallel) of more than one rank needs dp_cp, the "
                    "data x context parallel group (ProcessGroups.from_device_mesh builds it)"
                )
            self.dp_cp = self.dp
        self._check_layout()

    def _check_layout(self) -> None:
        """Refuse groups that would leave ranks out of token sums, before any collective.

        ``dp``, ``cp``, ``ep`` and ``edp`` must lie inside ``dp_cp``, and ``ep`` and ``edp``
        share only this rank: a hand-built ``ProcessGroups(ep=G)`` without ``dp`` summed the
        expert loads over this rank alone (the other EP ranks' tokens lost). Membership is
        read from the local group table (``get_process_group_ranks``): no collective.
        """
        if not is_distributed():
            return
        me = dist.get_rank()
        for f in fields(self):
            try:
                outside = group_size(getattr(self, f.name)) < 1
            except Exception:  # not a process group this rank can look up: not checked
                outside = False
            if outside:
                # (a group dist.new_group made without this rank: its size reads -1, and its
                # ranks read as the members', so the checks below named another field)
                raise ValueError(
                    f"ProcessGroups: {f.name} is a group that rank {me} is not a member of; "
                    "pass each rank its own group (the one holding it) of the layout"
                )

        def members(name: str) -> set[int] | None:
            try:
                return set(_members(getattr(self, name), me))
            except Exception:  # not a process group this rank can look up: not checked
                return None

        dp_cp = members("dp_cp")
        ep = members("ep")
        # torchtitan's ep and edp may span tensor-parallel ranks (from_device_mesh sets them)
        region = _EXPERT_REGION.get()
        if dp_cp is not None:
            for name in ("dp", "cp", "ep", "edp"):
                ranks = members(name)
                inside = dp_cp if region is None or name in ("dp", "cp") else set(region)
                if ranks is None or ranks <= inside:
                    continue
                hint = ""
                if name == "ep":
                    hint = (
                        " (expert-parallel ranks route different tokens to each other's "
                        "experts, so they are data parallel: pass dp (or dp_cp) holding them, "
                        "as ProcessGroups.from_device_mesh does for an 'ep' dim; an ep group "
                        "folded over tensor-parallel ranks (MoE parallel folding) is not "
                        "supported when the groups are built by hand)"
                    )
                what = "dp_cp" if inside is dp_cp else "dp_cp x tp"
                raise ValueError(
                    f"ProcessGroups: {name} (ranks {sorted(ranks)}) must lie inside {what} "
                    f"(ranks {sorted(inside)}), the ranks every token sum covers; ranks "
                    f"{sorted(ranks - inside)} would be left out{hint}"
                )
        edp = members("edp")
        if ep is not None and edp is not None and ep & edp != {me}:
            raise ValueError(
                f"ProcessGroups: ep (ranks {sorted(ep)}) and edp (ranks {sorted(edp)}) share "
                f"ranks {sorted(ep & edp - {me})}: edp holds the ranks with the same experts, "
                "one per ep group"
            )

    @property
    def is_trivial(self) -> bool:
        return all(group_size(getattr(self, f.name)) == 1 for f in fields(self))

    def sizes(self) -> dict[str, int]:
        return {f.name: group_size(getattr(self, f.name)) for f in fields(self)}

    # ---- constructors

    @classmethod
    def single(cls) -> ProcessGroups:
        return cls()

    @classmethod
    def world(cls) -> ProcessGroups:
        """Every rank is a data-parallel replica (DDP)."""
        return cls(dp=world_group())

    @classmethod
    def from_device_mesh(cls, mesh: Any, *meshes: Any) -> ProcessGroups:
        """Groups from one or more ``DeviceMesh`` whose dims carry the usual names.

        Recognised: ``dp``/``data_parallel``, ``dp_shard``/``fsdp``, ``dp_replicate``/``ddp``,
        ``tp``/``tensor_parallel``, ``pp``, ``ep``, ``cp``/``context_parallel`` and
        ``sp``/``sequence_parallel``. A sequence-parallel dim shards each sequence over its
        ranks, so their routers see different tokens: it is a ``cp`` dim (with a ``cp`` dim
        as well, ``cp`` is both, flattened). A ``tp`` dim is taken to give its ranks the same
        router input; under Megatron-style sequence parallelism over the tensor-parallel
        ranks, name that dim ``sp``. Two dims with the same role (other than ``cp``) raise
        ``ValueError``. With both ``dp_replicate`` and ``dp_shard`` (HSDP) the data-parallel
        group is their flattened product. An ``ep`` dim of its own is part of it too: its ranks
        see different tokens (each routes its own batch to the experts of all), so a mesh
        ``("dp", "ep")`` of shape ``(2, 2)`` has four data-parallel ranks and ``ep`` groups of
        two. With an ``ep`` dim, ``edp`` is the
        flattened data-parallel and ``cp`` dims other than ``ep`` (the ranks holding the same
        experts; ``None`` when there are none). A mesh with unnamed or unknown dims raises
        ``ValueError`` naming them; so does, on that rank, a mesh that does not hold this rank,
        and a flattened ``dp_cp`` / ``loss`` dim of more ranks than ``cp`` passed without the
        data-parallel dims it was made of (``dp`` would be this rank alone).

        torchtitan: pass ``parallel_dims.world_mesh`` (its flattened ``dp``, ``dp_shard_cp``,
        ``dp_cp`` and ``ep`` dims are read from it), or, for versions whose ``world_mesh`` is
        one ``"world"`` dim, the ``ParallelDims`` itself (its ``_global_meshes`` or
        ``_all_meshes``, built through ``world_mesh`` when not yet built) or its meshes
        (``batch`` / ``dp``, ``loss`` / ``loss_mesh``, ``fsdp``, ``efsdp``, ``ep``, ``etp``) as
        further arguments. In a mesh unflattened from the ``"world"`` mesh ``fsdp`` is
        ``dp_shard`` x ``cp`` flattened: its dense mesh ``(pp, dp_replicate, fsdp, tp)`` (or a
        ``dp_shard_cp`` dim) without the data loader's ``batch`` / ``dp`` dim raises
        ``ValueError`` (naming what to pass) when ``fsdp`` has more than one rank, as its ranks
        do not tell data from context parallelism. ``etp`` names no group here. ``dp`` is
        torchtitan's ``dp`` / ``batch``, ``dp_cp`` its ``dp_cp`` / ``loss`` (the group its
        loss and expert-load reductions use), ``ep`` its ``ep`` (borrowed from the
        ``dp_shard`` x ``cp`` (x ``tp``) ranks, so not added to ``dp``), and ``edp``
        ``dp_replicate`` x ``dp_shard_mod_ep`` / ``efsdp`` (the FSDP dims of the experts).
        Its ``ep`` may span tensor-parallel ranks (expert tensor parallel 1: the router input
        is replicated over ``tp`` and the experts' tokens are split over it), so ``ep`` and
        ``edp`` are checked to lie inside ``dp_cp`` x ``tp`` there. A dim name held by two
        meshes with different ranks raises ``ValueError``.
        """
        sources = [m for obj in (mesh, *meshes) for m in _meshes_of(obj)]
        me = dist.get_rank() if is_distributed() else 0
        # name -> (a 1-d mesh of that dim, the meshes holding it as one of their own dims:
        # none for a dim flattened onto a root mesh)
        dims: dict[str, tuple[Any, list[Any]]] = {}

        def add(name: str, one_d: Any, owner: Any) -> None:
            if name in dims:
                if _ranks_of(dims[name][0]) != _ranks_of(one_d):
                    raise ValueError(
                        f"ProcessGroups.from_device_mesh: mesh dim {name!r} holds ranks "
                        f"{_ranks_of(dims[name][0])} in one mesh and {_ranks_of(one_d)} in "
                        "another; pass meshes of one layout"
                    )
                dims[name][1].extend([owner] if owner is not None else [])
                return
            dims[name] = (one_d, [owner] if owner is not None else [])

        torchtitan_family = False  # a mesh unflattened from torchtitan's one-dim "world" mesh
        for m in sources:
            names = tuple(m.mesh_dim_names or ())
            if len(names) != m.ndim:
                raise ValueError("from_device_mesh needs a DeviceMesh with mesh_dim_names")
            coordinate = getattr(m, "get_coordinate", None)
            if is_distributed() and callable(coordinate) and coordinate() is None:
                # (torch then fails deep inside get_group: IndexError or RuntimeError)
                raise ValueError(
                    f"ProcessGroups.from_device_mesh: rank {me} is not in the mesh with dims "
                    f"{names}, so it has none of its groups; build the groups of this rank from "
                    "a mesh that holds it (every rank's mesh, or the whole mesh)"
                )
            for name in names:
                add(name, m if m.ndim == 1 else m[name], m)
            root = m._get_root_mesh() if hasattr(m, "_get_root_mesh") else None
            if root is not None and root is not m:
                torchtitan_family |= tuple(root.mesh_dim_names or ()) == ("world",)
            if root is m:  # dims flattened onto a whole mesh (torchtitan's dp_cp, ep, ...)
                for name, flat in getattr(m, "_flatten_mapping", {}).items():
                    if name in _TORCHTITAN_DIMS or name in _MESH_DIM_ALIASES:
                        add(name, flat, None)  # others (ours: "dp_replicate_dp_shard") derive
        if all(tuple(m.mesh_dim_names or ()) == ("world",) for m in sources):
            raise ValueError(
                "ProcessGroups.from_device_mesh: a one-dim 'world' mesh does not say which "
                "ranks are data, context, tensor, pipeline or expert parallel (torchtitan's "
                "world_mesh since it builds its meshes by unflattening): pass the ParallelDims "
                "or its dataloading, loss, dense and sparse meshes"
            )
        roles_of = {**_MESH_DIM_ALIASES, **_TORCHTITAN_DIMS}
        if torchtitan_family:
            roles_of.update(_TORCHTITAN_FSDP)
        unknown = [n for n in dims if n not in roles_of and n != "world"]
        if unknown:
            raise ValueError(
                f"unknown mesh dim names {unknown}; expected some of {sorted(roles_of)}"
            )
        dims_of: dict[str, list[str]] = {}
        for name in dims:
            if name != "world":
                dims_of.setdefault(roles_of[name], []).append(name)
        # dims with one role and the same ranks (torchtitan's "dp" and "batch", a dim in two
        # meshes) are one dim; keeping one of two that differ would silently leave the
        # other's ranks out of every reduction
        clashes = {}
        for role, names in dims_of.items():
            if role in _MULTI_DIM_ROLES:
                continue
            distinct = {tuple(_ranks_of(dims[n][0])): n for n in reversed(names)}
            dims_of[role] = [n for n in names if n in distinct.values()]
            if len(dims_of[role]) > 1:
                clashes[role] = dims_of[role]
        if clashes:
            raise ValueError(
                "mesh dims with the same role: "
                + "; ".join(f"{d} are all {r!r}" for r, d in sorted(clashes.items()))
            )
        roles = {r: d[0] for r, d in dims_of.items()}

        def one(role: str) -> Any:
            return dims[roles[role]][0].get_group() if role in roles else None

        def flat(names: list[str]) -> Any:
            if not names:
                return None
            if len(names) == 1:
                return dims[names[0]][0].get_group()
            owner = next(
                (
                    m
                    for m in dims[names[0]][1]
                    if all(any(m is x for x in dims[n][1]) for n in names)
                ),
                None,
            )
            if owner is None:
                raise ValueError(
                    f"ProcessGroups.from_device_mesh: mesh dims {names} are not dims of one "
                    "mesh, so their flattened group cannot be built; pass a mesh holding them all"
                )
            return _flat_group(owner, names)

        # torchtitan's expert region: ep borrows dp_shard x cp (x tp) ranks, the experts are
        # FSDP-sharded over dp_shard_mod_ep / efsdp (and replicated over dp_replicate)
        tt_ep = "ep_or_edp_part" in roles or ("ep" in roles and not dims[roles["ep"]][1])
        ep = one("ep")
        replicate = [roles["dp_replicate"]] if "dp_replicate" in roles else []
        cp_dims = dims_of.get("cp", [])
        cp = flat(cp_dims)
        if "dp" in roles:
            dp_dims = [roles["dp"]]
        else:
            dp_dims = [roles[r] for r in ("dp_replicate", "dp_shard") if r in roles]
            if {"dp_shard_mod_ep", "dp_shard_in_ep"} <= set(dims_of.get("ep_or_edp_part", [])):
                dp_dims += ["dp_shard_mod_ep", "dp_shard_in_ep"]  # torchtitan's dp_shard
            elif "dp_shard" not in roles and "dp_shard_cp" in roles:
                dp_dims += _shard_of_shard_cp(roles["dp_shard_cp"], one("dp_shard_cp"), cp_dims, cp)
        if "ep" in roles and not tt_ep:
            # ep counts as data parallel: leaving it out would sum tokens and expert loads
            # over half the token streams of a ("dp", "ep") mesh (measured: CV 1.0 for a
            # balanced load)
            dp_dims.append(roles["ep"])
        dp = flat(dp_dims)
        if "dp_cp" in roles:
            dp_cp = one("dp_cp")
        elif "dp_shard_cp" in roles:
            dp_cp = flat([*replicate, roles["dp_shard_cp"]])
        else:
            dp_cp = flat([*dp_dims, *cp_dims]) if cp is not None else dp
        if not dp_dims and group_size(dp_cp) > group_size(cp):
            # a flattened dp_cp (torchtitan's loss mesh, Accelerate's dp_cp) without the dims it
            # was made of: dp would be this rank alone, and sample counts one rank's samples
            name = roles.get("dp_cp", roles.get("dp_shard_cp"))
            raise ValueError(
                f"ProcessGroups.from_device_mesh: mesh dim {name!r} holds "
                f"{group_size(dp_cp)} data x context parallel ranks but no mesh given says "
                "which of them are data parallel; pass the mesh with the 'dp' (or 'batch', "
                "'dp_replicate'/'dp_shard') and 'cp' dims as well"
            )
        edp = None
        region = None
        if tt_ep:
            if group_size(ep) > 1:
                ep_ranks = set(_ranks_of(dims[roles["ep"]][0]))
                # dp_shard_in_ep is part of ep (torchtitan's single world mesh) or the experts'
                # FSDP dim (its unflattened EP mesh): the ranks tell
                edp_parts = [
                    n
                    for n in dims_of.get("ep_or_edp_part", [])
                    if set(_ranks_of(dims[n][0])) & ep_ranks == {me}
                ]
                if edp_parts:
                    edp = flat([*replicate, *edp_parts])
                region = _product(_members(dp_cp, me), _members(one("tp"), me), me)
        elif "ep" in roles:
            edp_dims = [d for d in dp_dims if d != roles["ep"]]
            edp = flat([*edp_dims, *cp_dims])
        token = _EXPERT_REGION.set(region)
        try:
            return cls(dp=dp, tp=one("tp"), pp=one("pp"), ep=ep, cp=cp, dp_cp=dp_cp, edp=edp)
        finally:
            _EXPERT_REGION.reset(token)

    @classmethod
    def from_accelerator(cls, accelerator: Any) -> ProcessGroups:
        """Groups from an ``accelerate.Accelerator``.

        Uses ``accelerator.torch_device_mesh`` (dims ``dp_replicate``, ``dp_shard``, ``cp``,
        ``sp``, ``tp``) when a ``ParallelismConfig`` built one. Accelerate builds none for
        DeepSpeed sequence parallelism (``ParallelismConfig(sp_size=N)``, Ulysses/ALST:
        DeepSpeed makes its own groups): the groups are then built here from the config's
        ``sp_size`` and ``tp_size`` in Accelerate's mesh order (data parallel, ``sp``, ``tp``,
        row-major over the ranks; DeepSpeed's sequence-parallel groups are the same blocks of
        ``sp_size`` consecutive ranks), with ``world_size // (sp_size * tp_size)``
        data-parallel replicas. ``dp`` leaves the ``sp`` ranks out (they hold parts of the same
        samples, so counting samples over them would count each ``sp_size`` times); ``cp`` is
        the ``sp`` group and ``dp_cp`` holds both (their routers see different tokens). This
        makes new process groups: call it on every rank, in the same order. Otherwise (no
        mesh, no sequence parallelism) every process is a data-parallel replica.
        """
        mesh = getattr(accelerator, "torch_device_mesh", None)
        if mesh is not None:
            base_dims = [n for n in (mesh.mesh_dim_names or ()) if n in _MESH_DIM_ALIASES]
            return cls.from_device_mesh(mesh[tuple(base_dims)] if len(base_dims) > 1 else mesh)
        config = getattr(accelerator, "parallelism_config", None)
        if int(getattr(config, "sp_size", 1) or 1) > 1 and is_distributed():
            return cls._from_accelerate_sp(config)
        if getattr(accelerator, "num_processes", 1) > 1:
            return cls.world()
        return cls()

    @classmethod
    def _from_accelerate_sp(cls, config: Any) -> ProcessGroups:
        """Groups of Accelerate's DeepSpeed sequence parallelism, which builds no device mesh.

        Layout (Accelerate's mesh order, DeepSpeed's ``initialize_sequence_parallel``): rank =
        (dp * sp_size + sp) * tp_size + tp. The data-parallel size is what is left of the world:
        Accelerate does not check its ``dp_*_size`` against the world under DeepSpeed SP, and
        DeepSpeed's data-parallel group is ``world // sp_size`` ranks.
        """
        sp = int(config.sp_size)
        tp = int(getattr(config, "tp_size", 1) or 1)
        world = dist.get_world_size()
        if int(getattr(config, "cp_size", 1) or 1) > 1 or world % (sp * tp):
            raise ValueError(
                f"ProcessGroups.from_accelerator: ParallelismConfig(sp_size={sp}, tp_size={tp}, "
                f"cp_size={getattr(config, 'cp_size', 1)}) does not lay out {world} ranks as "
                "data parallel x sp x tp; pass ProcessGroups(dp=..., cp=..., dp_cp=...) built "
                "from your sequence-parallel groups"
            )
        shape = (world // (sp * tp), sp, tp)
        return cls(
            dp=_row_major_group(shape, [0]),
            cp=_row_major_group(shape, [1]),
            tp=_row_major_group(shape, [2]),
            dp_cp=_row_major_group(shape, [0, 1]),
        )

    @classmethod
    def from_strategy(cls, strategy: Any) -> ProcessGroups:
        """Groups from a Lightning strategy (``lightning`` or ``pytorch_lightning``).

        Single-device: trivial. DDP, FSDP, DeepSpeed: every rank a data-parallel replica (the
        world group). ``ModelParallelStrategy``: its ``device_mesh`` dims ``data_parallel`` and
        ``tensor_parallel``.
        """
        mesh = None
        try:
            mesh = getattr(strategy, "device_mesh", None)
        except Exception:  # Lightning raises before setup
            mesh = None
        if mesh is not None:
            return cls.from_device_mesh(mesh)
        world_size = getattr(strategy, "world_size", 1) or 1
        if world_size > 1 and is_distributed():
            return cls.world()
        return cls()


def _row_major_group(shape: tuple[int, ...], dims: list[int]) -> Any:
    """This rank's group along ``dims`` of a row-major layout of ``shape`` over the world:
    ``None`` when it is this rank alone, the world group when it is every rank, else a new
    group (every rank creates every group of the layout, in the same order)."""
    size = math.prod(shape[d] for d in dims)
    if size == 1:
        return None
    if size == dist.get_world_size():
        return world_group()
    return _new_groups_along(torch.arange(math.prod(shape)).reshape(shape), dims)


def _new_groups_along(grid: torch.Tensor, dims: list[int]) -> Any:
    """``dist.new_group`` for every block of the rank ``grid`` along its ``dims`` (every rank
    must call it for every block, in the same order); returns this rank's group."""
    other = [d for d in range(grid.ndim) if d not in dims]
    blocks = grid.permute(*other, *dims).reshape(-1, math.prod(grid.shape[d] for d in dims))
    me = dist.get_rank()
    mine = None
    for block in blocks.tolist():
        group = dist.new_group(block)
        if me in block:
            mine = group
    return mine


def _shard_of_shard_cp(name: str, shard_cp: Any, cp_dims: list[str], cp: Any) -> list[str]:
    """The dims holding dp_shard when a mesh has only dp_shard x cp flattened (torchtitan's
    ``dp_shard_cp`` dim, its dense mesh's ``fsdp``) and no dim of the data loader (``dp`` /
    ``batch``): ``[name]`` when cp is one rank, ``[]`` when cp spans all of it (dp_shard is one
    rank); otherwise its ranks do not tell the ranks that load different samples (dp) from those
    that split one sequence (cp), and a guess would count samples cp times or miss some."""
    size = group_size(shard_cp)
    if size == 1:
        return []
    if cp_dims and group_size(cp) == 1:
        return [name]
    if cp_dims and group_size(cp) == size:
        return []
    raise ValueError(
        f"ProcessGroups.from_device_mesh: mesh dim {name!r} ({size} ranks) is dp_shard x cp "
        "flattened (torchtitan's dense mesh (pp, dp_replicate, fsdp, tp), or its dp_shard_cp), "
        "so it cannot tell the ranks that load different samples (dp) from those that split "
        "one sequence (cp); pass torchtitan's ParallelDims, or its dataloading mesh (a 'batch' "
        "or 'dp' dim, with 'cp') and loss mesh as well"
    )


def _meshes_of(obj: Any) -> list[Any]:
    """The meshes of ``obj``: a ``DeviceMesh``, or torchtitan's ``ParallelDims`` (its meshes,
    read without importing torchtitan)."""
    if hasattr(obj, "ndim") and hasattr(obj, "mesh_dim_names"):
        return [obj]

    def built() -> list[Any]:
        # _global_meshes: the dict of the versions that unflatten a "world" mesh; _all_meshes:
        # the list of a 2025 development version (its world_mesh returns the ParallelDims)
        for attr in ("_global_meshes", "_all_meshes"):
            found = getattr(obj, attr, None)
            if found:
                return list(found.values()) if isinstance(found, dict) else list(found)
        return []

    found = built()
    if found:
        return found
    world = getattr(obj, "world_mesh", None)  # builds the meshes of a ParallelDims
    found = built()
    if found:
        return found
    if world is not None and world is not obj and hasattr(world, "ndim"):
        return [world]
    raise TypeError(f"from_device_mesh needs a DeviceMesh, got {type(obj).__name__}")


def _ranks_of(one_d: Any) -> list[int]:
    """The sorted ranks of this rank's group along a one-dim mesh (local, no collective)."""
    if not is_distributed():
        return [0]
    return sorted(dist.get_process_group_ranks(one_d.get_group()))


def _members(group: Any, me: int) -> list[int]:
    return [me] if group is None else sorted(dist.get_process_group_ranks(group))


def _product(a: list[int], b: list[int], me: int) -> list[int]:
    """The ranks of two groups through ``me`` along independent dims of a row-major layout
    (rank = sum of coordinate x stride): every ``a + b - me``."""
    return sorted({x + y - me for x in a for y in b})


def _flat_group(mesh: Any, dims: list[str]) -> Any:
    if not dims:
        return None
    if len(dims) == 1:
        return mesh[dims[0]].get_group()
    # a DeviceMesh slices only in its own dim order (("ep", "dp")[("dp", "ep")] raises
    # KeyError): take the dims as the mesh orders them (the group is the same set of ranks)
    order = list(mesh.mesh_dim_names)
    dims = sorted(dims, key=order.index)
    sub = mesh[tuple(dims)]
    flat_name = "_".join(dims)
    try:
        return sub._flatten(flat_name).get_group()
    except Exception:
        # Fall back to a new group with the same members (costs one new_group per call).
        return _new_group_for(mesh, dims)


def _new_group_for(mesh: Any, dims: list[str]) -> Any:
    # Every rank must call new_group for every subgroup, in the same order.
    full = mesh.mesh
    if full.numel() != dist.get_world_size():
        # a sub-mesh: the ranks of the other sub-meshes would call new_group for other
        # blocks (mismatched calls hang); a clear error instead, on every rank
        raise ValueError(
            f"ProcessGroups.from_device_mesh: cannot flatten mesh dims {dims} of a sub-mesh "
            "(DeviceMesh._flatten failed); pass the whole mesh"
        )
    return _new_groups_along(full, [mesh.mesh_dim_names.index(n) for n in dims])


def unique_by_identity(items: Iterable[Any]) -> list[Any]:
    seen: set[int] = set()
    out = []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out
