"""TensorStatsMonitor counts every distinct piece of an activation or dgrad once, also when the
tensor-parallel mesh dim lies inside ``groups.dp_cp``.

Under Megatron-style sequence parallelism over the tensor-parallel ranks the mesh dim is named
``sp`` (docs/load_balance.md), so ``ProcessGroups.from_device_mesh`` puts it in ``cp`` and
``dp_cp`` holds its ranks. A site replicated over that dim (the ``Replicate`` input of a
column-parallel ``Linear``, a row-parallel output reduced to a replica, a ``Partial`` dgrad
summed over the dim) was counted once per rank of it, and a site sharded over it was merged over
its shard group and then again over ``dp_cp``. Real gloo processes; every statistic of every
site must equal the float64 statistic of the full tensors, computed in one process by the same
seeded model, unsharded, fed every data-parallel rank's batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed
from tests.scripts.vitals_testing import NullWriter
from tests.stats.test_moments import assert_matches, reference
from trainvitals.stats.moments import FIELDS, derive, moments_from_dicts

pytestmark = pytest.mark.slow

B, S, D, F = 2, 4, 8, 16  # batch, sequence (split over the sp ranks), model and hidden width
SITES = ("up1", "down1", "up2", "down2")


class SPNet(nn.Module):
    """Two tensor-parallel MLPs: the first takes the whole (replicated) sequence and hands out
    sequence shards (``RowwiseParallel(output_layouts=Shard(1))``), the norm runs on them
    (``SequenceParallel``), the second gathers the sequence and ends replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.up1 = nn.Linear(D, F)
        self.down1 = nn.Linear(F, D)
        self.norm = nn.LayerNorm(D)
        self.up2 = nn.Linear(D, F)
        self.down2 = nn.Linear(F, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down1(torch.relu(self.up1(x)))
        return self.down2(torch.relu(self.up2(self.norm(h))))


def _batch(dp_rank: int) -> torch.Tensor:
    """Different on every data-parallel rank, the same on the ranks of one sp/tp group."""
    return 3 + torch.randn(B, S, D, generator=torch.Generator().manual_seed(500 + dp_rank))


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y**2).sum() + y[..., 0].sum()


def _body(rank: int, world_size: int, run_dir: str, dims: tuple[str, ...], grad: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import TensorStatsMonitor
    from trainvitals.distributed import ProcessGroups, collective_counter

    shape = (2,) * len(dims)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    tp_mesh = mesh[dims[-1]] if len(dims) > 1 else mesh
    torch.manual_seed(0)
    model = SPNet()
    parallelize_module(
        model,
        tp_mesh,
        {
            "up1": ColwiseParallel(),
            "down1": RowwiseParallel(output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "up2": ColwiseParallel(input_layouts=Shard(1)),
            "down2": RowwiseParallel(),
        },
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dp_rank = mesh.get_local_rank("dp") if "dp" in dims else 0
    groups = ProcessGroups.from_device_mesh(mesh)
    with Vitals(
        [TensorStatsMonitor(kinds=_kinds(grad), kernel="eager")],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=groups,
    ) as vitals:
        vitals.attach(model, opt)
        x = _batch(dp_rank).requires_grad_(grad)
        vitals.batch(x)
        if grad:
            _loss(model(x)).backward()
        else:  # no autograd node behind to_local(): the layout is told by the shapes
            with torch.no_grad():
                model(x)
        before = dict(collective_counter)
        opt.step()
        counts = {k: v - before.get(k, 0) for k, v in collective_counter.items()}
    return {"counts": counts}


def _float64(dp_ranks: int) -> dict[str, dict[str, torch.Tensor]]:
    """One process, float64, unsharded: every dp rank's batch through the seeded model; the loss
    is the sum of the ranks' losses, so each batch's activations get their own dgrads."""
    torch.manual_seed(0)
    model = SPNet().double()
    out: dict[str, dict[str, list[torch.Tensor]]] = {"activation": {}, "dgrad": {}}

    def keep(kind: str, site: str, t: torch.Tensor) -> None:
        out[kind].setdefault(site, []).append(t.detach().reshape(-1).clone())

    def hook(name: str):
        def fn(module, args, output):
            for suffix, t in (("input0", args[0]), ("output0", output)):
                keep("activation", f"{name}/{suffix}", t)
                t.register_hook(lambda g, s=f"{name}/{suffix}": keep("dgrad", s, g))

        return fn

    for name in SITES:
        getattr(model, name).register_forward_hook(hook(name))
    total = sum(_loss(model(_batch(r).double().requires_grad_())) for r in range(dp_ranks))
    total.backward()
    return {k: {s: torch.cat(v) for s, v in d.items()} for k, d in out.items()}


def _kinds(grad: bool) -> list[str]:
    return ["activation", "dgrad"] if grad else ["activation"]


def _check(run_dir: Path, dp_ranks: int, kinds: list[str]) -> None:
    want = {k: v for k, v in _float64(dp_ranks).items() if k in kinds}
    assert_every_site_matches(run_dir, want)


def read_lines(run_dir: Path) -> dict[str, dict]:
    """The run's tensor_stats.jsonl lines by kind (one logged step)."""
    return {
        r["kind"]: r
        for r in map(json.loads, (run_dir / "tensor_stats.jsonl").read_text().splitlines())
    }


def assert_every_site_matches(run_dir: Path, want: dict[str, dict[str, torch.Tensor]]) -> None:
    """Every site of every kind in ``want`` (its float64 elements) is in the file, with its
    count first (a site counted twice shows as 2x the elements), then every statistic."""
    lines = read_lines(run_dir)
    assert sorted(lines) == sorted(want)
    got = {}
    for kind, sites in want.items():
        tensors = lines[kind]["tensors"]
        assert set(tensors) == set(sites), (kind, sorted(tensors), sorted(sites))
        names = sorted(sites)
        rows = [dict(zip(FIELDS, tensors[n], strict=True)) for n in names]
        got[kind] = (names, derive(moments_from_dicts(rows)))
    counts = {
        f"{kind}/{n}": int(d["count"][i])
        for kind, (names, d) in got.items()
        for i, n in enumerate(names)
    }
    expected = {f"{kind}/{n}": t.numel() for kind, sites in want.items() for n, t in sites.items()}
    assert counts == expected, f"counts {counts}, float64 has {expected}"
    for kind, (names, d) in got.items():
        for i, n in enumerate(names):
            assert_matches(d, i, reference(want[kind][n]), f"{kind}/{n}")


CASES = {  # test id -> (mesh dims, whether the loss is backpropagated)
    "sp_2_ranks": (("sp",), True),
    "dp_x_sp_4_ranks": (("dp", "sp"), True),
    "dp_x_sp_4_ranks_no_grad": (("dp", "sp"), False),
    "dp_x_tp_4_ranks": (("dp", "tp"), True),
}


def _bodies(rank: int, world_size: int, root: str, cases: list[str]) -> dict:
    """``_body`` of each case in turn, each with a run folder of its own (``root/<case>``), on
    the same processes: starting them costs more than a case's step."""
    out = {}
    for case in cases:
        dims, grad = CASES[case]
        try:
            out[case] = _body(rank, world_size, str(Path(root) / case), dims, grad)
        except Exception as e:
            raise RuntimeError(f"case {case!r} failed") from e
    return out


@pytest.fixture(scope="module")
def case_runs(request, tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """The run folders' root and each selected case's results by rank: one
    ``run_distributed`` per world size, running its cases in turn."""
    selected = {
        item.callspec.params["case"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and "case" in getattr(getattr(item, "callspec", None), "params", {})
    }
    root = tmp_path_factory.mktemp("replicas")
    by_world: dict[int, list[str]] = {}
    for case, (dims, _) in CASES.items():
        if case in selected:
            (root / case).mkdir()
            by_world.setdefault(2 ** len(dims), []).append(case)
    results = {}
    for world, cases in by_world.items():
        ranks = run_distributed(_bodies, world_size=world, args=(str(root), cases), timeout=240)
        results |= {case: [r[case] for r in ranks] for case in cases}
    return root, results


@pytest.mark.parametrize("case", list(CASES))
def test_replicas_and_shards_count_once(case_runs, case: str) -> None:
    """``sp``: dp_cp holds the sequence/tensor-parallel ranks, so replicas over them count once
    (the canonical rank's copy) and shards over them are merged over dp_cp alone. ``tp`` (outside
    dp_cp): replicas are not merged, shards merged over tp, then over dp. Under ``no_grad`` the
    reduced row-parallel outputs are told apart by their shapes: the all-reduced one is a replica
    over sp, the reduce-scattered one a shard."""
    dims, grad = CASES[case]
    root, runs = case_runs
    results = runs[case]
    _check(root / case, 2 if "dp" in dims else 1, _kinds(grad))
    for res in results:
        # one all_gather per distinct merge group: dp_cp only under sp (its shard groups lie
        # inside it), dp and tp under tp; no other collective at step end
        assert res["counts"].get("all_gather", 0) == (2 if "tp" in dims else 1), res["counts"]
        assert res["counts"].get("all_reduce", 0) == 0, res["counts"]
