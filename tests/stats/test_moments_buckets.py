"""MomentAccumulator.add_bucketed: the accelerator path of partial_moments (bodies of many
tensors concatenated, one compiled call per bucket), checked on CPU with the masked row kernel
run eagerly in place of its compiled form, against float64 numpy statistics of each tensor."""

from __future__ import annotations

import pytest
import torch

from tests.stats.test_moments import assert_matches, reference
from trainvitals.stats import moments as moments_module
from trainvitals.stats.moments import CHUNK, SMALL_NUMEL, MomentAccumulator, combine_moments, derive


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3 * CHUNK * 10 + 7, generator=g),  # body of 30 rows and a tail
        torch.randn(100, generator=g),  # small
        5.0 + 0.01 * torch.randn(64, CHUNK, generator=g),  # |mean|/std 500, no tail
        torch.randn(SMALL_NUMEL + 5, generator=g).double(),  # another dtype: its own bucket
        torch.randn(40 * CHUNK, generator=g).exp(),  # skewed
        torch.randn(9 * CHUNK + 1, generator=g),
        torch.full((12 * CHUNK,), 2.5),  # constant
    ]


def _run(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    acc = MomentAccumulator(len(tensors), kernel="compile")
    acc.add_bucketed(tensors)
    acc.fix_nonfinite(tensors)
    parts, owner = acc.parts()
    return derive(combine_moments(parts, owner, len(tensors)))


@pytest.mark.parametrize("bucket", [16 * CHUNK, 48 * CHUNK, 1 << 25])
def test_buckets_give_each_tensor_its_own_moments(monkeypatch, bucket: int) -> None:
    calls: list[tuple[int, ...]] = []

    def masked_rows(x2: torch.Tensor, masked: bool = True) -> torch.Tensor:
        assert masked
        calls.append(tuple(x2.shape))
        return moments_module._rows_masked(x2)

    monkeypatch.setattr(moments_module, "_compiled", masked_rows)
    monkeypatch.setattr(moments_module, "_BUCKET_NUMEL", bucket)
    tensors = _tensors()
    got = _run(tensors)
    for i, t in enumerate(tensors):
        assert_matches(got, i, reference(t), f"tensor {i}, bucket {bucket}")
    # every tensor whole, padded to whole rows: float32 31 (30 and a tail), 1 (small), 64, 40,
    # 10 and 12 rows, float64 9 rows apart: one call per bucket, no bucket over its size; a
    # body of a bucket's size alone (30, 64, 40 rows) reduced where it is, its tail bucketed
    rows = bucket // CHUNK
    if rows >= 200:
        assert sorted(calls) == sorted([(31 + 1 + 64 + 40 + 10 + 12, CHUNK), (9, CHUNK)])
    for shape in calls:
        assert shape[0] <= rows or (shape[0] in (30, 64, 40) and rows < shape[0])
    assert sum(c[0] for c in calls) == 31 + 1 + 64 + 40 + 10 + 12 + 9


def test_nonfinite_values_are_masked_in_buckets(monkeypatch) -> None:
    monkeypatch.setattr(
        moments_module, "_compiled", lambda x2, masked=True: moments_module._rows_masked(x2)
    )
    tensors = _tensors()
    tensors[0][5] = float("nan")
    tensors[4][7] = float("inf")
    tensors[5][CHUNK : 2 * CHUNK] = float("nan")  # a whole row: no finite element in it
    tensors[5][-1] = float("-inf")  # in the padded last row (one element and 1023 NaN of pad)
    tensors[1][3] = float("nan")  # a small tensor: one padded row
    tensors[3][-2] = float("nan")  # float64, in its padded tail
    got = _run(tensors)
    bad = {0: 1.0, 1: 1.0, 3: 1.0, 4: 1.0, 5: float(CHUNK + 1)}
    for i, count in bad.items():
        finite = tensors[i][torch.isfinite(tensors[i])]
        assert_matches(got, i, {**reference(finite), "nonfinite": count}, f"tensor {i}")


def test_a_failed_compilation_falls_back_to_the_eager_rows(monkeypatch) -> None:
    monkeypatch.setattr(moments_module, "_compiled", lambda x2, masked=True: None)
    tensors = _tensors()
    tensors[2] = tensors[2] * 1e-30  # tiny: float32 powers underflow, redone exactly
    got = _run(tensors)
    for i, t in enumerate(tensors):
        assert_matches(got, i, reference(t), f"tensor {i} (eager fallback)")


def test_add_many_buckets_and_reduces_a_repeated_key_once(monkeypatch) -> None:
    """The hooks' batches (TensorStatsMonitor._reduce_deferred): slots as given, a tensor seen
    at two slots reduced once, small tensors and tails copied (changed afterwards: the moments
    are of the values at the add)."""
    calls: list[int] = []

    def masked_rows(x2: torch.Tensor, masked: bool = True) -> torch.Tensor:
        calls.append(x2.shape[0])
        return moments_module._rows_masked(x2)

    monkeypatch.setattr(moments_module, "_compiled", masked_rows)
    monkeypatch.setattr(moments_module, "_bucketing", lambda kernel, device: True)
    tensors = _tensors()
    shared = tensors[0]
    originals = [t.clone() for t in tensors]
    acc = MomentAccumulator(3, kernel="compile")
    acc.add_many([(0, t, t) for t in tensors[:3]] + [(2, shared, shared)])
    acc.add_many([(1, t, t) for t in tensors[3:]] + [(1, shared, shared)])
    for t in tensors:
        t.add_(1000.0)  # in place after the add: small tensors and tails were copied
    got = derive(acc.result())
    groups = {
        0: originals[:3],
        1: [*originals[3:], originals[0]],
        2: [originals[0]],
    }
    for slot, members in groups.items():
        assert_matches(
            got,
            slot,
            reference(torch.cat([m.reshape(-1).double() for m in members])),
            f"slot {slot}",
        )
    # each call's float32 tensors whole in one bucket: 31 + 1 + 64 rows, then 40 + 10 + 12
    # rows; the float64 tensor its own (9 rows); the repeated tensor not reduced again
    assert sorted(calls) == sorted([31 + 1 + 64, 9, 40 + 10 + 12])
