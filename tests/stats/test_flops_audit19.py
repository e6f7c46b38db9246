"""Flop formulas for matmul ops that torch 2.13's ``flop_counter`` counts 0: the FP8/MX
``scaled_mm``/``scaled_grouped_mm`` v2 ops, ``addmm`` with a fused activation, ``addbmm``,
``_foreach_mm`` and the in-place ``addmm_``/``baddbmm_``/``addbmm_``. Each against the analytic
count ``2 * M * K * N`` per product, on tiny CPU tensors (the op itself where it runs on CPU,
the formula on the schema's arguments where it does not)."""

from __future__ import annotations

import pytest
import torch

from trainvitals.stats.flops import extra_flop_formulas, measure_flops

aten = torch.ops.aten
M, K, N, BATCH = 4, 8, 6, 3


def _mm(m: int, k: int, n: int, batch: int = 1) -> int:
    return 2 * batch * m * k * n


def _scaled_mm_v2() -> torch.Tensor:
    from torch.nn.functional import ScalingType, SwizzleType

    a = torch.randn(M, K).to(torch.float8_e4m3fn)
    b = torch.randn(N, K).to(torch.float8_e4m3fn).t()  # column-major, as the kernel wants
    one = torch.tensor(1.0)
    tensorwise, plain = [ScalingType.TensorWise], [SwizzleType.NO_SWIZZLE]
    return torch._scaled_mm_v2(
        a, b, [one], tensorwise, plain, [one], tensorwise, plain, None, torch.float32
    )


CASES = {
    "_scaled_mm_v2": (_scaled_mm_v2, _mm(M, K, N)),
    "_addmm_activation": (
        lambda: aten._addmm_activation(
            torch.randn(N), torch.randn(M, K), torch.randn(K, N), use_gelu=True
        ),
        _mm(M, K, N),
    ),
    "addbmm": (
        lambda: torch.addbmm(torch.randn(M, N), torch.randn(BATCH, M, K), torch.randn(BATCH, K, N)),
        _mm(M, K, N, BATCH),
    ),
    "addbmm_": (
        lambda: torch.randn(M, N).addbmm_(torch.randn(BATCH, M, K), torch.randn(BATCH, K, N)),
        _mm(M, K, N, BATCH),
    ),
    "addmm_": (
        lambda: torch.randn(M, N).addmm_(torch.randn(M, K), torch.randn(K, N)),
        _mm(M, K, N),
    ),
    "baddbmm_": (
        lambda: torch.randn(BATCH, M, N).baddbmm_(
            torch.randn(BATCH, M, K), torch.randn(BATCH, K, N)
        ),
        _mm(M, K, N, BATCH),
    ),
    "_foreach_mm": (
        lambda: aten._foreach_mm(
            [torch.randn(M, K), torch.randn(2, 3)], [torch.randn(K, N), torch.randn(3, 5)]
        ),
        _mm(M, K, N) + _mm(2, 3, 5),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matmul_ops_torch_does_not_count_are_counted(name):
    # before: 0 flops for each
    run, expected = CASES[name]
    assert measure_flops(run) == expected


def test_addbmm_forward_and_backward():
    # forward: the batch of products; backward: dA_b = dY B_b^T and dB_b = A_b^T dY, each
    # 2 * BATCH * M * K * N (before: the forward counted 0, 2/3 of the total)
    a = torch.randn(BATCH, M, K, requires_grad=True)
    b = torch.randn(BATCH, K, N, requires_grad=True)
    flops = measure_flops(lambda: torch.addbmm(torch.randn(M, N), a, b).pow(2).sum().backward())
    assert flops == 3 * _mm(M, K, N, BATCH)


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "offs", "mms"),
    [
        # (M, K) x (G, K, N): each group's rows through its matrix, rows past offs[-1] skipped
        ((10, 8), (3, 8, 4), [2, 2, 7], [(2, 8, 4), (0, 8, 4), (5, 8, 4)]),
        # (M, K) x (K, N) grouped along K (the weight gradients): out (G, M, N)
        ((4, 12), (12, 8), [3, 8], [(4, 3, 8), (4, 5, 8)]),
        # (G, M, K) x (G, K, N): batched, no offsets
        ((3, 4, 8), (3, 8, 4), None, [(4, 8, 4)] * 3),
    ],
)
def test_scaled_grouped_mm_v2_formula(a_shape, b_shape, offs, mms):
    # No CPU (or meta) kernel: the formula on the schema's arguments, aten::_scaled_grouped_mm_v2(
    # self, mat2, scale_a[], recipe_a[], swizzle_a[], scale_b[], recipe_b[], swizzle_b[],
    # offs, bias, out_dtype, contraction_dim, use_fast_accum); offs as positional or keyword.
    formula = extra_flop_formulas()[aten._scaled_grouped_mm_v2]
    a, b = torch.empty(a_shape), torch.empty(b_shape)
    o = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    scales = ([torch.ones(1)], [0], [0], [torch.ones(1)], [0], [0])
    expected = sum(_mm(m, k, n) for m, k, n in mms)
    assert formula(a, b, *scales, o, None, None, [], False) == expected
    assert formula(a, b, *scales, offs=o) == expected
