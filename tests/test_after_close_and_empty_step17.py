"""Two robustness gaps: a ``FanoutWriter`` used after ``close()`` (a lower step raised
``ValueError``; ``flush()`` called a closed sink) and ``RuntimeMonitor`` after a step that had no
micro-batch (``time/batches``, ``time/samples`` and ``time/tokens`` were never written again)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import pytest
import torch

from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters import FanoutWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.adapters.sinks.base import Sink
from trainvitals.callbacks import RuntimeMonitor

# ---------------------------------------------------------------- 1. the writer after close()


class _CallSink(Sink):
    """Records every call the writer makes: ``calls`` is a list of (method, step or None)."""

    def __init__(self, name: str, *, thread_safe: bool) -> None:
        super().__init__(name=name)
        self.thread_safe = thread_safe
        self.calls: list[tuple[str, int | None]] = []

    def resume_at(self, step: int) -> None:
        self.calls.append(("resume_at", step))

    def open(self) -> None:
        self.calls.append(("open", None))

    def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
        self.calls.append(("write", step))

    def flush(self) -> None:
        self.calls.append(("flush", None))

    def close(self) -> None:
        self.calls.append(("close", None))


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
@pytest.mark.parametrize("rank", [0, 1])
def test_logging_after_close_at_any_step_warns_once_and_returns(background, rank) -> None:
    """Before, a step lower than the last one given raised ``ValueError`` ("steps must not
    decrease") after ``close()``, although logging after close only warns: a callback logging
    once more at an earlier step (a rollback's step) crashed the run."""
    sinks = [_CallSink("threaded", thread_safe=True), _CallSink("caller", thread_safe=False)]
    writer = FanoutWriter(sinks, rank=rank, background=background)
    writer.add_scalar("a", 1.0, 5)
    writer.close()
    before = [list(s.calls) for s in sinks]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer.add_scalar("a", 2.0, 3)  # lower than 5
        writer.add_scalars({"a": 2.0, "b": 3.0}, 0)
        writer.add_scalars("loss", {"train": 1.0}, global_step=1)  # SummaryWriter's form
        writer.add_scalar(tag="a", scalar_value=2.0, global_step=9)  # higher
        writer.add_scalar("a", torch.tensor(2.0), 4)  # lower again
    messages = [str(w.message) for w in caught]
    assert messages == ["trainvitals FanoutWriter: values logged after close() are dropped"]
    assert [s.calls for s in sinks] == before  # nothing more reached a sink
    # bad input still raises after close, as before it (a bug in the caller, on every rank)
    with pytest.raises(TypeError, match="must be a real number"):
        writer.add_scalar("a", "x", 1)


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
def test_other_methods_after_close_call_no_sink_and_raise_nothing(background) -> None:
    """Before, ``flush()`` after ``close()`` flushed a closed training-thread sink again
    (``Sink.close`` is its last call); now ``end_step``, ``flush``, ``resume_at``,
    ``status`` and a second ``close`` call no sink."""
    sinks = [_CallSink("threaded", thread_safe=True), _CallSink("caller", thread_safe=False)]
    writer = FanoutWriter(sinks, rank=0, background=background)
    writer.add_scalar("a", 1.0, 0)
    writer.add_scalar("a", 2.0, 1)
    writer.close()
    expected = [("open", None), ("write", 0), ("write", 1), ("close", None)]
    assert [s.calls for s in sinks] == [expected, expected]
    status = writer.status()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer.add_scalar("a", 3.0, 1)
        writer.end_step()
        assert writer.flush() is True  # every sink got every step
        writer.resume_at(0)
        writer.end_step()
        assert writer.flush(timeout=0.1) is True
        writer.close()
    assert [s.calls for s in sinks] == [expected, expected]
    assert writer.status() == status
    assert status["caller"]["delivered"] == status["threaded"]["delivered"] == 2
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert "after close() are dropped" in messages[0] and "resume_at(0)" in messages[1]


def test_flush_after_close_reports_a_sink_that_missed_steps() -> None:
    """After close, ``flush()`` says whether every sink got everything (not a disabled one),
    without flushing the closed sink (before, a training-thread sink was flushed again)."""

    class Broken(_CallSink):
        def write(self, step: int, metrics: Mapping[str, float], wall_time: float) -> None:
            raise ConnectionError("down")

    broken = Broken("broken", thread_safe=False)
    writer = FanoutWriter([broken], rank=0, max_failures=1, retry_backoff=(0.0, 0.0))
    writer.add_scalar("a", 1.0, 0)
    with pytest.warns(RuntimeWarning):
        writer.close()
    assert writer.status()["broken"]["disabled"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either
        assert writer.flush() is False
    assert ("flush", None) not in broken.calls


# ---------------------------------------------------------------- 2. RuntimeMonitor, empty step

K = 2  # critic steps per batch
BATCHES = 5


def _size(b: int) -> int:
    return 2 + b % 3


def _tokens(b: int) -> int:
    return 3 * _size(b) + 1


def _wgan(log_every: int, validate_in_first_batch: bool) -> RecordingWriter:
    """Per batch: the generator steps, then the critic K times. An evaluation after the critic's
    first step of the run's first batch ends the step there (every optimizer stepped; there is
    no earlier batch to compare with), and the critic's second step starts the next step: a
    step with no micro-batch (the driver's module docstring)."""
    torch.manual_seed(0)
    gen, dis = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)
    model = torch.nn.ModuleDict({"gen": gen, "dis": dis})
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(dis.parameters(), lr=0.01)
    writer = RecordingWriter()
    vitals = Vitals([RuntimeMonitor(max_steps=10)], writer=writer, log_every_n_steps=log_every)
    vitals.attach(model, [opt_d, opt_g])
    for b in range(BATCHES):
        vitals.batch(torch.randn(_size(b), 4), num_tokens=_tokens(b))
        opt_g.zero_grad()
        (-dis(gen(torch.randn(_size(b), 3))).mean()).backward()
        opt_g.step()
        for k in range(K):
            opt_d.zero_grad()
            fake = gen(torch.randn(_size(b), 3)).detach()
            (dis(fake).mean() - dis(torch.randn(_size(b), 4)).mean()).backward()
            opt_d.step()
            if validate_in_first_batch and (b, k) == (0, 0):
                with vitals.validating(), torch.no_grad():
                    dis(torch.ones(2, 4))
    vitals.close()
    return writer


@pytest.mark.parametrize("log_every", [1, 2])
def test_consumed_counts_come_back_after_a_step_without_micro_batches(log_every) -> None:
    """Batch 0 is split into step 0 (its micro-batch) and step 1 (none); batch b >= 1 is step
    b + 1. Before, step 1's "no micro-batch" mark stayed in the summed counts and the three
    keys were never written again (none at steps 2..5). Now step 1 writes none of them (its
    counts are not known) and every later logging step writes the hand-counted totals; with
    an interval of 2 the empty step is inside an interval, and step 2 writes them."""
    writer = _wgan(log_every, validate_in_first_batch=True)
    logged = sorted(s for s, row in writer.rows.items() if "time/train_hours" in row)
    # (interval 2: steps 0, 2, 4; the empty step 1 is inside an interval)
    assert logged == [s for s in range(BATCHES + 1) if s % log_every == 0]

    def batches_in(step: int) -> list[int]:  # the batches consumed by the end of ``step``
        return [0] if step == 0 else list(range(step))

    expected = {
        s: {
            "batches": float(len(batches_in(s))),
            "samples": float(sum(_size(b) for b in batches_in(s))),
            "tokens": float(sum(_tokens(b) for b in batches_in(s))),
        }
        for s in logged
        if s != 1
    }
    for name in ("batches", "samples", "tokens"):
        assert writer.key(f"time/{name}") == {s: v[name] for s, v in expected.items()}, name
    assert len(expected) == (5 if log_every == 1 else 3)


def test_the_same_loop_without_the_split_counts_alike() -> None:
    """Without the evaluation (no empty step) each batch is one step: the totals at the last
    step are the same as with the split (the empty step consumed nothing)."""
    plain = _wgan(1, validate_in_first_batch=False)
    split = _wgan(1, validate_in_first_batch=True)
    assert sorted(plain.rows) == list(range(BATCHES))
    for name in ("batches", "samples", "tokens"):
        assert plain.key(f"time/{name}")[BATCHES - 1] == split.key(f"time/{name}")[BATCHES]
