"""1000 keys per step over 20 steps into every real backend at once, read back exactly.

One writer fans out to TensorBoard (float32 and float64 summaries), an MLflow SQLite store, a
Comet OfflineExperiment, a W&B offline run and a JSONL file. Values are Python floats and
float32/float64/int64/bool tensors, with NaN, +Inf and -Inf among them; a few keys need mapping
(MLflow refuses ``[``, ``]`` and ``:``; W&B reserves ``_runtime``). Each backend's files are read
back with that backend's own reader and compared with expectations computed here with numpy.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.adapters.conftest import (
    QUIET_COMET,
    offline_wandb_run,
    read_comet_archive,
    read_mlflow,
    read_tensorboard,
    read_wandb_offline,
)
from trainvitals.adapters import (
    CometSink,
    FanoutWriter,
    JsonlSink,
    MLflowSink,
    TensorBoardSink,
    WandbSink,
    read_jsonl,
)
from trainvitals.adapters.sinks.base import COMET_KEYS, MLFLOW_KEYS, WANDB_KEYS

N_KEYS = 1000
N_STEPS = 20
FLOAT_MAX = 1.7976931348623157e308


def _keys() -> list[str]:
    keys = [f"stats/layer_{i // 10}/metric_{i % 10}" for i in range(N_KEYS - 4)]
    return [*keys, "loss[0]", "ratio:a/b", "_runtime", "moe/layer_3/cv"]


def _step_values(step: int) -> tuple[dict[str, Any], dict[str, float]]:
    """What is logged at ``step`` and, independently, the float64 each value stands for."""
    rng = np.random.default_rng(step)
    keys = _keys()
    f64 = rng.standard_normal(N_KEYS) * 10.0 ** rng.integers(-30, 30, N_KEYS)
    f32 = f64.astype(np.float32)
    ints = rng.integers(-(2**50), 2**50, N_KEYS)
    logged: dict[str, Any] = {}
    expected: dict[str, float] = {}
    for i, key in enumerate(keys):
        kind = i % 5
        if kind == 0:
            logged[key], expected[key] = float(f64[i]), float(f64[i])
        elif kind == 1:
            logged[key], expected[key] = torch.from_numpy(f32[i : i + 1]).reshape(()), float(f32[i])
        elif kind == 2:
            logged[key] = torch.tensor(float(f64[i]), dtype=torch.float64)
            expected[key] = float(f64[i])
        elif kind == 3:
            logged[key], expected[key] = torch.tensor(int(ints[i])), float(int(ints[i]))
        else:
            logged[key], expected[key] = torch.tensor(bool(ints[i] % 2)), float(ints[i] % 2)
    specials = {keys[7]: math.nan, keys[8]: math.inf, keys[9]: -math.inf}
    for j, (key, v) in enumerate(specials.items()):
        logged[key] = v if (step + j) % 2 else torch.tensor(v)
        expected[key] = v
    return logged, expected


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _assert_exact(got: dict[str, dict[int, float]], expected: dict[str, dict[int, float]]) -> None:
    assert set(got) == set(expected), set(got) ^ set(expected)
    bad = [
        (k, s, got[k].get(s), v)
        for k, per_step in expected.items()
        for s, v in per_step.items()
        if s not in got[k] or not _same(got[k][s], v)
    ]
    assert not bad, f"{len(bad)} mismatches, e.g. {bad[:5]}"
    assert all(len(got[k]) == len(expected[k]) for k in expected)


def _by_key(expected_steps: list[dict[str, float]], key_map=lambda k: k, value_map=lambda v: v):
    out: dict[str, dict[int, float]] = {}
    for step, values in enumerate(expected_steps):
        for k, v in values.items():
            out.setdefault(key_map(k), {})[step] = value_map(v)
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("backends")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_DIR", str(tmp))
        mp.setenv("WANDB_CACHE_DIR", str(tmp / "wandb-cache"))
        mp.setenv("WANDB_CONFIG_DIR", str(tmp / "wandb-config"))
        mp.setenv("COMET_API_KEY", "dummy-offline-key")

        run = offline_wandb_run(tmp, "trainvitals-test")
        sinks = {
            "tb32": TensorBoardSink(tmp / "tb32"),
            "tb64": TensorBoardSink(tmp / "tb64", double_precision=True, name="tb64"),
            "mlflow": MLflowSink(run_dir=tmp / "mlflow", experiment_name="backends"),
            "comet": CometSink(offline_directory=tmp / "comet", experiment_kwargs=QUIET_COMET),
            "wandb": WandbSink(run, owned=True),
            "jsonl": JsonlSink(tmp / "metrics.jsonl"),
        }
        expected_steps = []
        writer = FanoutWriter(list(sinks.values()), rank=0, close_timeout=300)
        for step in range(N_STEPS):
            logged, expected = _step_values(step)
            writer.add_scalars(logged, step)
            expected_steps.append(expected)
        writer.close()
        status = writer.status()
    return {"tmp": tmp, "sinks": sinks, "expected": expected_steps, "status": status}


def test_every_sink_got_every_step(written) -> None:
    # one status per sink given (an empty status would pass the loop below unchecked)
    assert len(written["status"]) == len(written["sinks"])
    for name, st in written["status"].items():
        assert st["delivered"] == N_STEPS and st["missed"] == 0 and st["failures"] == 0, name


def test_tensorboard_float32_summaries(written) -> None:
    got = read_tensorboard(written["tmp"] / "tb32")
    expected = _by_key(written["expected"], value_map=lambda v: float(np.float32(v)))
    _assert_exact(got, expected)


def test_tensorboard_float64_summaries(written) -> None:
    got = read_tensorboard(written["tmp"] / "tb64")
    _assert_exact(got, _by_key(written["expected"]))


def test_mlflow_sqlite_store(written) -> None:
    from mlflow import MlflowClient

    sink = written["sinks"]["mlflow"]
    assert sink.tracking_uri == f"sqlite:///{(written['tmp'] / 'mlflow' / 'mlflow.db').resolve()}"
    client = MlflowClient(sink.tracking_uri)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED"  # the sink created the run, so it ended it
    keys = [MLFLOW_KEYS.map(k) for k in _keys()]
    assert "loss_x5b0_x5d" in keys and "ratio_x3aa/b" in keys
    assert set(run.data.metrics) == set(keys)
    got = read_mlflow(client, sink.run_id, keys)
    # MLflow's SQL store keeps NaN and stores +-Inf as +-float max
    expected = _by_key(
        written["expected"],
        key_map=MLFLOW_KEYS.map,
        value_map=lambda v: math.copysign(FLOAT_MAX, v) if math.isinf(v) else v,
    )
    _assert_exact(got, expected)


def test_comet_offline_archive(written) -> None:
    got = read_comet_archive(written["tmp"] / "comet")
    _assert_exact(got, _by_key(written["expected"]))


def test_comet_long_keys_sharing_their_start_stay_apart(tmp_path: Path) -> None:
    # Comet cuts a name over 100 characters to a plain prefix (comet_ml MAXIMAL_KEY_LENGTH), so
    # without mapping these two per-tensor keys landed in one metric, the later one winning.
    prefix = "tensor_stats/grad/" + "model.decoder.layers.11.self_attention.linear_qkv.weight/" * 2
    logged = {prefix + "rms_mean": 1.0, prefix + "abs_max": 100.0, "short/key": -2.5}
    with FanoutWriter(
        [CometSink(offline_directory=tmp_path / "comet", experiment_kwargs=QUIET_COMET)], rank=0
    ) as writer:
        for step in range(3):
            writer.add_scalars({k: v + step for k, v in logged.items()}, step)
    got = read_comet_archive(tmp_path / "comet")
    expected = {COMET_KEYS.map(k): {s: v + s for s in range(3)} for k, v in logged.items()}
    assert got == expected
    assert all(len(name) <= 100 for name in got)
    assert COMET_KEYS.map("short/key") == "short/key"


def test_wandb_offline_run(written) -> None:
    rows = read_wandb_offline(written["tmp"])
    assert [row["_step"] for row in rows] == list(range(N_STEPS))
    got: dict[str, dict[int, float]] = {}
    for row in rows:
        for k, v in row.items():
            if k not in ("_step", "_runtime", "_timestamp"):
                got.setdefault(k, {})[row["_step"]] = float(v)
    assert "_x5fruntime" in got
    _assert_exact(got, _by_key(written["expected"], key_map=WANDB_KEYS.map))


def test_jsonl_file(written) -> None:
    records = read_jsonl(written["tmp"] / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(N_STEPS))
    got: dict[str, dict[int, float]] = {}
    for r in records:
        for k, v in r["metrics"].items():
            got.setdefault(k, {})[r["step"]] = v
    _assert_exact(got, _by_key(written["expected"]))
    assert list(records[0]["metrics"]) == _keys()  # the order the keys were logged in


def test_mlflow_sink_on_an_existing_client_and_run_leaves_the_run_open(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    run_id = client.create_run(client.create_experiment("existing")).info.run_id
    keys = [f"k{i}" for i in range(1001)]  # two log_batch chunks per step
    with FanoutWriter([MLflowSink(client, run_id)], rank=0) as writer:
        for step in range(2):
            writer.add_scalars({k: float(i + step) for i, k in enumerate(keys)}, step)
    assert client.get_run(run_id).info.status == "RUNNING"
    history = read_mlflow(client, run_id, [keys[0], keys[999], keys[1000]])
    assert history == {
        keys[0]: {0: 0.0, 1: 1.0},
        keys[999]: {0: 999.0, 1: 1000.0},
        keys[1000]: {0: 1000.0, 1: 1001.0},
    }
    assert len(client.get_run(run_id).data.metrics) == 1001


def test_mlflow_sink_on_a_run_id_in_the_run_folders_store(tmp_path: Path, monkeypatch) -> None:
    # MLflowSink(run_id=..., run_dir=...) ignored run_dir and looked for the run in MLflow's
    # default store (./mlruns or MLFLOW_TRACKING_URI): every step failed on an unknown run
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)  # (MLflow's default store would be ./mlruns here)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("resumed")).info.run_id
    with FanoutWriter([MLflowSink(run_id=run_id, run_dir=run_dir)], rank=0) as writer:
        for step in range(3):
            writer.add_scalars({"loss": 1.0 / (step + 1)}, step)
    assert writer.status()["mlflow"]["missed"] == 0
    assert read_mlflow(client, run_id, ["loss"]) == {"loss": {s: 1.0 / (s + 1) for s in range(3)}}
    assert not (tmp_path / "mlruns").exists()


def test_mlflow_chunked_step_resumes_after_a_failed_chunk(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    run_id = client.create_run(client.create_experiment("resume")).info.run_id
    calls: list[int] = []
    real = client.log_batch

    def flaky_log_batch(run_id, metrics=(), **kw):
        calls.append(len(metrics))
        if len(calls) == 2:
            raise ConnectionError("lost in the middle of a step")
        return real(run_id, metrics=metrics, **kw)

    client.log_batch = flaky_log_batch  # type: ignore[method-assign]
    writer = FanoutWriter([MLflowSink(client, run_id)], rank=0, retry_backoff=(0.01, 0.01))
    with pytest.warns(RuntimeWarning, match="lost in the middle"), writer:
        writer.add_scalars({f"k{i}": float(i) for i in range(2001)}, 0)
    # chunk 1 once, chunk 2 failed then retried, chunk 3 once: no chunk sent twice
    assert calls == [1000, 1000, 1000, 1]
    assert len(client.get_run(run_id).data.metrics) == 2001


def test_sink_constructors_check_their_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run_id"):
        MLflowSink(client=object())
    with pytest.raises(ValueError, match="run_dir"):
        MLflowSink()
    with pytest.raises(ValueError, match="offline_directory"):
        CometSink()
    with pytest.raises(TypeError, match="SummaryWriter"):
        TensorBoardSink(42)


class _PlainScalarWriter:
    """A writer like tensorboardX's: add_scalar without new_style/double_precision."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, int]] = []

    def add_scalar(self, tag, scalar_value, global_step=None, walltime=None):
        self.rows.append((tag, scalar_value, global_step))

    def flush(self) -> None:
        pass


def test_tensorboard_double_precision_needs_a_writer_that_takes_it(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    plain = _PlainScalarWriter()
    with pytest.raises(ValueError, match="double_precision"):
        TensorBoardSink(plain, double_precision=True)
    sink = TensorBoardSink(plain)  # float32 through its own add_scalar works
    sink.write(3, {"a": 0.25}, 0.0)
    assert plain.rows == [("a", 0.25, 3)]
    torch_writer = SummaryWriter(tmp_path / "tb")
    try:
        TensorBoardSink(torch_writer, double_precision=True)  # torch's takes it
    finally:
        torch_writer.close()
    with pytest.raises(TypeError, match="wandb run"):
        WandbSink(object())
