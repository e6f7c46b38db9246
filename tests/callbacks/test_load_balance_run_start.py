"""LoadBalanceMonitor: configuration errors come at run start, on every rank; a logging step
reads its reduced loads back with one device-to-host transfer.

The ranks of ``ctx.groups.dp_cp`` sum their ``[layers, experts]`` tables element by element, so
they must hold the same routers. Ranks that do not (pipeline stages passed as data-parallel
ranks; a model with other experts on one rank; no router on one rank) used to find out at the
first logging step, or never: two stages of the same table size were summed row by row into
wrong layers without a word. The checks below run on 2 gloo CPU processes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed
from tests.helpers.shared_ranks import SharedRanks
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor

# the 2-rank cases of this file run in turn on one set of gloo processes
# (tests/helpers/shared_ranks.py)
shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()

HIDDEN = 8


class Routed(nn.Module):
    """Routers only: ``layers.<i>.router`` for ``i`` in ``layer_numbers``, ``E`` experts each."""

    def __init__(self, layer_numbers: list[int], num_experts: int) -> None:
        from trainvitals.moe import TopKRouter

        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleDict(
            {
                str(i): nn.ModuleDict({"router": TopKRouter(HIDDEN, num_experts, 1)})
                for i in layer_numbers
            }
        )
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for block in self.layers.values():
            probs, _ = block["router"](h)
            h = h + probs.sum()
        return h.pow(2).mean()


# rank -> (layer numbers, experts) of its model
CASES: dict[str, tuple[tuple[list[int], int], tuple[list[int], int]]] = {
    # two pipeline stages given as data-parallel ranks: same table size, other layers
    "stages_in_dp": (([0, 1], 4), ([2, 3], 4)),
    "other_expert_count": (([0, 1], 4), ([0, 1], 8)),
    "no_router_on_rank_1": (([0, 1], 4), ([], 4)),
}


def _body(rank: int, world_size: int, case: str) -> dict[str, Any]:
    from trainvitals.distributed import ProcessGroups
    from trainvitals.moe import TopKRouter, destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    layers, num_experts = CASES[case][rank]
    model = Routed(layers, num_experts)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    vitals = Vitals(
        [LoadBalanceMonitor()], writer=writer, groups=ProcessGroups.world(), log_every_n_steps=1
    )
    vitals.attach(model, opt)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(rank))
    try:
        vitals.batch(x)
    except ValueError as exc:
        hooks = sum(len(r._forward_hooks) for r in routers)
        return {"where": "run_start", "message": str(exc), "hooks_left": hooks}
    try:
        model(x).backward()
        opt.step()  # step 0 logs: step_end reduces the loads over the two ranks
        vitals.close()
    except Exception as exc:
        return {"where": "step", "message": f"{type(exc).__name__}: {exc}"}
    return {"where": None, "rows": writer.rows}


def _each_case(test):
    for case in CASES:
        test = shared.on_ranks(2, _body, case, param=case)(test)
    return test


@pytest.mark.slow
@_each_case
@pytest.mark.parametrize("case", list(CASES))
def test_dp_cp_ranks_with_other_routers_raise_at_run_start(case: str, ran) -> None:
    _, results = ran
    for rank, r in enumerate(results):
        assert r["where"] == "run_start", (rank, r)
        assert r["hooks_left"] == 0  # the capture made at run start took its hooks back
    messages = [r["message"] for r in results]
    if case == "no_router_on_rank_1":
        assert "found no router in Routed" in messages[1]
        assert messages[0].startswith("LoadBalanceMonitor: rank 1 of ctx.groups.dp_cp: ")
        assert messages[0].endswith(messages[1])
        return
    (layers0, e0), (layers1, e1) = CASES[case]
    for message in messages:  # the same error, naming each rank's routers, on both ranks
        assert message == messages[0]
        assert "ranks of ctx.groups.dp_cp" in message
        assert f"rank 0: 2 MoE layers [{', '.join(map(str, layers0))}] of {e0} experts" in message
        assert f"rank 1: 2 MoE layers [{', '.join(map(str, layers1))}] of {e1} experts" in message


def _detailed_on_world(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[Vitals, Recorder]:
    """The loop driver with a detailed LoadBalanceMonitor over the world group, logging every
    step, attached to ``model`` and ``opt``; and its writer."""
    from trainvitals.distributed import ProcessGroups

    writer = Recorder()
    vitals = Vitals(
        [LoadBalanceMonitor(mode="detailed")],
        writer=writer,
        groups=ProcessGroups.world(),
        log_every_n_steps=1,
    )
    vitals.attach(model, opt)
    return vitals, writer


def _same_routers_body(rank: int, world_size: int) -> dict[str, Any]:
    from trainvitals.moe import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    model = Routed([0, 1], 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals, writer = _detailed_on_world(model, opt)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(rank))
    vitals.batch(x)
    model(x).backward()
    opt.step()
    vitals.close()
    return {"rows": writer.rows}


@pytest.mark.slow
@shared.on_ranks(2, _same_routers_body)
def test_dp_cp_ranks_with_the_same_routers_report_every_token(ran) -> None:
    """The run-start agreement lets a consistent run through: 2 ranks x 6 tokens, top-1."""
    _, results = ran
    for r in results:
        row = r["rows"][0]
        for layer in ("0", "1"):
            tokens = [row[f"moe/layer_{layer}/tokens_per_expert/{e}"] for e in range(4)]
            assert sum(tokens) == 12


# ---------------------------------------------------------------------- transfers (CUDA)


def _transfers_body(rank: int, world_size: int) -> dict[str, Any]:
    """Both ranks on cuda:0, reduced over gloo (which reduces host tensors): the device-to-host
    copies and collectives of the logging step's step_end, counted at their Python entry
    points on CUDA tensors (a copy whose source is on the GPU and whose result is not)."""
    from tests.helpers.moe_models import tiny_moe_lm
    from trainvitals.distributed import collective_counter
    from trainvitals.moe import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()
    torch.cuda.set_device(0)
    model = tiny_moe_lm().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals, writer = _detailed_on_world(model, opt)
    counted: list[str] = []
    originals = {n: getattr(torch.Tensor, n) for n in ("cpu", "to", "tolist", "item", "numpy")}

    def wrap(name: str):
        original = originals[name]

        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            if self.is_cuda and (not isinstance(out, torch.Tensor) or not out.is_cuda):
                counted.append(name)
            return out

        return method

    transfers: list[int] = []
    collectives: list[int] = []
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        for _ in range(2):
            x = torch.randint(0, 32, (2, 6), generator=gen).cuda()
            vitals.batch(x)
            model(x, labels=x).loss.backward()
        torch.cuda.synchronize()
        counted.clear()
        before = sum(collective_counter.values())
        for name in originals:
            setattr(torch.Tensor, name, wrap(name))
        try:
            opt.step()  # step_end: every step logs
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        transfers.append(len(counted))
        collectives.append(sum(collective_counter.values()) - before)
        opt.zero_grad()
    vitals.close()
    tokens = [
        sum(v for k, v in row.items() if "/tokens_per_expert/" in k) for row in writer.rows.values()
    ]
    return {"transfers": transfers, "collectives": collectives, "tokens": tokens}


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gloo_with_cuda_counts_one_transfer_per_logging_step() -> None:
    results = run_distributed(_transfers_body, world_size=2, timeout=180)
    for r in results:
        # one all_reduce; one copy of the packed buffer to the host (was 4: each of the three
        # tensors to the host for gloo, back to the GPU, then the concatenation to the host)
        assert r["collectives"] == [1, 1]
        assert r["transfers"] == [1, 1]
        # 3 layers x 2 micro-batches x 12 tokens x top-2 x 2 ranks
        assert r["tokens"] == [3 * 2 * 12 * 2 * 2] * 2
