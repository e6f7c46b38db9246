"""Sinks that forward to a framework's own logger object (Lightning loggers, Accelerate trackers).

Used for loggers without a dedicated sink (Lightning's ``CSVLogger`` and any other logger,
Accelerate trackers other than tensorboard/mlflow/comet_ml/wandb). They receive one call per
step with a dict of Python floats (Accelerate's own trackers drop tensor values silently: these
never get any) and are called from the training thread, because the training loop calls the same
objects without locks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainvitals.adapters.sinks.base import Sink

__all__ = ["LightningLoggerSink", "TrackerSink"]


class LightningLoggerSink(Sink):
    """Forward each step to a Lightning logger's ``log_metrics(dict, step)``; ``save()`` on flush.

    The logger is called from the training thread (``thread_safe = False``): Lightning's
    ``CSVLogger`` rewrites its file from a list that the trainer appends to without a lock.

    Example::

        sink = LightningLoggerSink(CSVLogger("logs"))
    """

    thread_safe = False

    def __init__(self, logger: Any, *, name: str | None = None) -> None:
        if not callable(getattr(logger, "log_metrics", None)):
            raise TypeError(f"expected a Lightning logger, got {type(logger).__name__}")
        super().__init__(name=name or type(logger).__name__.lower(), owned=False)
        self.logger = logger

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self.logger.log_metrics(dict(metrics), step)

    def flush(self) -> None:
        save = getattr(self.logger, "save", None)
        if callable(save):
            save()


class TrackerSink(Sink):
    """Forward each step to an Accelerate tracker's ``log(dict, step=)`` with float values.

    Example::

        sink = TrackerSink(accelerator.get_tracker("aim"))
    """

    thread_safe = False

    def __init__(self, tracker: Any, *, name: str | None = None) -> None:
        if not callable(getattr(tracker, "log", None)):
            raise TypeError(f"expected an Accelerate tracker, got {type(tracker).__name__}")
        super().__init__(
            name=name or str(getattr(tracker, "name", type(tracker).__name__)), owned=False
        )
        self.tracker = tracker

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self.tracker.log(dict(metrics), step=step)
