"""Sinks that forward to a framework's own logger object (Lightning loggers, Accelerate trackers).

Used for loggers without a dedicated sink (Lightning's ``CSVLogger`` and any other logger,
Accelerate trackers other than tensorboard/mlflow/comet_ml/wandb). They receive one call per
step with a dict of Python floats (Accelerate's own trackers drop tensor values silently: these
never get any) and are called from the training thread, because the training loop calls the same
objects without locks.

Order with the loop's own logs
------------------------------
The training loop logs to the same object (``accelerator.log(values, step=N)`` reaches every
tracker's ``log``; Lightning calls each logger's ``log_metrics(metrics, step=N)``). The writer
calls these sinks at its next call after a step's values reached the host, which is after the
loop has logged the next step: the object would get trainvitals' step N after the loop's step
N + 1 (DVCLive's tracker sets ``live.step = step`` and starts a new row per call; a
``CSVLogger`` writes its rows in call order). So the writer has each of these sinks wrap that
method of the object (an instance attribute, taken back at ``close``): a call of step ``M`` by
other code first has the writer deliver its steps lower than ``M``
(``FanoutWriter._deliver_before``; a call without a step delivers what is on the host). The
sinks' own writes call the method as it was before.
"""

from __future__ import annotations

import functools
import numbers
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from trainvitals._patching import AttributePatch
from trainvitals.adapters.sinks.base import Sink

__all__ = ["LightningLoggerSink", "TrackerSink"]


class _OrderedForwardSink(Sink):
    """A sink calling ``target.<method>(dict, step)``, the method other code calls too, with
    ``step`` its second argument (positional or ``step=``)."""

    thread_safe = False
    _method = ""
    _step_keyword = True  # pass step=step (False: positionally)

    def __init__(self, target: Any, *, name: str) -> None:
        super().__init__(name=name, owned=False)
        self._target = target
        self._patch: AttributePatch | None = None
        self._original: Callable[..., Any] | None = None  # the method under our wrapper

    def install_order_hook(self, deliver_before: Callable[[int | None], None]) -> None:
        """Wrap the target's method so that ``deliver_before(step)`` runs before each call of
        it by other code (the writer calls this once, when it is built; see the module
        docstring)."""
        if self._patch is not None:
            return
        original = getattr(self._target, self._method)
        warned: list[bool] = []

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            step = kwargs["step"] if "step" in kwargs else args[1] if len(args) > 1 else None
            if not isinstance(step, numbers.Integral) or isinstance(step, bool):
                step = None  # no step (the backend counts), or one we cannot compare
            try:
                deliver_before(None if step is None else int(step))
            except Exception as e:  # the loop's own log must go through whatever happens
                if not warned:
                    warned.append(True)
                    warnings.warn(
                        f"trainvitals sink {self.name!r}: could not deliver earlier steps "
                        f"before the loop's own {self._method}: {e!r}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            return original(*args, **kwargs)

        try:
            self._patch = AttributePatch(self._target, self._method, wrapper)
        except (AttributeError, TypeError):  # an object that takes no attributes: unordered
            return
        self._original = original

    def _forward(self, step: int, metrics: Mapping[str, float]) -> None:
        method = self._original or getattr(self._target, self._method)
        if self._step_keyword:
            method(dict(metrics), step=step)
        else:
            method(dict(metrics), step)

    def close(self) -> None:
        if self._patch is not None:
            self._patch.undo()  # (kept when other code wrapped it after us)
            self._patch = None
            self._original = None
        super().close()


class LightningLoggerSink(_OrderedForwardSink):
    """Forward each step to a Lightning logger's ``log_metrics(dict, step)``; ``save()`` on flush.

    The logger is called from the training thread (``thread_safe = False``): Lightning's
    ``CSVLogger`` rewrites its file from a list that the trainer appends to without a lock.
    Steps reach the logger in order with Lightning's own ``log_metrics`` calls (module
    docstring).

    Example::

        sink = LightningLoggerSink(CSVLogger("logs"))
    """

    _method = "log_metrics"
    _step_keyword = False

    def __init__(self, logger: Any, *, name: str | None = None) -> None:
        if not callable(getattr(logger, "log_metrics", None)):
            raise TypeError(f"expected a Lightning logger, got {type(logger).__name__}")
        super().__init__(logger, name=name or type(logger).__name__.lower())
        self.logger = logger

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self._forward(step, metrics)

    def flush(self) -> None:
        save = getattr(self.logger, "save", None)
        if callable(save):
            save()


class TrackerSink(_OrderedForwardSink):
    """Forward each step to an Accelerate tracker's ``log(dict, step=)`` with float values.

    Steps reach the tracker in order with the loop's own logs: trainvitals' step N arrives no
    later than the loop's ``accelerator.log(values, step=M)`` of any ``M > N`` (module
    docstring).

    Example::

        sink = TrackerSink(accelerator.get_tracker("aim"))
    """

    _method = "log"

    def __init__(self, tracker: Any, *, name: str | None = None) -> None:
        if not callable(getattr(tracker, "log", None)):
            raise TypeError(f"expected an Accelerate tracker, got {type(tracker).__name__}")
        super().__init__(
            tracker, name=name or str(getattr(tracker, "name", type(tracker).__name__))
        )
        self.tracker = tracker

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self._forward(step, metrics)
