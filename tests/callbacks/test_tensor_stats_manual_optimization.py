"""TensorStatsMonitor under Lightning's manual optimization with several optimizers (a GAN).

Each optimizer's parameters and gradients are measured right before its own ``step()``; the
step's ``param`` and ``grad`` records hold every parameter once. The references are taken by
the LightningModule's own ``on_before_optimizer_step`` (called after the callbacks'), copied
in float64, and their moments computed with numpy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.callbacks.test_tensor_stats_monitor import check_line, read_lines
from tests.scripts.vitals_testing import (
    RecordingWriter,
    lsgan_manual_step,
    manual_optimization_module,
    quiet_trainer,
)
from tests.stats.test_moments import reference
from trainvitals.callbacks import TensorStatsMonitor

BATCHES = 3


def _gan_module_cls(pl):
    class LitGAN(pl.LightningModule):
        def __init__(self, toggle: bool) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
            self.disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
            # trainable, in no optimizer: measured with the batch's first optimizer.step()
            self.scale = nn.Parameter(torch.full((6,), 1.5))
            self.toggle = toggle
            self.batch_step = -1
            # (global_step at the batch's start, name) -> float64 (value, gradient) at the
            # step() of the parameter's optimizer (no optimizer: the batch's first step())
            self.refs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}

        def training_step(self, batch, batch_idx):
            self.batch_step = self.global_step
            real, z = batch
            lsgan_manual_step(self, real, lambda: self.gen(z) * self.scale, self.toggle)

        def on_before_optimizer_step(self, optimizer):
            stepping = {id(p) for g in optimizer.param_groups for p in g["params"]}
            every = {
                id(p) for o in self.trainer.optimizers for g in o.param_groups for p in g["params"]
            }
            for name, p in self.named_parameters():
                if id(p) in stepping or id(p) not in every:
                    grad = None if p.grad is None else p.grad.detach().double().clone()
                    self.refs.setdefault(
                        (self.batch_step, name), (p.detach().double().clone(), grad)
                    )

        def configure_optimizers(self):
            return (
                torch.optim.SGD(self.gen.parameters(), lr=0.3),
                torch.optim.SGD(self.disc.parameters(), lr=0.3),
            )

    return LitGAN


def _fit_gan(tmp_path: Path, toggle: bool, interval: int, kinds=("param", "grad")):
    pl = pytest.importorskip("lightning.pytorch")
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * BATCHES, 6, generator=g), torch.randn(4 * BATCHES, 4, generator=g)
    )
    module = _gan_module_cls(pl)(toggle)
    writer = RecordingWriter()
    monitor = TensorStatsMonitor(kinds=list(kinds), kernel="eager", writer=writer)
    trainer = quiet_trainer(
        max_epochs=1, log_every_n_steps=interval, callbacks=[monitor], default_root_dir=tmp_path
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.global_step == 2 * BATCHES  # every optimizer.step() counts
    return module, writer, read_lines(Path(trainer.default_root_dir) / "tensor_stats.jsonl")


def _check_step(module, lines: list[dict], step: int) -> None:
    names = [n for n, _ in module.named_parameters()]
    records = {r["kind"]: r for r in lines if r["step"] == step}
    assert set(records) == {"param", "grad"}
    params = {n: module.refs[step, n][0] for n in names}
    grads = {n: module.refs[step, n][1] for n in names}
    assert all(g is not None for g in grads.values())
    check_line(records["param"], params, f"param at {step}")
    check_line(records["grad"], grads, f"grad at {step}")


@pytest.mark.parametrize("toggle", [False, True], ids=["plain", "toggle_optimizer"])
def test_each_optimizer_is_measured_at_its_own_step(tmp_path: Path, toggle: bool) -> None:
    module, writer, lines = _fit_gan(tmp_path, toggle, interval=1)
    # A batch is one step keyed by trainer.global_step at its start: 0, 2, 4; one record per
    # kind per step, holding every parameter once.
    assert [(r["step"], r["kind"]) for r in lines] == [
        (s, k) for s in (0, 2, 4) for k in ("param", "grad")
    ]
    for step in (0, 2, 4):
        _check_step(module, lines, step)
        # the scalar summaries cover both optimizers' parameters too
        rms = [reference(module.refs[step, n][1])["rms"] for n, _ in module.named_parameters()]
        got = writer.rows[step]["tensor_stats/grad/rms_max"]
        assert got == pytest.approx(max(rms), rel=1e-9)


def test_interval_counts_batches_of_several_optimizer_steps(tmp_path: Path) -> None:
    # global_step advances by 2 per batch: with an interval of 4 steps, batches 0 and 2 log,
    # each with both optimizers' parameters (never one optimizer alone).
    module, _, lines = _fit_gan(tmp_path, toggle=True, interval=4)
    assert sorted({r["step"] for r in lines}) == [0, 4]
    for step in (0, 4):
        _check_step(module, lines, step)


def test_activation_interval_holds_in_optimizer_steps_as_the_param_interval(
    tmp_path: Path,
) -> None:
    # Batches start at steps 0, 2, 4; with an interval of 3 each multiple of 3 is logged by the
    # first batch starting at or after it (should_log): 0 and 4 (3 lies in (2, 4]). The
    # activations follow the same rule as params and grads (they tested the batch's first step
    # alone: step 0 only).
    expected = [b for a, b in zip([-1, 0, 2], [0, 2, 4], strict=True) if (b // 3) > (a // 3)]
    _, _, lines = _fit_gan(tmp_path, toggle=True, interval=3, kinds=("param", "activation"))
    steps = {
        k: sorted({r["step"] for r in lines if r["kind"] == k}) for k in ("param", "activation")
    }
    assert expected == [0, 4]
    assert steps == {"param": expected, "activation": expected}


class _RecordingLinear(nn.Linear):
    """A Linear that keeps its last input, so that the test can recompute its gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_input = x.detach().double().clone()
        return super().forward(x)


def test_three_optimizers_each_stepped_after_its_own_backward(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    torch.manual_seed(1)
    layers = [_RecordingLinear(3, 4 + i) for i in range(3)]
    at_batch_start: dict[int, dict[str, torch.Tensor]] = {}

    def on_batch(batch_idx: int) -> None:
        # the layers are independent: each one's weights at its own step() are those at the
        # batch's start (the step() of another optimizer does not touch them)
        at_batch_start[batch_idx] = {
            f"layers.{i}.{n}": p.detach().double().clone()
            for i, layer in enumerate(layers)
            for n, p in layer.named_parameters()
        }

    module = manual_optimization_module(layers, samples=8, on_batch=on_batch)
    monitor = TensorStatsMonitor(kinds=["param", "grad"], kernel="eager", writer=RecordingWriter())
    # 3 optimizer steps per batch: batches start at global_step 0, 3, 6, 9; with an interval of
    # 2 steps each multiple of 2 is logged by the first batch starting at or after it
    # (should_log): 0, 2 -> 3, 4 and 6 -> 6, 8 -> 9: every batch logs
    trainer = quiet_trainer(
        max_epochs=1, log_every_n_steps=2, callbacks=[monitor], default_root_dir=tmp_path
    )
    inputs: dict[int, list[torch.Tensor]] = {}

    class KeepInputs(pl.Callback):  # each batch's inputs, for the reference gradients
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            inputs[batch_idx] = [layer.last_input for layer in layers]

    trainer.callbacks.append(KeepInputs())
    trainer.fit(module)
    lines = read_lines(Path(trainer.default_root_dir) / "tensor_stats.jsonl")
    starts = [0, 3, 6, 9]
    logged = [b for a, b in zip([-1, *starts[:-1]], starts, strict=True) if b // 2 > a // 2]
    assert [(r["step"], r["kind"]) for r in lines] == [
        (s, k) for s in logged for k in ("param", "grad")
    ]
    for step, batch_idx in ((s, starts.index(s)) for s in logged):
        params = at_batch_start[batch_idx]
        grads = {}
        for i, x in enumerate(inputs[batch_idx]):
            w = params[f"layers.{i}.weight"].clone().requires_grad_(True)
            b = params[f"layers.{i}.bias"].clone().requires_grad_(True)
            loss = (x @ w.T + b).pow(2).mean()
            grads[f"layers.{i}.weight"], grads[f"layers.{i}.bias"] = torch.autograd.grad(
                loss, (w, b)
            )
        records = {r["kind"]: r for r in lines if r["step"] == step}
        check_line(records["param"], params, f"param at {step}")
        check_line(records["grad"], grads, f"grad at {step}")
