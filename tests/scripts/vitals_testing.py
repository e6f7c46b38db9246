"""Small helpers shared by the driver/Lightning/Accelerate tests and the torchrun scripts."""

from __future__ import annotations

from typing import Any

import torch


class RecordingWriter:
    """A writer that keeps every value as a float: ``rows[step][key] = value``."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}
        self.flushed = 0
        self.closed = False

    def add_scalar(self, name: str, value: Any, step: int) -> None:
        self.add_scalars({name: value}, step)

    def add_scalars(self, mapping: dict[str, Any], step: int) -> None:
        row = self.rows.setdefault(int(step), {})
        for key, value in mapping.items():
            row[key] = float(value.item() if isinstance(value, torch.Tensor) else value)

    def flush(self) -> None:
        self.flushed += 1

    def close(self) -> None:
        self.closed = True

    def key(self, name: str) -> dict[int, float]:
        """``{step: value}`` of one key."""
        return {s: row[name] for s, row in sorted(self.rows.items()) if name in row}


class NullWriter:
    """A writer that drops everything (for tests about what a callback does, not writes)."""

    def add_scalar(self, name: str, value: Any, step: int) -> None:
        pass

    def add_scalars(self, mapping: dict[str, Any], step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeClock:
    """A clock the test moves by hand: ``clock.t += 1.5``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def dt(step: int, mb: int) -> float:
    """Seconds the fake clock moves during micro-batch ``mb`` of ``step`` in :func:`fake_loop`."""
    return 0.25 * (1 + (3 * step + mb) % 4)


def batch_size(step: int, mb: int, rank: int = 0) -> int:
    """Samples in micro-batch ``mb`` of ``step`` on ``rank`` in :func:`fake_loop`."""
    return 2 + (step + mb) % 3 + 3 * rank


def fake_loop(
    callbacks: list,
    clock: FakeClock | None,
    *,
    steps: range,
    acc: int = 2,
    seq: int = 5,
    log_every: int = 2,
    val_every: int = 3,
    val_seconds: float = 100.0,
    rank: int = 0,
    state: dict | None = None,
    max_steps: int | None = None,
    on_step: Any = None,
) -> tuple[RecordingWriter, Any]:
    """A plain loop under the driver: ``acc`` micro-batches per optimizer step (the fake clock
    moves :func:`dt` inside each), validation of ``val_seconds`` after every ``val_every``-th
    step. Returns the writer and the closed driver."""
    from trainvitals.adapters.loop import Vitals

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = RecordingWriter()
    vitals = Vitals(callbacks, writer=writer, log_every_n_steps=log_every, max_steps=max_steps)
    vitals.attach(model, opt)
    if state is not None:
        vitals.load_state_dict(state)
    for step in steps:
        for mb in range(acc):
            bs = batch_size(step, mb, rank)
            batch = {"input_ids": torch.zeros(bs, seq, dtype=torch.long), "x": torch.randn(bs, 3)}
            vitals.batch(batch)
            if clock is not None:
                clock.t += dt(step, mb)
            model(batch["x"]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if on_step is not None:
            on_step(step)
        if (step + 1) % val_every == 0:
            with vitals.validating():
                if clock is not None:
                    clock.t += val_seconds
    vitals.close()
    return writer, vitals


def quiet_trainer(package: str = "lightning.pytorch", **kwargs: Any) -> Any:
    """A ``Trainer`` of ``package`` (``lightning.pytorch`` or ``pytorch_lightning``) on CPU
    without logger, checkpoints, progress bar or model summary (each can be overridden); every
    other argument as given."""
    import importlib

    pl = importlib.import_module(package)

    defaults = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{**defaults, **kwargs})


def manual_optimization_module(
    layers: list[torch.nn.Module],
    samples: int,
    *,
    on_batch: Any = None,
    package: str = "lightning.pytorch",
) -> Any:
    """A LightningModule under manual optimization: one SGD optimizer per layer, each stepped
    once per batch after its own forward and backward (a GAN's shape), on ``samples`` random
    inputs of 3 features in batches of 2; ``on_batch(batch_idx)`` runs first in each step."""
    import importlib

    pl = importlib.import_module(package)

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layers = torch.nn.ModuleList(layers)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            if on_batch is not None:
                on_batch(batch_idx)
            optimizers = self.optimizers()
            if not isinstance(optimizers, list):
                optimizers = [optimizers]
            for opt, layer in zip(optimizers, self.layers, strict=True):
                opt.zero_grad()
                self.manual_backward(layer(batch).pow(2).mean())
                opt.step()

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(m.parameters(), lr=0.01) for m in self.layers]

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(samples, 3), batch_size=2)

    return Manual()


def lsgan_manual_step(module: Any, real: torch.Tensor, generate: Any, toggle: bool) -> None:
    """One least-squares GAN batch under Lightning's manual optimization: the generator's
    ``step()`` then the discriminator's (``module.disc``, optimizers ``(opt_g, opt_d)``), with
    ``toggle_optimizer`` around each when ``toggle``; ``generate()`` makes the fakes."""
    opt_g, opt_d = module.optimizers()
    if toggle:
        module.toggle_optimizer(opt_g)
    fake = generate()
    g_loss = (module.disc(fake) - 1).pow(2).mean()
    opt_g.zero_grad()
    module.manual_backward(g_loss)
    opt_g.step()
    if toggle:
        module.untoggle_optimizer(opt_g)
        module.toggle_optimizer(opt_d)
    d_loss = module.disc(fake.detach()).pow(2).mean() + (module.disc(real) - 1).pow(2).mean()
    opt_d.zero_grad()
    module.manual_backward(d_loss)
    opt_d.step()
    if toggle:
        module.untoggle_optimizer(opt_d)


def fit_twice_with_a_gap(
    callback: Any, clock: FakeClock, seconds_per_step: float, gap: float = 500.0
) -> Any:
    """Two ``fit`` calls on one Lightning trainer with ``callback``: 4 optimizer steps, then
    ``gap`` seconds of the user's own code on ``clock`` (evaluation, saving, ...), then
    ``max_steps`` raised to 8 and the second fit. Each step (4 samples of 3 features) moves
    ``clock`` by ``seconds_per_step``. Returns the trainer."""
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            clock.t += seconds_per_step
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(64, 3), batch_size=4)

    module = Tiny()
    trainer = quiet_trainer(max_steps=4, callbacks=[callback])
    trainer.fit(module)
    clock.t += gap
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(module)
    return trainer
