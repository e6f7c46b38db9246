"""Comet sink: one ``Experiment.log_metrics(dict, step=)`` per step."""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

from trainvitals.adapters.sinks.base import COMET_KEYS, Sink, StepRefused

__all__ = ["CometSink"]


class CometSink(Sink):
    """Write each step to a Comet ``Experiment`` or ``OfflineExperiment``.

    Args:
        experiment: an existing experiment (Lightning's ``CometLogger.experiment``,
            Accelerate's comet_ml tracker's ``writer``); the sink leaves it running.
        offline_directory: instead of ``experiment``: the sink creates an
            ``OfflineExperiment`` writing its archive (a ``.zip``) into this directory on its
            first delivery, and ends it (which writes the archive) when the writer closes.
        experiment_kwargs: extra keyword arguments for that ``OfflineExperiment`` (unused
            with ``experiment``): not a mapping of keyword names, ``TypeError``; holding
            ``offline_directory`` (give it as the sink's own), ``ValueError``; both when the
            sink is built, not at every retry of its first delivery.
        name: the sink's name in warnings.

    Threads: an experiment passed in is shared with the loop's own logging, so the sink calls
    it from the training thread (``thread_safe = False``: at the writer's next call after the
    step reached the host). Comet's ``log_metrics(d, step=)`` sets the experiment's current
    step and then logs each metric at whatever the current step is by then
    (``Experiment._log_metric`` reads ``curr_step``); from another thread, a step the loop logs
    meanwhile (Lightning's ``CometLogger``, Accelerate's tracker) would move the rest of the
    sink's step onto the loop's step. An experiment the sink creates is its own: it is written
    from the sink's background thread.

    Current step: ``log_metrics(d, step=)`` also leaves the experiment's ``curr_step`` at the
    sink's step, which is the previous step (a step is delivered once the next one started).
    What the loop logs without a step (``log_metric(name, value)``, Accelerate's
    ``accelerator.log(values)``, assets, Comet's PyTorch auto-logging, which counts steps on
    from ``curr_step``) would land on that earlier step; so the sink puts a shared
    experiment's ``curr_step`` back to what it was, as Comet's own Keras callback does around
    its test batches (``comet_ml/callbacks/_base.py``). (Comet's ``curr_step`` parameter keeps
    the sink's step until the loop sets a step again.)

    Epoch: Comet tags each metric with the experiment's ``curr_epoch`` at the time it is logged
    (``experiment.set_epoch(e)``; Lightning's ``CometLogger`` sets it from the ``epoch`` it
    logs). A step reaches a shared experiment some time after it was logged, by when the loop
    may have started the next epoch (the last steps of epoch 0 were tagged epoch 1), so the
    sink reads the experiment's epoch when the step's first value is logged
    (:meth:`~trainvitals.adapters.Sink.capture_context`) and tags the step with it, putting the
    loop's epoch back afterwards (without ``set_epoch``, which would log a parameter).

    Context: Comet tags each metric with the experiment's context at the time it is logged
    (``with experiment.train():``, ``.validate()``, ``.test()``), and shows it under the
    context's prefix (``train_loss``; Comet's own summary uses ``Experiment._fullname``). A
    step reaches a shared experiment at the writer's next call, whichever context the loop is
    in by then (a training step delivered from the validation loop), so the sink logs without
    the context (``log_metrics(..., include_context=False)``): every key keeps its own name, as
    in the other sinks. (A comet_ml whose ``log_metrics`` has no ``include_context`` is called
    without it.)

    An experiment that is no longer alive (ended, by its owner or by the
    ``CometLogger.finalize`` of older Lightning versions; or disabled, as the one Lightning
    2.6's ``CometLogger(online=False)`` creates) drops whatever is logged to it without a word:
    the sink reports such a step as missed
    (:class:`~trainvitals.adapters.sinks.base.StepRefused`, one warning) instead of counting it
    as delivered.

    Keys are mapped by :data:`~trainvitals.adapters.sinks.base.COMET_KEYS`: unchanged up to
    100 characters (``_x`` followed by two hex digits is escaped as ``_x5fx..``, as by every
    key rule, so that mapped keys stay distinct); a longer key is cut with a hash (Comet would
    cut it to a plain prefix itself, merging long keys that start alike into one metric).
    Comet serialises NaN and infinities as the strings ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"`` in its messages (``messages.json`` of the offline archive); finite values
    as JSON numbers.

    Example::

        sink = CometSink(comet_logger.experiment)
        sink = CometSink(offline_directory="runs/demo/comet", experiment_kwargs={"project_name": "demo"})
    """

    name = "comet"
    key_rule = COMET_KEYS

    def __init__(
        self,
        experiment: Any = None,
        *,
        offline_directory: str | os.PathLike[str] | None = None,
        experiment_kwargs: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        if experiment is None and offline_directory is None:
            raise ValueError("CometSink needs an experiment or an offline_directory")
        if experiment is not None and not callable(getattr(experiment, "log_metrics", None)):
            raise TypeError(
                f"CometSink needs a comet_ml Experiment, got {type(experiment).__name__}"
            )
        # (the kwargs build the OfflineExperiment: unused, and not checked, with an experiment)
        if experiment is None and experiment_kwargs is not None:
            if not isinstance(experiment_kwargs, Mapping) or not all(
                isinstance(k, str) for k in experiment_kwargs
            ):
                raise TypeError(
                    "experiment_kwargs must be a mapping of keyword names, got "
                    f"{experiment_kwargs!r}"
                )
            if "offline_directory" in experiment_kwargs:
                # (passed twice to OfflineExperiment: a TypeError at every retry of its first step)
                raise ValueError(
                    "experiment_kwargs must not hold offline_directory: give it as CometSink's "
                    "offline_directory"
                )
        super().__init__(name=name, owned=experiment is None)
        self.thread_safe = experiment is None  # see "Threads" above
        self.experiment = experiment
        self.offline_directory = (
            os.fspath(offline_directory) if offline_directory is not None else None
        )
        self.experiment_kwargs = dict(experiment_kwargs or {})
        self._log_kwargs: dict[str, Any] | None = None  # what log_metrics is given besides step

    def open(self) -> None:
        if self.experiment is None:
            import comet_ml

            assert self.offline_directory is not None
            os.makedirs(self.offline_directory, exist_ok=True)
            self.experiment = comet_ml.OfflineExperiment(
                offline_directory=self.offline_directory, **self.experiment_kwargs
            )

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        if self.experiment is None:
            self.open()
        experiment = self.experiment
        if getattr(experiment, "alive", True) is False:
            # Comet's _log_metric logs nothing once the experiment is not alive
            raise StepRefused(
                "the Comet experiment is not alive (ended or disabled): Comet drops what is "
                "logged to it"
            )
        kwargs = self._log_kwargs
        if kwargs is None:
            kwargs = self._log_kwargs = _no_context_kwargs(experiment.log_metrics)
        if self.owned or not hasattr(experiment, "curr_step"):
            experiment.log_metrics(dict(self.map_metrics(metrics)), step=step, **kwargs)
            return
        loop_step = experiment.curr_step
        loop_epoch = getattr(experiment, "curr_epoch", None)
        epoch = self.step_context  # the loop's epoch when the step was logged (see "Epoch")
        retag = hasattr(experiment, "curr_epoch") and epoch != loop_epoch
        try:
            if retag:
                experiment.curr_epoch = epoch
            experiment.log_metrics(dict(self.map_metrics(metrics)), step=step, **kwargs)
        finally:
            experiment.curr_step = loop_step  # see "Current step" above
            if retag:
                experiment.curr_epoch = loop_epoch

    def capture_context(self) -> Any:
        # a shared experiment's epoch when the step's first value is logged (see "Epoch")
        experiment = self.experiment
        if self.owned or experiment is None:
            return None
        return getattr(experiment, "curr_epoch", None)

    def close(self) -> None:
        if self.owned and self.experiment is not None:
            self.experiment.end()


def _no_context_kwargs(log_metrics: Any) -> dict[str, Any]:
    """``{"include_context": False}`` when ``log_metrics`` takes it (see "Context" above)."""
    try:
        params = inspect.signature(log_metrics).parameters
    except (TypeError, ValueError):  # no signature to read: call it as before
        return {}
    takes = "include_context" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )
    return {"include_context": False} if takes else {}
