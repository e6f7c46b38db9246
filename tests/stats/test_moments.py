"""Moments against an independent float64 computation on the whole tensor (numpy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainvitals.stats.moments import (
    CHUNK,
    FIELDS,
    SMALL_NUMEL,
    combine_moments,
    derive,
    empty_moments,
    fused_moments,
    merge_moments,
    moments_from_dicts,
    moments_to_dicts,
    tensor_moments,
)

REL = 1e-4


def reference(x: torch.Tensor) -> dict[str, float]:
    """float64 statistics of the finite elements of the whole tensor, computed with numpy."""
    a = x.detach().to(torch.float64).reshape(-1).numpy()
    finite = np.isfinite(a)
    a = a[finite]
    n = a.size
    mean = a.mean()
    d = a - mean
    var = (d**2).mean()
    if var == 0:
        var = np.nan  # undefined skewness/kurtosis, without numpy's 0/0 warning
    return {
        "count": float(n),
        "mean": float(mean),
        "var": float((d**2).mean()),
        "std": float(np.sqrt((d**2).mean())),
        "l2": float(np.sqrt((a**2).sum())),
        "rms": float(np.sqrt((a**2).mean())),
        "skewness": float((d**3).mean() / var**1.5),
        "kurtosis": float((d**4).mean() / var**2),
        "excess_kurtosis": float((d**4).mean() / var**2 - 3.0),
        "min": float(a.min()),
        "max": float(a.max()),
        "nonfinite": float((~finite).sum()),
    }


def assert_matches(got: dict[str, torch.Tensor], i: int, ref: dict[str, float], what: str) -> None:
    # Relative 1e-4 of the float64 value. Statistics that can be ~0 relative to their natural
    # scale (mean vs. rms; skewness vs. 1) get an absolute floor at that scale's 1e-6.
    floors = {"mean": 1e-6 * ref["rms"], "skewness": 1e-6, "excess_kurtosis": 1e-6}
    for name, want in ref.items():
        value = float(got[name][i])
        if math.isnan(want):  # skewness/kurtosis of a constant tensor: undefined in both
            assert math.isnan(value), f"{what}: {name} = {value!r}, float64 says nan"
            continue
        tol = REL * abs(want) + floors.get(name, 0.0)
        assert abs(value - want) <= tol, f"{what}: {name} = {value!r}, float64 says {want!r}"


def assert_written_moments(got: dict, want: dict[str, torch.Tensor], what: str) -> None:
    """The moments of a ``tensor_stats.jsonl`` line's ``tensors`` (``got``: name -> field
    values) against the float64 statistics of the whole tensors ``want``, name by name."""
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    names = sorted(want)
    d = derive(moments_from_dicts([dict(zip(FIELDS, got[n], strict=True)) for n in names]))
    for i, n in enumerate(names):
        assert_matches(d, i, reference(want[n]), f"{what}/{n}")


def cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        # the two pathological examples
        "layernorm_weight": 1 + 0.01 * randn(4096),
        "offset_100": 100 + randn(10**6),
        # |mean| / std = 1000, large tensor with a tail that is not a multiple of CHUNK
        "offset_1000_tail": 1000 + randn(3 * CHUNK * 17 + 11),
        "tiny_grad": 1e-6 * randn(512, 768),
        "heavy_tail": randn(300, 257) ** 3,
        "uniform_shifted": 1e4 + torch.rand(50_000, generator=g),
        "bias": randn(96),
        "bf16": (3 + randn(64, 1024)).bfloat16(),
        "fp16_small": (randn(1000) * 0.1).half(),
        "float64": 5 + randn(20, CHUNK) * 1e-3,
        "noncontiguous": randn(512, 64).t(),
    }


@pytest.mark.parametrize("kernel", ["eager", "compile"])
def test_every_statistic_matches_float64(kernel: str) -> None:
    xs = cases()
    if kernel == "compile":  # compiling is slow on 2 CPU cores: a few large tensors suffice
        xs = {k: xs[k] for k in ("offset_100", "offset_1000_tail", "bf16", "heavy_tail")}
    got = derive(fused_moments(list(xs.values()), kernel=kernel))
    for i, (name, x) in enumerate(xs.items()):
        assert_matches(got, i, reference(x), f"{kernel}/{name}")


def test_raw_power_sums_would_fail_this_test() -> None:
    # The test above can fail: the float32 raw-power-sum method (Megatron-LM PR #5492) is far
    # off on the LayerNorm example, ours is not.
    x = cases()["layernorm_weight"]
    n = x.numel()
    s1, s2, s3, s4 = (float((x**k).sum()) for k in range(1, 5))
    mu = s1 / n
    var = s2 / n - mu * mu
    raw_kurt = (s4 / n - 4 * mu * s3 / n + 6 * mu * mu * s2 / n - 3 * mu**4) / var**2
    want = reference(x)["kurtosis"]
    assert abs(raw_kurt - want) > 1.0
    assert abs(float(derive(tensor_moments(x))["kurtosis"]) - want) <= REL * want


def test_nonfinite_elements_are_counted_and_excluded() -> None:
    g = torch.Generator().manual_seed(1)
    big = 10 + torch.randn(40 * CHUNK + 5, generator=g)
    big[[3, 777, 40 * CHUNK + 2]] = torch.tensor([math.nan, math.inf, -math.inf])
    small = torch.randn(100, generator=g)
    small[7] = math.nan
    all_bad = torch.full((10,), math.nan)
    clean = torch.randn(20 * CHUNK, generator=g)
    xs = [big, small, clean, all_bad]
    for kernel in ("eager", "compile"):
        m = fused_moments(xs, kernel=kernel)
        got = derive(m)
        for i, x in enumerate(xs[:3]):
            assert_matches(got, i, reference(x), f"{kernel}/nonfinite{i}")
        assert m[3, 0] == 0 and m[3, 7] == 10
        assert math.isnan(float(got["mean"][3])) and math.isnan(float(got["kurtosis"][3]))


def test_constant_and_empty_tensors() -> None:
    m = fused_moments([torch.ones(SMALL_NUMEL * 2), torch.empty(0), torch.zeros(3)])
    d = derive(m)
    assert d["var"][0] == 0 and d["mean"][0] == 1 and d["l2"][0] == math.sqrt(SMALL_NUMEL * 2)
    assert math.isnan(float(d["kurtosis"][0])) and math.isnan(float(d["skewness"][0]))
    assert d["count"][1] == 0 and math.isnan(float(d["mean"][1]))
    assert d["rms"][2] == 0


@pytest.mark.parametrize("offset", [0.0, 100.0, 1e4])
def test_combination_over_splits_is_exact(offset: float) -> None:
    g = torch.Generator().manual_seed(2)
    x = offset + torch.randn(200_003, generator=g) * torch.linspace(0.5, 3, 200_003)
    # random split points: pieces of very different sizes, some tiny, some chunked
    cuts = sorted(torch.randint(1, x.numel(), (9,), generator=g).tolist())
    pieces = list(torch.tensor_split(x, cuts))
    whole = derive(tensor_moments(x))
    ref = reference(x)
    per_piece = fused_moments(pieces)
    merged = combine_moments(per_piece)  # all parts at once
    assert_matches(derive(merged.unsqueeze(0)), 0, ref, "combine all")
    # pairwise, left to right (as micro-batches arrive)
    acc = empty_moments()
    for row in per_piece:
        acc = merge_moments(acc, row)
    assert_matches(derive(acc.unsqueeze(0)), 0, ref, "pairwise")
    # grouped: pieces 0..4 -> group 0, the rest -> group 1, then the two groups
    idx = torch.tensor([0] * 5 + [1] * (len(pieces) - 5))
    two = combine_moments(per_piece, idx, 2)
    assert_matches(derive(combine_moments(two).unsqueeze(0)), 0, ref, "tree")
    for name in ("mean", "var", "kurtosis"):
        assert abs(float(whole[name]) - ref[name]) <= REL * abs(ref[name]) + 1e-6 * ref["rms"]


def test_combination_over_a_gathered_dim() -> None:
    # [ranks, tensors, fields] -> [tensors, fields], as after an all_gather
    g = torch.Generator().manual_seed(3)
    full = [1 + 0.01 * torch.randn(4096, generator=g), torch.randn(64, 1024, generator=g)]
    shards = [torch.tensor_split(t.reshape(-1), 4) for t in full]
    stacked = torch.stack([fused_moments([s[r] for s in shards]) for r in range(4)])
    got = derive(combine_moments(stacked, dim=0))
    for i, t in enumerate(full):
        assert_matches(got, i, reference(t), f"gathered{i}")


def test_dict_round_trip_keeps_identity() -> None:
    m = fused_moments([torch.randn(10), torch.empty(0)])
    rows = moments_to_dicts(m)
    assert set(rows[0]) == set(FIELDS) and rows[1]["min"] is None
    back = moments_from_dicts(rows)
    assert torch.equal(back, m)


def test_bad_input_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        fused_moments([torch.randn(3), torch.arange(3)])
    with pytest.raises(ValueError, match="kernel"):
        fused_moments([torch.randn(3)], kernel="triton")
    with pytest.raises(ValueError, match="parts"):
        combine_moments(torch.zeros(3, 5))


def test_compile_failure_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from trainvitals.stats import moments as mod

    def broken_compile(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(mod, "_compiled", mod._Compiled())
    monkeypatch.setattr(torch, "compile", broken_compile)
    x = 100 + torch.randn(20 * CHUNK + 3, generator=torch.Generator().manual_seed(4))
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        got = derive(fused_moments([x], kernel="compile"))
    assert_matches(got, 0, reference(x), "fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once; later calls go straight to eager
        fused_moments([x], kernel="compile")
    assert mod._compiled.failed is not None


@pytest.mark.parametrize("kernel", ["eager", "compile"])
def test_accumulator_merges_adds_exactly_and_copies_small_tensors(kernel: str) -> None:
    from trainvitals.stats.moments import MomentAccumulator

    g = torch.Generator().manual_seed(5)
    micro = [50 + torch.randn(3, 4000, generator=g) for _ in range(3)]  # large, with tails
    small = [torch.randn(100, generator=g) for _ in range(3)]
    bad = torch.randn(20 * CHUNK, generator=g)
    bad[5] = math.nan
    acc = MomentAccumulator(3, kernel=kernel)
    for m, s in zip(micro, small, strict=True):
        acc.add(0, m)
        acc.add(1, s)
    acc.add(2, bad)  # check_finite: recomputed with masking right away
    want_small = torch.cat(small)
    for s in small:
        s.mul_(1000)  # an in-place op after the hook (ReLU(inplace=True)) must not leak in
    got = derive(acc.result())
    assert_matches(got, 0, reference(torch.cat([m.reshape(-1) for m in micro])), "acc/large")
    assert_matches(got, 1, reference(want_small), "acc/small")
    assert_matches(got, 2, reference(bad), "acc/nonfinite")
    assert float(got["nonfinite"][2]) == 1


@pytest.mark.parametrize("kernel", ["eager", "compile"])
def test_accumulator_reduces_a_shared_tensor_once(kernel: str) -> None:
    from trainvitals.stats.moments import MomentAccumulator

    x = 3 + torch.randn(40, 1000, generator=torch.Generator().manual_seed(6))
    acc = MomentAccumulator(3, kernel=kernel)
    # the eager kernel keeps raw rows, the compiled CPU kernel one vector per tensor body
    parts = acc._rows if kernel == "eager" else acc._bodies
    acc.add(0, x.detach(), key=x)
    acc.add(1, x.detach(), key=x)  # the same tensor at a second site: reused
    assert len(parts) == 2 and parts[0] is parts[1]
    x.add_(1.0)  # modified in place: a new version is reduced again
    acc.add(2, x.detach(), key=x)
    assert parts[2] is not parts[0]
    got = derive(acc.result())
    ref = reference(x - 1.0)
    assert_matches(got, 0, ref, "shared0")
    assert_matches(got, 1, ref, "shared1")
    assert_matches(got, 2, reference(x), "modified")


def test_small_pieces_of_equal_length_with_nonfinite_rows() -> None:
    # Small pieces that share a length are reduced as one dense matrix on CPU; a row with a
    # NaN/inf there must fall back to the masked path without disturbing its neighbours.
    g = torch.Generator().manual_seed(7)
    xs = [1000 + 0.01 * torch.randn(1024, generator=g) for _ in range(4)]
    xs[1][5] = math.nan
    xs[2][[0, 1023]] = torch.tensor([math.inf, -math.inf])
    xs.append(torch.randn(1024, generator=g).half())  # same length, another dtype
    xs.append(torch.full((1024,), math.nan))  # no finite element at all
    xs.append(5 + torch.randn(333, generator=g))  # a length that occurs once
    m = fused_moments(xs)
    got = derive(m)
    for i, x in enumerate(xs):
        if i == 5:
            assert m[i, 0] == 0 and m[i, 7] == 1024
            continue
        assert_matches(got, i, reference(x), f"small{i}")


@pytest.mark.parametrize("kernel", ["eager", "compile"])
def test_large_tensor_whose_blocks_differ(kernel: str) -> None:
    # Many eager blocks and rows with very different means, a large common offset, a tail:
    # every block/row shift and min/max must merge to the whole tensor's statistics.
    g = torch.Generator().manual_seed(8)
    from trainvitals.stats.moments import _EAGER_BLOCK

    n = 3 * _EAGER_BLOCK + 3 * CHUNK + 77  # four eager blocks, the last one partial
    x = 1e4 + torch.linspace(-30.0, 30.0, n) + torch.randn(n, generator=g)
    x[123_456] = 1e4 + 400.0  # a single outlier sets max and the kurtosis
    got = derive(fused_moments([x, x.view(-1)[: 2 * CHUNK * 64]], kernel=kernel))
    assert_matches(got, 0, reference(x), f"{kernel}/blocks")
    assert_matches(got, 1, reference(x[: 2 * CHUNK * 64]), f"{kernel}/blocks_prefix")


def test_compiled_kernel_on_float64_and_sizes_that_are_not_multiples() -> None:
    # The compiled CPU kernel merges a tensor's rows inside its graph; one graph per dtype
    # serves every size (dynamic shapes), including a single row and a ragged tail.
    g = torch.Generator().manual_seed(9)
    xs = [
        (1e3 + torch.randn(37 * CHUNK + 5, generator=g)).double(),
        -7 + 0.1 * torch.randn(CHUNK + 1, generator=g),
        -7 + 0.1 * torch.randn(SMALL_NUMEL, generator=g),
        torch.randn(3 * CHUNK * 40 + 999, generator=g) ** 3,
    ]
    got = derive(fused_moments(xs, kernel="compile"))
    for i, x in enumerate(xs):
        assert_matches(got, i, reference(x), f"compile/sizes{i}")


@pytest.mark.parametrize("kernel", ["eager", "compile"])
def test_deferred_finiteness_check_covers_a_reused_tensor(kernel: str) -> None:
    # add(check_finite=False) + fix_nonfinite: a tensor with a NaN reused at a second slot
    # (same key) must be recomputed with masking at both slots, and the parts added after it
    # must keep their slots.
    from trainvitals.stats.moments import MomentAccumulator

    g = torch.Generator().manual_seed(8)
    bad = 5 + torch.randn(30 * CHUNK, generator=g)
    bad[100] = math.nan
    clean = torch.randn(20 * CHUNK, generator=g)
    tensors = [bad, bad, clean]
    acc = MomentAccumulator(3, kernel=kernel)
    for i, t in enumerate(tensors):
        acc.add(i, t, check_finite=False, key=t)
    acc.fix_nonfinite(tensors)
    got = derive(acc.result())
    for i, t in enumerate(tensors):
        assert_matches(got, i, reference(t), f"{kernel}/reused{i}")
    assert got["nonfinite"].tolist() == [1.0, 1.0, 0.0]


def test_eager_raw_block_sums_are_exact_when_the_mean_is_within_a_std() -> None:
    # The eager CPU kernel keeps raw power sums (no shift) for blocks whose |mean| <= std and
    # recomputes the other blocks with per-row shifts. Tensors on both sides of that bound,
    # heavy tails, and one whose blocks differ (first blocks centred, later ones offset by
    # 100 std: only those fall back).
    from trainvitals.stats.moments import _EAGER_BLOCK, _blocks_eager, _rows_to_moments

    g = torch.Generator().manual_seed(10)
    n = 2 * _EAGER_BLOCK + 5 * CHUNK
    mixed = torch.randn(n, generator=g)
    mixed[_EAGER_BLOCK:] += 100.0
    xs = {
        "centred": torch.randn(n, generator=g),
        "mean_0.99_std": 0.99 + torch.randn(n, generator=g),
        "mean_1.5_std": 1.5 + torch.randn(n, generator=g),
        "relu": torch.relu(torch.randn(n, generator=g)),
        "heavy_tail": torch.randn(n, generator=g) ** 5,
        "mixed_blocks": mixed,
        "bf16": torch.randn(n, generator=g).bfloat16(),
    }
    got = derive(fused_moments(list(xs.values()), kernel="eager"))
    for i, (name, x) in enumerate(xs.items()):
        assert_matches(got, i, reference(x), f"raw/{name}")
    # which path each took: three blocks of raw sums, or a block's rows after a fallback
    blocks = 3
    rows = {k: _blocks_eager(v.view(-1, CHUNK), [])[0].shape[1] for k, v in xs.items()}
    assert rows["centred"] == rows["mean_0.99_std"] == rows["relu"] == blocks
    assert rows["mean_1.5_std"] == n // CHUNK  # every block failed the bound: per-row shifts
    assert rows["mixed_blocks"] == 1 + (n - _EAGER_BLOCK) // CHUNK
    # the offset blocks alone (the kept block comes first, then the rows that replaced the
    # others): raw sums there would lose the kurtosis to cancellation
    parts = _rows_to_moments(_blocks_eager(mixed.view(-1, CHUNK), [])[0], CHUNK)
    offset = derive(combine_moments(parts[1:]).unsqueeze(0))
    assert_matches(offset, 0, reference(mixed[_EAGER_BLOCK:]), "raw/offset blocks")


def test_eager_tensor_with_an_offset_first_row_skips_the_raw_sums() -> None:
    from trainvitals.stats.moments import _blocks_eager

    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, CHUNK, generator=g)
    x[0] += 1e3  # only the first row is offset: the block as a whole would pass the bound
    assert _blocks_eager(x, [])[0].shape[1] == 64  # rows of the shifted kernel, no raw pass
    assert_matches(derive(fused_moments([x], kernel="eager")), 0, reference(x), "offset")


@pytest.mark.parametrize("kernel", ["eager", "compile"])
@pytest.mark.parametrize("check_finite", [False, True])
def test_tiny_and_huge_magnitudes_are_recomputed_in_float64(kernel: str, check_finite) -> None:
    # float32 fourth powers underflow below a spread of ~1e-10 (kurtosis 0.02 instead of 3 at
    # 1e-12) and overflow above ~1e9; such tensors are recomputed in float64, through
    # fix_nonfinite (fused_moments) or right away (add with check_finite=True).
    from trainvitals.stats.moments import MomentAccumulator

    g = torch.Generator().manual_seed(12)
    base = torch.randn(20 * CHUNK + 7, generator=g)
    xs = [
        1e-12 * base,
        1e-30 * torch.randn(9 * CHUNK, generator=g) ** 3,
        1e-4 + 1e-11 * base,  # tiny spread around an offset
        1e12 * base,
        1e30 * base,  # x^2 overflows float32
        torch.randn(9 * CHUNK, generator=g),  # an ordinary tensor beside them
    ]
    if check_finite:
        acc = MomentAccumulator(len(xs), kernel=kernel)
        for i, x in enumerate(xs):
            acc.add(i, x)
        got = derive(acc.result())
    else:
        got = derive(fused_moments(xs, kernel=kernel))
    for i, x in enumerate(xs):
        assert_matches(got, i, reference(x), f"{kernel}/range{i}")


@pytest.mark.parametrize("compiled", [False, True])
def test_masked_kernel_scales_rows_instead_of_a_host_check(compiled: bool) -> None:
    # The masked kernel is the accelerators' compiled path, which must not sync with the host:
    # it scales each row by a power of two so tiny and huge tensors (here with a NaN and an
    # inf, masked) keep exact moments without the CPU's float64 recompute. Run here on CPU,
    # eagerly and compiled.
    from trainvitals.stats.moments import _compiled, _rows_masked, _rows_to_moments

    g = torch.Generator().manual_seed(13)
    xs = [s * torch.randn(12 * CHUNK, generator=g) for s in (1e-12, 1e-30, 1e12, 1e30, 1.0)]
    xs.append(torch.zeros(4 * CHUNK))
    for x in xs[:3]:
        x[[7, 4000]] = torch.tensor([math.nan, math.inf])
    parts, owner = [], []
    for i, x in enumerate(xs):
        body = x.view(-1, CHUNK)
        rows = _compiled(body, masked=True) if compiled else _rows_masked(body)
        assert rows is not None
        parts.append(_rows_to_moments(rows, CHUNK))
        owner += [i] * body.shape[0]
    got = derive(combine_moments(torch.cat(parts), torch.tensor(owner), len(xs)))
    for i, x in enumerate(xs):
        assert_matches(got, i, reference(x), f"masked/{'compiled' if compiled else 'eager'}{i}")


def test_deferred_checks_keep_float32_and_float64_tensors_apart(monkeypatch) -> None:
    # The rows of an accelerator's eager kernel are checked in one batch by fix_nonfinite; a
    # float64 tensor among float32 ones must not make the float32 rows skip the underflow check
    # (a concatenation promotes them all to float64). CPU stands in for the accelerator here:
    # its eager kernel is swapped for the row kernel whose check is deferred.
    import trainvitals.stats.moments as mod

    def deferred(body: torch.Tensor, work: list[torch.Tensor]):
        return mod._rows_eager_fast(body, work), None

    monkeypatch.setattr(mod, "_blocks_eager", deferred)
    g = torch.Generator().manual_seed(21)
    xs = [
        torch.randn(9 * CHUNK, generator=g, dtype=torch.float64),
        1e-12 * torch.randn(20 * CHUNK, generator=g),  # float32 powers underflow
        1e-12 * torch.randn(9 * CHUNK, generator=g, dtype=torch.float64),  # float64 do not
    ]
    got = derive(fused_moments(xs, kernel="eager"))
    for i, x in enumerate(xs):
        assert_matches(got, i, reference(x), f"deferred{i}")


def test_compiled_float64_body_with_a_tiny_spread_is_not_recomputed(monkeypatch) -> None:
    # float64 sums do not underflow: a float64 tensor of std 1e-12 keeps the compiled kernel's
    # moments (exact), a float32 one is recomputed in float64
    import trainvitals.stats.moments as mod

    recomputed: list[torch.dtype] = []
    exact = mod._rows_exact

    def counting(body: torch.Tensor) -> torch.Tensor:
        recomputed.append(body.dtype)
        return exact(body)

    monkeypatch.setattr(mod, "_rows_exact", counting)
    g = torch.Generator().manual_seed(22)
    x64 = 1e-12 * torch.randn(16 * CHUNK, generator=g, dtype=torch.float64)
    x32 = 1e-12 * torch.randn(16 * CHUNK, generator=g)
    for check_finite in (False, True):
        recomputed.clear()
        acc = mod.MomentAccumulator(2, kernel="compile")
        acc.add(0, x64, check_finite=check_finite)
        acc.add(1, x32, check_finite=check_finite)
        acc.fix_nonfinite([x64, x32])
        got = derive(acc.result())
        assert recomputed == [torch.float32], (check_finite, recomputed)
        for i, x in enumerate((x64, x32)):
            assert_matches(got, i, reference(x), f"compiled{i}/{check_finite}")
