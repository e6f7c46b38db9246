"""No callback reads a tensor back to the host on a step that does not log.

The promise (README, docs/design.md, every callback docstring): on a non-logging step nothing
leaves the device, no ``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``nonzero``,
boolean-mask indexing, host-to-device copy of a Python list, ``torch.cuda.synchronize`` or
collective. There is no GPU here, so ``torch.cuda.set_sync_debug_mode`` cannot watch for it;
this is its CPU stand-in. Every public callback runs at once on the tiny MoE model, with
gradient accumulation, under the ``Vitals`` driver and under a Lightning ``Trainer``, while the
Python entry points of every host read are wrapped by a probe that notes a call when a frame of
the ``trainvitals`` package (the user model ``trainvitals/moe/tiny_model.py`` excepted) is on
the stack. On CPU such a call costs nothing, but the same line on a CUDA tensor waits for the
device, so every call is counted whatever the device; a read of a tensor that never lives on
the device would be listed in ``_HOST_ONLY`` with the reason (none is needed today).

What the probe cannot see: syncs made inside C++ operators that have no Python entry point
wrapped here, and code that runs on CUDA only (e.g. NormMonitor's deferred read of its
non-finite flags at a later step's ``step_end``: a pinned host copy read once its event has
completed, so no wait). A failing test names each call: step, what, tensor, file:line, code.

A call belongs to the step in the driver's ``ctx.step`` when it is made, except inside the
writer's ``_materialize`` (the one host copy of a logged step, made when the next step starts
or in the writer's thread), which belongs to the step whose values it copies.
"""

from __future__ import annotations

import functools
import linecache
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import trainvitals
from trainvitals import callbacks as tv_callbacks
from trainvitals.adapters import FanoutWriter, JsonlSink
from trainvitals.adapters import fanout_writer as fanout_writer_module
from trainvitals.adapters.jsonl import read_jsonl
from trainvitals.adapters.loop import Vitals
from trainvitals.moe import TinyMoELM, destroy_moe_metrics_tracker

INTERVAL = 4
# Steps 0..8: logging steps 0, 4, 8; the non-logging steps checked: 1-3 and 5-7 (step 0's
# one-time setup is not). The last step logs, so the run's end reports no steps of its own.
STEPS = 9
MICRO_BATCHES = 2
LOGGING_STEPS = set(range(0, STEPS, INTERVAL))
CHECKED_STEPS = set(range(1, STEPS)) - LOGGING_STEPS

_PACKAGE = str(Path(trainvitals.__file__).resolve().parent)
_USER_MODEL = str(Path(_PACKAGE, "moe", "tiny_model.py"))

# Calls that read tensors which never live on the device, by (file, function) of the innermost
# trainvitals frame; the value says why the read cannot wait for the device. Empty: every
# trainvitals read seen on CPU happens on a logging step.
_HOST_ONLY: dict[tuple[str, str], str] = {}

# Python entry points of host reads, on torch.Tensor. ``cpu``/``numpy``/``to(device)`` copy
# (``to`` is counted whenever it names a device: on CPU a host tensor cannot be told from a
# device one, and ``.to(x.device)`` of a host tensor is a blocking host-to-device copy).
_TENSOR_READS = (
    "item",
    "tolist",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "cpu",
    "numpy",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "bincount",  # (its length is the maximum value)
    "new_tensor",  # (host data: a blocking copy to the tensor's device)
)
# torch functions whose result size depends on the values (the host waits for the device).
_TORCH_READS = ("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount")
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "monitored_barrier",
    "send",
    "recv",
)


@dataclass(frozen=True)
class _Call:
    what: str
    step: int | None
    file: str  # innermost trainvitals frame, relative to the package
    line: int
    function: str
    tensor: str  # device/dtype/shape of the tensor read, or ""
    main_thread: bool

    def describe(self) -> str:
        code = linecache.getline(str(Path(_PACKAGE, self.file)), self.line).strip()
        where = "" if self.main_thread else " (writer thread)"
        return (
            f"step {self.step}: {self.what} on {self.tensor or '-'} at trainvitals/{self.file}:"
            f"{self.line} in {self.function}(){where}: {code}"
        )


def _describe(tensor: Any) -> str:
    if not isinstance(tensor, torch.Tensor):
        return ""
    return f"{tensor.device.type} {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def _is_mask(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    return isinstance(index, tuple) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index
    )


def _device_like(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``Tensor.to`` call names a device (a device, a string, another tensor)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, torch.device | str | torch.Tensor) for a in args)


class _Probe:
    """Wraps the host-read entry points; notes each call made under a trainvitals frame."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[_Call] = []
        self.step_of: Callable[[], int | None] = lambda: None
        self._local = threading.local()
        for name in _TENSOR_READS:
            self._wrap(monkeypatch, torch.Tensor, name, name)
        for name in _TORCH_READS:
            self._wrap(monkeypatch, torch, name, f"torch.{name}")
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self._wrap(monkeypatch, dist, name, f"dist.{name}", tensor_arg=False)
        self._wrap(monkeypatch, torch.cuda, "synchronize", "torch.cuda.synchronize", False)
        self._wrap_when(
            monkeypatch, torch, "where", "torch.where(cond)", lambda a, k: len(a) + len(k) == 1
        )
        for owner in (torch, torch.Tensor):  # (without output_size: sum(repeats) is read)
            self._wrap_when(
                monkeypatch,
                owner,
                "repeat_interleave",
                "repeat_interleave(tensor repeats)",
                lambda a, k: (
                    isinstance(a[1] if len(a) > 1 else k.get("repeats"), torch.Tensor)
                    and k.get("output_size") is None
                ),
            )
        self._wrap_when(
            monkeypatch,
            torch.Tensor,
            "__getitem__",
            "boolean-mask index",
            lambda a, k: _is_mask(a[1]),
        )
        self._wrap_when(
            monkeypatch,
            torch.Tensor,
            "__setitem__",
            "boolean-mask assignment",
            lambda a, k: _is_mask(a[1]),
        )
        for name in ("index_put", "index_put_"):
            self._wrap_when(
                monkeypatch,
                torch.Tensor,
                name,
                f"{name} (boolean mask)",
                lambda a, k: _is_mask(tuple(a[1] if len(a) > 1 else k.get("indices", ()))),
            )
        self._wrap_when(
            monkeypatch,
            torch.nn.functional,
            "one_hot",
            "one_hot without num_classes",
            lambda a, k: (a[1] if len(a) > 1 else k.get("num_classes", -1)) < 0,
        )
        self._wrap_when(
            monkeypatch, torch.Tensor, "to", "to(device)", lambda a, k: _device_like(a[1:], k)
        )
        for name in ("tensor", "as_tensor"):
            self._wrap_when(
                monkeypatch,
                torch,
                name,
                f"torch.{name}(host data, device=)",
                lambda a, k: (
                    k.get("device") is not None
                    and not isinstance(a[0] if a else k.get("data"), torch.Tensor)
                ),
                tensor_arg=False,
            )
        # The writer's host copy of a logged step belongs to that step.
        original = fanout_writer_module._materialize

        @functools.wraps(original)
        def materialize(batch: Any, *args: Any, **kwargs: Any) -> Any:
            self._local.step = batch.step
            try:
                return original(batch, *args, **kwargs)
            finally:
                self._local.step = None

        monkeypatch.setattr(fanout_writer_module, "_materialize", materialize)

    def _wrap(
        self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, what: str, tensor_arg=True
    ) -> None:
        self._wrap_when(monkeypatch, owner, name, what, None, tensor_arg=tensor_arg)

    def _wrap_when(
        self,
        monkeypatch: pytest.MonkeyPatch,
        owner: Any,
        name: str,
        what: str,
        when: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None,
        tensor_arg: bool = True,
    ) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if when is None or when(args, kwargs):
                self._note(what, args[0] if tensor_arg and args else None)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    def _note(self, what: str, tensor: Any) -> None:
        frame = sys._getframe(2)  # the caller of the wrapped function
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename.startswith(_PACKAGE) and filename != _USER_MODEL:
                break
            frame = frame.f_back
        if frame is None:  # the user's loop, model, Lightning or torch: theirs to sync
            return
        step = getattr(self._local, "step", None)
        if step is None:
            step = self.step_of()
        self.calls.append(
            _Call(
                what=what,
                step=step,
                file=str(Path(frame.f_code.co_filename).relative_to(_PACKAGE)),
                line=frame.f_lineno,
                function=frame.f_code.co_name,
                tensor=_describe(tensor),
                main_thread=threading.current_thread() is threading.main_thread(),
            )
        )

    def on(self, steps: set[int]) -> list[_Call]:
        return [c for c in self.calls if c.step in steps]


def _model() -> TinyMoELM:
    torch.manual_seed(0)
    return TinyMoELM(
        vocab_size=32,
        hidden_size=16,
        num_layers=2,
        num_experts=4,
        top_k=2,
        ffn_hidden_size=16,
        num_heads=2,
        max_seq_len=16,
    )


def _batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 32, (2, 9), generator=generator)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def _callbacks() -> list[tv_callbacks.VitalsCallback]:
    built = []
    for name in sorted(tv_callbacks._MODULES):
        cls = getattr(tv_callbacks, name)
        if name == "TensorStatsMonitor":
            built.append(
                cls(
                    kinds=("param", "grad", "activation", "dgrad"),
                    activation_every_n_steps=INTERVAL,
                    layer_pattern=r"layers\.(\d+)\.",
                )
            )
        elif name == "ThroughputMonitor":
            built.append(cls(measure_flops=True, warmup_steps=0))
        elif name == "RuntimeMonitor":
            built.append(cls(warmup_steps=0))
        else:
            built.append(cls())
    return built


def _found(probe: _Probe) -> list[_Call]:
    """The calls on checked (non-logging) steps that are not known to read host memory."""
    return [c for c in probe.on(CHECKED_STEPS) if (c.file, c.function) not in _HOST_ONLY]


def _check(probe: _Probe) -> None:
    found = _found(probe)
    assert not found, "host reads by trainvitals on non-logging steps:\n" + "\n".join(
        dict.fromkeys(c.describe() for c in found)
    )
    # The probe sees reads where they are allowed: the writer's one host copy of each logged
    # step, and the callbacks' own reads at their logging steps.
    for step in LOGGING_STEPS:
        files = {c.file for c in probe.on({step})}
        assert "adapters/fanout_writer.py" in files, (step, files)
        assert any(f.startswith("callbacks/") for f in files), (step, files)


def _run_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _Probe:
    destroy_moe_metrics_tracker()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # background=False: the writer's host copy runs on the training thread, at the start of
    # the step after the logged one (attributed to the logged step, see _Probe)
    writer = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")], background=False)
    vitals = Vitals(_callbacks(), writer=writer, log_every_n_steps=INTERVAL, run_dir=tmp_path)
    vitals.attach(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    batches = [_batch(generator) for _ in range(STEPS * MICRO_BATCHES)]

    probe = _Probe(monkeypatch)
    probe.step_of = lambda: vitals.ctx.step
    with vitals:
        for step in range(STEPS):
            for micro in range(MICRO_BATCHES):
                batch = batches[step * MICRO_BATCHES + micro]
                vitals.batch(batch)
                loss = model(batch["input_ids"], labels=batch["labels"]).loss
                (loss / MICRO_BATCHES).backward()
            optimizer.step()
            optimizer.zero_grad()
        probe.step_of = lambda: None  # closing the run is no step's
    writer.close()
    monkeypatch.undo()
    assert {row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")} == LOGGING_STEPS
    return probe


def test_driver_reads_nothing_on_non_logging_steps(tmp_path, monkeypatch):
    _check(_run_driver(tmp_path, monkeypatch))


def test_probe_sees_a_device_read_in_an_every_step_hook(tmp_path, monkeypatch):
    """The probe itself: one ``.item()`` of a parameter (a device tensor in a GPU run) added
    to a hook that runs every micro-batch is found on every checked step."""
    cls = tv_callbacks.ThroughputMonitor
    original = cls.micro_batch_start

    def micro_batch_start(self, ctx, batch):
        original(self, ctx, batch)
        next(ctx.model.parameters()).sum().item()

    monkeypatch.setattr(cls, "micro_batch_start", micro_batch_start)
    probe = _run_driver(tmp_path, monkeypatch)
    found = _found(probe)
    assert sorted({c.step for c in found}) == sorted(CHECKED_STEPS)
    assert len(found) == len(CHECKED_STEPS) * MICRO_BATCHES
    assert {(c.what, c.file, c.function) for c in found} == {
        ("item", "callbacks/base.py", "_dispatch")
    }
    with pytest.raises(AssertionError, match="host reads by trainvitals on non-logging steps"):
        _check(probe)


def lightning_run(tmp_path: Path, accelerator: str) -> tuple[Any, Any, Any]:
    """Every callback in a Lightning ``Trainer`` on the tiny MoE model: ``(trainer, module,
    loader)`` ready for ``trainer.fit(module, loader)`` (also used by tests/test_cuda.py)."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    destroy_moe_metrics_tracker()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model()

        def training_step(self, batch, batch_idx):
            return self.model(batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    generator = torch.Generator().manual_seed(2)
    data = [_batch(generator) for _ in range(STEPS * MICRO_BATCHES)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer = pl.Trainer(
        max_steps=STEPS,
        accumulate_grad_batches=MICRO_BATCHES,
        log_every_n_steps=INTERVAL,
        accelerator=accelerator,
        devices=1,
        logger=CSVLogger(tmp_path, name="csv"),
        callbacks=_callbacks(),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    return trainer, Module(), loader


def lightning_step_of(trainer: Any) -> Callable[[], int | None]:
    """The step a host read of a Lightning run belongs to (``None``: the run's end)."""

    def step_of() -> int | None:
        ctx = getattr(trainer, "_trainvitals_ctx", None)
        return None if ctx is None or ctx.step >= STEPS else ctx.step

    return step_of


def test_lightning_reads_nothing_on_non_logging_steps(tmp_path, monkeypatch):
    trainer, module, loader = lightning_run(tmp_path, "cpu")
    probe = _Probe(monkeypatch)
    probe.step_of = lightning_step_of(trainer)
    trainer.fit(module, loader)
    monkeypatch.undo()

    assert trainer.global_step == STEPS
    _check(probe)
