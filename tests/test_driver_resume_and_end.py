"""The Vitals driver under Accelerate at the two ends of a run segment: a checkpoint taken inside
a gradient-accumulation window resumes the counts an uninterrupted run has, and
``accelerator.end_training()`` before ``vitals.close()`` keeps every step in the trackers (one
TensorBoard event file, every MLflow step)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainvitals.adapters import read_jsonl
from trainvitals.adapters.accelerate import Vitals
from trainvitals.callbacks.runtime_monitor import RuntimeMonitor
from trainvitals.callbacks.throughput_monitor import ThroughputMonitor

ACC = 4  # micro-batches per optimizer step
SIZES = [2, 3, 5, 7, 2, 3, 5, 7, 1, 4, 6, 8]  # samples of each micro-batch: 3 optimizer steps
SEQ = 3  # tokens per sample (passed as num_tokens)


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _driver(run_dir: Path, **accelerator_kwargs):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, **accelerator_kwargs)
    if accelerator_kwargs.get("log_with"):
        accelerator.init_trackers("exp")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    vitals = Vitals(
        [RuntimeMonitor(max_steps=len(SIZES) // ACC), ThroughputMonitor()],
        accelerator=accelerator,
        run_dir=run_dir,
        log_every_n_steps=1,
    )
    vitals.attach(model, optimizer)
    accelerator.register_for_checkpointing(vitals)
    return accelerator, model, optimizer, vitals


def _train(accelerator, model, optimizer, vitals, micro_batches: range) -> None:
    for i in micro_batches:
        x = torch.randn(SIZES[i], 4)
        vitals.batch(x, num_tokens=SIZES[i] * SEQ)
        with accelerator.accumulate(model):
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()


def _counts(run_dir: Path) -> dict[int, tuple[float, float, float]]:
    return {
        r["step"]: tuple(r["metrics"][f"time/{k}"] for k in ("batches", "samples", "tokens"))
        for r in read_jsonl(run_dir / "metrics.jsonl")
    }


@pytest.mark.parametrize("split", [5, 6, 7])
def test_checkpoint_inside_an_accumulation_window_resumes_the_uninterrupted_counts(
    tmp_path, fresh_accelerate_state, split
):
    """Saved after micro-batch ``split % ACC`` of step 1, the resumed run (Accelerate goes on
    at the next micro-batch of the window: ``save_state`` keeps its micro-batch counter)
    counts the micro-batches, samples and tokens the interrupted process consumed in that
    step, as an uninterrupted run does."""
    whole = tmp_path / "whole"
    accelerator, model, optimizer, vitals = _driver(whole, gradient_accumulation_steps=ACC)
    _train(accelerator, model, optimizer, vitals, range(len(SIZES)))
    vitals.close()
    whole_totals = vitals.state_dict()["callbacks"]["ThroughputMonitor"]["totals"]

    split_dir = tmp_path / "split"
    accelerator, model, optimizer, vitals = _driver(split_dir, gradient_accumulation_steps=ACC)
    _train(accelerator, model, optimizer, vitals, range(split))
    accelerator.save_state(tmp_path / "ckpt")
    vitals.close()  # the process ends here
    accelerator, model, optimizer, vitals = _driver(split_dir, gradient_accumulation_steps=ACC)
    accelerator.load_state(tmp_path / "ckpt")
    assert accelerator.step == split  # Accelerate resumes inside the window
    assert vitals.step == 1
    _train(accelerator, model, optimizer, vitals, range(split, len(SIZES)))
    vitals.close()
    assert vitals.step == len(SIZES) // ACC
    split_totals = vitals.state_dict()["callbacks"]["ThroughputMonitor"]["totals"]

    # independent: cumulative sums of the micro-batches up to each step's end
    expected = {
        s: (float(ACC * (s + 1)), float(sum(SIZES[: ACC * (s + 1)])), float(SEQ * sum(SIZES[: ACC * (s + 1)])))
        for s in range(len(SIZES) // ACC)
    }  # fmt: skip
    assert _counts(whole) == expected
    assert _counts(split_dir) == expected
    assert (
        whole_totals
        == split_totals
        == {
            "steps": 3.0,
            "batches": float(len(SIZES)),
            "samples": float(sum(SIZES)),
            "tokens": float(SEQ * sum(SIZES)),
        }
    )


def test_a_checkpoint_right_after_a_restore_inside_a_window_keeps_its_micro_batches(tmp_path):
    """A plain loop saving ``vitals.state_dict()`` inside a window, restoring it and saving again
    before the next micro-batch: the second checkpoint still holds the window's micro-batches."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def driver() -> Vitals:
        return Vitals([RuntimeMonitor(max_steps=3)], run_dir=tmp_path, log_every_n_steps=1).attach(
            model, optimizer
        )

    vitals = driver()
    for i in range(6):  # step 0 (4 micro-batches), then 2 of step 1
        x = torch.randn(SIZES[i], 4)
        vitals.batch(x, num_tokens=SIZES[i] * SEQ)
        model(x).pow(2).mean().backward()
        if i % ACC == ACC - 1:
            optimizer.step()
            optimizer.zero_grad()
    first = vitals.state_dict()
    vitals.close()
    vitals = driver()
    vitals.load_state_dict(first)
    second = vitals.state_dict()
    vitals.close()
    vitals = driver()
    vitals.load_state_dict(second)
    for i in range(6, 8):
        x = torch.randn(SIZES[i], 4)
        vitals.batch(x, num_tokens=SIZES[i] * SEQ)
        model(x).pow(2).mean().backward()
    optimizer.step()
    vitals.close()
    assert vitals.step == 2
    last = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    assert last["step"] == 1
    metrics = last["metrics"]
    assert (metrics["time/batches"], metrics["time/samples"], metrics["time/tokens"]) == (
        8.0,
        float(sum(SIZES[:8])),
        float(SEQ * sum(SIZES[:8])),
    )


@pytest.mark.parametrize("end_training_first", [True, False], ids=["end_first", "close_first"])
def test_end_training_before_or_after_close_keeps_every_step_in_one_event_file(
    tmp_path, monkeypatch, fresh_accelerate_state, end_training_first
):
    """``accelerator.end_training()`` finishes the trackers; before ``vitals.close()`` it used to
    leave the last step's values to a TensorBoard writer it had closed, which opened a second
    event file for them. Either order: one event file with every step, and every step in
    MLflow."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    accelerator, model, optimizer, vitals = _driver(
        tmp_path, log_with=["tensorboard", "mlflow"], project_dir=str(tmp_path / "proj")
    )
    run_id = accelerator.get_tracker("mlflow").active_run.info.run_id
    _train(accelerator, model, optimizer, vitals, range(3))  # 3 steps of 1 micro-batch
    if end_training_first:
        accelerator.end_training()
        vitals.close()
    else:
        vitals.close()
        accelerator.end_training()

    files = sorted((tmp_path / "proj").rglob("events.out.tfevents.*"))
    assert len(files) == 1, files
    events = EventAccumulator(str(files[0]))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("time/batches")]
    assert got == [(0, 1.0), (1, 2.0), (2, 3.0)]
    samples = [(e.step, e.value) for e in events.Scalars("time/samples")]
    assert samples == [(s, float(sum(SIZES[: s + 1]))) for s in range(3)]

    client = MlflowClient(tracking_uri)
    history = client.get_metric_history(run_id, "time/batches")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_end_training_first_without_trackers_keeps_every_jsonl_line(
    tmp_path, fresh_accelerate_state
):
    """No tracker: the driver's own ``metrics.jsonl``; ``end_training()`` first ends the run
    (a later ``vitals.batch()`` is ignored with a warning) and every step is in the file."""
    accelerator, model, optimizer, vitals = _driver(tmp_path)
    _train(accelerator, model, optimizer, vitals, range(3))
    accelerator.end_training()
    with pytest.warns(RuntimeWarning, match=r"batch\(\) after close"):
        vitals.batch(torch.randn(2, 4))
    vitals.close()
    assert {s: c[:2] for s, c in _counts(tmp_path).items()} == {
        s: (float(s + 1), float(sum(SIZES[: s + 1]))) for s in range(3)
    }
