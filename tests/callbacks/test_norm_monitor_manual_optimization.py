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
from tests.scripts.vitals_testing import lsgan_manual_step, quiet_trainer
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
    trainer = quiet_trainer(
        devices=1,
        max_epochs=1,
        log_every_n_steps=interval,
        callbacks=[NormMonitor(writer=writer, **monitor_kwargs)],
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


# ------------------------------------------ one optimizer stepped several times per batch

CRITIC_STEPS = 3


def _critic_module_cls(pl):
    """A WGAN-style batch: the critic (``opt_d``, index 1) steps ``CRITIC_STEPS`` times, then
    the generator (``opt_g``, index 0) once. With ``bad_first_critic_grad`` the critic's first
    gradient of each batch holds an Inf, which the module's own ``on_before_optimizer_step``
    (after the callbacks') zeroes before the update, so the weights stay finite."""

    class LitCritic(pl.LightningModule):
        def __init__(self, bad_first_critic_grad: bool) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
            self.disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
            self.bad_first_critic_grad = bad_first_critic_grad
            self.refs: dict[tuple[int, int], tuple[float, float]] = {}
            self.per_tensor: dict[tuple[int, str], float] = {}

        def training_step(self, batch, batch_idx):
            real, z = batch
            opt_g, opt_d = self.optimizers()
            for k in range(CRITIC_STEPS):
                fake = self.gen(z).detach()
                d_loss = self.disc(fake).mean() - self.disc(real * (1 + k)).mean()
                opt_d.zero_grad()
                self.manual_backward(d_loss)
                if self.bad_first_critic_grad and k == 0:
                    self.disc[2].weight.grad[0, 0] = math.inf
                opt_d.step()
            g_loss = -self.disc(self.gen(z)).mean()
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()

        def on_before_optimizer_step(self, optimizer):
            index = next(i for i, o in enumerate(self.trainer.optimizers) if o is optimizer)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            step = self.trainer.global_step
            self.refs[step, index] = float64_norms(params)
            for name, p in self.named_parameters():
                if any(p is q for q in params) and p.grad is not None:
                    self.per_tensor[step, name] = float(p.grad.double().norm())
                    p.grad.nan_to_num_(posinf=0.0)  # the update stays finite

        def configure_optimizers(self):
            return (
                torch.optim.SGD(self.gen.parameters(), lr=0.05),
                torch.optim.SGD(self.disc.parameters(), lr=0.05),
            )

    return LitCritic


def _fit_critic(tmp_path, bad_first_critic_grad: bool):
    pl = pytest.importorskip("lightning.pytorch")
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * BATCHES, 6, generator=g), torch.randn(4 * BATCHES, 4, generator=g)
    )
    module = _critic_module_cls(pl)(bad_first_critic_grad)
    writer = RecordingWriter()
    trainer = quiet_trainer(
        devices=1,
        max_epochs=1,
        log_every_n_steps=1,
        callbacks=[NormMonitor(writer=writer, per_param=["disc.0.weight", "gen.2.bias"])],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.global_step == (CRITIC_STEPS + 1) * BATCHES
    return module, writer


def test_an_optimizer_stepped_several_times_per_batch_shows_its_last_step(tmp_path):
    module, writer = _fit_critic(tmp_path, bad_first_critic_grad=False)
    per_batch = CRITIC_STEPS + 1
    assert sorted(writer.steps) == [per_batch * b for b in range(BATCHES)]
    for step, row in writer.steps.items():
        last_critic = step + CRITIC_STEPS - 1  # global_step of the critic's last step()
        p_d, g_d = module.refs[last_critic, 1]
        p_g, g_g = module.refs[step + CRITIC_STEPS, 0]
        # the critic's earlier step()s of the batch had other gradients (and weights)
        assert not math.isclose(module.refs[step, 1][1], g_d, rel_tol=1e-3)
        assert row["l2_norm/grad/optimizer_1"] == pytest.approx(g_d, rel=REL)
        assert row["l2_norm/param/optimizer_1"] == pytest.approx(p_d, rel=REL)
        assert row["l2_norm/grad/optimizer_0"] == pytest.approx(g_g, rel=REL)
        assert row["l2_norm/param/optimizer_0"] == pytest.approx(p_g, rel=REL)
        # each parameter counted once: the global norms hold the critic's last measurement
        assert row["l2_norm/grad/global"] == pytest.approx(math.hypot(g_g, g_d), rel=REL)
        assert row["l2_norm/param/global"] == pytest.approx(math.hypot(p_g, p_d), rel=REL)
        ref = module.per_tensor[last_critic, "disc.0.weight"]
        assert row["l2_norm/grad/disc.0.weight"] == pytest.approx(ref, rel=REL)
        ref = module.per_tensor[step + CRITIC_STEPS, "gen.2.bias"]
        assert row["l2_norm/grad/gen.2.bias"] == pytest.approx(ref, rel=REL)
        assert row["l2_norm/grad/nonfinite_count"] == 0


def test_a_nonfinite_gradient_at_an_earlier_step_of_the_same_optimizer_stays_counted(tmp_path):
    with pytest.warns(
        RuntimeWarning, match=r"1 gradient\(s\) hold NaN/Inf at step \d+: disc.2.weight "
    ):
        module, writer = _fit_critic(tmp_path, bad_first_critic_grad=True)
    for step, row in writer.steps.items():
        assert math.isinf(module.per_tensor[step, "disc.2.weight"])  # the critic's first step()
        # the critic's last step() had finite gradients: the norms are those
        _, g_d = module.refs[step + CRITIC_STEPS - 1, 1]
        assert math.isfinite(g_d)
        assert row["l2_norm/grad/optimizer_1"] == pytest.approx(g_d, rel=REL)
        # and the Inf of its first step() is counted, once
        assert row["l2_norm/grad/nonfinite_count"] == 1


def _driver_gan():
    """A seeded generator and critic, their ModuleDict and one SGD optimizer each (driver tests)."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    model = nn.ModuleDict({"gen": gen, "disc": disc})
    return (
        gen,
        disc,
        model,
        torch.optim.SGD(gen.parameters(), lr=0.05),
        torch.optim.SGD(disc.parameters(), lr=0.05),
    )


def test_driver_critic_stepped_several_times_per_batch_shows_its_last_step():
    from trainvitals.adapters.loop import Vitals

    gen, disc, model, opt_g, opt_d = _driver_gan()
    writer = RecordingWriter()
    refs: dict[int, dict[str, tuple[float, float]]] = {}
    g = torch.Generator().manual_seed(5)
    with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1) as vitals:
        vitals.attach(model, [opt_g, opt_d])
        for step in range(BATCHES):
            real, z = torch.randn(4, 6, generator=g), torch.randn(4, 4, generator=g)
            vitals.batch(real)
            for k in range(CRITIC_STEPS):
                opt_d.zero_grad()
                (disc(gen(z).detach()).mean() - disc(real * (1 + k)).mean()).backward()
                refs.setdefault(step, {})[f"disc{k}"] = float64_norms(list(disc.parameters()))
                opt_d.step()
            opt_g.zero_grad()
            (-disc(gen(z)).mean()).backward()
            refs[step]["gen"] = float64_norms(list(gen.parameters()))
            opt_g.step()
    assert sorted(writer.steps) == list(range(BATCHES))
    for step, row in writer.steps.items():
        p_d, g_d = refs[step][f"disc{CRITIC_STEPS - 1}"]
        p_g, g_g = refs[step]["gen"]
        assert not math.isclose(refs[step]["disc0"][1], g_d, rel_tol=1e-3)
        assert row["l2_norm/grad/optimizer_1"] == pytest.approx(g_d, rel=REL)
        assert row["l2_norm/param/optimizer_1"] == pytest.approx(p_d, rel=REL)
        assert row["l2_norm/grad/global"] == pytest.approx(math.hypot(g_g, g_d), rel=REL)
        assert row["l2_norm/param/global"] == pytest.approx(math.hypot(p_g, p_d), rel=REL)


def test_a_single_optimizer_stepped_twice_per_batch_shows_its_last_step(tmp_path):
    # Lightning's manual optimization, one optimizer stepped twice per batch: both step()s are
    # measured at the batch's step; the second's norms stay, the first's Inf stays counted.
    pl = pytest.importorskip("lightning.pytorch")

    class LitTwice(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
            self.refs: dict[int, tuple[float, float]] = {}

        def training_step(self, batch, batch_idx):
            (x,) = batch
            opt = self.optimizers()
            for k in range(2):
                opt.zero_grad()
                self.manual_backward(self.net(x * (1 + k)).pow(2).mean())
                if k == 0:
                    self.net[0].bias.grad[0] = math.inf
                opt.step()

        def on_before_optimizer_step(self, optimizer):
            self.refs[self.trainer.global_step] = float64_norms(list(self.parameters()))
            for p in self.parameters():
                p.grad.nan_to_num_(posinf=0.0)  # (after the callbacks: the update stays finite)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(4 * BATCHES, 6, generator=g))
    module = LitTwice()
    writer = RecordingWriter()
    trainer = quiet_trainer(
        devices=1,
        max_epochs=1,
        log_every_n_steps=1,
        callbacks=[NormMonitor(writer=writer)],
        default_root_dir=tmp_path,
    )
    with pytest.warns(
        RuntimeWarning, match=r"1 gradient\(s\) hold NaN/Inf at step \d+: net.0.bias"
    ):
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert sorted(writer.steps) == [0, 2, 4]
    for step, row in writer.steps.items():
        assert math.isinf(module.refs[step][1])
        p_ref, g_ref = module.refs[step + 1]
        assert row["l2_norm/grad/global"] == pytest.approx(g_ref, rel=REL)
        assert row["l2_norm/param/global"] == pytest.approx(p_ref, rel=REL)
        assert row["l2_norm/grad/nonfinite_count"] == 1


def test_a_rollback_in_the_middle_of_a_step_forgets_what_was_measured_of_it():
    # The critic steps with an Inf gradient, the loop notices and restores the checkpoint of
    # this step (model, optimizers, Vitals) and replays it: the replayed step's keys are those
    # of the replay alone.
    import copy

    from trainvitals.adapters.loop import Vitals

    gen, disc, model, opt_g, opt_d = _driver_gan()
    writer = RecordingWriter()
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 4, generator=g)) for _ in range(2)]
    refs: dict[str, tuple[float, float]] = {}

    def run_batch(vitals, real, z, *, spoil: bool) -> None:
        vitals.batch(real)
        opt_d.zero_grad()
        (disc(gen(z).detach()).mean() - disc(real).mean()).backward()
        if spoil:
            disc[2].weight.grad[0, 0] = math.inf
            opt_d.step()  # measured, then the loop notices the Inf and rolls back
            return
        refs["disc"] = float64_norms(list(disc.parameters()))
        opt_d.step()
        opt_g.zero_grad()
        (-disc(gen(z)).mean()).backward()
        refs["gen"] = float64_norms(list(gen.parameters()))
        opt_g.step()

    with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1) as vitals:
        vitals.attach(model, [opt_g, opt_d])
        run_batch(vitals, *batches[0], spoil=False)
        checkpoint = copy.deepcopy(
            (model.state_dict(), opt_g.state_dict(), opt_d.state_dict(), vitals.state_dict())
        )
        run_batch(vitals, *batches[1], spoil=True)
        model.load_state_dict(checkpoint[0])
        opt_g.load_state_dict(checkpoint[1])
        opt_d.load_state_dict(checkpoint[2])
        vitals.load_state_dict(checkpoint[3])
        run_batch(vitals, *batches[1], spoil=False)
    row = writer.steps[1]
    assert row["l2_norm/grad/nonfinite_count"] == 0
    assert row["l2_norm/grad/optimizer_1"] == pytest.approx(refs["disc"][1], rel=REL)
    assert row["l2_norm/grad/global"] == pytest.approx(
        math.hypot(refs["disc"][1], refs["gen"][1]), rel=REL
    )
