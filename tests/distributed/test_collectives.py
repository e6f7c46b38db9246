"""The coalesced collectives: values, one collective per call (per group), no-ops when trivial.

Each rank's inputs are a known function of its rank, so the expected reductions are computed
here in float64 from all ranks' inputs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.shared_ranks import SharedRanks
from trainvitals import distributed as tvd
from trainvitals.distributed import (
    all_gather_coalesced,
    all_gather_objects,
    all_reduce_by_groups,
    all_reduce_coalesced,
    collective_counter,
    partial_groups,
    shard_groups,
)

# one set of gloo processes per world size runs every case of this file
# (tests/helpers/shared_ranks.py)
shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()


def _inputs(rank: int) -> list[torch.Tensor]:
    """Three tensors of different shapes and dtypes (an int count among them)."""
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(3, generator=g),
        torch.tensor(rank * 7 + 1, dtype=torch.int64),
        torch.randn(2, 2, generator=g).double(),
    ]


def _count() -> int:
    return sum(collective_counter.values())


def _reduce_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    out: dict = {}
    inputs = _inputs(rank)
    copies = [t.clone() for t in inputs]
    for op in ("sum", "avg", "max", "min"):
        before = _count()
        reduced = all_reduce_coalesced(inputs, op, tvd.world_group())
        out[op] = [r.tolist() for r in reduced]
        out[f"{op}_dtypes"] = [str(r.dtype) for r in reduced]
        out[f"{op}_shapes"] = [tuple(r.shape) for r in reduced]
        out[f"{op}_collectives"] = _count() - before
    out["inputs_unchanged"] = all(torch.equal(a, b) for a, b in zip(inputs, copies, strict=True))
    # trivial groups: None and a group of one member issue nothing
    singles = [dist.new_group([r]) for r in range(world_size)]
    before = _count()
    out["none_group"] = [r.tolist() for r in all_reduce_coalesced(inputs, "sum", None)]
    out["single_group"] = [r.tolist() for r in all_reduce_coalesced(inputs, "sum", singles[rank])]
    out["empty"] = all_reduce_coalesced([], "sum", tvd.world_group())
    out["trivial_collectives"] = _count() - before
    # gathers
    before = _count()
    gathered = all_gather_coalesced(inputs, tvd.world_group())
    out["gathered"] = [g.tolist() for g in gathered]
    out["gathered_shapes"] = [tuple(g.shape) for g in gathered]
    out["objects"] = all_gather_objects({"rank": rank, "names": ["a"] * rank}, tvd.world_group())
    out["gather_collectives"] = _count() - before
    try:
        all_reduce_coalesced(inputs, "mean", tvd.world_group())
    except ValueError as exc:
        out["bad_op"] = str(exc)
    return out


def _close(got: list | float, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-12, atol=0)


@shared.on_ranks(3, _reduce_body)
def test_all_reduce_coalesced_values_and_collective_count(ran):
    world_size = 3
    _, results = ran
    per_rank = [[t.double() for t in _inputs(r)] for r in range(world_size)]
    expected = {
        "sum": [sum(ts) for ts in zip(*per_rank, strict=True)],
        "max": [torch.stack(ts).amax(0) for ts in zip(*per_rank, strict=True)],
        "min": [torch.stack(ts).amin(0) for ts in zip(*per_rank, strict=True)],
    }
    expected["avg"] = [s / world_size for s in expected["sum"]]
    for rank, res in enumerate(results):
        for op, values in expected.items():
            for got, want in zip(res[op], values, strict=True):
                _close(got, want)
            assert res[f"{op}_collectives"] == 1  # three tensors, one collective
            assert res[f"{op}_dtypes"] == ["torch.float64"] * 3
            assert res[f"{op}_shapes"] == [(3,), (), (2, 2)]
        assert res["inputs_unchanged"]
        own = [t.double().tolist() for t in _inputs(rank)]
        assert res["none_group"] == own
        assert res["single_group"] == own
        assert res["empty"] == []
        assert res["trivial_collectives"] == 0
        for r in range(world_size):
            for got, want in zip(res["gathered"], per_rank[r], strict=True):
                _close(got[r], want)
        assert res["gathered_shapes"] == [(3, 3), (3,), (3, 2, 2)]
        assert res["objects"] == [{"rank": r, "names": ["a"] * r} for r in range(world_size)]
        assert res["gather_collectives"] == 2
        assert "mean" in res["bad_op"]


def _by_groups_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    value = float(rank + 1)
    items = [
        (torch.tensor([value]), (dp,)),
        (torch.tensor([10 * value, 1.0]), (tp,)),
        (torch.tensor(100 * value), (dp, tp)),
        (torch.tensor(value), ()),
        (torch.tensor([-value]), (dp,)),
    ]
    before = _count()
    reduced = all_reduce_by_groups(items, "sum")
    out: dict = {
        "sum": [r.tolist() for r in reduced],
        "collectives": _count() - before,
    }
    before = _count()
    out["max"] = [r.tolist() for r in all_reduce_by_groups(items, "max")]
    out["max_collectives"] = _count() - before
    try:
        all_reduce_by_groups(items, "avg")
    except ValueError as exc:
        out["avg_error"] = str(exc)

    def ranks(groups):
        import torch.distributed as dist

        return [sorted(dist.get_process_group_ranks(g)) for g in groups]

    local = torch.ones(2, 2)
    layouts = {
        "shard_replicate": (Shard(0), Replicate()),
        "replicate_shard": (Replicate(), Shard(1)),
        "partial_shard": (Partial(), Shard(0)),
        "replicate_replicate": (Replicate(), Replicate()),
    }
    for key, placements in layouts.items():
        t = DTensor.from_local(local, mesh, placements)
        out[key] = {
            "shard": ranks(shard_groups(t)),
            "shard_no_partial": ranks(shard_groups(t, include_partial=False)),
            "partial": ranks(partial_groups(t)),
        }
    out["plain"] = (shard_groups(local), partial_groups(local))
    return out


def test_all_reduce_by_groups_one_collective_per_distinct_group_and_placements():
    results = run_distributed(_by_groups_body, 4, timeout=120)
    dp_of = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    tp_of = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    for rank, res in enumerate(results):
        vals = {r: float(r + 1) for r in range(4)}
        dp_sum = sum(vals[r] for r in dp_of[rank])
        tp_sum = sum(vals[r] for r in tp_of[rank])
        assert res["sum"][0] == [dp_sum]
        assert res["sum"][1] == [10 * tp_sum, 2.0]
        assert res["sum"][2] == pytest.approx(100 * sum(vals.values()))  # over dp, then tp
        assert res["sum"][3] == vals[rank]  # no group: untouched
        assert res["sum"][4] == [-dp_sum]
        assert res["collectives"] == 2  # dp once, tp once, whatever the number of tensors
        assert res["max"][0] == [max(vals[r] for r in dp_of[rank])]
        assert res["max"][2] == pytest.approx(400.0)
        assert res["max_collectives"] == 2
        assert "avg" in res["avg_error"]
        assert res["shard_replicate"] == {
            "shard": [dp_of[rank]],
            "shard_no_partial": [dp_of[rank]],
            "partial": [],
        }
        assert res["replicate_shard"]["shard"] == [tp_of[rank]]
        assert res["partial_shard"] == {
            "shard": [tp_of[rank], dp_of[rank]],
            "shard_no_partial": [tp_of[rank]],
            "partial": [dp_of[rank]],
        }
        assert res["replicate_replicate"]["shard"] == []
        assert res["plain"] == ((), ())


def test_single_process_helpers_are_noops():
    before = dict(collective_counter)
    tensors = [torch.tensor([1.0, 2.0]), torch.tensor(3)]
    assert [t.tolist() for t in all_reduce_coalesced(tensors, "sum", tvd.world_group())] == [
        [1.0, 2.0],
        3.0,
    ]
    assert all_reduce_coalesced(tensors, "avg")[1].dtype == torch.float64
    assert all_gather_coalesced(tensors)[0].shape == (1, 2)
    assert all_gather_objects("x") == ["x"]
    assert all_reduce_by_groups([(tensors[0], ())])[0].tolist() == [1.0, 2.0]
    assert dict(collective_counter) == before
    with pytest.raises(ValueError, match="op must be one of"):
        all_reduce_coalesced(tensors, "prod")


def test_a_collective_returns_only_once_the_worker_let_go_of_its_tensors(monkeypatch):
    """gloo's worker thread drops its reference to a collective's tensors just after waking the
    caller; the caller must wait for that, so that it (holding the GIL) frees them last, not
    the worker at interpreter exit (SIGABRT "terminate called without an active exception")."""
    import threading
    import time

    t = torch.zeros(4)
    uses = t._use_count()
    worker_refs = [t.view(-1)]  # a view holds the tensor like the backend's work does
    started = threading.Event()

    def worker() -> None:
        started.set()
        time.sleep(0.05)
        worker_refs.clear()

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    tvd._let_worker_release([(t, uses)])
    assert worker_refs == []  # returned only after the other thread let go
    assert t._use_count() == uses
    thread.join()

    # bounded: a reference never let go stops the wait after the timeout (with a warning),
    # and the wait is off from then on in this process. A fake clock in the module (each sleep
    # advances it 1/64 s, exact in binary) checks the bound without asserting on wall time.
    clock = {"now": 100.0}

    def fake_sleep(seconds: float) -> None:
        clock["now"] += 1 / 64

    monkeypatch.setattr(
        tvd, "time", SimpleNamespace(monotonic=lambda: clock["now"], sleep=fake_sleep)
    )
    monkeypatch.setattr(tvd, "_RELEASE_TIMEOUT_S", 4 / 64)
    monkeypatch.setattr(tvd, "_release_wait_off", False)
    kept = t.view(-1)
    with pytest.warns(RuntimeWarning, match="no longer waiting"):
        tvd._let_worker_release([(t, uses)])
    # the timeout (4/64) waited in full, and at most a step or two of the clock more
    assert 4 / 64 <= clock["now"] - 100.0 <= 6 / 64
    assert t._use_count() > uses
    assert tvd._release_wait_off
    monkeypatch.setattr(tvd, "_RELEASE_TIMEOUT_S", 60.0)
    tvd._let_worker_release([(t, uses)])  # returns at once: off
    del kept
    monkeypatch.setattr(tvd, "_release_wait_off", False)
    # only CPU tensors are waited for (NCCL's watchdog frees its works asynchronously)
    meta = torch.zeros(4, device="meta")
    held = meta.view(-1)
    monkeypatch.setattr(tvd, "_RELEASE_TIMEOUT_S", 60.0)
    tvd._let_worker_release([(meta, meta._use_count() - 1)])
    assert held.device.type == "meta"


def _replay_body(rank: int, world_size: int) -> dict:
    """Rank 1 issues, through replay_missing, what rank 0 issues for real (recorded by rank 0
    in a first round where both issue them for real)."""
    group = tvd.world_group()
    x = torch.tensor([1.0 + rank, -2.0 - rank, 5.0])

    def issue() -> None:
        all_reduce_coalesced([x[:2], x[2:]], "sum", group)
        all_reduce_coalesced([x], "min", group)
        all_reduce_coalesced([x.int()], "max", group, dtype=None)
        all_gather_coalesced([x], group)
        all_gather_objects({"rank": rank}, group)

    with tvd.recording_collectives() as calls:
        issue()
    out: dict = {"calls": [(c.kind, c.numel, str(c.dtype), c.op) for c in calls], "raised": []}
    for i in range(len(calls)):
        if rank == 1:
            tvd.replay_missing(calls[i : i + 1])  # never raises on the replaying rank
            continue
        try:  # rank 0 issues the i-th collective for real
            [
                lambda: all_reduce_coalesced([x[:2], x[2:]], "sum", group),
                lambda: all_reduce_coalesced([x], "min", group),
                lambda: all_reduce_coalesced([x.int()], "max", group, dtype=None),
                lambda: all_gather_coalesced([x], group),
                lambda: all_gather_objects({"rank": rank}, group),
            ][i]()
        except tvd.PeerRankFailed:
            out["raised"].append(i)
    # afterwards the same collectives are plain again
    out["sum"] = all_reduce_coalesced([x], "sum", group)[0]
    out["min"] = all_reduce_coalesced([x], "min", group)[0]
    return out


def test_replay_missing_marks_every_kind_of_collective():
    """What the guard replays for a failed callback matches the recorded collectives (kind,
    size, dtype, op): the other rank gets PeerRankFailed from each (the mark survives SUM, MIN,
    MAX, an integer dtype, a gather and an object gather), and later collectives are exact."""
    rank0, rank1 = run_distributed(_replay_body, world_size=2, timeout=90)
    calls = [
        ("all_reduce", 3, "torch.float64", "sum"),
        ("all_reduce", 3, "torch.float64", "min"),
        ("all_reduce", 3, "torch.int32", "max"),
        ("all_gather", 3, "torch.float64", "sum"),
        ("all_gather_object", 0, "None", "sum"),
    ]
    assert rank0["calls"] == calls and rank1["calls"] == calls
    assert rank0["raised"] == [0, 1, 2, 3, 4] and rank1["raised"] == []
    for r in (rank0, rank1):
        assert r["sum"].tolist() == [3.0, -5.0, 10.0]
        assert r["min"].tolist() == [1.0, -3.0, 5.0]


def test_a_peer_mark_on_an_accelerator_gives_nan_instead_of_a_host_read():
    """Where reading the mark would sync the host (a device tensor), floating results are
    NaN when some member was missing, untouched otherwise; integers are left as they are."""
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    clear, marked = torch.zeros(2), torch.tensor([0.0, 1.0])
    kept = tvd._check_mark(clear, values, "all_gather", host=False)
    assert torch.equal(kept, values)
    assert torch.isnan(tvd._check_mark(marked, values, "all_gather", host=False)).all()
    ints = torch.tensor([5, 6])
    assert torch.equal(tvd._check_mark(marked, ints, "all_reduce", host=False), ints)
    with pytest.raises(tvd.PeerRankFailed):
        tvd._check_mark(marked, values, "all_gather")  # CPU flags: read, and raised


_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)


def _typed_input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Values exact in ``dtype``; the int64 ones above 2**53 (a float64 buffer rounds them)."""
    if dtype == torch.bool:
        return torch.tensor([rank == 0, rank == 1, True, False])
    if dtype == torch.int64:
        return torch.tensor([2**53 + 1 + 2 * rank, -(2**60) - rank, rank, 7])
    if dtype == torch.uint8:
        return torch.tensor([rank + 1, 3 * rank, 80 - rank, 7], dtype=dtype)
    return torch.tensor([rank + 1, -(rank + 1), 2 * rank - 1, 7], dtype=dtype)


def _edge_cases_body(rank: int, world_size: int) -> dict:
    group = tvd.world_group()
    last = rank == world_size - 1
    out: dict = {"typed": {}, "raised": {}, "errors": {}}
    # every dtype, in its own dtype (dtype=None): same dtype out, exact values
    for dt in _DTYPES:
        for op in ("sum", "max", "min"):
            got = all_reduce_coalesced([_typed_input(rank, dt)], op, group, dtype=None)[0]
            out["typed"][f"{dt}/{op}"] = (str(got.dtype), got.tolist())
    # NaN ("not measured") on the middle and the last rank under MAX/MIN, in float64 and float16
    nan = float("nan")
    x = torch.tensor([nan if rank == 0 else 1.0 + rank, nan if last else -rank, 2.0 * rank])
    for dt in (torch.float64, torch.float16):
        for op in ("max", "min"):
            out[f"nan/{dt}/{op}"] = all_reduce_coalesced([x], op, group, dtype=dt)[0].double()
    # the "missing" mark survives MIN of bool and unsigned buffers: rank 1 replays
    for dt in (torch.bool, torch.uint8, torch.int64, torch.float32):
        for op in ("min", "max", "sum"):
            ones = torch.ones(3, dtype=dt)
            with tvd.recording_collectives() as calls:
                all_reduce_coalesced([ones], op, group, dtype=dt)
            if rank == 1:
                tvd.replay_missing(calls)
                continue
            try:
                all_reduce_coalesced([ones], op, group, dtype=dt)
                out["raised"][f"{dt}/{op}"] = False
            except tvd.PeerRankFailed:
                out["raised"][f"{dt}/{op}"] = True
    # an 8-bit SUM of the marks must not wrap to 0: ranks 1 and 2 replay with a mark of 128
    # each (standing for 256 replaying ranks), rank 0 must still learn of it
    real_mark = tvd._mark
    for dt in (torch.uint8, torch.int8):
        ones = torch.ones(3, dtype=dt)
        with tvd.recording_collectives() as calls:
            all_reduce_coalesced([ones], "sum", group, dtype=dt)
        if rank > 0:
            tvd._mark = lambda device, dtype, op="sum": 128 * real_mark(device, dtype, op)
            try:
                tvd.replay_missing(calls)
            finally:
                tvd._mark = real_mark
            continue
        try:
            all_reduce_coalesced([ones], "sum", group, dtype=dt)
            out["raised"][f"wrap/{dt}"] = False
        except tvd.PeerRankFailed:
            out["raised"][f"wrap/{dt}"] = True
    # bad input: a clear error on every rank, before the collective
    before = _count()
    for key, call in {
        "avg_int": lambda: all_reduce_coalesced([torch.tensor([rank])], "avg", group, dtype=None),
        "avg_int64": lambda: all_reduce_coalesced([x], "avg", group, dtype=torch.int64),
        "mixed_none": lambda: all_reduce_coalesced(
            [torch.tensor([0.5]), torch.tensor([2**24 + 1 + 2 * rank])], "sum", group, dtype=None
        ),
        "mixed_none_gather": lambda: all_gather_coalesced(
            [torch.tensor([0.5]), torch.tensor([2**24 + 1])], group, dtype=None
        ),
    }.items():
        try:
            call()
        except ValueError as exc:
            out["errors"][key] = str(exc)
    out["bad_input_collectives"] = _count() - before
    # an object one rank cannot pickle: TypeError on every rank, not a hang (kept last: without
    # the fix the other ranks wait in this gather)
    try:
        all_gather_objects((lambda: 0) if rank == 1 else {"rank": rank}, group)
    except TypeError as exc:
        out["unpicklable"] = str(exc)
    return out


@shared.on_ranks(3, _edge_cases_body)
def test_dtypes_nan_marks_and_bad_input_on_real_ranks(ran):
    world_size = 3
    _, results = ran
    for res in results:
        for dt in _DTYPES:
            stacked = torch.stack([_typed_input(r, dt) for r in range(world_size)])
            want = {  # integers and bools as Python ints: no float rounding in the reference
                "sum": stacked.any(0) if dt == torch.bool else stacked.sum(0, dtype=dt),
                "max": stacked.amax(0),
                "min": stacked.amin(0),
            }
            for op, value in want.items():
                assert res["typed"][f"{dt}/{op}"] == (str(dt), value.tolist()), (dt, op)
        nan = float("nan")
        ranks = [
            torch.tensor(
                [nan if r == 0 else 1.0 + r, nan if r == world_size - 1 else -r, 2.0 * r],
                dtype=torch.float64,
            )
            for r in range(world_size)
        ]
        for dt in (torch.float64, torch.float16):
            stacked = torch.stack(ranks)  # torch.amax/amin propagate NaN from any row
            for op, want in (("max", stacked.amax(0)), ("min", stacked.amin(0))):
                got = torch.as_tensor(res[f"nan/{dt}/{op}"])
                torch.testing.assert_close(got, want, equal_nan=True)
    for key, raised in results[0]["raised"].items():
        assert raised, key  # rank 0 learns that rank 1 replayed
    assert results[1]["raised"] == {}
    for res in results:
        assert set(res["errors"]) == {"avg_int", "avg_int64", "mixed_none", "mixed_none_gather"}
        assert "floating dtype" in res["errors"]["avg_int"]
        assert "one dtype" in res["errors"]["mixed_none"]
        assert res["bad_input_collectives"] == 0
        assert "rank 1" in res["unpicklable"] and "pickle" in res["unpicklable"]
