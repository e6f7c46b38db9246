"""The callback base: one class that runs under Lightning and under the :class:`Vitals` driver.

A trainvitals callback implements a small, framework-neutral set of hooks:

==============================  ==================================================================
hook                            when
==============================  ==================================================================
``run_start(ctx)``              once, when training starts (model, optimizers, writer, groups set)
``micro_batch_start(ctx, b)``   before the forward pass of every training micro-batch; ``b`` (a
                                :class:`BatchInfo`) carries the batch and its sample/token counts
``before_optimizer_step(ctx)``  once per optimizer step, when gradients are complete: after AMP
                                unscaling, before clipping (under the driver, not at a step whose
                                gradients are still multiplied by the loss scale: warned)
``step_end(ctx)``               once per optimizer step, after ``optimizer.step()`` and after every
                                micro-batch of that step has ended
``validation_start(ctx)``       validation begins (time until it ends is not training time)
``validation_end(ctx)``         validation ends
``exception_raised(ctx, exc)``  training raised: remove hooks, keep state
``run_end(ctx)``                training ended normally
==============================  ==================================================================

``ctx.step`` is the index of the optimizer step in progress, counted from 0 (Lightning's
``trainer.global_step`` before the step; the driver's own counter), so step 0 is the first
optimizer step and is always a logging step. Values are written with this step.

The same instance is a Lightning callback: :class:`VitalsCallback` defines every Lightning
``Callback`` hook (duck typing, so it works with both ``lightning.pytorch`` and
``pytorch_lightning`` Trainers without importing either) and translates them to the hooks above.

A callback that raises inside a training hook never ends the run: it is reported once with a
warning and, in a single process, disabled for the rest of that run; a later run with the same
instance (another ``trainer.fit``, a retried fit, a new driver) runs it again. With several
ranks it keeps running instead (its values for the failing step are missing), because
disabling it on the rank that failed would leave the other ranks waiting in its next
collective. A hook that fails part-way, after some of its collectives and before the others,
has the rest issued for it with a "missing" mark
(:func:`trainvitals.distributed.replay_missing`): the same collectives as the last call of the
same hook with the same :meth:`VitalsCallback.collective_key`. The other ranks then leave the
step's values out too (:class:`~trainvitals.distributed.PeerRankFailed`; NaN results on
accelerators) instead of waiting, or pairing this step's collective with the failed rank's
next one; every later step is reduced as usual. Only a failure at the first call of a key (no
earlier call to copy) cannot be completed; it is reported as such. Where a rank-local failure
is likeliest, before a collective (the norm and moment kernels: out of memory), the callbacks
catch it themselves and send "not measured" values (NaN, or -inf for a sum of squares) through
the step's collectives, so every rank stays in step and the other values of the step are still
written; modules' forward/gradient hooks installed by a callback run outside this guard and
catch their own failures. Set ``TRAINVITALS_STRICT=1`` (the
test suite does) to re-raise. Configuration errors (``ValueError``/``TypeError``) are raised at
construction or at run start, on every rank, before any collective.

``state_dict``/``load_state_dict`` are guarded too (every subclass's own definition is wrapped
when the class is made), since checkpointing calls them outside the hooks: a failing
``state_dict`` is warned and returns a marker state in place of the callback's, which a later
``load_state_dict`` skips with a warning; a failing ``load_state_dict`` is warned and the
callback goes on from its state before the restore. A failing ``state_dict`` of a callback whose
state is collective (:meth:`VitalsCallback.state_dict_collectives`) has its remaining
collectives issued with the "missing" mark, so the other ranks' ``state_dict`` return the
marker too instead of waiting. Under Lightning only a fit's restore loads the callbacks' state:
``trainer.validate/test/predict(ckpt_path=)`` leave it (and the trainer's ``global_step``) as it
is, so a later ``fit`` on the same trainer goes on with the counters of its own steps.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainvitals._patching import AttributePatch
from trainvitals._strict import strict as _strict
from trainvitals.adapters.context import (
    BatchInfo,
    ReplayWriter,
    RunContext,
    infer_batch_size,
    infer_num_tokens,
    needs_replay_floor,
)
from trainvitals.distributed import (
    CollectiveCall,
    PeerRankFailed,
    ProcessGroups,
    recording_collectives,
    replay_missing,
)
from trainvitals.stats.norms import is_flat_shard

_WRITER_ATTR = "_trainvitals_writer"
# (global_step at the start of the trainer's last training batch, that batch's ctx.step_gap):
# on the trainer, which outlives its fits; saved in Lightning checkpoints under _CKPT_KEY
_LAST_BATCH_ATTR = "_trainvitals_last_batch"
_CKPT_KEY = "trainvitals_lightning"
# (global_step, [per micro-batch: {state_key: (batch_size, num_tokens)}]): the micro-batches of
# the step in progress that a checkpoint taken inside its accumulation window carried, from
# on_load_checkpoint to the resumed fit's context (on_train_start)
_CARRIED_ATTR = "_trainvitals_carried"
# the trainer's global_step when its last fit that trained ended normally (teardown): a later fit
# starting there continues that fit's timeline (see _lightning_writer); None after a crash
_ENDED_AT_ATTR = "_trainvitals_fit_ended_at"


def compile_regex(arg: str, pattern: Any, *, optional: bool = False) -> re.Pattern[str]:
    """``pattern`` compiled for the argument ``arg``: not a string, ``TypeError``; not a valid
    regex, ``ValueError``; both naming ``arg`` (at construction, before any collective).
    ``optional``: the message says ``None`` is allowed too (the caller handles it)."""
    if not isinstance(pattern, str):
        allowed = "None or a regex string" if optional else "a regex string"
        raise TypeError(f"{arg} must be {allowed}, got {type(pattern).__name__}")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{arg} is not a valid regex: {exc}") from exc


def compile_one_group(arg: str, pattern: str | None) -> re.Pattern[str] | None:
    """``pattern`` compiled, for an argument ``arg`` whose one capture group names a tensor's
    group (a layer index, an expert index, a label); ``None`` stays ``None``. Not a string:
    ``TypeError``; not a valid regex, or not exactly one capture group: ``ValueError``, both
    naming ``arg`` (at construction, before any collective)."""
    if pattern is None:
        return None
    compiled = compile_regex(arg, pattern, optional=True)
    if compiled.groups != 1:
        raise ValueError(
            f"{arg} must have exactly one capture group (the label), {pattern!r} has "
            f"{compiled.groups}"
        )
    return compiled


def _positive_int_or_none(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return value


#: :func:`flat_sharding`'s answers
DEEPSPEED = "DeepSpeed (ZeRO keeps gradients outside p.grad and partitions parameters)"
FSDP1 = "FSDP1 (FullyShardedDataParallel: flat parameter shards)"


def flat_sharding(model: Any, ctx: RunContext) -> str | None:
    """The layout's name when parameters and gradients are flat plain-tensor shards
    (:data:`FSDP1`, :data:`DEEPSPEED`), else ``None``; a callback that reads per-parameter
    values must not take them for whole tensors.

    FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) concatenates a wrapped
    module's parameters into one ``FlatParameter`` (``_is_flat_param``) and keeps each rank's
    slice of it; under ``use_orig_params=True`` the original parameters (``_fsdp_flattened``,
    torch's ``_set_fsdp_flattened``) are views into that slice, whole, partial or empty on a
    rank. Both marks are looked for too, so the inner module of a root-only wrap (Lightning's
    ``pl_module``, ``accelerator.unwrap_model``) is caught. DeepSpeed ZeRO keeps gradients
    outside ``p.grad`` and ZeRO-3 parameters are empty ``ds_tensor`` partitions. FSDP2
    (``fully_shard``, Lightning's ``ModelParallelStrategy``, Accelerate's ``fsdp_version=2``)
    shards as ``DTensor`` s and is not flagged. Names only, no import: Lightning,
    Accelerate and DeepSpeed stay optional. Looks at every module and parameter (run start)."""
    strategy = getattr(ctx.trainer, "strategy", None) if ctx.trainer is not None else None
    strategy_names = {c.__name__ for c in type(strategy).__mro__} if strategy is not None else set()
    accelerator = ctx.accelerator
    kind = getattr(accelerator, "distributed_type", None)
    distributed = getattr(kind, "value", kind)  # (accelerate's DistributedType is a str enum)
    if any("DeepSpeed" in n for n in strategy_names) or distributed == "DEEPSPEED":
        return DEEPSPEED
    # (Lightning's FSDPStrategy is FSDP1; its ModelParallelStrategy, FSDP2, is another class)
    if "FSDPStrategy" in strategy_names:
        return FSDP1
    if distributed == "FSDP" and not getattr(accelerator, "is_fsdp2", False):
        return FSDP1
    if model is None:
        return None
    # (a unit whose parameters are all frozen, a teacher wrapped in FSDP1 inside a student
    # trained plainly, holds nothing a callback measures: the student's are whole tensors)
    for m in model.modules():
        names = {c.__name__ for c in type(m).__mro__}
        if "DeepSpeedEngine" in names:
            return DEEPSPEED
        if "FullyShardedDataParallel" in names and any(p.requires_grad for p in m.parameters()):
            return FSDP1
    for p in model.parameters():
        if is_flat_shard(p) and p.requires_grad:
            return FSDP1
        if hasattr(p, "ds_tensor"):
            return DEEPSPEED
    return None


class VitalsCallback:
    """Base class of every trainvitals callback.

    Args:
        log_every_n_steps: log on optimizer steps ``0, n, 2n, ...`` (a batch of several steps:
            see :meth:`should_log`). ``None`` takes the run's setting: Lightning's
            ``Trainer(log_every_n_steps=...)`` or the driver's.
        writer: where values go. ``None`` takes the run's writer: under Lightning
            ``FanoutWriter.from_lightning(trainer)`` (one per trainer, shared by all callbacks;
            a JSONL file ``metrics.jsonl`` in the run folder when the trainer has no logger),
            under the driver the driver's writer. A ``FanoutWriter`` given here outlives
            rollbacks and later runs of this instance: when a run goes back below the highest
            step the callback reached (a restore from an earlier checkpoint, a second run
            from step 0), the steps below that one are dropped from it with a warning, since
            it refuses steps lower than those it was given.
    """

    # Callbacks that count samples/tokens set these; declared here so that the driver's per
    # micro-batch look-up finds None instead of going through ``__getattr__`` and an exception.
    batch_size_fn: Any = None
    num_tokens_fn: Any = None

    def __init__(self, *, log_every_n_steps: int | None = None, writer: Any = None) -> None:
        self.log_every_n_steps = _positive_int_or_none("log_every_n_steps", log_every_n_steps)
        self._writer_override = writer
        self._ctx: RunContext | None = None
        self._disabled = False
        self._warned: set[str] = set()
        # the collectives of the last successful call per collective_key (several ranks only)
        self._collective_schemas: dict[Hashable, tuple[CollectiveCall, ...]] = {}
        self._runs_started = 0
        # the highest step this instance was called at, over all its runs; and the floor of
        # its own writer= when a later run starts below it (RunContext.replay_floor)
        self._highest_step = -1
        self._replay_floor: int | None = None
        # Lightning adapter state
        self._pl_last_global_step: int | None = None

    # ------------------------------------------------------------------ neutral hooks

    def run_start(self, ctx: RunContext) -> None:
        """Training starts."""

    def micro_batch_start(self, ctx: RunContext, batch: BatchInfo) -> None:
        """A training micro-batch is about to run its forward pass."""

    def before_optimizer_step(self, ctx: RunContext) -> None:
        """Gradients of the step are complete (unscaled, not yet clipped)."""

    def step_end(self, ctx: RunContext) -> None:
        """The optimizer step ``ctx.step`` finished."""

    def validation_start(self, ctx: RunContext) -> None:
        """Validation starts."""

    def validation_end(self, ctx: RunContext) -> None:
        """Validation ended."""

    def exception_raised(self, ctx: RunContext, exception: BaseException) -> None:
        """Training raised."""

    def run_end(self, ctx: RunContext) -> None:
        """Training ended."""

    # Subclasses override these as usual; VitalsCallback.__init_subclass__ puts each class's own
    # definition under the checkpoint guard (_guard_state_dict, _guard_load_state_dict).
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def state_dict_collectives(self) -> tuple[CollectiveCall, ...]:
        """The collectives ``state_dict`` issues on a multi-rank run, in order, known from the
        configuration alone (the same on every rank whatever its state): the checkpoint guard
        issues those a failed ``state_dict`` did not reach, with the "missing" mark, so that no
        other rank waits in them. Default: none (a ``state_dict`` without collectives)."""
        return ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Lightning (trainer.save_checkpoint, ModelCheckpoint, fit(ckpt_path=)) and the driver
        # (Vitals.state_dict, accelerator.save_state/load_state) call these two directly, outside
        # _dispatch: each subclass's own definition is wrapped here, so every callback, the
        # user's too, keeps its public methods and gets the guard.
        for name, guard in (
            ("state_dict", _guard_state_dict),
            ("load_state_dict", _guard_load_state_dict),
        ):
            method = vars(cls).get(name)
            if inspect.isfunction(method) and not hasattr(method, _GUARDED):
                setattr(cls, name, guard(method))

    # ------------------------------------------------------------------ helpers for subclasses

    def interval(self, ctx: RunContext) -> int:
        return self.log_every_n_steps or ctx.log_every_n_steps

    def should_log(
        self, ctx: RunContext, step: int | None = None, *, every: int | None = None
    ) -> bool:
        """Whether the batch whose first optimizer step is ``step`` (default ``ctx.step``) logs,
        with an interval of ``every`` steps (default :meth:`interval`).

        A batch logs when one of the ``ctx.step_gap`` steps since the previous batch's first,
        ``step - step_gap + 1 .. step``, is a multiple of the interval: with one step per batch
        the steps ``0, n, 2n, ...``. When a batch is several steps (Lightning's manual
        optimization stepping two optimizers: ``global_step`` advances by 2 per batch), each
        multiple of ``n`` is logged by the first batch starting at or after it, so the interval
        holds in optimizer steps; testing the first step alone logged every ``lcm(n, 2)``
        steps (``n=3``: every 6). The rule needs only what is known when the batch starts
        (not its own increment), so ``micro_batch_start`` and ``step_end`` agree. A ``step``
        other than ``ctx.step`` is judged as a batch of one step."""
        every = every or self.interval(ctx)
        if step is None or step == ctx.step:
            step, gap = ctx.step, max(1, ctx.step_gap)
        else:
            gap = 1
        # a multiple of `every` lies in (step - gap, step]
        return step % every < gap

    def writer(self, ctx: RunContext, step: int | None = None) -> Any:
        """Where this callback's values go; ``step``: the step about to be written (default
        ``ctx.step``), which decides, when it makes the run's Lightning writer, whether that
        writer resumes (see ``_lightning_writer``)."""
        if self._writer_override is not None:
            writer = self._writer_override
            floors = (ctx.replay_floor, self._replay_floor)
        else:
            if ctx.writer is None and ctx.trainer is not None:
                # Under Lightning the run's writer is made on first use, so callbacks that all
                # bring their own writer never need the default one.
                first = ctx.step if step is None else step
                ctx.writer = _lightning_writer(ctx.trainer, ctx.run_dir, ctx.start_step, first)
            writer = ctx.writer
            floors = (ctx.replay_floor if ctx.replay_run_writer else None,)
        floor = max((f for f in floors if f is not None), default=None)
        if floor is not None and needs_replay_floor(writer):
            # The run went back to an earlier step and this writer holds the abandoned steps,
            # refusing lower ones: it gets the restored timeline from where those stopped.
            return ReplayWriter(writer, floor, ctx)
        return writer

    def write(self, ctx: RunContext, values: Mapping[str, Any], step: int | None = None) -> None:
        """Hand ``values`` (numbers or 0-d tensors, not modified afterwards) to the writer."""
        if values:
            step = ctx.step if step is None else step
            self.writer(ctx, step).add_scalars(dict(values), step)

    def warn_once(self, key: str, message: str) -> None:
        self._warn_first(key, f"{type(self).__name__}: {message}", stacklevel=4)

    def warn_meta_parameters(self, names: Sequence[str], left_out_of: str) -> None:
        """Warn once that the trainable parameters ``names`` are on the ``meta`` device
        (deferred initialisation never materialised): they have no values, so they are left
        out of ``left_out_of`` (reading one would fail the hook and disable the callback)."""
        if not names:
            return
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        self._warn_first(  # (one frame deeper than warn_once: the caller's line is named)
            "meta",
            f"{type(self).__name__}: {len(names)} trainable parameter(s) on the meta device "
            f"(never materialised: {shown}) have no values and are left out of {left_out_of}",
            stacklevel=5,
        )

    def tolerate_failure(self, key: str, what: str, exc: Exception, consequence: str) -> None:
        """A rank-local failure the callback recovers from itself (it goes on with "not
        measured" values so that this rank still reaches its collectives): re-raised under
        ``TRAINVITALS_STRICT``, otherwise warned once per ``key``."""
        if _strict():
            raise exc
        self.warn_once(
            key,
            f"{what} raised {type(exc).__name__}: {exc}; {consequence} "
            "(training continues; warned once)",
        )

    @property
    def state_key(self) -> str:
        """Key of this callback's state in checkpoints (Lightning and the driver): the class
        name, unless assigned. Two instances of one class in one run need keys of their own
        (``monitor.state_key = "norms_per_layer"``): Lightning refuses two stateful callbacks
        with one key, and so does the driver."""
        named = getattr(self, "_state_key", None)
        return type(self).__qualname__ if named is None else named

    @state_key.setter
    def state_key(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise TypeError(f"state_key must be a non-empty str, got {value!r}")
        self._state_key = value

    # ------------------------------------------------------------------ dispatch with guard

    def collective_key(self, hook: str, ctx: RunContext) -> Hashable:
        """What decides which collectives ``hook`` issues at this step, evaluated before the
        hook runs: two calls with the same key must issue the same collectives (kinds, groups,
        sizes), or agree on their sizes through an object gather first. The guard completes a
        call that failed part-way with the collectives of the last call with the same key.
        Default: the hook and whether the step logs; override when a callback has several
        intervals. ``None`` records nothing (such a call cannot be completed)."""
        return (hook, self.should_log(ctx))

    def _dispatch(self, hook: str, ctx: RunContext, *args: Any) -> None:
        if hook == "run_start":
            self._start_new_run(ctx)
        if ctx.step > self._highest_step:
            self._highest_step = ctx.step
        if self._disabled:
            return
        self._ctx = ctx
        if hook == "run_start":
            self._runs_started += 1
            if self._runs_started > 1 and ctx.step == 0:
                # One instance in a second run from step 0 (a new Trainer, a new Vitals): its
                # counters, windows and estimates go on from the first run.
                self._warn_first(
                    "reused",
                    f"{type(self).__name__}: this instance already ran and starts a new run "
                    "at step 0; its counters, windows and estimates continue from the "
                    "earlier run. Create new callback instances for each run",
                    stacklevel=3,
                )
        several = ctx.world_size > 1
        key = self._collective_key_or_none(hook, ctx) if several else None
        # (one process: no collectives to record)
        with recording_collectives() if several else contextlib.nullcontext([]) as issued:
            try:
                getattr(self, hook)(ctx, *args)
            except Exception as exc:
                failure = exc
            else:
                if key is not None:
                    self._collective_schemas[key] = tuple(issued)
                return
        if _strict():
            raise failure
        if hook == "run_start" and isinstance(failure, ValueError | TypeError):
            # A configuration error (a glob matching nothing, no router found): the user
            # must fix it, and at run start it costs nothing and is raised on every rank.
            raise failure
        if several:
            # Disabling on this rank alone would leave the other ranks waiting forever in
            # this callback's next collective. Keep calling it: a failure that happens on
            # every rank keeps happening on every rank, one that does not leaves the later
            # steps in lockstep once this step's collectives are completed.
            completed = self._complete_collectives(key, issued)
            where = f"{type(self).__name__}.{hook}"
            if isinstance(failure, PeerRankFailed):
                what = f"trainvitals: {where}: {failure}"
            else:
                what = f"trainvitals: {where} raised {type(failure).__name__}: {failure}"
            if not completed:
                self._warn_first(
                    "guard:incomplete",
                    f"{what}; its remaining collectives of this step, if it has any, could not be "
                    "issued (no earlier call with the same collectives to copy), so the other "
                    "ranks may wait in them. Set TRAINVITALS_STRICT=1 to raise instead.",
                )
            elif isinstance(failure, PeerRankFailed):
                self._warn_first(
                    "guard:peer",
                    f"{what}; training continues and the callback keeps working; this "
                    "step's values of this callback are missing on every rank.",
                )
            else:
                self._warn_first(
                    "guard:failure",
                    f"{what}; training continues and the callback keeps running (disabling "
                    "it on one rank could hang the others); its values for this step are "
                    "missing (its remaining collectives were issued with a 'missing' mark, "
                    "so every rank leaves them out). Set TRAINVITALS_STRICT=1 to raise "
                    "instead.",
                )
            return
        self._disabled = True
        # (the run's number makes a second run's message new to Python's once-per-location
        # warning filter, which would otherwise hide the same failure in a later fit)
        run = f" (run {self._runs_started} of this instance)" if self._runs_started > 1 else ""
        warnings.warn(
            f"trainvitals: {type(self).__name__}.{hook} raised {type(failure).__name__}: "
            f"{failure}; the callback is disabled for the rest of the run{run} (training "
            "continues). Set TRAINVITALS_STRICT=1 to raise instead.",
            RuntimeWarning,
            stacklevel=2,
        )
        try:
            self.release(ctx)
        except Exception as exc:  # what it could not release stays; the run goes on
            self._warn_first(
                "guard:release",
                f"trainvitals: {type(self).__name__}.release raised {type(exc).__name__}: {exc}",
            )

    def release(self, ctx: RunContext) -> None:
        """Called once when the guard disables this callback (one process, a hook raised):
        none of its later hooks runs, ``step_end`` and ``run_end`` included, so a callback that
        installs hooks on the model or holds tensors between its hooks removes and drops them
        here. A later run re-enables the callback and starts with ``run_start`` as usual."""

    def _start_new_run(self, ctx: RunContext) -> None:
        """A new run (a new ``trainer.fit``, a retried fit, a new driver) starts: what the
        guard concluded about the previous one no longer holds. A callback it disabled runs
        again, and warns again if it fails again; the recorded collectives belong to the
        earlier run's process groups, so none is replayed into this one. When an earlier run
        got further than this one starts (a retry from an earlier checkpoint, a second run
        from step 0), the callback's own ``writer=`` holds those steps: see ``writer()``."""
        if ctx.step < self._highest_step:
            self._replay_floor = max(self._replay_floor or 0, self._highest_step)
        self._disabled = False
        self._collective_schemas.clear()
        self._warned = {key for key in self._warned if not key.startswith("guard:")}

    def _collective_key_or_none(self, hook: str, ctx: RunContext) -> Hashable | None:
        """:meth:`collective_key`, or None (nothing recorded, nothing completed) when it raises:
        an override's bug must not end the run either."""
        try:
            return self.collective_key(hook, ctx)
        except Exception as exc:
            if _strict():
                raise
            self._warn_first(
                "guard:key",
                f"trainvitals: {type(self).__name__}.collective_key raised "
                f"{type(exc).__name__}: {exc}; a failure of this callback on one rank can "
                "no longer be completed on the others",
            )
            return None

    def _complete_collectives(self, key: Hashable, issued: list[CollectiveCall]) -> bool:
        """Issue, with the "missing" mark, the collectives a failed call did not reach: the
        rest of the last successful call with the same key, when the failed call's own
        collectives are its beginning. False when there is no such call (or issuing failed)."""
        schema = None if key is None else self._collective_schemas.get(key)
        return schema is not None and _replay_rest(schema, issued)

    def _warn_first(self, key: str, message: str, stacklevel: int = 3) -> None:
        """Warn ``message`` once per ``key`` (:meth:`warn_once` without the class prefix, for
        the guard's messages, which name the callback and hook themselves)."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)

    # ------------------------------------------------------------------ Lightning adapter
    # Every Lightning Callback hook is defined here (duck typing): the Trainer calls
    # getattr(callback, hook)(trainer, pl_module, ...).

    def _pl_context(self, trainer: Any, pl_module: Any) -> RunContext:
        ctx = getattr(trainer, "_trainvitals_ctx", None)
        if ctx is None:
            ctx = _context_from_trainer(trainer, pl_module)
            trainer._trainvitals_ctx = ctx
        return ctx

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # A fit that raised never reached teardown (Lightning calls on_exception instead): its
        # context still holds that fit's model, optimizers and micro-batch counts. A later fit
        # on the same trainer (a retry from a checkpoint) builds its own at on_train_start.
        if (ctx := getattr(trainer, "_trainvitals_ctx", None)) is not None:
            _remove_batch_start_gate(ctx)
            trainer._trainvitals_ctx = None
            setattr(trainer, _ENDED_AT_ATTR, None)
            # and its writer, which refuses the lower steps of a retry from an earlier
            # checkpoint (a new one is made at first use; the JSONL resume rule drops the
            # crashed fit's lines past the checkpoint)
            writer = getattr(trainer, _WRITER_ATTR, None)
            if writer is not None:
                setattr(trainer, _WRITER_ATTR, None)
                writer.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # (an evaluation's restore whose load_state_dict did not come: an empty state)
        self.__dict__.pop(_SKIP_LOAD, None)
        writer = getattr(trainer, _WRITER_ATTR, None)
        if writer is not None:
            # The first callback to tear down closes the shared writer; a later fit() on the
            # same trainer builds a fresh context and writer.
            setattr(trainer, _WRITER_ATTR, None)
            writer.close()
        if (ctx := getattr(trainer, "_trainvitals_ctx", None)) is not None:
            _remove_batch_start_gate(ctx)
            trainer._trainvitals_ctx = None
            setattr(trainer, _ENDED_AT_ATTR, trainer.global_step)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.log_every_n_steps is None and not trainer.log_every_n_steps:
            # Lightning's 0 (also set by barebones=True) turns its own logging off; an interval
            # of 0 steps means nothing here. A configuration error, raised on every rank.
            raise ValueError(
                f"{type(self).__name__}: Trainer(log_every_n_steps="
                f"{trainer.log_every_n_steps!r}) turns Lightning's logging off, and this "
                "callback takes its interval from the trainer; pass log_every_n_steps= (a "
                "positive int) to the callback"
            )
        ctx = self._pl_context(trainer, pl_module)
        if not hasattr(ctx, "_pl_carried"):  # (the first callback's on_train_start of the fit)
            ctx._pl_carried = getattr(trainer, _CARRIED_ATTR, None)
            ctx._pl_replayed = set()
            setattr(trainer, _CARRIED_ATTR, None)
        if getattr(ctx, "_pl_gate", None) is None and _overrides_batch_start(pl_module):
            ctx._pl_gate = _BatchStartGate(pl_module)
        if getattr(ctx, "_pl_clip", None) is None and not pl_module.automatic_optimization:
            ctx._pl_clip = _ManualClipGate.install(trainer, pl_module)
        self._pl_last_global_step = trainer.global_step
        ctx.step = ctx.start_step = trainer.global_step
        self._dispatch("run_start", ctx)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        ctx = self._pl_context(trainer, pl_module)
        start = functools.partial(self._pl_micro_batch_start, ctx, trainer, batch, batch_idx)
        gate = getattr(ctx, "_pl_gate", None)
        if gate is not None and gate.module is pl_module:
            gate.pending.append(start)  # run once the module's own hook has kept the batch
        else:
            start()

    def _pl_micro_batch_start(
        self, ctx: RunContext, trainer: Any, batch: Any, batch_idx: int
    ) -> None:
        ctx.step = trainer.global_step
        # (the epoch too: batch_idx restarts at 0 each epoch, and a batch that did not step
        # leaves global_step as it was, so with one batch per epoch, e.g. overfit_batches=1
        # or limit_train_batches=1 under manual optimization stepping every other batch,
        # (global_step, batch_idx) repeats and the next epoch's batch went uncounted)
        batch_key = (trainer.global_step, batch_idx, getattr(trainer, "current_epoch", None))
        previous = getattr(ctx, "_pl_batch_key", None)
        carried = getattr(ctx, "_pl_carried", None)
        if carried is not None and (
            previous not in (None, batch_key) or carried[0] != trainer.global_step
        ):
            carried = ctx._pl_carried = None  # (the restored step is over, or never came)
        if previous != batch_key:
            # The context is shared by all callbacks of the trainer: only the first callback to
            # see this batch advances the micro-batch count.
            if previous is None or previous[0] != trainer.global_step:
                ctx.micro_batches_in_step = 0
                # how far the previous batch advanced global_step: the logging decision of
                # this batch (should_log). At a fit's first batch the previous batch is the
                # one before the checkpoint (ckpt_path=) or of the trainer's previous fit
                ctx.step_gap = _step_gap(trainer, previous)
                # the sizes of the step's micro-batches, for a checkpoint inside its window
                # (on_save_checkpoint); a restored step goes on from those it carried
                ctx._pl_window = [dict(sizes) for sizes in carried[1]] if carried else []
            ctx._pl_batch_key = batch_key
            ctx.micro_batch = ctx.micro_batches_in_step
            ctx.micro_batches_in_step += 1
            if ctx._pl_window is not None:
                from trainvitals.adapters.loop import _window_bound

                if len(ctx._pl_window) < _window_bound(
                    ctx.accumulate_grad_batches, len(carried[1]) if carried else 0
                ):
                    ctx._pl_window.append({})
                else:  # no step for longer than any window: not one to carry (the driver's rule)
                    ctx._pl_window = None
            setattr(trainer, _LAST_BATCH_ATTR, (batch_key[0], ctx.step_gap))
        if carried is not None and self.state_key not in ctx._pl_replayed:
            # A fit resumed from a checkpoint taken inside an accumulation window (after
            # micro-batch k of this step: a mid-window val_check_interval, a train-time
            # interval, a save_checkpoint of the loop's own): Lightning goes on at micro-batch
            # k + 1 and steps at the window's end, so the k micro-batches the checkpoint
            # carried are told first, with batch=None and the sizes told then, as the driver
            # does (trainvitals.adapters.loop, _replay_carried): the step's batches, samples
            # and tokens are those of an uninterrupted run.
            ctx._pl_replayed.add(self.state_key)
            for sizes in carried[1]:
                if self.state_key in sizes:
                    batch_size, num_tokens = sizes[self.state_key]
                    self._dispatch(
                        "micro_batch_start", ctx, BatchInfo(None, batch_size, num_tokens)
                    )
        info = self._batch_info(batch)
        if ctx._pl_window is not None:
            ctx._pl_window[-1][self.state_key] = (info.batch_size, info.num_tokens)
        self._dispatch("micro_batch_start", ctx, info)

    def _batch_info(self, batch: Any) -> BatchInfo:
        return BatchInfo(
            batch=batch,
            batch_size=self._batch_count(batch, "batch_size_fn", infer_batch_size),
            num_tokens=self._batch_count(batch, "num_tokens_fn", infer_num_tokens),
        )

    def _batch_count(
        self, batch: Any, attr: str, default: Callable[[Any], int | None]
    ) -> int | None:
        """``batch_size_fn``/``num_tokens_fn`` (the user's) of ``batch``; None (a count not
        reported) when it raises, which must not end the run: it runs outside the guard."""
        fn: Callable[[Any], int | None] = getattr(self, attr, None) or default
        try:
            return fn(batch)
        except Exception as exc:
            self.tolerate_failure(
                attr, attr, exc, "counts of such batches are missing (not reported)"
            )
            return None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        ctx = self._pl_context(trainer, pl_module)
        clip = getattr(ctx, "_pl_clip", None)
        if clip is not None and clip.shown_before_clipping(optimizer, ctx.step):
            return  # the callbacks saw this step()'s gradients when its clipping started
        _release_batch_start_gate(ctx)
        ctx.stepping_optimizer = optimizer
        try:
            self._dispatch("before_optimizer_step", ctx)
        finally:
            ctx.stepping_optimizer = None

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ctx = self._pl_context(trainer, pl_module)
        _release_batch_start_gate(ctx)
        last = self._pl_last_global_step
        if last is not None and trainer.global_step > last:
            _refresh_limits(ctx, trainer)
            # One optimizer step finished (the step index is the one before the increment).
            # Under manual optimization every optimizer.step() increments global_step, so one
            # batch with several optimizers advances it by more than one.
            ctx.step = last
            ctx.step_increment = trainer.global_step - last
            self._dispatch("step_end", ctx)
            ctx.step = trainer.global_step
        self._pl_last_global_step = trainer.global_step
        if (clip := getattr(ctx, "_pl_clip", None)) is not None:
            clip.shown.clear()  # every step() of the batch is done

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if (ctx := getattr(trainer, "_trainvitals_ctx", None)) is not None:
            _refresh_limits(ctx, trainer)  # (a dataloader reloaded for this epoch)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        ctx = getattr(trainer, "_trainvitals_ctx", None)
        if ctx is not None and not trainer.sanity_checking:
            ctx.in_validation = True
            self._dispatch("validation_start", ctx)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        ctx = getattr(trainer, "_trainvitals_ctx", None)
        if ctx is not None and not trainer.sanity_checking:
            ctx.in_validation = False
            self._dispatch("validation_end", ctx)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        ctx = getattr(trainer, "_trainvitals_ctx", None)
        if ctx is not None:
            self._dispatch("run_end", ctx)
            writer = self._writer_override if self._writer_override is not None else ctx.writer
            if writer is not None:
                writer.flush()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        ctx = getattr(trainer, "_trainvitals_ctx", None)
        if ctx is not None:
            _remove_batch_start_gate(ctx)  # this fit is over; the module is the user's again
            self._dispatch("exception_raised", ctx, exception)
            # The run may end here; deliver what was written so far now, not at exit (the
            # writer stays open until the process ends, or a retried fit on the same trainer
            # closes it in setup; a flush failure must not hide the exception being raised).
            # This callback's own writer too: nothing else flushes it before the process ends.
            writer = self._writer_override if self._writer_override is not None else ctx.writer
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.flush()

    # Lightning's checkpoint hooks: state_dict/load_state_dict above are what it calls for each
    # callback's own state. These two keep the trainer's batch bookkeeping that every callback
    # shares (one entry per checkpoint, written by the first trainvitals callback): where the
    # last batch started, and, in a checkpoint taken inside an accumulation window, the sizes
    # of the step's micro-batches so far, which the resumed fit tells the callbacks again.
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        last = getattr(trainer, _LAST_BATCH_ATTR, None)
        if last is None or not isinstance(checkpoint, dict) or _CKPT_KEY in checkpoint:
            return  # (written by the first trainvitals callback of this checkpoint)
        from trainvitals.adapters.loop import _number, _world_size, gather_window

        # plain ints: torch.load(weights_only=True) reads them
        saved: dict[str, Any] = {"batch_start_step": int(last[0]), "step_gap": int(last[1])}
        # Taken inside an accumulation window (after micro-batch k of the step in progress,
        # which has not stepped: its first batch's global_step is the trainer's): the sizes of
        # its micro-batches so far, told again when the resumed fit goes on (see
        # _pl_micro_batch_start). Every rank's, where the state is collective anyway (as the
        # driver's checkpoint: trainvitals.adapters.loop.gather_window).
        ctx = getattr(trainer, "_trainvitals_ctx", None)
        key = getattr(ctx, "_pl_batch_key", None)
        window = getattr(ctx, "_pl_window", None) or []
        if key is None or key[0] != trainer.global_step:
            window = []  # between steps: the last one stepped, nothing to carry
        window = [{k: [_number(n) for n in pair] for k, pair in sizes.items()} for sizes in window]
        callbacks = [cb for cb in trainer.callbacks if isinstance(cb, VitalsCallback)]
        by_rank = gather_window(window, callbacks)  # (on every rank alike)
        if window:  # (non-empty on every rank alike: they step together)
            saved["micro_batches_in_step"] = window
            saved["world_size"] = _world_size()  # (restored on another: _own_window)
            if by_rank is not None:
                saved["micro_batches_in_step_by_rank"] = by_rank
        checkpoint[_CKPT_KEY] = saved

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        fn = getattr(getattr(getattr(trainer, "state", None), "fn", None), "value", None)
        # trainer.validate/test/predict(ckpt_path=) restore the callbacks' state too (Lightning's
        # _restore_modules_and_callbacks calls on_load_checkpoint, then load_state_dict, for
        # every stage) but not the trainer's global_step: a fit, validate(ckpt_path=<step 3>),
        # fit again went on at step 6 with the counters of step 3 (time/samples 8 for 14). No
        # training batch follows such a restore, so the callback keeps its own state.
        self.__dict__[_SKIP_LOAD] = fn != "fit"
        if fn != "fit":
            return
        saved = checkpoint.get(_CKPT_KEY) if isinstance(checkpoint, Mapping) else None
        try:
            last = (int(saved["batch_start_step"]), int(saved["step_gap"]))
        except (TypeError, KeyError, ValueError):
            last = None  # a checkpoint without it (an older one, weights only): gap unknown
        setattr(trainer, _LAST_BATCH_ATTR, last)
        carried = None
        if last is not None and isinstance(saved, Mapping):
            from trainvitals.adapters.loop import _own_window

            try:
                window = [
                    {str(k): (pair[0], pair[1]) for k, pair in sizes.items()}
                    for sizes in _own_window(
                        dict(saved), "trainvitals (Lightning fit(ckpt_path=))", stacklevel=3
                    )
                ]
            except Exception as exc:  # a damaged entry must not stop the restore
                warnings.warn(
                    f"trainvitals: the checkpoint's micro-batch sizes of the step in progress "
                    f"are unreadable ({type(exc).__name__}: {exc}); the resumed step counts "
                    "only the micro-batches trained after the resume",
                    RuntimeWarning,
                    stacklevel=2,
                )
                window = []
            if window:  # (saved only while the step of the last batch, last[0], was open)
                carried = (last[0], window)
        setattr(trainer, _CARRIED_ATTR, carried)

    @property
    def _legacy_state_key(self) -> type:
        # Lightning restores a callback whose state_key is not in the checkpoint from this key
        # (meant for checkpoints before 1.5, keyed by type). The type, as Lightning's own
        # Callback returns: never a string key of a newer checkpoint. The class name matched
        # an unnamed instance's state_key, and a named callback added on resume beside one was
        # restored from that one's state.
        return type(self)

    def _generate_state_key(self, **kwargs: Any) -> str:
        return f"{type(self).__qualname__}{kwargs!r}"

    def __getattr__(self, name: str) -> Any:
        # Any other Lightning hook (on_fit_start, on_train_epoch_end, ... and hooks added by
        # future versions) is a no-op.
        if name.startswith("on_"):
            return _noop
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


# ---------------------------------------------------------------------- the checkpoint guard

# Key of the marker state a failed state_dict() returns (plain str data: it survives deepcopy,
# torch.save and torch.load(weights_only=True)); load_state_dict() recognises and skips it.
STATE_FAILED_KEY = "trainvitals_state_dict_failed"
# on an instance, from Lightning's on_load_checkpoint of an evaluation (validate, test, predict)
# to the load_state_dict that follows it in the same restore, which it skips
_SKIP_LOAD = "_trainvitals_skip_state_load"
# set on the wrapped functions (not wrapped twice); and, on an instance, while its outermost
# guarded call runs: a super().state_dict() inside it is part of that call and fails with it
_GUARDED = "_trainvitals_state_guard"


def _guard_state_dict(method: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    """``state_dict`` that never ends the run (checkpoints are saved on every rank, outside
    the hook guard): a failure is warned (once per run) and returns the marker state instead.

    ThroughputMonitor's and RuntimeMonitor's own state_dict are collective (SUMs over the ranks,
    ``reduce_counts``). A failure on one rank before or between those collectives (a host read
    of a device count, a user subclass's code before ``super().state_dict()``) would leave the
    other ranks waiting in them, or pair them with this rank's next collective (a later logging
    step's). So the guard records the collectives of the call and, when it fails, issues the
    rest of :meth:`VitalsCallback.state_dict_collectives` (fixed by the configuration, the same
    on every rank) with the "missing" mark: the other ranks' state_dict then fail alike
    (:class:`PeerRankFailed`) and every rank's checkpoint gets the marker, none waits."""

    @functools.wraps(method)
    def state_dict(self: VitalsCallback) -> dict[str, Any]:
        if self.__dict__.get(_GUARDED):
            return method(self)  # a super().state_dict() of a guarded call
        self.__dict__[_GUARDED] = True
        try:
            with recording_collectives() as issued:
                try:
                    return method(self)
                except Exception as exc:
                    failure = exc
        finally:
            self.__dict__.pop(_GUARDED, None)
        completed = _complete_state_collectives(self, issued)
        if _strict():
            raise failure
        name = type(self).__name__
        if not completed:
            self._warn_first(
                "guard:state_incomplete",
                f"trainvitals: {name}.state_dict raised {type(failure).__name__}: {failure}; "
                "its remaining collectives could not be issued, so the other ranks may wait in "
                "them",
            )
        if isinstance(failure, PeerRankFailed):
            cause = f"another rank's {name}.state_dict failed ({failure})"
        else:
            cause = f"{name}.state_dict raised {type(failure).__name__}: {failure}"
        self._warn_first(
            "guard:state_dict",
            f"trainvitals: {cause}; the checkpoint gets no state of this callback (a marker "
            "instead: restoring it leaves the callback's counters, windows and estimates as "
            "they are, with a warning). Training continues. Set TRAINVITALS_STRICT=1 to raise "
            "instead.",
        )
        return {STATE_FAILED_KEY: f"{type(failure).__name__}: {failure}"}

    setattr(state_dict, _GUARDED, True)
    return state_dict


def _complete_state_collectives(callback: VitalsCallback, issued: list[CollectiveCall]) -> bool:
    """Issue, with the "missing" mark, the collectives of ``callback.state_dict_collectives()``
    that a failed ``state_dict`` did not reach. False when its own collectives are not their
    beginning (they cannot be completed) or issuing them failed."""
    try:
        schema = tuple(callback.state_dict_collectives())
    except Exception:
        return False
    return _replay_rest(schema, issued)


def _replay_rest(schema: tuple[CollectiveCall, ...], issued: list[CollectiveCall]) -> bool:
    """Issue, with the "missing" mark, the collectives of ``schema`` after those ``issued``.
    False when ``issued`` is not the beginning of ``schema`` (it cannot be completed) or
    issuing failed."""
    done = len(issued)
    if schema[:done] != tuple(issued):
        return False
    try:
        replay_missing(schema[done:])
    except Exception:  # the backend itself failed: nothing more can be done from here
        return False
    return True


def _guard_load_state_dict(
    method: Callable[[Any, dict[str, Any]], None],
) -> Callable[[Any, dict[str, Any]], None]:
    """``load_state_dict`` that never ends the run: the marker of a failed ``state_dict`` is
    skipped with a warning; a load that raises is warned and undone as far as it rebound the
    callback's attributes (objects it changed in place stay as it left them), so the callback
    goes on from its state before the restore: a fresh callback's on a resume. No collective
    (none of the callbacks' loads issues one either)."""

    @functools.wraps(method)
    def load_state_dict(self: VitalsCallback, state_dict: dict[str, Any]) -> None:
        if self.__dict__.get(_GUARDED):
            return method(self, state_dict)  # a super().load_state_dict() of a guarded call
        if self.__dict__.pop(_SKIP_LOAD, False):
            return None  # an evaluation's restore (see VitalsCallback.on_load_checkpoint)
        name = type(self).__name__
        if isinstance(state_dict, Mapping) and STATE_FAILED_KEY in state_dict:
            self._warn_first(
                "guard:state_marker",
                f"trainvitals: {name}.load_state_dict: the checkpoint holds no state of this "
                f"callback (its state_dict raised {state_dict[STATE_FAILED_KEY]} when the "
                "checkpoint was saved); it goes on from its state before the restore (its "
                "counters, windows and estimates are not those of the checkpoint)",
            )
            return None
        before = dict(self.__dict__)
        self.__dict__[_GUARDED] = True
        try:
            method(self, state_dict)
        except Exception as exc:
            if _strict():
                raise
            self.__dict__.clear()
            self.__dict__.update(before)
            self._warn_first(
                "guard:load_state_dict",
                f"trainvitals: {name}.load_state_dict raised {type(exc).__name__}: {exc}; the "
                "checkpoint's state of this callback is not used, it goes on from its state "
                "before the restore (training continues). Set TRAINVITALS_STRICT=1 to raise "
                "instead.",
            )
        finally:
            self.__dict__.pop(_GUARDED, None)
        return None

    setattr(load_state_dict, _GUARDED, True)
    return load_state_dict


# the base's own definitions too: a callback without state of its own skips the marker alike
VitalsCallback.state_dict = _guard_state_dict(VitalsCallback.state_dict)  # type: ignore[method-assign]
VitalsCallback.load_state_dict = _guard_load_state_dict(VitalsCallback.load_state_dict)  # type: ignore[method-assign]


class _BatchStartGate:
    """Holds the trainvitals callbacks' ``on_train_batch_start`` until the LightningModule's own
    has answered. Lightning calls the callbacks' hook first and the module's after it, and a
    module returning -1 skips the rest of the epoch, that batch included
    (``_TrainingEpochLoop.advance``): that batch is not trained on, so no callback may count it.
    The module's hook is wrapped for the fit (an instance attribute, removed at its end)."""

    def __init__(self, pl_module: Any) -> None:
        self.module = pl_module
        self.pending: list[Callable[[], None]] = []
        original = pl_module.on_train_batch_start

        def on_train_batch_start(batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
            response = original(batch, batch_idx, *args, **kwargs)
            if response == -1:  # Lightning's own test (should_skip_rest_of_epoch)
                self.pending.clear()
            else:
                self.release()
            return response

        self._patch = AttributePatch(pl_module, "on_train_batch_start", on_train_batch_start)

    def release(self) -> None:
        pending, self.pending = self.pending, []
        for start in pending:
            start()

    def remove(self) -> None:
        self.pending.clear()
        self._patch.undo()  # the module's own hook again


def _overrides_batch_start(pl_module: Any) -> bool:
    """Whether the module's ``on_train_batch_start`` is its own (it may return -1); Lightning's
    default returns None, and then the module is left untouched."""
    if "on_train_batch_start" in vars(pl_module):
        return True
    for cls in type(pl_module).__mro__:
        if "on_train_batch_start" in vars(cls):
            return not cls.__module__.startswith(("lightning.", "pytorch_lightning."))
    return False


def _release_batch_start_gate(ctx: RunContext) -> None:
    """Run micro-batch starts still held: the module's hook did not run through the gate (a
    wrapper of its own replaced it), so the batch was not skipped."""
    gate = getattr(ctx, "_pl_gate", None)
    if gate is not None and gate.pending:
        gate.release()


def _remove_batch_start_gate(ctx: RunContext) -> None:
    """Give the module and the precision plugin their own methods back (the fit is over)."""
    gate = getattr(ctx, "_pl_gate", None)
    if gate is not None:
        ctx._pl_gate = None
        gate.remove()
    clip = getattr(ctx, "_pl_clip", None)
    if clip is not None:
        ctx._pl_clip = None
        clip.remove()


class _ManualClipGate:
    """Shows the callbacks a step's gradients before Lightning's manual optimization clips them.

    Under automatic optimization Lightning calls ``on_before_optimizer_step`` after unscaling
    and before clipping, where the callbacks read the gradients (the step's "grad" is the
    unclipped one). Under manual optimization ``training_step`` clips, with
    ``self.clip_gradients(opt, gradient_clip_val=...)`` as Lightning's docs show, before
    ``opt.step()``, and ``on_before_optimizer_step`` comes inside that step(): after the
    clipping. So the precision plugin's ``clip_gradients`` (which
    ``LightningModule.clip_gradients`` calls) is wrapped for the fit: when it is about to clip
    (a value > 0), every trainvitals callback of the trainer gets that optimizer's
    ``on_before_optimizer_step`` first, and the one inside its step() is skipped. Not under
    fp16 with an enabled ``GradScaler``: the gradients are still multiplied by the loss scale
    when ``training_step`` clips (Lightning unscales them inside step()), so they are read
    there, as before. A ``torch.nn.utils.clip_grad_norm_`` called directly is not seen."""

    def __init__(self, trainer: Any, pl_module: Any, plugin: Any) -> None:
        self.shown: dict[int, int] = {}  # id(optimizer) -> the step its gradients were shown at
        original = plugin.clip_gradients

        def clip_gradients(optimizer: Any, clip_val: Any = 0.0, *args: Any, **kwargs: Any) -> Any:
            self._show(trainer, pl_module, plugin, optimizer, clip_val)
            return original(optimizer, clip_val, *args, **kwargs)

        self._patch = AttributePatch(plugin, "clip_gradients", clip_gradients)

    @classmethod
    def install(cls, trainer: Any, pl_module: Any) -> _ManualClipGate | None:
        plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
        if plugin is None or not callable(getattr(plugin, "clip_gradients", None)):
            return None
        return cls(trainer, pl_module, plugin)

    def shown_before_clipping(self, optimizer: Any, step: int) -> bool:
        return self.shown.get(id(getattr(optimizer, "_optimizer", optimizer))) == step

    def _show(self, trainer: Any, pl_module: Any, plugin: Any, optimizer: Any, clip: Any) -> None:
        ctx = getattr(trainer, "_trainvitals_ctx", None)
        if ctx is None or ctx.in_validation or pl_module.automatic_optimization:
            return  # (automatic optimization clips after on_before_optimizer_step)
        if isinstance(clip, bool) or not isinstance(clip, int | float) or not clip > 0:
            return  # nothing is clipped: step()'s own hook shows the gradients
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            return  # fp16: still multiplied by the loss scale here (unscaled in step())
        if self.shown_before_clipping(optimizer, ctx.step):
            return  # clipped again before its step(): the first showing was unclipped
        inner = getattr(optimizer, "_optimizer", optimizer)  # (a LightningOptimizer)
        for callback in trainer.callbacks:
            if isinstance(callback, VitalsCallback):
                callback.on_before_optimizer_step(trainer, pl_module, inner)
        self.shown[id(inner)] = ctx.step

    def remove(self) -> None:
        self.shown.clear()
        self._patch.undo()


def _step_gap(trainer: Any, previous: tuple[Any, ...] | None) -> int:
    """``ctx.step_gap`` of a batch starting at ``trainer.global_step``: how far the previous
    batch that stepped advanced ``global_step`` (see :meth:`VitalsCallback.should_log`).

    At a fit's first batch (``previous`` None) that batch is the last one the trainer ran
    before: in this fit's checkpoint (``ckpt_path=``, kept under ``_CKPT_KEY``) or in its
    previous fit. Under manual optimization with two optimizers stepped per batch the gap is
    2 there as everywhere else; taking 1 skipped the multiple of the interval just before a
    resume point (``log_every_n_steps=3``, resumed at step 10: step 9's point, logged by the
    batch at 10 in an uninterrupted run, was lost). 1 when unknown or after a rollback."""
    if previous is None:
        last = getattr(trainer, _LAST_BATCH_ATTR, None)
        if last is None:
            return 1
        start, gap = last
        if trainer.global_step == start:  # that batch did not step: its gap still holds
            return max(1, gap)
    else:
        start = previous[0]
    gap = trainer.global_step - start
    return gap if gap > 0 else 1


def _lightning_writer(trainer: Any, run_dir: Path, start_step: int, first_step: int) -> Any:
    """The trainer's shared writer: its loggers, or ``metrics.jsonl`` in the run folder; told
    the step the fit started at (a checkpoint's on a resume) before anything is logged.

    Made at the fit's first write, at ``first_step``. A fit that goes on where the trainer's
    previous fit ended (a second ``fit`` with ``max_steps`` raised) abandoned nothing: the lines
    that fit wrote at the step it ended at (RuntimeMonitor's totals after its last validation)
    are the run's. When this fit writes that step again, the sinks replace them as on a resume;
    when its first write is later, the writer is not told, and a sink keeps every line below
    the first step it writes (told, it dropped them: a fit to step 6 ending with a validation,
    then a fit to 12 logging every 4 steps, lost step 6's totals from ``metrics.jsonl``)."""
    writer = getattr(trainer, _WRITER_ATTR, None)
    if writer is None:
        from trainvitals.adapters import FanoutWriter

        writer = FanoutWriter.from_lightning(trainer, default_jsonl=run_dir / "metrics.jsonl")
        if getattr(trainer, _ENDED_AT_ATTR, None) != start_step or first_step <= start_step:
            writer.resume_at(start_step)
        setattr(trainer, _WRITER_ATTR, writer)
    return writer


def _refresh_limits(ctx: RunContext, trainer: Any) -> None:
    """Set the context's ``max_steps``, ``max_epochs``, ``num_training_batches`` and
    ``accumulate_grad_batches`` to the trainer's as they stand now (a few Python attributes):
    a callback or the user may change ``trainer.fit_loop.epoch_loop.max_steps`` or
    ``fit_loop.max_epochs`` mid-run, and ``reload_dataloaders_every_n_epochs`` loads a
    dataloader of another length at an epoch's start. Refreshed at the start of training, of
    each epoch and before each ``step_end``."""
    max_steps = trainer.max_steps
    max_epochs = trainer.max_epochs
    num_batches = trainer.num_training_batches
    ctx.max_steps = max_steps if max_steps and max_steps > 0 else None
    ctx.max_epochs = max_epochs if max_epochs and max_epochs > 0 else None
    ctx.num_training_batches = (
        int(num_batches) if num_batches is not None and 0 < num_batches < float("inf") else None
    )
    ctx.accumulate_grad_batches = trainer.accumulate_grad_batches


def _context_from_trainer(trainer: Any, pl_module: Any) -> RunContext:
    writer = getattr(trainer, _WRITER_ATTR, None)  # made on first use (VitalsCallback.writer)
    run_dir = Path(getattr(trainer, "log_dir", None) or trainer.default_root_dir)
    ctx = RunContext(
        writer=writer,
        groups=ProcessGroups.from_strategy(trainer.strategy),
        model=pl_module,
        optimizers=list(trainer.optimizers),
        log_every_n_steps=trainer.log_every_n_steps,
        run_dir=run_dir,
        framework="lightning",
        trainer=trainer,
    )
    _refresh_limits(ctx, trainer)
    return ctx
