"""Readers for what each backend wrote, a real ``mlflow server``, and in-memory test sinks."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from trainvitals.adapters import Sink


@pytest.fixture(autouse=True)
def _offline_backends(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep W&B and Comet offline and quiet, and every default store inside tmp_path."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("COMET_API_KEY", "dummy-offline-key")
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path / "comet"))
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'default-mlflow.db'}")
    # mlflow.set_tracking_uri (called by Lightning's MLFlowLogger) is process-global and beats
    # the environment: start every test without it, and restore it afterwards
    tracking = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if tracking is not None:
        monkeypatch.setattr(tracking, "_tracking_uri", None)


# --------------------------------------------------------------------------------------------
# in-memory sinks


class RecordingSink(Sink):
    """Records every delivered step: ``steps`` is a list of (step, {key: float}, wall_time)."""

    def __init__(self, name: str = "recording", *, thread_safe: bool = True) -> None:
        super().__init__(name=name)
        self.thread_safe = thread_safe
        self.steps: list[tuple[int, dict[str, float], float]] = []
        self.threads: set[str] = set()
        self.opened = 0
        self.closed = 0

    def open(self) -> None:
        self.opened += 1

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self.threads.add(threading.current_thread().name)
        self.steps.append((step, dict(metrics), wall_time))

    def close(self) -> None:
        self.closed += 1

    def merged(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for step, metrics, _ in self.steps:
            out.setdefault(step, {}).update(metrics)
        return out


class FlakySink(RecordingSink):
    """Raises on the first ``fail_first`` write attempts, then records like RecordingSink."""

    def __init__(self, fail_first: int, name: str = "flaky") -> None:
        super().__init__(name)
        self.fail_first = fail_first
        self.attempts = 0

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self.attempts += 1
        if self.attempts <= self.fail_first:
            raise ConnectionError(f"backend unavailable (attempt {self.attempts})")
        super().write(step, metrics, wall_time)


class HangingSink(RecordingSink):
    """Blocks in write() until ``release`` is set."""

    def __init__(self, name: str = "hanging") -> None:
        super().__init__(name)
        self.release = threading.Event()
        self.entered = threading.Event()

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self.entered.set()
        self.release.wait()
        super().write(step, metrics, wall_time)


# --------------------------------------------------------------------------------------------
# backend readers


def read_tensorboard(logdir: str | os.PathLike[str]) -> dict[str, dict[int, float]]:
    """tag -> step -> value from every event file under ``logdir`` (simple_value and tensors)."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    out: dict[str, dict[int, float]] = {}
    dirs = sorted(
        {
            os.path.dirname(p)
            for p in glob.glob(f"{logdir}/**/events.out.tfevents.*", recursive=True)
        }
    )
    for d in dirs:
        acc = ea.EventAccumulator(d, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
        acc.Reload()
        tags = acc.Tags()
        for tag in tags["scalars"]:
            for e in acc.Scalars(tag):
                out.setdefault(tag, {})[e.step] = e.value
        for tag in tags["tensors"]:
            for e in acc.Tensors(tag):
                out.setdefault(tag, {})[e.step] = float(tensor_util.make_ndarray(e.tensor_proto))
    return out


def read_mlflow(client: Any, run_id: str, keys: list[str]) -> dict[str, dict[int, float]]:
    """key -> step -> value via ``MlflowClient.get_metric_history``."""
    return {k: {m.step: m.value for m in client.get_metric_history(run_id, k)} for k in keys}


def read_comet_archive(offline_directory: str | os.PathLike[str]) -> dict[str, dict[int, float]]:
    """metricName -> step -> value from the (single) offline archive in the directory."""
    from trainvitals.adapters.jsonl import decode_value

    zips = glob.glob(os.path.join(offline_directory, "*.zip"))
    assert len(zips) == 1, zips
    out: dict[str, dict[int, float]] = {}
    with zipfile.ZipFile(zips[0]) as z:
        for line in z.read("messages.json").decode().splitlines():
            msg = json.loads(line)
            if msg.get("type") != "metric_msg":
                continue
            m = msg["payload"]["metric"]
            out.setdefault(m["metricName"], {})[m["step"]] = decode_value(m["metricValue"])
    return out


def _wandb_records(path: str) -> Any:
    """Raw records of a ``.wandb`` file.

    Format (W&B's leveldb-style log, as in wandb's former ``sdk/internal/datastore.py``): a
    7-byte header ``:W&B`` + magic ``0xBEE1`` + version, then 32 KiB blocks of records, each a
    7-byte header (crc32 uint32, length uint16, type uint8: 1 full, 2 first, 3 middle, 4 last)
    and its data; a block tail shorter than a header is zero padding.
    """
    data = Path(path).read_bytes()
    if len(data) < 7:  # the service has not written the header yet
        return
    assert data[:4] == b":W&B", data[:7]
    block, header = 32768, 7
    pos, parts = 7, b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + header : pos + header + length]
        pos += header + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            yield parts + chunk
            parts = b""


#: OfflineExperiment keyword arguments for a quiet Comet experiment that logs only what a test
#: logs (no automatic metrics, environment, git or code)
QUIET_COMET = {
    "project_name": "trainvitals-test",
    "auto_metric_logging": False,
    "auto_param_logging": False,
    "auto_output_logging": False,
    "log_env_details": False,
    "log_git_metadata": False,
    "log_git_patch": False,
    "log_env_gpu": False,
    "log_env_host": False,
    "log_env_cpu": False,
    "log_code": False,
    "display_summary_level": 0,
}


def offline_wandb_run(run_dir: str | os.PathLike[str], project: str = "tv") -> Any:
    """A W&B run in offline mode under ``run_dir``, quiet and without system stats."""
    import wandb

    return wandb.init(
        mode="offline",
        dir=str(run_dir),
        project=project,
        settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
    )


def read_wandb_offline(
    wandb_dir: str | os.PathLike[str], timeout: float = 60.0
) -> list[dict[str, float]]:
    """The history rows of the (single) offline run under ``wandb_dir``, JSON-decoded.

    ``run.finish()`` returns before wandb's service has written the whole ``.wandb`` file: read
    until its ``exit`` record is there (a record being written reads as corrupt: read again).
    """
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout
    while True:
        pattern = os.path.join(wandb_dir, "**", "offline-run-*", "run-*.wandb")
        files = glob.glob(pattern, recursive=True)
        assert len(files) <= 1, files
        rows, finished = [], False
        for raw in _wandb_records(files[0]) if files else ():
            rec = pb.Record()
            try:
                rec.ParseFromString(raw)
            except DecodeError:  # the service is writing this record: no exit record yet
                break
            kind = rec.WhichOneof("record_type")
            finished = finished or kind == "exit"
            if kind == "history":
                row = {}
                for item in rec.history.item:
                    # flat keys are in `key` or (recent wandb) a one-element `nested_key`
                    key = item.key or ".".join(item.nested_key)
                    row[key] = json.loads(item.value_json)
                rows.append(row)
        if finished:
            return rows
        assert time.monotonic() < deadline, "the W&B run file has no exit record"
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# a real mlflow server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with a SQLite store; start(), stop(), start() again."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.db = workdir / "server.db"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 150.0) -> None:
        log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 - owned by the process
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "mlflow", "server",
                "--backend-store-uri", f"sqlite:///{self.db}",
                "--default-artifact-root", str(self.workdir / "artifacts"),
                "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            ],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, env=env,
            start_new_session=True,  # its own process group: stop() ends uvicorn with it
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.workdir / "server.log").read_text()[-2000:]
                raise RuntimeError(f"mlflow server exited: {tail}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1).read()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError("mlflow server did not start")

    def stop(self) -> None:
        """Kill the server and its workers at once (a crash, as far as clients can tell)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None


@pytest.fixture
def mlflow_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # one attempt per request, short timeout: the writer's own retry is what is under test
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    server = MlflowServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
