"""TopKRouter against float64 formulas written here: Switch, sequence and global (2 gloo ranks)
load-balancing losses, z-loss, gradients, capacity and drop policies, group-limited routing,
expert bias, jitter, sinkhorn, and what it records in the tracker."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.helpers.dist import run_distributed
from trainvitals.moe import (
    MoEMetricsTracker,
    TopKRouter,
    set_moe_metrics_tracker,
    update_expert_biases,
)
from trainvitals.moe._aux_loss import set_aux_loss_backward_scale

H, E, K = 8, 6, 2


@pytest.fixture(autouse=True)
def fresh_tracker():
    tracker = MoEMetricsTracker()
    set_moe_metrics_tracker(tracker)
    set_aux_loss_backward_scale(1.0)
    yield tracker
    from trainvitals.moe import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()


def make_router(seed: int = 0, **kwargs) -> TopKRouter:
    torch.manual_seed(seed)
    router = TopKRouter(
        kwargs.pop("hidden_size", H), kwargs.pop("num_experts", E), kwargs.pop("top_k", K), **kwargs
    )
    with torch.no_grad():
        router.weight.normal_(0, 0.5)  # spread scores so that routing is not uniform
    return router


# ---------------------------------------------------------------------- float64 references


def ref_scores(x: torch.Tensor, w: torch.Tensor, score: str, k: int) -> torch.Tensor:
    logits = x.reshape(-1, x.shape[-1]).double() @ w.detach().double().T
    if score == "softmax":
        return torch.softmax(logits, dim=-1)
    s = torch.sigmoid(logits)
    return s / s.sum(dim=-1, keepdim=True) if k > 1 else s


def ref_switch(p: torch.Tensor, k: int) -> torch.Tensor:
    """E/(k T^2) sum_i (sum_x p_xi) * tokens_i, tokens from each token's top-k of p."""
    t, e = p.shape
    tokens = torch.zeros(e, dtype=torch.float64)
    for row in p:
        for i in torch.topk(row, k).indices.tolist():
            tokens[i] += 1
    return e / (k * t * t) * (p.sum(dim=0) * tokens).sum()


# ---------------------------------------------------------------------- losses


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_switch_loss_matches_float64_formula_and_is_recorded(fresh_tracker, score):
    router = make_router(score_function=score, aux_loss_type="aux_loss", aux_loss_coeff=0.1)
    router.set_layer_number(2, num_layers=3)
    x = torch.randn(4, 5, H)
    router(x)
    expected = ref_switch(ref_scores(x, router.weight, score, K), K)
    assert float(router.last_aux_loss) == pytest.approx(float(expected), rel=1e-5)
    values = fresh_tracker.metrics["load_balancing_loss"].values
    assert values.tolist()[0] == 0 and values.tolist()[2] == 0
    assert float(values[1]) == pytest.approx(float(expected), rel=1e-5)  # divided by the coeff


def test_switch_loss_is_one_at_perfect_balance():
    router = make_router(aux_loss_type="aux_loss", aux_loss_coeff=1.0)
    with torch.no_grad():
        router.weight.zero_()  # uniform scores: any assignment is balanced in expectation
    router(torch.randn(10, H))
    assert float(router.last_aux_loss) == pytest.approx(1.0, rel=1e-6)


def test_seq_aux_loss_is_the_mean_of_per_sequence_switch_losses(fresh_tracker):
    router = make_router(aux_loss_type="seq_aux_loss", aux_loss_coeff=0.01, layer_number=1)
    router.num_layers = 1
    x = torch.randn(3, 7, H)  # batch-first
    router(x)
    per_seq = [ref_switch(ref_scores(x[b], router.weight, "softmax", K), K) for b in range(3)]
    expected = float(sum(per_seq)) / 3
    assert float(router.last_aux_loss) == pytest.approx(expected, rel=1e-5)
    assert float(fresh_tracker.metrics["seq_load_balancing_loss"].values[0]) == pytest.approx(
        expected, rel=1e-5
    )
    with pytest.raises(ValueError, match="batch-first"):
        router(torch.randn(7, H))


def test_z_loss_matches_formula():
    router = make_router(z_loss_coeff=1e-3)
    x = torch.randn(9, H)
    router(x)
    logits = x.double() @ router.weight.double().T
    expected = torch.logsumexp(logits, dim=-1).square().mean()
    assert float(router.last_z_loss) == pytest.approx(float(expected), rel=1e-5)
    assert router.last_aux_loss is None


def test_losses_reach_the_router_weights_without_changing_forward_values():
    coeff_aux, coeff_z = 0.3, 0.2
    x = torch.randn(12, H, dtype=torch.float32)
    g = torch.randn(12, E)  # an arbitrary upstream gradient for the combine weights
    with_loss = make_router(
        aux_loss_type="aux_loss", aux_loss_coeff=coeff_aux, z_loss_coeff=coeff_z
    )
    plain = make_router()
    probs, routing_map = with_loss(x)
    probs_plain, map_plain = plain(x)
    assert torch.equal(probs, probs_plain) and torch.equal(routing_map, map_plain)
    (probs * g).sum().backward()

    # float64 reference: the same objective written out, differentiated by autograd.
    w = with_loss.weight.detach().double().requires_grad_(True)
    logits = x.double() @ w.T
    top = torch.topk(logits, K, dim=-1).indices
    weights = torch.softmax(logits.gather(1, top), dim=-1)
    probs64 = torch.zeros(12, E, dtype=torch.float64).scatter(1, top, weights)
    p = torch.softmax(logits, dim=-1)
    tokens = torch.zeros(E, dtype=torch.float64).index_add_(
        0, top.reshape(-1), torch.ones(12 * K, dtype=torch.float64)
    )
    aux = E / (K * 12 * 12) * (p.sum(dim=0) * tokens).sum()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    objective = (probs64 * g.double()).sum() + coeff_aux * aux + coeff_z * z
    objective.backward()
    assert torch.allclose(with_loss.weight.grad.double(), w.grad, rtol=1e-4, atol=1e-6)
    # and without the losses the gradient is different (the losses did reach the weights)
    (probs_plain * g).sum().backward()
    assert not torch.allclose(plain.weight.grad, with_loss.weight.grad, rtol=1e-3)


def test_backward_scale_multiplies_the_injected_gradient():
    x = torch.randn(6, H)
    grads = []
    for scale in (1.0, 0.25):
        set_aux_loss_backward_scale(scale)
        router = make_router(aux_loss_type="aux_loss", aux_loss_coeff=1.0)
        probs, _ = router(x)
        (probs * 0).sum().backward()  # only the aux loss contributes
        grads.append(router.weight.grad.clone())
    assert torch.allclose(grads[1], grads[0] * 0.25, rtol=1e-5, atol=1e-8)
    assert grads[0].abs().sum() > 0


def test_no_loss_in_eval_or_without_grad(fresh_tracker):
    router = make_router(
        aux_loss_type="aux_loss", aux_loss_coeff=0.1, z_loss_coeff=0.1, layer_number=1
    )
    router.num_layers = 1
    router.eval()
    router(torch.randn(4, H))
    router.train()
    with torch.no_grad():
        router(torch.randn(4, H))
    assert router.last_aux_loss is None and router.last_z_loss is None
    assert not fresh_tracker.metrics


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(aux_loss_type="aux_loss", aux_loss_coeff=0.1, z_loss_coeff=0.1),
        dict(aux_loss_type="aux_loss", aux_loss_coeff=0.1, capacity_factor=1.0),
        dict(aux_loss_type="seq_aux_loss", aux_loss_coeff=0.1, z_loss_coeff=0.1),
        dict(sinkhorn=True, z_loss_coeff=0.1),
    ],
)
def test_forward_without_tokens_routes_nothing_and_records_nothing(fresh_tracker, kwargs):
    # An empty micro-batch must not end the run (1/T of the losses) nor put a NaN into the
    # step's sums: the next forward's recorded values are its own, as the float64 formula.
    router = make_router(layer_number=1, **kwargs)
    router.num_layers = 1
    x = torch.randn(2, 4, H)
    router(x)
    last, dropped = router.last_aux_loss, router.last_dropped_fraction
    probs, routing_map = router(torch.randn(0, 4, H))
    assert probs.shape == (0, E) and routing_map.shape == (0, E)
    assert router.last_z_loss is None
    if last is not None:
        assert router.last_aux_loss is None  # not the previous forward's value
    probs.sum().backward()
    assert torch.isfinite(router.weight.grad).all()
    recorded = {name: float(entry.values[0]) for name, entry in fresh_tracker.metrics.items()}
    logits = x.reshape(-1, H).double() @ router.weight.detach().double().T
    if "z_loss" in recorded:
        z = torch.logsumexp(logits, dim=-1).square().mean()
        assert recorded["z_loss"] == pytest.approx(float(z), rel=1e-5)
    p = ref_scores(x, router.weight, "softmax", K)
    if "load_balancing_loss" in recorded:
        assert recorded["load_balancing_loss"] == pytest.approx(float(ref_switch(p, K)), rel=1e-5)
    if "seq_load_balancing_loss" in recorded:
        per_seq = sum(ref_switch(p[4 * b : 4 * b + 4], K) for b in range(2)) / 2
        assert recorded["seq_load_balancing_loss"] == pytest.approx(float(per_seq), rel=1e-5)
    if "dropped_token_fraction" in recorded:
        assert recorded["dropped_token_fraction"] == float(dropped)
    assert all(math.isfinite(v) for v in recorded.values())


@pytest.mark.parametrize(
    ("mode", "twice", "no_grad_between"),
    [
        ("non-reentrant", False, False),
        ("reentrant", False, False),
        ("nested reentrant", False, False),
        ("non-reentrant", True, False),  # the router twice per forward, different token counts
        ("non-reentrant", False, True),  # a no_grad forward between a forward and its backward
        ("reentrant", False, True),
    ],
)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(aux_loss_type="aux_loss", aux_loss_coeff=0.1, z_loss_coeff=0.1, capacity_factor=1.0),
        dict(aux_loss_type="global_aux_loss", aux_loss_coeff=0.1),
        dict(aux_loss_type="seq_aux_loss", aux_loss_coeff=0.1, expert_bias=True),
    ],
)
def test_activation_checkpointing_records_and_counts_each_forward_once(
    mode, twice, no_grad_between, kwargs
):
    # A non-reentrant checkpoint re-runs the forward in the backward pass (Megatron-LM then
    # records its losses twice); a reentrant one runs it first with autograd off (a nested one
    # also runs the inner first run with autograd off inside the outer re-run). Either way the
    # tracker, the token counts and the gradients must be those of plain forwards.
    from torch.utils.checkpoint import checkpoint

    def region(router):
        def run(t):
            probs = router(t)[0]
            if twice:  # a second call on fewer tokens (its own global_aux_loss total)
                probs = probs.sum() + router(t[:1, :3])[0].sum() * 0.5
            return probs

        return run

    def forward(router, x, checkpointed):
        run = region(router)
        if not checkpointed:
            return run(x)
        if mode == "nested reentrant":
            return checkpoint(
                lambda t: checkpoint(run, t, use_reentrant=True), x, use_reentrant=True
            )
        return checkpoint(run, x, use_reentrant=mode == "reentrant")

    results = []
    for checkpointed in (False, True):
        tracker = MoEMetricsTracker()
        set_moe_metrics_tracker(tracker)
        router = make_router(layer_number=1, **kwargs)
        router.num_layers = 1
        torch.manual_seed(1)
        for _ in range(2):  # two micro-batches
            x = torch.randn(2, 5, H, requires_grad=True)
            out = forward(router, x, checkpointed)
            if no_grad_between:  # e.g. a generation step in training mode
                with torch.no_grad():
                    router(torch.randn(2, 5, H))
            weights = torch.arange(E, dtype=out.dtype) if out.ndim else 1.0
            (out * weights).sum().backward()
        counts = [
            getattr(router, name).clone()
            for name in ("local_tokens_per_expert", "global_tokens_per_expert")
            if getattr(router, name) is not None
        ]
        recorded = {name: entry.values.clone() for name, entry in tracker.metrics.items()}
        results.append((recorded, router.weight.grad.clone(), counts))
    (plain, plain_grad, plain_counts), (ckpt, ckpt_grad, ckpt_counts) = results
    assert set(ckpt) == set(plain) and plain
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-6, atol=0, msg=name)
    torch.testing.assert_close(ckpt_grad, plain_grad, rtol=1e-5, atol=1e-8)
    for got, want in zip(ckpt_counts, plain_counts, strict=True):
        assert want.sum() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.usefixtures("fresh_dynamo")
def test_router_compiles_to_one_graph_in_training():
    # the activation-checkpoint bookkeeping must not break torch.compile's graph
    router = make_router(aux_loss_type="aux_loss", aux_loss_coeff=0.1, z_loss_coeff=0.1)
    compiled = torch.compile(router, fullgraph=True, backend="eager")  # raises on a break
    x = torch.randn(6, H)
    probs, routing_map = compiled(x)
    want_probs, want_map = router(x)
    torch.testing.assert_close(probs, want_probs)
    assert torch.equal(routing_map, want_map)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_routers_of_every_layer_share_one_graph(fresh_tracker):
    """torch.compile guards on an int attribute's value: with the layer number read as an int,
    the routers' forward compiled once per layer and, past Dynamo's recompile limit (8),
    ran the remaining layers uncompiled (a model whose layer loop breaks the graph, e.g. with
    LoadBalanceMonitor's hooks, compiles each router's forward on its own)."""
    num_layers = 12
    routers = []
    for i in range(num_layers):
        router = make_router(seed=i, aux_loss_type="aux_loss", aux_loss_coeff=0.1, z_loss_coeff=0.1)
        router.set_layer_number(i + 1, num_layers)
        routers.append(router)
    for name in ("load_balancing_loss", "z_loss"):  # (a first forward creating them recompiles)
        fresh_tracker.ensure_initialized(name, num_layers)
    graphs = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    xs = [torch.randn(2, 5, H) for _ in range(num_layers)]
    for router, x in zip(routers, xs, strict=True):
        torch.compile(router, backend=counting_backend)(x)
    compiled = {n: (e.values.clone(), e.counts.clone()) for n, e in fresh_tracker.metrics.items()}
    fresh_tracker.clear()
    for router, x in zip(routers, xs, strict=True):
        router(x)
    assert len(graphs) == 1
    assert set(compiled) == {"load_balancing_loss", "z_loss"}
    for name, entry in fresh_tracker.metrics.items():
        assert entry.counts.tolist() == [1.0] * num_layers
        assert (entry.values > 0).all(), name
        torch.testing.assert_close(compiled[name][0], entry.values, rtol=1e-6, atol=0)
        assert compiled[name][1].tolist() == entry.counts.tolist()


def test_layer_number_and_num_layers_are_checked_together():
    router = make_router(layer_number=5)
    with pytest.raises(ValueError, match=r"layer_number must be in \[1, num_layers=4\], got 5"):
        router.num_layers = 4
    router.num_layers = 8
    with pytest.raises(ValueError, match="num_layers=8"):
        router.layer_number = 9
    router.set_layer_number(10, 12)  # a pair checked as a pair, not setter by setter
    assert (router.layer_number, router.num_layers) == (10, 12)
    router.set_layer_number(3)
    assert (router.layer_number, router.num_layers) == (3, 12)
    with pytest.raises(ValueError, match="got 13"):
        router.set_layer_number(13)
    assert (router.layer_number, router.num_layers) == (3, 12)


# ---------------------------------------------------------------------- global aux loss (2 ranks)


def _global_body(rank: int, world_size: int) -> dict:
    import torch

    from trainvitals.distributed import ProcessGroups, world_group
    from trainvitals.moe import MoEMetricsTracker, TopKRouter, set_moe_metrics_tracker

    tracker = MoEMetricsTracker()
    set_moe_metrics_tracker(tracker)
    torch.manual_seed(0)  # same weights on both ranks (DDP replicas)
    router = TopKRouter(
        H, E, K, aux_loss_type="global_aux_loss", aux_loss_coeff=0.1, layer_number=1
    )
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    router.num_layers = 1
    router.dp_group = world_group()
    from trainvitals.moe.capture import RouterCapture

    capture = RouterCapture(router)  # LoadBalanceMonitor's source of moe/aux_loss_*
    gen = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(5, H, generator=gen) for _ in range(2)]  # two micro-batches
    losses = []
    for x in xs:
        router(x)
        losses.append(float(router.last_aux_loss))
    aux_sum, aux_count = capture.aux_losses()
    rows: dict[str, float] = {}

    class W:
        def add_scalars(self, mapping, step):
            rows.update(mapping)

    tracker.report(0.5, 0, W(), groups=ProcessGroups(dp=world_group()))
    before = router.global_aux_micro_batches
    router.reset_global_tokens()
    return {
        "xs": [x.tolist() for x in xs],
        "w": router.weight.tolist(),
        "losses": losses,
        "rows": rows,
        "micro": before,
        "capture_aux": (float(aux_sum[0]), float(aux_count[0])),
        "after_reset": (router.global_aux_micro_batches, router.global_tokens_per_expert.tolist()),
    }


def _two_rank_body(rank: int, world_size: int) -> dict:
    return {
        "global": _global_body(rank, world_size),
        "bias": _bias_body(rank, world_size),
        "ddp": _ddp_bias_body(rank, world_size),
    }


@pytest.fixture(scope="module")
def two_ranks():
    """Both 2-rank scenarios in one pair of processes (spawning is the slow part)."""
    return run_distributed(_two_rank_body, 2, timeout=150)


def test_global_aux_loss_uses_tokens_summed_over_dp_and_micro_batches(two_ranks):
    res = [r["global"] for r in two_ranks]
    w = torch.tensor(res[0]["w"], dtype=torch.float64)
    xs = [[torch.tensor(r["xs"][m], dtype=torch.float64) for m in range(2)] for r in res]
    p = [[ref_scores(xs[r][m], w, "softmax", K) for m in range(2)] for r in range(2)]

    def counts(scores):
        c = torch.zeros(E, dtype=torch.float64)
        for row in scores:
            c[torch.topk(row, K).indices] += 1
        return c

    global_counts = [counts(torch.cat([p[0][m], p[1][m]])) for m in range(2)]
    total = 10  # tokens of both ranks in one micro-batch
    global_per_micro = [0.0, 0.0]  # the sum of the ranks' shares
    for m in range(2):
        mean_counts = sum(global_counts[: m + 1]) / (m + 1)  # accumulated over micro-batches
        for r in range(2):
            expected = E / (K * total * total) * (p[r][m].sum(dim=0) * mean_counts).sum()
            assert res[r]["losses"][m] == pytest.approx(float(expected), rel=1e-5)
            global_per_micro[m] += float(expected)
        # the tracker sums the ranks' shares over dp: micro-batch 0 is the Switch loss of the
        # whole global batch
    whole = ref_switch(torch.cat([p[0][0], p[1][0]]), K)
    assert res[0]["losses"][0] + res[1]["losses"][0] == pytest.approx(float(whole), rel=1e-5)
    expected_logged = 0.5 * sum(res[r]["losses"][m] for r in range(2) for m in range(2))
    for r in range(2):
        assert res[r]["rows"]["moe/global_load_balancing_loss"] == pytest.approx(
            expected_logged, rel=1e-5
        )
        assert res[r]["micro"] == 2
        assert res[r]["after_reset"] == (0, [0.0] * E)
    # Router capture: averaged over the ranks and micro-batches (as LoadBalanceMonitor does), a
    # rank's aux value is the global loss, not the mean of the ranks' shares (1/2 of it).
    aux_sum = sum(res[r]["capture_aux"][0] for r in range(2))
    aux_count = sum(res[r]["capture_aux"][1] for r in range(2))
    assert aux_count == 4
    assert aux_sum / aux_count == pytest.approx(sum(global_per_micro) / 2, rel=1e-5)


# ---------------------------------------------------------------------- expert bias (2 ranks)


def _bias_body(rank: int, world_size: int) -> dict:
    import torch

    from trainvitals.distributed import collective_counter, world_group
    from trainvitals.moe import TopKRouter, update_expert_biases

    torch.manual_seed(0)
    routers = [TopKRouter(H, E, K, expert_bias=True, bias_update_rate=0.01) for _ in range(3)]
    gen = torch.Generator().manual_seed(7 + rank)
    loads = []
    for r in routers:
        with torch.no_grad():
            r.weight.normal_(0, 0.5)
        for _ in range(2):
            _, routing_map = r(torch.randn(6, H, generator=gen))
            loads.append(routing_map.sum(dim=0).tolist())
    before = collective_counter["all_reduce"]
    update_expert_biases(routers, world_group())
    return {
        "loads": loads,
        "bias": [r.expert_bias.tolist() for r in routers],
        "collectives": collective_counter["all_reduce"] - before,
        "local_after": [r.local_tokens_per_expert.tolist() for r in routers],
    }


def test_expert_bias_update_from_loads_summed_over_dp_in_one_collective(two_ranks):
    res = [r["bias"] for r in two_ranks]
    for i in range(3):
        load = torch.zeros(E, dtype=torch.float64)
        for r in range(2):
            load += torch.tensor(res[r]["loads"][2 * i]) + torch.tensor(res[r]["loads"][2 * i + 1])
        expected = 0.01 * torch.sign(load.mean() - load)
        for r in range(2):
            assert torch.allclose(
                torch.tensor(res[r]["bias"][i], dtype=torch.float64), expected, atol=1e-7
            )
            assert res[r]["local_after"][i] == [0.0] * E
    assert [r["collectives"] for r in res] == [1, 1]


def _ddp_bias_body(rank: int, world_size: int) -> dict:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from trainvitals.distributed import world_group
    from trainvitals.moe import TopKRouter, update_expert_biases

    class TwoRouters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.routers = nn.ModuleList(
                [TopKRouter(H, E, K, expert_bias=True, bias_update_rate=0.01) for _ in range(2)]
            )

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
            outs = [r(x) for r in self.routers]
            return sum(p.sum() for p, _ in outs), [m for _, m in outs]

    torch.manual_seed(0)  # the same weights on both ranks
    model = TwoRouters()
    with torch.no_grad():
        for r in model.routers:
            r.weight.normal_(0, 0.5)
    # broadcast_buffers=True (DDP's default) copies rank 0's buffers to every rank before
    # each forward
    ddp = DistributedDataParallel(model, broadcast_buffers=True)
    gen = torch.Generator().manual_seed(11 + rank)  # different tokens on each rank
    loads = [torch.zeros(E, dtype=torch.float64) for _ in range(2)]
    for _ in range(3):
        loss, maps = ddp(torch.randn(5, H, generator=gen))
        loss.backward()
        for i, routing_map in enumerate(maps):
            loads[i] += routing_map.sum(dim=0)
    counted = [r.local_tokens_per_expert.clone() for r in model.routers]
    update_expert_biases(model, world_group())
    return {
        "loads": loads,
        "counted": counted,
        "bias": [r.expert_bias.clone() for r in model.routers],
    }


def test_expert_bias_under_ddp_counts_each_ranks_own_tokens(two_ranks):
    """DDP's buffer broadcast must not replace a rank's loads with rank 0's (it did while the
    counts were buffers: rank 1 then held rank 0's first two micro-batches and its own last)."""
    res = [r["ddp"] for r in two_ranks]
    for r in range(2):
        for i in range(2):
            assert res[r]["counted"][i].tolist() == res[r]["loads"][i].tolist(), (r, i)
    for i in range(2):
        load = torch.tensor(res[0]["loads"][i]) + torch.tensor(res[1]["loads"][i])
        expected = 0.01 * torch.sign(load.mean() - load)
        for r in range(2):
            torch.testing.assert_close(
                torch.tensor(res[r]["bias"][i], dtype=torch.float64), expected, atol=1e-7, rtol=0
            )


def test_expert_bias_shifts_selection_not_weights():
    router = make_router(score_function="sigmoid", expert_bias=True)
    x = torch.randn(20, H)
    with torch.no_grad():
        router.expert_bias[3] = 10.0  # every token now selects expert 3
    probs, routing_map = router(x)
    assert routing_map[:, 3].all()
    s = torch.sigmoid(x.double() @ router.weight.double().T)
    top = routing_map.double()
    expected = s * top / (s * top).sum(dim=-1, keepdim=True)  # unbiased scores, normalised
    assert torch.allclose(probs.double(), expected, atol=1e-6)
    # and the loads accumulate on the device for the next update
    assert router.local_tokens_per_expert[3] == 20
    router.eval()
    router(x)
    assert router.local_tokens_per_expert[3] == 20  # no accumulation in evaluation


def test_state_loaded_mid_step_drops_the_abandoned_token_counts():
    """A loop that rolls back to a checkpoint in the middle of a step (model.load_state_dict)
    replays the step: the expert-bias update and the global_aux_loss that follow must count
    the replayed micro-batches only, as a router that never ran the abandoned ones (the
    counts are not in the checkpoint)."""
    router = make_router(expert_bias=True, aux_loss_type="global_aux_loss", aux_loss_coeff=0.1)
    with torch.no_grad():
        router.expert_bias.copy_(torch.linspace(-0.2, 0.3, E))
    checkpoint = copy.deepcopy(router.state_dict())
    reference = copy.deepcopy(router)  # never runs the abandoned micro-batches
    abandoned, replayed = torch.randn(12, H), torch.randn(7, H)
    router(abandoned)
    router.load_state_dict(checkpoint)
    router(replayed)
    reference(replayed)
    # the loss of the replayed forward: the global batch is that micro-batch alone
    assert router.last_aux_loss == pytest.approx(float(reference.last_aux_loss), rel=1e-6)
    assert router.global_aux_micro_batches == 1
    router.update_expert_bias()
    reference.update_expert_bias()
    assert torch.equal(router.expert_bias, reference.expert_bias)
    # independent: the bias moved by the sign of (mean load - load) of the replayed tokens,
    # selected by the top-k of logits + bias (softmax after the top-k)
    loads = torch.zeros(E)
    logits = replayed.double() @ router.weight.double().T
    top = torch.topk(logits + checkpoint["expert_bias"].double(), K, dim=-1).indices
    loads.index_add_(0, top.reshape(-1), torch.ones(top.numel()))
    expected = checkpoint["expert_bias"] + 1e-3 * torch.sign(loads.mean() - loads)
    assert torch.allclose(router.expert_bias, expected)


# ---------------------------------------------------------------------- routing variants


def test_pre_softmax_and_post_softmax_weights():
    x = torch.randn(5, H)
    for pre in (False, True):
        router = make_router(pre_softmax=pre)
        probs, routing_map = router(x)
        logits = x.double() @ router.weight.double().T
        top = torch.topk(logits, K, dim=-1).indices
        if pre:
            w = torch.softmax(logits, dim=-1).gather(1, top)
        else:
            w = torch.softmax(logits.gather(1, top), dim=-1)
        expected = torch.zeros(5, E, dtype=torch.float64).scatter(1, top, w)
        assert torch.allclose(probs.double(), expected, atol=1e-6)
        assert torch.equal(routing_map, expected > 0)


def test_group_limited_routing_keeps_the_best_groups():
    num_groups, group_topk, k = 3, 2, 4  # 6 experts in 3 groups of 2; 2 best groups; k=4
    router = make_router(top_k=k, num_groups=num_groups, group_topk=group_topk, pre_softmax=True)
    x = torch.randn(30, H)
    _, routing_map = router(x)
    scores = torch.softmax(x.double() @ router.weight.double().T, dim=-1)
    for t in range(30):
        s = scores[t].view(num_groups, E // num_groups)
        group_score = [sorted(g.tolist(), reverse=True)[: k // group_topk] for g in s]
        best = sorted(range(num_groups), key=lambda i: -sum(group_score[i]))[:group_topk]
        eligible = [e for e in range(E) if e // (E // num_groups) in best]
        chosen = sorted(eligible, key=lambda e: -scores[t, e])[:k]
        assert sorted(routing_map[t].nonzero().view(-1).tolist()) == sorted(chosen)


def _expected_keep(probs: torch.Tensor, selected: torch.Tensor, cap: int, policy: str):
    keep = torch.zeros_like(selected)
    for e in range(selected.shape[1]):
        tokens = selected[:, e].nonzero().view(-1).tolist()
        if policy == "probs":
            tokens = sorted(tokens, key=lambda t: -probs[t, e])
        keep[tokens[:cap], e] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_and_drop_policies(fresh_tracker, policy):
    t = 24
    router = make_router(capacity_factor=0.5, drop_policy=policy, layer_number=1)
    router.num_layers = 1
    uncapped = make_router()
    x = torch.randn(t, H)
    probs, routing_map = router(x)
    full, selected = uncapped(x)
    cap = math.ceil(t * K / E * 0.5)
    keep = _expected_keep(full.double(), selected, cap, policy)
    assert torch.equal(routing_map, keep)
    assert torch.equal(probs, full * keep)
    assert int(routing_map.sum(dim=0).max()) <= cap
    dropped = 1 - keep.sum().item() / (t * K)
    assert dropped > 0
    assert float(router.last_dropped_fraction) == pytest.approx(dropped, rel=1e-6)
    assert float(fresh_tracker.metrics["dropped_token_fraction"].values[0]) == pytest.approx(
        dropped, rel=1e-6
    )


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_pad_to_capacity_fills_every_expert(policy):
    t = 24
    router = make_router(capacity_factor=0.5, drop_policy=policy, pad_to_capacity=True)
    uncapped = make_router()
    x = torch.randn(t, H)
    probs, routing_map = router(x)
    full, selected = uncapped(x)
    cap = math.ceil(t * K / E * 0.5)
    assert routing_map.sum(dim=0).tolist() == [cap] * E
    keep = _expected_keep(full.double(), selected, cap, policy)
    assert torch.equal(probs, full * keep)  # padding tokens have weight 0
    assert torch.equal(routing_map & selected, keep)


def test_input_jitter_statistics():
    eps = 0.1
    router = TopKRouter(1, 1, 1, score_function="sigmoid", input_jitter_eps=eps)
    with torch.no_grad():
        router.weight.fill_(1.0)
    x = torch.ones(40000, 1)
    torch.manual_seed(3)
    probs, _ = router(x)
    u = torch.logit(probs[:, 0].double())  # sigmoid(u * x * w) with x = w = 1
    assert float(u.min()) >= 1 - eps - 1e-5 and float(u.max()) <= 1 + eps + 1e-5
    assert float(u.mean()) == pytest.approx(1.0, abs=5 * eps / math.sqrt(3 * 40000))  # 5 sigma
    assert float(u.var()) == pytest.approx(eps**2 / 3, rel=0.05)  # variance of U(1-eps, 1+eps)
    router.eval()
    probs, _ = router(x)
    assert torch.allclose(
        torch.logit(probs[:, 0].double()), torch.ones(40000, dtype=torch.float64), atol=1e-5
    )


def test_sinkhorn_balances_a_skewed_router():
    router = make_router(top_k=1, sinkhorn=True)
    with torch.no_grad():
        router.weight[0] += 2.0  # expert 0 scores high for most tokens
    x = torch.randn(60, H).abs()
    _, greedy = router.eval()(x)
    _, balanced = router.train()(x)
    # Megatron's sinkhorn (exp domain, to a tolerance) in float64 gives the same selection.
    cost = torch.exp(x.double() @ router.weight.double().T)
    d0, d1 = torch.ones(60, dtype=torch.float64), torch.ones(E, dtype=torch.float64)
    for _ in range(1000):
        d0 = (1 / 60) / (cost @ d1 + 1e-8)
        d1_new = (1 / E) / (d0 @ cost + 1e-8)
        done = (d1_new - d1).abs().mean() < 1e-10
        d1 = d1_new
        if done:
            break
    expected = torch.argmax(d1 * cost * d0.unsqueeze(1), dim=1)
    assert torch.equal(balanced.float().argmax(dim=1), expected)
    assert greedy.sum(dim=0).max() > balanced.sum(dim=0).max()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 7}, "top_k"),
        ({"score_function": "relu"}, "score_function"),
        ({"pre_softmax": True, "score_function": "sigmoid"}, "pre_softmax"),
        ({"num_groups": 3}, "together"),
        ({"num_groups": 4, "group_topk": 2}, "divisible"),
        ({"num_groups": 3, "group_topk": 4}, "group_topk"),
        ({"capacity_factor": 0}, "capacity_factor"),
        ({"drop_policy": "random"}, "drop_policy"),
        ({"pad_to_capacity": True}, "capacity_factor"),
        ({"aux_loss_type": "switch"}, "aux_loss_type"),
        ({"aux_loss_coeff": -1}, "aux_loss_coeff"),
        ({"input_jitter_eps": 1.5}, "input_jitter_eps"),
        ({"sinkhorn": True, "aux_loss_type": "aux_loss", "aux_loss_coeff": 0.1}, "sinkhorn"),
        ({"layer_number": 0}, "layer_number"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TopKRouter(H, E, kwargs.pop("top_k", K), **kwargs)


def test_forward_rejects_wrong_hidden_size():
    with pytest.raises(ValueError, match="hidden_size"):
        make_router()(torch.randn(3, H + 1))


def test_update_expert_biases_accepts_a_model():
    model = torch.nn.Sequential(make_router(expert_bias=True), make_router(1, expert_bias=True))
    for r in model:
        r(torch.randn(10, H))
    # float64 by hand: each router's bias moves by its rate towards its own mean load
    wants = []
    for r in model:
        load = r.local_tokens_per_expert.double()
        before = r.expert_bias.double().clone()
        wants.append(before + r.bias_update_rate * torch.sign(load.mean() - load))
        assert not torch.equal(wants[-1], before)  # an update that moves something
    update_expert_biases(model)
    for r, want in zip(model, wants, strict=True):
        torch.testing.assert_close(r.expert_bias.double(), want, rtol=1e-6, atol=0)
        assert r.local_tokens_per_expert.sum() == 0


def test_low_precision_model_keeps_bias_fp32_and_counts_exact():
    router = make_router(expert_bias=True, aux_loss_type="global_aux_loss", aux_loss_coeff=0.1)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([1e-3, 2e-3, -3e-3, 4e-3, 5e-3, 1.0 + 1e-3]))
        router.local_tokens_per_expert.fill_(2**20 + 1)
    bias = router.expert_bias.clone()
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == torch.float32 and torch.equal(router.expert_bias, bias)
    assert router.local_tokens_per_expert.dtype == torch.float64
    assert router.local_tokens_per_expert[0] == 2**20 + 1
    assert router.global_tokens_per_expert.dtype == torch.float64
    probs, _ = router(torch.randn(4, H, dtype=torch.bfloat16))
    assert probs.dtype == torch.float32


def _switch_and_z_loss64(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 Switch aux loss and z-loss of a softmax top-K router, written out."""
    logits = x.double() @ w.T
    tokens = torch.zeros(E, dtype=torch.float64).index_add_(
        0, torch.topk(logits, K, dim=-1).indices.reshape(-1), torch.ones(x.shape[0] * K).double()
    )
    aux = E / (K * x.shape[0] ** 2) * (torch.softmax(logits, dim=-1).sum(dim=0) * tokens).sum()
    return aux, torch.logsumexp(logits, dim=-1).square().mean()


def test_a_router_made_on_meta_counts_and_records_after_to_empty(fresh_tracker):
    """The token counts and the layer slot are no buffers (see the DDP test): they follow the
    weight to the device, zeros and the right layer, not a meta tensor's missing values."""
    with torch.device("meta"):
        router = TopKRouter(
            H,
            E,
            K,
            aux_loss_type="global_aux_loss",
            aux_loss_coeff=0.1,
            expert_bias=True,
            layer_number=3,
        )
    router.num_layers = 4
    router.to_empty(device="cpu")
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.expert_bias.zero_()
    assert router.local_tokens_per_expert.device.type == "cpu"
    assert not router.local_tokens_per_expert.any() and not router.global_tokens_per_expert.any()
    _, routing_map = router(torch.randn(7, H))
    assert router.local_tokens_per_expert.tolist() == routing_map.sum(dim=0).double().tolist()
    entry = fresh_tracker.metrics["global_load_balancing_loss"]
    assert entry.counts.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert entry.values[2] == pytest.approx(float(router.last_aux_loss), rel=1e-6)


def test_grad_scaler_multiplies_the_injected_gradient_and_follows_its_updates():
    # fp16 AMP: the main loss is multiplied by the GradScaler's scale before backward and every
    # gradient is divided by it in unscale_(); the injected aux gradient must go through the
    # same scale, or it ends up 65536x too small after unscaling.
    coeff_aux, coeff_z, accum = 0.5, 0.1, 2
    router = make_router(aux_loss_type="aux_loss", aux_loss_coeff=coeff_aux, z_loss_coeff=coeff_z)
    optimizer = torch.optim.SGD(router.parameters(), lr=0.0)  # the weights stay put
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    set_aux_loss_backward_scale(1.0 / accum, grad_scaler=scaler)
    batches = [torch.randn(10, H), torch.randn(7, H)]
    w = router.weight.detach().double().requires_grad_(True)
    objective = sum(
        (coeff_aux * aux + coeff_z * z) / accum
        for aux, z in (_switch_and_z_loss64(b, w) for b in batches)
    )
    (expected,) = torch.autograd.grad(objective, w)
    for step in range(2):  # growth_interval=1: the second step runs at scale 2**17
        for b in batches:
            probs, _ = router(b)
            scaler.scale((probs * 0).sum()).backward()  # only the injected losses contribute
        scaler.unscale_(optimizer)
        assert scaler.get_scale() == 2.0 ** (16 + step)
        assert torch.allclose(router.weight.grad.double(), expected, rtol=1e-5, atol=1e-9)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def test_backward_scale_rejects_an_object_without_scale():
    with pytest.raises(TypeError, match="grad_scaler"):
        set_aux_loss_backward_scale(1.0, grad_scaler=object())
