"""FanoutWriter semantics with in-memory sinks: step batching, values, bad input, ranks, closing."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from tests.adapters.conftest import (
    RecordingSink,
    offline_wandb_run,
    read_comet_archive,
    read_wandb_offline,
)
from trainvitals.adapters import FanoutWriter, JsonlSink, TensorBoardSink, read_jsonl


@pytest.fixture(params=[True, False], ids=["background", "inline"])
def background(request: pytest.FixtureRequest) -> bool:
    return request.param


def test_step_is_delivered_when_a_larger_step_arrives_or_on_flush(background: bool) -> None:
    sink = RecordingSink()
    writer = FanoutWriter([sink], rank=0, background=background)
    writer.add_scalar("a", 1.0, 0)
    writer.add_scalar("b", 2.0, 0)
    writer.add_scalar("a", 3.0, 1)  # closes step 0
    writer.add_scalars({"b": 4.0, "c": 5.0}, 1)
    assert writer.flush() is True
    writer.add_scalar("a", 6.0, 3)
    writer.close()
    assert [(s, m) for s, m, _ in sink.steps] == [
        (0, {"a": 1.0, "b": 2.0}),
        (1, {"a": 3.0, "b": 4.0, "c": 5.0}),
        (3, {"a": 6.0}),
    ]


def test_open_step_is_not_delivered_before_flush() -> None:
    sink = RecordingSink()
    writer = FanoutWriter([sink], rank=0)
    writer.add_scalar("a", 1.0, 5)
    # the step is open until a larger step, flush() or close(): no delivery can have happened
    assert writer.status()["recording"]["delivered"] == 0
    assert sink.steps == []
    writer.close()
    assert [(s, m) for s, m, _ in sink.steps] == [(5, {"a": 1.0})]


def test_same_key_twice_in_a_step_keeps_the_last_value_and_first_position() -> None:
    sink = RecordingSink()
    with FanoutWriter([sink], rank=0) as writer:
        writer.add_scalar("x", 1.0, 2)
        writer.add_scalar("y", torch.tensor(2.0), 2)
        writer.add_scalar("x", torch.tensor(3.0), 2)
        writer.add_scalar("y", 4.0, 2)
    ((step, metrics, _),) = sink.steps
    assert step == 2 and metrics == {"x": 3.0, "y": 4.0}
    assert list(metrics) == ["x", "y"]


def test_same_step_after_flush_is_a_second_batch_of_that_step() -> None:
    sink = RecordingSink()
    path_writer = FanoutWriter([sink], rank=0)
    path_writer.add_scalar("a", 1.0, 7)
    path_writer.flush()
    path_writer.add_scalar("b", 2.0, 7)
    path_writer.close()
    assert [(s, m) for s, m, _ in sink.steps] == [(7, {"a": 1.0}), (7, {"b": 2.0})]


def test_values_of_every_accepted_type_arrive_exactly() -> None:
    sink = RecordingSink()
    big_int = 2**40 + 1  # not representable in float32: must not be promoted through it
    values = {
        "py_float": 0.1,
        "py_int": 7,
        "py_bool": True,
        "np_float32": np.float32(1.1),
        "np_float64": np.float64(2.2),
        "np_int64": np.int64(-5),
        "np_bool": np.bool_(False),
        "np_0d": np.array(3.25),
        "np_1elem": np.array([4.5], dtype=np.float16),
        "t_float32": torch.tensor(1.1),
        "t_float64": torch.tensor(0.1, dtype=torch.float64),
        "t_bf16": torch.tensor(1.1, dtype=torch.bfloat16),
        "t_int64": torch.tensor(big_int),
        "t_int32": torch.tensor(-3, dtype=torch.int32),
        "t_bool": torch.tensor(True),
        "t_shape_1x1": torch.tensor([[2.5]]),
        "t_requires_grad": torch.tensor(1.5, requires_grad=True) * 2,
        "t_param": torch.nn.Parameter(torch.tensor([0.3])),
    }
    expected = {
        "py_float": 0.1,
        "py_int": 7.0,
        "py_bool": 1.0,
        "np_float32": float(np.float32(1.1)),
        "np_float64": 2.2,
        "np_int64": -5.0,
        "np_bool": 0.0,
        "np_0d": 3.25,
        "np_1elem": 4.5,
        "t_float32": float(np.float32(1.1)),
        "t_float64": 0.1,
        "t_bf16": 1.1015625,  # bfloat16 nearest to 1.1 (8 bits of mantissa)
        "t_int64": float(big_int),
        "t_int32": -3.0,
        "t_bool": 1.0,
        "t_shape_1x1": 2.5,
        "t_requires_grad": 3.0,
        "t_param": float(np.float32(0.3)),
    }
    with FanoutWriter([sink], rank=0) as writer:
        writer.add_scalars(values, 0)
    ((_, metrics, _),) = sink.steps
    assert metrics == expected
    assert all(type(v) is float for v in metrics.values())


def test_integer_tensors_are_not_rounded_through_a_float32_neighbour() -> None:
    # torch.stack would promote int64 + float32 to float32 (2**40 + 1 -> 2**40)
    sink = RecordingSink()
    with FanoutWriter([sink], rank=0) as writer:
        writer.add_scalars({"tokens": torch.tensor(2**40 + 1), "loss": torch.tensor(0.5)}, 0)
    assert sink.steps[0][1] == {"tokens": float(2**40 + 1), "loss": 0.5}


def test_non_finite_values_pass_through(background: bool) -> None:
    sink = RecordingSink()
    with FanoutWriter([sink], rank=0, background=background) as writer:
        writer.add_scalars(
            {"nan": float("nan"), "inf": torch.tensor(float("inf")), "ninf": -np.inf}, 0
        )
    ((_, m, _),) = sink.steps
    assert math.isnan(m["nan"]) and m["inf"] == math.inf and m["ninf"] == -math.inf


def test_tensors_are_read_at_delivery_and_never_item_per_value(monkeypatch) -> None:
    """Values of a step go to the host batched: no Tensor.item()/__float__ per value."""
    calls = []
    original_item = torch.Tensor.item

    def spy_item(self):
        calls.append(1)
        return original_item(self)

    monkeypatch.setattr(torch.Tensor, "item", spy_item)
    monkeypatch.setattr(torch.Tensor, "__float__", lambda self: calls.append(1) or 0.0)
    sink = RecordingSink()
    with FanoutWriter([sink], rank=0) as writer:
        for step in range(3):
            writer.add_scalars({f"k{i}": torch.tensor(float(i * step)) for i in range(50)}, step)
    assert calls == []
    assert [m for _, m, _ in sink.steps] == [
        {f"k{i}": float(i * s) for i in range(50)} for s in range(3)
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_arrive_exactly() -> None:  # pragma: no cover - no GPU in CI
    sink = RecordingSink()
    values = torch.randn(100, device="cuda")
    expected = {f"k{i}": float(v) for i, v in enumerate(values.cpu().tolist())}
    with FanoutWriter([sink], rank=0) as writer:
        writer.add_scalars({f"k{i}": values[i] * 1 for i in range(100)}, 0)
        writer.add_scalar("int", torch.tensor(2**40 + 1, device="cuda"), 0)
    ((_, m, _),) = sink.steps
    assert m == {**expected, "int": float(2**40 + 1)}


# ---- bad input


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("", 1.0, ValueError, "non-empty"),
        ("   ", 1.0, ValueError, "non-empty"),
        (3, 1.0, TypeError, "must be a str"),
        ("loss", "1.0", TypeError, "'loss'"),
        ("loss", None, TypeError, "'loss'"),
        ("loss", [1.0], TypeError, "'loss'"),
        ("loss", 1 + 2j, TypeError, "'loss'"),
        ("loss", np.complex64(1), TypeError, "'loss'"),
        ("vec", torch.ones(3), ValueError, "'vec'.*3 elements"),
        ("empty", torch.ones(0), ValueError, "'empty'.*0 elements"),
        ("arr", np.ones(2), ValueError, "'arr'"),
        ("cplx", torch.tensor(1 + 1j), TypeError, "'cplx'"),
        ("meta", torch.empty((), device="meta"), ValueError, "'meta'"),
        ("huge", 10**400, ValueError, "'huge'"),
    ],
)
def test_bad_values_and_keys_raise_naming_the_key(key, value, error, match) -> None:
    sink = RecordingSink()
    writer = FanoutWriter([sink], rank=0)
    with pytest.raises(error, match=match):
        writer.add_scalar(key, value, 0)
    with pytest.raises(error, match=match):
        writer.add_scalars({"ok": 1.0, key: value}, 0)
    writer.add_scalar("good", 2.0, 0)
    writer.close()
    # nothing of the failed calls was logged, not even the valid entry of add_scalars
    assert [(s, m) for s, m, _ in sink.steps] == [(0, {"good": 2.0})]


@pytest.mark.parametrize(
    ("step", "error", "match"),
    [
        (-1, ValueError, ">= 0"),
        (1.0, TypeError, "int"),
        (True, TypeError, "int"),
        ("3", TypeError, "int"),
        (torch.tensor(3), TypeError, "int"),
        (None, TypeError, "needs a step"),
    ],
)
def test_bad_steps_raise(step, error, match) -> None:
    writer = FanoutWriter([RecordingSink()], rank=0)
    with pytest.raises(error, match=match):
        writer.add_scalar("a", 1.0, step)
    with pytest.raises(error, match=match):
        writer.add_scalars({"a": 1.0}, step)
    writer.close()


def test_numpy_integer_steps_are_accepted() -> None:
    sink = RecordingSink()
    with FanoutWriter([sink], rank=0) as writer:
        writer.add_scalar("a", 1.0, np.int64(4))
    assert sink.steps[0][0] == 4 and type(sink.steps[0][0]) is int


def test_decreasing_step_raises_and_keeps_the_current_step(background: bool) -> None:
    sink = RecordingSink()
    writer = FanoutWriter([sink], rank=0, background=background)
    writer.add_scalar("a", 1.0, 5)
    with pytest.raises(ValueError, match=r"step 4 for key 'b' is lower than step 5"):
        writer.add_scalar("b", 2.0, 4)
    with pytest.raises(ValueError, match="lower than step 5"):
        writer.add_scalars({"b": 2.0}, 3)
    writer.flush()
    with pytest.raises(ValueError, match="lower than step 5"):
        writer.add_scalar("b", 2.0, 4)  # also after the step was delivered
    writer.add_scalar("c", 3.0, 5)
    writer.close()
    assert [(s, m) for s, m, _ in sink.steps] == [(5, {"a": 1.0}), (5, {"c": 3.0})]


def test_summary_writer_call_forms() -> None:
    sink = RecordingSink()
    with FanoutWriter([sink], rank=0) as writer:
        writer.add_scalar("a", 1.0, global_step=3)
        writer.add_scalars("loss", {"train": 1.5, "val": 2.5}, 3)
        writer.add_scalars("lr", {"g0": 0.1}, global_step=3)
        writer.add_scalar("w", 4.0, 3, walltime=1234.5)
    ((step, metrics, wall),) = sink.steps
    assert step == 3
    assert metrics == {"a": 1.0, "loss/train": 1.5, "loss/val": 2.5, "lr/g0": 0.1, "w": 4.0}
    assert wall != 1234.5  # walltime only sets the time of a step's first value
    sink2 = RecordingSink()
    with FanoutWriter([sink2], rank=0) as writer:
        writer.add_scalar("w", 4.0, 0, walltime=1234.5)
    assert sink2.steps[0][2] == 1234.5


def test_wall_time_is_the_time_of_the_steps_first_value() -> None:
    import time

    sink = RecordingSink()
    with FanoutWriter([sink], rank=0) as writer:
        before = time.time()
        writer.add_scalar("a", 1.0, 0)
        after = time.time()
        writer.add_scalar("b", 1.0, 0)
    assert before <= sink.steps[0][2] <= after


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 1e300, "12.5", True])
def test_a_bad_walltime_raises_in_the_caller_and_the_sinks_keep_every_step(tmp_path, bad) -> None:
    # A NaN, infinite or negative walltime= used to be stored as the step's time: the JSONL
    # sink (JSON has no NaN) and MLflow (int64 milliseconds >= 0) failed on every retry of
    # that step and were switched off after max_failures, missing every later step too.
    from mlflow import MlflowClient

    from trainvitals.adapters import MLflowSink

    sinks = [JsonlSink(tmp_path / "m.jsonl"), MLflowSink(run_dir=tmp_path / "ml")]
    writer = FanoutWriter(sinks, rank=0, max_failures=2, retry_backoff=(0.01, 0.01))
    with writer:
        writer.add_scalar("a", 0.5, 0, walltime=1_700_000_000.25)
        with pytest.raises((TypeError, ValueError), match="walltime"):
            writer.add_scalar("a", 1.0, 1, walltime=bad)
        with pytest.raises((TypeError, ValueError), match="walltime"):
            writer.add_scalars({"b": 1.0}, 1, walltime=bad)
        for step in range(1, 4):
            writer.add_scalar("a", float(step), step)
    for name, st in writer.status().items():
        assert (st["delivered"], st["missed"], st["failures"]) == (4, 0, 0), name
    records = read_jsonl(tmp_path / "m.jsonl")
    assert [(r["step"], r["metrics"]) for r in records] == [
        (s, {"a": 0.5 if s == 0 else float(s)}) for s in range(4)
    ]
    assert records[0]["time"] == 1_700_000_000.25
    history = MlflowClient(sinks[1].tracking_uri).get_metric_history(sinks[1].run_id, "a")
    assert [(m.step, m.value) for m in history] == [(0, 0.5), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert history[0].timestamp == 1_700_000_000_250


# ---- ranks


def test_nonzero_rank_checks_input_but_delivers_and_opens_nothing(tmp_path) -> None:
    sink = RecordingSink()
    jsonl = JsonlSink(tmp_path / "rank1.jsonl")
    tb = TensorBoardSink(tmp_path / "tb")
    writer = FanoutWriter([sink, jsonl, tb], rank=1)
    writer.add_scalar("a", torch.tensor(1.0), 0)
    writer.add_scalars({"b": 2.0}, 1)
    with pytest.raises(ValueError, match="'v'"):
        writer.add_scalar("v", torch.ones(2), 1)  # the same error as on rank 0
    with pytest.raises(ValueError, match="lower"):
        writer.add_scalar("a", 1.0, 0)
    assert writer.flush() is True
    writer.close()
    assert sink.steps == [] and sink.opened == 0
    assert not (tmp_path / "rank1.jsonl").exists() and not (tmp_path / "tb").exists()
    assert writer.status() == {}


def test_rank_defaults_to_the_global_rank(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "3")
    assert FanoutWriter([RecordingSink()]).rank == 3
    monkeypatch.setenv("RANK", "0")
    assert FanoutWriter([RecordingSink()]).rank == 0


@pytest.mark.timeout(120)
def test_only_global_rank_zero_writes_with_two_gloo_processes(tmp_path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
        from trainvitals.adapters import FanoutWriter, JsonlSink

        def main(rank):
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
            dist.init_process_group("gloo", rank=rank, world_size=2)
            writer = FanoutWriter([JsonlSink(f"{tmp_path}/rank{{rank}}.jsonl")])  # rank=None
            for step in range(3):
                writer.add_scalar("loss", torch.tensor(float(step + rank)), step)
            writer.close()
            dist.barrier()
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(main, nprocs=2)
        """
    )
    from tests.adapters.conftest import free_port

    (tmp_path / "run.py").write_text(script)
    subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), str(free_port())], check=True, timeout=110
    )
    assert not (tmp_path / "rank1.jsonl").exists()
    records = read_jsonl(tmp_path / "rank0.jsonl")
    assert [(r["step"], r["metrics"]) for r in records] == [
        (s, {"loss": float(s)}) for s in range(3)
    ]


# ---- threads, closing, ownership


def test_thread_safe_sinks_run_on_their_own_thread_others_on_the_callers() -> None:
    threaded = RecordingSink("threaded")
    caller = RecordingSink("caller", thread_safe=False)
    with FanoutWriter([threaded, caller], rank=0) as writer:
        for step in range(4):
            writer.add_scalar("a", float(step), step)
    assert threaded.threads == {"trainvitals-sink-threaded"}
    assert caller.threads == {threading.current_thread().name}
    assert [s for s, _, _ in caller.steps] == [0, 1, 2, 3] == [s for s, _, _ in threaded.steps]


def test_close_is_idempotent_and_logging_after_close_warns_once() -> None:
    sink = RecordingSink()
    writer = FanoutWriter([sink], rank=0)
    writer.add_scalar("a", 1.0, 0)
    writer.close()
    writer.close()
    with pytest.warns(RuntimeWarning, match="after close"):
        writer.add_scalar("a", 2.0, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        writer.add_scalar("a", 2.0, 2)  # no second warning
    assert sink.closed == 1 and [s for s, _, _ in sink.steps] == [0]


def test_owned_sinks_are_closed_user_objects_are_left_open(tmp_path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    user_writer = SummaryWriter(str(tmp_path / "user"))
    sink_user = TensorBoardSink(user_writer)
    sink_owned = TensorBoardSink(tmp_path / "owned")
    with FanoutWriter([sink_user, sink_owned], rank=0) as writer:
        writer.add_scalar("a", 1.0, 0)
    assert sink_owned.writer.all_writers is None  # torch's SummaryWriter.close() clears it
    assert user_writer.all_writers is not None
    user_writer.add_scalar("still_open", 1.0, 0)  # the user's writer still works
    user_writer.close()
    from tests.adapters.conftest import read_tensorboard

    assert read_tensorboard(tmp_path / "user") == {"a": {0: 1.0}, "still_open": {0: 1.0}}
    assert read_tensorboard(tmp_path / "owned") == {"a": {0: 1.0}}


def test_no_values_no_threads_no_sink_calls() -> None:
    sink = RecordingSink()
    writer = FanoutWriter([sink], rank=0)
    assert writer.flush() is True
    writer.close()
    assert sink.opened == 0 and sink.steps == [] and sink.closed == 1
    assert writer._dispatcher is None


def test_constructor_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="Sink"):
        FanoutWriter([object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="buffer_steps"):
        FanoutWriter([], buffer_steps=0)
    with pytest.raises(ValueError, match="retry_backoff"):
        FanoutWriter([], retry_backoff=(2.0, 1.0))


def test_duplicate_sink_names_are_made_unique() -> None:
    writer = FanoutWriter([RecordingSink("x"), RecordingSink("x")], rank=0)
    assert list(writer.status()) == ["x", "x#2"]
    writer.close()


def test_import_needs_torch_only() -> None:
    code = (
        "import sys, trainvitals.adapters, trainvitals.adapters.from_frameworks; "
        "heavy = {'mlflow', 'tensorboard', 'comet_ml', 'wandb', 'lightning', "
        "'pytorch_lightning', 'accelerate', 'transformers'}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_values_queued_at_exit_without_close_are_delivered(tmp_path) -> None:
    code = (
        "import torch; from trainvitals.adapters import FanoutWriter, JsonlSink; "
        f"w = FanoutWriter([JsonlSink({str(tmp_path / 'm.jsonl')!r})], rank=0); "
        "[w.add_scalar('a', torch.tensor(float(s)), s) for s in range(3)]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    records = read_jsonl(tmp_path / "m.jsonl")
    assert [(r["step"], r["metrics"]) for r in records] == [(s, {"a": float(s)}) for s in range(3)]


def test_values_queued_at_exit_reach_runs_whose_backends_end_them_at_exit(tmp_path) -> None:
    # W&B (an atexit hook) and Comet (a threading._register_atexit hook) end their runs at exit
    # themselves; the writer's exit hook used to run after both, and every queued step was lost.
    code = textwrap.dedent(
        f"""
        import comet_ml, wandb
        from trainvitals.adapters import CometSink, FanoutWriter, WandbSink
        run = wandb.init(mode="offline", dir={str(tmp_path)!r}, project="t",
                         settings=wandb.Settings(console="off", x_disable_stats=True))
        experiment = comet_ml.OfflineExperiment(
            offline_directory={str(tmp_path / "comet")!r}, project_name="t",
            auto_metric_logging=False, auto_param_logging=False, auto_output_logging=False,
            log_env_details=False, log_git_metadata=False, log_git_patch=False, log_code=False,
            display_summary_level=0)
        w = FanoutWriter([WandbSink(run), CometSink(experiment)], rank=0, close_timeout=20)
        for s in range(4):
            w.add_scalar("loss", 0.5 * s, s)
        """
    )
    (tmp_path / "comet").mkdir()
    # A script of its own: not attached to the wandb service an earlier test of this process
    # started (wandb exports its address in WANDB_SERVICE; the child would end its run there).
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=300, capture_output=True, env=env
    )
    expected = {s: 0.5 * s for s in range(4)}
    rows = read_wandb_offline(tmp_path)
    assert {row["_step"]: row["loss"] for row in rows if "loss" in row} == expected
    assert read_comet_archive(tmp_path / "comet")["loss"] == expected


def test_the_driver_hands_each_step_to_wandb_before_the_loop_logs_the_next(tmp_path) -> None:
    # The loop logs its own metrics to the same run every step (accelerator.log(..., step=)):
    # W&B refuses a step lower than the run's, so the driver must not leave a logged step in
    # the writer until a later step logs (here: the next logging step, 2 steps later).

    from trainvitals.adapters import WandbSink
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import NormMonitor

    run = offline_wandb_run(tmp_path, "t")
    writer = FanoutWriter([WandbSink(run, owned=True)], rank=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected: dict[int, float] = {}
    with Vitals([NormMonitor()], writer=writer, log_every_n_steps=2) as vitals:
        vitals.attach(model, opt)
        for step in range(6):
            x = torch.randn(8, 4)
            vitals.batch(x)  # a new step: the last one is handed over ...
            # ... and delivered while this step runs, without a later step's values (a real
            # step takes long enough; here the test waits for it)
            deadline = time.monotonic() + 20
            while writer.status()["wandb"]["delivered"] < len(expected):
                assert time.monotonic() < deadline, f"step {step - 1} was not handed over"
                time.sleep(0.01)
            model(x).pow(2).mean().backward()
            if step % 2 == 0:
                squares = sum(float(p.grad.double().square().sum()) for p in model.parameters())
                expected[step] = math.sqrt(squares)
            opt.step()
            opt.zero_grad()
            run.log({"loss": float(step)}, step=step)  # the loop's own metrics
    writer.close()
    rows = read_wandb_offline(tmp_path)
    got = {r["_step"]: r["l2_norm/grad/global"] for r in rows if "l2_norm/grad/global" in r}
    assert got == pytest.approx(expected, rel=1e-6)
    assert {r["_step"] for r in rows if "loss" in r} == set(range(6))
    assert writer.status()["wandb"]["missed"] == 0
