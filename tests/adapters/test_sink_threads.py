"""Sinks sharing a backend object with the training loop: whose thread calls it."""

from __future__ import annotations

import threading

from tests.adapters.conftest import read_comet_archive
from trainvitals.adapters import CometSink, FanoutWriter


def test_a_shared_comet_experiment_keeps_each_step_while_the_loop_logs_its_own(tmp_path) -> None:
    """Comet's ``log_metrics(d, step=)`` sets the experiment's current step, then logs every
    metric at whatever the current step is by then (``Experiment._log_metric`` reads
    ``curr_step``). The loop's own logger (Lightning's ``CometLogger``, Accelerate's tracker)
    moves that step on from the training thread: a writer thread in the middle of a step would
    log the rest of it at the loop's step. Here the loop logs step s + 1 exactly then."""
    import comet_ml

    experiment = comet_ml.OfflineExperiment(offline_directory=str(tmp_path / "comet"))
    training_thread = threading.current_thread()
    inside_sink_step = threading.Event()
    loop_logged = threading.Event()
    logged_by_other_threads = 0
    original = experiment._log_metric

    def log_metric(*args, **kwargs):
        nonlocal logged_by_other_threads
        if threading.current_thread() is not training_thread:
            logged_by_other_threads += 1
            if logged_by_other_threads == len(keys) + 2:  # mid-step 1: the loop logs step 2
                inside_sink_step.set()
                loop_logged.wait(10.0)
        return original(*args, **kwargs)

    experiment._log_metric = log_metric
    keys = [f"vitals/k{i}" for i in range(4)]
    with FanoutWriter([CometSink(experiment)], rank=0) as writer:
        for step in range(3):
            writer.add_scalars({k: 10.0 * step + i for i, k in enumerate(keys)}, step)
            writer.end_step()
            if step == 1:  # (waits in vain when the training thread delivers: nothing to race)
                inside_sink_step.wait(2.0)
            experiment.log_metrics({"loop/loss": float(step + 1)}, step=step + 1)
            if step == 1:
                loop_logged.set()
    experiment.end()
    got = read_comet_archive(tmp_path / "comet")
    got = {k: v for k, v in got.items() if not k.startswith("sys.")}  # Comet's own
    assert got == {
        **{k: {s: 10.0 * s + i for s in range(3)} for i, k in enumerate(keys)},
        "loop/loss": {s: float(s) for s in (1, 2, 3)},
    }


def test_a_training_thread_sink_gets_a_step_when_the_next_step_starts() -> None:
    """Logging every 50 steps, a step must not sit on the host for 50 more steps waiting for
    a training-thread sink (Comet on a shared experiment, CSV): a crash meanwhile loses it."""
    import time

    from tests.adapters.conftest import RecordingSink

    sink = RecordingSink(thread_safe=False)
    writer = FanoutWriter([sink], rank=0)
    writer.add_scalar("loss", 2.5, 50)
    writer.end_step()  # step 51 starts (the driver calls this every step)
    deadline = time.monotonic() + 20
    while writer.status()["recording"]["pending"] == 0:  # on the host, waiting for the sink
        assert time.monotonic() < deadline
        time.sleep(0.005)
    for _ in range(51, 60):  # steps that log nothing
        writer.end_step()
    assert [(step, metrics) for step, metrics, _ in sink.steps] == [(50, {"loss": 2.5})]
    writer.close()
