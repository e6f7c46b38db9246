"""LoadBalanceMonitor when router capture gives up on a router (its counting raised, or its
output was not understood: warned once, "no longer counted").

Before, the layer's counts simply stopped: on one rank its loads were zeros (the layer left out
of that step's statistics, but ``moe/dead_experts_persistent = 0`` written even when every
router had been given up, a count of nothing measured), and with 2 gloo ranks the sum over the
ranks was the other rank's tokens alone, written as the layer's ``tokens_per_expert``, CV and
utilization. Now such a layer is "not measured" (NaN through the collective, as a rank whose
hooks never ran): left out on every rank; the other layers are exact (float64 routing maps of
the test's own hooks); a step with no layer measured writes nothing."""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from tests.callbacks.test_load_balance_monitor import (  # noqa: F401 (an autouse fixture)
    _fresh_moe_tracker,
    check_row,
)
from tests.helpers.moe_models import VOCAB, RoutingMaps, tiny_moe_lm
from tests.helpers.shared_ranks import SharedRanks
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor
from trainvitals.moe.capture import RouterCapture

shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()

LABELS = ["0", "1", "2"]


class Breaker:
    """Makes the counting of the routers in ``layers`` raise while ``on`` (patched into
    :meth:`RouterCapture._count_topk_router`)."""

    def __init__(self, layers: set[int]) -> None:
        self.layers = layers
        self.on = False
        self._original = RouterCapture._count_topk_router
        breaker = self

        def count(capture: RouterCapture, i: int, module: Any, output: Any) -> None:
            if breaker.on and i in breaker.layers:
                raise RuntimeError("injected counting failure")
            breaker._original(capture, i, module, output)

        RouterCapture._count_topk_router = count  # type: ignore[method-assign]

    def undo(self) -> None:
        RouterCapture._count_topk_router = self._original  # type: ignore[method-assign]


def _train(
    layers: set[int], break_at: tuple[int, int], steps: int, seed: int
) -> tuple[dict[int, dict[str, float]], list[tuple[np.ndarray, np.ndarray]], list[str]]:
    """``steps`` logged steps of 2 micro-batches, counting of ``layers`` failing from
    ``break_at`` (step, micro-batch): the written rows, the test's own loads and aux per step,
    the warnings."""
    model = tiny_moe_lm(0)
    maps = RoutingMaps(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=2, dead_expert_patience=1)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    gen = torch.Generator().manual_seed(seed)
    breaker = Breaker(layers)
    taken = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                for micro in range(2):
                    breaker.on = (step, micro) >= break_at
                    x = torch.randint(0, VOCAB, (2, 6), generator=gen)
                    model(x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
                taken.append(maps.take())
            vitals.close()
    finally:
        breaker.undo()
    return writer.rows, taken, [str(w.message) for w in caught]


def _check_without(row: dict[str, float], loads: np.ndarray, aux: np.ndarray, gone: int) -> None:
    keep = [i for i in range(len(LABELS)) if i != gone]
    check_row(row, loads[keep], [LABELS[i] for i in keep], aux[keep], top_k=2)
    assert not [k for k in row if f"layer_{gone}/" in k or f"layer_{gone}_expert" in k]


def test_a_router_given_up_is_left_out(monkeypatch) -> None:
    """Given up at the second micro-batch of step 1: before, step 1 wrote that layer's first
    micro-batch alone as the step's loads (its tokens_per_expert, CV, utilization)."""
    monkeypatch.setenv("TRAINVITALS_STRICT", "0")  # (the tests' strict mode raises instead)
    rows, taken, messages = _train({1}, break_at=(1, 1), steps=3, seed=3)
    check_row(rows[0], taken[0][0], LABELS, taken[0][1], top_k=2)
    for step in (1, 2):
        _check_without(rows[step], *taken[step], gone=1)
    assert sum("no longer counted" in m for m in messages) == 1


def test_every_router_given_up_writes_nothing(monkeypatch) -> None:
    monkeypatch.setenv("TRAINVITALS_STRICT", "0")
    rows, taken, messages = _train({0, 1, 2}, break_at=(1, 0), steps=3, seed=4)
    check_row(rows[0], taken[0][0], LABELS, taken[0][1], top_k=2)
    # before: {"moe/dead_experts_persistent": 0.0} at steps 1 and 2
    assert sorted(rows) == [0]
    assert sum("no longer counted" in m for m in messages) == 3


# ---------------------------------------------------------------------- two ranks


def _two_ranks_body(rank: int, world_size: int) -> dict[str, Any]:
    os.environ["TRAINVITALS_STRICT"] = "0"  # (put back by the shared ranks)
    rows, taken, messages = _train({1} if rank == 1 else set(), (0, 0), 2, seed=20 + rank)
    return {
        "rows": rows,
        "loads": [t[0].tolist() for t in taken],
        "aux": [t[1].tolist() for t in taken],
        "given_up": sum("no longer counted" in m for m in messages),
    }


@pytest.mark.slow
@shared.on_ranks(2, _two_ranks_body)
def test_a_router_given_up_on_one_rank_is_left_out_on_every_rank(ran) -> None:
    _, results = ran
    assert [r["given_up"] for r in results] == [0, 1]
    for step in (0, 1):
        loads = sum(np.array(r["loads"][step]) for r in results)
        aux = np.mean([r["aux"][step] for r in results], axis=0)  # equal forward counts
        for r in results:
            # before: layer 1's loads were rank 0's alone, written as the step's
            _check_without(r["rows"][step], loads, aux, gone=1)


def test_a_router_given_up_leaves_the_dead_expert_count(monkeypatch) -> None:
    """Two gates that never route to expert 3 of 4 (``FixedGate``), patience 1: one dead
    expert per measured layer. Layer 1's counting fails from step 1: its dead expert is left
    out of ``moe/dead_experts_persistent`` like its other keys (before: its last streak was
    counted for the rest of the run, 2 instead of 1)."""
    from tests.callbacks.test_load_balance_monitor import FixedGate, Gated, _gate_counts

    monkeypatch.setenv("TRAINVITALS_STRICT", "0")
    failing = {"on": False}

    def counts(module: Any, inputs: Any, output: Any) -> torch.Tensor:
        if failing["on"] and module is model.layers[1]["gate"]:
            raise RuntimeError("injected counting failure")
        return _gate_counts(module, inputs, output)

    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(
        dead_expert_patience=1, extractors=[(FixedGate, counts)], mode="detailed"
    )
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            failing["on"] = step >= 1
            vitals.batch()
            model(torch.randn(6, 2)).backward()
            opt.step()
        vitals.close()
    # token t -> expert t % 3 in every measured layer: expert 3 dead from the first step
    expected = {0: 2.0, 1: 1.0, 2: 1.0, 3: 1.0}
    assert {s: r["moe/dead_experts_persistent"] for s, r in writer.rows.items()} == expected
    assert not [k for s in (1, 2, 3) for k in writer.rows[s] if "layer_1" in k]
    assert sum("no longer counted" in str(w.message) for w in caught) == 1
