"""RuntimeMonitor: remaining training time, consumed data and elapsed time of the run."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from trainvitals.adapters.context import BatchInfo, RunContext
from trainvitals.callbacks.base import VitalsCallback
from trainvitals.callbacks.throughput_monitor import (
    ContextParallelTokensCheck,
    count_reduction_calls,
    reduce_counts,
)
from trainvitals.distributed import CollectiveCall, PeerRankFailed, ProcessGroups
from trainvitals.stats.runtime import (
    TIME_UNITS,
    TrainClock,
    remaining_seconds,
    seconds_to,
    training_horizon,
)
from trainvitals.stats.throughput import COUNT_FIELDS, StepCounter, to_vector

__all__ = ["RuntimeMonitor"]

_CONSUMED = ("batches", "samples", "tokens")
# the counts summed over the steps; batches_missing is each step's own (see step_end)
_SUMMED = tuple(n for n in COUNT_FIELDS[1:] if n != "batches_missing")


class RuntimeMonitor(VitalsCallback):
    """How long the run has taken, how much data it consumed, and how long it has left.

    A clock starts at the first training micro-batch and stops during validation (a validation
    before the first training micro-batch, such as an evaluation before training or Lightning
    finishing a validation that a restart interrupted, is validation time too). At every
    ``step_end`` the monitor notes the step; the training seconds per optimizer step are the
    training time of all steps so far divided by their number, leaving out the first
    ``warmup_steps`` steps of each run (a new process, a restore, another fit or driver with the
    same instance: compilation and warm-up). The remaining time is
    that rate times the optimizer steps left to the training horizon: ``max_steps`` given here,
    else the run's ``max_steps``, else ``max_epochs * ceil(num_training_batches /
    accumulate_grad_batches)`` (the smaller of the two when both are known; under Lightning's
    manual optimization the latter only while every batch steps exactly once; under Lightning a
    training dataloader of unknown length, an ``IterableDataset`` without ``__len__``, has its
    batches per epoch known once its first epoch ends, and the estimate starts then). The horizon is
    read again at every logging step (a few Python numbers, no sync): under Lightning off the
    trainer, so a ``max_steps`` or ``max_epochs`` changed mid-run
    (``trainer.fit_loop.epoch_loop.max_steps``, ``trainer.fit_loop.max_epochs``) and a
    dataloader reloaded with another length (``reload_dataloaders_every_n_epochs``) move it;
    the epochs part is then the steps before the epoch in progress plus the epochs left (this
    one included) at this epoch's steps per epoch, later epochs taken to be as long as this
    one (and an accumulation changed by epoch, ``GradientAccumulationScheduler``, taken to
    stay as it is now). The horizon is where the run ends at the latest, so the estimate is an
    upper bound: ``EarlyStopping`` (any ``trainer.should_stop``) may end the run before it,
    and ``min_steps``/``min_epochs`` never extend it (Lightning stops at ``max_steps`` or
    ``max_epochs`` even when a minimum is not met). Validation time is not in the estimate (it
    is reported apart). Under Lightning with a time limit
    (``Trainer(max_time=...)``, or a ``Timer(duration=...)`` callback stopping mid-epoch, its
    default) the remaining time is at most the limit's ``Timer.time_remaining()``, which counts
    validation as the limit does; with only a time limit (no ``max_steps``, ``max_epochs=-1``)
    it is that. A ``Timer(interval="epoch")`` (stops at an epoch end) is not used. Consumed
    batches, samples and tokens are summed over the ranks that see different data in one
    collective on each logging step (samples and batches over data-parallel ranks, tokens over
    data- and context-parallel ranks).

    Validation time is counted at every logging step; a validation after the last logging step
    (Lightning's at the end of the last epoch, a loop's final evaluation) is written at the
    run's end: ``time/train_<unit>``, ``time/validation_<unit>`` and ``time/total_<unit>`` at
    the step one past the last step's row (the number of optimizer steps done), so that it
    adds a point rather than rewriting the last step's (Lightning logs that validation's own
    metrics at the last step's number).

    Everything is state: a resumed run continues its clocks, its counters and its rate from the
    checkpoint (Lightning checkpoints, the driver's ``state_dict``); time between the
    checkpoint and the restart (downtime) is not counted. Another run with the same instance
    (a second ``fit`` on the same trainer, a retry after a failure, a new driver) continues
    the same way from where the previous run ended, with its own warm-up: the time between
    the runs is not counted. On CUDA a logging step synchronises
    the device once before reading the clock, and so do the start and end of validation;
    non-logging steps read the clock and add a few Python numbers: no sync, no transfer, no
    collective. So on an accelerator the rate starts at the end of the first logging step at
    or after the warm-up (the first reading that includes the warm-up's queued device work),
    not at a non-logging step's end.

    Args:
        max_steps: the training horizon in optimizer steps (default: the run's).
        time_unit: unit of the time keys: ``seconds``, ``minutes``, ``hours`` or ``days``.
        warmup_steps: steps after each (re)start left out of the per-step rate.
        batch_size_fn: ``batch -> samples`` (as in :class:`ThroughputMonitor`).
        num_tokens_fn: ``batch -> tokens`` (as in :class:`ThroughputMonitor`).
        clock: a callable returning seconds (default ``time.perf_counter``), for tests.
        log_every_n_steps: interval in optimizer steps (default: the run's).
        writer: where values go (default: the run's writer).

    Keys written on logging steps (``<unit>`` is ``time_unit``, ``hours`` by default):

    ==========================  ===================================================================  ========
    key                         meaning                                                              unit
    ==========================  ===================================================================  ========
    ``time/remaining_<unit>``   estimated training time to the step horizon or the time limit        <unit>
    ``time/seconds_per_step``   training seconds per optimizer step the estimate uses                s
    ``time/train_<unit>``       training wall time so far, validation excluded, over all restarts    <unit>
    ``time/validation_<unit>``  validation wall time so far                                          <unit>
    ``time/total_<unit>``       training plus validation wall time so far                            <unit>
    ``time/batches``            micro-batches consumed, summed over data-parallel ranks (*)          batches
    ``time/samples``            samples consumed, summed over data-parallel ranks                    samples
    ``time/tokens``             tokens consumed, summed over data- and context-parallel ranks        tokens
    ==========================  ===================================================================  ========

    (*) Micro-batches, as Lightning's ``ThroughputMonitor`` counts batches: Megatron-Bridge's
    ``time/batches`` counts iterations (optimizer steps over the global batch), data-parallel
    size times accumulation steps below ours (the step axis is that count here).
    ``time/tokens`` sums each context-parallel rank's own tokens: under context parallelism
    each must count its own slice of the sequence (``num_tokens=`` or ``num_tokens_fn``, or
    the batch told after the split); a count read off the batch with more than one
    context-parallel rank is warned about once per run (see :class:`ThroughputMonitor`).

    Megatron-Bridge's ``report_runtime`` writes ``time/remaining_estimate`` and ``time/total``
    without a unit in the name; ours carry the unit (``time/remaining_hours``) and exclude
    validation from the estimate, which theirs does not. A count some rank could not provide
    (no tensor in a batch, no ``input_ids``) is not written, from then on (the total would be
    short). A logging step in which some rank had no micro-batch (the driver splitting a batch
    into two steps at an evaluation, a step restored from a checkpoint) writes none of the
    three; such a step counts as consuming nothing, and the next logging step with
    micro-batches writes them again.

    Example::

        import lightning.pytorch as pl
        from trainvitals import RuntimeMonitor

        trainer = pl.Trainer(max_steps=10_000, callbacks=[RuntimeMonitor(time_unit="hours")])
    """

    def __init__(
        self,
        *,
        max_steps: int | None = None,
        time_unit: str = "hours",
        warmup_steps: int = 1,
        batch_size_fn: Callable[[Any], Any] | None = None,
        num_tokens_fn: Callable[[Any], Any] | None = None,
        clock: Callable[[], float] | None = None,
        log_every_n_steps: int | None = None,
        writer: Any = None,
    ) -> None:
        super().__init__(log_every_n_steps=log_every_n_steps, writer=writer)
        if max_steps is not None and (
            isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps <= 0
        ):
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps!r}")
        if time_unit not in TIME_UNITS:
            raise ValueError(f"time_unit must be one of {sorted(TIME_UNITS)}, got {time_unit!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
        for name, fn in (("batch_size_fn", batch_size_fn), ("num_tokens_fn", num_tokens_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a callable batch -> int, got {fn!r}")
        self.max_steps = max_steps
        self.time_unit = time_unit
        self.warmup_steps = warmup_steps
        self.batch_size_fn = batch_size_fn
        self.num_tokens_fn = num_tokens_fn
        self._clock = TrainClock(clock)
        self._counter = StepCounter()
        self._groups = ProcessGroups()
        self._horizon: int | None = None  # as of the last logging step (run_start: at the start)
        # False once Lightning's manual optimization is seen not to step once per batch: the
        # epochs x batches horizon is then not in optimizer steps (_check_epoch_horizon).
        self._epoch_horizon_usable = True
        self._time_limit: Callable[[], float | None] | None = None  # Lightning Timer's
        self._epoch_horizon_unchecked = False
        self._steps_this_process = 0
        self._rate_anchor: float | None = None  # train-clock reading where the rate starts
        # Steps (in ctx.step units) of this process since the anchor: Lightning's global_step
        # advances once per optimizer, so a batch stepping two optimizers is two steps of the
        # horizon (max_steps), not one.
        self._rate_steps = 0
        self._train_at_step_end: float | None = None  # train-clock reading at the last step end
        # Carried over from earlier processes of the run (checkpoint state).
        self._prev = {"train": 0.0, "validation": 0.0, "total": 0.0}
        self._prev_rate = {"seconds": 0.0, "steps": 0}
        # Training seconds of the step in progress that ran in earlier processes: a checkpoint
        # taken inside a step (a validation inside an accumulation window) keeps the rate up to
        # the last step end, and this apart; the restored step adds it only when its own time
        # is in the rate (warmup_steps=0), else it was counted without its step.
        self._open_carried = 0.0
        # Global consumed counts (synced on logging steps) and this rank's counts since then.
        self._consumed = dict.fromkeys(COUNT_FIELDS[1:], 0.0)
        self._pending = dict.fromkeys(COUNT_FIELDS[1:], 0.0)
        # ranks whose last step had no micro-batch, as of the last sum (_sync_consumed)
        self._empty_ranks = 0.0
        # A validation ended since the time keys were last written: the run's end writes them
        # (the validation after the last training step is no logging step's).
        self._validated_since_write = False
        # Under Lightning with a training dataloader of unknown length (an IterableDataset
        # without __len__): the epoch seen at the last step end and its batches then, and the
        # batches of the last epoch seen to end (the length of later epochs, as with a len).
        self._epoch_seen: tuple[int, int] | None = None
        self._epoch_batches: int | None = None
        self._cp_tokens = ContextParallelTokensCheck("time/tokens")

    # ------------------------------------------------------------------ hooks

    def run_start(self, ctx: RunContext) -> None:
        self._fold_into_previous()  # (a previous run that did not end: no-op otherwise)
        self._groups = ctx.groups
        self._cp_tokens.arm(ctx.groups, self.num_tokens_fn)
        device = ctx.device
        self._clock.sync_fn = (
            partial(torch.cuda.synchronize, device) if device.type == "cuda" else None
        )
        self._epoch_horizon_usable = True
        self._horizon = self._current_horizon(ctx, ctx.step)
        # The epochs x batches horizon counts one optimizer step per accumulated batch. Under
        # Lightning's manual optimization the module steps its optimizers itself (two per batch,
        # or one every few batches): checked at each step_end, see _check_epoch_horizon.
        self._epoch_horizon_unchecked = (
            self.max_steps is None
            and ctx.max_epochs is not None
            and not getattr(ctx.model, "automatic_optimization", True)
        )
        self._time_limit = _lightning_time_limit(ctx.trainer)
        if (
            self._horizon is None
            and self._time_limit is None
            and not (ctx.max_epochs and _lightning_epoch_progress(ctx.trainer) is not None)
        ):
            # (Lightning, max_epochs and a dataloader of unknown length: the horizon is known
            # once the first epoch ends, _note_epoch_length)
            self.warn_once(
                "horizon",
                "training horizon unknown (no max_steps, no epochs x "
                "batches): time/remaining is not written; pass max_steps=",
            )

    def micro_batch_start(self, ctx: RunContext, batch: BatchInfo) -> None:
        if ctx.in_validation:
            return
        self._clock.start()
        self._counter.add(batch.batch_size, batch.num_tokens)
        self._cp_tokens.check(self, batch)

    def validation_start(self, ctx: RunContext) -> None:
        self._clock.pause()  # waits for the device's queued work first (sync_fn)

    def validation_end(self, ctx: RunContext) -> None:
        self._clock.resume()
        self._validated_since_write = True

    def run_end(self, ctx: RunContext) -> None:
        if self._validated_since_write:
            # A validation after the last logging step (Lightning's at the end of the last
            # epoch, the loop's final evaluation): its time is in no written value yet. The
            # clock keys only (rank-local readings, no collective), one step past the last
            # step's row: a point of its own, not a rewrite of a row already delivered.
            self.write(ctx, self._clock_values(self._clock.read()), step=ctx.step)
            self._validated_since_write = False
        # Another run with this instance may follow (a second fit on the same trainer, a retry,
        # a new driver): what this one measured is kept as a restore would keep it, and the
        # clock stops here (the time between the runs is no step's).
        self._fold_into_previous()

    def exception_raised(self, ctx: RunContext, exception: BaseException) -> None:
        self._fold_into_previous()

    def step_end(self, ctx: RunContext) -> None:
        log = self.should_log(ctx)
        if log:
            self._clock.sync()
        if self._epoch_horizon_unchecked:
            self._check_epoch_horizon(ctx)
        self._note_epoch_length(ctx)
        self._clock.start()  # no-op unless no micro-batch was reported
        train_now = self._clock.train_seconds()
        self._train_at_step_end = train_now
        self._steps_this_process += 1
        open_carried, self._open_carried = self._open_carried, 0.0
        if self._rate_anchor is not None:
            self._rate_steps += ctx.step_increment
        elif self.warmup_steps == 0:
            self._rate_anchor = 0.0
            self._rate_steps += ctx.step_increment
            # (this process's first step, in the rate: its part before a restore too)
            self._prev_rate["seconds"] += open_carried
        elif self._steps_this_process >= self.warmup_steps and (log or self._clock.sync_fn is None):
            # The rate starts at the first reading after the warm-up that includes the
            # device's queued work: on an accelerator only a logging step synchronises (the
            # end of the last warm-up step may not log: warmup_steps=2, a resume at a step
            # that is not a multiple of the interval), else the warm-up's queued device work
            # would be charged to the measured steps. No extra sync on a non-logging step.
            self._rate_anchor = train_now
        record = self._counter.take(0.0)
        if record.batches == 0:
            # No micro-batch in this step (the driver split a batch into two steps at an
            # evaluation, a restored step): nothing was reported consumed, so it adds zeros,
            # not a gap, to the totals. Only this step's keys are left out (a loop that never
            # reports micro-batches must not show 0 consumed): the next logging step with
            # micro-batches writes them again. Kept in the summed missing marks, it stopped
            # them for the rest of the run.
            record.samples_missing = record.tokens_missing = 0
        for name in _SUMMED:
            self._pending[name] = self._pending[name] + getattr(record, name)
        # this step's alone (not summed over steps): whether it had no micro-batch
        self._pending["batches_missing"] = float(record.batches_missing)
        if log:
            self._sync_consumed()
            steps_done = ctx.step + ctx.step_increment
            # the horizon as of now (a few Python numbers): max_steps or the dataloader's
            # length may have changed since the run started
            self._horizon = self._current_horizon(ctx, steps_done)
            self.write(ctx, self._values(steps_done, consumed=self._empty_ranks == 0))
            self._validated_since_write = False

    # ------------------------------------------------------------------ what it measures

    def _current_horizon(self, ctx: RunContext, steps_done: int) -> int | None:
        """The training horizon in optimizer steps as the run stands now: ``max_steps`` given
        here, else the smaller of the run's ``max_steps`` and its epochs x batches (see
        :func:`training_horizon`), from the context, which under Lightning follows the trainer
        (a callback or the user may change ``trainer.fit_loop.epoch_loop.max_steps`` or
        ``fit_loop.max_epochs`` mid-run, and ``reload_dataloaders_every_n_epochs`` may load a
        dataloader of another length). Under Lightning the epochs part counts from the start
        of the epoch in progress with its batches (:func:`_lightning_epoch_progress`)."""
        if self.max_steps is not None:
            return self.max_steps
        limits: dict[str, Any] = {
            "max_steps": ctx.max_steps,
            "max_epochs": ctx.max_epochs if self._epoch_horizon_usable else None,
            # (a dataloader of unknown length: the batches of the last epoch seen to end)
            "num_training_batches": ctx.num_training_batches or self._epoch_batches,
            "accumulate_grad_batches": ctx.accumulate_grad_batches,
        }
        progress = _lightning_epoch_progress(ctx.trainer)
        if progress is not None:
            limits["epoch"], limits["batches_done_in_epoch"] = progress
            limits["steps_done"] = steps_done
        # (only max_steps is in optimizer steps when _epoch_horizon_usable is False)
        return training_horizon(**limits)

    def _note_epoch_length(self, ctx: RunContext) -> None:
        """Under Lightning, note the batches of an epoch that ended (read at the first step end of
        the next one) for a training dataloader of unknown length (``num_training_batches``
        infinite: an ``IterableDataset`` without ``__len__``): the epochs x batches horizon then
        takes later epochs to be as long, as it does with a length. A few Python attributes."""
        progress = _lightning_epoch_progress(ctx.trainer)
        if progress is None:
            return
        seen, self._epoch_seen = self._epoch_seen, progress
        if seen is not None and progress[0] > seen[0] and seen[1] > 0:
            self._epoch_batches = seen[1]

    def _check_epoch_horizon(self, ctx: RunContext) -> None:
        """Under manual optimization, keep the epochs x batches horizon only while each batch
        steps exactly once: a batch stepping two optimizers advances ``ctx.step`` (Lightning's
        ``global_step``) by two, and one step every few batches by a fraction, so that horizon
        in steps would be off by that factor (remaining time 0 halfway through a run)."""
        if ctx.step_increment == 1 and ctx.micro_batches_in_step <= 1:
            return
        self._epoch_horizon_unchecked = False
        self._epoch_horizon_usable = False  # the run's max_steps alone is in ctx.step units
        self._horizon = self._current_horizon(ctx, ctx.step + ctx.step_increment)
        if self._horizon is None:
            self.warn_once(
                "manual_horizon",
                "manual optimization does not step once per batch, so the horizon of "
                "max_epochs x batches is not known in optimizer steps: time/remaining is not "
                "written; pass max_steps=",
            )

    def _sync_consumed(self) -> None:
        """Add every rank's counts since the last sync to the global counts (one collective);
        note in ``_empty_ranks`` on how many ranks the last step ended had no micro-batch
        (``batches_missing`` is that step's alone, not a count to add up)."""
        vec = to_vector([self._pending[n] for n in COUNT_FIELDS[1:]]).unsqueeze(0)
        summed = reduce_counts(vec, self._groups)[0].tolist()
        if any(math.isnan(v) for v in summed):
            # another rank's counts are missing (its failure's mark, as NaN on accelerators):
            # keep this rank's pending counts for the next sum instead of adding a partial one
            raise PeerRankFailed("another rank's consumed counts are missing at this step")
        for name, value in zip(COUNT_FIELDS[1:], summed, strict=True):
            if name == "batches_missing":
                self._empty_ranks = value
            else:
                self._consumed[name] += value
            self._pending[name] = 0.0

    def _rate(self, train_now: float) -> tuple[float, int]:
        """(training seconds, steps) the per-step rate is made of, over all processes."""
        seconds, steps = self._prev_rate["seconds"], self._prev_rate["steps"]
        if self._rate_anchor is not None:
            seconds += train_now - self._rate_anchor
            steps += self._rate_steps
        return seconds, steps

    def _clock_values(self, now: dict[str, float]) -> dict[str, Any]:
        """``time/train_<unit>``, ``time/validation_<unit>``, ``time/total_<unit>``: the clock's
        reading ``now`` on top of the restored seconds."""
        unit = self.time_unit
        return {
            f"time/{kind}_{unit}": seconds_to(self._prev[kind] + now[kind], unit)
            for kind in ("train", "validation", "total")
        }

    def _values(self, steps_done: int, *, consumed: bool = True) -> dict[str, Any]:
        """The keys of a logging step; ``consumed=False``: without the consumed counts (a step
        that had no micro-batch on some rank)."""
        now = self._clock.read()
        unit = self.time_unit
        out = self._clock_values(now)
        for name in _CONSUMED if consumed else ():
            # (samples or tokens: not once some micro-batch lacked its count, the total would
            # be short from then on; batches_missing stays 0, see step_end)
            if self._consumed[f"{name}_missing"] == 0:
                out[f"time/{name}"] = self._consumed[name]
        seconds, steps = self._rate(now["train"])
        left = None
        if steps > 0:
            per_step = seconds / steps
            out["time/seconds_per_step"] = per_step
            if self._horizon is not None:
                left = remaining_seconds(per_step, steps_done, self._horizon)
        by_time = self._time_limit() if self._time_limit is not None else None
        if by_time is not None and (left is not None or self._horizon is None):
            # the run stops at whichever of the two limits comes first
            left = max(by_time, 0.0) if left is None else min(left, max(by_time, 0.0))
        if left is not None:
            out[f"time/remaining_{unit}"] = seconds_to(left, unit)
        return out

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Clocks, rate and consumed counts. On a multi-rank run this is collective (every rank's
        counts since the last logging step are summed into the global counts): call it on every
        rank, as Lightning's and Accelerate's checkpointing do."""
        self._sync_consumed()
        now = self._clock.read()
        # The rate ends at the last step end, as at a run's end (_fold_into_previous): the
        # seconds since then are the step in progress's, which ends in the restored process,
        # kept apart. In the rate they were charged to no step when the restored step is a
        # warm-up step (the default): a checkpoint at a validation inside an accumulation
        # window made the resumed seconds_per_step 6.0 instead of 3.5.
        last = self._train_at_step_end
        seconds, steps = self._rate(now["train"] if last is None else last)
        open_seconds = (
            now["train"] - last if last is not None else now["train"] + self._open_carried
        )
        return {
            "seconds": {kind: self._prev[kind] + now[kind] for kind in self._prev},
            "rate": {"seconds": seconds, "steps": steps},
            "rate_open_seconds": open_seconds,
            "consumed": dict(self._consumed),
            "epoch_batches": self._epoch_batches,
        }

    def state_dict_collectives(self) -> tuple[CollectiveCall, ...]:
        return count_reduction_calls(1, self._groups)  # _sync_consumed's one row

    def _fold_into_previous(self) -> None:
        """Keep this run's clocks and rate as earlier runs' (what a checkpoint carries) and
        start afresh: a new clock and warm-up, no micro-batch of an unfinished step. The rate
        ends at the last step's end (the time after it, the run's end, belongs to no step)."""
        if not (self._clock.started or self._clock.paused):
            return  # nothing measured since the last fold or restore
        now = self._clock.read()
        last = self._train_at_step_end
        seconds, steps = self._rate(now["train"] if last is None else last)
        self._prev = {kind: self._prev[kind] + now[kind] for kind in self._prev}
        self._prev_rate = {"seconds": seconds, "steps": steps}
        self._restart()

    def _restart(self) -> None:
        self._train_at_step_end = None
        self._epoch_seen = None  # (the next run's first step end reads it afresh)
        self._counter.reset()
        self._clock = self._clock.fresh()
        self._steps_this_process = 0
        self._rate_anchor = None
        self._rate_steps = 0
        self._open_carried = 0.0  # (an unfinished step's time is no step's)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        seconds = state_dict.get("seconds", {})
        self._prev = {k: float(seconds.get(k, 0.0)) for k in self._prev}
        rate = state_dict.get("rate", {})
        self._prev_rate = {
            "seconds": float(rate.get("seconds", 0.0)),
            "steps": int(rate.get("steps", 0)),
        }
        # (0 for checkpoints saved before it existed: their rate holds these seconds)
        open_seconds = float(state_dict.get("rate_open_seconds", 0.0))
        consumed = state_dict.get("consumed", {})
        self._consumed = {k: float(consumed.get(k, 0.0)) for k in self._consumed}
        self._consumed["batches_missing"] = 0.0  # (no longer summed; older checkpoints did)
        epoch_batches = state_dict.get("epoch_batches")
        self._epoch_batches = None if epoch_batches is None else int(epoch_batches)
        self._pending = dict.fromkeys(self._pending, 0.0)
        # Micro-batches of a step in progress at the restore belong to the abandoned timeline
        # (the restored run replays that step): not counted into the next step. This process
        # starts its own clock and its own warm-up.
        self._restart()
        self._open_carried = open_seconds


def _lightning_epoch_progress(trainer: Any) -> tuple[int, int] | None:
    """(the epoch in progress, its batches so far) of ``trainer`` (a Lightning ``Trainer``;
    the batches are kept by a checkpoint taken mid-epoch), or ``None`` when it has no such
    loops (no trainer: the driver). Python attributes only: no sync, no collective."""
    if trainer is None:
        return None
    try:
        epoch = trainer.current_epoch
        done_in_epoch = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    except AttributeError:
        return None
    if not isinstance(epoch, int) or not isinstance(done_in_epoch, int):
        return None
    return epoch, done_in_epoch


def _lightning_time_limit(trainer: Any) -> Callable[[], float | None] | None:
    """``time_remaining`` of the Lightning ``Timer`` that stops ``trainer`` mid-epoch at a time
    limit (``Trainer(max_time=)`` adds one), or ``None``: no trainer, no such Timer."""
    timer_types = tuple(
        getattr(module, "Timer", None)
        for module in (
            sys.modules.get("lightning.pytorch.callbacks"),
            sys.modules.get("pytorch_lightning.callbacks"),
        )
        if module is not None
    )
    timer_types = tuple(t for t in timer_types if isinstance(t, type))
    if trainer is None or not timer_types:
        return None
    for callback in getattr(trainer, "callbacks", None) or ():
        if (
            isinstance(callback, timer_types)
            and callback.time_remaining() is not None
            # "epoch": stops at the end of the epoch the limit falls in, not at the limit
            and getattr(callback, "_interval", "step") != "epoch"
        ):
            return callback.time_remaining
    return None
