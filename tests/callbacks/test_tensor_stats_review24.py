"""TensorStatsMonitor, review of session 24.

Several backward passes through one forward (a loss per head, each ``backward(retain_graph=
True)``; a gradient penalty's ``torch.autograd.grad(..., create_graph=True)`` before
``backward``): a site's gradient hook was called once per pass and every call was folded in as
new elements, so ``count`` doubled and the line held the pieces side by side, not the gradient
of the total loss (multi-task ``2/output0``: kurtosis 1.95 where float64 says 4.64). Such a
site's dgrad is now left out of the step, on every rank, with one warning per run; the sites one
pass reaches, and the other kinds, stay exact against float64.

``layer_pattern`` capturing something that is not a layer number wrote no per-layer summary,
silently: now warned once.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.callbacks.test_tensor_stats_monitor import check_line, read_lines
from tests.helpers.shared_ranks import CASE_DIR, SharedRanks
from tests.scripts.vitals_testing import NullWriter
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from tests.stats.test_moments import reference
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor

SEVERAL = "several backward passes"

ranks = SharedRanks(__name__)
case_runs, ran = ranks.fixtures()


class MultiTask(nn.Module):
    """A trunk both losses reach, and two heads each reached by one loss; ``shared`` is called
    twice in one forward (on two different tensors) inside head a."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 16)
        self.proj_a = nn.Linear(16, 16)
        self.shared = nn.Linear(16, 16)
        self.out_a = nn.Linear(16, 2)
        self.head_b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tanh(self.trunk(x))
        s = self.shared(torch.tanh(self.shared(torch.tanh(self.proj_a(t)))))
        return self.out_a(s), self.head_b(t)


def _task_losses(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a.pow(2).mean() + a[:, 0].mean(), (b - 1).abs().mean() + b.pow(3).mean()


# trunk/input0 is the data (no gradient); these are reached by both losses' passes
TASK_BOTH = {"trunk/output0", "proj_a/input0", "head_b/input0"}
TASK_ONE = {
    "proj_a/output0",
    "shared/input0",
    "shared/output0",
    "out_a/input0",
    "out_a/output0",
    "head_b/output0",
}


class Critic(nn.Module):
    """WGAN-GP / R1 style: the penalty's ``autograd.grad`` of the score reaches enc and critic
    (and ``t``, head's input); head's output is reached by the loss's pass only."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 16)
        self.critic = nn.Linear(16, 1)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tanh(self.enc(x))
        return self.critic(t), self.head(t)


def _penalty_loss(x: torch.Tensor, score: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    (gx,) = torch.autograd.grad(score.sum(), x, create_graph=True)
    return score.pow(2).mean() + aux.pow(2).mean() + 10 * (gx.norm(dim=1) - 1).pow(2).mean()


def _float64(model: nn.Module, x: torch.Tensor, total_loss) -> dict[str, dict[str, torch.Tensor]]:
    """float64 truth on a twin of ``model``: every site's activations (all calls), the gradient
    of the total loss with respect to every site tensor (one ``autograd.grad``: one value per
    element), the parameters and their gradients."""
    twin = copy.deepcopy(model).double()
    seen: dict[str, list[torch.Tensor]] = {}

    def capture(name: str):
        def hook(module, args, output):
            for suffix, t in (("input0", args[0]), ("output0", output)):
                seen.setdefault(f"{name}/{suffix}", []).append(t)

        return hook

    for name, m in twin.named_children():
        m.register_forward_hook(capture(name))
    x = x.double().requires_grad_(x.requires_grad)
    total = total_loss(x, *twin(x))
    sites = [(s, t) for s, ts in seen.items() for t in ts if t.requires_grad]
    grads = torch.autograd.grad(total, [t for _, t in sites], retain_graph=True)
    dgrad: dict[str, list[torch.Tensor]] = {}
    for (s, _), g in zip(sites, grads, strict=True):
        dgrad.setdefault(s, []).append(g.reshape(-1))
    total.backward()
    flat = {s: torch.cat([t.detach().reshape(-1) for t in ts]) for s, ts in seen.items()}
    return {
        "activation": flat,
        "dgrad": {s: torch.cat(v) for s, v in dgrad.items()},
        "param": {n: p.detach().clone() for n, p in twin.named_parameters()},
        "grad": {n: p.grad.clone() for n, p in twin.named_parameters()},
    }


def _batch(i: int, rows: int = 8) -> torch.Tensor:
    return torch.randn(rows, 6, generator=torch.Generator().manual_seed(10 + i))


def _several_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if SEVERAL in str(w.message)]


def test_multitask_retain_graph_leaves_the_shared_sites_dgrad_out(tmp_path: Path) -> None:
    """Steps 0 and 2: two losses, each ``backward(retain_graph=True)``; step 1: their sum, one
    ``backward()``. The sites both passes reach have no dgrad at steps 0 and 2 (they had count
    doubled and the pieces' statistics); the sites one pass reaches (``shared``, called twice,
    included) and every other kind equal float64 at every step; step 1 records every site."""
    torch.manual_seed(0)
    model = MultiTask()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = TensorStatsMonitor(kernel="eager")
    truth = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([monitor], writer=writer, run_dir=tmp_path, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            for step in range(3):
                x = _batch(step)
                truth.append(_float64(model, x, lambda _x, a, b: sum(_task_losses(a, b))))
                vitals.batch(x)
                loss_a, loss_b = _task_losses(*model(x))
                if step == 1:
                    (loss_a + loss_b).backward()
                else:
                    loss_a.backward(retain_graph=True)
                    loss_b.backward()
                opt.step()
                opt.zero_grad()
    lines = {(r["step"], r["kind"]): r for r in read_lines(tmp_path / "tensor_stats.jsonl")}
    assert set(lines) == {
        (s, k) for s in range(3) for k in ("param", "grad", "activation", "dgrad")
    }
    for step, want in enumerate(truth):
        dgrad = want["dgrad"]
        assert set(dgrad) == TASK_BOTH | TASK_ONE
        if step != 1:
            dgrad = {s: v for s, v in dgrad.items() if s in TASK_ONE}
            # the scalar summaries are of the kept sites only
            rms_max = max(reference(v)["rms"] for v in dgrad.values())
            assert writer.rows[step]["tensor_stats/dgrad/rms_max"] == pytest.approx(rms_max, 1e-4)
        check_line(lines[(step, "dgrad")], dgrad, f"step {step} dgrad")
        for kind in ("param", "grad", "activation"):
            check_line(lines[(step, kind)], want[kind], f"step {step} {kind}")
    (message,) = _several_warnings(caught)  # once per run, though two steps dropped
    assert "trunk/output0" in message and "retain_graph" in message
    assert "autograd.grad" in message and "total loss is not available" in message


def test_gradient_penalty_leaves_the_penalised_sites_dgrad_out(tmp_path: Path) -> None:
    """``torch.autograd.grad(score.sum(), x, create_graph=True)`` then ``loss.backward()``: the
    penalty's pass delivered d(score.sum())/d(site), no gradient of the loss, beside the loss's
    (critic/output0: mean 0.487 for 0.974, count doubled). Only head/output0, which the
    penalty's pass does not reach, keeps its dgrad; the other kinds equal float64."""
    torch.manual_seed(0)
    model = Critic()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kernel="eager")
    x = _batch(0).requires_grad_()
    want = _float64(model, x, _penalty_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([monitor], writer=NullWriter(), run_dir=tmp_path) as vitals:
            vitals.attach(model, opt)
            vitals.batch(x)
            _penalty_loss(x, *model(x)).backward()
            opt.step()
    lines = {r["kind"]: r for r in read_lines(tmp_path / "tensor_stats.jsonl")}
    assert set(want["dgrad"]) == {
        f"{m}/{s}" for m in ("enc", "critic", "head") for s in ("input0", "output0")
    }
    check_line(lines["dgrad"], {"head/output0": want["dgrad"]["head/output0"]}, "dgrad")
    for kind in ("param", "grad", "activation"):
        check_line(lines[kind], want[kind], kind)
    (message,) = _several_warnings(caught)
    assert "enc/output0" in message and "(5 in all)" in message


class Checkpointed(nn.Module):
    """A checkpointed block both losses reach, then a head per loss."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.plain = False  # the float64 twin runs the block plainly
        self.b1 = nn.Linear(6, 16)
        self.b2 = nn.Linear(16, 16)
        self.head_a = nn.Linear(16, 2)
        self.head_b = nn.Linear(16, 3)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b2(torch.tanh(self.b1(x))))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        plain = self.plain
        t = self.block(x) if plain else checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head_a(t), self.head_b(t)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_block_under_two_backward_passes(tmp_path: Path, reentrant: bool) -> None:
    """Under a reentrant checkpoint the second pass re-runs the block again, where no hook was
    wanted: b1/b2 held the first pass's piece alone (a wrong value, count right); under a
    non-reentrant one the hooks were called twice. Both: left out; the heads' outputs kept."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _batch(0).requires_grad_()  # (a reentrant checkpoint needs an input that needs it)
    twin = copy.deepcopy(model)
    twin.plain = True
    want = _float64(twin, x, lambda _x, a, b: sum(_task_losses(a, b)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals(
            [TensorStatsMonitor(kernel="eager", kinds="dgrad")],
            writer=NullWriter(),
            run_dir=tmp_path,
        ) as vitals:
            vitals.attach(model, opt)
            vitals.batch(x)
            loss_a, loss_b = _task_losses(*model(x))
            loss_a.backward(retain_graph=True)
            loss_b.backward()
            opt.step()
    (line,) = read_lines(tmp_path / "tensor_stats.jsonl")
    kept = {"head_a/output0", "head_b/output0"}
    check_line(line, {s: want["dgrad"][s] for s in kept}, f"reentrant={reentrant}")
    (message,) = _several_warnings(caught)
    assert "b1/output0" in message


# ------------------------------------------------------------------------- several ranks


def _dp_body(rank: int, world_size: int, run_dir: str) -> dict:
    from trainvitals.distributed import ProcessGroups, world_group

    torch.manual_seed(0)
    model = MultiTask()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals(
            [TensorStatsMonitor(kernel="eager", kinds=["activation", "dgrad"])],
            writer=NullWriter(),
            run_dir=run_dir,
            groups=ProcessGroups(dp=world_group()),
        ) as vitals:
            vitals.attach(model, opt)
            x = _batch(rank)
            vitals.batch(x)
            loss_a, loss_b = _task_losses(*model(x))
            if rank == 1:  # this rank alone makes two passes
                loss_a.backward(retain_graph=True)
                loss_b.backward()
            else:
                (loss_a + loss_b).backward()
            opt.step()
    return {"warned": len(_several_warnings(caught))}


@ranks.on_ranks(2, _dp_body, CASE_DIR)
def test_a_site_one_rank_drops_is_missing_after_the_merge(ran) -> None:
    """Data parallel over 2 ranks, rank 1 alone with two passes: the sites both its passes
    reach are missing from the file (rank 0's part alone would be a wrong number; before, the
    merge counted rank 1's elements twice), no rank waits, and the rest is merged over both
    ranks' data exactly."""
    run_dir, results = ran
    lines = {r["kind"]: r for r in read_lines(run_dir / "tensor_stats.jsonl")}
    torch.manual_seed(0)
    model = MultiTask()
    truth = [_float64(model, _batch(r), lambda _x, a, b: sum(_task_losses(a, b))) for r in (0, 1)]
    for kind, sites in (("activation", set(truth[0]["activation"])), ("dgrad", TASK_ONE)):
        want = {s: torch.cat([t[kind][s] for t in truth]) for s in sites}
        check_line(lines[kind], want, kind)
    assert [res["warned"] for res in results] == [0, 1]


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.down(torch.relu(self.up(x))),)


def _tp_losses(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (y**2).sum(), y[:, 0].sum()


def _tp_x(step: int) -> torch.Tensor:
    # (needing a gradient: up/input0's dgrad is then the Partial one)
    x = 1 + torch.randn(6, 8, generator=torch.Generator().manual_seed(50 + step))
    return x.requires_grad_()


def _tp_body(rank: int, world_size: int, run_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from trainvitals.distributed import ProcessGroups, collective_counter

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = TPNet()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Vitals(
        [TensorStatsMonitor(kernel="eager")],
        writer=NullWriter(),
        run_dir=run_dir,
        log_every_n_steps=1,
        groups=ProcessGroups.from_device_mesh(mesh),
    ) as vitals:
        vitals.attach(model, opt)
        reduces = []  # the monitor's all_reduces in each step's backward passes
        for step in range(2):
            x = _tp_x(step)  # the same on both tensor-parallel ranks
            vitals.batch(x)
            first, second = _tp_losses(*model(x))
            before = collective_counter["all_reduce"]
            if step == 0:
                first.backward(retain_graph=True)
                second.backward()
            else:
                (first + second).backward()
            reduces.append(collective_counter["all_reduce"] - before)
            opt.step()
            opt.zero_grad()
    return {"reduces": reduces}


@ranks.on_ranks(2, _tp_body, CASE_DIR)
def test_tensor_parallel_partial_dgrad_under_two_passes(ran) -> None:
    """Tensor parallel over 2 ranks: up/input0's dgrad is Partial, summed over the group in
    its gradient hook (a collective). Two passes at step 0: every site's dgrad left out, each
    rank still reaching that collective at both calls (no hang), param/grad/activation exact;
    step 1, one pass: every dgrad exact (the ranks still in step)."""
    run_dir, results = ran
    # the Partial sum at each call of the hook, on both ranks alike
    assert [res["reduces"] for res in results] == [[2, 1], [2, 1]]
    lines = {(r["step"], r["kind"]): r for r in read_lines(run_dir / "tensor_stats.jsonl")}
    torch.manual_seed(0)
    model = TPNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        want = _float64(model, _tp_x(step), lambda _x, y: sum(_tp_losses(y)))
        assert set(want["dgrad"]) == {f"{m}/{s}" for m in ("up", "down") for s in _SUFFIXES}
        check_line(lines[(step, "dgrad")], {} if step == 0 else want["dgrad"], f"{step} dgrad")
        for kind in ("param", "grad", "activation"):
            check_line(lines[(step, kind)], want[kind], f"{step} {kind}")
        # the float32 model steps as the ranks' did
        sum(_tp_losses(*model(_tp_x(step)))).backward()
        opt.step()
        opt.zero_grad()


_SUFFIXES = ("input0", "output0")


# ------------------------------------------------------------------------- layer_pattern


class Layered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encoder(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize(
    ("pattern", "numbers", "example"),
    [
        (r"layers\.(\d+)\.", True, None),
        (r"^(encoder|decoder)", False, "'encoder'"),  # matches, captures a word
        (r"(?:layers\.(\d+)|encoder)", True, "None"),  # the group takes no part for encoder
    ],
)
def test_layer_pattern_capturing_no_number_warns_once(
    tmp_path: Path, pattern: str, numbers: bool, example: str | None
) -> None:
    """Per-layer keys are layer numbers (DESIGN.md): a pattern capturing something else wrote
    no per-layer summary for those names, silently (and a group taking no part raised). Now:
    one warning per run naming an example; layer numbers still give exact layer keys."""
    torch.manual_seed(0)
    model = Layered()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    monitor = TensorStatsMonitor(kernel="eager", kinds=["param", "grad"], layer_pattern=pattern)
    truth: list[dict[str, dict[str, torch.Tensor]]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([monitor], writer=writer, run_dir=tmp_path, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            for step in range(2):
                x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
                vitals.batch(x)
                model(x).pow(2).sum().backward()
                truth.append(
                    {
                        "param": {n: p.detach().double() for n, p in model.named_parameters()},
                        "grad": {n: p.grad.double() for n, p in model.named_parameters()},
                    }
                )
                opt.step()
                opt.zero_grad()
    warned = [str(w.message) for w in caught if "not a layer number" in str(w.message)]
    if example is None:
        assert warned == []
    else:
        (message,) = warned  # two steps, two kinds: once
        assert "'encoder.weight'" in message or "'encoder.bias'" in message
        assert f"captures {example}" in message
    for step, want in enumerate(truth):
        keys = {k for k in writer.rows[step] if "/layer_" in k}
        expected = (
            {
                f"tensor_stats/{k}/layer_{i}/{s}"
                for k in want
                for i in range(3)
                for s in ("rms", "kurtosis")
            }
            if numbers
            else set()
        )
        assert keys == expected
        for kind, tensors in want.items():
            for i in range(3) if numbers else ():
                merged = torch.cat(
                    [tensors[f"layers.{i}.{p}"].reshape(-1) for p in ("weight", "bias")]
                )
                ref = reference(merged)
                for stat in ("rms", "kurtosis"):
                    got = writer.rows[step][f"tensor_stats/{kind}/layer_{i}/{stat}"]
                    assert got == pytest.approx(ref[stat], rel=1e-4), (step, kind, i, stat)
