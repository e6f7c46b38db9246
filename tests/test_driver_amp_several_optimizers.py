"""The Vitals driver with several optimizers on one ``torch.amp.GradScaler`` and no clipping:
``scaler.step(opt)`` unscales each optimizer's gradients right before its step, and the driver
shows them there, that optimizer's alone, also when the scaler then skips the step for inf/nan
gradients. torch.amp's "multiple optimizers" example (one backward, ``scaler.step(opt0);
scaler.step(opt1); scaler.update()``), a GAN (a backward per optimizer) and a critic stepped
twice per batch, with NormMonitor and TensorStatsMonitor's ``grad`` kind checked against the
float64 norms and moments of the unscaled gradients each optimizer stepped with."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from tests.callbacks.test_tensor_stats_monitor import check_line, read_lines
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.norm_monitor import NormMonitor
from trainvitals.callbacks.tensor_stats_monitor import TensorStatsMonitor

INF = math.inf


def _unscaled(module: torch.nn.Module, scale: float, prefix: str) -> dict[str, torch.Tensor]:
    """float64 copies of ``module``'s gradients divided by the loss scale, by name."""
    return {
        f"{prefix}{name}": p.grad.detach().double() / scale for name, p in module.named_parameters()
    }


def _params(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}{name}": p.detach().double().clone() for name, p in module.named_parameters()}


def _sq(tensors: dict[str, torch.Tensor]) -> float:
    """float64 sum of squares (inf when an element is not finite)."""
    return float(sum(float((t * t).sum()) for t in tensors.values()))


def _monitors(tmp_path: Path) -> tuple[list, RecordingWriter]:
    writer = RecordingWriter()
    return [NormMonitor(), TensorStatsMonitor(kinds=["grad"], kernel="eager")], writer


def _check(
    tmp_path: Path,
    writer: RecordingWriter,
    expected: list[list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]],
) -> None:
    """``expected[step][i]``: (unscaled gradients, weights) optimizer ``i`` stepped with."""
    assert sorted(writer.rows) == list(range(len(expected)))
    lines = [line for line in read_lines(tmp_path / "tensor_stats.jsonl") if line["kind"] == "grad"]
    assert [line["step"] for line in lines] == list(range(len(expected)))
    for step, per_optimizer in enumerate(expected):
        row = writer.rows[step]
        grads_sq = [_sq(grads) for grads, _ in per_optimizer]
        params_sq = [_sq(params) for _, params in per_optimizer]
        for i, (g, p) in enumerate(zip(grads_sq, params_sq, strict=True)):
            got = row[f"l2_norm/grad/optimizer_{i}"]
            assert got == (INF if math.isinf(g) else pytest.approx(g**0.5, rel=1e-6)), (step, i)
            assert row[f"l2_norm/param/optimizer_{i}"] == pytest.approx(p**0.5, rel=1e-6)
        total = sum(grads_sq)
        assert row["l2_norm/grad/global"] == (
            INF if math.isinf(total) else pytest.approx(total**0.5, rel=1e-6)
        )
        bad = sum(
            not bool(torch.isfinite(t).all()) for grads, _ in per_optimizer for t in grads.values()
        )
        assert row["l2_norm/grad/nonfinite_count"] == bad
        every = {name: t for grads, _ in per_optimizer for name, t in grads.items()}
        check_line(lines[step], every, f"grad step {step}")


def _no_scaled_warning(caught: list[warnings.WarningMessage]) -> None:
    assert not [w for w in caught if "still scaled" in str(w.message)]


def test_one_backward_then_scaler_step_per_optimizer_shows_each_at_its_step(tmp_path):
    # torch.amp's multiple-optimizers example: one backward, then scaler.step(opt0);
    # scaler.step(opt1); scaler.update(). Each scaler.step unscales its own optimizer's
    # gradients: opt0's are shown (unscaled) inside scaler.step(opt0), opt1's inside
    # scaler.step(opt1). At step 1 opt0's gradients hold an inf: the scaler skips opt0 (its
    # hooks never run) and steps opt1; opt0's gradients are still shown, with the inf counted.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[2].parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitors, writer = _monitors(tmp_path)
    vitals = Vitals(monitors, writer=writer, run_dir=tmp_path, log_every_n_steps=1)
    vitals.attach(model, [first, second], scaler=scaler)
    expected = []
    scales = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x = torch.randn(5, 4)
            vitals.batch(x)
            scaler.scale(model(x).pow(2).mean()).backward()
            if step == 1:
                model[0].weight.grad[0, 0] = INF
            scale = scaler.get_scale()
            scales.append(scale)
            expected.append(
                [
                    (_unscaled(model[0], scale, "0."), _params(model[0], "0.")),
                    (_unscaled(model[2], scale, "2."), _params(model[2], "2.")),
                ]
            )
            weights = _params(model, "")
            scaler.step(first)
            scaler.step(second)
            scaler.update()
            first.zero_grad()
            second.zero_grad()
            if step == 1:  # opt0 skipped, opt1 stepped
                assert torch.equal(model[0].weight.detach().double(), weights["0.weight"])
                assert not torch.equal(model[2].weight.detach().double(), weights["2.weight"])
        vitals.close()
    assert scales == [2.0**10, 2.0**10, 2.0**9]  # the inf step backed the scale off
    assert vitals.step == 3
    _check(tmp_path, writer, expected)
    _no_scaled_warning(caught)


@pytest.mark.parametrize("skip", ["none", "discriminator", "both"])
def test_gan_backward_per_optimizer_shows_each_network_at_its_scaler_step(tmp_path, skip):
    # A GAN on one scaler: scale(loss_d).backward(); scaler.step(opt_d); then the generator's
    # backward and scaler.step(opt_g); one update() per batch. Each network's gradients are
    # shown, unscaled, at its own scaler.step, also when the scaler skips that step (batch 1).
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    disc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = torch.nn.ModuleDict({"d": disc, "g": gen})
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitors, writer = _monitors(tmp_path)
    vitals = Vitals(monitors, writer=writer, run_dir=tmp_path, log_every_n_steps=1)
    vitals.attach(model, [opt_d, opt_g], scaler=scaler)
    expected = []
    counted = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            real, z = torch.randn(5, 4), torch.randn(5, 3)
            vitals.batch(real)
            opt_d.zero_grad()
            scaler.scale(disc(gen(z).detach()).mean() - disc(real).mean()).backward()
            if step == 1 and skip != "none":
                disc[0].bias.grad[0] = INF
            scale = scaler.get_scale()
            row = [(_unscaled(disc, scale, "d."), _params(disc, "d."))]
            scaler.step(opt_d)
            opt_g.zero_grad()
            scaler.scale(-disc(gen(z)).mean()).backward()
            if step == 1 and skip == "both":
                gen[2].weight.grad[0, 0] = -INF
            row.append((_unscaled(gen, scale, "g."), _params(gen, "g.")))
            scaler.step(opt_g)
            scaler.update()
            counted.append(vitals.step)
            expected.append(row)
        assert vitals.state_dict()["step"] == 3  # the last batch is counted by a checkpoint
        vitals.close()
    # the step is the batch: it ends at the next batch, also when every step() was skipped
    assert counted == [0, 1, 2]
    assert vitals.step == 3
    _check(tmp_path, writer, expected)
    _no_scaled_warning(caught)


def test_critic_skipped_then_stepped_again_in_its_batch_shows_its_last_step(tmp_path):
    # WGAN-style on one scaler (update() after each scaler.step, as torch requires before the
    # same optimizer steps again): the generator, then the critic twice. The critic's first
    # step is skipped (inf): its second step() in the batch is shown again and is what the
    # batch's critic norms are; the skipped step's inf stays counted.
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = torch.nn.ModuleDict({"c": critic, "g": gen})
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    writer = RecordingWriter()
    vitals = Vitals([NormMonitor()], writer=writer, log_every_n_steps=1)
    vitals.attach(model, [opt_g, opt_c], scaler=scaler)
    expected = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            real, z = torch.randn(5, 4), torch.randn(5, 3)
            vitals.batch(real)
            opt_g.zero_grad()
            scaler.scale(-critic(gen(z)).mean()).backward()
            g_sq = _sq(_unscaled(gen, scaler.get_scale(), ""))
            scaler.step(opt_g)
            scaler.update()
            for i in range(2):
                opt_c.zero_grad()
                loss = critic(gen(z).detach()).mean() - critic(real * (1 + i)).mean()
                scaler.scale(loss).backward()
                if i == 0:
                    critic[2].weight.grad[0, 1] = math.nan
                c_sq = _sq(_unscaled(critic, scaler.get_scale(), ""))
                scaler.step(opt_c)
                scaler.update()
            expected.append((g_sq, c_sq))
        vitals.close()
    assert vitals.step == 2
    for step, (g_sq, c_sq) in enumerate(expected):
        row = writer.rows[step]
        assert math.isfinite(c_sq)
        assert row["l2_norm/grad/optimizer_0"] == pytest.approx(g_sq**0.5, rel=1e-6)
        assert row["l2_norm/grad/optimizer_1"] == pytest.approx(c_sq**0.5, rel=1e-6)
        assert row["l2_norm/grad/global"] == pytest.approx((g_sq + c_sq) ** 0.5, rel=1e-6)
        assert row["l2_norm/grad/nonfinite_count"] == 1  # the skipped step's NaN
    _no_scaled_warning(caught)


def test_an_explicit_unscale_of_one_optimizer_then_its_step_is_still_not_shown():
    # Still ambiguous: scaler.unscale_(opt0) (the loop may go on to unscale opt1 before any
    # step: all at once), then a clip the driver cannot see, then opt0 steps while opt1's
    # gradients are scaled. opt0's gradients are not shown (they may be clipped), with the
    # warning; opt1's are, unscaled, inside scaler.step(opt1).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    writer = RecordingWriter()
    vitals = Vitals([NormMonitor()], writer=writer, log_every_n_steps=1)
    vitals.attach(model, [first, second], scaler=scaler)
    x = torch.randn(3, 4) * 10
    vitals.batch(x)
    scaler.scale(model(x).pow(2).mean()).backward()
    want = _sq(_unscaled(model[1], scaler.get_scale(), ""))
    scaler.unscale_(first)
    torch.nn.utils.clip_grad_norm_(model[0].parameters(), max_norm=1e-3)
    with pytest.warns(RuntimeWarning, match="still scaled"):
        scaler.step(first)
    scaler.step(second)
    scaler.update()
    vitals.close()
    row = writer.rows[0]
    assert "l2_norm/grad/optimizer_0" not in row
    assert row["l2_norm/grad/optimizer_1"] == pytest.approx(want**0.5, rel=1e-6)
    assert row["l2_norm/grad/global"] == pytest.approx(want**0.5, rel=1e-6)
