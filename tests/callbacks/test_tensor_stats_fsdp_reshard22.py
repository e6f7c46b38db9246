"""TensorStatsMonitor: FSDP2 without reshard after backward (2 gloo ranks); a model compiled and
run before the monitor attached (hooks that never fire); a state without dead entries.

Under ``set_reshard_after_backward(False)`` FSDP2 leaves its unsharded parameters (plain
tensors without gradients) registered in the modules at the optimizer step: the ``param`` and
``grad`` lines must still be those of the sharded parameters the optimizer updates, equal to
the float64 statistics of the whole tensors (``full_tensor()``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.shared_ranks import CASE_DIR, SharedRanks
from tests.scripts.vitals_testing import NullWriter
from tests.stats.test_moments import assert_written_moments
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor

ranks = SharedRanks(__name__)
case_runs, ran = ranks.fixtures()

STEPS = 3
MICRO = 2


def _lines(path: Path) -> dict[tuple[int, str], dict]:
    return {
        (r["step"], r["kind"]): r["tensors"] for r in map(json.loads, path.read_text().splitlines())
    }


# ---------------------------------------------------------- FSDP2, no reshard after backward


def _fsdp_body(rank: int, world_size: int, run_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from trainvitals.distributed import ProcessGroups

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(4, 6), nn.Tanh()),
        nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
        nn.Linear(6, 3),
    )
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for block in model[:2]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Accumulation without re-gathering: the unsharded parameters stay registered after every
    # backward, the optimizer step included; resharded by hand after the step (so that the
    # next forward gathers the updated weights)
    model.set_reshard_after_backward(False, recurse=True)
    sharded = dict(model.named_parameters())  # before any forward: FSDP2's sharded DTensors
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    whole: list[dict] = []
    registered_plain = []
    with Vitals(
        [TensorStatsMonitor(kinds=("param", "grad"), kernel="eager")],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=ProcessGroups.from_device_mesh(mesh),
        accumulate_grad_batches=MICRO,
    ) as vitals:
        vitals.attach(model, opt)
        for step in range(STEPS):
            for m in range(MICRO):
                g = torch.Generator().manual_seed(100 * step + 10 * rank + m)
                x = 1 + 2 * torch.randn(5, 4, generator=g)
                vitals.batch(x)
                model.set_requires_gradient_sync(m == MICRO - 1, recurse=True)
                model(x).pow(2).mean().backward()
            # (what the monitor finds registered at its step: not the optimizer's tensors)
            registered_plain.append(all(p is not sharded[n] for n, p in model.named_parameters()))
            whole.append(
                {
                    kind: {
                        n: (p if kind == "param" else p.grad)
                        .full_tensor()
                        .detach()
                        .double()
                        .numpy()
                        for n, p in sharded.items()
                    }
                    for kind in ("param", "grad")
                }
            )
            opt.step()
            opt.zero_grad()
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
    return {"whole": whole, "registered_plain": registered_plain}


@pytest.mark.slow
@ranks.on_ranks(2, _fsdp_body, CASE_DIR)
def test_fsdp2_unsharded_parameters_left_registered_are_not_measured(ran) -> None:
    run_dir, results = ran
    assert results[0]["registered_plain"] == [True] * STEPS  # the case this test is about
    lines = _lines(run_dir / "tensor_stats.jsonl")
    for step in range(STEPS):
        for kind in ("param", "grad"):
            want = {n: torch.from_numpy(a) for n, a in results[0]["whole"][step][kind].items()}
            # (before: every grad line empty, each name "not measured")
            assert_written_moments(lines[(step, kind)], want, f"step {step} {kind}")


# ------------------------------------------------------------------ compiled before attaching


def _train(
    model: nn.Module, compiled: nn.Module, run_dir: Path, *, steps: int, every: int, start: int = 0
):
    """``steps`` steps of the compiled model from step ``start`` with a TensorStatsMonitor
    attached now; the warnings given, and each step's input (the test's own float64 record)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[int, torch.Tensor] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals(
            [
                TensorStatsMonitor(
                    kinds=("activation",), kernel="eager", activation_every_n_steps=every
                )
            ],
            writer=NullWriter(),
            run_dir=run_dir,
            log_every_n_steps=1,
        ) as vitals:
            vitals.attach(compiled, opt)
            if start:
                vitals.load_state_dict({"step": start, "callbacks": {}})
            for step in range(start, start + steps):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
                seen[step] = x.double()
                vitals.batch(x)
                compiled(x).sum().backward()
                opt.step()
                opt.zero_grad()
    said = [w for w in caught if "no activation/dgrad site hook ran" in str(w.message)]
    return said, seen


def test_model_compiled_and_run_before_attaching_is_warned_once(tmp_path) -> None:
    torch.compiler.reset()
    try:
        # run before the monitor attached: the compiled code has no hooks and never calls them
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
        compiled = torch.compile(model, backend="eager")
        compiled(torch.randn(3, 4))
        said, _ = _train(model, compiled, tmp_path / "early", steps=3, every=1)
        assert len(said) == 1, [str(w.message) for w in said]
        message = str(said[0].message)
        assert "attach the monitor before" in message.lower()
        assert "torch.compiler.reset()" in message
        lines = _lines(tmp_path / "early" / "tensor_stats.jsonl")
        assert [lines[(s, "activation")] for s in range(3)] == [{}, {}, {}]

        # steps 1-3 with activations every 10 steps: nothing collected, nothing to warn about
        said, _ = _train(model, compiled, tmp_path / "off", steps=3, every=10, start=1)
        assert said == []

        # the fix the warning names: reset, and the next forward compiles with the hooks
        torch.compiler.reset()
        said, seen = _train(model, compiled, tmp_path / "reset", steps=2, every=1)
        assert said == []
        lines = _lines(tmp_path / "reset" / "tensor_stats.jsonl")
        for step in range(2):
            assert_written_moments(
                {k: v for k, v in lines[(step, "activation")].items() if k == "0/input0"},
                {"0/input0": seen[step]},
                f"step {step}",
            )

        # attached first (the normal case): no warning, every site recorded
        torch.compiler.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
        said, _ = _train(
            model, torch.compile(model, backend="eager"), tmp_path / "first", steps=2, every=1
        )
        assert said == []
        lines = _lines(tmp_path / "first" / "tensor_stats.jsonl")
        assert set(lines[(1, "activation")]) == {"0/input0", "0/output0", "2/input0", "2/output0"}
    finally:
        torch.compiler.reset()


# ------------------------------------------------------------------ state


def test_state_holds_nothing_unread_and_old_checkpoints_load(tmp_path) -> None:
    """The monitor's state was ``{"version", "logged_steps"}``, which nothing read: gone. A
    checkpoint that holds it still loads, and the resumed run rewrites its steps."""

    def run(steps: range, ckpt: dict | None) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Vitals(
            [TensorStatsMonitor(kinds=("param",), kernel="eager")],
            writer=NullWriter(),
            run_dir=tmp_path,
            log_every_n_steps=1,
        ) as vitals:
            vitals.attach(model, opt)
            if ckpt is not None:
                vitals.load_state_dict(ckpt)
            for _ in steps:
                vitals.batch(torch.ones(2, 4))
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            return vitals.state_dict()

    state = run(range(3), None)
    own = [v for k, v in state["callbacks"].items() if k.startswith("TensorStatsMonitor")]
    assert own == [{}]
    old = {"version": 1, "logged_steps": {"param": 1}}
    ckpt = {"step": 2, "callbacks": {k: old for k in state["callbacks"] if k.startswith("Tensor")}}
    run(range(2), ckpt)
    steps = [json.loads(line)["step"] for line in (tmp_path / "tensor_stats.jsonl").open()]
    assert steps == [0, 1, 2, 3]
