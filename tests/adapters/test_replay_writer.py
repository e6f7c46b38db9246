"""ReplayWriter, the wrapper of a FanoutWriter that outlived a rollback: every argument form
FanoutWriter takes (its own and SummaryWriter's), the step found as the writer finds it, values
below the floor dropped and every other call forwarded unchanged; the forwarded methods; two
rollbacks through the driver."""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from trainvitals.adapters import FanoutWriter, JsonlSink, read_jsonl
from trainvitals.adapters.context import ReplayWriter, RunContext
from trainvitals.distributed import ProcessGroups

FLOOR = 5
DROPPED = "dropped from that writer"

# Every form as (key logged, args, kwargs), with the placeholder S where the step goes: in every
# place FanoutWriter looks for it (add_scalars' main_tag form logs "<main_tag>/x").
S = object()


def _scalar_forms(k: str) -> list[tuple[str, tuple, dict]]:
    return [
        (f"{k}.pos", (f"{k}.pos", 1.0, S), {}),
        (f"{k}.step_kw", (f"{k}.step_kw", 1.0), {"step": S}),
        (f"{k}.gs_kw", (f"{k}.gs_kw", 1.0), {"global_step": S}),
        (f"{k}.names", (), {"name": f"{k}.names", "value": 1.0, "step": S}),
        (f"{k}.sw_kw", (), {"tag": f"{k}.sw_kw", "scalar_value": 1.0, "global_step": S}),
        (f"{k}.sw_mixed", (f"{k}.sw_mixed",), {"scalar_value": 1.0, "global_step": S}),
        (f"{k}.walltime", (f"{k}.walltime", 1.0, S, 100.0), {}),
        (f"{k}.sw_pos", (f"{k}.sw_pos", 1.0, S, None, False, False), {}),
        (
            f"{k}.sw_all_kw",
            (),
            {
                "tag": f"{k}.sw_all_kw",
                "scalar_value": 1.0,
                "global_step": S,
                "walltime": 100.0,
                "new_style": True,
                "double_precision": True,
            },
        ),
        (f"{k}.tag_value", (), {"tag": f"{k}.tag_value", "value": 1.0, "step": S}),
        (f"{k}.none_then_gs", (f"{k}.none_then_gs", 1.0, None), {"global_step": S}),
    ]


def _scalars_forms(k: str) -> list[tuple[str, tuple, dict]]:
    return [
        (f"{k}.map_pos", ({f"{k}.map_pos": 1.0}, S), {}),
        (f"{k}.map_step_kw", ({f"{k}.map_step_kw": 1.0},), {"step": S}),
        (f"{k}.map_gs_kw", ({f"{k}.map_gs_kw": 1.0},), {"global_step": S}),
        (f"{k}.map_gs_third", ({f"{k}.map_gs_third": 1.0}, None, S), {}),
        (f"{k}.map_named", (), {"mapping": {f"{k}.map_named": 1.0}, "step": S}),
        (f"{k}.tag_pos/x", (f"{k}.tag_pos", {"x": 1.0}, S), {}),
        (f"{k}.tag_gs_kw/x", (f"{k}.tag_gs_kw", {"x": 1.0}), {"global_step": S}),
        (
            f"{k}.tag_dict_kw/x",
            (f"{k}.tag_dict_kw",),
            {"tag_scalar_dict": {"x": 1.0}, "global_step": S},
        ),
        (
            f"{k}.sw_kw/x",
            (),
            {"main_tag": f"{k}.sw_kw", "tag_scalar_dict": {"x": 1.0}, "global_step": S},
        ),
        (f"{k}.tag_walltime/x", (f"{k}.tag_walltime", {"x": 1.0}, S, 100.0), {}),
        (
            f"{k}.sw_all_kw/x",
            (),
            {
                "main_tag": f"{k}.sw_all_kw",
                "tag_scalar_dict": {"x": 1.0},
                "global_step": S,
                "walltime": 100.0,
            },
        ),
        (
            f"{k}.tag_wall_kw/x",
            (f"{k}.tag_wall_kw", {"x": 1.0}),
            {"walltime": 100.0, "global_step": S},
        ),
        (
            f"{k}.sw_step_none/x",
            (),
            {
                "main_tag": f"{k}.sw_step_none",
                "tag_scalar_dict": {"x": 1.0},
                "step": None,
                "global_step": S,
            },
        ),
    ]


def _at(step: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return (
        tuple(step if a is S else a for a in args),
        {n: step if v is S else v for n, v in kwargs.items()},
    )


def _calls(k: str, step: Any) -> list[tuple[str, str, tuple, dict]]:
    """(method, key logged, args, kwargs) of every form at ``step``."""
    return [("add_scalar", key, *_at(step, a, kw)) for key, a, kw in _scalar_forms(k)] + [
        ("add_scalars", key, *_at(step, a, kw)) for key, a, kw in _scalars_forms(k)
    ]


class _Recording:
    """A writer that records every call as it was made."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.closed = False

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("add_scalar", args, kwargs))

    def add_scalars(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("add_scalars", args, kwargs))

    def flush(self, *args: Any, **kwargs: Any) -> bool:
        self.calls.append(("flush", args, kwargs))
        return True

    def close(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("close", args, kwargs))

    def end_step(self) -> None:
        self.calls.append(("end_step", (), {}))

    def resume_at(self, step: int) -> None:
        self.calls.append(("resume_at", (step,), {}))

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.calls.append(("__exit__", (exc_type, exc), {}))


def _replay(writer: Any) -> tuple[ReplayWriter, RunContext]:
    ctx = RunContext(writer=writer, groups=ProcessGroups())
    return ReplayWriter(writer, floor=FLOOR, ctx=ctx), ctx


def test_every_call_form_below_the_floor_is_dropped_and_the_others_forwarded_unchanged():
    fake = _Recording()
    writer, ctx = _replay(fake)
    steps = [3, np.int64(4), FLOOR, np.int64(FLOOR + 1), FLOOR + 7]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in steps:
            for method, _, args, kwargs in _calls("k", step):
                getattr(writer, method)(*args, **kwargs)
    # the calls at steps >= FLOOR reach the writer as they were made, in order; none below
    expected = [
        (method, args, kwargs)
        for step in steps
        if step >= FLOOR
        for method, _, args, kwargs in _calls("k", step)
    ]
    assert len(expected) == 3 * (11 + 13)
    assert fake.calls == expected
    assert len([w for w in caught if DROPPED in str(w.message)]) == 1
    assert ctx.replay_warned


def test_every_call_form_through_a_fanout_writer_writes_from_the_floor_on(tmp_path):
    # The writer holds the abandoned timeline's step FLOOR - 1: a lower step reaching it would
    # raise ValueError. Read back from the JSONL: nothing below the floor, every form's key at
    # the floor, as the same calls made on a FanoutWriter directly log them.
    fanout = FanoutWriter([JsonlSink(tmp_path / "replayed.jsonl")], background=False)
    fanout.add_scalar("old", 2.0, FLOOR - 1)
    writer, _ = _replay(fanout)
    direct = FanoutWriter([JsonlSink(tmp_path / "direct.jsonl")], background=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (2, np.int64(FLOOR - 1)):
            for method, _, args, kwargs in _calls("lo", step):
                getattr(writer, method)(*args, **kwargs)
        for method, _, args, kwargs in _calls("hi", FLOOR):
            getattr(writer, method)(*args, **kwargs)
            getattr(direct, method)(*args, **kwargs)
    fanout.close()
    direct.close()
    assert len([w for w in caught if DROPPED in str(w.message)]) == 1
    rows = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "replayed.jsonl")}
    keys = {key: 1.0 for _, key, _, _ in _calls("hi", FLOOR)}
    assert len(keys) == 11 + 13
    assert rows == {FLOOR - 1: {"old": 2.0}, FLOOR: keys}
    assert {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "direct.jsonl")} == {FLOOR: keys}


def test_a_call_the_writer_refuses_raises_as_it_does_below_the_floor_too():
    # A call whose arguments FanoutWriter refuses is not dropped silently below the floor: it
    # goes to the writer and raises its TypeError, with its message, as at the floor.
    def bad(step):
        return [
            ("add_scalar", (), {"name": "a", "tag": "a", "value": 1.0, "step": step}),
            ("add_scalar", ("a",), {"value": 1.0, "scalar_value": 1.0, "step": step}),
            ("add_scalar", ("a", 1.0, step), {"unknown": 1}),
            ("add_scalar", ("a", 1.0, step, None, False, False, 7), {}),
            ("add_scalars", ({"a": 1.0},), {"tag_scalar_dict": {"x": 1.0}, "global_step": step}),
            ("add_scalars", ("m", {"x": 1.0}), {"main_tag": "m", "global_step": step}),
            ("add_scalars", ("m", {"x": 1.0}, step, None, 9), {}),
            ("add_scalar", ("a", 1.0, step), {"global_step": step}),  # the step twice
            ("add_scalars", ({"a": 1.0}, step), {"global_step": step}),
        ]

    raised = 0
    for step in (2, FLOOR):
        for method, args, kwargs in bad(step):
            with pytest.raises(TypeError) as direct:
                getattr(FanoutWriter([], background=False), method)(*args, **kwargs)
            fanout = FanoutWriter([], background=False)
            fanout.add_scalar("old", 1.0, FLOOR - 1)
            writer, _ = _replay(fanout)
            with pytest.raises(TypeError) as replayed:
                getattr(writer, method)(*args, **kwargs)
            assert str(replayed.value) == str(direct.value), (method, args, kwargs)
            raised += 1
    assert raised == 2 * 9


def test_the_step_is_found_with_fanout_writers_own_parameters():
    # ReplayWriter reads the step from a copy of FanoutWriter's parameter lists: they must
    # stay the same, or a form would be misread (and a replayed step refused with ValueError)
    from trainvitals.adapters import context

    for method, mirror in (("add_scalar", "_scalar_step"), ("add_scalars", "_scalars_step")):
        own = list(inspect.signature(getattr(FanoutWriter, method)).parameters.values())[1:]
        copied = list(inspect.signature(getattr(context, mirror)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in copied] == [
            (p.name, p.kind, p.default) for p in own
        ]


def test_the_other_methods_go_to_the_writer():
    fake = _Recording()
    writer, _ = _replay(fake)
    assert writer.flush(timeout=2.5) is True
    writer.end_step()
    writer.resume_at(7)
    writer.close(1.0, failed=True)
    assert writer.closed is False
    error = ValueError("diverged")
    with pytest.raises(ValueError), writer as entered:
        assert entered is writer
        raise error
    assert fake.calls == [
        ("flush", (), {"timeout": 2.5}),
        ("end_step", (), {}),
        ("resume_at", (7,), {}),
        ("close", (1.0,), {"failed": True}),
        ("__exit__", (ValueError, error), {}),
    ]
    # a copy (made before __init__'s attributes exist) goes to the same writer
    copied = copy.copy(writer)
    copied.add_scalar("a", 1.0, FLOOR)
    with pytest.warns(RuntimeWarning, match=DROPPED):
        copied.add_scalar("a", 1.0, FLOOR - 1)
    assert fake.calls[-1] == ("add_scalar", ("a", 1.0, FLOOR), {})
    with pytest.raises(AttributeError):
        _ = writer.no_such_method


def test_with_a_replay_writer_closes_the_fanout_writer(tmp_path):
    fanout = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")], background=False)
    fanout.add_scalar("old", 1.0, FLOOR - 1)
    writer, _ = _replay(fanout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with writer:
            writer.add_scalar(tag="old", scalar_value=3.0, global_step=FLOOR - 1)
            writer.add_scalar(tag="new", scalar_value=4.0, global_step=FLOOR)
    assert fanout.closed and writer.closed
    rows = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert rows == {FLOOR - 1: {"old": 1.0}, FLOOR: {"new": 4.0}}


def test_two_rollbacks_with_summary_writer_style_calls(tmp_path):
    # A FanoutWriter given to Vitals, and one given to a callback, outlive two in-process
    # rollbacks; the callbacks write with SummaryWriter's keywords. The first rollback leaves
    # step 6 (floor 6), the second leaves step 5, lower: the floor stays 6. Each writer keeps
    # timeline A's steps 0..5 and gets timeline C's from 6 on; B's and C's below 6 are
    # dropped, and neither callback is disabled.
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks.base import VitalsCallback

    timeline = {"now": 1}

    class Tagged(VitalsCallback):
        def step_end(self, ctx):
            value = 100.0 * timeline["now"] + ctx.step
            self.writer(ctx).add_scalar(tag="v", scalar_value=value, global_step=ctx.step)
            self.writer(ctx).add_scalars(
                main_tag="m", tag_scalar_dict={"v": value}, global_step=ctx.step
            )

    given = FanoutWriter([JsonlSink(tmp_path / "given.jsonl")], background=False)
    own = FanoutWriter([JsonlSink(tmp_path / "own.jsonl")], background=False)
    run_writer, own_writer = Tagged(), Tagged(writer=own)
    own_writer.state_key = "own"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals = Vitals([run_writer, own_writer], writer=given, log_every_n_steps=1)
    vitals.attach(model, opt)

    def steps(n):
        for _ in range(n):
            x = torch.full((2, 4), 0.5)
            vitals.batch(x)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps(1)  # A: step 0
        after_0 = vitals.state_dict()
        steps(1)  # A: step 1
        after_1 = vitals.state_dict()
        steps(4)  # A: steps 2..5
        timeline["now"] = 2
        vitals.load_state_dict(after_1)
        steps(3)  # B: steps 2..4
        timeline["now"] = 3
        vitals.load_state_dict(after_0)
        steps(8)  # C: steps 1..8
        vitals.close()
    given.close()
    own.close()
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "disabled" in m], messages
    assert len([m for m in messages if DROPPED in m]) == 1
    assert vitals.ctx.replay_floor == 6
    expected = {s: 100.0 + s for s in range(6)} | {s: 300.0 + s for s in range(6, 9)}
    for name in ("given", "own"):
        rows = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / f"{name}.jsonl")}
        assert rows == {s: {"v": v, "m/v": v} for s, v in expected.items()}, name
