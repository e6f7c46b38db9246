"""MLflow sink: one ``log_batch`` per 1000 metrics of a step."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from trainvitals.adapters.sinks.base import (
    MLFLOW_KEYS,
    Sink,
    make_folder,
    refuse_step_beyond_int64,
    warn,
)

__all__ = ["MLFLOW_BATCH_LIMIT", "MLFLOW_RUN_ID_FILE", "MLflowSink"]

#: ``mlflow.utils.validation.MAX_METRICS_PER_BATCH``: metrics per ``log_batch`` call.
MLFLOW_BATCH_LIMIT = 1000

#: The file in ``run_dir`` where ``MLflowSink(run_dir=...)`` records the id of the run it
#: created, to continue that run when the training resumes in the same ``run_dir``.
MLFLOW_RUN_ID_FILE = "mlflow_run_id.txt"


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

    Resuming in the same ``run_dir`` continues the same run (as Lightning's ``MLFlowLogger``
    with ``run_id=`` and W&B's ``resume=`` do), so that a resumed job's curves are one run,
    not two. ``MLflowSink(run_dir=...)`` records the id of the run it creates in
    ``<run_dir>/mlflow_run_id.txt`` (:data:`MLFLOW_RUN_ID_FILE`). A later sink on that
    ``run_dir`` whose run resumes, that is whose resume step is above 0, reopens that run
    (status ``RUNNING`` again, as ``mlflow.start_run(run_id=...)`` does) and logs into it,
    provided the run is still in the store, not deleted, and in ``experiment_name``; else it
    creates a new run and records that one. The resume step is the one given to
    :meth:`FanoutWriter.resume_at` (the checkpoint's step), or, when the run did not say, the
    first step the sink writes (or the lower of the two), as for
    :class:`~trainvitals.adapters.JsonlSink`: a run starting at step 0 is a new run and gets
    a new MLflow run (a new job not telling ``resume_at(0)`` whose first step is above 0
    continues the recorded run: tell it, or pass ``resume=False``). A continued run keeps its
    name and tags (``run_name=`` and ``tags=`` apply to a run this sink creates).
    ``resume=False`` creates a new run each time. MLflow keeps every point
    it was given: steps that an interrupted job logged after its checkpoint stay in the
    history beside the resumed job's values of the same steps (MLflow has no call to delete
    points); the resumed values have the later timestamps. So the run's "latest" value of a
    metric (the runs table, ``run.data.metrics``, ``search_runs(order_by=["metrics.x"])``),
    which MLflow's SQL store takes from the point of highest ``(step, timestamp, value)``,
    stays the interrupted job's last value until the resumed job logs that metric at that step
    or a later one: a job killed at step 1900 and resumed from step 1000 shows its abandoned
    step 1900 as the run's value while the resumed job is between steps 1000 and 1899, and for
    good when it ends before step 1900. Where runs are compared by their latest values, pass
    ``resume=False``: the resumed job gets a new run (its history from the resume step on; the
    earlier steps stay in the first run). With ``tracking_uri`` and no
    ``run_dir`` there is no folder to record the id in: each sink creates a run (pass
    ``run_id=`` to continue a known one).

    A step of N metrics is sent as ceil(N / 1000) ``log_batch`` calls (MLflow's limit per call).
    A retried step resumes after the last chunk that went through (and MLflow's SQL store
    ignores an exact duplicate anyway). Keys MLflow refuses are mapped by
    :data:`~trainvitals.adapters.sinks.base.MLFLOW_KEYS`.

    Non-finite values: MLflow's SQL store keeps NaN (read back as NaN) and stores +-Inf as
    +-1.7976931348623157e308 (``sys.float_info.max``), which ``get_metric_history`` returns;
    over HTTP the same happens on the server. Treat +-``sys.float_info.max`` from MLflow as
    +-Inf. A step above ``2**63 - 1`` (MLflow's ``step`` is an int64) is refused
    (:class:`~trainvitals.adapters.StepRefused`).

    A deleted experiment ``experiment_name`` (MLflow refuses new runs in it) or a run deleted
    while the sink logs to it (MLflow refuses its points) cannot take anything: the sink raises
    a ``PermissionError`` naming it, which has the writer disable the sink at once (one
    warning) instead of retrying it until ``close()`` ran out of ``close_timeout``.

    Arguments MLflow would refuse at the first delivery are a ``TypeError`` when the sink is
    built: a ``run_id`` that is not a non-empty string, ``tags`` that are neither a mapping nor
    key-value pairs, and, when the sink creates its run, an ``experiment_name`` that is not a
    non-empty string (a ``run_name`` or tag of another type is stored as its text, as MLflow
    does).

    Every ``log_batch`` is synchronous, also under ``MLFLOW_ENABLE_ASYNC_LOGGING``: a step
    counts as delivered only once MLflow has stored it.

    Over HTTP, MLflow's own client retries a failed request (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
    ``MLFLOW_HTTP_REQUEST_TIMEOUT``) inside one ``log_batch`` call before the writer sees the
    failure; the writer's retry and hang detection (``sink_timeout``) come on top.

    Example::

        sink = MLflowSink(run_dir="runs/demo", experiment_name="demo")
        sink = MLflowSink(run_dir="runs/demo", resume=False)   # a new run even on a resume
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
        resume: bool = True,
        name: str | None = None,
    ) -> None:
        if client is not None and run_id is None:
            raise ValueError("MLflowSink(client=...) needs the run_id of the run to write to")
        if client is None and run_id is None and tracking_uri is None and run_dir is None:
            raise ValueError(
                "MLflowSink needs a client and run_id, a run_id, a tracking_uri or a run_dir"
            )
        # Checked here, in the caller's thread, what MLflow refuses at the first delivery (the
        # writer retried it until close() gave up: a run's end held for close_timeout); what
        # MLflow takes as text (a run_name or tag of another type) is left to it.
        if run_id is None and (not isinstance(experiment_name, str) or not experiment_name.strip()):
            raise TypeError(f"experiment_name must be a non-empty str, got {experiment_name!r}")
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise TypeError(f"run_id must be a non-empty str or None, got {run_id!r}")
        try:
            tags = dict(tags or {})
        except (TypeError, ValueError):
            raise TypeError(f"tags must be a mapping (or key, value pairs), got {tags!r}") from None
        creates_run = run_id is None
        super().__init__(name=name, owned=creates_run)
        self.client = client
        self.run_id = run_id
        if tracking_uri is None and run_dir is not None:
            # (also with run_id: that run is in the run folder's store, not the default one)
            database = str(Path(run_dir).resolve() / "mlflow.db")
            # SQLAlchemy decodes "%XX" and cuts at "?" in the URI's path: escape those two
            # only (MLflow makes the folder from the URI undecoded, so escaping anything else,
            # a space, would leave it an empty "my%20runs" beside "my runs")
            tracking_uri = "sqlite:///" + database.replace("%", "%25").replace("?", "%3F")
        self.tracking_uri = tracking_uri
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = tags
        self.resume = resume
        # where the id of the run this sink creates is recorded (and read back on a resume)
        self._run_id_file = (
            self.run_dir / MLFLOW_RUN_ID_FILE if creates_run and self.run_dir is not None else None
        )
        self._resume_step: int | None = None  # from FanoutWriter.resume_at
        # (the metrics object of a step that failed part-way, chunks of it already logged)
        self._resume: tuple[Any, int] = (None, 0)

    def resume_at(self, step: int) -> None:
        self._resume_step = step

    def open(self) -> None:
        # The run itself is created (or reopened) by the first write, which knows its step.
        if self.client is None:
            from mlflow import MlflowClient

            if self.run_dir is not None:
                make_folder(self.run_dir)
            database = _sqlite_file(self.tracking_uri)
            if database is not None:
                # Before MLflow opens it: a store that cannot be written raises here, with an
                # errno that has the writer disable the sink at once. MLflow itself retried
                # opening it for 101 s (10 tries, create_sqlalchemy_engine_with_retry) in every
                # write, so the writer reported the sink as hung and close() waited its whole
                # close_timeout instead of saying which folder cannot be written.
                make_folder(database.parent)
                _check_writable(database)
            self.client = MlflowClient(tracking_uri=self.tracking_uri)

    def _start_run(self, first_step: int) -> None:
        """Reopen the run recorded in ``run_dir`` when this run resumes, else create one."""
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is not None and experiment.lifecycle_stage != "active":
            # MLflow refuses a run in a deleted experiment ("must be in the 'active' state") at
            # every retry, and cannot make another experiment of that name until it is purged
            # (mlflow.set_experiment refuses it too): an errno the writer does not retry, so
            # that close() does not wait its close_timeout for a sink that cannot work.
            raise PermissionError(
                errno.EPERM,
                f"the MLflow experiment {self.experiment_name!r} (id {experiment.experiment_id})"
                " is deleted; restore it (`mlflow experiments restore`) or give MLflowSink "
                "another experiment_name",
                self._store_uri(),
            )
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self.client.create_experiment(self.experiment_name)
        resume_step = (
            first_step if self._resume_step is None else min(first_step, self._resume_step)
        )
        run_id = None
        if self.resume and resume_step > 0:
            run_id = self._recorded_run(experiment_id)
        if run_id is not None:
            # what mlflow.start_run(run_id=...) does to resume a run: RUNNING again
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        run = self.client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        if self._run_id_file is not None:
            try:  # whole or not at all: a crash must not leave half an id
                tmp = self._run_id_file.with_name(self._run_id_file.name + ".tmp")
                tmp.write_text(self.run_id + "\n", encoding="utf-8")
                os.replace(tmp, self._run_id_file)
            except OSError as e:  # the run is there; only a later resume will not find it
                message = (
                    f"MLflowSink: could not record the run id in {self._run_id_file}: {e!r}; "
                    "a resumed run will create a new MLflow run"
                )
                warn(message)  # never raises: warnings as errors must not fail the write

    def _recorded_run(self, experiment_id: str) -> str | None:
        """The run recorded in ``run_dir``, if it is in the store, active and in the
        experiment; ``None`` otherwise (raises when the store cannot be asked)."""
        if self._run_id_file is None:
            return None
        try:
            run_id = self._run_id_file.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        if not run_id:
            return None
        try:
            run = self.client.get_run(run_id)
        except Exception as e:
            if getattr(e, "error_code", None) in (
                "RESOURCE_DOES_NOT_EXIST",
                "INVALID_PARAMETER_VALUE",
            ):
                return None  # a store made anew, or a file that is not ours
            raise
        info = run.info
        if info.lifecycle_stage != "active" or info.experiment_id != experiment_id:
            return None
        return run_id

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        refuse_step_beyond_int64(step, "MLflow")
        try:
            self._write(step, metrics, wall_time)
        except Exception as e:
            # MLflow's SQLite store reports a store that cannot be written as an MlflowException
            # over sqlalchemy's OperationalError ("attempt to write a readonly database",
            # "unable to open database file"), which says nothing of why: the writer retried
            # it as transient for about two minutes. Ask the file system what SQLite met.
            database = _sqlite_file(self._store_uri())
            if database is not None and database.is_file():
                try:
                    _check_writable(database)
                except OSError as why:
                    raise why from e
            if getattr(e, "error_code", None) == "INVALID_PARAMETER_VALUE":
                self._raise_if_run_deleted(e)
            raise

    def _raise_if_run_deleted(self, error: Exception) -> None:
        """A run deleted while it was logged to (in the UI, ``mlflow runs delete``): MLflow
        refuses its every ``log_batch`` ("must be in the 'active' state"), which the writer
        retried until ``close()`` gave up after its whole ``close_timeout``. Raise an errno
        the writer does not retry instead."""
        run_id = self.run_id
        if run_id is None or self.client is None:
            return
        try:
            stage = self.client.get_run(run_id).info.lifecycle_stage
        except Exception:  # (the store cannot say: the original error stands)
            return
        if stage != "active":
            raise PermissionError(
                errno.EPERM,
                f"the MLflow run {run_id} is {stage}; MLflow takes nothing more for it "
                "(restore it to log to it again)",
                self._store_uri(),
            ) from error

    def _store_uri(self) -> str | None:
        if self.tracking_uri is not None:
            return self.tracking_uri
        tracking = getattr(self.client, "_tracking_client", None)  # a client passed in
        uri = getattr(tracking, "tracking_uri", None)
        return uri if isinstance(uri, str) else None

    def _write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        if self.client is None:
            self.open()
        if self.run_id is None:
            self._start_run(step)
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


def _sqlite_file(uri: str | None) -> Path | None:
    """The database file of an SQLite tracking URI (``sqlite:///``, ``sqlite+pysqlite:///``),
    the file SQLAlchemy opens (it decodes ``%20`` and drops the query); ``None`` for any other
    store, an in-memory database or an SQLite ``file:`` URI."""
    if not uri or not uri.startswith("sqlite"):
        return None
    try:  # MLflow opens its SQL stores through SQLAlchemy: read the URI as it does
        from sqlalchemy.engine import make_url

        url = make_url(uri)
        database = url.database if url.get_backend_name() == "sqlite" else None
        uri_mode = "uri" in url.query
    except ImportError:  # (no SQLAlchemy: MLflow cannot open an SQL store either)
        if not uri.startswith("sqlite:///"):
            return None
        database, _, query = uri.removeprefix("sqlite:///").partition("?")
        database, uri_mode = unquote(database), "uri=" in query
    except Exception:  # a URI SQLAlchemy refuses: MLflow will say so itself
        return None
    if not database or database == ":memory:" or database.startswith("file:") or uri_mode:
        return None
    return Path(database).absolute()


def _check_writable(database: Path) -> None:
    """Raise the ``OSError`` SQLite meets when it writes ``database``: the file must open for
    reading and writing (it is made when missing; an empty file is an empty SQLite database),
    and its folder must take a new file (SQLite's rollback journal is made beside it)."""
    with open(database, "ab"):
        pass
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{database.name}-", dir=database.parent)
    except OSError as e:  # (it named the random file name: name the folder)
        raise type(e)(e.errno, e.strerror, str(database.parent)) from None
    os.close(fd)
    os.unlink(probe)
