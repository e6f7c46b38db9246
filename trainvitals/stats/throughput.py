"""Throughput math: per-step counts of batches, samples and tokens, and a rolling window of steps.

Pure Python/tensor bookkeeping, no I/O, no collectives. Counts may be ints, floats or 0-d tensors
(a user's ``num_tokens_fn`` may return ``attention_mask.sum()`` on the device); sums of tensors
stay on the device until the caller hands them to the writer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any

import torch

from trainvitals.stats.runtime import as_float_state

__all__ = ["COUNT_FIELDS", "RollingWindow", "StepCounter", "StepRecord", "to_vector"]


@dataclass
class StepRecord:
    """What one rank did in one optimizer step.

    ``samples_missing``/``tokens_missing`` are 1 when some micro-batch of the step had no sample
    or token count (then the corresponding count is incomplete and no rate is reported);
    ``batches_missing`` is 1 when no micro-batch of the step was reported at all.
    ``flops`` is the floating-point work this device did in the step (0 when no flops are
    known, NaN when they are but this rank lacks the count they are derived from, so that a sum
    over ranks says "incomplete" instead of coming out low). ``steps`` is how many optimizer
    steps the record stands for: 1, except under Lightning's manual optimization where one
    batch steps several optimizers and ``global_step`` (the step axis, ``max_steps``) advances
    once per ``optimizer.step()``. It is this rank's own (every rank steps alike), never summed
    over ranks, and last so that records saved before it existed still load (as 1 step).
    """

    seconds: float = 0.0
    batches: Any = 0
    samples: Any = 0
    tokens: Any = 0
    batches_missing: int = 0
    samples_missing: int = 0
    tokens_missing: int = 0
    flops: Any = 0.0
    steps: int = 1

    def counts(self) -> tuple[Any, ...]:
        """The values of :data:`COUNT_FIELDS` after ``seconds`` (those summed over ranks)."""
        return tuple(getattr(self, name) for name in COUNT_FIELDS[1:])


# ``seconds`` and the counts summed over ranks (``steps`` is neither).
COUNT_FIELDS = tuple(f.name for f in fields(StepRecord) if f.name != "steps")
_RECORD_FIELDS = tuple(f.name for f in fields(StepRecord))


class StepCounter:
    """Accumulates the micro-batches of the optimizer step in progress."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.batches = 0
        self.samples: Any = 0
        self.tokens: Any = 0
        self.samples_missing = 0
        self.tokens_missing = 0

    def add(self, batch_size: Any, num_tokens: Any) -> None:
        """Count one micro-batch of ``batch_size`` samples and ``num_tokens`` tokens (``None``:
        unknown)."""
        self.batches += 1
        if batch_size is None:
            self.samples_missing = 1
        else:
            self.samples = self.samples + batch_size
        if num_tokens is None:
            self.tokens_missing = 1
        else:
            self.tokens = self.tokens + num_tokens

    def take(self, seconds: float, flops: Any = 0.0, steps: int = 1) -> StepRecord:
        """The step's record (with its duration, flops and optimizer steps); resets the counter.
        A step in which no micro-batch was reported has every count marked missing."""
        none_seen = int(self.batches == 0)
        record = StepRecord(
            seconds=float(seconds),
            batches=self.batches,
            samples=self.samples,
            tokens=self.tokens,
            batches_missing=none_seen,
            samples_missing=max(self.samples_missing, none_seen),
            tokens_missing=max(self.tokens_missing, none_seen),
            flops=flops,
            steps=steps,
        )
        self.reset()
        return record


class RollingWindow:
    """The last ``size`` optimizer steps of one rank.

    Each entry is a :class:`StepRecord` (this rank's counts). An entry may also carry its global
    sums over the ranks (:meth:`set_globals`): the caller reduces the entries over the ranks when
    it saves a checkpoint, so the one copy a checkpoint keeps (rank 0's) restores exact global
    rates on every rank after a resume. :meth:`split_sums` separates the entries still to be
    reduced from those whose global sums are known. With its global sums an entry keeps the
    number of ranks they were summed over (the world size of its run, which a resume on
    another number of devices changes): :meth:`device_seconds`.
    """

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"window_size must be a positive int, got {size!r}")
        self.size = size
        self._records: deque[StepRecord] = deque(maxlen=size)
        # Parallel to _records: None for a live entry, else its global sums (COUNT_FIELDS[1:]).
        self._globals: deque[tuple[float, ...] | None] = deque(maxlen=size)
        # Parallel to _records: the world size of an entry's global sums (None: live, or
        # restored from a checkpoint that did not say).
        self._worlds: deque[int | None] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._records)

    def append(self, record: StepRecord) -> None:
        self._records.append(record)
        self._globals.append(None)
        self._worlds.append(None)

    def clear(self) -> None:
        self._records.clear()
        self._globals.clear()
        self._worlds.clear()

    def sums(self) -> StepRecord:
        """Field-wise sums over the window (this rank's counts)."""
        out = StepRecord()
        for name in _RECORD_FIELDS:
            setattr(out, name, _sum(getattr(r, name) for r in self._records))
        return out

    def split_sums(self) -> tuple[StepRecord, tuple[float, ...]]:
        """``(live, restored)``: sums over the entries recorded by this process (to be reduced
        over ranks) and the already-global sums of entries restored from a checkpoint."""
        live = StepRecord()
        live_records = [r for r, g in zip(self._records, self._globals, strict=True) if g is None]
        for name in _RECORD_FIELDS:
            setattr(live, name, _sum(getattr(r, name) for r in live_records))
        restored = [g for g in self._globals if g is not None]
        restored_sum = tuple(float(sum(col)) for col in zip(*restored, strict=True))
        return live, restored_sum or (0.0,) * (len(COUNT_FIELDS) - 1)

    def device_seconds(self, world_size: int) -> float:
        """Device-seconds of the window: each entry's seconds times the devices of its run
        (``world_size``, this run's, for live entries and those of unknown size), the
        capacity that MFU divides the window's flops by, exact across a resume on another
        number of devices."""
        return float(
            sum(
                float(r.seconds) * (w or world_size)
                for r, w in zip(self._records, self._worlds, strict=True)
            )
        )

    # -------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "records": [[as_float_state(v) for v in astuple(r)] for r in self._records],
            "globals": [None if g is None else list(g) for g in self._globals],
            "worlds": list(self._worlds),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clear()
        records = [StepRecord(*r) for r in state.get("records", [])]
        globals_ = state.get("globals") or [None] * len(records)
        worlds = state.get("worlds") or [None] * len(records)
        for record, g, w in zip(
            records[-self.size :], globals_[-self.size :], worlds[-self.size :], strict=True
        ):
            self._records.append(record)
            self._globals.append(None if g is None else tuple(g))
            self._worlds.append(None if g is None or w is None else int(w))

    def live_matrix(self) -> tuple[list[int], torch.Tensor]:
        """Indices and counts (``[n, 7]`` float64, the :data:`COUNT_FIELDS` after ``seconds``)
        of the entries whose global sums are not known yet."""
        idx = [i for i, g in enumerate(self._globals) if g is None]
        rows = [to_vector(self._records[i].counts()) for i in idx]
        matrix = (
            torch.stack(rows)
            if rows
            else torch.zeros(0, len(COUNT_FIELDS) - 1, dtype=torch.float64)
        )
        return idx, matrix

    def set_globals(
        self, idx: Sequence[int], matrix: torch.Tensor, world_size: int | None = None
    ) -> None:
        """Record the global sums (rows of ``matrix``, summed over ``world_size`` ranks) of
        the entries at ``idx``."""
        for i, row in zip(idx, matrix.tolist(), strict=True):
            self._globals[i] = tuple(float(v) for v in row)
            self._worlds[i] = world_size


def _sum(values: Iterable[Any]) -> Any:
    total: Any = 0
    for v in values:
        total = total + v
    return total


def to_vector(values: Sequence[Any]) -> torch.Tensor:
    """A float64 CPU vector of numbers and 0-d tensors (a tensor on a device is copied to the
    host here: callers use this on logging steps only)."""
    if not any(isinstance(v, torch.Tensor) for v in values):
        return torch.tensor([float(v) for v in values], dtype=torch.float64)
    parts = [
        v.detach().reshape(1).to(device="cpu", dtype=torch.float64)
        if isinstance(v, torch.Tensor)
        else torch.tensor([float(v)], dtype=torch.float64)
        for v in values
    ]
    return torch.cat(parts)
