"""Checks that need a CUDA device (skipped without one; CI has none).

- No callback synchronises the host with the device on a step that does not log: every public
  callback on the tiny MoE model on CUDA, under the ``Vitals`` driver (float32, bf16 autocast,
  fp16 with a ``GradScaler``) and under a Lightning ``Trainer``, with
  ``torch.cuda.set_sync_debug_mode("warn")``: each synchronising CUDA call is a warning, noted
  with the Python stack it came from. Calls under a ``trainvitals`` frame on a non-logging step
  fail the test (the user's model, Lightning and torch are theirs to sync). This sees what the
  CPU stand-in (tests/test_no_host_reads_on_non_logging_steps.py) cannot: syncs inside C++
  operators. The writer's own thread may wait for the device (it waits on the logged step's
  event, off the training thread).
- The moments kernels (eager and ``torch.compile``/Triton) against float64 on the host.
- NormMonitor's float64 norms of gradients whose float32 sum of squares overflows.
- MemoryMonitor's keys against ``torch.cuda.memory_stats`` read at the same point.
"""

from __future__ import annotations

import json
import math
import re
import threading
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import trainvitals
from tests.test_no_host_reads_on_non_logging_steps import (
    CHECKED_STEPS,
    INTERVAL,
    LOGGING_STEPS,
    MICRO_BATCHES,
    STEPS,
    _batch,
    _callbacks,
    _model,
    lightning_run,
    lightning_step_of,
)
from trainvitals.adapters import FanoutWriter, JsonlSink
from trainvitals.adapters.jsonl import read_jsonl
from trainvitals.adapters.loop import Vitals
from trainvitals.moe import destroy_moe_metrics_tracker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_PACKAGE = str(Path(trainvitals.__file__).resolve().parent)
_USER_MODEL = str(Path(_PACKAGE, "moe", "tiny_model.py"))
# A line of ours that only hands the user's call on to the original (our optimizer.step wrapper)
_PASS_THROUGH = re.compile(r"return original\w*\(")


@dataclass(frozen=True)
class _Sync:
    step: int | None
    thread: str
    where: str  # innermost trainvitals frame (file:line function: code), or "" for none
    stack: str  # the last frames, for the failure message

    def describe(self) -> str:
        return f"step {self.step} [{self.thread}] {self.where or '(not trainvitals)'}\n{self.stack}"


class _SyncWatch:
    """``torch.cuda.set_sync_debug_mode("warn")`` while active; each synchronising call's
    warning is noted with its step (``step_of()`` when it is made) and Python stack."""

    def __init__(self, step_of: Any) -> None:
        self.step_of = step_of
        self.syncs: list[_Sync] = []

    def __enter__(self) -> _SyncWatch:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self._show = warnings.showwarning
        warnings.showwarning = self._seen
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode(0)
        self._warnings.__exit__(*exc)

    def _seen(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing CUDA operation" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        where = ""
        for frame in reversed(stack):
            if frame.filename.startswith(_PACKAGE) and frame.filename != _USER_MODEL:
                if _PASS_THROUGH.match(frame.line or ""):
                    # our wrapper of the user's call (optimizer.step, scaler.step) calling it:
                    # the sync is inside the user's call (GradScaler reads found_inf itself)
                    continue
                rel = Path(frame.filename).relative_to(_PACKAGE)
                where = f"trainvitals/{rel}:{frame.lineno} {frame.name}: {frame.line}"
                break
        self.syncs.append(
            _Sync(
                step=self.step_of(),
                thread=threading.current_thread().name,
                where=where,
                stack="".join(traceback.format_list(stack[-6:])),
            )
        )

    def ours_on(self, steps: set[int]) -> list[_Sync]:
        """Our syncs on ``steps``, except the writer thread's wait for a logged step."""
        return [
            s
            for s in self.syncs
            if s.step in steps
            and s.where
            and not ("adapters/fanout_writer.py" in s.where and s.thread != "MainThread")
        ]


def _check(watch: _SyncWatch) -> None:
    found = watch.ours_on(CHECKED_STEPS)
    assert not found, "trainvitals synchronised on non-logging steps:\n" + "\n".join(
        dict.fromkeys(s.describe() for s in found)
    )


def _to(batch: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "fp16-scaler"])
def test_driver_does_not_sync_on_non_logging_steps(precision: str, tmp_path: Path) -> None:
    destroy_moe_metrics_tracker()
    model = _model().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16-scaler" else None
    dtype = {"bf16-autocast": torch.bfloat16, "fp16-scaler": torch.float16}.get(precision)
    writer = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")])
    vitals = Vitals(_callbacks(), writer=writer, log_every_n_steps=INTERVAL, run_dir=tmp_path)
    vitals.attach(model, optimizer, scaler=scaler)
    generator = torch.Generator().manual_seed(1)
    batches = [_to(_batch(generator), "cuda") for _ in range(STEPS * MICRO_BATCHES)]
    torch.cuda.synchronize()
    with _SyncWatch(lambda: vitals.ctx.step) as watch, vitals:
        for step in range(STEPS):
            for micro in range(MICRO_BATCHES):
                batch = batches[step * MICRO_BATCHES + micro]
                vitals.batch(batch)
                with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                    loss = model(batch["input_ids"], labels=batch["labels"]).loss
                loss = loss / MICRO_BATCHES
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
        watch.step_of = lambda: None
    writer.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert {row["step"] for row in rows} == LOGGING_STEPS
    keys = {k for row in rows for k in row["metrics"]}
    assert any(k.startswith("memory/") for k in keys)  # CUDA keys arrive
    # The watch sees syncs where they are allowed (a logging step's reads), so it is working.
    assert watch.ours_on(LOGGING_STEPS), "the sync watch saw nothing on logging steps"
    _check(watch)


def test_lightning_does_not_sync_on_non_logging_steps(tmp_path: Path) -> None:
    trainer, module, loader = lightning_run(tmp_path, "gpu")
    with _SyncWatch(lightning_step_of(trainer)) as watch:
        trainer.fit(module, loader)
    assert trainer.global_step == STEPS
    assert watch.ours_on(LOGGING_STEPS), "the sync watch saw nothing on logging steps"
    _check(watch)


def test_sync_watch_sees_a_read_in_an_every_step_hook(tmp_path: Path, monkeypatch) -> None:
    """The watch itself: an ``.item()`` of a CUDA parameter added to a hook that runs every
    micro-batch is found on every checked step."""
    from trainvitals import callbacks as tv_callbacks

    cls = tv_callbacks.ThroughputMonitor
    original = cls.micro_batch_start

    def micro_batch_start(self, ctx, batch):
        original(self, ctx, batch)
        next(ctx.model.parameters()).sum().item()

    monkeypatch.setattr(cls, "micro_batch_start", micro_batch_start)
    with pytest.raises(AssertionError, match="synchronised on non-logging steps") as failure:
        test_driver_does_not_sync_on_non_logging_steps("fp32", tmp_path)
    text = str(failure.value)
    assert all(f"step {s} [MainThread]" in text for s in CHECKED_STEPS), text


# ------------------------------------------------------------------------------ kernels


@pytest.mark.parametrize("kernel", ["eager", "compile"])
def test_moments_on_cuda_equal_float64(kernel: str) -> None:
    from tests.stats.test_moments import assert_matches, reference
    from trainvitals.stats.moments import derive, fused_moments

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [
        torch.randn(3000, 1024, device="cuda", generator=g),  # rows of the chunked kernel
        100.0 + 0.5 * torch.randn(1_000_003, device="cuda", generator=g),  # |mean|/std 200
        torch.randn(5000, device="cuda", generator=g),  # the small batched path
        torch.randn(4096, 513, device="cuda", generator=g).exp(),  # skewed, heavy tail
        (1e-12 * torch.randn(300_000, device="cuda", generator=g)),  # tiny variance
        torch.randn(2048, 1024, device="cuda", generator=g).to(torch.bfloat16) - 3,
    ]
    moments = fused_moments(tensors, kernel=kernel)
    assert moments.device.type == "cuda"
    got = {k: v.cpu() for k, v in derive(moments).items()}
    for i, t in enumerate(tensors):  # the CPU kernels' tolerance (tests/stats/test_moments.py)
        assert_matches(got, i, reference(t.cpu()), f"tensor {i} ({kernel})")


# ------------------------------------------------------------------------------ norms, memory


def test_norm_monitor_huge_gradients_on_cuda_are_exact(tmp_path: Path) -> None:
    """Gradients of 1e20 per element: their float32 squares overflow (1e40 > 3.4e38); the
    norms must still be the float64 norm, finite."""
    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.callbacks import NormMonitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = RecordingWriter()
    vitals = Vitals([NormMonitor()], writer=writer, log_every_n_steps=1)
    vitals.attach(model, optimizer)
    with vitals:
        vitals.batch(torch.zeros(8, 256, device="cuda"))
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        for p in model.parameters():
            p.grad.mul_(0).add_(1e20 * torch.randn_like(p.grad).sign())
        grads = [p.grad.detach().to("cpu", torch.float64) for p in model.parameters()]
        params = [p.detach().to("cpu", torch.float64) for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    row = writer.rows[0]
    expected_grad = math.sqrt(sum(float(g.square().sum()) for g in grads))
    expected_param = math.sqrt(sum(float(p.square().sum()) for p in params))
    assert row["l2_norm/grad/global"] == pytest.approx(expected_grad, rel=1e-9)
    assert row["l2_norm/param/global"] == pytest.approx(expected_param, rel=1e-9)
    assert row["l2_norm/grad/nonfinite_count"] == 0


def test_memory_monitor_reads_the_allocator(tmp_path: Path) -> None:
    from trainvitals.callbacks import MemoryMonitor
    from trainvitals.stats.memory import BYTES_PER_GB, CUDA_STATS

    model = torch.nn.Linear(1024, 1024).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    from tests.scripts.vitals_testing import RecordingWriter

    monitor = MemoryMonitor(host=False)
    vitals = Vitals([monitor], writer=RecordingWriter(), log_every_n_steps=1)
    vitals.attach(model, optimizer)
    with vitals:
        vitals.batch(torch.zeros(4, 1024, device="cuda"))
        keep = torch.empty(64 * 1024 * 1024, device="cuda")  # 256 MiB held
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        got = monitor._read_and_reduce()
        after = torch.cuda.memory_stats()
        del keep
    for key, (stat, is_bytes) in CUDA_STATS.items():
        scale = BYTES_PER_GB if is_bytes else 1.0
        low = min(before.get(stat, 0), after.get(stat, 0)) / scale
        high = max(before.get(stat, 0), after.get(stat, 0)) / scale
        assert low <= got[f"memory/{key}"] <= high, (key, got[f"memory/{key}"], low, high)
    assert got["memory/allocated_gb"] >= 64 * 1024 * 1024 * 4 / BYTES_PER_GB


# ------------------------------------------------------------------------------ Accelerate


@pytest.mark.parametrize("mixed_precision", ["fp16", "bf16"])
def test_accelerate_does_not_sync_on_non_logging_steps(
    mixed_precision: str, tmp_path: Path
) -> None:
    """The Accelerate front door on CUDA: ``accelerator.backward`` (its GradScaler under fp16),
    ``clip_grad_norm_`` on sync steps, its prepared optimizer; every callback at once."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from trainvitals.adapters.accelerate import Vitals as AccelerateVitals

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    destroy_moe_metrics_tracker()
    reset()
    try:
        accelerator = Accelerator(
            mixed_precision=mixed_precision, gradient_accumulation_steps=MICRO_BATCHES
        )
        assert accelerator.device.type == "cuda"
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        writer = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")])
        vitals = AccelerateVitals(
            _callbacks(),
            accelerator=accelerator,
            writer=writer,
            log_every_n_steps=INTERVAL,
            run_dir=tmp_path,
        )
        vitals.attach(model, optimizer)
        generator = torch.Generator().manual_seed(1)
        batches = [_to(_batch(generator), "cuda") for _ in range(STEPS * MICRO_BATCHES)]
        torch.cuda.synchronize()
        with _SyncWatch(lambda: vitals.ctx.step) as watch:
            for batch in batches:
                vitals.batch(batch)
                with accelerator.accumulate(model):
                    loss = model(batch["input_ids"], labels=batch["labels"]).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
            watch.step_of = lambda: None
        vitals.close()
        writer.close()
    finally:
        reset()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert {row["step"] for row in rows} == LOGGING_STEPS
    keys = {k for row in rows for k in row["metrics"]}
    assert any(k.startswith("memory/") for k in keys) and "l2_norm/grad/global" in keys
    assert watch.ours_on(LOGGING_STEPS), "the sync watch saw nothing on logging steps"
    _check(watch)


# ------------------------------------------------------------------------------ tensor stats


def test_tensor_stats_on_cuda_match_float64(tmp_path: Path) -> None:
    """All four kinds of a CUDA model, two micro-batches, bf16 autocast: every tensor's
    statistics equal float64 ones of the whole tensors (the test's own hooks keep them)."""
    from tests.callbacks.test_tensor_stats_monitor import (
        VOCAB,
        Capture,
        Net,
        batches,
        check_line,
        read_lines,
    )
    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.callbacks import TensorStatsMonitor

    torch.manual_seed(0)
    model = Net().cuda()
    model.layers[0].act.inplace = False  # (the in-place case has its own CPU test)
    model.layers[1].act.inplace = False
    capture = Capture(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kinds=("param", "grad", "activation", "dgrad"))
    params: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    data = iter(batches(4))
    with Vitals([monitor], writer=RecordingWriter(), run_dir=tmp_path, log_every_n_steps=2) as v:
        v.attach(model, optimizer)
        for step in range(2):
            capture.on = step == 0
            for _ in range(2):
                ids = next(data).cuda()
                v.batch(ids)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(ids)
                loss = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, VOCAB), ids.reshape(-1)
                )
                (loss / 2).backward()
            if step == 0:
                params = {n: p.detach().double().cpu() for n, p in model.named_parameters()}
                grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
    lines = {r["kind"]: r for r in read_lines(tmp_path / "tensor_stats.jsonl") if r["step"] == 0}
    assert set(lines) == {"param", "grad", "activation", "dgrad"}
    check_line(lines["param"], params, "param")
    check_line(lines["grad"], grads, "grad")
    for kind in ("activation", "dgrad"):
        sites = {site for (k, site) in capture.data if k == kind}
        check_line(lines[kind], {s: capture.whole(kind, s).cpu() for s in sites}, kind)


# ------------------------------------------------------------------------------ throughput


def test_throughput_mfu_on_cuda_uses_the_devices_peak(tmp_path: Path) -> None:
    """On a GPU of the peak table: the measured flops of a step are torch's FlopCounterMode
    count of the same step, and MFU is flops/s over the table's peak for this device's name."""
    from torch.utils.flop_counter import FlopCounterMode

    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.callbacks import ThroughputMonitor
    from trainvitals.stats.flops import peak_flops

    peak = peak_flops(torch.cuda.get_device_name(), "bf16")
    if peak is None:
        pytest.skip(f"{torch.cuda.get_device_name()!r} is not in the peak table")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
    ).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512, device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()

    with FlopCounterMode(display=False) as counter:
        step()
    optimizer.zero_grad()
    counted = counter.get_total_flops()
    writer = RecordingWriter()
    monitor = ThroughputMonitor(measure_flops=True, warmup_steps=1, precision="bf16")
    with Vitals([monitor], writer=writer, log_every_n_steps=4) as vitals:
        vitals.attach(model, optimizer)
        for _ in range(8):
            vitals.batch(x)
            step()
            optimizer.step()
            optimizer.zero_grad()
    row = writer.rows[max(writer.rows)]
    per_step = row["throughput/flops_per_sec"] * row["throughput/seconds_per_step"]
    assert per_step == pytest.approx(counted, rel=1e-9)
    assert row["throughput/mfu"] == pytest.approx(row["throughput/flops_per_sec"] / peak)
    assert row["throughput/device/mfu"] == pytest.approx(row["throughput/mfu"])


_ASYNC_SCRIPT = """
import json, warnings
import torch
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import MemoryMonitor

assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
model = torch.nn.Linear(1024, 1024).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
writer = RecordingWriter()
with warnings.catch_warnings(record=True) as caught, Vitals(
    [MemoryMonitor(host=False)], writer=writer, log_every_n_steps=1
) as vitals:
    warnings.simplefilter("always")
    vitals.attach(model, optimizer)
    x = torch.randn(64, 1024, device="cuda")
    vitals.batch(x)
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
print(json.dumps({"row": writer.rows[0], "warnings": [str(w.message) for w in caught]}))
"""


def test_memory_monitor_under_the_cuda_malloc_async_backend() -> None:
    """``backend:cudaMallocAsync`` fills allocated, active and reserved bytes only and leaves
    the other statistics at 0: those are left out (one warning), not written as 0; the counted
    ones are there. (A new process: the backend is chosen when CUDA starts.)"""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _ASYNC_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    keys = {k.removeprefix("memory/") for k in out["row"]}
    assert keys == {
        "allocated_gb",
        "active_gb",
        "reserved_gb",
        "peak_allocated_gb",
        "peak_active_gb",
        "peak_reserved_gb",
    }
    # at least the layer's weight (4 MiB) is allocated, within what the pool reserved
    assert 4 * 2**20 / 1e9 <= out["row"]["memory/allocated_gb"] <= out["row"]["memory/reserved_gb"]
    assert sum("cudaMallocAsync backend" in w for w in out["warnings"]) == 1


# ------------------------------------------------------------------------------ compiled, z-loss


def _driver_run(
    tmp_path: Path, run: Any, params: Any, steps_of_batches: list[Any], loss_of: Any
) -> tuple[_SyncWatch, list[dict[str, Any]]]:
    """Every callback under the driver on a CUDA model (``run`` is what the loop calls,
    ``params`` its parameters), one micro-batch per step: the sync watch and the JSONL rows."""
    destroy_moe_metrics_tracker()
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    writer = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")])
    vitals = Vitals(_callbacks(), writer=writer, log_every_n_steps=INTERVAL, run_dir=tmp_path)
    vitals.attach(run, optimizer)
    torch.cuda.synchronize()
    with _SyncWatch(lambda: vitals.ctx.step) as watch, vitals:
        for batch in steps_of_batches:
            vitals.batch(batch)
            loss_of(run, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
        watch.step_of = lambda: None
    writer.close()
    return watch, read_jsonl(tmp_path / "metrics.jsonl")


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("how", ["whole", "block"])
def test_compiled_model_does_not_sync_on_non_logging_steps(how: str, tmp_path: Path) -> None:
    """A ``torch.compile``d (inductor, Triton) tiny MoE model on CUDA, whole or per block:
    TensorStatsMonitor's persistent hooks of compiled models, the flop step under the
    force_eager stance, the router capture on compiled routers; nothing of ours syncs on a
    non-logging step, and every kind is recorded on the logging steps."""
    model = _model().cuda()
    if how == "whole":
        run = torch.compile(model)
    else:
        for block in model.layers:
            block.compile()
        run = model
    generator = torch.Generator().manual_seed(1)
    batches = [_to(_batch(generator), "cuda") for _ in range(STEPS)]
    watch, rows = _driver_run(
        tmp_path,
        run,
        model.parameters(),
        batches,
        lambda m, b: m(b["input_ids"], labels=b["labels"]).loss,
    )
    assert {row["step"] for row in rows} == LOGGING_STEPS
    keys = {k for row in rows for k in row["metrics"]}
    assert any(k.startswith("moe/") for k in keys) and any(k.startswith("memory/") for k in keys)
    stats = [json.loads(s) for s in (tmp_path / "tensor_stats.jsonl").read_text().splitlines()]
    assert {(r["step"], r["kind"]) for r in stats} == {
        (s, k) for s in LOGGING_STEPS for k in ("param", "grad", "activation", "dgrad")
    }
    assert watch.ours_on(LOGGING_STEPS), "the sync watch saw nothing on logging steps"
    _check(watch)


def test_switch_transformers_z_loss_on_cuda(tmp_path: Path) -> None:
    """Switch Transformers on CUDA with every callback: the router z-loss written on each
    logging step is the mean over sparse layers of transformers' z-loss of each layer's router
    logits (float64 here), and nothing of ours syncs on a non-logging step."""
    pytest.importorskip("transformers")
    from tests.helpers.moe_models import tiny_switch_transformers

    vocab = 64
    model = tiny_switch_transformers(vocab, 4, router_z_loss_coef=0.01, dropout_rate=0.0).cuda()
    generator = torch.Generator().manual_seed(2)
    batches = [
        {
            "input_ids": torch.randint(3, vocab, (2, 7), generator=generator).cuda(),
            "labels": torch.randint(3, vocab, (2, 5), generator=generator).cuda(),
        }
        for _ in range(STEPS)
    ]
    expected: dict[int, float] = {}

    def loss_of(m: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = m(**batch, output_router_logits=True)
        logits = [*out.encoder_router_logits, *out.decoder_router_logits]
        # the test's own float64 reference (its sync is not ours: no trainvitals frame)
        per_layer = [torch.logsumexp(t.detach().double(), -1).square().mean() for t in logits]
        expected[len(expected)] = float(torch.stack(per_layer).mean())
        return out.loss

    watch, rows = _driver_run(tmp_path, model, model.parameters(), batches, loss_of)
    written = {row["step"]: row["metrics"] for row in rows}
    assert set(written) == LOGGING_STEPS
    for step in LOGGING_STEPS:
        assert written[step]["moe/z_loss_mean"] == pytest.approx(expected[step], rel=1e-5)
    assert watch.ours_on(LOGGING_STEPS), "the sync watch saw nothing on logging steps"
    _check(watch)


@pytest.mark.parametrize("which", ["TensorStatsMonitor", "NormMonitor", "every callback"])
def test_logging_step_does_not_wait_for_the_device_before_the_optimizer_step(
    which: str, tmp_path: Path
) -> None:
    """On a logging step TensorStatsMonitor computes the parameters' and gradients' moments in
    the optimizer's pre-hook (NormMonitor their norms), and reduces activations and dgrads in
    the forward and backward: all of it is queued without the host waiting for the device. A
    wait there (an index copied from pageable memory did, in both) holds the host until the
    backward has run, so the optimizer step is queued late and the device idles while the host
    launches the rest (TensorStatsMonitor: +12.3% of a 58 ms H100 step, +10.2% without). The
    reads of the step's values come at its end."""
    from trainvitals.callbacks import NormMonitor, TensorStatsMonitor

    destroy_moe_metrics_tracker()
    model = _model().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    callbacks = {
        "TensorStatsMonitor": lambda: [
            TensorStatsMonitor(
                kinds=("param", "grad", "activation", "dgrad"), activation_every_n_steps=1
            )
        ],
        "NormMonitor": lambda: [NormMonitor()],
        "every callback": _callbacks,
    }[which]()
    # (the package's writer: it takes device values without reading them on this thread)
    writer = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")])
    vitals = Vitals(callbacks, writer=writer, log_every_n_steps=1, run_dir=tmp_path)
    vitals.attach(model, optimizer)
    phase = ["step 0"]
    # after the driver's pre-hook (registered at attach), where the monitors measure
    optimizer.register_step_pre_hook(lambda *_: phase.__setitem__(0, "optimizer step"))
    generator = torch.Generator().manual_seed(4)
    batches = [_to(_batch(generator), "cuda") for _ in range(3)]
    torch.cuda.synchronize()
    with _SyncWatch(lambda: phase[0]) as watch, vitals:
        for step, batch in enumerate(batches):
            phase[0] = f"step {step} forward/backward"
            vitals.batch(batch)
            model(batch["input_ids"], labels=batch["labels"]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    writer.close()
    early = [
        s.describe()
        for s in watch.syncs
        if s.where
        and s.step in ("step 1 forward/backward", "step 2 forward/backward")
        and s.thread == "MainThread"  # (the writer's thread reads the values it was given)
        # the writer's one host copy of the previous logged step, as the next step starts
        and not re.search(r"adapters/fanout_writer\.py:\d+ _materialize", s.where)
    ]
    assert not early, "trainvitals waited for the device mid-step:\n" + "\n".join(
        dict.fromkeys(early)
    )
    if which != "NormMonitor":  # (it reads nothing on this thread: its writer's and its
        # non-finite flags' copies are read once their events completed)
        assert [s for s in watch.syncs if s.where and s.step == "optimizer step"]  # the reads
    if which == "TensorStatsMonitor":
        lines = (tmp_path / "tensor_stats.jsonl").read_text().splitlines()
        assert {(r["step"], r["kind"]) for r in map(json.loads, lines)} == {
            (s, k) for s in range(3) for k in ("param", "grad", "activation", "dgrad")
        }
