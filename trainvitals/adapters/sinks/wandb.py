"""Weights & Biases sink: one ``run.log(dict, step=)`` per step."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from trainvitals.adapters.sinks.base import (
    WANDB_KEYS,
    WANDB_SHARED_KEYS,
    Sink,
    StepRefused,
    refuse_step_beyond_int64,
)

__all__ = ["SHARED_STEP_METRIC", "WandbSink"]

#: the x-axis key that ``WandbSink(shared_step=True)`` logs with every row
SHARED_STEP_METRIC = "trainvitals/step"


def _metric_name(key: str) -> str | None:
    """The name of the logged key ``key`` in ``define_metric`` (``None``: W&B has none).

    W&B reads a ``define_metric`` name as a path: an unescaped ``.`` separates the levels of a
    nested dict (``define_metric("a.b")`` is ``log({"a": {"b": v}})``), ``\\.`` is a literal
    dot and a ``\\`` before any other character stays as it is (wandb-core's ``runmetric``,
    W&B's own test ``test_metric_dotted``). A flat key such as
    ``l2_norm/grad/model.layers.0.weight`` is therefore declared with its dots escaped (the key
    itself is logged as it is). A key with an odd run of ``\\`` before a ``.`` or at its end
    has no such name (W&B would read ``odd\\`` as ``odd``, another key); the sink's key rule
    (:data:`~trainvitals.adapters.sinks.base.WANDB_SHARED_KEYS`) escapes every ``\\`` of a
    logged key, so this only happens for a ``step_metric`` name, which ``WandbSink`` refuses.
    """
    if _UNNAMEABLE.search(key):
        return None
    return key.replace(".", "\\.")


_UNNAMEABLE = re.compile(r"(?<!\\)(?:\\\\)*\\(?:\.|\Z)")


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
        shared_step: other code moves the run's step too (below); ``step_metric`` then names
            the x-axis key written with every row (default ``"trainvitals/step"``).
        owned: finish the run when the writer closes: exit code 0, 1 when the run failed
            (``FanoutWriter.close(failed=True)``), 255 when the user stopped it
            (``close(interrupted=True)``), as W&B's own exit hook does for Ctrl-C.
        name: the sink's name in warnings.

    W&B refuses a ``step`` lower than the run's current step (it drops the row with a
    warning). With ``step_metric=None`` the sink checks ``run.step`` first and reports such a
    step as missed (a warning, once) instead of letting it vanish; this happens when other code
    logs later steps to the same run before the writer delivered an earlier one: use
    ``shared_step=True``, give trainvitals the step axis (``step_metric``), or end each step
    with ``writer.end_step()`` (the ``Vitals`` driver does) or ``writer.flush()`` before that
    code logs the next step. Values logged for one step in two deliveries land in the same row.

    A run that was finished before the writer delivered its last steps (``run.finish()``
    before the writer's ``close()``) takes nothing more: the sink reports those steps as missed
    (one warning) at once. (Accelerate's ``end_training()`` has a writer from
    :meth:`FanoutWriter.from_accelerator` deliver its steps first.) (W&B raises ``UsageError`` for
    its ``log()``, and its ``run.step`` waited 30 s for an answer at each of the writer's
    retries, so ``close()`` stalled for its whole ``close_timeout``.)

    ``shared_step=True`` (what :meth:`FanoutWriter.from_accelerator` builds for Accelerate's
    wandb tracker) is for a run whose step other code moves with ``log(..., step=N)``, such as
    a loop's ``accelerator.log(values, step=completed_steps)``: a step the run has not passed
    goes to W&B step ``step`` as above; a step the run has passed joins the run's open row
    (``log(commit=False)``) instead of being refused, so the loop's own rows are never touched
    and its numbering (from 0 or from 1, every step or every k) costs no trainvitals step.
    Every row the sink writes carries ``step_metric`` (default ``"trainvitals/step"``), declared
    with ``define_metric`` as the x-axis of each trainvitals key, so charts plot each value at
    its own step whichever W&B row holds it. Two trainvitals steps never share a row: a step
    whose row holds the previous one (the loop counts from 1, its step ``N`` being trainvitals'
    ``N - 1``) takes the next row, which the loop has not logged yet; the rest of a step
    delivered in two parts joins its row, or the open row once that one is closed (both
    carry the step). The loop's own numbers must only grow, and not fall below trainvitals' steps
    (an epoch index as ``step=`` does): a run that trainvitals moved to step 100 refuses the
    loop's ``step=1``.

    Keys W&B writes itself (``_step``, ``_runtime``, ``_timestamp``, ``_wandb...``) are mapped
    by :data:`~trainvitals.adapters.sinks.base.WANDB_KEYS`, and so is a metric named as the
    sink's ``step_metric`` (``trainer/global_step`` -> ``_x74rainer/global_step``: the sink
    writes the step under that name, which overwrote the metric); with ``shared_step=True`` a ``*``
    and a ``\\`` are escaped too (:data:`~trainvitals.adapters.sinks.base.WANDB_SHARED_KEYS`:
    ``attn*scale`` -> ``attn_x2ascale``, ``a\\.b`` -> ``a_x5c.b``), because ``define_metric``
    raises for a ``*`` inside a name (every step of the sink failed, and it was switched off)
    and takes a trailing ``*`` as a glob, and reads ``\\`` as an escape (a key with an odd run
    of ``\\`` before a ``.`` or at its end has no name there: it was logged without its
    x-axis). In the names it gives ``define_metric`` the sink escapes each ``.``
    (``model.layers.0.weight`` -> ``model\\.layers\\.0\\.weight``; the logged key keeps its
    dots): W&B reads an unescaped ``.`` there as a nested dict's level (the x-axis would go to
    a key nobody logs). So every key the sink logs is declared. A ``step_metric`` W&B cannot
    name that way raises ``ValueError``. NaN and infinities are stored as such (``NaN``,
    ``Infinity``, ``-Infinity`` in the run's history JSON). A step above ``2**63 - 1`` (W&B's
    ``_step`` is an int64) is refused (:class:`~trainvitals.adapters.StepRefused`).

    Dead service: W&B's ``run.log`` hands each row to the run's background service
    (``wandb-core``). When that process is killed or its connection breaks, W&B raises a
    ``ConnectionError`` for that and every later call of the run: the sink then reports that
    step and every later one as missed (one warning) without calling W&B again, instead of
    retrying until the writer's ``close_timeout`` ran out. When the service stops answering
    (hung), ``run.step`` waits 30 s and raises ``TimeoutError``; the sink then stops reading
    ``run.step`` for the rest of the run (steps go to ``log(..., step=)`` under W&B's own rule,
    which drops a step lower than the run's with a warning of its own, and with
    ``shared_step=True`` to W&B step ``step``), so that a delivery no longer takes 30 s each.

    Example::

        run = wandb.init(project="demo", mode="offline", dir="runs/demo")
        sink = WandbSink(run)
        sink = WandbSink(wandb_logger.experiment, step_metric="trainer/global_step")
        sink = WandbSink(accelerator.get_tracker("wandb", unwrap=True), shared_step=True)
    """

    name = "wandb"
    key_rule = WANDB_KEYS

    def __init__(
        self,
        run: Any,
        *,
        step_metric: str | None = None,
        shared_step: bool = False,
        owned: bool = False,
        name: str | None = None,
    ) -> None:
        if not callable(getattr(run, "log", None)):
            raise TypeError(f"WandbSink needs a wandb run, got {type(run).__name__}")
        super().__init__(name=name, owned=owned)
        self.run = run
        self.shared_step = shared_step
        if shared_step:
            self.key_rule = WANDB_SHARED_KEYS  # the names go to define_metric too
        self.step_metric = SHARED_STEP_METRIC if shared_step and not step_metric else step_metric
        axis = self.step_metric
        if axis is not None:  # a metric named as the step axis is escaped, not overwritten
            self.key_rule = self.key_rule.with_reserved(axis)
        if shared_step and axis is not None and _metric_name(axis) is None:
            # no define_metric name W&B reads as this key: no key would get its x-axis
            raise ValueError(
                f"WandbSink(shared_step=True): step_metric {axis!r} ends with, or "
                "has before a '.', an odd number of '\\', which W&B's define_metric cannot name"
            )
        # shared_step: the keys given their x-axis, and the W&B row that holds the last step
        # written (and which step that was): the row a later part of that step joins, and the
        # one no other step may join
        self._declared: set[str] = set()
        self._last_row: int | None = None
        self._last_step: int | None = None
        # run.step went unanswered (W&B's 30 s timeout): not asked again (see "Dead service")
        self._step_unanswered = False
        self._lost: str | None = None  # the run's service connection broke (see there too)

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        if getattr(self.run, "_is_finished", False) is True:
            # W&B ignores a finished run's log() (UsageError), and its run.step waits 30 s
            # for a service that no longer answers, at every retry
            raise StepRefused("the W&B run is finished; W&B ignores what is logged to it")
        refuse_step_beyond_int64(step, "W&B")
        if self._lost is not None:
            raise StepRefused(self._lost)
        try:
            self._write(step, metrics)
        except ConnectionError as e:
            # W&B's client keeps the error of a broken connection to its service and raises
            # it for every later call (wandb/sdk/lib/service/service_client.py): retrying
            # cannot help, and close() waited its whole close_timeout doing so
            self._lost = (
                f"the W&B service of this run is gone ({type(e).__name__}: {e}); W&B does "
                "not reconnect a run, so what is logged to it is lost"
            )
            raise StepRefused(self._lost) from e

    def _write(self, step: int, metrics: Mapping[str, float]) -> None:
        data = dict(self.map_metrics(metrics))
        if self.shared_step:
            self._write_shared(step, data)
            return
        if self.step_metric is not None:
            data[self.step_metric] = step
            self.run.log(data)
            return
        current = self._run_step()
        if current is not None and step < current:
            raise StepRefused(f"the W&B run is already at step {current}; W&B drops step {step}")
        self.run.log(data, step=step)

    def _run_step(self) -> int | None:
        """W&B's open row: the step of the run's next ``log()`` (``None``: not known)."""
        if self._step_unanswered:
            return None
        try:
            current = self.run.step
        except TimeoutError:
            # W&B waited 30 s for its service to answer (hung or overloaded): asking at
            # every step made each delivery take 30 s (see "Dead service")
            self._step_unanswered = True
            return None
        except Exception:  # a run object without it, or W&B's "shared" mode, which raises
            return None
        return current if isinstance(current, int) else None

    def _write_shared(self, step: int, data: dict[str, float]) -> None:
        axis = self.step_metric
        assert axis is not None
        step_name = _metric_name(axis)
        for key in data.keys() - self._declared:
            name = _metric_name(key)
            if name is not None and step_name is not None:
                self.run.define_metric(name, step_metric=step_name)
            self._declared.add(key)
        data[axis] = step
        current = self._run_step()
        if current is None:  # nothing to go by: W&B's own step rule
            self.run.log(data, step=step)
            return
        # The row this step goes to: its own W&B step while the run has not reached it, else
        # the row the run has open (the loop's). W&B keeps a row open until a later step is
        # logged, and joins every log(commit=False) into it.
        row = step if step > current else current
        if row == self._last_row and step != self._last_step:
            # That row holds the previous step (the loop counts from 1: its step N is
            # trainvitals' N - 1): the next row, which the loop has not logged yet (its
            # numbers only grow); joining would overwrite the previous step's values. (The
            # rest of a step delivered in two parts joins its row; once that row is closed,
            # the open one: every part carries its step.)
            row += 1
        if row > current:
            self.run.log(data, step=row)
        else:
            self.run.log(data, commit=False)
        # The loop may have logged a later step between the read and this log, so that the
        # values joined its row: count that row as taken too.
        after = self._run_step()
        row = row if after is None else max(row, after)
        self._last_row, self._last_step = row, step

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
