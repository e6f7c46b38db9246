"""MLflow sink: one ``log_batch`` per 1000 metrics of a step."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainvitals.adapters.sinks.base import MLFLOW_KEYS, Sink

__all__ = ["MLFLOW_BATCH_LIMIT", "MLflowSink"]

#: ``mlflow.utils.validation.MAX_METRICS_PER_BATCH``: metrics per ``log_batch`` call.
MLFLOW_BATCH_LIMIT = 1000


class MLflowSink(Sink):
    """Write each step to an MLflow run through ``MlflowClient.log_batch``.

    Three ways to say where:

    * ``MLflowSink(client, run_id)``: an existing ``MlflowClient`` and run (what Lightning's
      ``MLFlowLogger`` holds as ``.experiment`` and ``.run_id``). The run is left open.
    * ``MLflowSink(run_id=..., tracking_uri=...)``: an existing run in a tracking store (the
      URI defaults to ``sqlite:///<run_dir>/mlflow.db`` when ``run_dir`` is given, else to
      MLflow's own default). The run is left open.
    * ``MLflowSink(run_dir="runs/demo")`` or ``MLflowSink(tracking_uri=...)``: the sink creates
      a run (in ``experiment_name``, named ``run_name``) in the store, by default
      ``sqlite:///<run_dir>/mlflow.db``, on its first delivery, and ends it when the writer
      closes (``FINISHED``; ``FAILED`` after an exception: ``close(failed=True)``; ``KILLED``,
      MLflow's "run killed by user", after ``KeyboardInterrupt``: ``close(interrupted=True)``).
      Its id is :attr:`run_id` from then on.

    A step of N metrics is sent as ceil(N / 1000) ``log_batch`` calls (MLflow's limit per call).
    A retried step resumes after the last chunk that went through (and MLflow's SQL store
    ignores an exact duplicate anyway). Keys MLflow refuses are mapped by
    :data:`~trainvitals.adapters.sinks.base.MLFLOW_KEYS`.

    Non-finite values: MLflow's SQL store keeps NaN (read back as NaN) and stores +-Inf as
    +-1.7976931348623157e308 (``sys.float_info.max``), which ``get_metric_history`` returns;
    over HTTP the same happens on the server. Treat +-``sys.float_info.max`` from MLflow as
    +-Inf.

    Every ``log_batch`` is synchronous, also under ``MLFLOW_ENABLE_ASYNC_LOGGING``: a step
    counts as delivered only once MLflow has stored it.

    Over HTTP, MLflow's own client retries a failed request (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
    ``MLFLOW_HTTP_REQUEST_TIMEOUT``) inside one ``log_batch`` call before the writer sees the
    failure; the writer's retry and hang detection (``sink_timeout``) come on top.

    Example::

        sink = MLflowSink(run_dir="runs/demo", experiment_name="demo")
        sink = MLflowSink(mlflow_logger.experiment, mlflow_logger.run_id)
    """

    name = "mlflow"
    key_rule = MLFLOW_KEYS

    def __init__(
        self,
        client: Any = None,
        run_id: str | None = None,
        *,
        tracking_uri: str | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        experiment_name: str = "trainvitals",
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> None:
        if client is not None and run_id is None:
            raise ValueError("MLflowSink(client=...) needs the run_id of the run to write to")
        if client is None and run_id is None and tracking_uri is None and run_dir is None:
            raise ValueError(
                "MLflowSink needs a client and run_id, a run_id, a tracking_uri or a run_dir"
            )
        creates_run = run_id is None
        super().__init__(name=name, owned=creates_run)
        self.client = client
        self.run_id = run_id
        if tracking_uri is None and run_dir is not None:
            # (also with run_id: that run is in the run folder's store, not the default one)
            tracking_uri = f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"
        self.tracking_uri = tracking_uri
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = dict(tags or {})
        # (the metrics object of a step that failed part-way, chunks of it already logged)
        self._resume: tuple[Any, int] = (None, 0)

    def open(self) -> None:
        if self.client is None:
            from mlflow import MlflowClient

            if self.run_dir is not None:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
        if self.run_id is None:
            experiment = self.client.get_experiment_by_name(self.experiment_name)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                experiment_id = self.client.create_experiment(self.experiment_name)
            run = self.client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
            self.run_id = run.info.run_id

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        if self.client is None or self.run_id is None:
            self.open()
        from mlflow.entities import Metric

        timestamp = int(wall_time * 1000)
        key = self.map_key
        entities = [Metric(key(k), v, timestamp, step) for k, v in metrics.items()]
        resumed, done_chunks = self._resume
        first = done_chunks if resumed is metrics else 0
        for i, start in enumerate(range(0, len(entities), MLFLOW_BATCH_LIMIT)):
            if i < first:
                continue
            # synchronous=True: under MLFLOW_ENABLE_ASYNC_LOGGING (or
            # mlflow.config.enable_async_logging) log_batch would only queue the chunk and a
            # failed chunk would count as delivered; the writer already delivers in background.
            self.client.log_batch(
                self.run_id,
                metrics=entities[start : start + MLFLOW_BATCH_LIMIT],
                synchronous=True,
            )
            self._resume = (metrics, i + 1)
        self._resume = (None, 0)

    def close(self) -> None:
        if self.owned and self.client is not None and self.run_id is not None:
            if self.run_interrupted:
                status = "KILLED"
            else:
                status = "FAILED" if self.run_failed else "FINISHED"
            self.client.set_terminated(self.run_id, status)
