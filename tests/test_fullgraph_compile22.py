"""Models compiled with ``fullgraph=True`` (torchtitan's per-block compile, a whole model, an
in-place ``model.compile``): every callback attached through the driver runs without raising.

Dynamo refuses the graph break of a hook inside a region compiled with ``fullgraph=True``
(``Unsupported: Skip calling torch.compiler.disable()d function``): the user's forward raised
at the first step. Such modules are now left out (activation/dgrad sites, routers) with one
warning; a compiled region's root is hooked on its ``torch.compile`` wrapper, outside the graph.
What is still measured (param/grad moments, norms, sites and routers outside the compiled
regions) equals an uncompiled float64 reference. Eager backend: no inductor.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.compiled_models import ResidualBlock
from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import (
    LoadBalanceMonitor,
    MemoryMonitor,
    MoEMetricsMonitor,
    NormMonitor,
    RuntimeMonitor,
    TensorStatsMonitor,
    ThroughputMonitor,
)
from trainvitals.moe.tiny_model import TinyMoELM

STEPS, EVERY = 5, 2  # logs at steps 0, 2, 4; not at 1, 3
LOGGED = [s for s in range(STEPS) if s % EVERY == 0]


def _compile(m: nn.Module) -> nn.Module:
    return torch.compile(m, fullgraph=True, backend="eager")


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList([ResidualBlock(), ResidualBlock()])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def _tiny_moe() -> TinyMoELM:
    return TinyMoELM(
        vocab_size=32,
        hidden_size=16,
        num_layers=2,
        num_experts=4,
        top_k=2,
        ffn_hidden_size=32,
        num_heads=2,
        max_seq_len=16,
    )


def _compiled(model: nn.Module, how: str) -> nn.Module:
    """What the loop calls: ``model`` compiled ``how``."""
    if how == "block":  # torchtitan's dense blocks: the OptimizedModule replaces the block
        for i, block in enumerate(model.layers):
            model.layers.register_module(str(i), _compile(block))
    elif how == "block_inplace":
        for block in model.layers:
            block.compile(fullgraph=True, backend="eager")
    elif how == "titan":  # torchtitan's MoE blocks: each child, the MoE's children, not the MoE
        for block in model.layers:
            for name, child in list(block.named_children()):
                if name == "mlp":
                    for inner, grandchild in list(child.named_children()):
                        setattr(child, inner, _compile(grandchild))
                else:
                    setattr(block, name, _compile(child))
    elif how == "titan_router":  # only the router of each torchtitan MoE module
        for block in model.layers.values():
            block["moe"].router = _compile(block["moe"].router)
    elif how == "whole":
        return _compile(model)
    elif how == "inplace":
        model.compile(fullgraph=True, backend="eager")
    return model


def _first_float(values: Any) -> torch.Tensor | None:
    values = values if isinstance(values, tuple | list) else (values,)
    return next((v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def _reference(
    model: nn.Module,
    fresh: Callable[[], nn.Module],
    batch: dict[str, torch.Tensor],
    sites: list[str],
) -> dict[str, Any]:
    """An uncompiled float64 copy of ``model``'s current weights, run on ``batch``: parameters,
    gradients, the activations/dgrads of ``sites`` and the routers' tokens per expert."""
    ref = fresh().double()
    state = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
    ref.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()})
    seen: dict[str, torch.Tensor] = {}
    loads: dict[str, torch.Tensor] = {}
    modules = dict(ref.named_modules())
    for name in sites:

        def hook(m: nn.Module, args: Any, out: Any, name: str = name) -> None:
            if (x := _first_float(args)) is not None:
                seen[f"{name}/input0"] = x
            seen[f"{name}/output0"] = _first_float(out)

        modules[name].register_forward_hook(hook)
    for name, m in ref.named_modules():
        if type(m).__name__ == "TopKRouter":  # (probs, routing_map [T, E])
            m.register_forward_hook(
                lambda m, a, out, name=name: loads.__setitem__(name, out[1].sum(0).double())
            )
        elif type(m).__name__ == "TitanRouter":  # (top scores, top indices [T, k])
            m.register_forward_hook(
                lambda m, a, out, name=name: loads.__setitem__(
                    name, torch.bincount(out[1].reshape(-1), minlength=4).double()
                )
            )
    loss = _loss(ref, {k: v.double() if v.is_floating_point() else v for k, v in batch.items()})
    wrt = {s: t for s, t in seen.items() if t.requires_grad}
    params = dict(ref.named_parameters())
    grads = torch.autograd.grad(loss, [*params.values(), *wrt.values()])
    return {
        "param": {n: p.detach() for n, p in params.items()},
        "grad": dict(zip(params, grads[: len(params)], strict=True)),
        "activation": {s: t.detach() for s, t in seen.items()},
        "dgrad": dict(zip(wrt, grads[len(params) :], strict=True)),
        "loads": loads,
    }


def _loss(run: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "input_ids" in batch:
        return run(batch["input_ids"], labels=batch["labels"]).loss
    return run(batch["x"]).pow(2).mean()


def _moments64(t: torch.Tensor) -> list[float]:
    t = t.reshape(-1).double()
    d = t - t.mean()
    return [float(v) for v in (t.numel(), t.mean(), *(d.pow(p).sum() for p in (2, 3, 4)))] + [
        float(t.min()),
        float(t.max()),
    ]


def _batches(moe: bool) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    if moe:
        ids = [torch.randint(0, 32, (2, 9), generator=gen) for _ in range(STEPS)]
        return [{"input_ids": i[:, :-1], "labels": i[:, 1:]} for i in ids]
    return [{"x": torch.randn(6, 8, generator=gen)} for _ in range(STEPS)]


def _train(
    tmp_path: Path,
    fresh: Callable[[], nn.Module],
    how: str,
    callbacks: list[Any],
    sites: list[str],
    moe: bool,
) -> tuple[RecordingWriter, list[dict[str, Any]], dict[int, dict[str, Any]], list[str]]:
    """``STEPS`` steps of SGD, the driver counting the forwards (no ``batch()`` calls: the
    driver's pre-hook on the model). Returns the writer, the JSONL lines, the float64
    references of the logging steps and the messages of the warnings given."""
    torch.manual_seed(0)
    model = fresh()
    run = _compiled(model, how)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    writer = RecordingWriter()
    refs: dict[int, dict[str, Any]] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals(callbacks, writer=writer, run_dir=tmp_path, log_every_n_steps=EVERY) as v:
            v.attach(run, opt)
            for step, batch in enumerate(_batches(moe)):
                if step in LOGGED:
                    refs[step] = _reference(model, fresh, batch, sites)
                _loss(run, batch).backward()
                opt.step()
                opt.zero_grad()
    path = tmp_path / "tensor_stats.jsonl"
    lines = [json.loads(s) for s in path.read_text().splitlines()] if path.exists() else []
    return writer, lines, refs, [str(w.message) for w in caught]


def _check_records(
    lines: list[dict[str, Any]], refs: dict[int, dict[str, Any]], sites: list[str]
) -> None:
    """Every param/grad, and the activations/dgrads of exactly ``sites``, equal the reference."""
    got = {(r["step"], r["kind"]): r["tensors"] for r in lines}
    assert sorted(got) == sorted(
        (s, k) for s in LOGGED for k in ("param", "grad", "activation", "dgrad")
    )
    for (step, kind), tensors in got.items():
        want = refs[step][kind]
        assert sorted(tensors) == sorted(want), (step, kind)
        if kind in ("activation", "dgrad"):
            assert {n.rsplit("/", 1)[0] for n in tensors} <= set(sites)
        for name, t in want.items():
            row = tensors[name]
            ref = _moments64(t)
            assert row[0] == ref[0] and row[7] == 0, (step, kind, name)
            torch.testing.assert_close(
                torch.tensor(row[1:7], dtype=torch.float64),
                torch.tensor(ref[1:], dtype=torch.float64),
                rtol=1e-4,
                atol=1e-7,
                msg=f"{kind} {name} at step {step}",
            )


def _check_norms(writer: RecordingWriter, refs: dict[int, dict[str, Any]]) -> None:
    for key, kind in (("l2_norm/grad/global", "grad"), ("l2_norm/param/global", "param")):
        want = {
            s: float(torch.stack([t.pow(2).sum() for t in r[kind].values()]).sum().sqrt())
            for s, r in refs.items()
        }
        got = writer.key(key)
        assert sorted(got) == LOGGED, key
        for s in LOGGED:
            assert got[s] == pytest.approx(want[s], rel=1e-5), (key, s)


def _callbacks(*, load_balance: bool) -> list[Any]:
    cbs = [
        MoEMetricsMonitor(),
        TensorStatsMonitor(kernel="eager"),
        NormMonitor(),
        MemoryMonitor(),
        ThroughputMonitor(window_size=2),
        RuntimeMonitor(max_steps=STEPS),
    ]
    return [*cbs, LoadBalanceMonitor(mode="detailed")] if load_balance else cbs


def _fullgraph_warnings(messages: list[str], who: str) -> list[str]:
    return [m for m in messages if m.startswith(who) and "fullgraph=True" in m]


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(
    ("how", "outside"),
    [
        ("block", ["inp", "head"]),
        ("block_inplace", ["inp", "head"]),
        ("whole", []),
        ("inplace", []),
    ],
)
def test_dense_model_compiled_fullgraph(tmp_path: Path, how: str, outside: list[str]) -> None:
    writer, lines, refs, messages = _train(
        tmp_path, Dense, how, _callbacks(load_balance=False), outside, moe=False
    )
    _check_records(lines, refs, outside)
    _check_norms(writer, refs)
    left_out = 6 - len(outside)  # inp, 2 x (fc1, fc2), head
    assert _fullgraph_warnings(messages, "TensorStatsMonitor") == [
        f"TensorStatsMonitor: {left_out} activation/dgrad site module(s) (e.g. "
        f"{'layers.0.fc1' if outside else 'inp'}) are inside a module compiled with "
        "fullgraph=True: a hook there would break the graph and Dynamo refuses; they are not "
        "recorded (param and grad are). Compile without fullgraph, or leave these modules out "
        "of the compiled region, to record them"
    ]
    # every step counted by the driver's pre-hook: 5 batches, a logging step every 2
    assert sorted(writer.key("time/batches")) in (LOGGED, list(range(STEPS)))
    assert writer.key("time/batches")[4] == 5


@pytest.mark.usefixtures("fresh_dynamo")
def test_moe_model_compiled_torchtitan_style(tmp_path: Path) -> None:
    # torchtitan's MoE blocks: attention and norms compiled, and the MoE's router (not the MoE
    # module): the routers are compiled regions' roots, hooked on their wrappers, and counted
    outside = ["embed", "pos", "layers.0.mlp.router", "layers.1.mlp.router", "lm_head"]
    writer, lines, refs, messages = _train(
        tmp_path, _tiny_moe, "titan", _callbacks(load_balance=True), outside, moe=True
    )
    _check_records(lines, refs, outside)
    _check_norms(writer, refs)
    assert len(_fullgraph_warnings(messages, "TensorStatsMonitor")) == 1
    assert (
        "4 activation/dgrad site module(s) (e.g. layers.0.attn.qkv)"
        in messages[messages.index(_fullgraph_warnings(messages, "TensorStatsMonitor")[0])]
    )
    assert not _fullgraph_warnings(messages, "trainvitals router capture")
    for step in LOGGED:
        for layer, router in ((0, "layers.0.mlp.router"), (1, "layers.1.mlp.router")):
            got = [writer.rows[step][f"moe/layer_{layer}/tokens_per_expert/{e}"] for e in range(4)]
            assert got == refs[step]["loads"][router].tolist(), (step, layer)
    assert sorted(writer.key("moe/layer_1/tokens_per_expert/0")) == LOGGED


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("how", ["block", "whole", "inplace"])
def test_moe_model_compiled_fullgraph(tmp_path: Path, how: str) -> None:
    outside = ["embed", "pos", "lm_head"] if how == "block" else []
    writer, lines, refs, messages = _train(
        tmp_path, _tiny_moe, how, _callbacks(load_balance=False), outside, moe=True
    )
    _check_records(lines, refs, outside)
    _check_norms(writer, refs)
    assert len(_fullgraph_warnings(messages, "TensorStatsMonitor")) == 1
    # every router is inside: LoadBalanceMonitor says so at run start
    model = _tiny_moe()
    run = _compiled(model, how)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with (
        Vitals([LoadBalanceMonitor()], writer=RecordingWriter(), run_dir=tmp_path) as v,
        # (named as everywhere else: the wrapper's _orig_mod. left out)
        pytest.raises(
            ValueError, match=r"found 2 router\(s\) in \w+ \(e\.g\. 'layers\.0\.mlp\.router'\)"
        ),
    ):
        v.attach(run, opt)
        _loss(run, _batches(True)[0])


class TitanRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x).softmax(-1).topk(2, dim=-1)


class TitanMoE(nn.Module):
    """torchtitan's MoE pattern (see tests/moe/test_router_capture.py): a float32 buffer
    ``tokens_per_expert`` to which each training forward adds its counts."""

    def __init__(self) -> None:
        super().__init__()
        self.router = TitanRouter()
        self.experts = nn.Parameter(torch.randn(4, 8, 8) * 0.1)
        self.register_buffer("tokens_per_expert", torch.zeros(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, idx = self.router(x)
        routing = torch.zeros(x.shape[0], 4).scatter_(-1, idx, 1.0)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(routing.sum(0))
        out = torch.einsum("td,edf->tef", x, self.experts)
        return (out.gather(1, idx[..., None].expand(-1, -1, 8)) * top[..., None]).sum(1)


class TitanModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.ModuleDict({"moe": TitanMoE()}) for i in "01"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = x + block["moe"](x)
        return x


@pytest.mark.usefixtures("fresh_dynamo")
def test_torchtitan_moe_whose_router_is_compiled_fullgraph(tmp_path: Path) -> None:
    # The MoE module is not compiled (its buffer is read by hooks on it); its router is, as
    # torchtitan's apply_compile does: loads exact, the router itself a site (hooked on its
    # wrapper), its gate Linear left out
    routers = ["layers.0.moe.router", "layers.1.moe.router"]
    writer, lines, refs, messages = _train(
        tmp_path,
        TitanModel,
        "titan_router",
        [TensorStatsMonitor(kernel="eager"), LoadBalanceMonitor(mode="detailed")],
        routers,
        moe=False,
    )
    _check_records(lines, refs, routers)
    assert len(_fullgraph_warnings(messages, "TensorStatsMonitor")) == 1
    for step in LOGGED:
        for layer, router in enumerate(routers):
            got = [writer.rows[step][f"moe/layer_{layer}/tokens_per_expert/{e}"] for e in range(4)]
            assert got == refs[step]["loads"][router].tolist(), (step, layer)
