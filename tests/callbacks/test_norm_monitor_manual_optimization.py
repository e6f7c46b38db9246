"""NormMonitor under Lightning's manual optimization with several optimizers (a GAN).

Each optimizer's parameters are measured right before its own ``step()``; the step's keys merge
the optimizers' parts. The reference is taken by the LightningModule's own
``on_before_optimizer_step`` (called after the callbacks'), in float64, per optimizer.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import RecordingWriter, float64_norms
from tests.scripts.vitals_testing import lsgan_manual_step
from trainvitals.callbacks.norm_monitor import NormMonitor

REL = 1e-6
BATCHES = 3


def _gan_module_cls(pl):
    class LitGAN(pl.LightningModule):
        def __init__(self, toggle: bool) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
            self.disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
            self.toggle = toggle
            # (trainer.global_step, optimizer index) -> (param norm, grad norm) of its params
            self.refs: dict[tuple[int, int], tuple[float, float]] = {}
            self.per_tensor: dict[tuple[int, str], float] = {}

        def training_step(self, batch, batch_idx):
            real, z = batch
            lsgan_manual_step(self, real, lambda: self.gen(z), self.toggle)

        def on_before_optimizer_step(self, optimizer):
            index = next(i for i, o in enumerate(self.trainer.optimizers) if o is optimizer)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            step = self.trainer.global_step
            self.refs[step, index] = float64_norms(params)
            for name, p in self.named_parameters():
                if any(p is q for q in params) and p.grad is not None:
                    self.per_tensor[step, name] = float(p.grad.double().norm())

        def configure_optimizers(self):
            return (
                torch.optim.SGD(self.gen.parameters(), lr=0.3),
                torch.optim.SGD(self.disc.parameters(), lr=0.3),
            )

    return LitGAN


def _fit(tmp_path, toggle: bool, interval: int, **monitor_kwargs):
    pl = pytest.importorskip("lightning.pytorch")
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * BATCHES, 6, generator=g), torch.randn(4 * BATCHES, 4, generator=g)
    )
    module = _gan_module_cls(pl)(toggle)
    writer = RecordingWriter()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        log_every_n_steps=interval,
        callbacks=[NormMonitor(writer=writer, **monitor_kwargs)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.global_step == 2 * BATCHES  # every optimizer.step() counts
    return module, writer


@pytest.mark.parametrize("toggle", [False, True], ids=["plain", "toggle_optimizer"])
def test_each_optimizer_is_measured_at_its_own_step_and_merged(tmp_path, toggle):
    module, writer = _fit(tmp_path, toggle, interval=1, per_param=["gen.0.weight", "disc.2.*"])
    # A batch is one step whose key is trainer.global_step at its start: 0, 2, 4.
    assert sorted(writer.steps) == [0, 2, 4]
    for step, row in writer.steps.items():
        (p_g, g_g), (p_d, g_d) = module.refs[step, 0], module.refs[step + 1, 1]
        assert row["l2_norm/param/global"] == pytest.approx(math.hypot(p_g, p_d), rel=REL)
        assert row["l2_norm/grad/global"] == pytest.approx(math.hypot(g_g, g_d), rel=REL)
        assert row["l2_norm/grad/optimizer_0"] == pytest.approx(g_g, rel=REL)
        assert row["l2_norm/grad/optimizer_1"] == pytest.approx(g_d, rel=REL)
        assert row["l2_norm/param/optimizer_0"] == pytest.approx(p_g, rel=REL)
        assert row["l2_norm/param/optimizer_1"] == pytest.approx(p_d, rel=REL)
        assert row["l2_norm/grad/nonfinite_count"] == 0
        # per-parameter norms come from the step of the parameter's own optimizer
        gen_ref = module.per_tensor[step, "gen.0.weight"]
        assert row["l2_norm/grad/gen.0.weight"] == pytest.approx(gen_ref, rel=REL)
        for name in ("disc.2.weight", "disc.2.bias"):
            ref = module.per_tensor[step + 1, name]
            assert row[f"l2_norm/grad/{name}"] == pytest.approx(ref, rel=REL)


def test_interval_counts_batches_of_several_optimizer_steps(tmp_path):
    # global_step advances by 2 per batch: with an interval of 4 steps, batches 0 and 2 log,
    # each with both optimizers' norms (never one optimizer alone).
    module, writer = _fit(tmp_path, toggle=True, interval=4)
    assert sorted(writer.steps) == [0, 4]
    for step, row in writer.steps.items():
        g_ref = math.hypot(module.refs[step, 0][1], module.refs[step + 1, 1][1])
        assert row["l2_norm/grad/global"] == pytest.approx(g_ref, rel=REL)
