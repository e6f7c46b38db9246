"""TensorStatsMonitor, audit 20: a shared block checkpointed (reentrant) in some of its calls.

Values are checked against float64 statistics of the tensors the test captures itself, on the
same model run without checkpointing (the recomputation is deterministic: the same values).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.scripts.vitals_testing import RecordingWriter
from tests.stats.test_moments import assert_matches, reference
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor
from trainvitals.stats.moments import FIELDS, derive, moments_from_dicts

H = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(H, 4 * H)
        self.fc2 = nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Shared(nn.Module):
    """One block applied three times (weight sharing), each call checkpointed as ``modes`` says:
    ``"reentrant"``, ``"non-reentrant"``, ``"nested"`` (reentrant inside reentrant) or ``None``
    (not checkpointed)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.block = Block()
        self.head = nn.Linear(H, 1)
        self.modes: tuple[str | None, ...] = (None, None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for mode in self.modes:
            if mode is None:
                h = self.block(h)
            elif mode == "nested":  # a reentrant checkpoint inside another one
                h = checkpoint(self._inner, h, use_reentrant=True)
            else:
                h = checkpoint(self.block, h, use_reentrant=mode == "reentrant")
        return self.head(h)

    def _inner(self, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, h, use_reentrant=True)


def _truth(model: Shared, x: torch.Tensor) -> dict[tuple[str, str], torch.Tensor]:
    """Every call's input/output and their gradients at each site, without checkpointing."""
    seen: dict[tuple[str, str], list[torch.Tensor]] = {}

    def keep(kind: str, site: str, t: torch.Tensor) -> None:
        seen.setdefault((kind, site), []).append(t.detach().double().reshape(-1))

    def hook(name: str):
        def h(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            for slot, t in (("input0", args[0]), ("output0", out)):
                site = f"{name}/{slot}"
                keep("activation", site, t)
                if t.requires_grad:
                    t.register_hook(lambda g, site=site: keep("dgrad", site, g))

        return h

    handles = [
        m.register_forward_hook(hook(n))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    model.modes = (None, None, None)
    model(x).pow(2).sum().backward()
    for h in handles:
        h.remove()
    model.zero_grad()
    return {k: torch.cat(v) for k, v in seen.items()}


@pytest.mark.parametrize(
    ("modes", "no_grad_passes"),
    [
        (("reentrant", None, "reentrant"), False),
        (("reentrant", "non-reentrant", "reentrant"), False),
        (("reentrant", "reentrant", "reentrant"), True),
        # the inner checkpoint is not in the graph during the outer one's first run (autograd
        # off there): only the outer Function tells it from a no_grad pass (before: 2 calls of 3)
        (("nested", None, "reentrant"), False),
        (("nested", "nested", "nested"), True),
    ],
    ids=[
        "reentrant-and-plain",
        "reentrant-and-non-reentrant",
        "reentrant-beside-no-grad",
        "nested-reentrant-and-plain",
        "nested-reentrant-beside-no-grad",
    ],
)
def test_a_block_checkpointed_in_some_calls_counts_every_call(
    tmp_path: Path, modes: tuple[str | None, ...], no_grad_passes: bool
) -> None:
    # The reentrant calls run with autograd off (their re-run in backward has it on). Once the
    # same sites had run with autograd on (the plain or non-reentrant call), such calls were
    # taken for no_grad passes (generation) and left out: fc1/output0, fc2/input0 and
    # fc2/output0 held one call of three, activation and dgrad alike, silently. The dgrad
    # hooks of the first reentrant call were also cancelled by the call with autograd on, and
    # a non-reentrant recomputation took a reentrant call's re-run. And the other way round:
    # with every call reentrant, no_grad passes of the same model in the step (old log-probs,
    # a reference pass, in train mode) could not be told from the checkpoints' first runs and
    # were counted: 3x the elements with one such pass before and one after.
    torch.manual_seed(0)
    model = Shared()
    x = torch.randn(4, 5, H)
    want = _truth(model, x)
    model.modes = modes
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kinds=["activation", "dgrad"], kernel="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no site left out with a warning
        with Vitals(
            [monitor], writer=RecordingWriter(), run_dir=tmp_path, log_every_n_steps=1
        ) as v:
            v.attach(model, opt)
            v.batch(x)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # (no input requires grad)
                if no_grad_passes:
                    model(x)
            model(x).pow(2).sum().backward()
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                if no_grad_passes:
                    model(x)
            opt.step()
            opt.zero_grad()
    lines = [
        json.loads(line) for line in (tmp_path / "tensor_stats.jsonl").read_text().splitlines()
    ]
    assert [(r["step"], r["kind"]) for r in lines] == [(0, "activation"), (0, "dgrad")]
    for line in lines:
        expected = {site: t for (kind, site), t in want.items() if kind == line["kind"]}
        assert sorted(line["tensors"]) == sorted(expected)
        names = sorted(expected)
        rows = [dict(zip(FIELDS, line["tensors"][n], strict=True)) for n in names]
        got = derive(moments_from_dicts(rows))
        for i, n in enumerate(names):
            assert_matches(got, i, reference(expected[n]), f"{line['kind']} {n}")


def test_the_compiled_kernel_compiles_once_whatever_autograd_and_autocast(monkeypatch) -> None:
    # The monitor calls the kernel from forward hooks (autograd on; autocast on under AMP),
    # gradient hooks (both off) and before the optimizer step. Dynamo guards a compiled
    # function on that global state: each state met was one more compilation (seconds each),
    # and one run under bf16 autocast hit Dynamo's recompile limit (8) within three logging
    # steps, after which the kernel ran uncompiled.
    from torch._dynamo.utils import counters

    from trainvitals.stats import moments

    torch._dynamo.reset()  # (the compiled code is cached per function, across instances)
    monkeypatch.setattr(moments, "_compiled", moments._Compiled())
    counters.clear()
    x = torch.randn(16 * moments.CHUNK, generator=torch.Generator().manual_seed(0)) * 3 + 1
    results = []
    for grad, autocast in [(True, False), (False, False), (True, True), (False, True)]:
        with torch.set_grad_enabled(grad), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            results.append(moments.fused_moments([x], kernel="compile"))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    got = derive(torch.stack(results))
    for i in range(len(results)):
        assert_matches(got, i, reference(x), f"call {i}")
