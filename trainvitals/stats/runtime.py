"""Training time bookkeeping: wall time split into training and validation, remaining-time math.

Pure Python, no I/O, no framework. The clock is injectable (``clock=``) so that tests can drive
it deterministically; the default is :func:`time.perf_counter`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

__all__ = ["TIME_UNITS", "TrainClock", "seconds_to", "training_horizon"]

# Seconds per unit, for the ``time_unit`` arguments and the key suffixes (``time/total_hours``).
TIME_UNITS: dict[str, float] = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}


def seconds_to(seconds: float, unit: str) -> float:
    """``seconds`` expressed in ``unit`` (one of :data:`TIME_UNITS`)."""
    if unit not in TIME_UNITS:
        raise ValueError(f"time unit must be one of {sorted(TIME_UNITS)}, got {unit!r}")
    return seconds / TIME_UNITS[unit]


class TrainClock:
    """Wall time of one process's part of a run, with validation time kept apart.

    ``start()`` starts the clock (idempotent); ``pause()``/``resume()`` bracket validation.
    ``train_seconds()`` is the time since ``start()`` minus every paused interval (including one
    in progress), ``validation_seconds()`` the paused time, ``total_seconds()`` both together.
    Validation before ``start()`` (an evaluation before the first training batch, or Lightning
    finishing an interrupted validation after a restart) is validation time too; the training
    time starts at ``start()``. Before ``start()`` and any validation all three are 0.

    ``sync``: called by ``pause()`` and ``resume()`` before they read the clock, and by
    ``sync()``, so that work an accelerator still has queued is charged to the side that queued
    it (the callbacks set ``torch.cuda.synchronize`` of their device; ``None``: nothing to wait
    for, as on CPU). Settable after construction: the device is known only at run start.

    Example::

        clock = TrainClock(clock=iter([0.0, 5.0, 7.0, 10.0]).__next__)
        clock.start()          # t=0
        clock.pause()          # t=5: validation starts
        clock.resume()         # t=7: validation ends
        clock.train_seconds()  # t=10 -> 8.0
    """

    def __init__(
        self,
        clock: Callable[[], float] | None = None,
        sync: Callable[[], object] | None = None,
    ) -> None:
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        if sync is not None and not callable(sync):
            raise TypeError(f"sync must be a callable or None, got {sync!r}")
        self._clock: Callable[[], float] = clock or time.perf_counter
        self.sync_fn = sync
        # the start of the total time: start() less the validation before it, so that
        # now - _start is the total (training and every validation) from one subtraction
        self._start: float | None = None
        self._paused_at: float | None = None
        self._paused_seconds = 0.0  # every finished pause, those before start() included

    @property
    def started(self) -> bool:
        return self._start is not None

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def now(self) -> float:
        return float(self._clock())

    def start(self) -> None:
        if self._start is None:
            now = self.now()
            if self._paused_at is not None:
                # training starts: a validation before it is over (the callbacks never start
                # the clock inside validation, which has no training batches)
                self._paused_seconds += now - self._paused_at
                self._paused_at = None
            self._start = now - self._paused_seconds

    def sync(self) -> None:
        """Wait for queued accelerator work (``sync_fn``), if any."""
        if self.sync_fn is not None:
            self.sync_fn()

    def pause(self) -> None:
        if self._paused_at is None:
            if self._start is not None:
                self.sync()  # training's queued work is training time
            # (not started: no training work is queued; the validation is validation time)
            self._paused_at = self.now()

    def resume(self) -> None:
        if self._paused_at is not None:
            self.sync()  # validation's queued work is not
            self._paused_seconds += self.now() - self._paused_at
            self._paused_at = None

    def fresh(self) -> TrainClock:
        """A new, unstarted clock with the same time source and sync (a resumed process)."""
        return TrainClock(self._clock, self.sync_fn)

    def _read(self) -> tuple[float, float]:
        """(total, validation) seconds from one clock reading."""
        if self._start is None and self._paused_at is None:
            return self._paused_seconds, self._paused_seconds
        now = self.now()
        paused = self._paused_seconds
        if self._paused_at is not None:
            paused += now - self._paused_at
        if self._start is None:  # only validation so far
            return paused, paused
        return now - self._start, paused

    def train_seconds(self) -> float:
        total, paused = self._read()
        return total - paused

    def validation_seconds(self) -> float:
        return self._read()[1]

    def total_seconds(self) -> float:
        return self._read()[0]

    def read(self) -> dict[str, float]:
        """``{"train": ..., "validation": ..., "total": ...}`` from a single clock reading."""
        total, paused = self._read()
        return {"train": total - paused, "validation": paused, "total": total}


def training_horizon(
    *,
    max_steps: int | None = None,
    max_epochs: int | None = None,
    num_training_batches: int | None = None,
    accumulate_grad_batches: int = 1,
    epoch: int | None = None,
    batches_done_in_epoch: int = 0,
    steps_done: int = 0,
) -> int | None:
    """Total optimizer steps of the run, or ``None`` when unknown.

    The smaller of ``max_steps`` and ``max_epochs * ceil(num_training_batches /
    accumulate_grad_batches)`` (an epoch ends with an optimizer step even when its last
    accumulation is incomplete, as in Lightning's ``estimated_stepping_batches``).

    With ``epoch`` (0-based, the epoch in progress), ``batches_done_in_epoch`` (its batches so
    far) and ``steps_done`` (optimizer steps of the run so far) the epochs part counts from the
    start of the epoch in progress: the steps before it (``steps_done`` less the epoch's own,
    ``ceil(batches_done_in_epoch / accumulate_grad_batches)``) plus ``(max_epochs - epoch) *
    ceil(num_training_batches / accumulate_grad_batches)``, ``num_training_batches`` being
    this epoch's. The same number while every epoch has as many batches; also right when they
    differ (a dataloader reloaded with another length), where the product is not.
    """
    candidates: list[int] = []
    if max_steps is not None and max_steps > 0:
        candidates.append(int(max_steps))
    if max_epochs and num_training_batches:
        acc = max(int(accumulate_grad_batches or 1), 1)
        per_epoch = math.ceil(int(num_training_batches) / acc)
        if epoch is None:
            candidates.append(int(max_epochs) * per_epoch)
        else:
            in_epoch = min(math.ceil(int(batches_done_in_epoch) / acc), per_epoch)
            before_epoch = max(int(steps_done) - in_epoch, 0)
            candidates.append(before_epoch + (int(max_epochs) - int(epoch)) * per_epoch)
    return min(candidates) if candidates else None


def remaining_seconds(seconds_per_step: float, steps_done: int, horizon: int) -> float:
    """Estimated training seconds left: the steps left times the seconds per step."""
    return max(horizon - steps_done, 0) * seconds_per_step


def as_float_state(value: Any) -> Any:
    """A count (int, float or 0-d tensor) as a plain number for checkpoints."""
    if value is None or isinstance(value, int | float):
        return value
    return float(value)
