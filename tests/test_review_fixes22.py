"""Defects a review of session 22's own change found, each with the number or behaviour that
shows it: the flop step's ``force_eager`` stance leaked or left on, the driver's pre-hook in a
training function compiled with ``fullgraph=True``, Lightning's compiled LightningModule not seen
as compiled by TensorStatsMonitor, and a parameter a user swaps in without the optimizer taken
for an FSDP2 leftover."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import NormMonitor, TensorStatsMonitor, ThroughputMonitor


def _stance() -> str:
    from torch._dynamo import eval_frame

    return eval_frame._stance.stance


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


class _Passthrough(TorchDispatchMode):  # a user's profiler or debug mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_flop_session_that_cannot_leave_its_mode_puts_the_stance_back() -> None:
    # A dispatch mode entered after the counter's (around step 0's backward and optimizer
    # step) keeps the counter from being left; the session ended with force_eager still on, and
    # every compiled model of the process ran eagerly from then on (0 compiled calls).
    calls = 0

    def counting(gm, example):
        def run(*args):
            nonlocal calls
            calls += 1
            return gm.forward(*args)

        return run

    torch._dynamo.reset()
    model = _mlp()
    compiled = torch.compile(model, backend=counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    per_step = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Vitals(
            [ThroughputMonitor(measure_flops=True, window_size=2)],
            writer=RecordingWriter(),
            log_every_n_steps=1,
        ) as vitals:
            vitals.attach(compiled, opt)
            for step in range(3):
                x = torch.randn(4, 8)
                vitals.batch(x)
                before = calls
                loss = compiled(x).pow(2).mean()
                if step == 0:
                    with _Passthrough():
                        loss.backward()
                        opt.step()
                else:
                    loss.backward()
                    opt.step()
                opt.zero_grad()
                per_step.append(calls - before)
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    # the counter is left at the next step, once the user's mode is gone (it stayed on for
    # good: every later op of the process went through it)
    assert _get_current_dispatch_mode() is None
    assert _stance() == "default"
    # the steps after the measured one run the compiled graph (0 calls when left on)
    assert per_step[1] > 0 and per_step[2] == per_step[1]


def test_the_flop_step_leaves_a_users_own_stance_alone() -> None:
    # The user sets a stance around forward and backward only; the session, started inside
    # that block and stopped after it, restored the user's stance after the user had left it.
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    with Vitals(
        [ThroughputMonitor(measure_flops=True, window_size=2)],
        writer=RecordingWriter(),
        log_every_n_steps=1,
    ) as vitals:
        vitals.attach(model, opt)
        for _ in range(2):
            x = torch.randn(4, 8)
            with torch.compiler.set_stance("eager_on_recompile"):
                vitals.batch(x)
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            seen.append(_stance())
    assert seen == ["default", "default"]
    assert _stance() == "default"


@pytest.mark.parametrize("calls_batch", [True, False])
def test_a_training_function_compiled_with_fullgraph_runs_under_the_driver(
    calls_batch: bool,
) -> None:
    # torch.compile(fn, fullgraph=True) calling the attached model traces the model's hooks:
    # the driver's pre-hook, a torch.compiler.disable'd function, made the forward raise
    # Unsupported at step 0. It must run, and the norms must be the float64 ones; a loop that
    # does not call batch() is told once that its forwards cannot be counted.
    torch._dynamo.reset()
    model = _mlp()
    reference = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)

    @torch.compile(fullgraph=True, backend="eager")
    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    writer = RecordingWriter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            expected = []
            for _ in range(3):
                x = torch.randn(4, 8)
                if calls_batch:
                    vitals.batch(x)
                reference(x).pow(2).mean().backward()
                expected.append(
                    math.sqrt(
                        sum(float(p.grad.double().square().sum()) for p in reference.parameters())
                    )
                )
                ref_opt.step()
                ref_opt.zero_grad()
                loss_of(x).backward()
                opt.step()
                opt.zero_grad()
    traced = [w for w in caught if "cannot see its forwards" in str(w.message)]
    assert len(traced) == (0 if calls_batch else 1)
    got = writer.key("l2_norm/grad/global")
    assert list(got.values()) == pytest.approx(expected, rel=1e-5)


def test_lightnings_compiled_module_keeps_its_activation_hooks(tmp_path: Path) -> None:
    # Lightning takes torch.compile(lm) apart (from_compiled: its forward and training_step
    # compiled, no _orig_mod). Resumed at a step that does not log, its first compiled step
    # ran without hooks, and every later activation/dgrad record was empty (0 sites for 4).
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from tests.scripts.vitals_testing import quiet_trainer

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

        def training_step(self, batch, index):
            return self(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def data() -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g)), batch_size=4)

    records = {}
    for compiled in (False, True):
        root = tmp_path / ("compiled" if compiled else "eager")
        torch._dynamo.reset()
        torch.manual_seed(0)
        first = quiet_trainer(max_steps=1, default_root_dir=root, log_every_n_steps=3)
        first.fit(LM(), data())
        ckpt = root / "a.ckpt"
        first.save_checkpoint(ckpt)
        torch._dynamo.reset()  # a new process: nothing compiled yet
        lm = LM()
        monitor = TensorStatsMonitor(kernel="eager", kinds=("activation", "dgrad"))
        trainer = quiet_trainer(
            max_steps=7, default_root_dir=root, log_every_n_steps=3, callbacks=[monitor]
        )
        trainer.fit(torch.compile(lm, backend="eager") if compiled else lm, data(), ckpt_path=ckpt)
        lines = [
            json.loads(s)
            for f in root.rglob("tensor_stats.jsonl")
            for s in f.read_text().splitlines()
        ]
        records[compiled] = {(r["step"], r["kind"]): sorted(r["tensors"]) for r in lines}
    assert records[False][(3, "activation")]  # the sites of the uncompiled run
    assert records[True] == records[False]


def test_a_parameter_swapped_in_without_the_optimizer_is_the_one_measured(tmp_path: Path) -> None:
    # The rule that keeps FSDP2's sharded parameters over the unsharded ones it leaves
    # registered took any parameter in no optimizer for a leftover: a head bias a user put in
    # place (the model computes with it) was measured as the old, stale one.
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    with Vitals(
        [NormMonitor(per_param=["2.bias"], per_param_kinds=("param",))],
        writer=writer,
        log_every_n_steps=1,
    ) as vitals:
        vitals.attach(model, opt)
        for step in range(2):
            if step == 1:
                model[2].bias = nn.Parameter(torch.full((8,), 7.0))
            x = torch.randn(4, 8)
            vitals.batch(x)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert writer.key("l2_norm/param/2.bias")[1] == pytest.approx(7.0 * math.sqrt(8), rel=1e-6)


def test_norms_of_fsdp1_views_whose_units_are_out_of_reach_are_refused() -> None:
    # FSDP1 with use_orig_params=True wrapped at the root only: the module the monitor is given
    # holds views into this rank's flat shard (marked _fsdp_flattened) and no unit to add them
    # over. Its "norms" were a rank's pieces taken for whole tensors.
    model = _mlp()
    for p in model.parameters():
        p._fsdp_flattened = True  # torch's _set_fsdp_flattened mark
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            for _ in range(2):
                x = torch.randn(4, 8)
                vitals.batch(x)
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    assert not any(k.startswith("l2_norm/") for row in writer.rows.values() for k in row)
    assert len([w for w in caught if "FSDP1" in str(w.message)]) == 1


def test_an_evaluation_compiled_apart_is_not_warned_about() -> None:
    # Training forwards run eagerly (counted by the pre-hook); an evaluation through a compiled
    # function under no_grad traced the pre-hook too, which took it for training forwards it
    # could not count and warned.
    torch._dynamo.reset()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    evaluate = torch.compile(lambda x: model(x), backend="eager")
    writer = RecordingWriter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            for _ in range(3):
                x = torch.randn(4, 8)
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                model.eval()
                with torch.no_grad():
                    evaluate(x)
                model.train()
    assert not [w for w in caught if "cannot see its forwards" in str(w.message)]
    assert sorted(writer.key("l2_norm/grad/global")) == [0, 1, 2]


def test_a_window_restored_from_many_ranks_is_carried_again() -> None:
    # 2 old ranks carried 2100 micro-batches each; restored on one rank, that rank is told all
    # 4200, beyond the 4096 a window keeps: it warned "no optimizer step ran" and a checkpoint
    # taken later in the step carried none of them (a second resume lost 4200 micro-batches).
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = ThroughputMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vitals = Vitals([monitor], writer=RecordingWriter(), log_every_n_steps=1)
        vitals.attach(model, opt)
        row = [{monitor.state_key: [2, 8]} for _ in range(2100)]
        vitals.load_state_dict(
            {
                "step": 3,
                "callbacks": {},
                "micro_batches_in_step": row,
                "micro_batches_in_step_by_rank": [row, row],
                "world_size": 2,
            }
        )
        x = torch.ones(2, 2)
        vitals.batch(x)
        model(x).sum().backward()
        mid = vitals.state_dict()
        opt.step()
        opt.zero_grad()
        vitals.close()
    assert not [w for w in caught if "without the end of an optimizer step" in str(w.message)]
    assert len(mid["micro_batches_in_step"]) == 4201  # the 4200 told again and this one


def test_a_frozen_fsdp1_teacher_leaves_the_students_statistics(tmp_path: Path) -> None:
    # A frozen teacher wrapped in FSDP1 inside a student trained plainly (distillation): the
    # FSDP1 check refused the student's param/grad lines too, though they are whole tensors.
    class FullyShardedDataParallel(nn.Module):  # stands for torch's, by class name
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    class Student(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.teacher = FullyShardedDataParallel().requires_grad_(False)
            self.body = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) + self.teacher(x).detach()

    torch.manual_seed(0)
    model = Student()
    opt = torch.optim.SGD(model.body.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals(
            [TensorStatsMonitor(kinds=("param",), kernel="eager")],
            writer=RecordingWriter(),
            run_dir=tmp_path,
            log_every_n_steps=1,
        ) as vitals:
            vitals.attach(model, opt)
            x = torch.randn(4, 8)
            vitals.batch(x)
            model(x).pow(2).mean().backward()
            weight = model.body.weight.detach().double().clone()
            opt.step()
            opt.zero_grad()
    assert not [w for w in caught if "FSDP1" in str(w.message)]
    (line,) = [json.loads(s) for s in (tmp_path / "tensor_stats.jsonl").read_text().splitlines()]
    from trainvitals.stats.moments import FIELDS

    assert sorted(line["tensors"]) == ["body.bias", "body.weight"]
    mean = line["tensors"]["body.weight"][FIELDS.index("mean")]
    assert mean == pytest.approx(float(weight.mean()), rel=1e-6)
