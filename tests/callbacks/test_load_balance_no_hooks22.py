"""LoadBalanceMonitor when the router hooks never run although the model trains: a model
compiled and run before the monitor attached (Dynamo's code never calls hooks added later,
``torch._dynamo.config.skip_nnmodule_hook_guards``), a forward that calls ``router.forward``
directly, and routers found on another model object than the one trained.

Before, every logging step wrote ``moe/dead_experts_persistent = 0`` (and nothing else), with no
word: a number that reads as "measured, no dead expert". Now such a step writes nothing and
warns once with the causes and fixes; once the hooks run, the counts are the routers' own
(float64 from their routing maps, recorded here by hooks of the test); a step whose
micro-batches skip the MoE layers after routed steps, and a step without training
micro-batches, are not warned about. With 2 gloo ranks, a rank whose hooks are silent sends
"not measured" through the collective, so the writing rank does not report the other rank's
loads as the step's."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from tests.callbacks.test_load_balance_monitor import (  # noqa: F401 (an autouse fixture)
    _fresh_moe_tracker,
    check_row,
)
from tests.helpers.moe_models import EXPERTS, VOCAB, RoutingMaps, tiny_moe_lm
from tests.helpers.shared_ranks import SharedRanks
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.load_balance_monitor import LoadBalanceMonitor
from trainvitals.moe.capture import RouterCapture
from trainvitals.moe.tiny_model import MoEMLP

shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()

LABELS = ["0", "1", "2"]


class DirectMLP(MoEMLP):
    """``MoEMLP`` whose forward calls ``router.forward(x)``: no module hook of the router runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, _ = self.router.forward(x)
        tokens = x.reshape(-1, x.shape[-1])
        h = torch.nn.functional.gelu(
            torch.einsum("th,ehf->etf", tokens, self.w1) + self.b1.unsqueeze(1)
        )
        y = torch.einsum("etf,efh->eth", h, self.w2)
        return torch.einsum("te,eth->th", probs.to(y.dtype), y).view_as(x)


def _set_mlp_class(model: nn.Module, cls: type) -> None:
    for module in model.modules():
        if isinstance(module, MoEMLP):
            module.__class__ = cls


def _steps(vitals: Vitals, model: nn.Module, opt: Any, gen: torch.Generator, n: int) -> None:
    """``n`` optimizer steps of 2 micro-batches each (the driver counts the forwards)."""
    for _ in range(n):
        for _ in range(2):
            x = torch.randint(0, VOCAB, (2, 6), generator=gen)
            model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def _ours(caught: list[warnings.WarningMessage]) -> tuple[list[str], list[str]]:
    """(the no-hook warnings, the dead-expert warnings) among ``caught``."""
    texts = [str(w.message) for w in caught]
    silent = [t for t in texts if "no router hook ran" in t]
    dead = [t for t in texts if "received no token" in t]
    return silent, dead


def test_capture_fired_flag() -> None:
    model = tiny_moe_lm(0)
    capture = RouterCapture(model)
    x = torch.randint(0, VOCAB, (2, 6))
    assert capture.fired is False
    capture.enabled = False  # a step that is not logged: the flag is not even set
    model(x)
    assert capture.fired is False
    capture.enabled = True
    with torch.no_grad():
        model.eval()
        model(x)  # an evaluation: its hooks running says nothing of the training forwards'
    assert capture.fired is False  # (it said True: a silent compiled training went unwarned)
    model.train()
    model(x)
    assert capture.fired is True
    capture.reset()
    assert capture.fired is False
    model.train()
    _set_mlp_class(model, DirectMLP)
    model(x)
    assert capture.fired is False
    assert capture.read_host()[0] == [[0.0] * EXPERTS] * 3
    capture.remove()


def test_compiled_before_attach_writes_nothing_and_warns_once() -> None:
    """Case (a): torch.compile (a counting backend that runs the graph eagerly), run before the
    monitor attaches; then ``torch.compiler.reset()`` recompiles with the hooks."""
    from torch._dynamo.testing import CompileCounter

    model = tiny_moe_lm(0)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):  # (the MoE tracker's first records change its guards once)
        x = torch.randint(0, VOCAB, (2, 6), generator=gen)
        compiled(x, labels=x).loss.backward()
    model.zero_grad()
    frames = counter.frame_count
    maps = RoutingMaps(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # (weights fixed: any order is fine)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=2, dead_expert_patience=1)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(compiled, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(vitals, compiled, opt, gen, 3)
        assert counter.frame_count == frames  # the code compiled without the hooks ran
        assert not maps.loads.any()  # (no hook ran: neither the test's nor the monitor's)
        # before: {"moe/dead_experts_persistent": 0.0} at steps 0, 1, 2
        assert writer.rows == {}
        silent, dead = _ours(caught)
        assert len(silent) == 1 and not dead
        assert "torch.compiler.reset()" in silent[0]
        assert "skip_nnmodule_hook_guards" in silent[0]
        assert "router.forward" in silent[0]
        torch.compiler.reset()  # the fix: the next forward recompiles with the hooks
        for step in (3, 4):
            _steps(vitals, compiled, opt, gen, 1)
            loads, aux = maps.take()
            assert loads.sum() == 3 * 2 * 2 * 6 * 2  # layers x micro-batches x tokens x top-k
            check_row(writer.rows[step], loads, LABELS, aux, top_k=2)
        vitals.close()
        assert len(_ours(caught)[0]) == 1  # once
    assert sorted(writer.rows) == [3, 4]


def test_router_forward_called_directly_then_through_call() -> None:
    """Case (b): the MLP calls ``router.forward(x)``, after a first step without training
    micro-batches (only a validation), which is not warned about. Then the routers are called
    through ``__call__`` and counted; then a step whose micro-batches skip the MoE layers is
    not warned about either."""
    model = tiny_moe_lm(1)
    _set_mlp_class(model, DirectMLP)
    maps = RoutingMaps(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=2, dead_expert_patience=1)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    gen = torch.Generator().manual_seed(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # step 0: a validation only, then the optimizer steps without a training forward
        with vitals.validating():
            model(torch.randint(0, VOCAB, (2, 6), generator=gen))
        opt.step()
        assert writer.rows == {0: {"moe/dead_experts_persistent": 0.0}}  # (as before)
        assert _ours(caught) == ([], [])

        _steps(vitals, model, opt, gen, 2)  # steps 1, 2: the routers' hooks never run
        assert sorted(writer.rows) == [0]  # before: {"moe/dead_experts_persistent": 0.0}
        silent, dead = _ours(caught)
        assert len(silent) == 1 and not dead
        assert "logging step 1 (2 training micro-batch(es))" in silent[0]
        assert not maps.loads.any()

        _set_mlp_class(model, MoEMLP)  # step 3: routers called through __call__: counted
        _steps(vitals, model, opt, gen, 1)
        loads, aux = maps.take()
        assert (loads > 0).all()
        check_row(writer.rows[3], loads, LABELS, aux, top_k=2)
        assert writer.rows[3]["moe/dead_experts_persistent"] == 0.0

        # step 4: the micro-batches skip every MoE layer (their MLPs return zeros)
        skipped = [m for m in model.modules() if isinstance(m, MoEMLP)]
        for mlp in skipped:
            mlp.forward = torch.zeros_like  # (an instance attribute: the router never runs)
        _steps(vitals, model, opt, gen, 1)
        for mlp in skipped:
            del mlp.forward
        assert writer.rows[4] == {"moe/dead_experts_persistent": 0.0}  # nothing routed

        _steps(vitals, model, opt, gen, 1)  # step 5: counted again
        loads, aux = maps.take()
        check_row(writer.rows[5], loads, LABELS, aux, top_k=2)
        vitals.close()
        silent, dead = _ours(caught)
        assert len(silent) == 1 and not dead  # still once; no dead expert anywhere
    assert sorted(writer.rows) == [0, 3, 4, 5]


def test_model_copy_trained_writes_nothing() -> None:
    """Case (c): the monitor is given ``model``, a deep copy of it trains."""
    model = tiny_moe_lm(0)
    trained = copy.deepcopy(model)
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=2, dead_expert_patience=1)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randint(0, VOCAB, (2, 6), generator=gen)
            vitals.batch(x)  # (the attached model never runs: the loop counts its batches)
            trained(x, labels=x).loss.backward()
            opt.step()
        vitals.close()
    assert writer.rows == {}
    silent, dead = _ours(caught)
    assert len(silent) == 1 and not dead


# ---------------------------------------------------------------------- two ranks


def _two_ranks_body(rank: int, world_size: int, silent_rank: int) -> dict[str, Any]:
    """``silent_rank``'s routers are called through ``router.forward`` (its hooks are silent);
    the other rank's through ``__call__``."""
    model = tiny_moe_lm(0)
    if rank == silent_rank:
        _set_mlp_class(model, DirectMLP)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = LoadBalanceMonitor(mode="detailed", top_k=2, dead_expert_patience=1)
    vitals = Vitals([monitor], writer=writer, log_every_n_steps=1).attach(model, opt)
    gen = torch.Generator().manual_seed(10 + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(vitals, model, opt, gen, 2)
        vitals.close()
    silent, dead = _ours(caught)
    return {"rows": writer.rows, "silent": len(silent), "dead": len(dead)}


@pytest.mark.slow
@shared.on_ranks(2, _two_ranks_body, 0, param="0")
@shared.on_ranks(2, _two_ranks_body, 1, param="1")
@pytest.mark.parametrize("silent_rank", ["0", "1"])
def test_silent_rank_is_not_measured_on_the_writing_rank(silent_rank: str, ran) -> None:
    _, results = ran
    loud = 1 - int(silent_rank)
    # before: rank 0 wrote its own loads alone as the step's (cv, tokens_per_expert, ...),
    # then (a review) still moe/dead_experts_persistent 0.0, a count of a step not measured
    for r in results:
        assert r["rows"] == {}
    assert results[loud]["silent"] == 0 and results[1 - loud]["silent"] == 1
    assert results[0]["dead"] == 0 and results[1]["dead"] == 0
