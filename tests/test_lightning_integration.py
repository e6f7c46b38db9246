"""The run-health callbacks under Lightning: single device (lightning.pytorch and
pytorch_lightning), DDP on 2 CPU ranks with unequal batches, resume from ``ckpt_path``, and the
JSONL fallback when the trainer has no logger. A fake clock moved inside ``training_step`` (and
``validation_step``) makes every time and rate exact."""

from __future__ import annotations

import itertools
import logging
import math
import warnings

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed
from tests.scripts.vitals_testing import FakeClock, RecordingWriter, manual_optimization_module
from trainvitals.callbacks.memory_monitor import MemoryMonitor
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor

SEQ = 6
VOCAB = 16
VAL_SECONDS = 50.0


def step_seconds(step: int) -> float:
    """Seconds the fake clock moves per training micro-batch of optimizer step ``step``."""
    return 1.0 + step % 3


def _module(pl, clock: FakeClock, batch_size: int, batches: int):
    class TinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(VOCAB, 8)
            self.head = nn.Linear(8, VOCAB)

        def training_step(self, batch, batch_idx):
            clock.t += step_seconds(self.trainer.global_step)
            ids = batch["input_ids"]
            return nn.functional.cross_entropy(
                self.head(self.emb(ids)).flatten(0, 1), ids.flatten()
            )

        def validation_step(self, batch, batch_idx):
            clock.t += VAL_SECONDS

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def _loader(self, n):
            data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,))} for _ in range(n * batch_size)]
            return torch.utils.data.DataLoader(data, batch_size=batch_size)

        def train_dataloader(self):
            return self._loader(batches)

        def val_dataloader(self):
            return self._loader(2)

    return TinyLM()


def _trainer(pl, callbacks, tmp, **kwargs):
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp),
        "log_every_n_steps": 1,
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def _check_single_device(pl, tmp_path):
    clock = FakeClock()
    rw_t, rw_r, rw_m = RecordingWriter(), RecordingWriter(), RecordingWriter()
    callbacks = [
        ThroughputMonitor(window_size=4, clock=clock, writer=rw_t),
        RuntimeMonitor(clock=clock, writer=rw_r),
        MemoryMonitor(writer=rw_m),
    ]
    bs, batches, acc, epochs = 4, 6, 2, 2
    trainer = _trainer(
        pl,
        callbacks,
        tmp_path,
        max_epochs=epochs,
        accumulate_grad_batches=acc,
        limit_val_batches=2,
        num_sanity_val_steps=1,
    )
    trainer.fit(_module(pl, clock, bs, batches))
    horizon = epochs * math.ceil(batches / acc)
    # (step `horizon`: the last epoch's validation, after the last logging step, written at
    # the run's end with the time keys only)
    assert sorted(rw_r.rows) == list(range(horizon + 1))
    per_step = [acc * step_seconds(s) for s in range(horizon)]
    final = rw_r.rows.pop(horizon)
    assert set(final) == {"time/train_hours", "time/validation_hours", "time/total_hours"}
    train, val = sum(per_step), VAL_SECONDS * 2 * epochs
    assert final["time/train_hours"] == pytest.approx(train / 3600, rel=1e-12)
    assert final["time/validation_hours"] == pytest.approx(val / 3600, rel=1e-12)
    assert final["time/total_hours"] == pytest.approx((train + val) / 3600, rel=1e-12)
    for step, row in rw_r.rows.items():
        train = sum(per_step[: step + 1])
        val = VAL_SECONDS * 2 * (step >= 3)  # after epoch 0 (steps 0-2); sanity check excluded
        assert row["time/train_hours"] == pytest.approx(train / 3600, rel=1e-12)
        assert row["time/validation_hours"] == pytest.approx(val / 3600, rel=1e-12)
        assert row["time/total_hours"] == pytest.approx((train + val) / 3600, rel=1e-12)
        assert row["time/samples"] == acc * bs * (step + 1)
        assert row["time/tokens"] == acc * bs * SEQ * (step + 1)
        assert row["time/batches"] == acc * (step + 1)
        if step >= 1:
            rate = sum(per_step[1 : step + 1]) / step
            assert row["time/remaining_hours"] == pytest.approx(
                (horizon - step - 1) * rate / 3600, rel=1e-12
            )
    for step, row in rw_t.rows.items():
        window = range(max(1, step - 3), step + 1)
        seconds = sum(per_step[s] for s in window)
        assert row["throughput/samples_per_sec"] == pytest.approx(acc * bs * len(window) / seconds)
        assert row["throughput/tokens_per_sec"] == pytest.approx(
            acc * bs * SEQ * len(window) / seconds
        )
        assert row["throughput/batches_per_sec"] == pytest.approx(acc * len(window) / seconds)
    assert sorted(rw_t.rows) == list(range(1, horizon))  # step 0 is warm-up
    assert sorted(rw_m.rows) == list(range(horizon))
    assert all(row["memory/rss_gb"] > 0 for row in rw_m.rows.values())


def test_single_device_lightning_pytorch(tmp_path):
    import lightning.pytorch as pl

    _check_single_device(pl, tmp_path)


def test_single_device_pytorch_lightning_package(tmp_path):
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    _check_single_device(pytorch_lightning, tmp_path)


def test_resume_from_ckpt_path_continues_counters_windows_estimates(tmp_path):
    import lightning.pytorch as pl

    bs, batches = 3, 40

    def callbacks(clock, writers):
        return [
            ThroughputMonitor(window_size=5, warmup_steps=0, clock=clock, writer=writers[0]),
            RuntimeMonitor(clock=clock, writer=writers[1]),
        ]

    clock = FakeClock()
    first = (RecordingWriter(), RecordingWriter())
    trainer = _trainer(pl, callbacks(clock, first), tmp_path, max_steps=10)
    trainer.fit(_module(pl, clock, bs, batches))
    ckpt = tmp_path / "step10.ckpt"
    trainer.save_checkpoint(ckpt)

    clock = FakeClock(t=9e6)
    second = (RecordingWriter(), RecordingWriter())
    trainer = _trainer(pl, callbacks(clock, second), tmp_path, max_steps=20)
    trainer.fit(_module(pl, clock, bs, batches), ckpt_path=ckpt)

    assert sorted(second[1].rows) == list(range(10, 20))
    for step in range(10, 20):
        window = range(step - 4, step + 1)  # reaches back into the first run until step 14
        seconds = sum(step_seconds(s) for s in window)
        row = second[0].rows[step]
        assert row["throughput/samples_per_sec"] == pytest.approx(bs * 5 / seconds, rel=1e-12)
        assert row["throughput/seconds_per_step"] == pytest.approx(seconds / 5, rel=1e-12)
        row = second[1].rows[step]
        assert row["time/samples"] == bs * (step + 1)
        train = sum(step_seconds(s) for s in range(step + 1))
        assert row["time/train_hours"] == pytest.approx(train / 3600, rel=1e-12)
        # rate: steps 1..9 of the first run, 11..step of the second (10 is its warm-up)
        rate_steps = list(range(1, 10)) + list(range(11, step + 1))
        rate = sum(step_seconds(s) for s in rate_steps) / len(rate_steps)
        assert row["time/seconds_per_step"] == pytest.approx(rate, rel=1e-12)
        assert row["time/remaining_hours"] == pytest.approx((20 - step - 1) * rate / 3600)


def test_no_logger_falls_back_to_jsonl_in_run_folder(tmp_path):
    import lightning.pytorch as pl

    from trainvitals.adapters import read_jsonl

    clock = FakeClock()
    trainer = _trainer(pl, [RuntimeMonitor(clock=clock, max_steps=3)], tmp_path, max_steps=3)
    trainer.fit(_module(pl, clock, 2, 10))
    records = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert sorted(records) == [0, 1, 2]
    assert records[2]["time/samples"] == 6
    assert records[2]["time/remaining_hours"] == 0.0


def test_values_written_before_a_crash_are_in_the_file_when_fit_raises(tmp_path):
    import lightning.pytorch as pl

    from trainvitals.adapters import read_jsonl

    clock = FakeClock()
    module = _module(pl, clock, 2, 10)
    step = module.training_step

    def training_step(batch, batch_idx):
        if module.trainer.global_step == 3:
            raise RuntimeError("crash at step 3")
        return step(batch, batch_idx)

    module.training_step = training_step
    trainer = _trainer(pl, [RuntimeMonitor(clock=clock, max_steps=6)], tmp_path, max_steps=6)
    with pytest.raises(RuntimeError, match="crash"):
        trainer.fit(module)
    # still in the process: nothing has closed the writer, yet every logged step is on disk
    records = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert sorted(records) == [0, 1, 2]
    assert records[2]["time/samples"] == 2 * 3


def test_a_fit_retried_from_an_earlier_checkpoint_writes_its_steps_again(tmp_path):
    # crash at step 4, retry on the same trainer from the checkpoint of step 2: the leftover
    # writer (last step 3) would refuse steps 2 and 3 and disable the callbacks
    import lightning.pytorch as pl

    from trainvitals.adapters import read_jsonl

    clock = FakeClock()
    runtime = RuntimeMonitor(clock=clock, max_steps=6)
    caught = _crash_at_4_and_retry_from_step_2(pl, clock, runtime, tmp_path)
    assert not [w for w in caught if "lower than step" in str(w.message)]
    assert not runtime._disabled
    records = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert sorted(records) == list(range(6))
    assert records[5]["time/samples"] == 2 * 6


def test_a_fit_resumed_from_a_checkpoint_drops_the_interrupted_fits_later_lines(tmp_path, caplog):
    # The interrupted fit logged steps 2-4 after the checkpoint of step 2; the resumed fit logs
    # every third step only (steps 2-4: step 3), so the first step it writes is 3. The line of
    # step 2 from the interrupted fit is of a timeline that no longer exists: dropped too.
    import lightning.pytorch as pl

    from trainvitals.adapters import read_jsonl

    clock = FakeClock()
    trainer = _trainer(pl, [RuntimeMonitor(clock=clock, max_steps=5)], tmp_path, max_steps=2)
    trainer.fit(_module(pl, clock, 2, 20))
    ckpt = tmp_path / "step2.ckpt"
    trainer.save_checkpoint(ckpt)
    trainer = _trainer(pl, [RuntimeMonitor(clock=clock, max_steps=5)], tmp_path, max_steps=5)
    trainer.fit(_module(pl, clock, 2, 20), ckpt_path=ckpt)  # steps 2-4, then "interrupted"
    assert sorted(r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")) == list(range(5))
    resumed = RuntimeMonitor(clock=clock, max_steps=5, log_every_n_steps=3)
    trainer = _trainer(pl, [resumed], tmp_path, max_steps=5)
    # the lines after the checkpoint's step: an ordinary resume, an INFO log (no warning)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, "trainvitals"):
        warnings.filterwarnings("error", "JsonlSink", RuntimeWarning)
        trainer.fit(_module(pl, clock, 3, 20), ckpt_path=ckpt)  # batches of 3 this time
    assert any("dropped 3 line(s) of steps >= 2" in r.message for r in caplog.records)
    records = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert sorted(records) == [0, 1, 3]  # (steps 2-4 logged when step % 3 == 0)
    assert records[1]["time/samples"] == 2 * 2  # the first fit's
    assert records[3]["time/samples"] == 2 * 2 + 3 * 2  # the resumed fit's: steps 2 and 3


# ---------------------------------------------------------------------------- DDP


def _ddp_body(rank: int, world_size: int, tmp: str) -> dict:
    import lightning.pytorch as pl

    bs = 2 + 3 * rank  # rank 1 processes more than twice rank 0's samples
    out: dict = {}
    for phase, max_steps in (("first", 4), ("second", 8)):
        clock = FakeClock(t=1000.0 if phase == "first" else 5e5)
        writers = (RecordingWriter(), RecordingWriter())
        callbacks = [
            ThroughputMonitor(window_size=3, warmup_steps=0, clock=clock, writer=writers[0]),
            RuntimeMonitor(clock=clock, writer=writers[1]),
        ]
        trainer = _trainer(
            pl,
            callbacks,
            tmp,
            devices=world_size,
            strategy="ddp",
            max_steps=max_steps,
            accumulate_grad_batches=2,
            use_distributed_sampler=False,
        )
        ckpt = f"{tmp}/ddp.ckpt"
        trainer.fit(_module(pl, clock, bs, 40), ckpt_path=ckpt if phase == "second" else None)
        if phase == "first":
            trainer.save_checkpoint(ckpt)  # every rank: the callbacks' state_dict is collective
        out[phase] = (writers[0].rows, writers[1].rows)
    return out


@pytest.mark.timeout(300)
def test_ddp_two_ranks_true_sums_and_resume(tmp_path):
    results = run_distributed(_ddp_body, world_size=2, args=(str(tmp_path),), timeout=270)
    sizes = [2, 5]
    acc = 2
    for rank, result in enumerate(results):
        for phase, steps in (("first", range(4)), ("second", range(4, 8))):
            throughput, runtime = result[phase]
            assert sorted(runtime) == list(steps)
            for step in steps:
                window = range(max(0, step - 2), step + 1)
                seconds = acc * sum(step_seconds(s) for s in window)
                row = throughput[step]
                assert row["throughput/samples_per_sec"] == pytest.approx(
                    acc * sum(sizes) * len(window) / seconds, rel=1e-12
                )
                # Device figures are this rank's own, except that entries restored from the
                # checkpoint (rank 0's copy) are rank 0's: only rank 0 writes.
                own = [sizes[0] if (phase == "second" and s < 4) else sizes[rank] for s in window]
                assert row["throughput/device/samples_per_sec"] == pytest.approx(
                    acc * sum(own) / seconds, rel=1e-12
                )
                row = runtime[step]
                assert row["time/samples"] == acc * sum(sizes) * (step + 1)
                assert row["time/tokens"] == acc * sum(sizes) * SEQ * (step + 1)


def test_measure_flops_under_lightning(tmp_path):
    """FlopCounterMode entered in on_train_batch_start and left in on_before_optimizer_step
    (inside Lightning's optimizer closure). TinyLM's counted work per token is the head
    Linear(8, VOCAB): forward 2*8*VOCAB, backward grad input and grad weight 2 * 2*8*VOCAB (the
    embedding's backward and the loss have no flop formula)."""
    import lightning.pytorch as pl
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    clock = FakeClock()
    writer = RecordingWriter()
    monitor = ThroughputMonitor(
        measure_flops=True, peak_flops=1e4, window_size=2, clock=clock, writer=writer
    )
    trainer = _trainer(pl, [monitor], tmp_path, max_steps=4, accumulate_grad_batches=2)
    trainer.fit(_module(pl, clock, 3, 20))
    per_token = 6 * 8 * VOCAB
    assert monitor.state_dict()["measured"] == ["tokens", per_token]
    assert _get_current_dispatch_mode() is None
    row = writer.rows[3]
    seconds = 2 * (step_seconds(2) + step_seconds(3))
    tokens = 2 * 2 * 3 * SEQ
    assert row["throughput/flops_per_sec"] == pytest.approx(per_token * tokens / seconds)
    assert row["throughput/mfu"] == pytest.approx(per_token * tokens / seconds / 1e4)


def _model_parallel_body(rank: int, world_size: int, tmp: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    dp_rank = rank // 2  # mesh (data_parallel=2, tensor_parallel=2): ranks [[0, 1], [2, 3]]
    clock = FakeClock()
    module = _module(pl, clock, 2 + 3 * dp_rank, 20)

    def configure_model() -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = module.device_mesh["data_parallel"]
        for sub in (module.emb, module.head):
            fully_shard(sub, mesh=mesh)

    module.configure_model = configure_model
    writers = (RecordingWriter(), RecordingWriter())
    callbacks = [
        ThroughputMonitor(window_size=2, clock=clock, writer=writers[0]),
        RuntimeMonitor(clock=clock, writer=writers[1]),
    ]
    trainer = _trainer(
        pl, callbacks, tmp, devices=world_size, max_steps=3, use_distributed_sampler=False,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
    )  # fmt: skip
    trainer.fit(module)
    return {"throughput": writers[0].rows, "runtime": writers[1].rows}


@pytest.mark.timeout(300)
def test_model_parallel_strategy_counts_tensor_parallel_peers_once(tmp_path):
    results = run_distributed(
        _model_parallel_body, world_size=4, args=(str(tmp_path),), timeout=270
    )
    per_batch = (2 + 0) + (2 + 3)  # the two data-parallel replicas, each seen by 2 tp ranks
    for result in results:
        for step in range(3):
            assert result["runtime"][step]["time/samples"] == per_batch * (step + 1)
            assert result["runtime"][step]["time/tokens"] == per_batch * SEQ * (step + 1)
        row = result["throughput"][2]
        seconds = step_seconds(1) + step_seconds(2)
        assert row["throughput/samples_per_sec"] == pytest.approx(2 * per_batch / seconds)


def test_manual_optimization_two_optimizers_remaining_time_in_global_steps(tmp_path):
    """Manual optimization stepping two optimizers per batch: Lightning's global_step (the
    step axis and max_steps' unit) advances by 2 per batch, so the rate and the steps left are
    counted in global steps too (before: a batch counted as one step of a horizon of max_steps,
    which doubled the estimate)."""
    import lightning.pytorch as pl

    clock = FakeClock()
    writer = RecordingWriter()

    def tick(batch_idx: int) -> None:
        clock.t += step_seconds(batch_idx)

    module = manual_optimization_module([nn.Linear(3, 1), nn.Linear(3, 1)], 40, on_batch=tick)

    max_steps = 12  # 6 batches
    monitor = RuntimeMonitor(clock=clock, writer=writer, warmup_steps=1)
    trainer = _trainer(pl, [monitor], tmp_path, max_steps=max_steps)
    trainer.fit(module)
    assert trainer.global_step == max_steps
    assert sorted(writer.rows) == [0, 2, 4, 6, 8, 10]
    for step, row in writer.rows.items():
        batch = step // 2
        if batch == 0:
            continue  # warm-up batch: no rate yet
        per_global_step = sum(step_seconds(b) for b in range(1, batch + 1)) / (2 * batch)
        assert row["time/seconds_per_step"] == pytest.approx(per_global_step, rel=1e-12)
        left = max_steps - 2 * (batch + 1)
        assert row["time/remaining_hours"] == pytest.approx(
            left * per_global_step / 3600, rel=1e-12, abs=1e-15
        )


def test_retry_after_a_crashed_fit_on_the_same_trainer(tmp_path):
    """A fit that raised mid-step never reaches teardown; a retry ``trainer.fit(new_module,
    ckpt_path=...)`` on the same trainer must see the new module and count the resumed step's
    micro-batches from 0, and RuntimeMonitor must not add the crashed step's micro-batches
    (restored from the checkpoint while a step was in progress) to the replayed one."""
    import lightning.pytorch as pl

    from trainvitals.callbacks.base import VitalsCallback

    class Seen(VitalsCallback):
        def __init__(self) -> None:
            super().__init__(writer=RecordingWriter())
            self.models: list = []
            self.ends: dict[int, int] = {}

        def micro_batch_start(self, ctx, batch):
            self.models.append(ctx.model)

        def step_end(self, ctx):
            self.ends[ctx.step] = ctx.micro_batches_in_step

    bs, acc = 3, 2
    clock = FakeClock()
    crash = {"at": None}

    def module():
        m = _module(pl, clock, bs, 20)
        step = m.training_step

        def training_step(batch, batch_idx):
            if (m.trainer.global_step, batch_idx % acc) == crash["at"]:
                raise RuntimeError("crash in the second micro-batch of step 2")
            return step(batch, batch_idx)

        m.training_step = training_step
        return m

    rows = RecordingWriter()
    seen, runtime = Seen(), RuntimeMonitor(clock=clock, writer=rows)
    options = {"accumulate_grad_batches": acc, "limit_val_batches": 0, "num_sanity_val_steps": 0}
    trainer = _trainer(pl, [seen, runtime], tmp_path, max_steps=2, **options)
    trainer.fit(module())
    ckpt = tmp_path / "step2.ckpt"
    trainer.save_checkpoint(ckpt)

    trainer = _trainer(pl, [seen, runtime], tmp_path, max_steps=4, **options)
    crash["at"] = (2, 1)
    with pytest.raises(RuntimeError, match="crash"):
        trainer.fit(module(), ckpt_path=ckpt)
    crash["at"] = None
    seen.models.clear()
    seen.ends.clear()
    retried = module()
    trainer.fit(retried, ckpt_path=ckpt)
    assert trainer.global_step == 4
    assert len(seen.models) == 2 * acc and all(m is retried for m in seen.models)
    assert seen.ends == {2: acc, 3: acc}
    for step in (2, 3):
        row = rows.rows[step]
        assert row["time/batches"] == acc * (step + 1)
        assert row["time/samples"] == acc * bs * (step + 1)


# ---------------------------------------------------------------------------- Lightning specifics


def test_two_instances_of_one_callback_keep_their_own_checkpoint_state(tmp_path):
    """Two NormMonitors with different settings: Lightning keeps one state per ``state_key``
    and refuses two stateful callbacks sharing one, so they are named (before: ``state_key``
    could not be set, so no Trainer could hold both). Each counts its logging steps with a
    non-finite gradient; a resume continues each count from its own state."""
    import lightning.pytorch as pl

    from trainvitals.callbacks.norm_monitor import NormMonitor

    def module():
        m = _module(pl, FakeClock(), 2, 20)
        m.bad = nn.Parameter(torch.zeros(1))  # its gradient is NaN at every step
        step = m.training_step

        def training_step(batch, batch_idx):
            return step(batch, batch_idx) + (m.bad * float("nan")).sum()

        m.training_step = training_step
        return m

    def monitors():
        every_step = NormMonitor(per_param="emb.*", log_every_n_steps=1, writer=RecordingWriter())
        every_step.state_key = "norms_every_step"
        every_other = NormMonitor(per_param="head.*", log_every_n_steps=2, writer=RecordingWriter())
        every_other.state_key = "norms_every_other_step"
        return [every_step, every_other]

    def nonfinite_logging_steps(steps: range, every: int) -> int:
        return sum(s % every == 0 for s in steps)

    first = monitors()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the monitors' warnings about the NaN gradient
        trainer = _trainer(pl, first, tmp_path, max_steps=5)
        trained = module()
        trainer.fit(trained)
        assert "on_train_batch_start" not in vars(trained)  # no wrapper of ours left behind
        ckpt = tmp_path / "two.ckpt"
        trainer.save_checkpoint(ckpt)
        saved = torch.load(ckpt, weights_only=False)["callbacks"]
        assert saved["norms_every_step"]["nonfinite_logging_steps"] == nonfinite_logging_steps(
            range(5), 1
        )
        assert saved["norms_every_other_step"][
            "nonfinite_logging_steps"
        ] == nonfinite_logging_steps(range(5), 2)

        second = monitors()
        trainer = _trainer(pl, second, tmp_path, max_steps=8)
        trainer.fit(module(), ckpt_path=ckpt)
        for monitor, every in zip(second, (1, 2), strict=True):
            assert monitor.nonfinite_logging_steps == nonfinite_logging_steps(range(8), every)
            assert monitor.first_nonfinite_step == 0
    with pytest.raises(TypeError, match="state_key"):
        first[0].state_key = None


def test_a_batch_skipped_by_on_train_batch_start_returning_minus_one_is_not_counted(tmp_path):
    """Lightning calls the callbacks' on_train_batch_start before the module's; a module that
    returns -1 skips the rest of the epoch, that batch included. The skipped batch is not a
    micro-batch: here in the middle of an accumulation window, whose gradient (batch 2 of
    epoch 0) goes into the first step of epoch 1."""
    import lightning.pytorch as pl

    from trainvitals.callbacks.base import VitalsCallback

    class StepEnds(VitalsCallback):
        def __init__(self) -> None:
            super().__init__(writer=RecordingWriter())
            self.micro_batches: dict[int, int] = {}

        def step_end(self, ctx):
            self.micro_batches[ctx.step] = ctx.micro_batches_in_step

    bs, acc = 3, 2
    clock = FakeClock()
    module = _module(pl, clock, bs, 6)
    trained: dict[int, list[int]] = {}  # optimizer step -> sizes of the batches trained in it
    step = module.training_step

    def training_step(batch, batch_idx):
        trained.setdefault(module.trainer.global_step, []).append(len(batch["input_ids"]))
        return step(batch, batch_idx)

    def on_train_batch_start(batch, batch_idx):
        return -1 if (module.current_epoch, batch_idx) == (0, 3) else None

    module.training_step = training_step
    module.on_train_batch_start = on_train_batch_start
    rows, ends = RecordingWriter(), StepEnds()
    options = {"accumulate_grad_batches": acc, "limit_val_batches": 0, "num_sanity_val_steps": 0}
    trainer = _trainer(pl, [RuntimeMonitor(clock=clock, writer=rows), ends], tmp_path,
                       max_epochs=2, **options)  # fmt: skip
    trainer.fit(module)
    assert trainer.global_step == len(trained) == 4
    assert len(trained[1]) == 3  # batch 2 of epoch 0, batches 0 and 1 of epoch 1
    assert ends.micro_batches == {s: len(sizes) for s, sizes in trained.items()}
    for s in trained:
        assert rows.rows[s]["time/batches"] == sum(len(trained[t]) for t in range(s + 1))
        assert rows.rows[s]["time/samples"] == sum(sum(trained[t]) for t in range(s + 1))
    assert module.on_train_batch_start is on_train_batch_start  # the module's own hook again


def test_trainer_log_every_n_steps_zero_asks_for_the_callbacks_interval(tmp_path):
    """``Trainer(log_every_n_steps=0)`` (also what ``barebones=True`` sets) turns Lightning's
    logging off; a callback taking its interval from the trainer must say so at run start
    (before: a modulo by zero at the first step, which disabled the callback)."""
    import lightning.pytorch as pl

    clock = FakeClock()
    trainer = _trainer(pl, [RuntimeMonitor(clock=clock)], tmp_path, max_steps=2,
                       log_every_n_steps=0)  # fmt: skip
    with pytest.raises(ValueError, match="log_every_n_steps"):
        trainer.fit(_module(pl, clock, 2, 10))

    rows = RecordingWriter()
    monitor = RuntimeMonitor(clock=clock, writer=rows, log_every_n_steps=2)
    trainer = pl.Trainer(
        callbacks=[monitor], barebones=True, accelerator="cpu", devices=1, max_steps=5,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(_module(pl, clock, 2, 10))
    assert sorted(rows.rows) == [0, 2, 4]
    assert rows.rows[4]["time/samples"] == 2 * 5


def test_batch_size_of_a_batch_with_a_scalar_before_its_tensors():
    from trainvitals.adapters.context import infer_batch_size, infer_num_tokens

    batch = {"temperature": torch.tensor(0.7), "input_ids": torch.zeros(4, SEQ, dtype=torch.long)}
    assert infer_batch_size(batch) == 4
    assert infer_num_tokens(batch) == 4 * SEQ
    assert infer_batch_size((torch.tensor(3), [torch.ones(5, 2)])) == 5
    assert infer_batch_size(torch.tensor(1.0)) is None


def test_a_module_with_lightnings_own_batch_start_is_left_untouched(tmp_path):
    """Only a module whose on_train_batch_start is its own (it may return -1) gets the gate;
    Lightning's default returns None, so the module object stays as the user built it (no
    instance attribute, which e.g. would not pickle)."""
    import lightning.pytorch as pl

    clock = FakeClock()
    module = _module(pl, clock, 2, 4)
    seen: list[bool] = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append("on_train_batch_start" in vars(pl_module))

    rows = RecordingWriter()
    trainer = _trainer(pl, [RuntimeMonitor(clock=clock, writer=rows), Probe()], tmp_path,
                       max_steps=3, limit_val_batches=0)  # fmt: skip
    trainer.fit(module)
    assert seen == [False, False, False]
    assert rows.rows[2]["time/batches"] == 3  # every batch still counted


def _crash_at(module, crash: dict):
    """``module.training_step`` raising while ``trainer.global_step == crash["at"]``."""
    step = module.training_step

    def training_step(batch, batch_idx):
        if module.trainer.global_step == crash["at"]:
            raise RuntimeError(f"crash at step {crash['at']}")
        return step(batch, batch_idx)

    module.training_step = training_step
    return module


def _crash_at_4_and_retry_from_step_2(pl, clock: FakeClock, runtime, tmp_path) -> list:
    """A fit to step 2 and its checkpoint; a second trainer resumes from it for steps 2-5 and
    crashes at step 4; the same trainer retries from the step-2 checkpoint. The callbacks are
    ``[runtime]`` throughout. Returns the warnings of the retry."""
    crash = {"at": None}
    module = _crash_at(_module(pl, clock, 2, 20), crash)
    trainer = _trainer(pl, [runtime], tmp_path, max_steps=2)
    trainer.fit(module)
    ckpt = tmp_path / "step2.ckpt"
    trainer.save_checkpoint(ckpt)
    trainer = _trainer(pl, [runtime], tmp_path, max_steps=6)
    crash["at"] = 4
    with pytest.raises(RuntimeError, match="crash"):
        trainer.fit(module, ckpt_path=ckpt)
    crash["at"] = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, ckpt_path=ckpt)
    return caught


def test_a_callbacks_own_writer_is_flushed_when_fit_raises(tmp_path):
    # A callback given its own writer: when fit raises, the values it was given so far must
    # reach its sinks then, not only when (if) the process exits normally.
    import lightning.pytorch as pl

    from trainvitals.adapters import FanoutWriter, JsonlSink, read_jsonl

    clock = FakeClock()
    module = _crash_at(_module(pl, clock, 2, 10), {"at": 3})
    own = FanoutWriter([JsonlSink(tmp_path / "own.jsonl")])
    monitor = RuntimeMonitor(clock=clock, max_steps=6, writer=own)
    trainer = _trainer(pl, [monitor], tmp_path, max_steps=6)
    with pytest.raises(RuntimeError, match="crash"):
        trainer.fit(module)
    records = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "own.jsonl")}
    own.close()
    assert sorted(records) == [0, 1, 2]
    assert [records[s]["time/samples"] for s in (0, 1, 2)] == [2, 4, 6]


def test_a_callback_disabled_in_one_fit_runs_again_in_the_next_fit(tmp_path, monkeypatch):
    # The guard disables a failing callback for the rest of that fit; the next fit with the
    # same instance (a second fine-tuning fit, a retry) is a new run: it runs again, and a new
    # failure there is reported again.
    import lightning.pytorch as pl

    from trainvitals.callbacks.base import VitalsCallback

    monkeypatch.setenv("TRAINVITALS_STRICT", "0")

    class FailsAt(VitalsCallback):
        def __init__(self) -> None:
            super().__init__(writer=RecordingWriter())
            self.fail_at: int | None = None
            self.ends: list[int] = []

        def step_end(self, ctx):
            if ctx.step == self.fail_at:
                raise RuntimeError("telemetry bug")
            self.ends.append(ctx.step)

    callback = FailsAt()
    clock = FakeClock()
    messages = []
    for fit, fail_at in enumerate((1, 4)):
        callback.fail_at = fail_at
        callback.ends.clear()
        trainer = _trainer(pl, [callback], tmp_path, max_steps=3 + 3 * fit)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # Python's own once-per-location filter
            trainer.fit(_module(pl, clock, 2, 10))
        messages += [str(w.message) for w in caught if "disabled" in str(w.message)]
        assert callback.ends == ([0] if fit == 0 else [0, 1, 2, 3])
    assert len(messages) == 2


def test_retry_from_an_earlier_checkpoint_with_a_callbacks_own_writer(tmp_path):
    # The callback's own FanoutWriter outlives the crashed fit and holds its steps 0-3; it
    # refuses lower steps. The retry from the step-2 checkpoint must not fail the callback
    # (strict mode: it would raise), drops the replayed steps 2, 3 from that writer with one
    # warning, and writes steps 4, 5 of the retried run.
    import lightning.pytorch as pl

    from trainvitals.adapters import FanoutWriter, JsonlSink, read_jsonl

    clock = FakeClock()
    own = FanoutWriter([JsonlSink(tmp_path / "own.jsonl")])
    runtime = RuntimeMonitor(clock=clock, max_steps=6, writer=own)
    caught = _crash_at_4_and_retry_from_step_2(pl, clock, runtime, tmp_path)
    own.close()
    assert len([w for w in caught if "dropped from that writer" in str(w.message)]) == 1
    records = [
        (r["step"], r["metrics"]["time/samples"]) for r in read_jsonl(tmp_path / "own.jsonl")
    ]
    assert records == [(s, 2 * (s + 1)) for s in range(6)]  # each step once, in order


def _first_batch_at_or_after_each_multiple(starts: list[int], every: int, end: int) -> list[int]:
    """The logging rule computed from its definition: each multiple of ``every`` below ``end``
    is logged by the first batch (first optimizer step in ``starts``) at or after it."""
    return sorted(
        {min(s for s in starts if s >= m) for m in range(0, end, every) if m <= starts[-1]}
    )


class _DecisionProbe:
    """A callback recording its logging decision at each batch start and each step end."""

    @staticmethod
    def make():
        from trainvitals.callbacks.base import VitalsCallback

        class Probe(VitalsCallback):
            def __init__(self) -> None:
                super().__init__(writer=RecordingWriter())
                self.at_start: dict[int, set[bool]] = {}
                self.at_end: dict[int, bool] = {}

            def micro_batch_start(self, ctx, batch):
                self.at_start.setdefault(ctx.step, set()).add(self.should_log(ctx))

            def step_end(self, ctx):
                self.at_end[ctx.step] = self.should_log(ctx)

        return Probe()


def _varying_manual_module(pl, samples: int):
    """Manual optimization: the first optimizer steps every batch, the second every third batch
    (a generator stepped every k batches), so global_step advances by 2, 1, 1, 2, 1, 1, ..."""

    class Varying(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layers = nn.ModuleList([nn.Linear(3, 1), nn.Linear(3, 1)])

        def training_step(self, batch, batch_idx):
            for i, (opt, layer) in enumerate(zip(self.optimizers(), self.layers, strict=True)):
                if i == 1 and batch_idx % 3:
                    continue
                opt.zero_grad()
                self.manual_backward(layer(batch).pow(2).mean())
                opt.step()

        def configure_optimizers(self):
            return [torch.optim.SGD(m.parameters(), lr=0.01) for m in self.layers]

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(samples, 3), batch_size=2)

    return Varying()


@pytest.mark.parametrize("varying", [False, True], ids=["two_per_batch", "two_one_one"])
def test_manual_optimization_two_optimizers_log_interval_in_optimizer_steps(tmp_path, varying):
    """Two optimizers stepped per batch: global_step advances by 2 per batch (batches start at
    steps 0, 2, 4, ...). With log_every_n_steps=3 the interval must hold in optimizer steps:
    every multiple of 3 is logged once, by the first batch starting at or after it (before:
    only batches starting at a multiple of 3 logged, every 6 steps). The decision taken at
    micro_batch_start (callbacks preparing hooks) agrees with the one at step_end."""
    import lightning.pytorch as pl

    from trainvitals.callbacks.norm_monitor import NormMonitor

    writer = RecordingWriter()
    probe = _DecisionProbe.make()
    module = (
        _varying_manual_module(pl, 60)
        if varying
        else manual_optimization_module([nn.Linear(3, 1), nn.Linear(3, 1)], 60)
    )
    max_steps = 24
    trainer = _trainer(
        pl, [NormMonitor(writer=writer), probe], tmp_path, max_steps=max_steps, log_every_n_steps=3
    )
    trainer.fit(module)
    starts = sorted(probe.at_end)
    increments = [b - a for a, b in itertools.pairwise(starts)]
    assert set(increments) == ({1, 2} if varying else {2})
    expected = _first_batch_at_or_after_each_multiple(starts, 3, max_steps)
    assert sorted(writer.rows) == expected
    assert sorted(s for s, log in probe.at_end.items() if log) == expected
    assert probe.at_start == {s: {log} for s, log in probe.at_end.items()}
    if not varying:
        assert expected == [0, 4, 6, 10, 12, 16, 18, 22]


def test_one_optimizer_logs_on_multiples_of_the_interval(tmp_path):
    """One optimizer (automatic optimization, 2 micro-batches per step): the logged steps are
    exactly 0, n, 2n, ..., decided alike at every micro-batch and at the step's end."""
    import lightning.pytorch as pl

    from trainvitals.callbacks.norm_monitor import NormMonitor

    clock = FakeClock()
    writer = RecordingWriter()
    probe = _DecisionProbe.make()
    trainer = _trainer(
        pl,
        [NormMonitor(writer=writer), probe],
        tmp_path,
        max_steps=10,
        accumulate_grad_batches=2,
        log_every_n_steps=3,
    )
    trainer.fit(_module(pl, clock, 2, 20))
    assert sorted(probe.at_end) == list(range(10))
    assert sorted(writer.rows) == [0, 3, 6, 9]
    assert probe.at_start == {s: {s % 3 == 0} for s in range(10)}
