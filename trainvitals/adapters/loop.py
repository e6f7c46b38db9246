"""The driver that runs trainvitals callbacks in a hand-written or Accelerate training loop.

Three lines in a loop::

    vitals = Vitals([NormMonitor(), ThroughputMonitor()], run_dir="runs/exp1")  # 1
    vitals.attach(model, optimizer)                                               # 2
    for batch in loader:
        vitals.batch(batch)                        # 3: once per micro-batch, before forward
        loss = model(batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    vitals.close()

The driver learns of optimizer steps from the optimizer itself (``register_step_pre_hook`` and
``register_step_post_hook`` on the innermost torch optimizer), so under gradient accumulation,
where the optimizer steps once per real step, each step is seen once. Gradients are observed in
the pre-hook (``optimizer.step(closure)``, LBFGS: after the closure's first call, whose backward
makes them), or earlier, right after AMP unscaling and before clipping: when the loop clips
with ``accelerator.clip_grad_norm_`` or :meth:`Vitals.clip_grad_norm_`, and whenever a
``GradScaler`` unscales (``attach(..., scaler=scaler)``; Accelerate's own scaler is found by
itself). A step whose gradients were observed but that the optimizer skipped (``GradScaler`` on
inf/nan gradients) ends at the scaler's ``update()`` (else at the next :meth:`Vitals.batch`
call; with several optimizers, with its batch, below), so its micro-batches are not counted
into the next step. Without the scaler attached, ``GradScaler.step`` skips such a step before
the optimizer's hooks run: the callbacks never see its (non-finite) gradients. Several
optimizers sharing one scaler: every gradient is shown at once when every attached
optimizer's are unscaled before any steps (``scaler.unscale_(opt)`` for each, or
``accelerator.clip_grad_norm_``); else each optimizer's own gradients are shown when the
scaler unscales them inside ``scaler.step(opt)`` (torch.amp's ``scaler.step(opt0);
scaler.step(opt1)``, a GAN's ``scaler.step`` after each backward, every optimizer's step under
Accelerate fp16), also when the scaler then skips that step, or at an explicit
``scaler.unscale_(opt)`` once another optimizer stepped or was shown in the batch. An optimizer
that steps while another's gradients are still scaled after an explicit
``scaler.unscale_(opt)`` of its own that came first in the batch (the loop may have clipped
them since, unseen) or without the scaler unscaling it, shows none, with a warning, rather
than clipped or scaled gradients. (The scaler unscales optimizers' parameters only: the
gradient of a trainable parameter in no optimizer, shown with the batch's first step or all at
once, still carries the loss scale, with one optimizer as with several.) A fused (or
capturable) optimizer unscales inside its own ``step()``, so ``scaler.step`` alone leaves its
gradients scaled at its step: they are not shown (warned once); ``scaler.unscale_(opt)`` first
shows them.

Under Accelerate, give the driver the accelerator (``Vitals(..., accelerator=accelerator)``):
its ``clip_grad_norm_`` and scaler are what the driver wraps to see gradients before clipping.
Handed a model or optimizer that ``accelerator.prepare`` returned and no accelerator,
:meth:`Vitals.attach` finds the one that prepared them (else warns): without it, the
callbacks would see the gradients that ``accelerator.clip_grad_norm_`` clipped.

Several optimizers (``attach(model, [opt_d, opt_g])``: a GAN, or parameters split over two
optimizers): the step is the batch (its micro-batches under accumulation), and ``ctx.step``
counts those steps, not each ``optimizer.step()`` (unlike Lightning's ``global_step`` under
manual optimization). As Lightning's manual optimization runs ``on_before_optimizer_step`` per
``optimizer.step()``, ``before_optimizer_step`` runs before each attached optimizer's
``step()``, with that optimizer's current gradients: a GAN's two backward passes leave no
single moment at which both are current. A callback that reads every gradient at each call
sees the other optimizers' as they are then (one already stepped: updated weights). Every
gradient is shown once, at once, when the scaler's unscaling, or
:meth:`Vitals.clip_grad_norm_` or ``accelerator.clip_grad_norm_``/``clip_grad_value_`` over
every optimizer's parameters, comes before any of them steps (Accelerate's fp16 scaler
``update()`` after each optimizer's step makes the next one's ``scaler.step()`` unscale its
clipped gradients a second time, as that optimizer then uses them: the callbacks keep what the
clip saw, unclipped and unscaled once); clipping one network's
parameters (Accelerate unscales every optimizer's gradients there) shows the gradients of the
optimizers that own them, one at a time, as their own ``step()`` would. In a loop that calls
:meth:`Vitals.batch`, the step ends when its batch is over: at the next ``batch()`` that
starts a step (under accumulation the step's micro-batches stay one step),
at :meth:`Vitals.state_dict` or :meth:`Vitals.close`, and at :meth:`Vitals.validating` once
every attached optimizer stepped in it, unless the optimizers' ``step()`` calls so far are a
strict beginning of the last batch's (a WGAN stepping the generator, then the critic k times,
evaluated after the critic's first step: the critic steps again, the batch goes on); not as
soon as each optimizer has stepped, since one may step again after the others. So
``vitals.step`` counts a batch once it is over. A loop that does not call ``batch()`` ends the
step once every attached optimizer stepped in it (its next forward would start the next step),
else (a generator stepped every k batches) as above. An evaluation after only some optimizers
stepped (``validating()`` between two optimizers' steps of one batch, or after a batch in
which the generator did not step), or after all of them stepped in a batch whose steps so far
begin the last batch's without completing them, leaves the step open: it ends as it would
without the evaluation, so the batch stays one step (``vitals.step`` inside the evaluation is
that step's). In the run's first stepped batch there is no earlier batch to compare with: an
evaluation after every optimizer stepped ends the step there, and an optimizer that steps
again in that batch starts the next step (the batch is two steps).

``vitals.batch()`` tells the callbacks a micro-batch starts and how big it is. A loop that does
not call it still works: each training-mode forward of the attached model (with autograd on,
outside :meth:`Vitals.validating`) counts as one micro-batch of unknown size, so samples and
tokens are not counted. Once the loop calls ``batch()``, forwards are not counted at all (a
micro-batch may run several: R-Drop, adversarial training). Call ``batch()`` before the
forward, never after it. Every micro-batch told with ``batch()`` counts as trained: its samples
and tokens, and under ``ThroughputMonitor`` its model flops. The driver is not told of backward
passes, so a micro-batch that the loop drops after its forward (a non-finite loss skipped with
no backward) cannot be told apart: it counts as read (as Lightning counts a batch whose
``training_step`` returned ``None``), but with its flops too (which Lightning leaves out). Its
samples and tokens join the step its optimizer takes next (a loop that then skips
``optimizer.step()``: the next step, a step being an optimizer step).
Each rank tells its own micro-batches: under Accelerate what its prepared loader yields (with
``split_batches=True`` or ``dispatch_batches`` its slice of the loader's batch, with
``even_batches`` the samples repeated to even out the last batch too: they are trained), and
the global keys (``throughput/samples_per_sec``, ``time/samples``, ...) sum every
data-parallel rank's counts, so ranks with different batch sizes count as such.

The driver's ``state_dict``/``load_state_dict`` hold its step counter and every callback's
state, so ``accelerator.register_for_checkpointing(vitals)`` (or saving ``vitals.state_dict()``
next to the model) resumes counters, windows and estimates. A checkpoint taken inside a
gradient-accumulation window (after micro-batch k of a step) also holds the sizes of the
step's micro-batches so far: Accelerate's ``save_state`` keeps its micro-batch counter
(``Accelerator.step``), so the restored run goes on at micro-batch k + 1 and steps after the
window's last one, and the callbacks are told of the k carried micro-batches
(``micro_batch_start`` with ``batch=None`` and the sizes they were told then) when the restored
run's first micro-batch starts: its batches, samples and tokens are counted as in an
uninterrupted run. What the carried micro-batches left on the model (gradients, activations)
is in no checkpoint, Accelerate's included: ``ctx.micro_batch``/``micro_batches_in_step``
count the micro-batches this process ran. The restored step's time is this process's part of
it only: ``ThroughputMonitor`` and ``RuntimeMonitor`` leave the first step after a restore out
of their rates by default (``warmup_steps=1``). On several ranks a checkpoint keeps one copy
of the state (rank 0's), and the ranks' micro-batches may differ in size (uneven last batches,
variable-length sequences): where the state is collective anyway (a callback whose
``state_dict`` reduces over the ranks: ``ThroughputMonitor``, ``RuntimeMonitor``, those that
count samples and tokens), ``state_dict`` gathers every rank's sizes into it
(``micro_batches_in_step_by_rank``, one object gather over the world group) and each rank
restores its own row, so samples and tokens are exact too. Without such a callback
``state_dict`` issues no collective (a loop may call it on rank 0 alone) and every rank
restores the saving rank's sizes (exact batches). Restored on another number of ranks (the
state keeps its ``world_size``), the new rank 0 restores every old rank's micro-batches and the
other ranks none, so the step's counts summed over the ranks are those that ran (with a
warning: which rank ran what in that step is not an uninterrupted run's).

Under Accelerate, ``accelerator.end_training()`` closes the driver first (as
:meth:`Vitals.close`; called inside an ``except`` or ``finally`` block, with the exception
being handled, ``StopIteration`` excepted: an iterator's normal end, not a failure): it
finishes the trackers (a TensorBoard writer written after it opens a second event file; a
finished W&B run refuses values) and destroys the process group the callbacks' last
collectives use. A ``vitals.close()`` after it does nothing, so both orders log every step.
Call it on every rank, as Accelerate's documentation does. Called on rank 0 only (``if
accelerator.is_main_process: accelerator.end_training()``), it closes rank 0's driver alone,
and its close may have collectives to run (the last batch's step with several optimizers;
``MoEMetricsMonitor``'s report of micro-batches after the last step): on a multi-rank run a
driver not closed by the interpreter's exit is closed then (an exit hook that runs before the
writers' own, so what the close logs reaches them), so the other
ranks join those collectives as their processes end, and the last step is written instead of
failing on rank 0 ("Connection closed by peer" once a rank exited; waiting while it lives on).
Not when the process ends on a failure (an uncaught exception, a non-zero ``sys.exit``) nor once
its process group is destroyed. Rank 0 waits in its close until the other ranks end: a rank that
enters another collective first (a barrier after rank 0's ``end_training()``, which destroyed
rank 0's process group) fails or waits as it would without trainvitals.

``accelerator.free_memory()`` (and ``accelerator.clear()``, which calls it) closes the driver
first as well, as ``end_training()`` does: it drops every model and optimizer the accelerator
prepared, between two trainings (Accelerate's docstring), so the run the driver watched is
over; a driver left open (an attempt that failed) no longer shows the next training's
gradients to its callbacks through its wrappers of the accelerator's clipping and scaler.
"""

from __future__ import annotations

import atexit
import contextlib
import numbers
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import torch

from trainvitals._hooks import eager_hook
from trainvitals._patching import AttributePatch
from trainvitals.adapters.context import BatchInfo, RunContext, infer_batch_size, infer_num_tokens
from trainvitals.adapters.sinks.base import takes_main_tag
from trainvitals.distributed import ProcessGroups
from trainvitals.stats.norms import is_flat_shard


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """Unwrap Accelerate's ``AcceleratedOptimizer`` (and similar wrappers with ``.optimizer``).

    ``AcceleratedOptimizer`` subclasses ``torch.optim.Optimizer`` without running its
    ``__init__``, so it has no hook registries of its own: unwrap while ``.optimizer`` holds an
    optimizer, whatever the outer object's class.
    """
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"attach() needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


def _inner_or_none(optimizer: Any) -> torch.optim.Optimizer | None:
    """:func:`_inner_optimizer`, or ``None`` for something that is not an optimizer (what a
    scaler or Accelerate was handed; they raise their own errors for it)."""
    try:
        return _inner_optimizer(optimizer)
    except TypeError:
        return None


def _accelerate_prepared(model: Any, optimizers: Sequence[Any]) -> bool:
    """Whether ``accelerator.prepare`` returned ``model`` or one of ``optimizers``: it marks what
    it returns with ``_is_accelerate_prepared = True`` (``Accelerator.prepare`` and
    ``prepare_model``, accelerate 1.x; its ``AcceleratedOptimizer`` wrapper too)."""
    if getattr(model, "_is_accelerate_prepared", False) is True:
        return True
    wrapper = getattr(sys.modules.get("accelerate.optimizer"), "AcceleratedOptimizer", None)
    return any(
        getattr(o, "_is_accelerate_prepared", False) is True
        or (wrapper is not None and isinstance(o, wrapper))
        for o in optimizers
    )


def _preparing_accelerator(model: Any, optimizers: Sequence[Any]) -> Any:
    """The ``accelerate.Accelerator`` that prepared ``model`` or ``optimizers``, or ``None`` when
    not exactly one holds them.

    Nothing prepared points back to it: an ``AcceleratedOptimizer`` keeps the torch optimizer,
    the scaler, and the ``AcceleratorState``/``GradientState`` singletons, not the accelerator
    (``accelerate/optimizer.py``, ``AcceleratedOptimizer.__init__``), and a prepared model
    keeps nothing of it. The accelerator keeps what it prepared in its lists ``_models`` and
    ``_optimizers`` (``Accelerator.prepare_model``/``prepare_optimizer``): found through the
    garbage collector's referrers of those objects (the lists), then of the lists (the
    accelerator, or its ``__dict__`` once one was made). Three scans of the tracked objects at
    most, once, at ``attach()``."""
    import gc

    accelerator_class = getattr(sys.modules.get("accelerate.accelerator"), "Accelerator", None)
    if accelerator_class is None:
        return None
    targets = [model, *optimizers]
    lists = [r for r in gc.get_referrers(*targets) if type(r) is list]
    if not lists:
        return None
    found: list[Any] = []
    dicts: list[dict[str, Any]] = []
    for referrer in gc.get_referrers(*lists):
        if isinstance(referrer, accelerator_class):
            found.append(referrer)
        elif type(referrer) is dict:
            dicts.append(referrer)
    if not found and dicts:
        found = [r for r in gc.get_referrers(*dicts) if isinstance(r, accelerator_class)]

    def holds(accelerator: Any) -> bool:
        held = [*getattr(accelerator, "_models", ()), *getattr(accelerator, "_optimizers", ())]
        return any(t is h for t in targets for h in held)

    owners = list({id(a): a for a in found if holds(a)}.values())
    return owners[0] if len(owners) == 1 else None


def _scaler_enabled(scaler: Any) -> bool:
    """Whether ``scaler`` scales (a ``GradScaler(enabled=False)`` never does; an object without
    ``is_enabled`` is taken to)."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return not callable(is_enabled) or bool(is_enabled())


def _check_callback(index: int, callback: Any) -> None:
    """A trainvitals callback instance (duck-typed: the driver calls its ``_dispatch`` and
    ``state_key``), else a ``TypeError`` at construction rather than in the loop's first
    ``batch()``."""
    if isinstance(callback, type):
        name = callback.__name__
        raise TypeError(
            f"callbacks[{index}] is the class {name}, not an instance: pass {name}() (with its "
            "arguments)"
        )
    if not callable(getattr(callback, "_dispatch", None)) or not isinstance(
        getattr(callback, "state_key", None), str
    ):
        raise TypeError(
            f"callbacks[{index}] is not a trainvitals callback (a VitalsCallback such as "
            f"NormMonitor()), got {type(callback).__name__}: {callback!r:.80}"
        )


# The open (attached, not closed) driver each callback instance runs in, by id(callback): the
# driver holds the callback, so the id is not reused while its entry lives.
_running_in: weakref.WeakValueDictionary[int, Vitals] = weakref.WeakValueDictionary()


def _check_not_running_elsewhere(callbacks: Sequence[Any], driver: Vitals | None = None) -> None:
    """A callback instance keeps one run's counters, windows and context: two open drivers
    sharing it (one list of callbacks given to the drivers of two models) mix their
    micro-batches, steps and times into every value both write. Refused, at construction and
    at ``attach()``; one instance used again after ``close()`` (a second run) is allowed, as
    the callbacks document."""
    for collected in (False, True):
        busy = [
            cb
            for cb in callbacks
            if (other := _running_in.get(id(cb))) is not None
            and other is not driver
            and not other._closed
        ]
        if not busy:
            return
        if not collected:
            # (a driver left attached and unreachable, an abandoned attempt, is not running)
            import gc

            gc.collect()
    names = ", ".join(type(cb).__name__ for cb in busy)
    raise ValueError(
        f"callbacks: {names} already running in another Vitals that is not closed; a callback "
        "instance serves one run at a time (sharing it mixes both runs' values): create new "
        "instances for this driver, or close() the other one first (a driver dropped without "
        "close() stays hooked into its model and optimizer, and runs its callbacks still)"
    )


class Vitals:
    """Runs trainvitals callbacks in a loop that has no callback system.

    Args:
        callbacks: the callbacks to run, e.g. ``[NormMonitor(), MemoryMonitor()]``; an
            instance runs in one driver at a time (another driver still open with it:
            ``ValueError``), and again after that one's :meth:`close` (a second run). A class
            instead of an instance, or an object that is not a trainvitals callback:
            ``TypeError``.
        writer: where values go; default: ``FanoutWriter.from_accelerator(accelerator)`` when an
            accelerator is given and it has trackers, else a JSONL file ``metrics.jsonl`` in
            ``run_dir``. A rollback in the same process (:meth:`load_state_dict` of an earlier
            step) replaces the default writer, so the replayed steps are written again. A
            ``FanoutWriter`` given here (or to a callback) is kept and cannot go back (it
            refuses steps lower than those it was given): the replayed steps below the step
            the rollback left are not written to it (one warning), and it gets the restored
            run's values from that step on. A writer that takes any step gets them all. Our
            own writer is told the step the run starts at (``FanoutWriter.resume_at``: 0, or
            the step :meth:`load_state_dict` restored) before anything is logged, so its JSONL
            file drops what an interrupted run wrote after that checkpoint; a writer given here
            is the caller's to tell. A writer needs ``add_scalars(mapping, step)`` (``flush()``
            is called at :meth:`close` when it has one); TensorBoard's ``SummaryWriter``, whose
            ``add_scalars`` takes a ``main_tag``, or an object without ``add_scalars``:
            ``TypeError`` (wrap a ``SummaryWriter`` in ``FanoutWriter([TensorBoardSink(w)])``).
        accelerator: an ``accelerate.Accelerator``; gives the writer, the process groups and the
            gradient-accumulation steps.
        groups: the :class:`ProcessGroups`; default from the accelerator, else the world group
            as data parallel when ``torch.distributed`` is initialised, else trivial. Without
            an accelerator the default is looked up again at :meth:`attach` and when the run
            starts (its first micro-batch, or step), so a driver built before
            ``init_process_group`` (a torchrun script that builds its callbacks first) sums
            over the world; a process group initialised after that is not seen. Anything
            other than a ``ProcessGroups`` or ``None``: ``TypeError``.
        log_every_n_steps: the default logging interval of the callbacks, in optimizer steps.
        run_dir: folder for files the callbacks write (JSONL metrics, tensor statistics); not
            a str or path: ``TypeError``; an existing file: ``ValueError``.
        max_steps: the training horizon in optimizer steps (for remaining-time estimates).
        accumulate_grad_batches: micro-batches per optimizer step, when not counted: a
            positive int (else ``TypeError``/``ValueError``).
    """

    def __init__(
        self,
        callbacks: Sequence[Any],
        *,
        writer: Any = None,
        accelerator: Any = None,
        groups: ProcessGroups | None = None,
        log_every_n_steps: int = 50,
        run_dir: str | Path = "runs/vitals",
        max_steps: int | None = None,
        accumulate_grad_batches: int | None = None,
    ) -> None:
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int):
            raise TypeError(f"log_every_n_steps must be an int, got {log_every_n_steps!r}")
        if log_every_n_steps <= 0:
            raise ValueError(f"log_every_n_steps must be positive, got {log_every_n_steps}")
        if max_steps is not None:
            if isinstance(max_steps, bool) or not isinstance(max_steps, int):
                raise TypeError(f"max_steps must be an int or None, got {max_steps!r}")
            if max_steps <= 0:
                raise ValueError(f"max_steps must be positive or None, got {max_steps}")
        if isinstance(callbacks, str) or not isinstance(callbacks, Iterable):
            raise TypeError(
                "Vitals needs a list of callbacks, e.g. Vitals([NormMonitor()]), got "
                f"{type(callbacks).__name__}"
            )
        self.callbacks = list(callbacks)
        for index, cb in enumerate(self.callbacks):
            _check_callback(index, cb)
        keys = [cb.state_key for cb in self.callbacks]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two callbacks share a state_key: {keys}; give them distinct names")
        _check_not_running_elsewhere(self.callbacks)
        if accumulate_grad_batches is not None:
            # (a str or a float here failed only at the first batch(), inside the loop)
            if isinstance(accumulate_grad_batches, bool) or not isinstance(
                accumulate_grad_batches, numbers.Integral
            ):
                raise TypeError(
                    f"accumulate_grad_batches must be an int or None, got {accumulate_grad_batches!r}"
                )
            if accumulate_grad_batches <= 0:
                raise ValueError(
                    "accumulate_grad_batches must be positive or None, got "
                    f"{accumulate_grad_batches}"
                )
            accumulate_grad_batches = int(accumulate_grad_batches)
        if writer is not None and not callable(getattr(writer, "add_scalars", None)):
            # (else every callback failed at its first write and was disabled, and close() raised)
            raise TypeError(
                "writer must be a FanoutWriter (or an object with add_scalars(mapping, step)), "
                f"got {type(writer).__name__}: {writer!r:.80}; "
                "pass run_dir= for a folder"
            )
        if writer is not None and takes_main_tag(writer.add_scalars):
            # TensorBoard's SummaryWriter.add_scalars(main_tag, tag_scalar_dict, step): every
            # callback failed at its first write and was disabled
            raise TypeError(
                f"writer: {type(writer).__name__}.add_scalars takes a main_tag (TensorBoard's "
                "SummaryWriter); pass FanoutWriter([TensorBoardSink(summary_writer)]) instead"
            )
        if groups is not None and not isinstance(groups, ProcessGroups):
            raise TypeError(
                "groups must be a trainvitals.distributed.ProcessGroups (e.g. "
                f"ProcessGroups.from_device_mesh(mesh)) or None, got {type(groups).__name__}"
            )
        if not isinstance(run_dir, str | PathLike):
            raise TypeError(f"run_dir must be a str or a path, got {type(run_dir).__name__}")
        run_dir = Path(run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            # (its metrics.jsonl and the callbacks' files could never be written: the writer
            # would disable its sink at step 0 and the run would go on with nothing logged)
            raise ValueError(f"run_dir {str(run_dir)!r} is a file, not a folder: pass a folder")
        # what the caller set; an accelerator found at attach() fills in the rest
        self._explicit_accumulation = accumulate_grad_batches is not None
        self._explicit_groups = groups is not None
        if accumulate_grad_batches is None:
            accumulate_grad_batches = int(getattr(accelerator, "gradient_accumulation_steps", 1))
        self._owns_writer = writer is None
        if writer is None:
            writer = _default_writer(accelerator, run_dir)
        if groups is None:
            # (without an accelerator, provisional: _resolve_default_groups)
            groups = (
                ProcessGroups.from_accelerator(accelerator)
                if accelerator is not None
                else _default_groups()
            )
        self.ctx = RunContext(
            writer=writer,
            groups=groups,
            log_every_n_steps=log_every_n_steps,
            accumulate_grad_batches=accumulate_grad_batches,
            max_steps=max_steps,
            run_dir=run_dir,
            framework="accelerate" if accelerator is not None else "loop",
            accelerator=accelerator,
        )
        self._accelerator = accelerator
        # the accelerator the default writer was made from (not one found at attach())
        self._writer_accelerator = accelerator
        self._handles: list[Any] = []
        self._started = False
        self._grads_seen_for_step = False  # every gradient shown at once (gradients_ready)
        # Inside optimizer.step(closure) once its gradients were shown (after the closure's
        # first call, or before it: SAM), until the step's post-hook: later calls of the
        # closure re-evaluate the step's micro-batches (LBFGS), they are not new ones.
        self._closure_replays = False
        # Per optimizer in its step(): the caller frame of its outermost step hooks and how
        # deep its hooked steps are nested (a subclass whose step() calls super().step():
        # torch hooks each class's step, so both fire once the parent class has an instance)
        self._step_calls: dict[int, tuple[Any, int]] = {}
        # A training forward of the attached model ran since the last optimizer step: at a
        # step(closure), the loop made the step's gradients itself (SAM's loop), else the
        # closure will (LBFGS)
        self._forward_seen = False
        self._unscaled: set[int] = set()
        self._attached: set[int] = set()
        # Several attached optimizers: those whose gradients were shown and that have not
        # stepped since, and those that stepped in the step in progress.
        self._awaiting_step: set[int] = set()
        self._stepped: set[int] = set()
        # The attached optimizers' step() calls of the step in progress, in order, and those of
        # the last step that had any (its batch's pattern: a WGAN's generator, then the critic
        # k times), for validating() to tell an evaluation inside a batch from one after it.
        self._step_order: list[int] = []
        self._last_order: list[int] = []
        self._shown_in_step = False  # gradients shown in the step in progress (any of them)
        self._patches: list[AttributePatch] = []  # our wrappers, undone by close()
        # inside accelerator.clip_grad_norm_/clip_grad_value_: the parameters it clips
        self._accelerator_clipping: list[Any] | None = None
        # inside GradScaler.step(optimizer): the id of that (innermost) optimizer
        self._scaler_stepping: int | None = None
        # the (innermost) optimizers handed to GradScaler.step() since its last update()
        self._scaler_stepped: set[int] = set()
        self._scaled_at_step = False  # that optimizer steps with its gradients still scaled
        self._scaler: Any = None  # the GradScaler given to attach() (or Accelerate's)
        # attached optimizers whose gradients are not shown in this step: clipped by
        # vitals.clip_grad_norm_ while still multiplied by the loss scale
        self._hidden: set[int] = set()
        self._warned_clip_scaled = False
        self._loop_calls_batch = False
        # the attached model ran inside compiled code, where its pre-hook cannot count forwards
        self._forwards_traced = False
        self._warned_traced = False
        self._warned_scaled = False
        self._warned_fused = False
        self._closed = False
        self._warned_closed: set[str] = set()  # calls after close() already warned about
        # The sizes each callback was told for the micro-batches of the step in progress
        # (state_key -> (batch_size, num_tokens), one dict per micro-batch), and those a
        # restored checkpoint carried from inside an accumulation window, not yet told again.
        self._step_batches: list[dict[str, tuple[Any, Any]]] = []
        self._carried: list[dict[str, tuple[Any, Any]]] = []
        # the step in progress has more micro-batches than a window could have (_keep_sizes)
        self._sizes_dropped = False
        # of the step in progress, the micro-batches a restored checkpoint carried: on fewer
        # ranks than saved it, rank 0 carries every old rank's, beyond any one window
        self._carried_in_step = 0
        self._warned_no_step = False

    # ------------------------------------------------------------------ wiring

    def attach(self, model: torch.nn.Module, optimizer: Any, *, scaler: Any = None) -> Vitals:
        """Attach to the model and its optimizer (one or a list); returns ``self``.

        Several optimizers: the step is the batch, and the gradient hook runs before each one's
        ``step()`` (see the module docstring).

        ``scaler``: the loop's ``torch.amp.GradScaler`` under fp16 AMP (default: the
        accelerator's ``scaler``, if any). The callbacks then see each step's gradients right
        after it unscales them, before clipping, also on the steps it then skips for inf/nan
        gradients (whose optimizer hooks never run).

        ``model`` or ``optimizer`` returned by ``accelerator.prepare`` while the driver was given
        no ``accelerator``: the ``Accelerator`` that prepared them is looked up (through the
        garbage collector's referrers: nothing prepared points back to it; once, here) and used
        as if given (clipping, AMP unscaling, accumulation steps, process groups unless
        ``groups`` was given), except that the writer stays the constructor's (default: JSONL
        in ``run_dir``, not its trackers). When no single one is found: a warning saying to pass
        ``accelerator=``.

        An empty list of optimizers, or a callback still running in another driver that is not
        closed: ``ValueError``.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"attach() needs an nn.Module, got {type(model).__name__}")
        if self._handles or self._closed:
            # a second set of hooks would count every micro-batch and step twice
            raise RuntimeError(
                "Vitals.attach() was called already (or the driver is closed); attach once, "
                "after accelerator.prepare()"
            )
        if scaler is not None and not callable(getattr(scaler, "unscale_", None)):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        optimizers = optimizer if isinstance(optimizer, list | tuple) else [optimizer]
        if not optimizers:
            # (no optimizer hooked: no step would ever end, and nothing be logged)
            raise ValueError(
                "attach() needs an optimizer (or a list of them), got an empty "
                f"{type(optimizer).__name__}"
            )
        inner = [_inner_optimizer(o) for o in optimizers]
        _check_not_running_elsewhere(self.callbacks, self)
        if self._accelerator is None and _accelerate_prepared(model, optimizers):
            self._adopt_accelerator(_preparing_accelerator(model, optimizers))
        self._resolve_default_groups()
        self.ctx.model = model
        self.ctx.optimizers = inner
        self._attached = {id(o) for o in inner}
        for opt in dict.fromkeys(inner):  # (the same optimizer listed twice: hooked once)
            self._handles.append(opt.register_step_pre_hook(self._on_pre_step))
            self._handles.append(opt.register_step_post_hook(self._on_post_step))
        self._handles.append(model.register_forward_pre_hook(self._model_pre_hook()))
        for cb in self.callbacks:
            _running_in[id(cb)] = self
        if self._accelerator is not None:
            self._wrap_accelerator_clip()
            self._wrap_accelerator_end()
            if scaler is None:
                scaler = getattr(self._accelerator, "scaler", None)
        if scaler is not None:
            self._wrap_scaler(scaler)
        return self

    def _adopt_accelerator(self, accelerator: Any) -> None:
        """``attach()`` was handed objects that ``accelerator.prepare`` returned, and the driver
        was given no accelerator. Without it the driver would not see
        ``accelerator.clip_grad_norm_`` (the callbacks would get the clipped gradients at the
        optimizer's step) nor AMP unscaling. ``accelerator``: the one ``Accelerator`` that prepared them
        (:func:`_preparing_accelerator`), used from here on as if it had been given, except for
        the writer, which stays what the constructor chose (a JSONL file in ``run_dir`` by
        default, not the accelerator's trackers); ``None`` when none could be told: warn."""
        if accelerator is None:
            warnings.warn(
                "trainvitals Vitals.attach(): the model or optimizer was prepared by an "
                "accelerate.Accelerator that the driver was not given and could not find, so "
                "gradients clipped with accelerator.clip_grad_norm_ (or scaled under fp16) would "
                "be shown to the callbacks clipped (or scaled); pass it: "
                "Vitals(callbacks, accelerator=accelerator)",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        self._accelerator = accelerator
        self.ctx.accelerator = accelerator
        self.ctx.framework = "accelerate"
        if not self._explicit_accumulation:
            steps = getattr(accelerator, "gradient_accumulation_steps", 1)
            self.ctx.accumulate_grad_batches = int(steps)
        if not self._explicit_groups:
            self.ctx.groups = ProcessGroups.from_accelerator(accelerator)

    def _resolve_default_groups(self) -> None:
        """Look the default groups up again, when neither ``groups`` nor an accelerator gave
        them: the world group once ``torch.distributed`` is initialised, else trivial. A
        driver built before ``init_process_group`` (torchrun scripts often build callbacks,
        writer and driver first) had found no process group: kept, its trivial groups made
        every sum over the ranks (global samples and tokens, expert loads) this rank's alone,
        while ``ctx.world_size`` said otherwise. Called at :meth:`attach` and at run start,
        the last moment before any callback's ``run_start`` takes ``ctx.groups``."""
        if not self._explicit_groups and self._accelerator is None:
            self.ctx.groups = _default_groups()

    def _wrap_scaler(self, scaler: Any) -> None:
        # GradScaler.step() calls self.unscale_(optimizer) unless the loop already did, and
        # skips optimizer.step() on inf/nan gradients (torch.amp.GradScaler.step): an instance
        # attribute catches both the explicit and the implicit call, before any skip.
        self._scaler = scaler
        original = scaler.unscale_
        original_step = scaler.step
        original_update = scaler.update
        accelerator = self._accelerator

        def unscale_(optimizer: Any) -> None:
            original(optimizer)
            inner = _inner_or_none(optimizer)  # (the scaler took it: an optimizer)
            if not _scaler_enabled(scaler):
                self._unscaled |= self._attached  # a disabled scaler never scaled anything
            elif inner is not None:
                self._unscaled.add(id(inner))
            # Not inside accelerator.clip_grad_*, which unscales every optimizer's gradients:
            # its unscale_gradients wrapper decides, as it knows which parameters are clipped.
            # Under Accelerate, only when the optimizer will step.
            if self._accelerator_clipping is not None or not getattr(
                accelerator, "sync_gradients", True
            ):
                return
            if self._attached <= self._unscaled and not self._stepped and not self._awaiting_step:
                # Every attached optimizer's gradients unscaled (several optimizers share one
                # scaler) before any of them stepped or was shown: all at once. Not once one
                # stepped: its weights are updated.
                self.gradients_ready()
            elif (
                len(self._attached) > 1
                and inner is not None
                and id(inner) in self._attached
                and (self._scaler_stepping == id(inner) or self._stepped or self._awaiting_step)
            ):
                # Several optimizers, this one's own gradients unscaled: shown now, alone, as
                # its step() would (ctx.stepping_optimizer), when nothing can come between this
                # and its step: inside scaler.step(optimizer), which unscales and then steps, or
                # skips the step on inf/nan gradients (its hooks never run: shown here, as with
                # one optimizer). Or when the gradients cannot be shown all at once any more
                # (another optimizer stepped or was shown alone in this step): now, before
                # the loop clips them. An explicit scaler.unscale_(opt) before any of that
                # waits: the loop may unscale every optimizer before the first step (all at
                # once, above); if it steps instead, clipping may have come between (see
                # _on_pre_step).
                self._show_optimizer(inner)

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            outer = self._scaler_stepping, self._scaled_at_step
            inner = _inner_or_none(optimizer)
            self._scaler_stepping = None if inner is None else id(inner)
            if inner is not None:
                self._scaler_stepped.add(id(inner))
            # A fused (or capturable) optimizer unscales inside its own step() (GradScaler hands
            # it the scale, torch.amp.GradScaler.step): its gradients are still multiplied by
            # the loss scale at its step pre-hook, unless the loop unscaled them before.
            self._scaled_at_step = (
                inner is not None
                and bool(getattr(inner, "_step_supports_amp_scaling", False))
                and id(inner) not in self._unscaled
                and _scaler_enabled(scaler)
            )
            try:
                return original_step(optimizer, *args, **kwargs)
            finally:
                self._scaler_stepping, self._scaled_at_step = outer

        def update(*args: Any, **kwargs: Any) -> None:
            original_update(*args, **kwargs)
            # update() follows the step(s) of the iteration (torch.amp.GradScaler docs; Accelerate
            # calls it in AcceleratedOptimizer.step): a step whose gradients were seen and that is
            # still open was skipped. End it now, so that a checkpoint or close() taken before
            # the next batch counts it, as the loop's own step counter does.
            # (Several optimizers: the step is the batch and ends with it, at the next batch(),
            # validating(), state_dict() or close(), also when every step() in it was skipped;
            # Accelerate calls update() after each optimizer's step. Those shown and skipped
            # are shown again if they step again in the batch: a critic stepped k times. Only
            # those the scaler stepped since its last update(): an optimizer shown and not
            # stepped yet keeps what was shown. Accelerate's update() after the first of
            # several optimizers that accelerator.clip_grad_norm_ showed all at once makes the
            # next one's scaler.step() unscale its clipped gradients a second time (the
            # scaler forgot the first unscale_ at update()): shown again there, they replaced
            # the unclipped norms of every optimizer with that one's, clipped and divided
            # twice by the loss scale.)
            shown = self._grads_seen_for_step or self._awaiting_step
            stepped, self._scaler_stepped = self._scaler_stepped, set()
            if len(self._attached) > 1:
                self._awaiting_step -= stepped
            elif shown and not self._stepped and not self._closed:
                self._end_step()
            # and, as the scaler itself does, forget what was unscaled: an optimizer stepped
            # after the step ended (scaler.step(opt1)) is scaled again in the next iteration
            self._unscaled.clear()

        self._patches += [
            AttributePatch(scaler, "unscale_", unscale_),
            AttributePatch(scaler, "step", step),
            AttributePatch(scaler, "update", update),
        ]

    def _wrap_accelerator_clip(self) -> None:
        # Accelerate unscales AMP gradients in unscale_gradients(), which its clip_grad_norm_ and
        # clip_grad_value_ call right before clipping: observe the gradients just after it.
        # (Calling unscale ourselves would unscale twice, which GradScaler refuses.)
        # unscale_gradients() is told no parameters (it unscales every optimizer): the clip
        # wrappers note what is clipped, so that a GAN clipping one network before its
        # optimizer steps shows that network's gradients, as Vitals.clip_grad_norm_ does.
        accelerator = self._accelerator
        original = accelerator.unscale_gradients

        def unscale_gradients(optimizer: Any = None) -> None:
            original(optimizer)
            # Only when the optimizer will step: a loop that clips on every micro-batch would
            # otherwise show the callbacks partial gradients.
            if getattr(accelerator, "sync_gradients", True):
                if self._accelerator_clipping is not None:
                    self._gradients_final(parameters=self._accelerator_clipping)
                elif optimizer is not None:
                    self._gradients_final(optimizers=optimizer)
                else:
                    self.gradients_ready()

        self._patches.append(AttributePatch(accelerator, "unscale_gradients", unscale_gradients))
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            clip = getattr(accelerator, name, None)
            if callable(clip):
                self._patches.append(AttributePatch(accelerator, name, self._noting_clipped(clip)))

    def _wrap_accelerator_end(self) -> None:
        # accelerator.end_training() finishes the trackers (TensorBoard's SummaryWriter is
        # closed; a later write opens a second event file for the last steps; a finished W&B
        # run refuses them) and destroys the process group the callbacks' last collectives
        # need. The run is over there: the driver closes first (a later close() is a no-op).
        # accelerator.free_memory() (and clear(), which calls it) drops every model and
        # optimizer the accelerator prepared, "between two trainings with different
        # models/optimizers" (its docstring), and resets its micro-batch counter: the run this
        # driver watched is over too. Closed there, its hooks and its wrappers of the
        # accelerator (clipping, unscaling, the scaler) go, so a driver of the next training
        # on that accelerator is the only one shown its gradients.
        for name in ("end_training", "free_memory"):
            original = getattr(self._accelerator, name, None)
            if callable(original):
                wrapper = self._closing_first(original)
                self._patches.append(AttributePatch(self._accelerator, name, wrapper))

    def _closing_first(self, original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # inside an except block: the exception being handled ended the run, unless it is
            # an iterator's end (`except StopIteration:` around next(loader) ends a loop that
            # ran out of batches, no failure)
            exception = sys.exc_info()[1]
            if isinstance(exception, StopIteration | StopAsyncIteration):
                exception = None
            try:
                self.close(exception)
            finally:
                result = original(*args, **kwargs)
            return result

        return wrapper

    def _noting_clipped(self, clip: Any) -> Any:
        def wrapper(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(parameters, torch.Tensor):
                with contextlib.suppress(TypeError):  # not iterable: Accelerate's error, as is
                    parameters = list(parameters)
            outer = self._accelerator_clipping
            seen = [parameters] if isinstance(parameters, torch.Tensor) else parameters
            self._accelerator_clipping = seen if isinstance(seen, list) else None
            try:
                return clip(parameters, *args, **kwargs)
            finally:
                self._accelerator_clipping = outer

        return wrapper

    def clip_grad_norm_(self, parameters: Any, max_norm: float, **kwargs: Any) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` that lets the callbacks see the unclipped gradients
        first (for plain loops that clip).

        With several attached optimizers, clipping the parameters of only some of them (a GAN
        clipping one network before its optimizer steps) shows the gradients of those
        optimizers, one at a time, as their own ``step()`` would.

        Under FSDP1 (``FullyShardedDataParallel``) the parameters are this rank's flat shards:
        torch's function would clip each rank by its own shard's norm (2.88 and 2.65 for a
        total of 3.91, and the ranks' weights drift apart). The attached model's own
        ``FullyShardedDataParallel.clip_grad_norm_`` clips by the total instead; parameters
        that are not all of that model's raise ``ValueError``.
        """
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        root = self._fsdp1_root(parameters)
        self._hide_if_scaled(parameters)
        if len(self._attached) > 1:
            self._gradients_final(parameters=parameters)
        else:
            self.gradients_ready()
        if root is not None:
            return root.clip_grad_norm_(max_norm, norm_type=kwargs.get("norm_type", 2.0))
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, **kwargs)

    def _hide_if_scaled(self, parameters: list[Any]) -> None:
        """Clipping before the attached GradScaler unscaled the gradients (torch's AMP recipe
        calls ``scaler.unscale_(optimizer)`` first): they are still multiplied by the loss
        scale now, and clipped after. The optimizers owning ``parameters`` show none in this
        step rather than scaled or clipped ones (warned once)."""
        if self._scaler is None or not _scaler_enabled(self._scaler):
            return
        scaled = {id(o) for o in self._owners_of(parameters) if id(o) not in self._unscaled}
        if not scaled or scaled <= self._hidden:
            return
        self._hidden |= scaled
        if not self._warned_clip_scaled:
            self._warned_clip_scaled = True
            warnings.warn(
                "trainvitals Vitals: clip_grad_norm_ was called before the GradScaler unscaled "
                "the gradients: they are still multiplied by the loss scale (and so is what "
                "the clipping compares with max_norm); they are not shown to the callbacks at "
                "such steps. Call scaler.unscale_(optimizer) before clipping, as torch's AMP "
                "recipe does (warned once)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _owners_of(self, parameters: list[Any]) -> list[Any]:
        """The attached optimizers that update any of ``parameters``."""
        ids = {id(p) for p in parameters}
        return [
            o
            for o in self.ctx.optimizers
            if any(id(p) in ids for group in o.param_groups for p in group["params"])
        ]

    def _before_optimizer_step(self, optimizer: Any = None) -> None:
        """The gradient hooks, unless the gradients shown would be scaled (``_hidden``)."""
        hidden = self._hidden if optimizer is None else self._hidden & {id(optimizer)}
        if not hidden:
            self._each("before_optimizer_step")

    def _fsdp1_root(self, parameters: list[Any]) -> Any:
        """The attached FSDP1 root whose ``clip_grad_norm_`` clips ``parameters`` (flat shards,
        or views into them), ``None`` when they are not FSDP1's."""
        if not any(map(is_flat_shard, parameters)):
            return None
        model = self.ctx.model
        is_root = type(model).__name__ == "FullyShardedDataParallel" and callable(
            getattr(model, "clip_grad_norm_", None)
        )
        if is_root and {id(p) for p in parameters} == {id(p) for p in model.parameters()}:
            return model
        raise ValueError(
            "Vitals.clip_grad_norm_: the parameters are FSDP1 (FullyShardedDataParallel) "
            "shards, which torch.nn.utils.clip_grad_norm_ would clip rank by rank; attach the "
            "FSDP-wrapped root model and pass all of its parameters (clipped by its own "
            "clip_grad_norm_), or call vitals.gradients_ready() and then your FSDP model's "
            "clip_grad_norm_"
        )

    def _gradients_final(
        self, *, parameters: list[Any] | None = None, optimizers: Any = None
    ) -> None:
        """The gradients of ``parameters`` (or of ``optimizers``) are final, about to be clipped.
        Several attached optimizers, only some of which own them (a GAN clipping one network
        before its optimizer steps): show those optimizers' gradients one at a time, as their
        own ``step()`` would; else every gradient at once (:meth:`gradients_ready`)."""
        if len(self._attached) > 1 and not self._grads_seen_for_step:
            if parameters is not None:
                owners = self._owners_of(parameters)
            else:
                listed = optimizers if isinstance(optimizers, list | tuple) else [optimizers]
                ids = {id(inner) for o in listed if (inner := _inner_or_none(o)) is not None}
                owners = [o for o in self.ctx.optimizers if id(o) in ids]
            if owners and len(owners) < len(self.ctx.optimizers):
                for optimizer in owners:
                    self._show_optimizer(optimizer)
                return
        self.gradients_ready()

    def _start(self) -> None:
        if self._started:
            return
        if self.ctx.model is None:
            raise RuntimeError("call vitals.attach(model, optimizer) before the first batch")
        self._started = True
        self._resolve_default_groups()  # (init_process_group may have come after attach())
        self.ctx.start_step = self.ctx.step  # 0, or the step load_state_dict restored
        _close_at_exit_if_open(self)
        if self._owns_writer:
            # before anything is logged: its JSONL sink drops what an interrupted run wrote
            # from that step on (a writer given to us is the caller's to tell)
            self.ctx.writer.resume_at(self.ctx.step)
        self._each("run_start")

    def _each(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            cb._dispatch(hook, self.ctx, *args)

    # ------------------------------------------------------------------ per batch / step

    def batch(
        self,
        batch: Any = None,
        *,
        batch_size: int | None = None,
        num_tokens: int | None = None,
    ) -> None:
        """Call once per training micro-batch, before its forward pass.

        ``batch_size`` (samples) and ``num_tokens`` default to what a callback's own
        ``batch_size_fn``/``num_tokens_fn`` reads off ``batch``, else to what can be read off it
        (:func:`~trainvitals.adapters.context.infer_batch_size`: the first dim of its first
        tensor, dataclass fields included; :func:`~trainvitals.adapters.context.infer_num_tokens`:
        the element count of ``input_ids``, also of a ``(features, labels)`` batch's features,
        else of a 2-d ``int64``/``int32`` tensor that is the batch's first of two or more dims,
        bool masks skipped; padding included). Pass them
        to count only real tokens (``num_tokens=batch["attention_mask"].sum()``: a 0-d tensor
        stays on the device until a logging step), or the tokens of this rank.
        Calls inside :meth:`validating` are ignored (validation batches are not training).
        """
        if self.ctx.in_validation:
            return
        if self._closed:  # the run has ended: no callback may see more of it
            self._warn_closed("batch()")
            return
        self._loop_calls_batch = True
        if self._closure_replays:
            return  # (a closure called again inside one step: the same micro-batches)
        self._micro_batch(batch, batch_size, num_tokens)

    def _model_pre_hook(self) -> Any:
        """The attached model's forward pre-hook, which counts its forwards as micro-batches in
        a loop that does not call :meth:`batch`.

        Its work runs eagerly (:func:`eager_hook`): traced, it would guard on the driver's
        state (recompiled forward after forward). But a disabled function met while Dynamo
        traces code compiled with ``fullgraph=True`` (``torch.compile(train_step,
        fullgraph=True)`` calling the model, a model compiled whole with its hooks) makes the
        user's forward raise. So the hook itself is a thin function that Dynamo may trace: a
        loop that calls :meth:`batch` makes it return at once (a guard on a host flag); traced
        otherwise (``torch.compiler.is_compiling()``), it only notes that forwards run where
        the driver cannot count them (replayed by the compiled code: warned at the optimizer
        step). Dynamo does not compile it as a frame of its own (``skip_code``): called
        eagerly (from ``nn.Module.__call__`` outside compiled code, also for a model compiled
        in place with ``model.compile()``), it counts."""
        on_forward = eager_hook(self._on_model_forward)

        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            if self._loop_calls_batch:
                if not self._forward_seen and not torch.compiler.is_compiling():
                    self._forward_seen = module.training and torch.is_grad_enabled()
                return
            if torch.compiler.is_compiling():
                # (a training forward: an evaluation run compiled is not one to count)
                if module.training and torch.is_grad_enabled():
                    self._forwards_traced = True
                return
            on_forward(module, args)

        skip_code = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
        skip_code = getattr(skip_code, "skip_code", None)
        if callable(skip_code):
            skip_code(pre_hook.__code__)
        return pre_hook

    def _on_model_forward(self, module: torch.nn.Module, args: Any) -> None:
        # A loop without batch() calls: count each training forward of the attached model as a
        # micro-batch with unknown sizes, so it still gets every step, step 0 included, from its
        # first forward on. A loop that calls batch() counts its micro-batches itself: a second
        # forward of one micro-batch is not another one.
        if self._loop_calls_batch:
            return
        if self.ctx.in_validation or not module.training or not torch.is_grad_enabled():
            return
        self._forward_seen = True
        if self._closure_replays:
            # the closure evaluated again inside one optimizer.step(closure) (LBFGS), or SAM's
            # at perturbed weights: the step's micro-batches again, not new ones (nor, its
            # gradients shown, a new step)
            return
        self._micro_batch(None, None, None)

    def _micro_batch(self, batch: Any, batch_size: int | None, num_tokens: int | None) -> None:
        self._start()
        if self._grads_seen_for_step or self._shown_in_step or self._stepped:
            # The gradients of the previous step were observed but the optimizer did not step
            # (AMP's GradScaler skips steps with inf/nan gradients), or, with several
            # optimizers, some stepped in it (all of them, in a loop that calls batch(), or
            # not all: a generator stepped every k batches) or had their gradients shown: that
            # step is over. Under accumulation no optimizer steps before the step's last
            # micro-batch, so its micro-batches stay in one step.
            self._end_step()
        self._replay_carried()
        ctx = self.ctx
        if ctx.micro_batches_in_step == 0:
            # A new step: the previous step's values go to the sinks now, not when a later
            # step logs (a W&B run that the loop's own accelerator.log(step=) moved on would
            # refuse them by then). Here rather than at the optimizer step, so that what the
            # loop logs after optimizer.step() still joins its step's batch.
            end_step = getattr(ctx.writer, "end_step", None)
            if callable(end_step):
                end_step()
        ctx.micro_batch = ctx.micro_batches_in_step
        ctx.micro_batches_in_step += 1
        default: BatchInfo | None = None
        sizes: dict[str, tuple[Any, Any]] = {}
        self._keep_sizes(sizes)  # (filled below)
        for cb in self.callbacks:
            if getattr(cb, "batch_size_fn", None) or getattr(cb, "num_tokens_fn", None):
                info = cb._batch_info(batch) if batch is not None else BatchInfo(batch)
            else:
                if default is None:
                    default = BatchInfo(
                        batch,
                        infer_batch_size(batch) if batch is not None else None,
                        infer_num_tokens(batch) if batch is not None else None,
                    )
                info = default
            if batch_size is not None or num_tokens is not None:
                info = BatchInfo(
                    batch,
                    info.batch_size if batch_size is None else batch_size,
                    info.num_tokens if num_tokens is None else num_tokens,
                )
            sizes[cb.state_key] = (info.batch_size, info.num_tokens)
            cb._dispatch("micro_batch_start", ctx, info)

    def _replay_carried(self) -> None:
        """Tell the callbacks of the micro-batches a restored checkpoint carried from inside an
        accumulation window (saved after micro-batch k of a step), once this process trains:
        they were consumed before the checkpoint and belong to the step in progress, which
        Accelerate resumes at micro-batch k + 1 (``save_state`` keeps ``Accelerator.step``, its
        micro-batch counter), so the step's counts match an uninterrupted run's. Each callback
        gets ``micro_batch_start`` with the sizes it was told then and ``batch=None``;
        ``ctx.micro_batch``/``micro_batches_in_step`` count only the micro-batches this process
        runs (what hooks on the model can see: the carried ones' activations and gradients are
        not in the checkpoint)."""
        carried, self._carried = self._carried, []
        self._carried_in_step += len(carried)
        for sizes in carried:
            self._keep_sizes(sizes)
            for cb in self.callbacks:
                if cb.state_key in sizes:
                    batch_size, num_tokens = sizes[cb.state_key]
                    info = BatchInfo(None, batch_size, num_tokens)
                    cb._dispatch("micro_batch_start", self.ctx, info)

    def _keep_sizes(self, sizes: dict[str, tuple[Any, Any]]) -> None:
        """Keep a micro-batch's sizes for a checkpoint taken inside the step's accumulation
        window, unless the step already has more micro-batches than any window could have
        (:func:`_window_bound`: any window, plus the micro-batches a restore carried): then the
        driver sees no step end (a ``GradScaler`` not given to :meth:`attach` skipping every
        step, an optimizer stepped that is not attached), and the list would grow by one entry
        per micro-batch for the rest of the run (a 0-d tensor each, where the loop passes
        ``num_tokens`` as one). Such a step is not one to checkpoint mid-window: its sizes are
        dropped (a checkpoint carries none of its micro-batches) until a step ends."""
        if self._sizes_dropped:
            return
        bound = _window_bound(self.ctx.accumulate_grad_batches, self._carried_in_step)
        if len(self._step_batches) < bound:
            self._step_batches.append(sizes)
            return
        self._sizes_dropped = True
        self._step_batches = []
        if not self._warned_no_step:
            self._warned_no_step = True
            warnings.warn(
                f"trainvitals Vitals: more than {bound} micro-batches without the end of an "
                "optimizer step: no step of an attached optimizer ran (a GradScaler that skips "
                "every step, not passed to attach(..., scaler=scaler)? an optimizer that is "
                "not attached?); the callbacks log nothing until one does, and a checkpoint "
                "carries none of this step's micro-batches (warned once)",
                RuntimeWarning,
                stacklevel=4,
            )

    def gradients_ready(self) -> None:
        """Gradients of this step are final (unscaled, unclipped): run the gradient hooks now.

        Called by the driver's optimizer pre-hook when nothing called it earlier in the step.
        """
        if self._grads_seen_for_step or self._closed:  # (closed: the run has ended)
            return
        self._start()
        self._grads_seen_for_step = self._shown_in_step = True
        self._awaiting_step |= self._attached
        self._before_optimizer_step()

    def _show_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Several optimizers: run the gradient hooks for ``optimizer``, about to step, unless
        its gradients were shown since its last step. As Lightning's manual optimization runs
        ``on_before_optimizer_step`` per ``optimizer.step()``: with separate backward passes
        (a GAN) no single moment holds every optimizer's current gradients."""
        if id(optimizer) in self._awaiting_step or self._closed:
            return
        self._start()
        self._awaiting_step.add(id(optimizer))
        self._shown_in_step = True
        self.ctx.stepping_optimizer = optimizer
        try:
            self._before_optimizer_step(optimizer)
        finally:
            self.ctx.stepping_optimizer = None

    def _on_pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if self._nested_step(optimizer):
            return None
        # (torch passes the step's own arguments: ``args[0]`` is the optimizer itself)
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1:2] or (None,))[0]
        if callable(closure):
            # optimizer.step(closure) (LBFGS, the pattern torch documents): the gradients are
            # made by the closure's backward, inside step(); shown here they would be the last
            # step's (or none). Shown after the closure's first call instead, as Lightning
            # runs on_before_optimizer_step after its closure (LBFGS calls it again at other
            # points: the step's gradients are those of its first call). Unless the loop ran
            # the step's forward (and backward) before step(), as SAM's does: its closure
            # re-evaluates them at weights step() perturbs first, so they are shown now.
            made_before = self._forward_seen
            wrapped = self._closure_showing_gradients(optimizer, closure, made_before)
            if made_before:
                self._closure_replays = True
                self._show_gradients(optimizer)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        self._show_gradients(optimizer)
        return None

    def _closure_showing_gradients(
        self, optimizer: Any, closure: Callable[[], Any], shown: bool
    ) -> Any:

        def closure_then_gradients() -> Any:
            nonlocal shown
            try:
                loss = closure()
            except BaseException:
                self._closure_replays = False  # (step() raises: no post-hook)
                raise
            if not shown:
                shown = self._closure_replays = True
                self._show_gradients(optimizer)
            return loss

        return closure_then_gradients

    def _show_gradients(self, optimizer: Any) -> None:
        """The gradient hooks for ``optimizer``, about to step (its gradients are final)."""
        if self._forwards_traced and not self._loop_calls_batch and not self._warned_traced:
            self._warned_traced = True
            warnings.warn(
                "trainvitals Vitals: the attached model runs inside code compiled with "
                "torch.compile (a compiled training function, or the model compiled whole with "
                "its hooks), where the driver cannot see its forwards: call vitals.batch(batch) "
                "once per micro-batch so that micro-batches, samples and tokens are counted "
                "(warned once)",
                RuntimeWarning,
                stacklevel=2,
            )
        if self._scaled_at_step and self._scaler_stepping == id(optimizer):
            # scaler.step(fused optimizer): its gradients are still multiplied by the loss
            # scale here (it unscales them inside its step): none rather than scaled ones
            if not self._warned_fused:
                self._warned_fused = True
                warnings.warn(
                    "trainvitals Vitals: a fused (or capturable) optimizer unscales its "
                    "gradients inside its own step() under the GradScaler, so they are still "
                    "multiplied by the loss scale when the callbacks would see them; gradients "
                    "are not shown at such steps. Call scaler.unscale_(optimizer) before "
                    "scaler.step(optimizer) (or clip with vitals.clip_grad_norm_) to have "
                    "them (warned once)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        if self._unscaled and not self._attached <= self._unscaled:
            # The scaler is in use and another attached optimizer's gradients are still
            # multiplied by the loss scale. This one's were shown when the scaler unscaled them
            # (inside scaler.step(opt), as in torch.amp's scaler.step(opt0); scaler.step(opt1)
            # example, or in Accelerate's clipping), else they cannot be shown right: still
            # scaled (stepped without scaler.step), or unscaled by an explicit
            # scaler.unscale_(opt) that waited for the others (all at once) and may have been
            # clipped since. No gradients rather than wrong ones at this step.
            if id(optimizer) not in self._awaiting_step and not self._warned_scaled:
                self._warned_scaled = True
                warnings.warn(
                    "trainvitals Vitals: an optimizer stepped while another attached optimizer's "
                    "gradients were still scaled by the GradScaler, after scaler.unscale_(opt) "
                    "or without scaler.step(opt); gradients are not shown to the callbacks at "
                    "such steps. Call scaler.unscale_(opt) for every optimizer before the first "
                    "step, or clip with vitals.clip_grad_norm_, or let scaler.step(opt) unscale "
                    "(warned once)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return
        if len(self._attached) == 1:
            self.gradients_ready()
        else:
            self._show_optimizer(optimizer)

    def _nested_step(self, optimizer: Any) -> bool:
        """At a step pre-hook: whether this is a step() called inside the same optimizer's
        hooked step() (``super().step()``), whose hooks are the outer call's again."""
        key = id(optimizer)
        outer = self._step_calls.get(key)
        if outer is not None:
            frame = sys._getframe(2)
            while frame is not None:
                if frame is outer[0]:
                    self._step_calls[key] = (outer[0], outer[1] + 1)
                    return True
                frame = frame.f_back
            # (not inside it: that step raised, its post-hook never ran)
        self._step_calls[key] = (sys._getframe(2), 1)
        return False

    def _on_post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        call = self._step_calls.pop(id(optimizer), None)
        if call is not None and call[1] > 1:
            self._step_calls[id(optimizer)] = (call[0], call[1] - 1)  # (an inner step())
            return
        self._closure_replays = self._forward_seen = False
        self._start()
        self._awaiting_step.discard(id(optimizer))
        self._stepped.add(id(optimizer))
        self._step_order.append(id(optimizer))
        # The step is the batch. One optimizer: it ends now. Several, in a loop that calls
        # batch(): with the batch (_end_stepped_step), as one may step again after every
        # attached one stepped (a critic stepped k times after the generator). Several, with
        # forwards counted as micro-batches: once every one stepped, else with the batch.
        if self._attached <= self._stepped and (
            len(self._attached) == 1 or not self._loop_calls_batch
        ):
            self._end_step()

    def _end_stepped_step(self) -> None:
        """End the step in progress if an attached optimizer stepped in it, or (several
        optimizers) had its gradients shown, its step() skipped by the GradScaler (else a
        no-op): its batch is over (several optimizers; with one, the step ended at its step()
        or at the scaler's update())."""
        shown = len(self._attached) > 1 and self._shown_in_step
        if (self._stepped or shown) and not self._closed:
            self._end_step()

    def _end_step(self) -> None:
        self._replay_carried()  # (a step restored inside its window ending without a batch)
        self._each("step_end")
        self.ctx.step += 1
        self._start_step()
        if self in _open_at_exit:  # (a multi-rank run: a sink may have opened since)
            _keep_exit_hook_last()

    def _start_step(self) -> None:
        """The step in ``ctx.step`` starts from its first micro-batch: nothing of it seen yet."""
        self.ctx.micro_batch = 0
        self.ctx.micro_batches_in_step = 0
        self._grads_seen_for_step = self._shown_in_step = False
        self._awaiting_step.clear()
        self._stepped.clear()
        if self._step_order:
            self._last_order = self._step_order
        self._step_order = []
        self._unscaled.clear()
        self._hidden.clear()
        self._step_batches = []
        self._carried = []
        self._carried_in_step = 0
        self._sizes_dropped = False

    @contextlib.contextmanager
    def validating(self) -> Iterator[None]:
        """Wrap evaluation so its time is not counted as training time::

        with vitals.validating():
            evaluate(model)

        Several optimizers: a step in which every attached optimizer stepped ends here, before
        the evaluation, unless their ``step()`` calls so far begin the last batch's without
        completing them (a generator, then the critic k times: evaluated after the critic's
        first step); that one and one in which only some stepped stay open (the batch goes on
        after the evaluation) and end as without it (module docstring).

        After :meth:`close` it only runs the block: the callbacks have had their last hook.
        """
        if self._closed:
            self._warn_closed("validating()")
            yield
            return
        # Evaluation runs between batches (as Lightning's, after the batch ended): a step in
        # which every attached optimizer stepped is over (several optimizers). One in which
        # only some stepped (or had their gradients shown and skipped) may be a batch that goes
        # on after the evaluation, the next optimizer stepping (the loop validated between two
        # optimizers' steps of one batch): it ends with its batch, at the next micro-batch,
        # state_dict() or close(), as without the evaluation; ended here, that batch would be
        # two steps. Between batches (a generator stepped every k batches) its counts are the
        # same either way (the evaluation's time is not the step's). Likewise one in which every
        # optimizer stepped but whose step() calls so far begin the last batch's without
        # completing them (the generator, then the critic k times: the critic steps again).
        if (
            self._stepped
            and self._attached <= self._stepped
            and not self._batch_goes_on()
            and not self._closed
        ):
            self._end_step()
        self.ctx.in_validation = True
        self._each("validation_start")
        try:
            yield
        finally:
            self.ctx.in_validation = False
            if not self._closed:  # (closed inside the block: run_end was their last hook)
                self._each("validation_end")

    def _batch_goes_on(self) -> bool:
        """Several optimizers, every one stepped in the step in progress: whether its batch is
        known to go on, its optimizers' step() calls so far being a strict beginning of the last
        batch's (a generator then the critic k times: the critic steps again). A loop steps its
        optimizers in the same order every batch; an evaluation after the first critic step then
        sits inside the batch, which stays one step. Unknown in the run's first stepped batch
        (no earlier one to compare with)."""
        order, last = self._step_order, self._last_order
        return len(order) < len(last) and last[: len(order)] == order

    def _warn_closed(self, call: str) -> None:
        if call not in self._warned_closed:
            self._warned_closed.add(call)
            # stacklevel: the caller of batch() (validating(): contextlib's __enter__ between)
            stacklevel = 3 if call == "batch()" else 4
            warnings.warn(
                f"Vitals.{call} after close(): ignored", RuntimeWarning, stacklevel=stacklevel
            )

    # ------------------------------------------------------------------ state

    @property
    def step(self) -> int:
        """Optimizer steps completed so far (several optimizers: batches over, module docstring)."""
        return self.ctx.step

    def state_dict(self) -> dict[str, Any]:
        """The step counter, every callback's state and, taken inside a gradient-accumulation
        window, the sizes of the step's micro-batches so far (plain Python data; see the module
        docstring).

        On a multi-rank run some callbacks reduce their counters over the ranks here (one small
        collective each), and then every rank's micro-batch sizes of a step in progress are
        gathered too (one more, see the module docstring): call it on every rank, as
        ``accelerator.save_state`` does, not on rank 0 only.

        With several optimizers, a step in which they stepped (all of them, or a discriminator
        in a batch where the generator did not step) ends here, as at the next batch: a
        checkpoint is taken between batches, and its step counter and counts must include
        that batch.
        """
        self._end_stepped_step()
        callbacks = {cb.state_key: cb.state_dict() for cb in self.callbacks}
        # a checkpoint inside an accumulation window: the step's micro-batches so far
        window = [
            {key: [_number(n) for n in pair] for key, pair in sizes.items()}
            for sizes in self._carried + self._step_batches
        ]
        state: dict[str, Any] = {
            "step": self.ctx.step,
            "callbacks": callbacks,
            "micro_batches_in_step": window,
            # (a restore on another number of ranks splits the window's sizes by it: _own_window)
            "world_size": _world_size(),
        }
        by_rank = gather_window(window, self.callbacks)
        if by_rank is not None:
            state["micro_batches_in_step_by_rank"] = by_rank
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. A dict that is not one (no ``step`` or
        ``callbacks``, a step that is not a non-negative integer, ``callbacks`` not a dict)
        raises ``ValueError`` before anything is restored; a callback without an entry is
        warned and keeps its state; unreadable micro-batch sizes of a step in progress are
        warned and not carried (as under Lightning)."""
        if (
            not isinstance(state_dict, dict)
            or "callbacks" not in state_dict
            or "step" not in state_dict
        ):
            raise ValueError("not a Vitals state_dict (expected keys 'step' and 'callbacks')")
        self._apply_state(state_dict)

    def _apply_state(self, state_dict: dict[str, Any]) -> None:
        # Everything checked and read before anything changes: a bad entry used to fail
        # half-way (the step set, the writer replaced, some callbacks restored) or, a negative
        # step, only at the first batch() inside the loop.
        step = _checkpoint_step(state_dict["step"])
        states = state_dict["callbacks"]
        if not isinstance(states, dict):
            raise ValueError(
                "not a Vitals state_dict: its 'callbacks' must be a dict of each callback's "
                f"state by state_key, got {type(states).__name__}"
            )
        try:
            carried = [
                {str(key): (pair[0], pair[1]) for key, pair in sizes.items()}
                for sizes in _own_window(state_dict)
            ]
        except Exception as exc:  # (a damaged entry: the restore goes on without it)
            warnings.warn(
                f"Vitals.load_state_dict: the checkpoint's micro-batch sizes of the step in "
                f"progress are unreadable ({type(exc).__name__}: {exc}); the resumed step counts "
                "only the micro-batches trained after the resume",
                RuntimeWarning,
                stacklevel=3,
            )
            carried = []
        if step < self.ctx.step and not self._closed:
            # A rollback to an earlier step: a FanoutWriter refuses steps lower than those it
            # was given, so every callback's next write would fail. Our own writer is replaced
            # by a fresh one that takes the replayed steps (told resume_at, its JSONL sink
            # drops the abandoned timeline's lines from the restored step on). A FanoutWriter
            # given to us (or to a callback) cannot be replaced nor rewound (it has no such
            # call): the replayed steps below the step we were at are dropped from it with a
            # warning (ReplayWriter), the later ones are written.
            if self._owns_writer:
                self.ctx.writer.close()
                self.ctx.writer = _default_writer(self._writer_accelerator, self.ctx.run_dir)
                self.ctx.writer.resume_at(step)
            else:
                self.ctx.replay_run_writer = True
            self.ctx.replay_floor = max(self.ctx.replay_floor or 0, self.ctx.step)
        self.ctx.step = step
        # A restore while a step is in progress (a rollback) replays that step from the
        # checkpoint on: the micro-batches and gradients seen since belong to the abandoned
        # timeline (those the checkpoint carried are told again, below).
        self._start_step()
        for cb in self.callbacks:
            if cb.state_key in states:
                cb.load_state_dict(states[cb.state_key])
            else:
                warnings.warn(f"Vitals.load_state_dict: no state for {cb.state_key}", stacklevel=2)
        # The micro-batches of the step in progress when the checkpoint was taken (inside an
        # accumulation window), told to the callbacks when this process trains on: the restored
        # step goes on from there, as Accelerate's does (_replay_carried).
        self._carried = carried

    # ------------------------------------------------------------------ end

    def close(self, exception: BaseException | None = None) -> None:
        """End the run: final hooks, remove hooks, flush (and close the writer if we made it;
        a writer given without ``flush`` is left as it is).

        ``exception``: what ended the run, if anything did (``with vitals:`` passes it). The
        callbacks get ``exception_raised`` and a writer we made ends its runs as failed (as
        interrupted after ``KeyboardInterrupt``); ``SystemExit`` with status 0
        (``sys.exit()``, ``sys.exit(0)``: a script stopping early, its target reached) is a
        successful end, as if there were no exception.
        """
        if self._closed:
            return
        from trainvitals.adapters.fanout_writer import _run_outcome

        failed, interrupted = _run_outcome(exception)
        if not failed:
            exception = None
        if exception is None or self._attached <= self._stepped:
            # The run's last batch (several optimizers). After a failure only when every
            # attached optimizer stepped in it: a batch that failed before may be half done.
            self._end_stepped_step()
        self._closed = True
        _open_at_exit.discard(self)
        for cb in self.callbacks:
            if _running_in.get(id(cb)) is self:
                del _running_in[id(cb)]
        if self._started:
            if exception is None:
                self._each("run_end")
            else:
                self._each("exception_raised", exception)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for patch in reversed(self._patches):  # (another driver's later wrapper is kept)
            patch.undo()
        self._patches.clear()
        writer = self.ctx.writer
        if self._owns_writer:
            writer.close(failed=failed, interrupted=interrupted)
        else:
            flush = getattr(writer, "flush", None)
            if callable(flush):  # (a writer given with add_scalars only has nothing to flush)
                flush()

    def __enter__(self) -> Vitals:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(exc)


# Drivers of a multi-rank run, started and not closed: closed at the interpreter's exit.
_open_at_exit: weakref.WeakSet[Vitals] = weakref.WeakSet()
_exit_hook = [False]


def _close_at_exit_if_open(vitals: Vitals) -> None:
    """On a multi-rank run, have ``vitals`` closed when the interpreter exits, if nothing closed
    it before. ``accelerator.end_training()`` called on rank 0 only (``if
    accelerator.is_main_process: accelerator.end_training()``) closes rank 0's driver alone:
    the last batch's step of several optimizers (and ``MoEMetricsMonitor``'s report of
    micro-batches after the last step) ends there with its collectives, which wait for the other
    ranks; those close at their exit and join them, so neither waits forever and every rank's
    last step is counted (and their writers flushed).

    The drivers close before the writers: what a close logs (that last step, a validation after
    the last logging step) must reach a writer still open. The writers close at exit in a
    ``threading._register_atexit`` hook (before the backends' own exit hooks end their runs;
    those hooks run before every ``atexit`` hook, the last registered first), which a writer
    registers again whenever one of its sinks opens its backend; the drivers' hook of that kind
    is registered here and again at each step's end when another was registered after it
    (:func:`_keep_exit_hook_last`), so it runs first. When another non-daemon thread is still
    alive there (it may still be training or logging) both leave the close to their ``atexit``
    hooks, where the drivers' (registered after the writer module's) runs first too."""
    import trainvitals.adapters.fanout_writer  # noqa: F401  (its exit hooks first)
    from trainvitals.distributed import group_size, world_group

    if group_size(world_group()) <= 1:
        return
    _open_at_exit.add(vitals)
    if not _exit_hook[0]:
        _exit_hook[0] = True
        atexit.register(_close_open_drivers)
    _keep_exit_hook_last()


def _keep_exit_hook_last() -> None:
    """Have :func:`_close_open_drivers_first` be the last ``threading._register_atexit`` hook
    (the first to run at exit): registered again when another (a writer's, a backend's) came
    after it. An earlier registration left in the list runs later and finds nothing open."""
    register = getattr(threading, "_register_atexit", None)
    hooks = getattr(threading, "_threading_atexits", None)  # (entries: functools.partial)
    if register is None or hooks is None:  # pragma: no cover - CPython has both since 3.9
        return
    if hooks and getattr(hooks[-1], "func", None) is _close_open_drivers_first:
        return
    with contextlib.suppress(RuntimeError):  # raised once the interpreter is shutting down
        register(_close_open_drivers_first)


def _close_open_drivers_first() -> None:
    """:func:`_close_open_drivers` before the writers' threading exit hook closes them, unless
    another non-daemon thread is alive (then at ``atexit``, as the writers do)."""
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return
    _close_open_drivers()


def _close_open_drivers() -> None:
    """Close the drivers still open at exit (:func:`_close_at_exit_if_open`): not when the
    process is ending on a failure (an uncaught exception, a non-zero ``sys.exit``): the other
    ranks may not come to the collectives of a close then; nor once the process group is gone
    (they cannot run)."""
    from trainvitals.adapters.fanout_writer import _ProcessEnd
    from trainvitals.distributed import is_distributed

    failed, _ = _ProcessEnd.outcome()
    if failed or not is_distributed():
        return
    for vitals in list(_open_at_exit):
        try:
            vitals.close()
        except Exception as exc:  # never disturb the exit
            warnings.warn(
                f"trainvitals Vitals: closing at exit failed ({type(exc).__name__}: {exc})",
                RuntimeWarning,
                stacklevel=1,
            )


# The most micro-batches of one step whose sizes a checkpoint inside its accumulation window
# keeps (or accumulate_grad_batches, if larger): more than any window has (a single device
# reaching a global batch of 4M tokens with micro-batches of 2048 tokens accumulates 2048).
_MAX_WINDOW_MICRO_BATCHES = 4096


def _window_bound(accumulate_grad_batches: int | None, carried: int = 0) -> int:
    """The most micro-batches of one step whose sizes a checkpoint inside its accumulation
    window keeps: any window's (``accumulate_grad_batches``, at least
    :data:`_MAX_WINDOW_MICRO_BATCHES`), plus the ``carried`` micro-batches a restored
    checkpoint told this rank for the step (restored on fewer ranks, rank 0 is told every old
    rank's: 1024 ranks x 8 micro-batches onto fewer)."""
    return max(accumulate_grad_batches or 1, _MAX_WINDOW_MICRO_BATCHES) + carried


def gather_window(window: list[Any], callbacks: Iterable[Any]) -> list[Any] | None:
    """Every rank's micro-batch sizes of the step in progress, by global rank, for the one copy
    of the state a checkpoint keeps (rank 0's): each rank restores its own (ranks'
    micro-batches differ in size: uneven last batches, variable-length sequences). One object
    gather over the world group, only where the state is collective anyway (a callback's
    ``state_dict`` reduces over the ranks: ``ThroughputMonitor``, ``RuntimeMonitor``, the
    callbacks that count samples and tokens), so a ``state_dict`` that a loop may call on rank
    0 alone (no such callback) stays free of collectives. ``None`` in a single process, or
    when no callback's state is collective. (The driver's and the Lightning callbacks'
    checkpoints.)"""
    from trainvitals.distributed import all_gather_objects, group_size, world_group

    world = world_group()
    if group_size(world) <= 1 or not any(_collective_state(cb) for cb in callbacks):
        return None
    try:
        return all_gather_objects(window, world)
    except Exception as exc:  # raised on every rank alike, after the collective
        from trainvitals._strict import strict

        if strict():
            raise
        warnings.warn(
            f"trainvitals: gathering the ranks' micro-batch sizes for a checkpoint failed "
            f"({type(exc).__name__}: {exc}); the checkpoint carries this rank's only",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _collective_state(callback: Any) -> bool:
    """Whether ``callback.state_dict()`` issues collectives (known from its configuration, the
    same on every rank)."""
    collectives = getattr(callback, "state_dict_collectives", None)
    if not callable(collectives):
        return False
    try:
        return bool(tuple(collectives()))
    except Exception:
        return False


def _world_size() -> int:
    """The number of ranks (1 in a single process), saved with a window's sizes."""
    from trainvitals.distributed import group_size, world_group

    return group_size(world_group())


def _own_window(
    state_dict: dict[str, Any], where: str = "Vitals.load_state_dict", stacklevel: int = 4
) -> Sequence[Any]:
    """The micro-batch sizes of the step in progress that this rank restores from a checkpoint
    taken inside an accumulation window: on as many ranks as saved it, its own row of
    ``micro_batches_in_step_by_rank``, else ``micro_batches_in_step`` (the saving rank's, rank
    0's in a checkpoint kept once: exact batches, and samples and tokens where the ranks' sizes
    were equal). On another number of ranks a rank's row means nothing (the new ranks split the
    rest of the window their own way): the new rank 0 restores every old rank's micro-batches
    and the other ranks none, so that the step's batches, samples and tokens, summed over the
    ranks, are those that ran (without the rows, rank 0's sizes stand for every old rank's:
    exact batches). ``where``: the entry point the warning names."""
    from trainvitals.distributed import global_rank

    world = _world_size()
    by_rank = state_dict.get("micro_batches_in_step_by_rank")
    window = state_dict.get("micro_batches_in_step", ())
    # (every row empty: taken between steps, nothing carried, whatever the world size; the
    # driver saves a row per rank also then)
    if isinstance(by_rank, list | tuple) and any(by_rank):
        if len(by_rank) == world:
            return by_rank[global_rank()]
        saved, rows, exact = len(by_rank), list(by_rank), True
    else:
        saved = state_dict.get("world_size")  # (absent in older checkpoints: taken as this one)
        if not window or not isinstance(saved, int) or saved < 1 or saved == world:
            return window
        # (rank 0's sizes stand for every old rank's: exact batches; samples and tokens too
        # when it was the only one)
        rows, exact = [window] * saved, saved == 1
    # Replayed on every new rank, rank 0's row counted its micro-batches once per new rank and
    # lost the other old ranks' (2 ranks -> 1: time/batches 10 for 11; 1 -> 2: 8 for 7).
    counts = (
        "batches, samples and tokens summed over the ranks are exact"
        if exact
        else "batches summed over the ranks are exact (its samples and tokens take rank 0's "
        "sizes for every old rank's: the checkpoint holds rank 0's only)"
    )
    warnings.warn(
        f"{where}: the checkpoint was taken inside an accumulation window on {saved} "
        f"rank{'s' if saved > 1 else ''}, this run has {world}: rank 0 restores the "
        "micro-batches every old rank ran in the step in progress and the other ranks none, "
        f"so the step's {counts}; which rank ran what in that step (per-rank values: device "
        "throughput) is not an uninterrupted run's",
        RuntimeWarning,
        stacklevel=stacklevel,
    )
    return [sizes for row in rows for sizes in row] if global_rank() == 0 else []


def _checkpoint_step(value: Any) -> int:
    """A checkpoint's ``step``: a non-negative integer (a 0-d integer tensor, a numpy integer,
    a float holding an integer, as a JSON or YAML round trip may leave it), else ``ValueError``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(
            f"not a Vitals state_dict: its 'step' must be a non-negative int, got {value!r:.80}"
        )
    return int(value)


def _number(value: Any) -> Any:
    """A micro-batch size as plain Python data for a checkpoint (a 0-d tensor's or a numpy
    scalar's value: ``torch.load``'s default ``weights_only=True`` refuses numpy scalars, and
    JSON both)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, numbers.Integral):  # (an int stays an int, a count as it was told)
        return value if type(value) is int else int(value)
    if isinstance(value, numbers.Real) and type(value) is not float:
        return float(value)
    return value


def _default_writer(accelerator: Any, run_dir: Path) -> Any:
    from trainvitals.adapters import FanoutWriter

    if accelerator is not None:
        # Its trackers, or metrics.jsonl in the run folder when it has none.
        return FanoutWriter.from_accelerator(accelerator, default_jsonl=run_dir / "metrics.jsonl")
    from trainvitals.adapters import JsonlSink

    return FanoutWriter([JsonlSink(run_dir / "metrics.jsonl")])


def _default_groups() -> ProcessGroups:
    from trainvitals.distributed import is_distributed

    return ProcessGroups.world() if is_distributed() else ProcessGroups()
