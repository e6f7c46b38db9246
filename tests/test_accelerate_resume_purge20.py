"""docs/writer.md's recipe for a run resumed under Accelerate's TensorBoard tracker: the tracker
reuses one folder for every run of a project and opens its ``SummaryWriter`` without a
``purge_step``, so the interrupted run's steps after its checkpoint stay in the event files
beside the resumed run's; ``init_trackers(..., init_kwargs={"tensorboard": {"purge_step": N}})``
hides them, trainvitals' keys and the loop's own alike. Without it, both timelines show."""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

GRAD = "l2_norm/grad/global"
LOSS = "user/loss"


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    reset()
    yield
    reset()


def _train(
    project: Path,
    *,
    steps: int,
    log_every: int,
    seed: int,
    save_at: int | None = None,
    resume: bool = False,
    purge_step: int | None = None,
) -> dict[str, dict[int, float]]:
    """Train a tiny model with a TensorBoard tracker in ``project``, logging the loss itself
    with ``accelerator.log(step=)`` at every step; returns, per key, what this process computed
    for each step (float64 by hand: the unclipped gradient norm before the step)."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from trainvitals import NormMonitor
    from trainvitals.adapters.accelerate import Vitals

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(project))
    # (the step resumed at is known before load_state: the user's checkpoint naming, as the
    # step_<N> folders of Hugging Face's *_no_trainer scripts)
    tensorboard = {} if purge_step is None else {"purge_step": purge_step}
    accelerator.init_trackers("exp", init_kwargs={"tensorboard": tensorboard})
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    vitals = Vitals([NormMonitor()], accelerator=accelerator, log_every_n_steps=log_every)
    vitals.attach(model, optimizer)
    accelerator.register_for_checkpointing(vitals)
    ckpt = str(project / "ckpt")
    if resume:
        accelerator.load_state(ckpt)
    data = torch.Generator().manual_seed(seed)
    computed: dict[str, dict[int, float]] = {GRAD: {}, LOSS: {}}
    while vitals.step < steps:
        step = vitals.step
        x = torch.randn(4, 3, generator=data)
        vitals.batch(x)
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        grads = torch.cat([p.grad.double().flatten() for p in model.parameters()])
        computed[GRAD][step] = float(torch.linalg.vector_norm(grads))
        computed[LOSS][step] = loss.item()
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({LOSS: loss.item()}, step=step)
        if save_at is not None and vitals.step == save_at:
            accelerator.save_state(ckpt)
    accelerator.end_training()  # without vitals.close(): it closes the driver first
    return computed


def _read_back(project: Path) -> dict[str, list[tuple[int, float]]]:
    """Every (step, value) TensorBoard's own reader shows per key, in its order."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    (folder,) = {os.path.dirname(p) for p in glob.glob(f"{project}/**/events.out.tfevents.*")}
    acc = ea.EventAccumulator(folder, size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in (GRAD, LOSS)}


def _assert_shows(
    shown: list[tuple[int, float]], expected: dict[int, float], steps: list[int]
) -> None:
    assert [s for s, _ in shown] == steps  # each step once, in order
    for step, value in shown:
        assert value == pytest.approx(expected[step], rel=1e-6)  # float32 event values


@pytest.mark.parametrize("purge", [True, False])
def test_resume_into_the_trackers_folder_with_and_without_purge_step(
    tmp_path, fresh_accelerate_state, purge
):
    """Run 1 checkpoints after 3 steps, trains on to step 5 and stops (a crash); run 2 resumes
    from the checkpoint, logging every 2nd step. With ``purge_step=3`` TensorBoard shows one
    timeline; without it run 1's abandoned steps show too (what the docs warn about)."""
    from trainvitals.adapters.sinks.tensorboard import _wait_for_a_later_file_name

    first = _train(tmp_path, steps=6, log_every=1, seed=1, save_at=3)
    # (run 2's event file must sort after run 1's, as across two processes)
    _wait_for_a_later_file_name(tmp_path / "exp")
    second = _train(
        tmp_path, steps=8, log_every=2, seed=2, resume=True, purge_step=3 if purge else None
    )
    shown = _read_back(tmp_path)
    assert not math.isclose(first[LOSS][4], second[LOSS][4])  # (two timelines indeed)
    if purge:
        grad = {s: first[GRAD][s] for s in range(3)} | second[GRAD]
        _assert_shows(shown[GRAD], grad, [0, 1, 2, 4, 6])
        loss = {s: first[LOSS][s] for s in range(3)} | second[LOSS]
        _assert_shows(shown[LOSS], loss, list(range(8)))
    else:
        assert [s for s, _ in shown[GRAD]] == [0, 1, 2, 3, 4, 5, 4, 6]
