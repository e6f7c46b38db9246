"""The Vitals driver called carelessly: a configuration mistake is a clear error at construction,
attach() or load_state_dict(), before anything changes, instead of a failure inside the loop, a
silently disabled callback, or values mixed from two runs."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from tests.scripts.vitals_testing import FakeClock, RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import NormMonitor, ThroughputMonitor


def _model_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(vitals, model, opt, steps, batch_size=8, clock=None):
    for _ in range(steps):
        x = torch.randn(batch_size, 4)
        vitals.batch(x)
        if clock is not None:
            clock.t += 1.0
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    ("value", "error"), [("5", TypeError), (1.5, TypeError), (True, TypeError), (0, ValueError)]
)
def test_a_bad_accumulate_grad_batches_is_refused_at_construction(value, error):
    # "5" used to pass construction and fail in the loop's first batch() (int > str)
    with pytest.raises(error, match="accumulate_grad_batches"):
        Vitals([NormMonitor()], writer=RecordingWriter(), accumulate_grad_batches=value)


def test_a_callback_class_or_other_object_is_refused_at_construction():
    with pytest.raises(
        TypeError, match=r"callbacks\[1\] is the class NormMonitor.*NormMonitor\(\)"
    ):
        Vitals([ThroughputMonitor(), NormMonitor], writer=RecordingWriter())
    with pytest.raises(TypeError, match=r"callbacks\[0\] is not a trainvitals callback"):
        Vitals([object()], writer=RecordingWriter())


def test_a_writer_or_groups_of_the_wrong_kind_is_refused_at_construction(tmp_path):
    # a folder given as writer= used to disable every callback at its first write and make
    # close() raise AttributeError
    with pytest.raises(TypeError, match="writer must be"):
        Vitals([NormMonitor()], writer=str(tmp_path))
    with pytest.raises(TypeError, match="groups must be"):
        Vitals([NormMonitor()], writer=RecordingWriter(), groups="dp")


def test_a_run_dir_that_is_a_file_or_not_a_path_is_refused(tmp_path):
    file = tmp_path / "afile"
    file.write_text("not a folder")
    # (it used to log nothing: the JSONL sink was disabled at step 0 with a warning)
    with pytest.raises(ValueError, match=r"run_dir .* is a file"):
        Vitals([NormMonitor()], run_dir=file)
    assert file.read_text() == "not a folder"
    with pytest.raises(TypeError, match="run_dir must be"):
        Vitals([NormMonitor()], run_dir=None)


def test_attach_with_no_optimizer_is_refused():
    model, _ = _model_opt()
    vitals = Vitals([NormMonitor()], writer=RecordingWriter())
    # nothing would ever end a step: not one value logged, no error
    with pytest.raises(ValueError, match="attach\\(\\) needs an optimizer"):
        vitals.attach(model, [])


def test_a_writer_without_flush_does_not_fail_close():
    class AddOnly:
        def __init__(self):
            self.rows = {}

        def add_scalars(self, mapping, step):
            self.rows.setdefault(step, {}).update({k: float(v) for k, v in mapping.items()})

    writer = AddOnly()
    model, opt = _model_opt()
    vitals = Vitals([NormMonitor()], writer=writer, log_every_n_steps=1).attach(model, opt)
    _train(vitals, model, opt, 2)
    vitals.close()  # used to raise AttributeError: no flush
    assert sorted(writer.rows) == [0, 1]


def test_one_callback_instance_cannot_run_in_two_open_drivers():
    clock = FakeClock()
    shared = ThroughputMonitor(window_size=1, warmup_steps=0, clock=clock)
    model_a, opt_a = _model_opt()
    model_b, opt_b = _model_opt()
    first = Vitals([shared], writer=RecordingWriter(), log_every_n_steps=1).attach(model_a, opt_a)
    # interleaved, the two runs' micro-batches were counted into each other's steps
    # (samples per batch 6.3 and 5.5 for batches of 8 and 3)
    with pytest.raises(ValueError, match="ThroughputMonitor already running in another Vitals"):
        Vitals([shared], writer=RecordingWriter()).attach(model_b, opt_b)
    _train(first, model_a, opt_a, 2, batch_size=8, clock=clock)
    first.close()
    # after close() the instance may serve a second run (warned by the callback)
    writer = RecordingWriter()
    second = Vitals([shared], writer=writer, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*already ran", RuntimeWarning)
        second.attach(model_b, opt_b)
        _train(second, model_b, opt_b, 3, batch_size=3, clock=clock)
    second.close()
    # 3 samples and 1 batch per 1 s step
    assert writer.key("throughput/samples_per_sec")[2] == pytest.approx(3.0, rel=1e-12)
    assert writer.key("throughput/batches_per_sec")[2] == pytest.approx(1.0, rel=1e-12)


def _trained(tmp_path):
    model, opt = _model_opt()
    vitals = Vitals([NormMonitor()], run_dir=tmp_path, log_every_n_steps=1).attach(model, opt)
    _train(vitals, model, opt, 2)
    return vitals, model, opt


@pytest.mark.parametrize("step", [-5, "abc", 2.7, None])
def test_a_bad_step_in_load_state_dict_changes_nothing(tmp_path, step):
    vitals, model, opt = _trained(tmp_path)
    writer = vitals.ctx.writer
    # -5 used to close the run's writer, then fail; 2.7 became step 2; None a TypeError
    with pytest.raises(ValueError, match="'step' must be a non-negative int"):
        vitals.load_state_dict({"step": step, "callbacks": {}})
    assert vitals.step == 2 and vitals.ctx.writer is writer
    _train(vitals, model, opt, 2)
    vitals.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]


def test_a_state_dict_that_is_not_the_drivers_is_refused(tmp_path):
    vitals, _, _ = _trained(tmp_path)
    state = vitals.state_dict()
    with pytest.raises(ValueError, match="'callbacks' must be a dict"):
        vitals.load_state_dict({"step": 7, "callbacks": list(state["callbacks"])})
    with pytest.raises(ValueError, match="expected keys 'step' and 'callbacks'"):
        vitals.load_state_dict({"callbacks": state["callbacks"]})  # used to restore step 0
    assert vitals.step == 2
    vitals.close()


def test_unreadable_window_sizes_are_warned_and_the_rest_is_restored(tmp_path):
    vitals, _, _ = _trained(tmp_path)
    state = vitals.state_dict()
    vitals.close()
    model, opt = _model_opt()
    resumed = Vitals([NormMonitor()], writer=RecordingWriter(), log_every_n_steps=1)
    resumed.attach(model, opt)
    damaged = dict(state, micro_batches_in_step=[{"NormMonitor": 5}])
    # used to raise TypeError half-way: step set, callbacks restored, window not
    with pytest.warns(RuntimeWarning, match=r"micro-batch sizes .* are unreadable"):
        resumed.load_state_dict(damaged)
    assert resumed.step == 2 and resumed._carried == []
    _train(resumed, model, opt, 1)
    assert resumed.step == 3
    resumed.close()


def test_a_tensorboard_summary_writer_is_refused_with_the_sink_to_use(tmp_path):
    # SummaryWriter.add_scalars(main_tag, tag_scalar_dict, global_step) passed the add_scalars
    # check; every callback then failed at its first write and was disabled
    from torch.utils.tensorboard import SummaryWriter

    from trainvitals.adapters import FanoutWriter
    from trainvitals.adapters.sinks.tensorboard import TensorBoardSink

    summary = SummaryWriter(log_dir=str(tmp_path / "tb"))
    try:
        with pytest.raises(TypeError, match=r"main_tag.*TensorBoardSink\(summary_writer\)"):
            Vitals([NormMonitor()], writer=summary)
        # the suggested writer works: a step's global norm reaches the event file's writer
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        writer = FanoutWriter([TensorBoardSink(summary)])
        with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            vitals.batch(torch.ones(2, 3))
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
        writer.close()
        assert not vitals.callbacks[0]._disabled
    finally:
        summary.close()
