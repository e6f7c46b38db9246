"""NormMonitor ``group_by``: one norm per group of parameters (per transformer layer).

Every group norm is compared with a float64 sum of squares computed here, by hand, from the
group's parameters and gradients (the whole, unsharded tensors: ``full_tensor()`` under FSDP2,
the full model rebuilt in one process under expert and pipeline parallelism).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import RecordingWriter
from tests.helpers.shared_ranks import SharedRanks
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.norm_monitor import NormMonitor
from trainvitals.distributed import collective_counter

REL = 1e-6
LAYER = r"layers\.(\d+)\."


def _sq(t: torch.Tensor) -> float:
    return float(t.detach().double().pow(2).sum())


def _layer_of(name: str) -> str | None:
    """The layer number in ``name`` (``layers.<i>.``), read by hand rather than by the regex."""
    parts = name.split(".")
    return parts[1] if parts[0] == "layers" and len(parts) > 2 else None


# --------------------------------------------------------------------------- one process


class _Stack(nn.Module):
    """An embedding tied to the head, 11 layers (so that "10" sorts after "2"), layer 3's
    weight tied to layer 1's, and layer 10 unused by the forward pass (no gradient)."""

    def __init__(self, n: int = 11, d: int = 3, vocab: int = 7) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.layers[3].weight = self.layers[1].weight
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers[:10]:
            x = torch.tanh(layer(x))
        return self.head(x)


def _stack_reference(model: nn.Module) -> tuple[dict[str, float], dict[str, float]]:
    """Per layer: float64 sums of squares of its trainable parameters and of their gradients,
    each tensor once (the tied weight in layer 1, its first name)."""
    params: dict[str, float] = {}
    grads: dict[str, float] = {}
    for name, p in model.named_parameters():  # (deduplicated: first names only)
        label = _layer_of(name)
        if label is None or not p.requires_grad:
            continue
        params[label] = params.get(label, 0.0) + _sq(p)
        if p.grad is not None:
            grads[label] = grads.get(label, 0.0) + _sq(p.grad)
    return params, grads


def _run_stack(steps: int, interval: int, **kwargs):
    torch.manual_seed(0)
    model = _Stack()
    model.layers[5].requires_grad_(False)  # a frozen group: no key at all
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3)
    writer = RecordingWriter()
    refs = {}
    counts = []
    monitor = NormMonitor(**kwargs)
    with Vitals([monitor], writer=writer, log_every_n_steps=interval) as vitals:
        vitals.attach(model, opt)
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            ids = torch.randint(0, 7, (4, 5), generator=g)
            vitals.batch(ids)
            model(ids).pow(2).mean().backward()
            refs[step] = _stack_reference(model)
            before = sum(collective_counter.values())
            opt.step()
            counts.append(sum(collective_counter.values()) - before)
            opt.zero_grad()
    return writer, refs, counts


def test_driver_writes_one_exact_norm_per_layer_in_natural_order():
    writer, refs, counts = _run_stack(3, 1, group_by=LAYER, per_param_kinds=("grad", "param"))
    assert counts == [0, 0, 0]  # one process: no collective
    for step, row in writer.steps.items():
        params, grads = refs[step]
        assert "5" not in params  # (the frozen layer)
        group_keys = [k for k in row if "/group/" in k]
        # natural order ("10" after "9"), grad then param per group; frozen layer 5: nothing;
        # layer 10 has no gradient: its param key only
        expected = []
        for label in [str(i) for i in range(11) if i != 5]:
            if label in grads:
                expected.append(f"l2_norm/grad/group/{label}")
            expected.append(f"l2_norm/param/group/{label}")
        assert group_keys == expected
        for label, sq in params.items():
            assert row[f"l2_norm/param/group/{label}"] == pytest.approx(math.sqrt(sq), rel=REL)
        for label, sq in grads.items():
            assert row[f"l2_norm/grad/group/{label}"] == pytest.approx(math.sqrt(sq), rel=REL)
        # the tied weight counts once, in layer 1: layer 3 is its bias alone
        assert set(params) == {str(i) for i in range(11)} - {"5"}


def test_default_kinds_write_grad_group_keys_only_and_non_logging_steps_do_nothing(
    monkeypatch,
):
    calls = []
    from trainvitals.callbacks import norm_monitor

    real = norm_monitor.sums_by_group

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(norm_monitor, "sums_by_group", counting)
    writer, refs, _ = _run_stack(7, 3, group_by=LAYER)
    assert sorted(writer.steps) == [0, 3, 6]
    assert len(calls) == 3  # one part per logging step; nothing on the other steps
    for step, row in writer.steps.items():
        _, grads = refs[step]
        assert not [k for k in row if k.startswith("l2_norm/param/group/")]
        for label, sq in grads.items():
            assert row[f"l2_norm/grad/group/{label}"] == pytest.approx(math.sqrt(sq), rel=REL)


def test_a_group_frozen_after_run_start_drops_out_and_comes_back():
    torch.manual_seed(0)
    model = _Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = RecordingWriter()
    monitor = NormMonitor(group_by=LAYER, per_param_kinds=("grad", "param"))
    with Vitals([monitor], writer=writer, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        for step in range(3):
            model.layers[2].requires_grad_(step != 1)
            ids = torch.arange(5).view(1, 5)
            vitals.batch(ids)
            model(ids).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for step in (0, 2):
        expected = math.sqrt(_sq(model.layers[2].weight) + _sq(model.layers[2].bias))
        assert writer.steps[step]["l2_norm/param/group/2"] == pytest.approx(expected, rel=REL)
    assert "l2_norm/param/group/2" not in writer.steps[1]
    assert "l2_norm/grad/group/2" not in writer.steps[1]


@pytest.mark.parametrize(
    ("group_by", "error"),
    [
        (3, TypeError),
        ([LAYER], TypeError),
        (r"layers\.\d+\.", ValueError),  # no capture group
        (r"(layers)\.(\d+)\.", ValueError),  # two
        (r"layers\.(\d+", ValueError),  # not a regex
    ],
)
def test_bad_group_by(group_by, error):
    with pytest.raises(error, match=r"group_by (must|is not)"):
        NormMonitor(group_by=group_by)


@pytest.mark.parametrize(
    ("expert_pattern", "error", "match"),
    [
        (3, TypeError, r"expert_pattern must be a regex string, got int"),
        (r"experts\.(\d+", ValueError, r"expert_pattern is not a valid regex"),
    ],
)
def test_bad_expert_pattern(expert_pattern, error, match):
    # (the same check as group_by's, without its one-group rule: any regex names experts)
    with pytest.raises(error, match=match):
        NormMonitor(expert_pattern=expert_pattern)
    assert NormMonitor(expert_pattern=r"experts\.\d+\.").expert_pattern.groups == 0


def test_group_by_matching_no_parameter_is_an_error_at_run_start():
    model = _Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = NormMonitor(group_by=r"blocks\.(\d+)\.")
    vitals = Vitals([monitor], writer=RecordingWriter(), log_every_n_steps=1).attach(model, opt)
    with pytest.raises(ValueError, match=r"group_by 'blocks"):
        vitals.batch(torch.arange(5).view(1, 5))


def test_lightning_two_optimizers_count_each_parameter_in_its_own_step(tmp_path):
    from tests.callbacks.test_norm_monitor_manual_optimization import _fit

    # group "0": gen.0.* (optimizer 0) and disc.0.* (optimizer 1), each measured right
    # before its own optimizer's step()
    module, writer = _fit(tmp_path, False, interval=1, group_by=r"^(?:gen|disc)\.(\d+)\.")
    assert sorted(writer.steps) == [0, 2, 4]
    for step, row in writer.steps.items():
        for label in ("0", "2"):
            sq = sum(
                module.per_tensor[step + (kind == "disc"), f"{kind}.{label}.{what}"] ** 2
                for kind in ("gen", "disc")
                for what in ("weight", "bias")
            )
            assert row[f"l2_norm/grad/group/{label}"] == pytest.approx(math.sqrt(sq), rel=REL)


# ------------------------------------------------------------------------------ gloo ranks

ranks = SharedRanks(__name__)
on_ranks = ranks.on_ranks
case_runs, ran = ranks.fixtures()


def _count(delta_from: dict[str, int]) -> dict[str, int]:
    return {k: d for k, v in collective_counter.items() if (d := v - delta_from.get(k, 0))}


def _drive(model, opt, groups, monitor, batches, loss_fn, reference=None) -> dict:
    """The driver loop; per step what was written, the collectives of ``opt.step()`` (where
    the monitor runs), the reference taken before it, and the run's collectives in all."""
    writer = RecordingWriter()
    per_step, refs = [], []
    start = dict(collective_counter)
    with Vitals([monitor], writer=writer, log_every_n_steps=1, groups=groups) as vitals:
        vitals.attach(model, opt)
        for x in batches:
            vitals.batch(x)
            loss_fn(model, x).backward()
            if reference is not None:
                refs.append(reference(model))
            before = dict(collective_counter)
            opt.step()
            per_step.append(_count(before))
            opt.zero_grad()
    return {"steps": writer.steps, "per_step": per_step, "refs": refs, "run": _count(start)}


# ----------------------------------------------------------------- FSDP2 (DTensor shards)


class _Layers(nn.Module):
    def __init__(self, n: int = 3, d: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d)) for _ in range(n)
        )
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def _full_reference(model: nn.Module) -> dict[str, tuple[float, float]]:
    """Per layer (float64, the whole tensors gathered): (param sum of squares, grad's)."""
    out: dict[str, tuple[float, float]] = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        label = _layer_of(name)
        if label is not None:
            a, b = out.get(label, (0.0, 0.0))
            out[label] = (a + _sq(full), b + _sq(grad))
    return out


def _fsdp2_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainvitals.distributed import ProcessGroups

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    groups = ProcessGroups.from_device_mesh(mesh)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(5, 4, generator=g) for _ in range(2)]
    out = {}
    for group_by in (None, LAYER):
        torch.manual_seed(0)
        model = _Layers()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model.layers[0][0].weight).__name__ == "DTensor"
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        monitor = NormMonitor(group_by=group_by, per_param_kinds=("grad", "param"))
        out[str(group_by)] = _drive(
            model,
            opt,
            groups,
            monitor,
            batches,
            lambda m, x: m(x).pow(2).mean(),
            _full_reference,
        )
    return out


@pytest.mark.slow
@on_ranks(2, _fsdp2_body)
def test_fsdp2_group_norms_sum_the_shards_in_the_same_collectives(ran):
    _, results = ran
    for res in results:
        grouped, plain = res[LAYER], res["None"]
        for step, ref in enumerate(grouped["refs"]):
            row = grouped["steps"][step]
            assert sorted(ref) == ["0", "1", "2"]
            for label, (p_sq, g_sq) in ref.items():
                p_key, g_key = f"l2_norm/param/group/{label}", f"l2_norm/grad/group/{label}"
                assert row[p_key] == pytest.approx(math.sqrt(p_sq), rel=REL)
                assert row[g_key] == pytest.approx(math.sqrt(g_sq), rel=REL)
        # no collective added per logging step (group rows ride the shard sums' all-reduce)
        assert grouped["per_step"] == plain["per_step"]
        assert grouped["run"] == plain["run"]  # (no pipeline, no experts: no label gather)
    assert results[0][LAYER]["steps"] == results[1][LAYER]["steps"]


# ---------------------------------------------------------------- expert parallel (plain)

E = 4  # experts per layer, in all
D = 3


class _MoELayers(nn.Module):
    """Two layers, each a dense replica and the experts ``first .. first + n - 1``
    (``layers.<l>.experts.<e>``), the same seeded weights on every rank."""

    def __init__(self, first: int, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.dense = nn.Linear(D, D)
            every = [nn.Linear(D, D) for _ in range(E)]
            layer.experts = nn.ModuleDict({str(e): every[e] for e in range(first, first + n)})
            self.layers.append(layer)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(())
        for i, layer in enumerate(self.layers):
            out = out + layer.dense(x * (i + 1)).pow(2).mean()
            for e, expert in layer.experts.items():
                out = out + expert(x * (int(e) + 1 + i)).pow(2).mean()
        return out


def _ep_x() -> torch.Tensor:
    return torch.randn(5, D, generator=torch.Generator().manual_seed(7))


def _ep_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from trainvitals.distributed import ProcessGroups

    groups = ProcessGroups(dp=dist.group.WORLD, ep=dist.group.WORLD)
    n = E // world_size
    out = {}
    for group_by in (None, LAYER, r"experts\.(\d+)\."):
        model = _MoELayers(rank * n, n)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        monitor = NormMonitor(group_by=group_by, per_param_kinds=("grad", "param"))
        out[str(group_by)] = _drive(model, opt, groups, monitor, [_ep_x()], lambda m, x: m.loss(x))
    return out


@pytest.mark.slow
@on_ranks(2, _ep_body)
def test_plain_experts_join_their_group_over_ep(ran):
    _, results = ran
    full = _MoELayers(0, E).double()
    full.loss(_ep_x().double()).backward()
    by_layer: dict[str, list[float]] = {}
    by_expert: dict[str, list[float]] = {}
    for name, p in full.named_parameters():
        layer = name.split(".")[1]
        by_layer.setdefault(layer, [0.0, 0.0])
        by_layer[layer][0] += _sq(p)
        by_layer[layer][1] += _sq(p.grad)
        if ".experts." in name:
            expert = name.split(".")[3]
            by_expert.setdefault(expert, [0.0, 0.0])
            by_expert[expert][0] += _sq(p)
            by_expert[expert][1] += _sq(p.grad)
    for res in results:
        for group_by, ref in ((LAYER, by_layer), (r"experts\.(\d+)\.", by_expert)):
            row = res[group_by]["steps"][0]
            # every expert once (other EP ranks' too), the dense replicas once
            assert sorted(k for k in row if "/group/" in k) == sorted(
                f"l2_norm/{kind}/group/{label}" for label in ref for kind in ("grad", "param")
            )
            for label, (p_sq, g_sq) in ref.items():
                assert row[f"l2_norm/param/group/{label}"] == pytest.approx(
                    math.sqrt(p_sq), rel=REL
                )
                assert row[f"l2_norm/grad/group/{label}"] == pytest.approx(math.sqrt(g_sq), rel=REL)
            assert res[group_by]["per_step"] == res["None"]["per_step"]
        # (labels that differ between EP ranks, the experts', are gathered once at run start)
        extra = _minus(res[r"experts\.(\d+)\."]["run"], res["None"]["run"])
        assert extra == {"all_gather_object": 1}


def _minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: v for k in set(a) | set(b) if (v := a.get(k, 0) - b.get(k, 0))}


# ---------------------------------------------------------------------- pipeline stages

STAGES = ((0, 1, 2), tuple(range(3, 11)))
FROZEN, UNUSED = 4, 7  # on stage 1: a frozen layer, a layer without gradient


def _pp_stage(rank: int) -> tuple[nn.Module, torch.Tensor]:
    """Stage ``rank``: its layers under their global numbers (``layers.<i>``), each seeded by
    its number, and its input."""
    ids = STAGES[rank]
    model = nn.Module()
    layers = {}
    for i in ids:
        torch.manual_seed(100 + i)
        layers[str(i)] = nn.Linear(3, 3)
    model.layers = nn.ModuleDict(layers)
    if rank == 1:
        model.layers[str(FROZEN)].requires_grad_(False)
    return model, torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))


def _pp_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for name, layer in model.layers.items():
        if name != str(UNUSED):
            x = torch.tanh(layer(x))
    return x.pow(2).sum()


def _pp_body(rank: int, world_size: int) -> dict:
    from trainvitals.distributed import ProcessGroups, world_group

    groups = ProcessGroups(pp=world_group())
    out = {}
    for group_by in (None, LAYER):
        model, x = _pp_stage(rank)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        monitor = NormMonitor(group_by=group_by, per_param_kinds=("grad", "param"))
        out[str(group_by)] = _drive(model, opt, groups, monitor, [x, x], _pp_loss)
    # a regex that matches nothing on any stage: a ValueError on every stage, none waits
    model, x = _pp_stage(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = NormMonitor(group_by=r"blocks\.(\d+)\.")
    try:
        with Vitals([monitor], writer=RecordingWriter(), log_every_n_steps=1, groups=groups) as v:
            v.attach(model, opt)
            v.batch(x)
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.mark.slow
@on_ranks(2, _pp_body)
def test_pipeline_stages_write_the_union_of_layers_in_one_collective(ran):
    _, results = ran
    params: dict[str, float] = {}
    grads: dict[str, float] = {}
    for rank in range(2):
        model, x = _pp_stage(rank)
        model.double()
        _pp_loss(model, x.double()).backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                label = _layer_of(name)
                params[label] = params.get(label, 0.0) + _sq(p)
                if p.grad is not None:
                    grads[label] = grads.get(label, 0.0) + _sq(p.grad)
    assert str(FROZEN) not in params and str(UNUSED) not in grads
    expected = []
    for i in range(11):  # natural order: 10 after 9 (not after 1)
        label = str(i)
        if label in grads:
            expected.append(f"l2_norm/grad/group/{label}")
        if label in params:
            expected.append(f"l2_norm/param/group/{label}")
    for res in results:
        for step in (0, 1):
            row = res[LAYER]["steps"][step]
            assert [k for k in row if "/group/" in k] == expected
            for label, sq in params.items():
                assert row[f"l2_norm/param/group/{label}"] == pytest.approx(math.sqrt(sq), rel=REL)
            for label, sq in grads.items():
                assert row[f"l2_norm/grad/group/{label}"] == pytest.approx(math.sqrt(sq), rel=REL)
        # the totals' all-reduce over the stages carries the groups: no collective added per
        # step; one label gather at run start
        assert res[LAYER]["per_step"] == res["None"]["per_step"]
        assert res[LAYER]["per_step"][0].get("all_reduce") == 1
        assert _minus(res[LAYER]["run"], res["None"]["run"]) == {"all_gather_object": 1}
        assert re.search(r"group_by 'blocks.*matches no parameter", res["error"])
