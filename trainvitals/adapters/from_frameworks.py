"""Sinks from what a Lightning ``Trainer`` or an Accelerate ``Accelerator`` already set up.

Neither ``lightning``/``pytorch_lightning`` nor ``accelerate`` is imported here: loggers are
recognised by class name (anywhere in their MRO), so both Lightning packages work, and trackers
by their ``name``. Used by :meth:`FanoutWriter.from_lightning` and
:meth:`FanoutWriter.from_accelerator`.
"""

from __future__ import annotations

import os
from typing import Any

from trainvitals.adapters.sinks import (
    CometSink,
    JsonlSink,
    LightningLoggerSink,
    MLflowSink,
    Sink,
    TensorBoardSink,
    TrackerSink,
    WandbSink,
)

__all__ = ["accelerator_sinks", "lightning_sinks"]

#: the x-axis metric Lightning's ``WandbLogger`` declares and logs with every row
LIGHTNING_WANDB_STEP = "trainer/global_step"


def _class_names(obj: Any) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def lightning_sinks(
    trainer: Any, *, default_jsonl: str | os.PathLike[str] | None = None, build: bool = True
) -> list[Sink]:
    """One sink per logger of ``trainer`` (see :meth:`FanoutWriter.from_lightning`).

    ``build=False`` (a non-zero rank) checks the arguments the same way but builds nothing:
    there, Lightning's loggers hold dummy experiments.
    """
    loggers = list(getattr(trainer, "loggers", None) or [])
    if not loggers and default_jsonl is None:
        raise ValueError(
            "the Trainer has no logger (Trainer(logger=False)); give it a logger or pass "
            "default_jsonl=PATH to FanoutWriter.from_lightning"
        )
    if not build:
        return []
    sinks: list[Sink] = []
    for logger in loggers:
        names = _class_names(logger)
        sink: Sink
        if "TensorBoardLogger" in names:
            sink = TensorBoardSink(logger.experiment)
        elif "MLFlowLogger" in names:
            client = logger.experiment  # creates the experiment and run if needed
            sink = MLflowSink(client, logger.run_id)
        elif "CometLogger" in names:
            sink = CometSink(logger.experiment)
        elif "WandbLogger" in names:
            sink = WandbSink(logger.experiment, step_metric=LIGHTNING_WANDB_STEP)
        else:  # CSVLogger and any other logger: its own log_metrics (and prefix), once per step
            sinks.append(LightningLoggerSink(logger))
            continue
        sink.key_prefix = _logger_key_prefix(logger, comet="CometLogger" in names)
        sinks.append(sink)
    if not sinks:
        assert default_jsonl is not None
        sinks.append(JsonlSink(default_jsonl))
    return sinks


def _logger_key_prefix(logger: Any, *, comet: bool) -> str:
    """What a Lightning logger's ``log_metrics`` puts before each key, for the sinks that write
    to its backend directly: ``prefix`` and ``LOGGER_JOIN_CHAR`` (``"-"``), as Lightning's
    ``_add_prefix``; Comet's own ``prefix=`` argument, which ``CometLogger`` passes on, joins
    with ``"_"``."""
    prefix = getattr(logger, "_prefix", None)
    if not isinstance(prefix, str) or not prefix:
        return ""
    return prefix + ("_" if comet else str(getattr(logger, "LOGGER_JOIN_CHAR", "-")))


def accelerator_sinks(
    accelerator: Any,
    *,
    default_jsonl: str | os.PathLike[str] | None = None,
    build: bool = True,
) -> list[Sink]:
    """One sink per tracker of ``accelerator`` (see :meth:`FanoutWriter.from_accelerator`).

    ``build=False`` (not the main process, where Accelerate starts no tracker) checks what can
    be checked there and builds nothing.
    """
    configured = list(getattr(accelerator, "log_with", None) or [])
    trackers = list(getattr(accelerator, "trackers", None) or [])
    if not configured and not trackers and default_jsonl is None:
        raise ValueError(
            "the Accelerator has no trackers; create it with log_with=[...] and call "
            "accelerator.init_trackers(...), or pass default_jsonl=PATH to "
            "FanoutWriter.from_accelerator"
        )
    if not build:
        return []
    if configured and not trackers:
        raise ValueError(
            f"the Accelerator is configured with log_with={configured} but has no trackers "
            "yet: call accelerator.init_trackers(...) before FanoutWriter.from_accelerator"
        )
    sinks: list[Sink] = []
    for tracker in trackers:
        name = str(getattr(tracker, "name", ""))
        if name == "tensorboard":
            sinks.append(TensorBoardSink(tracker.writer))
        elif name == "mlflow":
            import mlflow

            run = tracker.active_run
            # Accelerate's tracker logs through mlflow's fluent API, i.e. to the tracking URI
            # in effect now; a client on the same URI writes into the same run.
            client = mlflow.MlflowClient(tracking_uri=mlflow.get_tracking_uri())
            sinks.append(MLflowSink(client, run.info.run_id))
        elif name == "comet_ml":
            sinks.append(CometSink(tracker.writer))
        elif name == "wandb":
            # the loop moves the same run with accelerator.log(..., step=): join its rows
            sinks.append(WandbSink(tracker.run, shared_step=True))
        else:
            sinks.append(TrackerSink(tracker))
    if not sinks:
        assert default_jsonl is not None
        sinks.append(JsonlSink(default_jsonl))
    return sinks
