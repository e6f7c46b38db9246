"""The Vitals driver with several attached optimizers: a GAN written as a plain loop (each
optimizer after its own backward), a discriminator stepped more often than the generator, and
parameters split over two optimizers after one backward. The step is the batch; the gradient
hook runs before every attached optimizer's step(), with that optimizer's current gradients."""

from __future__ import annotations

import pytest
import torch

from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.base import VitalsCallback


class GradRecorder(VitalsCallback):
    """Copies every parameter's gradient at each ``before_optimizer_step`` and records which
    optimizer the driver says is stepping."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []
        self.seen: list[tuple[object, dict[int, torch.Tensor | None]]] = []

    def micro_batch_start(self, ctx, batch):
        self.events.append(("mb", ctx.step))

    def before_optimizer_step(self, ctx):
        stepping = ctx.stepping_optimizer
        grads = {
            id(p): (None if p.grad is None else p.grad.detach().clone())
            for p in ctx.model.parameters()
        }
        self.seen.append((stepping, grads))
        self.events.append(("grads", ctx.step))

    def step_end(self, ctx):
        self.events.append(("end", ctx.step, ctx.micro_batches_in_step))


def _gan():
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    discriminator = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )
    model = torch.nn.ModuleDict({"generator": generator, "discriminator": discriminator})
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.05)
    return model, generator, discriminator, opt_d, opt_g


def _snapshot(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    return {id(p): p.grad.detach().clone() for p in module.parameters()}


def _assert_current(seen_grads: dict, expected: dict[int, torch.Tensor]) -> None:
    for key, want in expected.items():
        got = seen_grads[key]
        assert got is not None
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _two_steps_per_batch(batches: int) -> list[tuple]:
    """The events of batches of one micro-batch each that step both optimizers."""
    return [
        e for s in range(batches) for e in (("mb", s), ("grads", s), ("grads", s), ("end", s, 1))
    ]


def _run_gan(vitals: Vitals, generator, discriminator, opt_d, opt_g, g_every: int, batches: int):
    """A plain-loop GAN: the discriminator steps every batch, the generator every ``g_every``.
    Returns (optimizer, gradients copied right before its step()) for every step() call."""
    stepped = []
    for i in range(batches):
        real = torch.randn(5, 4)
        z = torch.randn(5, 3)
        vitals.batch(real)
        opt_d.zero_grad()
        loss_d = discriminator(generator(z).detach()).mean() - discriminator(real).mean()
        loss_d.backward()
        stepped.append((opt_d, _snapshot(discriminator)))
        opt_d.step()
        if (i + 1) % g_every == 0:
            opt_g.zero_grad()
            # the generator's loss reaches the discriminator's parameters too (not frozen, as
            # in many GAN loops), so its gradients at this point are not the ones opt_d used
            loss_g = -discriminator(generator(z)).mean()
            loss_g.backward()
            stepped.append((opt_g, _snapshot(generator)))
            opt_g.step()
    return stepped


def test_gan_loop_shows_each_optimizers_current_gradients_and_ends_the_step_after_the_last():
    model, generator, discriminator, opt_d, opt_g = _gan()
    rec = GradRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [opt_d, opt_g])
    batches = 3
    # at opt_d's step the generator still holds the previous batch's gradients, and at
    # opt_g's step the discriminator holds the generator loss's: neither is what its optimizer uses
    stepped = _run_gan(vitals, generator, discriminator, opt_d, opt_g, 1, batches)
    vitals.close()
    assert len(rec.seen) == len(stepped) == 2 * batches
    for (stepping, grads), (optimizer, expected) in zip(rec.seen, stepped, strict=True):
        assert stepping is optimizer
        _assert_current(grads, expected)
    assert rec.events == _two_steps_per_batch(batches)
    assert vitals.step == batches


@pytest.mark.parametrize("ends_at", ["checkpoint", "close"])
def test_an_optimizer_that_skips_a_batch_ends_the_step_at_the_next_batch(ends_at):
    # WGAN-style schedule: the discriminator steps every batch, the generator every 2nd. The
    # last batch steps the discriminator only: a checkpoint (or close) after it counts it.
    model, generator, discriminator, opt_d, opt_g = _gan()
    rec = GradRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [opt_d, opt_g])
    stepped = _run_gan(vitals, generator, discriminator, opt_d, opt_g, 2, 5)
    if ends_at == "checkpoint":
        assert vitals.state_dict()["step"] == 5
        assert rec.events[-1] == ("end", 4, 1)
    vitals.close()
    assert vitals.step == 5
    assert [opt for opt, _ in stepped] == [opt_d, opt_d, opt_g, opt_d, opt_d, opt_g, opt_d]
    for (stepping, grads), (optimizer, expected) in zip(rec.seen, stepped, strict=True):
        assert stepping is optimizer
        _assert_current(grads, expected)
    assert rec.events == [
        ("mb", 0), ("grads", 0), ("end", 0, 1),  # ended by batch 1's start
        ("mb", 1), ("grads", 1), ("grads", 1), ("end", 1, 1),  # ended by opt_g's step
        ("mb", 2), ("grads", 2), ("end", 2, 1),
        ("mb", 3), ("grads", 3), ("grads", 3), ("end", 3, 1),
        ("mb", 4), ("grads", 4), ("end", 4, 1),  # ended by the checkpoint, else by close()
    ]  # fmt: skip


def test_parameters_split_over_two_optimizers_after_one_backward():
    # Muon + AdamW style: one backward, then each optimizer steps its share of the parameters.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.AdamW(model[1].parameters(), lr=0.1)
    rec = GradRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [first, second])
    expected = []
    for _ in range(2):
        x = torch.randn(3, 4)
        vitals.batch(x)
        model(x).pow(2).mean().backward()
        expected += [(first, _snapshot(model[0])), (second, _snapshot(model[1]))]
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
    vitals.close()
    for (stepping, grads), (optimizer, want) in zip(rec.seen, expected, strict=True):
        assert stepping is optimizer
        _assert_current(grads, want)
    assert rec.events == _two_steps_per_batch(2)


def test_clipping_one_network_shows_its_unclipped_gradients_before_its_step():
    model, generator, discriminator, opt_d, opt_g = _gan()
    rec = GradRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [opt_d, opt_g])
    expected = []
    for _ in range(2):
        real, z = torch.randn(5, 4) * 50, torch.randn(5, 3)
        vitals.batch(real)
        opt_d.zero_grad()
        (discriminator(generator(z).detach()).mean() - discriminator(real).mean()).backward()
        expected.append((opt_d, _snapshot(discriminator)))
        vitals.clip_grad_norm_(discriminator.parameters(), max_norm=1e-4)
        opt_d.step()
        opt_g.zero_grad()
        (-discriminator(generator(z)).mean()).backward()
        expected.append((opt_g, _snapshot(generator)))
        vitals.clip_grad_norm_(generator.parameters(), max_norm=1e-4)
        opt_g.step()
    vitals.close()
    assert (
        min(float(torch.stack([g.norm() for g in want.values()]).norm()) for _, want in expected)
        > 1e-2
    )  # so that clipped gradients (1e-4) could not pass
    assert len(rec.seen) == len(expected)
    for (stepping, grads), (optimizer, want) in zip(rec.seen, expected, strict=True):
        assert stepping is optimizer
        _assert_current(grads, want)
    assert rec.events == _two_steps_per_batch(2)


def test_gan_on_one_grad_scaler_shows_the_generator_unscaled_and_never_scaled_gradients():
    # fp16 GAN on one scaler: at scaler.step(opt_d) the generator's gradients are not unscaled
    # yet, so nothing is shown there (warned); scaler.step(opt_g) unscales the generator's and
    # its pre-hook shows them, as opt_g alone (opt_d's weights are updated by then).
    model, generator, discriminator, opt_d, opt_g = _gan()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    rec = GradRecorder()
    vitals = Vitals([rec], writer=RecordingWriter()).attach(model, [opt_d, opt_g], scaler=scaler)
    expected = []
    with pytest.warns(RuntimeWarning, match="still scaled"):
        for _ in range(2):
            real, z = torch.randn(5, 4), torch.randn(5, 3)
            vitals.batch(real)
            opt_d.zero_grad()
            loss_d = discriminator(generator(z).detach()).mean() - discriminator(real).mean()
            scaler.scale(loss_d).backward()
            scaler.step(opt_d)
            opt_g.zero_grad()
            scaler.scale(-discriminator(generator(z)).mean()).backward()
            scale = scaler.get_scale()
            expected.append({k: g / scale for k, g in _snapshot(generator).items()})
            scaler.step(opt_g)
            scaler.update()
    vitals.close()
    assert [stepping for stepping, _ in rec.seen] == [opt_g, opt_g]
    for (_, grads), want in zip(rec.seen, expected, strict=True):
        for key, value in want.items():
            torch.testing.assert_close(grads[key], value, rtol=1e-6, atol=0)
    assert rec.events == [e for s in range(2) for e in (("mb", s), ("grads", s), ("end", s, 1))]


def test_norm_monitor_in_a_gan_loop_measures_each_network_at_its_own_step():
    # NormMonitor reads ctx.stepping_optimizer: each network's gradients and weights as its
    # optimizer uses them, merged into one write per batch with per-optimizer keys.
    from trainvitals.callbacks.norm_monitor import NormMonitor

    model, generator, discriminator, opt_d, opt_g = _gan()
    writer = RecordingWriter()
    vitals = Vitals([NormMonitor()], writer=writer, log_every_n_steps=1)
    vitals.attach(model, [opt_d, opt_g])
    expected: list[dict[str, float]] = []
    for _ in range(3):
        real, z = torch.randn(5, 4), torch.randn(5, 3)
        vitals.batch(real)
        row: dict[str, float] = {}
        opt_d.zero_grad()
        (discriminator(generator(z).detach()).mean() - discriminator(real).mean()).backward()
        for i, net in ((0, discriminator), (1, generator)):
            if i == 1:
                opt_g.zero_grad()
                (-discriminator(generator(z)).mean()).backward()
            params = [p.detach().double() for p in net.parameters()]
            grads = [p.grad.detach().double() for p in net.parameters()]
            row[f"l2_norm/param/optimizer_{i}"] = float(sum((x * x).sum() for x in params))
            row[f"l2_norm/grad/optimizer_{i}"] = float(sum((g * g).sum() for g in grads))
            (opt_d if i == 0 else opt_g).step()
        expected.append(row)
    vitals.close()
    assert sorted(writer.rows) == [0, 1, 2]
    for step, want in enumerate(expected):
        got = writer.rows[step]
        for key, sq in want.items():
            assert got[key] == pytest.approx(sq**0.5, rel=1e-6)
        for kind in ("param", "grad"):
            total = want[f"l2_norm/{kind}/optimizer_0"] + want[f"l2_norm/{kind}/optimizer_1"]
            assert got[f"l2_norm/{kind}/global"] == pytest.approx(total**0.5, rel=1e-6)


@pytest.mark.parametrize("generator_every", [1, 2])
def test_two_optimizers_log_every_n_batches(generator_every):
    """The driver's step is the batch (both optimizers' step()s in it): ctx.step advances by 1
    per batch, step_increment and step_gap stay 1, so log_every_n_steps=3 logs the batches 0, 3,
    6, 9, decided alike at the batch's start and at its end; also when the generator steps
    every other batch only (such a step ends at the next batch)."""
    from trainvitals.callbacks.norm_monitor import NormMonitor

    class Decisions(VitalsCallback):
        def __init__(self) -> None:
            super().__init__()
            self.at_start: dict[int, bool] = {}
            self.at_end: dict[int, tuple[bool, int, int]] = {}

        def micro_batch_start(self, ctx, batch):
            self.at_start[ctx.step] = self.should_log(ctx)

        def step_end(self, ctx):
            self.at_end[ctx.step] = (self.should_log(ctx), ctx.step_increment, ctx.step_gap)

    model, generator, discriminator, opt_d, opt_g = _gan()
    writer = RecordingWriter()
    probe = Decisions()
    vitals = Vitals([NormMonitor(), probe], writer=writer, log_every_n_steps=3)
    vitals.attach(model, [opt_d, opt_g])
    batches = 10
    for b in range(batches):
        real, z = torch.randn(5, 4), torch.randn(5, 3)
        vitals.batch(real)
        opt_d.zero_grad()
        (discriminator(generator(z).detach()).mean() - discriminator(real).mean()).backward()
        opt_d.step()
        if b % generator_every == 0:
            opt_g.zero_grad()
            (-discriminator(generator(z)).mean()).backward()
            opt_g.step()
    vitals.close()
    expected = [b for b in range(batches) if b % 3 == 0]
    assert sorted(writer.rows) == expected
    assert probe.at_end == {b: (b in expected, 1, 1) for b in range(batches)}
    assert probe.at_start == {b: b in expected for b in range(batches)}
