"""A custom Accelerate tracker (``TrackerSink``) gets trainvitals' steps in order with the loop's
own ``accelerator.log(..., step=)``: step N no later than the loop's log of any later step.

The sink is called from the training thread, at the writer's next call after a step reached the
host; before the fix that was after the loop had already logged the next step, so the tracker
saw ``loop 1, trainvitals 0, loop 2, trainvitals 1, ...`` (DVCLive's tracker sets
``live.step = step`` and starts a row per call: rows out of order)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainvitals.adapters import FanoutWriter, TrackerSink

LOOP_KEY = "loop/loss"


def _recording_tracker(fail_first: int = 0) -> Any:
    """A GeneralTracker recording ``(step, values)`` in the order it receives them; the first
    ``fail_first`` calls with trainvitals' values raise."""
    from accelerate.tracking import GeneralTracker

    class OrderTracker(GeneralTracker):
        name = "order"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[int | None, dict[str, float]]] = []
            self.failures = 0

        @property
        def tracker(self) -> Any:
            return self

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            if self.failures < fail_first and LOOP_KEY not in values:
                self.failures += 1
                raise ConnectionError("tracker backend down")
            self.calls.append((step, dict(values)))

    return OrderTracker()


@pytest.fixture
def accelerator_with() -> Iterator[Any]:
    """``make(tracker)``: an Accelerator on CPU logging to ``tracker``; state reset afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    def make(tracker: Any) -> Any:
        accelerator = Accelerator(cpu=True, log_with=[tracker])
        accelerator.init_trackers("order")
        return accelerator

    try:
        yield make
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()


def _steps(calls: list[tuple[int | None, dict[str, float]]]) -> list[int | None]:
    return [step for step, _ in calls]


def _is_ours(values: dict[str, float]) -> bool:
    return LOOP_KEY not in values


@pytest.mark.parametrize(
    ("first", "log_every"),
    [(0, 1), (1, 1), (1, 2)],
    ids=["loop-counts-from-0", "loop-counts-from-1", "loop-from-1-vitals-every-2"],
)
def test_vitals_driver_steps_reach_the_tracker_in_order(
    accelerator_with, tmp_path, first, log_every
) -> None:
    # The loop of Hugging Face's *_no_trainer scripts: accelerator.log(..., step=N) after each
    # optimizer step, counting from 1 (completed_steps) or from 0.
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import NormMonitor

    tracker = _recording_tracker()
    accelerator = accelerator_with(tracker)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    vitals = Vitals(
        [NormMonitor()], accelerator=accelerator, log_every_n_steps=log_every, run_dir=tmp_path
    )
    (sink,) = vitals.ctx.writer.sinks
    assert isinstance(sink, TrackerSink)
    vitals.attach(model, optimizer)
    n_steps = 7
    grad_norms: dict[int, float] = {}  # float64 norm of the gradients of each step
    loop_losses: dict[int, float] = {}
    for step in range(n_steps):
        x = torch.randn(8, 4)
        vitals.batch(x)
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        grads = [p.grad.double() for p in model.parameters()]
        grad_norms[step] = math.sqrt(sum(float(g.square().sum()) for g in grads))
        optimizer.step()
        optimizer.zero_grad()
        loop_step = step + first
        loop_losses[loop_step] = float(loss.detach())
        accelerator.log({LOOP_KEY: loop_losses[loop_step]}, step=loop_step)
    vitals.close()
    accelerator.end_training()

    steps = _steps(tracker.calls)
    assert steps == sorted(steps), f"steps reached the tracker out of order: {steps}"
    ours = [(step, values) for step, values in tracker.calls if _is_ours(values)]
    logged = [s for s in range(n_steps) if s % log_every == 0]
    assert [step for step, _ in ours] == logged  # each step once, as one call
    for step, values in ours:
        assert values["l2_norm/grad/global"] == pytest.approx(grad_norms[step], rel=1e-6)
        assert all(type(v) is float for v in values.values())
    assert {s: v[LOOP_KEY] for s, v in tracker.calls if not _is_ours(v)} == loop_losses
    assert "log" not in vars(tracker)  # the wrapper is gone with the writer


def test_writer_steps_reach_the_tracker_before_the_loops_next_step(accelerator_with) -> None:
    # The writer used directly, with CPU tensors: values of step s logged before and after the
    # loop's own log of s stay one call (the loop's log of s does not close step s), which
    # reaches the tracker before the loop's log of s + 1.
    tracker = _recording_tracker()
    accelerator = accelerator_with(tracker)
    writer = FanoutWriter.from_accelerator(accelerator)
    n_steps = 6
    for s in range(n_steps):
        writer.add_scalar("vitals/a", torch.tensor(float(s)) * 2, s)
        accelerator.log({LOOP_KEY: 10.0 + s}, step=s)
        writer.add_scalars({"vitals/b": torch.tensor(s, dtype=torch.int64), "vitals/c": 0.5}, s)
    writer.close()

    assert _steps(tracker.calls) == [s for s in range(n_steps) for _ in range(2)]
    ours = [(step, values) for step, values in tracker.calls if _is_ours(values)]
    assert ours == [
        (s, {"vitals/a": 2.0 * s, "vitals/b": float(s), "vitals/c": 0.5}) for s in range(n_steps)
    ]
    for s in range(n_steps):  # loop's s first (it came first), then ours, then loop's s + 1
        assert tracker.calls[2 * s] == (s, {LOOP_KEY: 10.0 + s})
    assert writer.status()["order"]["delivered"] == n_steps


def test_loop_logs_without_step_and_after_close_go_through(accelerator_with) -> None:
    tracker = _recording_tracker()
    accelerator = accelerator_with(tracker)
    writer = FanoutWriter.from_accelerator(accelerator, background=False)
    writer.add_scalar("vitals/a", 1.0, 0)
    accelerator.log({LOOP_KEY: 1.0})  # no step: the tracker counts; nothing to order against
    writer.add_scalar("vitals/a", 2.0, 1)  # closes step 0, delivered at once (no background)
    tracker.log({LOOP_KEY: 2.0}, 2)  # positional step, called on the tracker itself
    writer.close()
    accelerator.log({LOOP_KEY: 3.0}, step=3)
    assert tracker.calls == [
        (None, {LOOP_KEY: 1.0}),
        (0, {"vitals/a": 1.0}),
        (1, {"vitals/a": 2.0}),
        (2, {LOOP_KEY: 2.0}),
        (3, {LOOP_KEY: 3.0}),
    ]
    assert "log" not in vars(tracker)


def test_a_tracker_failing_once_gets_the_step_again_still_in_order(accelerator_with) -> None:
    # The first write of ours raises: reported once, retried (no backoff here), and the step
    # still reaches the tracker before the loop's next step; the loop's own log never raises.
    tracker = _recording_tracker(fail_first=1)
    accelerator = accelerator_with(tracker)
    writer = FanoutWriter.from_accelerator(accelerator, retry_backoff=(0.0, 0.0))
    with pytest.warns(RuntimeWarning, match="tracker backend down"):
        for s in range(4):
            writer.add_scalar("vitals/a", torch.tensor(float(s)), s)
            accelerator.log({LOOP_KEY: float(s)}, step=s + 1)
        writer.close()
    assert tracker.calls == [
        call
        for s in range(4)
        for call in ((s, {"vitals/a": float(s)}), (s + 1, {LOOP_KEY: float(s)}))
    ]
    status = writer.status()["order"]
    assert (status["delivered"], status["failures"], status["missed"]) == (4, 1, 0)


def test_two_writers_on_one_tracker_both_deliver_in_order(accelerator_with) -> None:
    # e.g. the driver's writer replaced after a rollback while the old one is still open
    tracker = _recording_tracker()
    accelerator = accelerator_with(tracker)
    first = FanoutWriter.from_accelerator(accelerator)
    second = FanoutWriter.from_accelerator(accelerator)
    for s in range(4):
        first.add_scalar("vitals/first", torch.tensor(float(s)), s)
        second.add_scalar("vitals/second", torch.tensor(float(s)), s)
        accelerator.log({LOOP_KEY: float(s)}, step=s + 1)
    second.add_scalar("vitals/second", torch.tensor(4.0), 4)
    second.close()  # the last wrapper first: the tracker's log is the first writer's again
    first.add_scalar("vitals/first", torch.tensor(4.0), 4)
    accelerator.log({LOOP_KEY: 9.0}, step=9)
    first.close()
    steps = _steps(tracker.calls)
    assert steps == sorted(steps)
    for key in ("vitals/first", "vitals/second"):
        assert [(s, v[key]) for s, v in tracker.calls if key in v] == [
            (s, float(s)) for s in range(5)
        ]
    assert "log" not in vars(tracker)


@pytest.mark.timeout(300)
def test_lightning_csv_logger_rows_are_in_step_order(tmp_path) -> None:
    # The same for Lightning's CSVLogger (LightningLoggerSink): Lightning calls the logger's
    # log_metrics(metrics, step=N) at the end of batch N; trainvitals' step N - 1 used to be
    # written after it, so metrics.csv held its rows out of step order.
    import csv

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from trainvitals.callbacks import NormMonitor

    grad_norms: list[float] = []

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.layer(batch[0]).pow(2).mean()
            self.log(LOOP_KEY, loss)
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            squares = sum(float(p.grad.double().square().sum()) for p in self.parameters())
            grad_norms.append(math.sqrt(squares))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    logger = CSVLogger(str(tmp_path), name="csv")
    monitor = NormMonitor(log_every_n_steps=1)
    trainer = pl.Trainer(
        max_steps=6,
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=1,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Model(), loader)
    assert "log_metrics" not in vars(logger)  # the wrapper is gone with the writer

    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps), f"rows out of step order: {steps}"
    ours = [r for r in rows if r.get("l2_norm/grad/global")]
    assert [int(r["step"]) for r in ours] == list(range(6))
    got = [float(r["l2_norm/grad/global"]) for r in ours]
    assert got == pytest.approx(grad_norms, rel=1e-6)
    assert [int(r["step"]) for r in rows if r.get(LOOP_KEY)] == list(range(6))
