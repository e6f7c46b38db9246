"""Weights & Biases sink: one ``run.log(dict, step=)`` per step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainvitals.adapters.sinks.base import WANDB_KEYS, Sink, StepRefused

__all__ = ["WandbSink"]


class WandbSink(Sink):
    """Write each step to a W&B run (online or ``mode="offline"``).

    Args:
        run: the ``wandb`` run (``wandb.init(...)``, Lightning's ``WandbLogger.experiment``,
            Accelerate's wandb tracker's ``run``). The sink leaves it running unless ``owned``.
        step_metric: ``None`` (default): log with ``run.log(metrics, step=step)``, so the
            writer's step is W&B's step. A name such as ``"trainer/global_step"``: log
            ``run.log({**metrics, step_metric: step})`` without ``step=``, the way Lightning's
            ``WandbLogger`` does (it declares that metric as the x-axis of every key), so that
            the sink and the logger can share the run.
        owned: finish the run when the writer closes: exit code 0, 1 when the run failed
            (``FanoutWriter.close(failed=True)``), 255 when the user stopped it
            (``close(interrupted=True)``), as W&B's own exit hook does for Ctrl-C.
        name: the sink's name in warnings.

    W&B refuses a ``step`` lower than the run's current step (it drops the row with a
    warning). With ``step_metric=None`` the sink checks ``run.step`` first and reports such a
    step as missed (a warning, once) instead of letting it vanish; this happens when other code
    logs later steps to the same run before the writer delivered an earlier one: give
    trainvitals the step axis (``step_metric``), or end each step with ``writer.end_step()``
    (the ``Vitals`` driver does) or ``writer.flush()`` before that code logs the next step. Values logged for one step in two deliveries land in the same row.

    Keys W&B writes itself (``_step``, ``_runtime``, ``_timestamp``, ``_wandb...``) are mapped
    by :data:`~trainvitals.adapters.sinks.base.WANDB_KEYS`. NaN and infinities are stored as
    such (``NaN``, ``Infinity``, ``-Infinity`` in the run's history JSON).

    Example::

        run = wandb.init(project="demo", mode="offline", dir="runs/demo")
        sink = WandbSink(run)
        sink = WandbSink(wandb_logger.experiment, step_metric="trainer/global_step")
    """

    name = "wandb"
    key_rule = WANDB_KEYS

    def __init__(
        self,
        run: Any,
        *,
        step_metric: str | None = None,
        owned: bool = False,
        name: str | None = None,
    ) -> None:
        if not callable(getattr(run, "log", None)):
            raise TypeError(f"WandbSink needs a wandb run, got {type(run).__name__}")
        super().__init__(name=name, owned=owned)
        self.run = run
        self.step_metric = step_metric

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        data = dict(self.map_metrics(metrics))
        if self.step_metric is not None:
            data[self.step_metric] = step
            self.run.log(data)
            return
        current = getattr(self.run, "step", None)
        if isinstance(current, int) and step < current:
            raise StepRefused(f"the W&B run is already at step {current}; W&B drops step {step}")
        self.run.log(data, step=step)

    def close(self) -> None:
        if self.owned:
            if self.run_interrupted:
                # what W&B's own exit hook gives a run stopped by Ctrl-C
                # (wandb/sdk/lib/exit_hooks.py, ExitHooks.exc_handler)
                self.run.finish(exit_code=255)
            elif self.run_failed:
                self.run.finish(exit_code=1)
            else:
                self.run.finish()
