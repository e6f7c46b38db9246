"""RouterCapture's count dtype: float64, float32 on Apple's ``mps`` (no float64 there). No MPS
here: ``count_dtype`` is forced to float32 on the CPU and a dispatch mode checks that no path
makes a float64 tensor, while the counts stay exact against an independent computation."""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tests.moe.recording_routers import topk_routers_with_recorder
from trainvitals.moe import capture as capture_module
from trainvitals.moe.capture import FLOAT32_EXACT_COUNTS, RouterCapture, count_dtype


def test_count_dtype_is_float32_on_mps_only() -> None:
    assert count_dtype("mps") is torch.float32
    assert count_dtype(torch.device("mps", 0)) is torch.float32
    for device in ("cpu", torch.device("cuda", 1), "meta", None):
        assert count_dtype(device) is torch.float64


@pytest.fixture
def as_on_mps(monkeypatch):
    """Every device counts as ``mps`` for the dtype choice (the capture's only MPS branch)."""
    monkeypatch.setattr(capture_module, "count_dtype", lambda device: torch.float32)


class Float64Spy(TorchDispatchMode):
    """Records every op that makes a float64 tensor (which MPS cannot hold)."""

    def __init__(self) -> None:
        super().__init__()
        self.float64_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(
            isinstance(t, torch.Tensor) and t.dtype == torch.float64
            for t in pytree.tree_leaves(out)
        ):
            self.float64_ops.append(str(func))
        return out


def _run_topk(model: nn.ModuleList, tokens: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(1)
    for n in tokens:
        for router in model:
            router(torch.randn(n, 8, generator=gen))[0].sum().backward()


def test_topk_router_paths_make_no_float64_and_count_exactly(as_on_mps) -> None:
    model, maps, aux = topk_routers_with_recorder(3)
    capture = RouterCapture(model)
    spy = Float64Spy()
    with spy:
        empty = capture.loads(device=torch.device("cpu"))
        empty_packed = capture.packed(device=torch.device("cpu"))
        empty_aux = capture.aux_losses(device=torch.device("cpu"))
        _run_topk(model, (10, 10))  # one map shape: read_host's direct path
        rows, aux_sum, aux_count = capture.read_host()
        loads = capture.loads()
        aux_sums, aux_counts = capture.aux_losses()
        packed = capture.packed()
        capture.reset()
        _run_topk(model, (10, 7))  # two shapes: read_host goes through packed()
        rows_mixed, _, _ = capture.read_host()
    assert spy.float64_ops == []
    assert empty.dtype == empty_packed.dtype == empty_aux[0].dtype == torch.float32
    assert not empty.any() and not empty_packed.any() and not empty_aux[0].any()
    assert loads.dtype == packed.dtype == aux_sums.dtype == aux_counts.dtype == torch.float32
    # independent: the maps' element sums in int64, the aux losses summed in float64
    expected = [torch.stack(maps[i][:2]).sum(dim=(0, 1)).tolist() for i in range(3)]
    expected_mixed = [(maps[i][2].sum(0) + maps[i][3].sum(0)).tolist() for i in range(3)]
    assert rows == loads.tolist() == expected
    assert rows_mixed == expected_mixed
    assert aux_count == aux_counts.tolist() == [2, 2, 2]
    np.testing.assert_allclose(aux_sum, [sum(aux[i][:2]) for i in range(3)], rtol=1e-6)
    np.testing.assert_allclose(aux_sums.numpy(), [sum(aux[i][:2]) for i in range(3)], rtol=1e-6)
    assert packed.tolist() == [v for r in expected for v in r] + aux_sums.tolist() + [2.0] * 3


class _Gate(nn.Module):
    """A router whose extractor hands int64 counts and an aux loss (the eager path)."""

    num_experts = 3

    def __init__(self, counts: list[int]) -> None:
        super().__init__()
        self.counts = torch.tensor(counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _gate_counts(module: nn.Module, inputs: Any, output: Any) -> tuple[torch.Tensor, Any]:
    return module.counts, torch.tensor(0.25)


def _gates(*counts: list[int]) -> nn.Sequential:
    return nn.Sequential(*(_Gate(c) for c in counts))


def test_extractor_path_makes_no_float64(as_on_mps) -> None:
    model = _gates([1, 0, 5], [2, 2, 2])
    capture = RouterCapture(model, extractors=[(_Gate, _gate_counts)])
    spy = Float64Spy()
    with spy:
        for _ in range(3):
            model(torch.zeros(1))
        rows, aux_sum, aux_count = capture.read_host()
        packed = capture.packed()
    assert spy.float64_ops == []
    assert rows == [[3.0, 0.0, 15.0], [6.0, 6.0, 6.0]]
    assert aux_sum == [0.75, 0.75] and aux_count == [3, 3]
    assert packed.dtype == torch.float32
    assert packed.tolist() == [3.0, 0.0, 15.0, 6.0, 6.0, 6.0, 0.75, 0.75, 3.0, 3.0]


def test_hf_router_with_padding_makes_no_float64(as_on_mps) -> None:
    # index counting, the Switch aux loss with an attention mask, and a micro-batch that is all
    # padding (a forward left out of the aux count on the device)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.MixtralForCausalLM(config)
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for layer, block in enumerate(model.model.layers):
        block.mlp.gate.register_forward_hook(
            lambda m, i, out, layer=layer: seen[layer].append(out[2].detach().clone())
        )
    capture = RouterCapture(model)
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(2))
    masks = [torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), torch.zeros(2, 5, dtype=torch.long)]
    spy = Float64Spy()
    with spy:
        for mask in masks:
            model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        rows, _, aux_count = capture.read_host()
        packed = capture.packed()
    assert spy.float64_ops == []
    assert aux_count == [1, 1]  # the all-padding forward has no aux loss to average
    assert packed[-2:].tolist() == [1.0, 1.0]
    keep = masks[0].reshape(-1).bool()
    expected = [
        torch.bincount(seen[layer][0][keep].reshape(-1), minlength=4).tolist() for layer in (0, 1)
    ]
    assert rows == expected
    assert [sum(r) for r in rows] == [8 * 2, 8 * 2]  # 8 real tokens x top-2


def test_float32_counts_at_the_exact_limit_warn_once(as_on_mps) -> None:
    below = FLOAT32_EXACT_COUNTS - 1
    assert float(np.float32(below)) + 1 == FLOAT32_EXACT_COUNTS  # still exact
    assert float(np.float32(FLOAT32_EXACT_COUNTS) + np.float32(1)) == FLOAT32_EXACT_COUNTS  # lost
    model = _gates([below, 0, 1])
    capture = RouterCapture(model, extractors=[(_Gate, _gate_counts)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.zeros(1))
        assert capture.read_host()[0] == [[below, 0.0, 1.0]]  # exact, no warning
    capture.reset()
    model[0].counts = torch.tensor([FLOAT32_EXACT_COUNTS, 0, 1])
    model(torch.zeros(1))
    with pytest.warns(RuntimeWarning, match="no longer exact"):
        capture.read_host()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture.read_host()  # once


def test_float64_counts_past_the_float32_limit_do_not_warn() -> None:
    model = _gates([FLOAT32_EXACT_COUNTS + 1, 0, 1])
    capture = RouterCapture(model, extractors=[(_Gate, _gate_counts)])
    model(torch.zeros(1))
    model(torch.zeros(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert capture.read_host()[0] == [[2 * FLOAT32_EXACT_COUNTS + 2, 0.0, 2.0]]
