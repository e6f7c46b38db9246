"""LoadBalanceMonitor audit: pipeline stages with stage-local layer numbers are reported in
global layer order (stage, then layer), and an extractor whose ``num_experts`` raises any
exception at run start lets every rank leave the run-start check (no rank left waiting in the
gather). Both on 2 gloo CPU processes, with a timeout so a hang fails instead of hanging."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.shared_ranks import CASE_DIR, SharedRanks
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor

# one set of gloo processes per world size runs every case of this file
# (tests/helpers/shared_ranks.py)
shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()

HIDDEN = 4
EXPERTS = 4


class Gate(nn.Module):
    """A router stand-in whose extractor reports the fixed ``loads`` of each forward."""

    def __init__(self, loads: list[float]) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, EXPERTS)
        self.loads = loads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _fixed_loads(module: nn.Module, inputs: Any, output: Any) -> torch.Tensor:
    return torch.tensor(module.loads, dtype=torch.float64)


class StageModel(nn.Module):
    """A pipeline stage: ``layers.<j>.gate`` numbered from 0 on every stage (Megatron's
    stage-local module names)."""

    def __init__(self, loads: list[list[float]]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"gate": Gate(row)}) for row in loads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(block["gate"](x).pow(2).mean() for block in self.layers)


# (stage, stage-local layer) -> loads of one forward. Layer (0, 0) is balanced; the other
# three have the same loads, so their top (3.0) and bottom (0.0) utilizations tie across
# layers: ties go to the first layer in report order.
LOADS = {
    (0, 0): [2.0, 2.0, 2.0, 2.0],
    (0, 1): [6.0, 2.0, 0.0, 0.0],
    (1, 0): [6.0, 2.0, 0.0, 0.0],
    (1, 1): [6.0, 2.0, 0.0, 0.0],
}


def _pipeline_body(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from trainvitals.distributed import ProcessGroups

    pp = dist.new_group([0, 1])
    model = StageModel([LOADS[(rank, 0)], LOADS[(rank, 1)]])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=1, extractors=[(Gate, _fixed_loads, 4)])
    vitals = Vitals(
        [monitor], writer=writer, groups=ProcessGroups(pp=pp), log_every_n_steps=1
    ).attach(model, opt)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(rank))
    vitals.batch(x)
    model(x).backward()
    opt.step()
    vitals.close()
    return {"row": writer.rows[0]}


@pytest.mark.slow
@shared.on_ranks(2, _pipeline_body)
def test_stage_local_layer_numbers_are_reported_in_global_layer_order(ran) -> None:
    _, results = ran
    # Global layer order of a pipeline: stage 0's layers, then stage 1's, each in its order.
    order = sorted(LOADS)
    labels = [f"pp{stage}_{layer}" for stage, layer in order]
    util = {key: [v / (sum(row) / EXPERTS) for v in row] for key, row in LOADS.items()}
    flat = [(util[key][e], i, e) for i, key in enumerate(order) for e in range(EXPERTS)]
    top_value = max(v for v, _, _ in flat)
    bottom_value = min(v for v, _, _ in flat)
    _, top_i, top_e = next(t for t in flat if t[0] == top_value)  # first in global order
    _, bottom_i, bottom_e = next(t for t in flat if t[0] == bottom_value)
    expected_experts = {
        f"moe_expert_utilization/layer_{labels[top_i]}_expert_{top_e}": top_value,
        f"moe_expert_utilization/layer_{labels[bottom_i]}_expert_{bottom_e}": bottom_value,
    }
    for r in results:
        row = r["row"]
        written = [k for k in row if k.startswith("moe/layer_") and k.endswith("/cv")]
        assert written == [f"moe/layer_{label}/cv" for label in labels]
        tokens = [k for k in row if "/tokens_per_expert/" in k]
        assert tokens == [
            f"moe/layer_{label}/tokens_per_expert/{e}" for label in labels for e in range(EXPERTS)
        ]
        for (stage, layer), label in zip(order, labels, strict=True):
            for e in range(EXPERTS):
                assert row[f"moe/layer_{label}/tokens_per_expert/{e}"] == LOADS[(stage, layer)][e]
        experts = {k: v for k, v in row.items() if k.startswith("moe_expert_utilization/")}
        assert experts == pytest.approx(expected_experts, rel=1e-12)


class _Broken(nn.Module):
    """A router whose number of experts cannot be read (a lazily built model, a property that
    touches a missing attribute): the extractor's ``num_experts`` raises ``RuntimeError``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, EXPERTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _num_experts_of(rank: int):
    def num_experts(module: nn.Module) -> int:
        if rank == 1:
            raise RuntimeError("expert count not built yet")
        return EXPERTS

    return num_experts


def _run_start_body(rank: int, world_size: int, where: str, tmp: str) -> dict[str, Any]:
    import time

    import torch.distributed as dist

    from trainvitals.distributed import ProcessGroups

    group = dist.new_group([0, 1])
    groups = ProcessGroups(dp=group) if where == "dp" else ProcessGroups(pp=group)
    model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"gate": _Broken()})])})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extractor = (_Broken, _fixed_loads, _num_experts_of(rank))
    monitor = LoadBalanceMonitor(extractors=[extractor])
    vitals = Vitals([monitor], writer=Recorder(), groups=groups, log_every_n_steps=1)
    error = None
    try:
        vitals.attach(model, opt)
        vitals.batch(torch.zeros(2, HIDDEN))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    # A failing rank stays alive (as a trainer handling the error does) until every rank has
    # left run_start: a rank stuck in the run-start gather then shows as a hang (the test's
    # timeout), not as the gloo error of a peer that exited.
    Path(tmp, f"done_{rank}").touch()
    deadline = time.monotonic() + 300
    while not all(Path(tmp, f"done_{r}").exists() for r in range(world_size)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return {"error": error, "hooks_left": hooks}


@pytest.mark.slow
@shared.on_ranks(2, _run_start_body, "dp", CASE_DIR, param="dp")
@shared.on_ranks(2, _run_start_body, "pp", CASE_DIR, param="pp")
@pytest.mark.parametrize("where", ["dp", "pp"])
def test_num_experts_raising_any_exception_fails_every_rank_at_run_start(where: str, ran) -> None:
    # Before the fix, rank 1 raised its RuntimeError at once and rank 0 waited in the
    # run-start gather for as long as rank 1 lived: a TimeoutError here (a hang of the
    # shared ranks, reported by their timeout as this case's failure).
    _, results = ran
    for r in results:
        assert r["error"] is not None
        assert "expert count not built yet" in r["error"]
        assert r["hooks_left"] == 0
    if where == "dp":
        # a ValueError on every rank: run_start lets it through (other exceptions would
        # disable the callback on that rank alone outside strict mode)
        assert results[1]["error"] == (
            "ValueError: LoadBalanceMonitor: RuntimeError: expert count not built yet"
        )
        assert results[0]["error"].startswith("ValueError: LoadBalanceMonitor: rank 1 of ")
    else:
        for r in results:
            assert r["error"].startswith("ValueError: LoadBalanceMonitor: pipeline stage 1: ")
