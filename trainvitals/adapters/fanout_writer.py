"""The fan-out writer: every scalar once, delivered to every sink through its batch API.

How a value travels
-------------------
1. **Training thread** (``add_scalar`` / ``add_scalars``): the key, value and step are checked
   (bad input raises here, before anything is queued) and the value is stored as it is: a
   Python float, or a reference to the one-element tensor. Nothing is copied, synchronised or
   moved. Values of the current step accumulate in one dict; a value for a key already logged
   in that step replaces the earlier one.
2. **Step boundary**: a call with a larger step (or ``end_step()``/``flush()``/``close()``)
   closes the current step and puts it on a bounded queue (``queue_size`` steps). With CUDA
   tensors in the step, a CUDA event is recorded on the current stream (a few microseconds);
   that is all the training thread does.
3. **Dispatcher thread**: takes a step off the queue and moves all of its tensors to the host
   in one batched transfer per (device, dtype): ``torch.stack`` on a side stream that waits for
   the recorded event, one non-blocking copy into pinned memory, one event the dispatcher (not
   the training thread) waits on, then ``tolist()``. It hands the resulting ``{key: float}`` to
   every sink's worker.
4. **Sink workers**: each sink has its own thread and its own bounded buffer of pending steps
   (``buffer_steps``), and delivers the steps in order through the backend's batch API. A slow,
   failing or hanging sink therefore delays nobody but itself: not the training thread, not the
   other sinks, not the dispatcher. Sinks marked ``thread_safe = False`` (Lightning's
   ``CSVLogger``, unknown loggers and trackers) are instead called from the training thread, at
   the next step boundary or ``flush()`` after their values reached the host, and before the
   loop's own log of a later step to the same tracker or logger (``_deliver_before``).

The tensor contract
-------------------
The writer keeps a *reference* to each tensor until its step has been copied to the host, some
time after the step closed. A caller must not modify such a tensor in place after handing it
over (hand over a fresh tensor: the result of an operation, or ``t.detach().clone()``). No
``.item()`` or ``.cpu()`` is ever issued per value, and the training thread never waits for
the device.

Faults
------
A sink whose ``write`` raises is reported once (a ``RuntimeWarning`` with its name and the
error) and retried with exponential backoff (``retry_backoff``); its pending steps stay in its
buffer, whose oldest step is dropped (and counted as missed) when it is full. After
``max_failures`` consecutive failures the sink is disabled with a warning saying how many steps
it missed. An ``OSError`` that retrying cannot fix (``errno`` ``ENOTDIR``, ``EISDIR``,
``EACCES``, ``EPERM``, ``EROFS``: a path that cannot be made or opened) disables the sink at
once, with one warning naming the error. A ``write`` that has not returned after
``sink_timeout`` seconds is reported as hung; ``flush()`` and ``close()`` stop waiting for it,
and for the sink's later writes until one of them returns within ``sink_timeout`` (``close()``
abandons such a sink at once). ``close()`` never raises because of a sink, and its last warning
lists every sink that missed steps.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import logging
import math
import numbers
import os
import queue
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from trainvitals import distributed
from trainvitals._patching import AttributePatch
from trainvitals.adapters.sinks.base import Sink, StepRefused
from trainvitals.adapters.sinks.base import warn as _warn  # (at the user's line; never raises)

__all__ = ["FanoutWriter"]

log = logging.getLogger(__name__)

_Tensor = torch.Tensor
_STOP = object()


# --------------------------------------------------------------------------------------------
# input checks (training thread)


def _bad_key(key: Any) -> None:
    """Raise for a key no backend can store; return for a non-ASCII key that is fine."""
    if not isinstance(key, str):
        raise TypeError(f"metric key must be a str, got {type(key).__name__}: {key!r}")
    if not key or key.isspace():
        raise ValueError(f"metric key must be a non-empty string, got {key!r}")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate ("\udcff": os.fsdecode of a name that is not UTF-8) has no UTF-8
        # form: TensorBoard's and W&B's protobufs raised for it at every retry of its step,
        # so each of those sinks was switched off and lost the rest of the run.
        raise ValueError(
            f"metric key {key!r} is not valid Unicode text (it holds a lone surrogate, which "
            "has no UTF-8 encoding); TensorBoard and W&B cannot store it"
        ) from None


def _as_value(key: str, value: Any) -> float | torch.Tensor:
    """``value`` as a float, or the one-element tensor itself; raises naming ``key``."""
    if isinstance(value, _Tensor):
        if type(value) is not _Tensor and hasattr(value, "placements"):
            value = _local_dtensor(key, value)
        n = value.numel()
        if n != 1:
            raise ValueError(
                f"value for key {key!r} is a tensor of shape {tuple(value.shape)} ({n} "
                "elements); expected a tensor with exactly one element"
            )
        if value.is_complex():
            raise TypeError(f"value for key {key!r} is a complex tensor; expected a real number")
        if value.is_meta:
            raise ValueError(f"value for key {key!r} is a meta tensor, which has no value")
        return value
    if isinstance(value, (bool, np.bool_)):
        return 1.0 if value else 0.0
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"value for key {key!r} does not fit a float64: {value!r}") from None
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        if value.size != 1:
            raise ValueError(
                f"value for key {key!r} is an array of shape {value.shape}; expected one element"
            )
        return float(value.reshape(()))
    raise TypeError(
        f"value for key {key!r} must be a real number, bool, numpy scalar or one-element "
        f"tensor, got {type(value).__name__}: {value!r:.80}"
    )


def _local_dtensor(key: str, value: Any) -> torch.Tensor:
    placements = value.placements
    if all(type(p).__name__ == "Replicate" for p in placements):
        return value.to_local()
    raise ValueError(
        f"value for key {key!r} is a DTensor with placements {placements}; reduce it to a "
        "replicated value (for example with .full_tensor()) before logging"
    )


def _as_step(step: Any) -> int:
    if type(step) is int:
        s = step
    elif isinstance(step, numbers.Integral) and not isinstance(step, (bool, np.bool_)):
        s = int(step)
    else:
        hint = (
            " (pass int(step); a tensor step would need a device sync)"
            if isinstance(step, _Tensor)
            else ""
        )
        raise TypeError(f"step must be an int, got {type(step).__name__}: {step!r:.40}{hint}")
    if s < 0:
        raise ValueError(f"step must be >= 0, got {s}")
    return s


def _as_walltime(walltime: Any) -> float:
    """``walltime=`` as Unix seconds; raises for what a backend would refuse at delivery (the
    JSONL and MLflow sinks failed on every retry of such a step and were switched off, losing
    the rest of the run)."""
    if not isinstance(walltime, numbers.Real) or isinstance(walltime, (bool, np.bool_)):
        raise TypeError(f"walltime must be a number of seconds, got {type(walltime).__name__}")
    try:
        seconds = float(walltime)
    except OverflowError:
        seconds = math.inf
    # (MLflow stores int64 milliseconds and refuses negative ones; JSON has no NaN or Inf)
    if not 0.0 <= seconds < _MAX_WALLTIME:
        raise ValueError(f"walltime must be finite Unix seconds >= 0, got {walltime!r:.40}")
    return seconds


_MAX_WALLTIME = 2.0**63 / 1000.0

_UNSET: Any = object()  # an argument not given (None is a value add_scalar refuses by name)


def _scalar_args(name: Any, value: Any, tag: Any, scalar_value: Any) -> tuple[Any, Any]:
    """``add_scalar``'s key and value from ours (``name``, ``value``) or ``SummaryWriter``'s
    names (``tag``, ``scalar_value``); raises ``TypeError`` for both names of one, or none."""
    if tag is not None:
        if name is not None:
            raise TypeError("add_scalar() got both name= and tag= (the same argument)")
        name = tag
    if scalar_value is not _UNSET:
        if value is not _UNSET:
            raise TypeError("add_scalar() got both value= and scalar_value= (the same argument)")
        value = scalar_value
    if name is None:
        raise TypeError("add_scalar() needs a key: add_scalar(name, value, step)")
    if value is _UNSET:
        raise TypeError(f"add_scalar({name!r}, ...) needs a value")
    return name, value


def _tagged_scalars_args(
    mapping: Any, second: Any, main_tag: Any, tag_scalar_dict: Any
) -> tuple[Any, Any]:
    """``add_scalars`` called with ``SummaryWriter``'s keywords ``main_tag=`` and/or
    ``tag_scalar_dict=``: its positional form ``(main_tag, tag_scalar_dict)``."""
    if main_tag is not None:
        if mapping is not None:
            raise TypeError("add_scalars() got main_tag= and a first positional argument")
        if not isinstance(main_tag, str):
            raise TypeError(f"main_tag must be a str, got {type(main_tag).__name__}")
        mapping = main_tag
    elif not isinstance(mapping, str):
        raise TypeError("add_scalars(tag_scalar_dict=...) needs main_tag (a str) too")
    if tag_scalar_dict is not None:
        if second is not None:
            raise TypeError("add_scalars() got tag_scalar_dict= and a second positional argument")
        second = tag_scalar_dict
    return mapping, second


# --------------------------------------------------------------------------------------------
# steps in flight


class _StepBatch:
    """A closed step as it leaves the training thread: values still floats or tensors."""

    __slots__ = ("contexts", "cuda_event", "has_tensors", "seq", "step", "time", "values")

    def __init__(
        self,
        seq: int,
        step: int,
        time_: float,
        values: dict[str, Any],
        has_tensors: bool,
        contexts: dict[Any, Any] | None = None,
    ) -> None:
        self.seq = seq
        self.step = step
        self.time = time_
        self.values = values
        self.has_tensors = has_tensors
        self.contexts = contexts
        self.cuda_event: tuple[int, Any] | None = None


class _Record:
    """A step on the host, shared (read-only) by every sink worker."""

    __slots__ = ("contexts", "metrics", "seq", "step", "time")

    def __init__(
        self,
        seq: int,
        step: int,
        time_: float,
        metrics: dict[str, float],
        contexts: dict[Any, Any] | None = None,
    ) -> None:
        self.seq = seq
        self.step = step
        self.time = time_
        self.metrics = metrics
        self.contexts = contexts  # worker -> what its sink's capture_context() returned


_side_streams: dict[int, Any] = {}


def _gather_to_host(tensors: list[torch.Tensor], batch: _StepBatch) -> tuple[torch.Tensor, Any]:
    """One tensor on the host holding ``tensors`` (same device, dtype and ndim), and an event.

    CPU: one ``torch.stack``. CUDA: on a side stream that first waits for the event the
    training thread recorded when the step closed (so every kernel that produced the values has
    run, and later kernels of the training stream are not waited for), ``torch.stack`` then one
    non-blocking copy into pinned memory and an event to wait on. The tensors stay referenced by
    ``batch`` until the caller has waited on that event, so their memory cannot be reused
    before the copy has read it. Tensors on a CUDA device other than the one whose stream the
    event was recorded on are read after a ``torch.cuda.synchronize`` of their device (in this
    thread). Other devices: a blocking ``.cpu()`` in this thread.
    """
    device = tensors[0].device
    if device.type == "cpu":
        return torch.stack(tensors).reshape(len(tensors)), None
    if device.type != "cuda":
        return torch.stack(tensors).reshape(len(tensors)).cpu(), None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(device=index)
    with torch.cuda.device(index), torch.cuda.stream(stream):
        if batch.cuda_event is not None and batch.cuda_event[0] == index:
            stream.wait_event(batch.cuda_event[1])
        else:
            torch.cuda.synchronize(index)
        flat = torch.stack(tensors).reshape(len(tensors))
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return host, done


def _materialize(batch: _StepBatch, warned: set[str]) -> dict[str, float]:
    """The step's values as ``{key: float}``, in the order the keys were first logged."""
    values = batch.values
    if not batch.has_tensors:
        return values
    groups: dict[tuple[Any, ...], list[str]] = {}
    for k, v in values.items():
        if type(v) is not float:
            groups.setdefault((v.device, v.dtype, v.dim()), []).append(k)
    out: dict[str, Any] = dict(values)
    copies = []
    with torch.no_grad():
        for keys in groups.values():
            try:
                copies.append((keys, *_gather_to_host([values[k] for k in keys], batch)))
            except Exception as e:  # unusual dtype or device: fall back to one read per value
                log.debug("batched host transfer failed (%r); reading values one by one", e)
                copies.append((keys, None, None))
        for keys, host, event in copies:
            if host is not None:
                try:
                    if event is not None:
                        event.synchronize()
                    out.update(zip(keys, host.to(torch.float64).tolist(), strict=True))
                    continue
                except Exception:
                    pass
            for k in keys:
                try:
                    out[k] = float(values[k])
                except Exception as e:
                    del out[k]
                    if k not in warned:
                        warned.add(k)
                        _warn(f"trainvitals FanoutWriter: could not read the value of {k!r}: {e!r}")
    return out


# --------------------------------------------------------------------------------------------
# one worker per sink

#: ``errno`` values of an ``OSError`` that retrying a sink cannot fix: the path it writes to
#: cannot be made or opened (a regular file where its folder should be, a folder where its
#: file should be, no permission, a read-only file system). Space, quota, I/O and network
#: errors (``ENOSPC``, ``EDQUOT``, ``EIO``, ``ECONNREFUSED``, ...) are retried.
_PERMANENT_ERRNOS = frozenset({errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS})


def _retry_cannot_fix(error: BaseException) -> bool:
    """Whether a sink's failure is one that retrying cannot fix (see ``_PERMANENT_ERRNOS``):
    the error itself, or the first ``OSError`` it was raised from or while handling. Backends
    wrap it: MLflow's file store raises an ``MlflowException`` while handling the
    ``PermissionError`` of a read-only run folder (it was retried as transient, about two
    minutes of retries before the sink was disabled)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e.errno in _PERMANENT_ERRNOS
        seen.add(id(e))
        e = e.__cause__ if e.__cause__ is not None or e.__suppress_context__ else e.__context__
    return False


class _SinkWorker:
    """Delivers one sink's steps in order; all state is guarded by the writer's condition."""

    def __init__(self, writer: FanoutWriter, sink: Sink, name: str, threaded: bool) -> None:
        self.writer = writer
        self.sink = sink
        self.name = name
        self.threaded = threaded
        # the sink reads something of its backend when a step's first value is logged
        self.captures = type(sink).capture_context is not Sink.capture_context
        self.cond = writer._cond
        self.pending: deque[_Record] = deque()
        self.inflight: _Record | None = None
        self.busy_since: float | None = None
        # a write ran past sink_timeout and none has returned in time since: flush() and
        # close() do not wait for this sink (a dead backend answering every call after its
        # own timeout, such as W&B's 30 s, would otherwise hold each of them that long)
        self.slow = False
        self.opened = False
        self.delivered = 0
        self.missed = 0
        self.missed_why: dict[str, int] = {}  # reason -> steps
        self.failures = 0  # consecutive
        self.total_failures = 0
        self.last_error: str | None = None
        self.next_attempt = 0.0
        self.disabled = False
        self.unusable = False  # disabled at its first error, one retrying cannot fix
        self.closing = False
        self.abandoned = False
        self.finished = False
        self.finishing = False  # finish() has started (on some thread): never call it twice
        self.resume_settled = False  # flush() had the sink act on resume_at without a write
        self.close_error: str | None = None  # a disabled sink's close() failed (see finish)
        self.reported: set[str] = set()  # which one-time warnings were given
        self.thread: threading.Thread | None = None

    # -- state queries (under cond)

    def idle_through(self, seq: int) -> bool:
        return (self.inflight is None or self.inflight.seq > seq) and (
            not self.pending or self.pending[0].seq > seq
        )

    def hung(self, now: float) -> bool:
        return self.busy_since is not None and now - self.busy_since > self.writer.sink_timeout

    def settled(self, seq: int, now: float) -> bool:
        """Nothing more to wait for, for a flush up to ``seq``."""
        return (
            self.disabled
            or self.failures > 0
            or self.slow
            or self.hung(now)
            or self.idle_through(seq)
        )

    def _miss(self, why: str, n: int = 1) -> None:
        self.missed += n
        n += self.missed_why.get(why, 0)
        if n:
            self.missed_why[why] = n
        else:
            self.missed_why.pop(why, None)

    def _report_once(self, what: str, message: str) -> None:
        if what not in self.reported:
            self.reported.add(what)
            _warn(message)

    # -- from the dispatcher (under cond)

    def offer(self, record: _Record) -> None:
        if self.disabled or self.abandoned:
            self._miss("disabled" if self.disabled else "abandoned")
            return
        if len(self.pending) >= self.writer.buffer_steps:
            self.pending.popleft()
            self._miss("buffer full")
            self._report_once(
                "overflow",
                f"trainvitals FanoutWriter: sink {self.name!r} is behind; its buffer of "
                f"{self.writer.buffer_steps} steps is full, dropping its oldest steps",
            )
        self.pending.append(record)
        self.cond.notify_all()

    def check_hang(self, now: float) -> None:
        if self.hung(now):
            assert self.busy_since is not None
            self.slow = True
            self._report_once(
                "hang",
                f"trainvitals FanoutWriter: sink {self.name!r} has not returned from writing "
                f"step {self.inflight.step if self.inflight else '?'} for "
                f"{now - self.busy_since:.0f} s; treating it as hung (the other sinks go on, "
                "flush() and close() no longer wait for it, until a write returns in time)",
            )

    # -- delivery

    def attempt(self, below: int | None = None) -> bool:
        """Deliver the oldest pending step once (only if its step is lower than ``below``, when
        given); False when there was nothing to try now."""
        with self.cond:
            if (
                self.disabled
                or self.abandoned
                or not self.pending
                or time.monotonic() < self.next_attempt
                or (below is not None and self.pending[0].step >= below)
            ):
                return False
            record = self.pending.popleft()
            self.inflight = record
            self.busy_since = started = time.monotonic()
            # a flush() or close() waiting without a deadline for this worker must learn when
            # its write began: it counts as hung sink_timeout later (flush waited its whole
            # flush_timeout instead)
            self.cond.notify_all()
        error: BaseException | None = None
        refused = False
        # a sink calling a tracker whose log a TrackerSink wrapped must not re-enter the
        # writer (_deliver_before) from inside a delivery
        calls = self.writer._delivering
        calls.depth = getattr(calls, "depth", 0) + 1
        try:
            if not self.opened:
                self.sink.open()
                self.opened = True
                _register_exit_hook()  # after any exit hook the backend registered in open()
            if self.captures:
                contexts = record.contexts
                self.sink.step_context = None if contexts is None else contexts.get(self)
            self.sink.write(record.step, record.metrics, record.time)
        except StepRefused as e:
            refused, error = True, e
        except Exception as e:
            error = e
        finally:
            calls.depth -= 1
        with self.cond:
            now = time.monotonic()
            self.check_hang(now)  # (a write that ran past sink_timeout between two checks)
            self.slow = now - started > self.writer.sink_timeout
            self.inflight = None
            self.busy_since = None
            if self.abandoned:
                # close() gave up on this write (hung) and counted the step as missed; it
                # returned after all: count it once, as what the sink got
                if error is None:
                    self.delivered += 1
                    self._miss("unfinished at close", -1)
                self.cond.notify_all()
                return True
            if error is None:
                self.delivered += 1
                if self.failures:
                    log.info(
                        "trainvitals FanoutWriter: sink %r recovered after %d failures",
                        self.name,
                        self.failures,
                    )
                self.failures = 0
            elif refused:
                self._miss("refused by the backend")
                self._report_once(
                    "refused",
                    f"trainvitals FanoutWriter: sink {self.name!r} refused step "
                    f"{record.step}: {error}; such steps are counted as missed",
                )
            elif _retry_cannot_fix(error):
                self._unusable(record, error)
            else:
                self._failed(record, error)
            self.cond.notify_all()
        return True

    def _unusable(self, record: _Record, error: BaseException) -> None:
        """Disable the sink at once: ``error`` says it cannot work in this run (a run folder
        that cannot be written), so retrying it until ``max_failures`` only held ``close()``
        for its whole ``close_timeout``."""
        self.failures += 1
        self.total_failures += 1
        self.last_error = f"{type(error).__name__}: {error}"
        lost = 1 + len(self.pending)
        self.pending.clear()
        self._miss("disabled", lost)
        self.disabled = True
        self.unusable = True
        _warn(
            f"trainvitals FanoutWriter: sink {self.name!r} cannot work: {self.last_error} "
            f"(failed on step {record.step}; retrying cannot fix this error). Disabled at once: "
            "it gets no further steps; the other sinks go on"
        )

    def _failed(self, record: _Record, error: BaseException) -> None:
        w = self.writer
        self.failures += 1
        self.total_failures += 1
        self.last_error = f"{type(error).__name__}: {error}"
        self._report_once(
            "error",
            f"trainvitals FanoutWriter: sink {self.name!r} failed on step {record.step}: "
            f"{self.last_error}. Retrying with backoff, keeping up to {w.buffer_steps} pending "
            f"steps; disabled after {w.max_failures} consecutive failures",
        )
        if self.failures >= w.max_failures:
            lost = 1 + len(self.pending)
            self.pending.clear()
            self._miss("disabled", lost)
            self.disabled = True
            _warn(
                f"trainvitals FanoutWriter: sink {self.name!r} disabled after {self.failures} "
                f"consecutive failures (last error: {self.last_error}); it missed "
                f"{self.missed} steps so far and will get no further steps"
            )
            return
        if len(self.pending) >= w.buffer_steps:
            self._miss("buffer full")  # the buffer filled up meanwhile: the oldest step goes
        else:
            self.pending.appendleft(record)
        first, cap = w.retry_backoff
        self.next_attempt = time.monotonic() + min(cap, first * 2 ** (self.failures - 1))

    def pump(self, below: int | None = None) -> None:
        """Deliver what can be delivered now (the calling thread does the work); with ``below``,
        only the steps lower than it."""
        while self.attempt(below):
            pass

    def settle_resume(self) -> None:
        """Have a sink that wrote nothing since ``resume_at`` act on it now (the caller makes
        sure no other thread calls the sink meanwhile). A write acts on it itself."""
        with self.cond:
            if (
                self.opened
                or self.resume_settled
                or self.disabled
                or self.abandoned
                or self.pending
                or self.inflight is not None
            ):
                return
            self.resume_settled = True
        try:
            self.sink.settle_resume()
        except Exception as e:  # a later write (or close) tries again
            self._report_once(
                "settle",
                f"trainvitals FanoutWriter: sink {self.name!r} could not act on resume_at: {e!r}",
            )

    def run(self) -> None:
        """The worker thread: deliver, wait (for steps or the end of a backoff), finish."""
        while True:
            with self.cond:
                while True:
                    if self.abandoned:
                        return
                    if self.disabled or not self.pending:
                        if self.closing:
                            break
                        self.cond.wait()
                        continue
                    delay = self.next_attempt - time.monotonic()
                    if delay > 0:
                        self.cond.wait(delay)
                        continue
                    break
                done = self.closing and (self.disabled or not self.pending)
            if done:
                self.finish()
                return
            self.attempt()

    def finish(self) -> None:
        """Close the sink (it flushes; it closes what it owns) and mark the worker finished."""
        with self.cond:
            if self.finishing:
                return
            self.finishing = True
        try:
            self.sink.close()
        except Exception as e:
            with self.cond:
                disabled = self.disabled
            if disabled:
                # Its failure was reported when it was disabled, and close() names it again
                # in its summary of the missed steps, with this error: a backend that could
                # not take the steps usually cannot end its run either (a read-only MLflow
                # store refuses set_terminated too), and a third warning says nothing new.
                text = " ".join(str(e).split())  # (MLflow's errors carry SQL on several lines)
                if len(text) > 500:
                    text = text[:499] + "…"
                self.close_error = f"{type(e).__name__}: {text}"
                log.info(
                    "trainvitals FanoutWriter: closing disabled sink %r failed: %r", self.name, e
                )
            else:
                self._report_once(
                    "close", f"trainvitals FanoutWriter: closing sink {self.name!r} failed: {e!r}"
                )
        with self.cond:
            self.finished = True
            self.cond.notify_all()


# --------------------------------------------------------------------------------------------
# the writer


def _order_hook(writer_ref: weakref.ref[FanoutWriter], worker_ref: weakref.ref[_SinkWorker]) -> Any:
    """``deliver_before(step)`` for a sink's ``install_order_hook``: the backend is about to be
    given ``step`` by other code; deliver this writer's lower steps to it first. Holds the
    writer weakly (a tracker outliving the writer keeps nothing alive)."""

    def deliver_before(step: int | None) -> None:
        writer, worker = writer_ref(), worker_ref()
        if writer is not None and worker is not None:
            writer._deliver_before(worker, step)

    return deliver_before


def _flushing_first(writer_ref: weakref.ref[FanoutWriter], original: Any) -> Any:
    """``original`` (a tracker's ``finish``), delivering the writer's steps before it runs:
    a W&B run or Comet experiment the tracker finishes refuses what arrives afterwards. Holds
    the writer weakly."""

    @functools.wraps(original)
    def finish_after_flush(*args: Any, **kwargs: Any) -> Any:
        writer = writer_ref()
        if writer is not None:
            try:
                writer.flush()
            except Exception as e:  # the tracker must finish whatever happens
                _warn(f"trainvitals FanoutWriter: flush before the tracker's finish failed: {e!r}")
        return original(*args, **kwargs)

    return finish_after_flush


_live_writers: weakref.WeakSet[FanoutWriter] = weakref.WeakSet()

#: seconds close() gives an abandoned (still failing) sink to close its own run
_ABANDONED_CLOSE_TIMEOUT = 5.0


@atexit.register
def _close_live_writers() -> None:
    """Deliver what is still queued when the interpreter exits without ``close()``; the runs
    the sinks created end as failed when the script is dying (see :class:`_ProcessEnd`)."""
    failed, interrupted = _ProcessEnd.outcome()
    for writer in list(_live_writers):
        writer.close(failed=failed, interrupted=interrupted)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, ``os.fork()``) has copies of the parent's writers,
    whose values only the parent delivers: make each copy drop what the child logs, with a
    warning (it was silent), and give it fresh locks (another thread of the parent may have
    held one at the fork, which would block the child's first ``add_scalar`` for ever)."""
    for writer in list(_live_writers):
        writer._lock = threading.Lock()
        writer._close_done = threading.Event()
        writer._values = {}
        writer._has_tensors = False
        writer._active = False
        writer._resolved = True  # (a writer whose rank was not known yet stays inactive)
        writer._fork_warned = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_live_writers_first() -> None:
    """The same, before the backends' own exit hooks run (see :func:`_register_exit_hook`)."""
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return  # a thread may still be logging: leave it to the atexit hook, after the joins
    _close_live_writers()


# how many threading exit hooks there were right after ours was last registered
_exit_hook_position = [0]


def _register_exit_hook() -> None:
    """Have the live writers closed at exit before the exit hooks of the backends registered
    so far. Those end their runs: W&B's ``atexit`` hook tears its service down (a later
    ``run.log`` raises), Comet's ``threading._register_atexit`` hook ends the experiment (later
    metrics are dropped). ``threading._register_atexit`` hooks run before every ``atexit`` hook,
    the last registered first, so the writer registers one there, again whenever one of its
    sinks has opened its backend.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython has it since 3.9
        return
    registered = getattr(threading, "_threading_atexits", None)  # (entries wrap the hooks)
    if registered is not None and len(registered) == _exit_hook_position[0] > 0:
        return  # ours is still the last registered (the first to run): nothing since
    with contextlib.suppress(RuntimeError):  # raised once the interpreter is shutting down
        register(_close_live_writers_first)
        if registered is not None:
            _exit_hook_position[0] = len(registered)


def _exit_status(code: object) -> int:
    """The process exit status ``SystemExit(code)`` gives: ``None`` 0, an int itself, anything
    else 1 (CPython's ``_Py_HandleSystemExit``)."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _run_outcome(exception: BaseException | None) -> tuple[bool, bool]:
    """``(failed, interrupted)`` for a run that ``exception`` ended (``None``: none did).

    ``SystemExit`` with status 0 (``sys.exit()``, ``sys.exit(0)``, ``sys.exit(None)``) is a
    success, any other status a failure. ``KeyboardInterrupt`` (Ctrl-C, SIGINT) is an
    interruption by the user: MLflow's ``KILLED`` ("run killed by user", ``RunStatus``), W&B's
    exit code 255 (what W&B's own hook gives a run ended by Ctrl-C:
    ``wandb/sdk/lib/exit_hooks.py``, ``ExitHooks.exc_handler``).
    """
    if exception is None:
        return False, False
    if isinstance(exception, SystemExit):
        return _exit_status(exception.code) != 0, False
    return True, isinstance(exception, KeyboardInterrupt)


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    try:
        return get_ipython is not None and get_ipython() is not None
    except Exception:
        return False


def _last_uncaught() -> BaseException | None:
    """The exception the interpreter last reported as uncaught (``sys.last_value``)."""
    # sys.last_exc is new in 3.12; sys.last_value is still set there too
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return exc if isinstance(exc, BaseException) else None


class _ProcessEnd:
    """How the interpreter is ending, for the writers still open at exit.

    The exit hooks run after the main thread's code has ended and cannot be told how it ended;
    the interpreter leaves two traces that :meth:`outcome` reads:

    * An exception that ended the main thread's code: before the interpreter reports it (calls
      ``sys.excepthook``, whichever hook is installed: ``rich.traceback.install`` replaces it
      without chaining) it stores it in ``sys.last_value`` (``PyErr_Print``). ``sys.excepthook``
      called by user code (which then goes on), ``threading.excepthook`` (other threads, whose
      exceptions do not end the process) and ``sys.unraisablehook`` store nothing. Not read in
      an interactive session (``python -i``, the REPL, IPython/Jupyter), whose shells store
      there every error typed at their prompt and go on. Nor once the main thread logs a later
      step or calls ``sys.exit``: that exception did not end it (a C extension printing a
      callback's error with ``PyErr_Print``).
    * ``sys.exit(status)``: a ``SystemExit`` is never reported nor stored, so :meth:`watch`
      (called when the first writer of rank 0 is made) chains ``sys.exit``, as W&B does for
      its runs (``wandb/sdk/lib/exit_hooks.py``); Hydra turns the exception of a
      ``@hydra.main`` task into ``sys.exit(1)`` (``hydra/_internal/utils.py:
      run_and_report``), argparse and click exit through it. ``sys.exit(status)`` in the main
      thread records the status it exits with; non-zero ends the runs as failed, ``0`` (or
      ``None``) as finished. Not recorded in IPython (which catches ``SystemExit`` in a cell
      and keeps the kernel running), nor once the main thread logs a later step (the
      ``SystemExit`` was caught).

    Not seen, and so ending the runs as finished: a ``SystemExit`` raised directly
    (``raise SystemExit(3)``, the ``exit(3)`` builtin, an ``exit`` imported from ``sys`` before
    the first writer was made): the interpreter takes its status and exits without storing it
    anywhere Python code can read; only tracing every frame (``sys.settrace``,
    ``sys.monitoring``'s ``PY_UNWIND``) would see it, at a cost on every step. A process ended
    by a signal or ``os._exit`` runs no exit hook at all.
    """

    watched = False
    exit_status: int | None = None  # from the last sys.exit() in the main thread
    survived: BaseException | None = None  # sys.last_value when the main thread last logged

    @classmethod
    def outcome(cls) -> tuple[bool, bool]:
        """``(failed, interrupted)`` of the main thread's end, as :func:`_run_outcome`."""
        try:
            if sys.flags.interactive or sys.flags.inspect or hasattr(sys, "ps1") or _in_ipython():
                return False, False
            uncaught = _last_uncaught()
            if uncaught is not None and uncaught is not cls.survived:
                return _run_outcome(uncaught)
        except Exception:  # pragma: no cover - never disturb the exit
            pass
        return bool(cls.exit_status), False

    @classmethod
    def main_thread_goes_on(cls) -> None:
        """The main thread logs a step: what it exited with or reported before ended nothing."""
        cls.exit_status = None
        cls.survived = _last_uncaught()

    @classmethod
    def watch(cls) -> None:
        if cls.watched:
            return
        cls.watched = True
        previous_exit = sys.exit

        @functools.wraps(previous_exit)
        def exit(*args: Any) -> Any:  # stands in for sys.exit
            if len(args) <= 1:  # (more: the original raises TypeError)
                cls._note_exit(args[0] if args else None)
            return previous_exit(*args)

        sys.exit = exit

    @classmethod
    def _note_exit(cls, code: object) -> None:
        try:
            if threading.current_thread() is threading.main_thread() and not _in_ipython():
                cls.exit_status = _exit_status(code)
                cls.survived = _last_uncaught()  # reported before: it did not end the thread
        except Exception:  # pragma: no cover - never disturb the exit
            pass


class FanoutWriter:
    """A ``SummaryWriter``-shaped writer that sends every scalar to several backends at once.

    Args:
        sinks: the sinks to deliver to (:class:`~trainvitals.adapters.TensorBoardSink`,
            :class:`~trainvitals.adapters.MLflowSink`, :class:`~trainvitals.adapters.CometSink`,
            :class:`~trainvitals.adapters.WandbSink`, :class:`~trainvitals.adapters.JsonlSink`
            or any :class:`~trainvitals.adapters.Sink`).
        rank: this process's global rank; ``None`` asks
            :func:`trainvitals.distributed.launch_rank` when the writer first needs it (its
            first value; a ``flush()`` or ``close()`` after ``resume_at``), not when it is
            built: the process group's rank when it exists by then, else ``RANK``, Lightning's
            ``LOCAL_RANK``/``NODE_RANK`` (``WORLD_SIZE`` above 1), 0 (so a writer built before
            ``trainer.fit()`` or ``init_process_group`` gets the right rank). Only rank 0
            delivers; on every other rank the writer checks its input (so every rank raises
            on the same bad call) and drops it, and never opens a sink.
        background: deliver from background threads (default). ``False`` delivers in the
            calling thread at each step boundary (for debugging; a hanging sink then hangs
            the caller).
        queue_size: closed steps waiting for their host transfer; the training thread waits
            when it is full (it only fills if the dispatcher is stuck).
        buffer_steps: per sink, the most pending steps kept while it is failing or slow; when
            full its oldest step is dropped and counted as missed. Memory: about
            ``buffer_steps * keys per step * 100`` bytes, shared by all sinks.
        max_failures: consecutive failures after which a sink is disabled.
        retry_backoff: ``(first, largest)`` delay in seconds between retries of a failing
            sink; the delay doubles per consecutive failure.
        sink_timeout: seconds after which a ``write`` that has not returned counts as hung;
            ``flush()`` and ``close()`` do not wait for that sink again until one of its
            writes returns within this time.
        flush_timeout: the longest ``flush()`` waits (seconds; ``None``: no limit other than
            the per-sink ``sink_timeout``).
        close_timeout: the longest ``close()`` waits for the sinks to drain (seconds).

    Steps: values are grouped per step. A call with a larger step closes the current step and
    queues it; ``flush()`` and ``close()`` close it too. A step lower than the last step given
    to the writer raises ``ValueError``; the same step again after a ``flush()`` is delivered as
    a second batch of that step. After ``close()`` values are dropped with one warning,
    whatever their step; ``end_step()``, ``flush()`` and ``resume_at()`` call no sink. Keys
    must be non-empty strings with a UTF-8 form (no lone surrogate), values real numbers, bools, numpy scalars or one-element tensors
    (see the module docstring for the tensor contract).

    Resuming: a run restored from a checkpoint of step N calls ``resume_at(N)`` before it logs
    anything. The sinks that keep files then drop what an earlier run of the same files wrote
    for steps ``>= N`` (:class:`~trainvitals.adapters.JsonlSink` cuts its file; a
    :class:`~trainvitals.adapters.TensorBoardSink` with its own log directory opens its
    ``SummaryWriter`` with ``purge_step=N``), and an ``MLflowSink(run_dir=...)`` continues the
    MLflow run it recorded there; ``resume_at(0)`` says the run is a new one. Without the call a
    ``JsonlSink`` or ``MLflowSink`` guesses the resume step from the first step it writes.

    Example::

        writer = FanoutWriter([TensorBoardSink("runs/a/tb"), JsonlSink("runs/a/metrics.jsonl")])
        for step in range(100):
            loss = train_step()
            writer.add_scalar("train/loss", loss.detach(), step)   # a tensor: no sync
            writer.add_scalars({"lr": sched.get_last_lr()[0], "tokens": n}, step)
        writer.close()
    """

    def __init__(
        self,
        sinks: Iterable[Sink] = (),
        *,
        rank: int | None = None,
        background: bool = True,
        queue_size: int = 64,
        buffer_steps: int = 1000,
        max_failures: int = 10,
        retry_backoff: tuple[float, float] = (0.5, 30.0),
        sink_timeout: float = 30.0,
        flush_timeout: float | None = 120.0,
        close_timeout: float = 60.0,
    ) -> None:
        sinks = list(sinks)
        for s in sinks:
            if not isinstance(s, Sink):
                raise TypeError(f"sinks must be Sink instances, got {type(s).__name__}")
        if queue_size < 1 or buffer_steps < 1 or max_failures < 1:
            raise ValueError("queue_size, buffer_steps and max_failures must be >= 1")
        if sink_timeout <= 0 or close_timeout < 0:
            raise ValueError("sink_timeout must be > 0 and close_timeout >= 0")
        if len(retry_backoff) != 2 or not 0 <= retry_backoff[0] <= retry_backoff[1]:
            raise ValueError("retry_backoff must be (first, largest) with 0 <= first <= largest")
        # None: worked out when the writer first needs it (see _resolve_rank)
        self._rank: int | None = None if rank is None else int(rank)
        self._resolved = False
        self.sinks = sinks
        self.background = background
        self.buffer_steps = buffer_steps
        self.max_failures = max_failures
        self.retry_backoff = (float(retry_backoff[0]), float(retry_backoff[1]))
        self.sink_timeout = float(sink_timeout)
        self.flush_timeout = flush_timeout
        self.close_timeout = float(close_timeout)
        self._active = False  # this process delivers: rank 0, once known (_activate)

        # training-thread state
        self._lock = threading.Lock()
        self._step: int | None = None
        self._step_time = 0.0
        self._step_contexts: dict[Any, Any] | None = None  # capture_context() of the step
        self._values: dict[str, Any] = {}
        self._has_tensors = False
        self._closed = False
        self._closed_warned = False
        self._fork_warned = False
        self._closing_thread: int | None = None  # the thread of the first close()
        self._close_done = threading.Event()  # that close() has returned
        self._resume_step: int | None = None
        self._resume_acted = False  # a flush() had the sinks act on _resume_step
        self._seq = 0
        self._pid = os.getpid()

        # delivery state, guarded by _cond
        self._cond = threading.Condition()
        self._dispatched = 0
        # SimpleQueue: put() takes no Python-level lock, so the training thread never blocks
        # (and never gives up the GIL) handing a step over; the bound is kept by _enqueue.
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.queue_size = queue_size
        self._dispatcher: threading.Thread | None = None
        self._unreadable: set[str] = set()
        self._workers: list[_SinkWorker] = []
        self._capturing: list[_SinkWorker] = []  # workers whose sink has capture_context
        # (seq, step) of the steps queued but perhaps not yet on the host, kept only while a
        # sink asked to be handed its steps before its backend's own later logs
        # (_deliver_before); the training thread's, under _lock
        self._queued_steps: deque[tuple[int, int]] | None = None
        self._delivering = threading.local()
        self._patches: list[AttributePatch] = []  # (flush_before_finish), undone at close()
        if self._rank is not None:
            self._resolved = True
            if self._rank == 0:
                self._activate()
        else:
            # (its lock is replaced in a forked child, which never delivers for it)
            _live_writers.add(self)

    @property
    def rank(self) -> int | None:
        """This process's global rank: the ``rank=`` given, or, with ``rank=None``, the one
        :func:`trainvitals.distributed.launch_rank` gave when the writer first needed it (its
        first value, or a ``flush()``/``close()`` after ``resume_at``). Until then what that
        function says now; ``None`` while the environment only says the rank is not 0."""
        return self._rank if self._rank is not None else distributed.launch_rank()

    def _resolve_rank(self) -> bool:
        """Whether this process delivers (lock held). With ``rank=None`` the rank is worked
        out at the first call that needs it, not in ``__init__``: a writer built before the
        process group exists (before Lightning's ``fit()``, whose launcher sets no ``RANK``)
        took rank 0 on every process, and each one delivered (two runs in MLflow, two writers
        of one JSONL file). Fixed once known; while the environment says only "not rank 0"
        (``launch_rank()`` is ``None``) nothing is delivered and it is asked again later."""
        if self._resolved:
            return self._active
        if self._pid != os.getpid():  # a forked child's copy never delivers
            self._resolved = True
            return False
        rank = distributed.launch_rank()
        if rank is None:
            return False
        self._rank = rank
        self._resolved = True
        if rank == 0:
            self._activate()
            if self._resume_step is not None:
                self._resume_sinks(self._resume_step)
        return self._active

    def _activate(self) -> None:
        """Rank 0: one worker per sink; the exit hooks."""
        self._active = True
        names: set[str] = set()
        for s in self.sinks:
            name = s.name
            i = 2
            while name in names:
                name, i = f"{s.name}#{i}", i + 1
            names.add(name)
            threaded = self.background and s.thread_safe
            worker = _SinkWorker(self, s, name, threaded)
            self._workers.append(worker)
            install = getattr(s, "install_order_hook", None)
            if not threaded and callable(install):
                # TrackerSink, LightningLoggerSink: the loop logs to the same object
                # (accelerator.log(step=), Lightning's log_metrics(step=)); it wraps that
                # call to have our lower steps delivered first (see _deliver_before)
                self._queued_steps = deque()
                install(_order_hook(weakref.ref(self), weakref.ref(worker)))
        self._capturing = [w for w in self._workers if w.captures]
        _live_writers.add(self)
        _register_exit_hook()
        _ProcessEnd.watch()

    def _resume_sinks(self, step: int) -> None:
        for s in self.sinks:
            try:
                s.resume_at(step)
            except Exception as e:  # a sink's bookkeeping must not stop the run
                _warn(f"trainvitals FanoutWriter: sink {s.name!r}: resume_at failed: {e!r}")

    def __repr__(self) -> str:
        names = [w.name for w in self._workers] or [s.name for s in self.sinks]
        return f"FanoutWriter(sinks={names}, rank={self.rank})"

    # ---- constructors from frameworks

    @classmethod
    def from_lightning(
        cls, trainer: Any, *, default_jsonl: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> FanoutWriter:
        """A writer delivering to the loggers of a Lightning ``Trainer``.

        Works for ``lightning.pytorch`` and ``pytorch_lightning`` trainers. Each logger in
        ``trainer.loggers`` becomes a sink writing into the run that logger already set up:
        ``TensorBoardLogger`` -> its ``SummaryWriter``; ``MLFlowLogger`` -> its
        ``MlflowClient`` and ``run_id`` (``log_batch``); ``CometLogger`` -> its experiment;
        ``WandbLogger`` -> its run, with ``trainer/global_step`` as the step metric like the
        logger itself; ``CSVLogger`` and any other logger -> its ``log_metrics`` once per step,
        called from the training thread. The writer's rank is ``trainer.global_rank``: on other
        ranks Lightning's loggers are dummies, and the writer drops everything.

        With no logger (``Trainer(logger=False)``) the writer writes JSONL to ``default_jsonl``;
        without that path it raises ``ValueError``. ``kwargs`` go to :class:`FanoutWriter`.
        """
        from trainvitals.adapters.from_frameworks import lightning_sinks

        rank = int(getattr(trainer, "global_rank", 0))
        sinks = lightning_sinks(trainer, default_jsonl=default_jsonl, build=rank == 0)
        return cls(sinks, rank=rank, **kwargs)

    @classmethod
    def from_accelerator(
        cls,
        accelerator: Any,
        *,
        default_jsonl: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> FanoutWriter:
        """A writer delivering to the trackers of an ``accelerate.Accelerator``.

        Call it after ``accelerator.init_trackers(...)``. Trackers: ``tensorboard`` -> its
        ``SummaryWriter``; ``mlflow`` -> an ``MlflowClient`` on the current tracking URI and the
        tracker's active run (``log_batch``); ``comet_ml`` -> its experiment; ``wandb`` -> its
        run (``run.log(dict, step=)``, as Accelerate itself does); any other tracker -> its
        ``log(dict, step=)`` with Python floats (Accelerate's own trackers drop tensor values
        silently; this writer converts them first), called from the training thread. Only the
        main process delivers. Each tracker's ``finish`` (``accelerator.end_training()``)
        first delivers the writer's steps (:meth:`flush_before_finish`), so ending the
        training before :meth:`close` loses no step.

        With no tracker the writer writes JSONL to ``default_jsonl``; without that path it
        raises ``ValueError``. ``kwargs`` go to :class:`FanoutWriter`.
        """
        from trainvitals.adapters.from_frameworks import accelerator_sinks

        rank = int(getattr(accelerator, "process_index", 0))
        sinks = accelerator_sinks(accelerator, default_jsonl=default_jsonl, build=rank == 0)
        writer = cls(sinks, rank=rank, **kwargs)
        for tracker in getattr(accelerator, "trackers", None) or ():
            writer.flush_before_finish(tracker)
        return writer

    def flush_before_finish(self, obj: Any, method: str = "finish") -> None:
        """Have ``obj.<method>()`` (an Accelerate tracker's ``finish``, which
        ``accelerator.end_training()`` calls) deliver this writer's steps before it runs.

        :meth:`from_accelerator` does it for every tracker: ``end_training()`` before the
        writer's :meth:`close` finished the W&B run and ended the Comet experiment while the
        last steps were still on their way, and both refuse what comes after (the W&B sink
        missed the last step, the Comet sink the last two). Wraps the method with an instance
        attribute, taken back at :meth:`close`; on a rank that does not deliver, and for an
        object that takes no attributes, it does nothing.
        """
        with self._lock:
            active = self._resolve_rank()
        if not active or self._closed or not callable(getattr(obj, method, None)):
            return
        original = getattr(obj, method)
        with contextlib.suppress(AttributeError, TypeError):  # (no instance attributes)
            self._patches.append(
                AttributePatch(obj, method, _flushing_first(weakref.ref(self), original))
            )

    # ---- logging (training thread)

    def add_scalar(
        self,
        name: str | None = None,
        value: Any = _UNSET,
        step: int | None = None,
        walltime: float | None = None,
        new_style: bool = False,
        double_precision: bool = False,
        *,
        global_step: int | None = None,
        tag: str | None = None,
        scalar_value: Any = _UNSET,
    ) -> None:
        """Log one scalar for ``step``.

        ``value``: a real number, bool, numpy scalar, or a tensor with one element on any
        device (kept by reference: do not modify it in place afterwards). ``walltime`` (Unix
        seconds) sets the step's time when it is the step's first value.

        Takes the arguments of ``torch.utils.tensorboard.SummaryWriter.add_scalar`` in its
        order, ``(tag, scalar_value, global_step, walltime, new_style, double_precision)``, and
        under its names: ``tag=``, ``scalar_value=`` and ``global_step=`` are the same as
        ``name=``, ``value=`` and ``step=`` (giving both names of one argument raises
        ``TypeError``). ``new_style`` and ``double_precision`` are accepted and ignored: the
        sinks decide how values are stored (``TensorBoardSink(..., double_precision=True)``).

        Raises ``TypeError``/``ValueError`` (naming the key) for a missing, non-string or empty
        key, a key holding a lone surrogate (no UTF-8 form), a missing or non-numeric value, a
        tensor with more than one element, a missing, negative or decreasing step, a
        ``walltime`` that is not a finite number of seconds ``>= 0``. After :meth:`close` the value is dropped with one warning (for the writer's
        lifetime), whatever its step: a lower step than the last one no longer raises.

        Example::

            writer.add_scalar("train/loss", loss.detach(), step=global_step)
            writer.add_scalar(tag="train/loss", scalar_value=2.3, global_step=7)
        """
        if tag is not None or scalar_value is not _UNSET or value is _UNSET:
            name, value = _scalar_args(name, value, tag, scalar_value)
        if type(name) is not str or not name or name.isspace() or not name.isascii():
            _bad_key(name)
        tv = type(value)
        if tv is not float and (
            tv is not _Tensor or value.numel() != 1 or value.is_complex() or value.is_meta
        ):
            value = _as_value(name, value)  # converts, or raises naming the key
        if step is None:
            step = global_step
            if step is None:
                raise TypeError(f"add_scalar({name!r}, ...) needs a step")
        elif global_step is not None:
            raise TypeError(
                f"add_scalar({name!r}, ...) got both step= (or the third positional argument) "
                "and global_step= (the same argument)"
            )
        if type(step) is not int or step < 0:
            step = _as_step(step)
        if walltime is not None:
            walltime = _as_walltime(walltime)
        with self._lock:
            if step != self._step:
                self._advance(step, name)
            if self._closed:
                self._warn_closed()
            elif self._active or (not self._resolved and self._resolve_rank()):
                values = self._values
                if not values:
                    self._step_time = time.time() if walltime is None else walltime
                    if self._capturing:
                        self._capture_contexts()
                values[name] = value
                if type(value) is not float:
                    self._has_tensors = True
            elif self._pid != os.getpid():  # a forked child's copy (_after_fork_in_child)
                self._warn_forked()

    def add_scalars(
        self,
        mapping: Mapping[str, Any] | str | None = None,
        step: Any = None,
        global_step: int | None = None,
        walltime: float | None = None,
        *,
        main_tag: str | None = None,
        tag_scalar_dict: Mapping[str, Any] | None = None,
    ) -> None:
        """Log several scalars for one step: ``add_scalars({"a": 1.0, "b": t}, step)``.

        The whole mapping is checked before any of it is stored: one bad entry raises and
        nothing of the call is logged. ``SummaryWriter.add_scalars``'s form
        ``add_scalars(main_tag, tag_scalar_dict, global_step, walltime)`` is accepted too, in
        that order and under those names (``main_tag=``, ``tag_scalar_dict=``,
        ``global_step=``, ``walltime=``), and logs the keys ``main_tag/tag``. ``global_step=``
        is also the same as ``step=`` in the mapping form (giving both raises ``TypeError``).

        Example::

            writer.add_scalars({"memory/allocated_gb": a, "memory/reserved_gb": r}, step)
            writer.add_scalars("loss", {"train": 2.3, "val": 2.5}, global_step=step)
        """
        if main_tag is not None or tag_scalar_dict is not None:
            mapping, step = _tagged_scalars_args(mapping, step, main_tag, tag_scalar_dict)
        if isinstance(mapping, str):
            main_tag, mapping, step, global_step = mapping, step, global_step, None
            if not isinstance(mapping, Mapping):
                raise TypeError("add_scalars(main_tag, tag_scalar_dict, global_step) needs a dict")
            if not main_tag or main_tag.isspace():
                _bad_key(main_tag)
            mapping = {f"{main_tag}/{k}": v for k, v in mapping.items()}
        elif not isinstance(mapping, Mapping):
            raise TypeError(f"add_scalars needs a mapping of key -> value, got {type(mapping)}")
        if step is None:
            step = global_step
            if step is None:
                raise TypeError("add_scalars(...) needs a step")
        elif global_step is not None:
            raise TypeError(
                "add_scalars(mapping, ...) got both step= (or the second positional argument) "
                "and global_step= (the same argument)"
            )
        if type(step) is not int or step < 0:
            step = _as_step(step)
        if walltime is not None:
            walltime = _as_walltime(walltime)
        checked: dict[str, Any] = {}
        has_tensors = False
        for k, v in mapping.items():
            if type(k) is not str or not k or k.isspace() or not k.isascii():
                _bad_key(k)
            tv = type(v)
            if tv is not float:
                # fast path for plain one-element tensors; anything else is checked (and
                # converted, or refused naming the key) by _as_value
                if tv is not _Tensor or v.numel() != 1 or v.is_complex() or v.is_meta:
                    v = _as_value(k, v)
                if type(v) is not float:
                    has_tensors = True
            checked[k] = v
        if not checked:
            return
        with self._lock:
            if step != self._step:
                self._advance(step, next(iter(checked)))
            if self._closed:
                self._warn_closed()
            elif self._active or (not self._resolved and self._resolve_rank()):
                values = self._values
                if not values:
                    self._step_time = time.time() if walltime is None else walltime
                    if self._capturing:
                        self._capture_contexts()
                values.update(checked)
                if has_tensors:
                    self._has_tensors = True
            elif self._pid != os.getpid():  # a forked child's copy (_after_fork_in_child)
                self._warn_forked()

    def _advance(self, step: int, key: str) -> None:
        """Move to ``step`` (lock held): close the current step, or refuse a lower one."""
        current = self._step
        # (after close() every call only warns: a run that logs once more, at whatever step,
        # must not be stopped by its telemetry)
        if current is not None and step < current and not self._closed:
            raise ValueError(
                f"step {step} for key {key!r} is lower than step {current}, already given to "
                "this writer; steps must not decrease"
            )
        if self._values:
            self._close_step()
        self._step = step
        if threading.current_thread() is threading.main_thread():
            _ProcessEnd.main_thread_goes_on()  # (its sys.exit was caught, if it called one)

    def _capture_contexts(self) -> None:
        """The step's first value (lock held): what the sinks that ask read of their backend
        now (``Sink.capture_context``: the loop's Comet epoch), handed to their write."""
        contexts = {}
        for w in self._capturing:
            try:
                contexts[w] = w.sink.capture_context()
            except Exception as e:  # the write goes on without it
                w._report_once("capture", f"trainvitals: sink {w.name!r}: capture failed: {e!r}")
        self._step_contexts = contexts

    def _warn_forked(self) -> None:
        if not self._fork_warned:
            self._fork_warned = True
            _warn(
                f"trainvitals FanoutWriter: values logged in a forked child process (pid "
                f"{os.getpid()}, e.g. a DataLoader worker) are dropped: only the process that "
                f"created the writer (pid {self._pid}) delivers"
            )

    def _warn_closed(self) -> None:
        if not self._closed_warned:
            self._closed_warned = True
            _warn("trainvitals FanoutWriter: values logged after close() are dropped")

    def _close_step(self) -> None:
        """Queue the current step's values (lock held); deliver what training-thread sinks have
        waiting."""
        if not self._values:
            # Still deliver: logging every N steps, a step on the host would otherwise wait
            # N more steps for its training-thread sinks (and be lost by a crash meanwhile).
            self._pump_training_thread_sinks()
            return
        if self._pid != os.getpid():  # a forked child (e.g. a DataLoader worker): not ours
            self._values = {}
            return
        assert self._step is not None
        self._seq += 1
        batch = _StepBatch(
            self._seq,
            self._step,
            self._step_time,
            self._values,
            self._has_tensors,
            self._step_contexts,
        )
        self._step_contexts = None
        self._values = {}
        self._has_tensors = False
        if batch.has_tensors and torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record()
            batch.cuda_event = (torch.cuda.current_device(), event)
        queued = self._queued_steps
        if queued is not None:
            while queued and queued[0][0] <= self._dispatched:
                queued.popleft()
            queued.append((batch.seq, batch.step))
        if self.background:
            self._start_threads()
            self._enqueue(batch)
        else:
            self._dispatch(batch)
        self._pump_training_thread_sinks()

    def _deliver_before(self, worker: _SinkWorker, step: int | None) -> None:
        """Deliver to ``worker`` (a sink the training thread calls) every step lower than
        ``step`` logged so far, now: other code is about to log ``step`` to the same backend
        (``accelerator.log(values, step=step)`` reaching a ``TrackerSink``'s tracker), which
        must not get an older trainvitals step after it (DVCLive sets ``live.step = step`` and
        writes a row per call: an older step after a newer one puts the rows out of order).

        Without this the sink would get its steps at the writer's next call after they reached
        the host: trainvitals' step N after the loop's ``accelerator.log(..., step=N + 1)``.
        Here, before that log: the current step is closed when it is lower than ``step`` (its
        values are complete: the loop has moved on to a later step), the training thread waits
        until the steps lower than ``step`` are on the host, and hands them to the sink.
        Steps of only floats and CPU tensors are ready at once (the dispatcher stacks them).
        CUDA values are copied by the dispatcher once their step's event has completed: the
        wait is for the kernels of a step that has ended (usually done by the time the loop
        logs the next step; a loop counting from 1 logs N + 1 right after our step N), and only
        when there is such a step (a step that logged nothing queues nothing: a loop logging
        every step to its tracker costs no synchronisation on the steps where trainvitals logs
        nothing). Order is what the loop asked for by logging a later step. ``step=None``
        (the tracker counts): only what is already on the host is delivered, without waiting.
        A step the sink failed to take (it is retrying on its backoff) stays pending.
        """
        if not self._active or self._pid != os.getpid() or worker.threaded:
            return
        calls = self._delivering
        if getattr(calls, "depth", 0):  # called from inside a delivery (a sink's write)
            return
        calls.depth = 1
        try:
            with self._lock:
                if self._closed:
                    return  # close() delivers what is left
                if step is None:
                    worker.pump()
                    return
                if self._values and self._step is not None and self._step < step:
                    self._close_step()
                target = 0
                for seq, s in self._queued_steps or ():
                    if s >= step:
                        break
                    target = seq
                if target > self._dispatched and self.background:
                    self._wait_dispatched(target, time.monotonic() + self.sink_timeout)
                worker.pump(below=step)
        finally:
            calls.depth = 0

    def _pump_training_thread_sinks(self) -> None:
        for w in self._workers:
            if not w.threaded and w.pending:
                w.pump()

    # ---- delivery

    def _start_threads(self) -> None:
        if self._dispatcher is not None:
            return
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name="trainvitals-writer", daemon=True
        )
        self._dispatcher.start()
        for w in self._workers:
            if w.threaded:
                w.thread = threading.Thread(
                    target=w.run, name=f"trainvitals-sink-{w.name}", daemon=True
                )
                w.thread.start()

    def _enqueue(self, batch: _StepBatch) -> None:
        """Hand a step to the dispatcher; wait (rarely) while ``queue_size`` steps are queued."""
        if self._queue.qsize() >= self.queue_size:
            dispatcher = self._dispatcher
            while (
                self._queue.qsize() >= self.queue_size
                and dispatcher is not None
                and dispatcher.is_alive()
            ):
                time.sleep(0.001)
        self._queue.put(batch)

    def _dispatch_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                self._check_hangs()
                continue
            if item is _STOP:
                return
            try:
                self._dispatch(item)
            except Exception as e:  # pragma: no cover - _materialize does not raise
                _warn(f"trainvitals FanoutWriter: dropped step {item.step}: {e!r}")
            self._check_hangs()

    def _dispatch(self, batch: _StepBatch) -> None:
        metrics = _materialize(batch, self._unreadable)
        record = _Record(batch.seq, batch.step, batch.time, metrics, batch.contexts)
        with self._cond:
            for w in self._workers:
                w.offer(record)
            self._dispatched = batch.seq
            self._cond.notify_all()

    def _check_hangs(self) -> None:
        now = time.monotonic()
        with self._cond:
            for w in self._workers:
                w.check_hang(now)

    def _wait_dispatched(self, seq: int, deadline: float | None) -> bool:
        with self._cond:
            while self._dispatched < seq:
                if self._dispatcher is None or not self._dispatcher.is_alive():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(0.5 if remaining is None else min(remaining, 0.5))
        return True

    def resume_at(self, step: int) -> None:
        """Say that this run resumes at ``step``, the step of the checkpoint it was restored
        from (``0``: a new run). Call it before logging anything.

        The steps ``>= step`` that an interrupted run wrote after that checkpoint belong to a
        timeline that no longer exists. The resumed run logs some of them again, but not
        necessarily all: after a rollback it may log at other steps (a changed interval, a
        monitor switched off, no NaN to report this time). So the sinks that keep files drop
        every earlier line of a step ``>= step`` before their first write, instead of only
        those from the first step this run happens to log, and at :meth:`flush` or
        :meth:`close` when nothing was written by then (a rollback, then the end of the run
        or a crash before its next logging step; see
        :class:`~trainvitals.adapters.JsonlSink` and
        :class:`~trainvitals.adapters.TensorBoardSink`). An
        :class:`~trainvitals.adapters.MLflowSink` built from a ``run_dir`` continues the MLflow
        run recorded there when ``step > 0`` and creates a new one for ``0``; other sinks
        ignore it.

        Raises ``TypeError``/``ValueError`` for a step that is not an int ``>= 0`` (on every
        rank). Called again before anything was logged, the later step replaces the earlier
        one (the same step again changes nothing). Called again with another step once values
        were logged, once a :meth:`flush` had the sinks act on the earlier step (cut their
        files), or after :meth:`close`, it warns and does nothing: the sinks have acted on the
        earlier step already.

        Example::

            step = load_checkpoint(model, optimizer)   # the step the checkpoint was taken at
            writer.resume_at(step)
        """
        step = _as_step(step)
        with self._lock:
            if step == self._resume_step:
                return
            if self._step is not None or self._closed or self._resume_acted:
                when = (
                    "close()"
                    if self._closed
                    else "values were logged"
                    if self._step is not None
                    else f"a flush() had the sinks act on resume_at({self._resume_step})"
                )
                _warn(
                    f"trainvitals FanoutWriter: resume_at({step}) after {when} is ignored; "
                    "call it once, before the first value"
                )
                return
            self._resume_step = step
            if self._active:  # (else the sinks are told when the rank is known to be 0)
                self._resume_sinks(step)

    def end_step(self) -> None:
        """Hand the current step's values to the sinks now, without waiting for the first
        value of a later step, and without waiting for delivery (:meth:`flush` waits).

        The ``Vitals`` driver calls it when a new optimizer step starts: a step logged only
        every 50 steps would otherwise wait 50 steps in the writer, and a W&B run that other
        code (``accelerator.log(..., step=)``) moves on meanwhile refuses it. Values logged
        later for the same step are delivered as a second part of that step. Sinks called from
        the training thread (``thread_safe = False``) get the steps that reached the host
        meanwhile here, also when the current step logged nothing. After :meth:`close` it does
        nothing.
        """
        if not self._active or self._pid != os.getpid():
            return
        with self._lock:
            if self._closed:  # close() delivered what there was; the sinks are closed
                return
            self._close_step()

    def flush(self, timeout: float | None = None) -> bool:
        """Deliver everything logged so far; return ``True`` when every sink has it.

        Closes the current step, waits until it and every earlier step went to the host, and
        until every sink has delivered them, except a sink that is failing (its steps stay
        buffered and are retried), hung (``sink_timeout``; also while its writes have not
        returned in time since) or disabled. Waits at most
        ``timeout`` seconds (default: the writer's ``flush_timeout``). Returns ``False`` when
        some sink has not got everything. After :meth:`close` it calls no sink and waits for
        nothing: it says whether every sink got every step (``False`` for a disabled or
        abandoned sink, or while a ``close()`` in another thread is still delivering).

        Example::

            writer.flush()   # e.g. before a checkpoint, or before reading the files back
        """
        if not self._active:
            with self._lock:
                # nothing logged yet; but the sinks must act on a resume_at (cut their files)
                if self._resume_step is None or not self._resolve_rank():
                    return True
        if self._pid != os.getpid():
            return True
        with self._lock:
            if self._closed:
                # close() delivers (or has delivered) what there was and closes the sinks,
                # which take no further call: say whether every sink got everything
                with self._cond:
                    return all(
                        not w.disabled and not w.abandoned and w.idle_through(self._seq)
                        for w in self._workers
                    )
            self._close_step()
            target = self._seq
        if timeout is None:
            timeout = self.flush_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.background and target > 0:
            self._wait_dispatched(target, deadline)
        if self._resume_step is not None:
            # A rollback, then a flush before the next logging step (and a kill before any
            # later write): the sinks' files must already be cut back. Only sinks no worker
            # thread calls (none started: nothing was logged), under the lock that starts them.
            with self._lock:
                self._resume_acted = True  # a later resume_at(other step) is refused
                for w in self._workers:
                    if not w.threaded or w.thread is None:
                        w.settle_resume()
        for w in self._workers:
            if not w.threaded:
                w.pump()
                try:
                    w.sink.flush()
                except Exception as e:
                    w._report_once("flush", f"trainvitals: flushing sink {w.name!r} failed: {e!r}")
        with self._cond:
            while True:
                now = time.monotonic()
                waiting = [w for w in self._workers if not w.settled(target, now)]
                if not waiting:
                    break
                remaining = None if deadline is None else deadline - now
                if remaining is not None and remaining <= 0:
                    break
                wake = min(
                    (w.busy_since + self.sink_timeout - now for w in waiting if w.busy_since),
                    default=None,
                )
                wait = [t for t in (remaining, wake) if t is not None]
                self._cond.wait(max(0.0, min(wait)) + 1e-3 if wait else None)
            now = time.monotonic()
            for w in self._workers:
                w.check_hang(now)
            return all(not w.disabled and w.idle_through(target) for w in self._workers)

    def close(
        self, timeout: float | None = None, *, failed: bool = False, interrupted: bool = False
    ) -> None:
        """Deliver what is queued, close the sinks this writer owns, stop the threads.

        Waits up to ``timeout`` seconds (default: ``close_timeout``) for the sinks to drain,
        retrying failing sinks on their backoff schedule; a sink still busy after that is
        abandoned and its undelivered steps are counted as missed. Sinks built on objects the
        caller passed in (a ``SummaryWriter``, an MLflow client and run, a Comet experiment, a
        W&B run) are flushed, not closed. ``failed=True`` (the run ended with an exception; the
        ``Vitals`` driver and ``with writer:`` pass it; ``sys.exit(0)`` is no failure) ends the
        runs the sinks created as failed (MLflow ``FAILED``, W&B exit code 1);
        ``interrupted=True`` (the user stopped it: ``KeyboardInterrupt``) as killed (MLflow
        ``KILLED``, W&B exit code 255). A writer still open when the interpreter exits is
        closed by an exit hook, as failed when an uncaught exception or ``sys.exit`` with a
        non-zero status ends the script, as interrupted after an uncaught
        ``KeyboardInterrupt`` (``docs/writer.md``, *How a run ends*). Never raises because of
        a sink; warns once, at the end, for every sink that missed steps. Calling it again
        does nothing more: from another thread while the first call is still delivering, it
        waits for that call to finish (within the same time limit), so that it too returns
        with every sink closed; the exit hook does the same for a ``close()`` still running
        in a daemon thread.
        """
        with self._lock:
            first = not self._closed
            if first:
                self._closed = True
                self._closing_thread = threading.get_ident()
                if failed or interrupted:
                    for s in self.sinks:
                        s.run_failed = True
                        s.run_interrupted = interrupted
                if not self._resolved and self._resume_step is not None:
                    self._resolve_rank()  # rank 0's sinks act on resume_at when they close
                if self._active and self._pid == os.getpid():
                    try:
                        self._close_step()
                    except Exception as e:  # pragma: no cover - defensive
                        _warn(f"trainvitals FanoutWriter: could not queue the last step: {e!r}")
        if not first:
            self._wait_closed(self.close_timeout if timeout is None else timeout)
            return
        try:
            if self._active and self._pid == os.getpid():
                self._shutdown(self.close_timeout if timeout is None else timeout)
        except Exception as e:  # pragma: no cover - defensive: close never raises
            _warn(f"trainvitals FanoutWriter: error while closing: {e!r}")
        finally:
            for patch in self._patches:  # (kept when other code wrapped the method after us)
                with contextlib.suppress(Exception):
                    patch.undo()
            self._patches.clear()
            # only now: the exit hook closes the writers still in the set, and its close()
            # must wait for this one (a close() in a daemon thread is cut off at exit)
            _live_writers.discard(self)
            self._close_done.set()

    def _wait_closed(self, timeout: float) -> None:
        """A second ``close()``: wait until the first call, perhaps running in another thread,
        has delivered and closed the sinks (at most ``timeout`` plus the time an abandoned
        sink gets to close), so that every caller returns with the sinks' data written."""
        if (
            not self._active
            or self._pid != os.getpid()
            or self._closing_thread == threading.get_ident()  # re-entered from a sink's close
        ):
            return
        self._close_done.wait(timeout + _ABANDONED_CLOSE_TIMEOUT)

    def _shutdown(self, timeout: float) -> None:
        start = time.monotonic()
        deadline = start + timeout
        dispatcher = self._dispatcher
        if dispatcher is not None:
            self._queue.put(_STOP)
            dispatcher.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            for w in self._workers:
                w.closing = True
            self._cond.notify_all()
        for w in self._workers:
            if w.threaded and w.thread is not None:
                continue
            # the calling thread delivers: drain on the backoff schedule, then close
            while True:
                w.pump()
                with self._cond:
                    if w.disabled or not w.pending:
                        break
                    delay = w.next_attempt - time.monotonic()
                if time.monotonic() + max(delay, 0.0) > deadline:
                    break
                if delay > 0:
                    time.sleep(delay)
            if w.pending:
                with self._cond:
                    w._miss("unfinished at close", len(w.pending))
                    w.pending.clear()
            w.finish()
        with self._cond:
            # wait for the worker threads to finish, but not for a hung one, nor for one
            # whose last write ran past sink_timeout and that is writing or has steps left
            while True:
                now = time.monotonic()
                busy = [
                    w
                    for w in self._workers
                    if not w.finished
                    and not w.hung(now)
                    and not (w.slow and (w.inflight is not None or w.pending))
                ]
                if not busy or now >= deadline:
                    break
                wake = min(
                    (w.busy_since + self.sink_timeout for w in busy if w.busy_since),
                    default=deadline,
                )
                self._cond.wait(max(0.0, min(deadline, wake) - now) + 1e-3)
            idle: list[_SinkWorker] = []
            for w in self._workers:
                w.check_hang(now)
                if not w.finished:
                    w.abandoned = True
                    left = len(w.pending) + (w.inflight is not None)
                    w._miss("unfinished at close", left)
                    w.pending.clear()
                    why = (
                        f"its write ran past sink_timeout ({self.sink_timeout:g} s)"
                        if w.slow
                        else f"close_timeout: {timeout:g} s"
                    )
                    _warn(
                        f"trainvitals FanoutWriter: sink {w.name!r} did not finish within "
                        f"{now - start:.1f} s of close() ({why}); abandoned with {left} "
                        "undelivered steps"
                    )
                    if w.inflight is None and not w.finishing:  # in a retry delay
                        idle.append(w)
            self._cond.notify_all()
            total = self._dispatched
            lossy = [w for w in self._workers if w.missed]
        # An abandoned sink that is not inside a write is still closed (an MLflow run it
        # created would stay RUNNING, a Comet experiment it created would write no archive);
        # its worker thread no longer calls it. Bounded: a backend's close may hang too.
        for w in idle:
            closer = threading.Thread(target=w.finish, name=f"trainvitals-close-{w.name}")
            closer.daemon = True
            closer.start()
            closer.join(_ABANDONED_CLOSE_TIMEOUT)
        for w in lossy:
            why = ", ".join(f"{n} {reason}" for reason, n in w.missed_why.items())
            if w.unusable:
                why += "; disabled at once: an error retrying cannot fix"
            elif w.disabled:
                why += f"; disabled after {w.failures} consecutive failures"
            last = f"; last error: {w.last_error}" if w.last_error else ""
            if w.close_error is not None:
                last += f"; closing sink {w.name!r} failed too: {w.close_error}"
            _warn(
                f"trainvitals FanoutWriter closed: sink {w.name!r} missed {w.missed} of "
                f"{total} steps ({why}){last}"
            )

    # ---- introspection

    def status(self) -> dict[str, dict[str, Any]]:
        """Per sink: steps ``delivered``, ``missed``, ``pending``; ``failures`` (all),
        ``consecutive_failures``, ``disabled``, ``hung``, ``last_error``.

        Example::

            >>> writer.status()["mlflow"]["missed"]   # doctest: +SKIP
            0
        """
        now = time.monotonic()
        with self._cond:
            return {
                w.name: {
                    "delivered": w.delivered,
                    "missed": w.missed,
                    # (a write close() abandoned counts as missed until it returns)
                    "pending": len(w.pending) + (w.inflight is not None and not w.abandoned),
                    "failures": w.total_failures,
                    "consecutive_failures": w.failures,
                    "disabled": w.disabled,
                    "hung": w.hung(now),
                    "last_error": w.last_error,
                }
                for w in self._workers
            }

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> FanoutWriter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        # sys.exit(0) inside the block is a success, as at exit (see _ProcessEnd)
        failed, interrupted = _run_outcome(exc)
        self.close(failed=failed, interrupted=interrupted)
