"""Audit of the coalesced collectives and ProcessGroups (session 20, hK).

* ``all_reduce_coalesced`` with a 1-byte (or unsigned MIN) ``dtype`` cast the inputs straight
  to its int64 wire buffer instead of to ``dtype``: a float 0.5 asked for as bool read False,
  int8 MAX picked 200 (which is -56 in int8) over 5, and bool SUM of -1 and 1 read False.
* A group that ``dist.new_group`` made without this rank (its size reads -1) gave torch's
  "Invalid process group specified" from the collectives, and ``ProcessGroups(dp=G)`` blamed
  ``cp`` with the members' ranks; both now name the problem, before any collective.

Expected values come from torch's own casts and reductions of the stacked inputs.
"""

from __future__ import annotations

import torch

from tests.helpers.shared_ranks import SharedRanks
from trainvitals import distributed as tvd

# one set of gloo processes per world size runs every case of this file
# (tests/helpers/shared_ranks.py)
shared = SharedRanks(__name__)
case_runs, ran = shared.fixtures()

# (inputs by rank, op, buffer dtype): inputs not of the buffer's dtype
_CAST_CASES = {
    "bool_sum": ([torch.tensor([-1, 0, 3]), torch.tensor([1, 0, -3])], "sum", torch.bool),
    "bool_max_float": ([torch.tensor([0.5, 0.0]), torch.tensor([0.0, 0.0])], "max", torch.bool),
    "int8_max": ([torch.tensor([200, -3]), torch.tensor([5, -4])], "max", torch.int8),
    "int8_min": ([torch.tensor([200, 130]), torch.tensor([5, 1])], "min", torch.int8),
    "uint8_min": ([torch.tensor([-1, 300]), torch.tensor([7, 2])], "min", torch.uint8),
}


def _cast_body(rank: int, world_size: int) -> dict:
    group = tvd.world_group()
    return {
        key: tvd.all_reduce_coalesced([inputs[rank]], op, group, dtype=dtype)[0].tolist()
        for key, (inputs, op, dtype) in _CAST_CASES.items()
    }


@shared.on_ranks(2, _cast_body)
def test_narrow_dtypes_reduce_the_values_cast_to_that_dtype(ran):
    _, results = ran
    for key, (inputs, op, dtype) in _CAST_CASES.items():
        stacked = torch.stack([t.to(dtype) for t in inputs])
        if op == "sum":  # a bool sum is a logical or (torch.distributed's SUM of bools)
            want = stacked.any(0) if dtype == torch.bool else stacked.sum(0, dtype=dtype)
        else:
            want = stacked.amax(0) if op == "max" else stacked.amin(0)
        for res in results:
            assert res[key] == want.tolist(), key


def _non_member_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    only_0 = dist.new_group([0])  # rank 1 is not a member: new_group gives it a placeholder
    out: dict = {"errors": {}}
    before = sum(tvd.collective_counter.values())
    calls = {
        "all_reduce": lambda: tvd.all_reduce_coalesced([torch.tensor([1.0])], "avg", only_0),
        "all_gather": lambda: tvd.all_gather_coalesced([torch.tensor([1.0])], only_0),
        "objects": lambda: tvd.all_gather_objects(rank, only_0),
        "groups": lambda: tvd.ProcessGroups(dp=only_0).sizes(),
    }
    for key, call in calls.items():
        try:
            out[key] = call()
        except ValueError as exc:
            out["errors"][key] = str(exc)
    out["collectives"] = sum(tvd.collective_counter.values()) - before
    # the world still pairs up: no rank issued a collective above
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out["after"] = t.item()
    return out


@shared.on_ranks(2, _non_member_body)
def test_a_group_without_this_rank_is_refused_by_name(ran):
    _, results = ran
    member, outsider = results
    assert member["errors"] == {}  # rank 0's own one-rank group: its values
    assert member["all_reduce"][0].tolist() == [1.0]
    assert member["objects"] == [0]
    assert member["groups"]["dp"] == 1
    errors = outsider["errors"]
    assert set(errors) == {"all_reduce", "all_gather", "objects", "groups"}
    for key in ("all_reduce", "all_gather", "objects"):
        assert "rank 1 is not a member" in errors[key], errors[key]
    # (named cp and the members' ranks [0] before)
    assert errors["groups"].startswith("ProcessGroups: dp is a group that rank 1 is not a member")
    assert member["collectives"] == outsider["collectives"] == 0
    assert member["after"] == outsider["after"] == 3.0
