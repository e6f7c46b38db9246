"""NormMonitor audit 20: expert parallelism with plain-tensor experts.

Each expert-parallel rank holds other experts, named by their global index
(``moe.experts.<e>.weight``), as plain tensors (Megatron-style, not DTensors). The global norms
must cover every expert once, as Megatron-LM's ``calc_params_l2_norm`` sums expert parameters
over their expert groups: summed over ``groups.ep``, never over ``groups.edp`` (whose ranks
hold replicas of the same experts). Compared with a float64 computation of the whole model in
one process.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import RecordingWriter
from tests.helpers.shared_ranks import SharedRanks

pytestmark = pytest.mark.slow

E = 4  # experts in all
D = 3

ranks = SharedRanks(__name__)
on_ranks = ranks.on_ranks
case_runs, ran = ranks.fixtures()


class _MoE(nn.Module):
    """A dense layer (a replica on every rank) and the experts ``first .. first + n - 1``."""

    def __init__(self, first: int, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(D, D)
        every = [nn.Linear(D, D) for _ in range(E)]  # the same seeded experts on every rank
        self.moe = nn.Module()
        self.moe.experts = nn.ModuleDict({str(e): every[e] for e in range(first, first + n)})

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dense(x).pow(2).mean()
        for e, expert in self.moe.experts.items():
            out = out + expert(x * (int(e) + 1)).pow(2).mean()
        return out


def _x() -> torch.Tensor:
    return torch.randn(5, D, generator=torch.Generator().manual_seed(7))


def _ep_body(rank: int, world_size: int, ep_size: int) -> dict:
    import torch.distributed as dist

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor
    from trainvitals.distributed import ProcessGroups

    # ep: consecutive ranks; edp: the ranks holding the same experts (every group is created
    # on every rank, in the same order)
    ep = edp = None
    for start in range(0, world_size, ep_size):
        g = dist.new_group(list(range(start, start + ep_size)))
        ep = g if start <= rank < start + ep_size else ep
    if world_size > ep_size:
        for r in range(ep_size):
            g = dist.new_group(list(range(r, world_size, ep_size)))
            edp = g if rank % ep_size == r else edp
    groups = ProcessGroups(dp=dist.group.WORLD, ep=ep, edp=edp)
    ep_rank, n = rank % ep_size, E // ep_size
    model = _MoE(ep_rank * n, n)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = RecordingWriter()
    monitor = NormMonitor(per_param="*")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([monitor], writer=writer, log_every_n_steps=1, groups=groups) as vitals:
            vitals.attach(model, opt)
            for step in range(2):
                vitals.batch(_x())
                model.loss(_x()).backward()
                if step == 1 and ep_rank == ep_size - 1:
                    # (expert E-1's gradient, replicated over edp, holds an Inf)
                    model.moe.experts[str(E - 1)].weight.grad[0, 0] = math.inf
                opt.step()
                opt.zero_grad()
    nonfinite = [str(w.message) for w in caught if "NaN/Inf" in str(w.message)]
    return {"steps": writer.steps, "state": monitor.state_dict(), "warned": nonfinite}


def _reference() -> tuple[float, float, dict[str, float]]:
    model = _MoE(0, E).double()
    model.loss(_x().double()).backward()
    params = list(model.parameters())
    param = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in params))
    grad = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
    return param, grad, {n: float(p.grad.norm()) for n, p in model.named_parameters()}


def _check(results: list[dict], ep_size: int) -> None:
    param, grad, per_param = _reference()
    for rank, res in enumerate(results):
        first, second = res["steps"][0], res["steps"][1]
        assert first["l2_norm/param/global"] == pytest.approx(param, rel=1e-6)
        assert first["l2_norm/grad/global"] == pytest.approx(grad, rel=1e-6)
        assert first["l2_norm/grad/nonfinite_count"] == 0
        # per-parameter keys: this rank's experts, each its own norm (not summed over ep)
        n = E // ep_size
        mine = [str(e) for e in range((rank % ep_size) * n, (rank % ep_size + 1) * n)]
        for name, value in per_param.items():
            key = f"l2_norm/grad/{name}"
            held = not name.startswith("moe.") or name.split(".")[2] in mine
            assert (key in first) == held, key
            if held:
                assert first[key] == pytest.approx(value, rel=1e-6)
        # one Inf on the EP rank holding expert E-1 (and its edp replicas): counted once
        assert second["l2_norm/grad/nonfinite_count"] == 1
        assert second["l2_norm/grad/global"] == math.inf
        assert second["l2_norm/param/global"] == pytest.approx(param, rel=1e-6)
        # every rank counts that logging step, also those not holding expert E-1
        assert res["state"]["nonfinite_logging_steps"] == 1
        assert res["state"]["first_nonfinite_step"] == 1
    # the reporting rank (which holds experts 0 and 1) warns, naming none of its own
    [warned] = results[0]["warned"]
    assert "1 gradient(s) hold NaN/Inf at step 1" in warned
    assert "1 held by other pipeline stages or expert-parallel ranks" in warned


@on_ranks(4, _ep_body, 2)
def test_plain_experts_are_summed_over_ep_not_over_expert_data_parallel(ran):
    _check(ran[1], ep_size=2)


def _two_optimizers_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor
    from trainvitals.distributed import ProcessGroups

    groups = ProcessGroups(dp=dist.group.WORLD, ep=dist.group.WORLD)
    n = E // world_size
    model = _MoE(rank * n, n)
    dense = torch.optim.SGD(model.dense.parameters(), lr=0.0)
    experts = torch.optim.SGD(model.moe.parameters(), lr=0.0)
    writer = RecordingWriter()
    with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1, groups=groups) as vitals:
        vitals.attach(model, [dense, experts])
        vitals.batch(_x())
        model.loss(_x()).backward()
        dense.step()  # (stepped apart: optimizer_<i> keys)
        experts.step()
    return {"steps": writer.steps}


@on_ranks(2, _two_optimizers_body)
def test_plain_experts_count_in_their_optimizers_norms(ran):
    full = _MoE(0, E).double()
    full.loss(_x().double()).backward()

    def norm(params, grad):
        return math.sqrt(sum(float((p.grad if grad else p.detach()).pow(2).sum()) for p in params))

    for res in ran[1]:
        row = res["steps"][0]
        for i, module in enumerate((full.dense, full.moe)):
            params = list(module.parameters())
            assert row[f"l2_norm/grad/optimizer_{i}"] == pytest.approx(norm(params, True), rel=1e-6)
            assert row[f"l2_norm/param/optimizer_{i}"] == pytest.approx(
                norm(params, False), rel=1e-6
            )
        every = list(full.parameters())
        assert row["l2_norm/grad/global"] == pytest.approx(norm(every, True), rel=1e-6)


class _MegatronNamedMoE(nn.Module):
    """Megatron-LM's SequentialMLP naming: ``moe.experts.local_experts.<local i>`` (the index
    local to the rank), and a ``shared_experts`` layer that is a replica like the dense one."""

    def __init__(self, first: int, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(D, D)
        every = [nn.Linear(D, D) for _ in range(E)]
        self.first = first
        self.moe = nn.Module()
        self.moe.shared_experts = nn.Linear(D, D)
        self.moe.experts = nn.Module()
        self.moe.experts.local_experts = nn.ModuleList(every[first : first + n])

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dense(x).pow(2).mean() + self.moe.shared_experts(x).pow(2).mean()
        for i, expert in enumerate(self.moe.experts.local_experts):
            out = out + expert(x * (self.first + i + 1)).pow(2).mean()
        return out


def _megatron_body(
    rank: int, world_size: int, frozen_rank: int | None, megatron_names: bool = True
) -> dict:
    import torch.distributed as dist

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor
    from trainvitals.distributed import ProcessGroups

    groups = ProcessGroups(dp=dist.group.WORLD, ep=dist.group.WORLD)
    n = E // world_size
    model = (_MegatronNamedMoE if megatron_names else _MoE)(rank * n, n)
    if rank == frozen_rank:  # (a rank with nothing to train still joins the EP all-reduce)
        model.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = RecordingWriter()
    from trainvitals.distributed import collective_counter

    before = dict(collective_counter)
    with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1, groups=groups) as vitals:
        vitals.attach(model, opt)
        vitals.batch(_x())
        loss = model.loss(_x())
        if loss.requires_grad:
            loss.backward()
        opt.step()
    trained = [
        float(p.detach().double().pow(2).sum()) for p in model.parameters() if p.requires_grad
    ]
    issued = {k: v - before.get(k, 0) for k, v in collective_counter.items()}
    return {"steps": writer.steps, "experts_sq": trained, "rank": rank, "issued": issued}


@on_ranks(2, _megatron_body, None)
def test_megatron_named_experts_are_summed_over_ep(ran):
    # (before: the default pattern wanted experts.<i>: these were counted on their rank only)
    full = _MegatronNamedMoE(0, E).double()
    param = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in full.parameters()))
    for res in ran[1]:
        assert res["steps"][0]["l2_norm/param/global"] == pytest.approx(param, rel=1e-6)


@on_ranks(2, _megatron_body, 1, False)
def test_an_ep_rank_with_nothing_to_train_joins_the_sum(ran):
    # rank 1 is frozen: no parameter tracked, it returned before the all-reduce over ep that
    # rank 0 issued (rank 0 waited, then failed). Rank 0's totals: its own parameters (the
    # replicas counted here once) and its experts; rank 1's experts are frozen, not counted.
    by_rank = {res["rank"]: res for res in ran[1]}
    assert set(by_rank) == {0, 1}
    # the same collectives on both ranks (before: rank 1 issued one all_reduce fewer)
    assert by_rank[0]["issued"] == by_rank[1]["issued"]
    expected = math.sqrt(sum(by_rank[0]["experts_sq"]))
    assert by_rank[0]["steps"][0]["l2_norm/param/global"] == pytest.approx(expected, rel=1e-6)
