"""NormMonitor and gradient clipping under Lightning's manual optimization.

A ``training_step`` that clips (``self.clip_gradients(opt, ...)``, as Lightning's docs show for
manual optimization) does so before ``opt.step()``, whose ``on_before_optimizer_step`` comes
after the clipping. The logged gradient norm must still be the unclipped one (the keys'
documentation: "after AMP unscaling, before clipping"). The reference is taken in float64 by the
module itself, right before it clips.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import RecordingWriter, float64_norms
from tests.scripts.vitals_testing import quiet_trainer
from trainvitals.callbacks.norm_monitor import NormMonitor

REL = 1e-6
BATCHES = 3
CLIP = 1e-3


def _module_cls(pl, two_optimizers: bool, algorithm: str):
    class LitClipping(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
            self.disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
            # (global_step at the batch's start, optimizer index) -> (param, grad) norms before
            # clipping, of that optimizer's parameters
            self.refs: dict[tuple[int, int], tuple[float, float]] = {}
            self.clipped: list[float] = []
            self.grad_refs: dict[tuple[int, str], torch.Tensor] = {}  # float64, before clipping

        def _clip_and_step(self, opt, index: int, step: int) -> None:
            params = [p for g in opt.optimizer.param_groups for p in g["params"]]
            self.refs[step, index] = float64_norms(params)
            owned = {id(p) for p in params}
            for name, p in self.named_parameters():
                if id(p) in owned:
                    self.grad_refs[step, name] = p.grad.detach().double().clone()
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm=algorithm)
            # clipped twice: the second clip changes nothing the monitor reports
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm=algorithm)
            self.clipped.append(float64_norms(params)[1])
            opt.step()

        def training_step(self, batch, batch_idx):
            step = self.trainer.global_step
            real, z = batch
            if two_optimizers:
                opt_g, opt_d = self.optimizers()
            else:
                opt_g, opt_d = self.optimizers(), None
            fake = self.gen(z)
            opt_g.zero_grad()
            self.manual_backward((self.disc(fake) - 1).pow(2).mean() * 100)
            self._clip_and_step(opt_g, 0, step)
            if opt_d is not None:
                d_loss = (
                    self.disc(fake.detach()).pow(2).mean() + (self.disc(real) - 1).pow(2).mean()
                )
                opt_d.zero_grad()
                self.manual_backward(d_loss * 100)
                self._clip_and_step(opt_d, 1, step)

        def configure_optimizers(self):
            if two_optimizers:
                return (
                    torch.optim.SGD(self.gen.parameters(), lr=0.1),
                    torch.optim.SGD(self.disc.parameters(), lr=0.1),
                )
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return LitClipping


def _fit(tmp_path, two_optimizers: bool, algorithm: str, extra_callbacks=()):
    pl = pytest.importorskip("lightning.pytorch")
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * BATCHES, 6, generator=g), torch.randn(4 * BATCHES, 4, generator=g)
    )
    module = _module_cls(pl, two_optimizers, algorithm)()
    writer = RecordingWriter()
    trainer = quiet_trainer(
        devices=1,
        max_epochs=1,
        log_every_n_steps=1,
        callbacks=[NormMonitor(writer=writer, per_param="gen.0.weight"), *extra_callbacks],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    # the wrapper is gone with the fit: Lightning's own clip_gradients again
    assert "clip_gradients" not in vars(trainer.strategy.precision_plugin)
    return module, writer


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_manual_optimization_clipping_in_training_step_logs_the_unclipped_norm(tmp_path, algorithm):
    module, writer = _fit(tmp_path, two_optimizers=False, algorithm=algorithm)
    assert sorted(writer.steps) == list(range(BATCHES))
    for step, row in writer.steps.items():
        p_ref, g_ref = module.refs[step, 0]
        assert g_ref > 100 * CLIP  # the clipping changes the norm a lot
        assert row["l2_norm/grad/global"] == pytest.approx(g_ref, rel=REL)
        assert row["l2_norm/param/global"] == pytest.approx(p_ref, rel=REL)
        assert row["l2_norm/grad/nonfinite_count"] == 0
        assert "l2_norm/grad/gen.0.weight" in row
    assert max(module.clipped) < 100 * CLIP  # (it did clip)


def test_manual_optimization_two_optimizers_each_clipped_logs_unclipped_norms(tmp_path):
    module, writer = _fit(tmp_path, two_optimizers=True, algorithm="norm")
    # global_step counts both step() calls: the batches start at 0, 2, 4
    assert sorted(writer.steps) == [0, 2, 4]
    for step, row in writer.steps.items():
        (p_g, g_g), (p_d, g_d) = module.refs[step, 0], module.refs[step, 1]
        assert min(g_g, g_d) > 100 * CLIP
        assert row["l2_norm/grad/optimizer_0"] == pytest.approx(g_g, rel=REL)
        assert row["l2_norm/grad/optimizer_1"] == pytest.approx(g_d, rel=REL)
        assert row["l2_norm/param/optimizer_0"] == pytest.approx(p_g, rel=REL)
        assert row["l2_norm/param/optimizer_1"] == pytest.approx(p_d, rel=REL)
        assert row["l2_norm/grad/global"] == pytest.approx((g_g**2 + g_d**2) ** 0.5, rel=REL)


def test_manual_optimization_clipping_tensor_stats_grads_are_the_unclipped_ones(tmp_path):
    """Every callback reading gradients sees them before the clipping (the trainer-wide
    wrapper shows them to all trainvitals callbacks, once per optimizer and step)."""
    from tests.callbacks.test_tensor_stats_monitor import check_line, read_lines
    from trainvitals.callbacks import TensorStatsMonitor

    monitor = TensorStatsMonitor(kinds=["grad"], kernel="eager", log_every_n_steps=1)
    module, writer = _fit(tmp_path, False, "norm", extra_callbacks=[monitor])
    lines = read_lines(tmp_path / "tensor_stats.jsonl")
    assert [(r["step"], r["kind"]) for r in lines] == [(s, "grad") for s in range(BATCHES)]
    names = [n for n, _ in module.named_parameters()]
    for record in lines:
        step = record["step"]
        check_line(record, {n: module.grad_refs[step, n] for n in names}, f"grad at {step}")
        assert writer.steps[step]["l2_norm/grad/global"] == pytest.approx(
            module.refs[step, 0][1], rel=REL
        )
