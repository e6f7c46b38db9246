"""TensorStatsMonitor in one process: driver and Lightning, values vs. float64 on captured data."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.scripts.vitals_testing import RecordingWriter as Recorder
from tests.scripts.vitals_testing import quiet_trainer
from tests.stats.test_moments import assert_matches, reference
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor
from trainvitals.stats.moments import FIELDS, derive, moments_from_dicts

VOCAB, D, H = 256, 48, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.gate = nn.Linear(D, H)  # shares fc1's input: one reduction, two sites
        self.act = nn.ReLU(inplace=True)  # in place on a Linear output: hooks must cope
        self.fc2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.fc2(self.act(self.fc1(h)) * torch.sigmoid(self.gate(h)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)  # 12288-element weight: the chunked kernel path

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


SITE_MODULES = ["emb", "head"] + [
    f"layers.{i}.{m}" for i in range(2) for m in ("fc1", "gate", "fc2")
]


def batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # 4 x 48 tokens: fc1 output has 12288 elements (chunked path with a tail)
    return [torch.randint(0, VOCAB, (4, 48), generator=g) for _ in range(n)]


class Capture:
    """The test's own hooks: every site tensor and its gradient, on chosen steps."""

    def __init__(self, model: nn.Module) -> None:
        self.on = False
        self.data: dict[tuple[str, str], list[torch.Tensor]] = {}
        for name in SITE_MODULES:
            model.get_submodule(name).register_forward_hook(self._hook(name))

    def _keep(self, kind: str, site: str, t: torch.Tensor) -> None:
        self.data.setdefault((kind, site), []).append(t.detach().double().clone().reshape(-1))

    def _hook(self, name: str):
        def hook(module, args, output):
            if not self.on:
                return
            for suffix, t in (("input0", args[0]), ("output0", output)):
                if not t.is_floating_point():
                    continue
                site = f"{name}/{suffix}"
                self._keep("activation", site, t)
                if t.requires_grad:
                    # fc1's output is a view (of F.linear's 2-D result) that ReLU(inplace=True)
                    # changes: a hook on it never fires; its base has the same gradient (see
                    # test_tensor_stats_inplace_dgrad.py, which checks that against a twin)
                    on = t._base if suffix == "output0" and t._is_view() else t
                    on.register_hook(lambda g, site=site: self._keep("dgrad", site, g))

        return hook

    def whole(self, kind: str, site: str) -> torch.Tensor:
        return torch.cat(self.data[(kind, site)])


_nothing = contextlib.nullcontext


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_line(line: dict, want: dict[str, torch.Tensor], what: str) -> None:
    assert line["version"] == 1 and line["fields"] == list(FIELDS)
    assert set(line["tensors"]) == set(want), (what, sorted(line["tensors"]), sorted(want))
    names = sorted(want)
    got = derive(
        moments_from_dicts([dict(zip(FIELDS, line["tensors"][n], strict=True)) for n in names])
    )
    for i, n in enumerate(names):
        assert_matches(got, i, reference(want[n]), f"{what}/{n}")


def run_loop(
    tmp: Path,
    steps: int,
    accumulate: int,
    monitor: TensorStatsMonitor,
    capture_step: int,
    loss_scale: float = 1.0,
):
    torch.manual_seed(0)
    model = Net()
    cap = Capture(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = Recorder()
    ref_params: dict[str, torch.Tensor] = {}
    ref_grads: dict[str, torch.Tensor] = {}
    hook_counts = []
    base = sum(len(m._forward_hooks) for m in model.modules())
    with Vitals([monitor], writer=writer, run_dir=tmp, log_every_n_steps=2) as vitals:
        vitals.attach(model, opt)
        data = iter(batches(steps * accumulate))
        for step in range(steps):
            cap.on = step == capture_step
            for _ in range(accumulate):
                ids = next(data)
                vitals.batch(ids)
                hook_counts.append(
                    (step, sum(len(m._forward_hooks) for m in model.modules()) - base)
                )
                logits = model(ids)
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))
                (loss * loss_scale / accumulate).backward()
            if step == capture_step:
                for n, p in model.named_parameters():
                    ref_params[n] = p.detach().double().clone()
                    ref_grads[n] = p.grad.detach().double().clone()
            opt.step()
            opt.zero_grad()
            hook_counts.append((step, sum(len(m._forward_hooks) for m in model.modules()) - base))
    return model, cap, writer, ref_params, ref_grads, hook_counts


class CheckpointedNet(nn.Module):
    """Blocks run under torch.utils.checkpoint (``reentrant`` True/False) or plainly (None)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)) for _ in range(2)]
        )
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for block in self.blocks:
            if self.reentrant is None:
                h = h + block(h)
            else:
                h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        return h


@pytest.mark.parametrize(
    ("reentrant", "no_grad_between"), [(False, False), (True, False), (False, True)]
)
def test_activation_checkpointing_gives_every_site_once(
    tmp_path: Path, reentrant: bool, no_grad_between: bool
) -> None:
    # Non-reentrant: the re-run in backward must not count again. Reentrant: the first run has
    # autograd off (no dgrad there); the gradient hooks go on the re-run's tensors instead. A
    # training-mode no_grad forward between a forward and its backward (generation) is not
    # part of the step: measured neither as activations nor as a first run to re-run. (Under
    # a reentrant checkpoint it cannot be told from the first run: a documented limit.)
    import copy

    torch.manual_seed(0)
    plain = CheckpointedNet(None)
    model = copy.deepcopy(plain)
    model.reentrant = reentrant
    sites = ["inp"] + [f"blocks.{i}.{j}" for i in range(2) for j in (0, 2)]
    want: dict[tuple[str, str], list[torch.Tensor]] = {}

    def keep(kind: str, site: str, t: torch.Tensor) -> None:
        want.setdefault((kind, site), []).append(t.detach().double().reshape(-1).clone())

    def capture(name: str):
        def hook(module, args, output):
            for suffix, t in (("input0", args[0]), ("output0", output)):
                keep("activation", f"{name}/{suffix}", t)
                if t.requires_grad:  # (not the model's input)
                    t.register_hook(lambda g, s=f"{name}/{suffix}": keep("dgrad", s, g))

        return hook

    for name in sites:
        plain.get_submodule(name).register_forward_hook(capture(name))
    xs = [torch.randn(3, 5, D, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for x in xs:  # the reference: plain forwards of the same weights and inputs
        plain(x).pow(2).mean().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kinds=("activation", "dgrad"), kernel="eager")
    with Vitals([monitor], writer=Recorder(), run_dir=tmp_path) as vitals:
        vitals.attach(model, opt)
        for x in xs:  # one step of two micro-batches
            vitals.batch(x)
            out = model(x)
            if no_grad_between:
                with torch.no_grad():
                    model(torch.randn(3, 5, D))
            out.pow(2).mean().backward()
        opt.step()
    lines = {r["kind"]: r for r in read_lines(tmp_path / "tensor_stats.jsonl")}
    for kind in ("activation", "dgrad"):
        expected = {s: torch.cat(v) for (k, s), v in want.items() if k == kind}
        assert len(expected) == 2 * len(sites) - (kind == "dgrad")  # every site (not inp/input0)
        check_line(lines[kind], expected, f"{kind}, reentrant={reentrant}")


def test_driver_all_kinds_match_float64_with_accumulation(tmp_path: Path) -> None:
    monitor = TensorStatsMonitor(activation_every_n_steps=2, kernel="eager")
    with pytest.warns(RuntimeWarning, match=r"layers\.0\.fc1/output0 was modified in place"):
        _, cap, writer, params, grads, hooks = run_loop(tmp_path, 4, 2, monitor, capture_step=2)
    lines = read_lines(tmp_path / "tensor_stats.jsonl")
    # fc1's output is changed in place by ReLU(inplace=True) after the hooks saw it: on the
    # first logging step (reductions batched after the hook) that is only noticed later, so
    # the site is left out of step 0 entirely (not merged from one micro-batch of two); from
    # then on it is reduced inside its hook, and step 2 below has it, exact.
    at0 = {r["kind"]: r for r in lines if r["step"] == 0}
    assert "layers.0.fc1/output0" not in at0["activation"]["tensors"]
    assert "layers.0.fc1/input0" in at0["activation"]["tensors"]
    assert [(r["step"], r["kind"]) for r in lines] == [
        (s, k) for s in (0, 2) for k in ("param", "grad", "activation", "dgrad")
    ]
    at2 = {r["kind"]: r for r in lines if r["step"] == 2}
    check_line(at2["param"], params, "param")
    check_line(at2["grad"], grads, "grad")
    sites = {site for (kind, site) in cap.data if kind == "activation"}
    check_line(at2["activation"], {s: cap.whole("activation", s) for s in sites}, "activation")
    dsites = {site for (kind, site) in cap.data if kind == "dgrad"}
    check_line(at2["dgrad"], {s: cap.whole("dgrad", s) for s in dsites}, "dgrad")
    assert at2["activation"]["micro_batches"] == 2
    # both micro-batches merged: the count is that of the two batches together
    assert at2["activation"]["tensors"]["layers.0.fc1/output0"][0] == 2 * 4 * 48 * H
    # hooks only during logging steps: installed at the first micro-batch, gone after the step
    installed = {s: c for s, c in hooks if c}
    assert set(installed) == {0, 2}
    assert hooks[-1][1] == 0 and all(c == 0 for s, c in hooks if s in (1, 3))
    # summaries, recomputed from the file
    for kind in ("param", "grad", "activation", "dgrad"):
        d = derive(
            moments_from_dicts(
                [dict(zip(FIELDS, v, strict=True)) for v in at2[kind]["tensors"].values()]
            )
        )
        kurt = d["kurtosis"][~torch.isnan(d["kurtosis"])]
        row = writer.rows[2]
        assert row[f"tensor_stats/{kind}/kurtosis_max"] == pytest.approx(
            float(kurt.max()), rel=1e-12
        )
        assert row[f"tensor_stats/{kind}/rms_mean"] == pytest.approx(
            float(d["rms"].mean()), rel=1e-12
        )
        assert row[f"tensor_stats/{kind}/nonfinite"] == 0
    assert 1 not in writer.rows and 3 not in writer.rows


@pytest.mark.parametrize("kernel", ["eager", "compile"])
def test_tiny_gradients_keep_exact_moments(tmp_path: Path, kernel: str) -> None:
    # A loss scaled by 1e-12 gives gradients and dgrads around 1e-14: their float32 fourth
    # powers underflow (the kurtosis came out near 0 before the range fix), and the monitor
    # must still write float64-exact moments for them.
    monitor = TensorStatsMonitor(kinds=["grad", "dgrad"], kernel=kernel)
    _, cap, _, _, grads, _ = run_loop(tmp_path, 1, 1, monitor, capture_step=0, loss_scale=1e-12)
    lines = {r["kind"]: r for r in read_lines(tmp_path / "tensor_stats.jsonl")}
    assert float(grads["head.weight"].std()) < 1e-12
    check_line(lines["grad"], grads, f"{kernel}/tiny grad")
    dsites = {site for (kind, site) in cap.data if kind == "dgrad"}
    check_line(lines["dgrad"], {s: cap.whole("dgrad", s) for s in dsites}, f"{kernel}/dgrad")


def test_separate_intervals_and_layer_summaries(tmp_path: Path) -> None:
    monitor = TensorStatsMonitor(
        log_every_n_steps=1,
        activation_every_n_steps=3,
        layer_pattern=r"layers\.(\d+)\.",
        kernel="eager",
    )
    _, _, writer, _, grads, _ = run_loop(tmp_path, 4, 1, monitor, capture_step=3)
    lines = read_lines(tmp_path / "tensor_stats.jsonl")
    kinds_by_step: dict[int, list[str]] = {}
    for r in lines:
        kinds_by_step.setdefault(r["step"], []).append(r["kind"])
    assert kinds_by_step == {
        0: ["param", "grad", "activation", "dgrad"],
        1: ["param", "grad"],
        2: ["param", "grad"],
        3: ["param", "grad", "activation", "dgrad"],
    }
    # layer summary = all of layer 1's gradients merged, vs float64 on their concatenation
    layer1 = torch.cat([g.reshape(-1) for n, g in grads.items() if n.startswith("layers.1.")])
    ref = reference(layer1)
    got = writer.rows[3]["tensor_stats/grad/layer_1/kurtosis"]
    assert abs(got - ref["kurtosis"]) <= 1e-4 * ref["kurtosis"]
    assert writer.rows[3]["tensor_stats/grad/layer_1/rms"] == pytest.approx(ref["rms"], rel=1e-4)


def test_step_that_raises_leaves_no_hooks(tmp_path: Path) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kernel="eager")
    base = sum(len(m._forward_hooks) for m in model.modules())
    seen = []
    with (
        pytest.raises(RuntimeError, match="boom"),
        Vitals([monitor], writer=Recorder(), run_dir=tmp_path, log_every_n_steps=1) as vitals,
    ):
        vitals.attach(model, opt)
        ids = batches(1)[0]
        vitals.batch(ids)
        seen.append(sum(len(m._forward_hooks) for m in model.modules()) - base)
        model(ids).sum().backward()
        raise RuntimeError("boom")
    assert seen == [2 * len(SITE_MODULES)]  # an early and a late forward hook per site module
    assert sum(len(m._forward_hooks) for m in model.modules()) == base
    assert monitor._handles == []


def test_resume_appends_without_duplicate_steps(tmp_path: Path) -> None:
    def run(steps: range, state: dict | None) -> dict:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = TensorStatsMonitor(kinds=["param", "activation"], kernel="eager")
        with Vitals([monitor], writer=Recorder(), run_dir=tmp_path, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            if state is not None:
                vitals.load_state_dict(state)
            for ids in batches(len(steps)):
                vitals.batch(ids)
                model(ids).sum().backward()
                opt.step()
                opt.zero_grad()
            return vitals.state_dict()

    state = run(range(3), None)
    assert state["callbacks"]["TensorStatsMonitor"] == {}  # (the file is its own record)
    path = tmp_path / "tensor_stats.jsonl"
    # a crash cut a line of step 3; the checkpoint is from step 2: steps 2 and 3 are re-run
    with open(path, "a") as f:
        f.write('{"version":1,"step":3,"kind":"param","tensors":{"a"')
    ckpt = {"step": 2, "callbacks": state["callbacks"]}
    with pytest.warns(RuntimeWarning, match="dropped 3 line"):
        run(range(2), ckpt)
    lines = read_lines(path)
    steps = [(r["step"], r["kind"]) for r in lines]
    assert steps == [(s, k) for s in range(4) for k in ("param", "activation")]


def two_plain_steps(run_dir: Path, monitor: TensorStatsMonitor, writer: Any) -> None:
    """Two steps of a fresh ``Net`` (seed 0) under the driver, every step a logging step."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Vitals([monitor], writer=writer, run_dir=run_dir, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        for ids in batches(2):
            vitals.batch(ids)
            model(ids).sum().backward()
            opt.step()
            opt.zero_grad()


def test_real_fanout_writer_with_jsonl_sink(tmp_path: Path) -> None:
    from trainvitals.adapters import FanoutWriter, JsonlSink, read_jsonl

    writer = FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")])
    two_plain_steps(tmp_path, TensorStatsMonitor(kernel="eager"), writer)
    writer.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    by_step = {r["step"]: r["metrics"] for r in records}
    stats = [
        r
        for r in read_lines(tmp_path / "tensor_stats.jsonl")
        if r["kind"] == "param" and r["step"] == 1
    ]
    d = derive(
        moments_from_dicts(
            [dict(zip(FIELDS, v, strict=True)) for v in stats[0]["tensors"].values()]
        )
    )
    want = float(torch.maximum(d["min"].abs(), d["max"].abs()).max())
    assert by_step[1]["tensor_stats/param/abs_max"] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_values_and_hooks(tmp_path: Path, package: str) -> None:
    lightning = pytest.importorskip(package)

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()
            self.cap = None
            self.params: dict[int, dict[str, torch.Tensor]] = {}
            self.hooks: list[tuple[int, int]] = []

        def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.hooks.append(
                (self.global_step, sum(len(m._forward_hooks) for m in self.modules()))
            )
            if self.cap is not None:
                self.cap.on = self.global_step == 2
            logits = self.net(ids)
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))

        def on_before_optimizer_step(self, optimizer) -> None:
            self.params[self.global_step] = {
                f"net.{n}": p.grad.detach().double().clone() for n, p in self.net.named_parameters()
            }

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    module.cap = Capture(module.net)
    base = sum(len(m._forward_hooks) for m in module.modules())
    monitor = TensorStatsMonitor(kinds=["grad", "activation"], kernel="eager")
    trainer = quiet_trainer(
        package,
        max_steps=4,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        callbacks=[monitor],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches(8), batch_size=None))
    path = Path(trainer.default_root_dir) / "tensor_stats.jsonl"
    lines = read_lines(path)
    assert [(r["step"], r["kind"]) for r in lines] == [
        (0, "grad"),
        (0, "activation"),
        (2, "grad"),
        (2, "activation"),
    ]
    at2 = {r["kind"]: r for r in lines if r["step"] == 2}
    check_line(at2["grad"], module.params[2], "lightning grad")
    sites = {s for (k, s) in module.cap.data if k == "activation"}
    check_line(
        at2["activation"],
        {f"net.{s}": module.cap.whole("activation", s) for s in sites},
        "lightning act",
    )
    assert {s for s, c in module.hooks if c > base} == {0, 2}
    assert sum(len(m._forward_hooks) for m in module.modules()) == base


def test_nonfinite_gradient_is_counted(tmp_path: Path) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = Recorder()
    with Vitals(
        [TensorStatsMonitor(kinds=["grad"], kernel="eager")],
        writer=writer,
        run_dir=tmp_path,
        log_every_n_steps=1,
    ) as vitals:
        vitals.attach(model, opt)
        ids = batches(1)[0]
        vitals.batch(ids)
        model(ids).sum().backward()
        model.head.weight.grad[0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
        opt.step()
    line = read_lines(tmp_path / "tensor_stats.jsonl")[0]
    assert line["tensors"]["head.weight"][FIELDS.index("nonfinite")] == 3
    assert line["tensors"]["head.weight"][0] == VOCAB * D - 3
    assert writer.rows[0]["tensor_stats/grad/nonfinite"] == 3


def test_sparse_gradient_is_measured_with_its_implicit_zeros(tmp_path: Path) -> None:
    # nn.Embedding(sparse=True) gives a sparse COO gradient with one entry per looked-up token
    # (repeated ids): it made every parameter and gradient of the step go missing (the dense
    # kernel cannot reshape it). Its moments are those of the dense gradient.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, D, sparse=True), nn.Linear(D, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 20, (4, 48), generator=torch.Generator().manual_seed(1))
    with (
        warnings.catch_warnings(),
        Vitals(
            [TensorStatsMonitor(kinds=["param", "grad"], kernel="eager")],
            writer=Recorder(),
            run_dir=tmp_path,
            log_every_n_steps=1,
        ) as vitals,
    ):
        warnings.simplefilter("error")  # no "missing from this logging step" warning
        vitals.attach(model, opt)
        vitals.batch(ids)
        model(ids).pow(2).sum().backward()
        grad = model[0].weight.grad
        assert grad.is_sparse and not grad.is_coalesced()
        want = {n: p.grad.to_dense().double() for n, p in model.named_parameters()}
        params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        opt.step()
    lines = {r["kind"]: r for r in read_lines(tmp_path / "tensor_stats.jsonl")}
    check_line(lines["grad"], want, "sparse grad")
    check_line(lines["param"], params, "param next to a sparse grad")


def test_frozen_and_replaced_parameters_are_seen_at_the_next_logging_step(tmp_path: Path) -> None:
    # the parameter list is cached between steps; freezing a layer or swapping a parameter
    # object must still change what is measured
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = batches(1)[0]
    with Vitals(
        [TensorStatsMonitor(kinds=["param"], kernel="eager")],
        writer=Recorder(),
        run_dir=tmp_path,
        log_every_n_steps=1,
    ) as vitals:
        vitals.attach(model, opt)
        for step in range(3):
            if step == 1:
                model.layers[0].fc1.requires_grad_(False)
            if step == 2:
                model.head.bias = nn.Parameter(torch.full((VOCAB,), 7.0))
            vitals.batch(ids)
            model(ids).sum().backward()
            opt.step()
            opt.zero_grad()
    lines = read_lines(tmp_path / "tensor_stats.jsonl")
    names = [set(line["tensors"]) for line in lines]
    assert "layers.0.fc1.weight" in names[0]
    assert "layers.0.fc1.weight" not in names[1] and "layers.0.fc1.bias" not in names[1]
    assert names[2] == names[1]
    mean = FIELDS.index("mean")
    assert lines[2]["tensors"]["head.bias"][mean] == 7.0
    assert lines[1]["tensors"]["head.bias"][mean] != 7.0


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_pass_before_the_first_training_forward_is_not_measured(
    tmp_path: Path, monkeypatch, mode: str
) -> None:
    # PPO-style: old log-probs from the same model under no_grad, then the training forward.
    # On the run's first logging step the monitor did not yet know these sites train with
    # autograd on, and merged the no_grad pass into them (twice the tokens, wrong moments).
    # A frozen part that always runs under no_grad stays measured. Under inference_mode, the
    # hooks failed on the inference tensors (no version counter): every activation and dgrad
    # of the step went missing, and the kernel's cached work buffers, made there, would have
    # been inference tensors that no later step could write.
    import trainvitals.stats.moments as moments

    monkeypatch.setattr(moments, "_eager_work", {})  # made afresh, inside the hooks
    torch.manual_seed(0)
    frozen = nn.Linear(D, D).requires_grad_(False)
    policy = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, 8))
    model = nn.ModuleDict({"frozen": frozen, "policy": policy})
    want: dict[str, dict[str, list[torch.Tensor]]] = {"activation": {}, "dgrad": {}}
    capturing = [True]

    def capture(name: str):
        def hook(module, args, output):
            if not capturing[0] or (name.startswith("policy") and not torch.is_grad_enabled()):
                return  # the policy's no_grad pass: not part of the training step
            for suffix, t in ((f"{name}/input0", args[0]), (f"{name}/output0", output)):
                want["activation"].setdefault(suffix, []).append(t.detach().double().reshape(-1))
                if t.requires_grad:
                    t.register_hook(
                        lambda g, s=suffix: want["dgrad"].setdefault(s, []).append(g.double())
                    )

        return hook

    for name in ("frozen", "policy.0", "policy.2"):
        model.get_submodule(name).register_forward_hook(capture(name))
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kinds=["activation", "dgrad"], kernel="eager")
    no_grad = torch.no_grad if mode == "no_grad" else torch.inference_mode
    tokens = 256  # frozen/output0: 256 x 48 elements, the chunked kernel with its work buffers
    with Vitals([monitor], writer=Recorder(), run_dir=tmp_path, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        for step in range(2):
            capturing[0] = step == 1
            x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(step))
            vitals.batch(x)
            with no_grad():
                h = frozen(x)
                old = policy(h + 50.0)
            h, old = h.clone(), old.clone()  # (an inference tensor cannot enter autograd)
            policy(h).sub(old).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    lines = read_lines(tmp_path / "tensor_stats.jsonl")
    assert [(r["step"], r["kind"]) for r in lines] == [
        (s, k) for s in (0, 1) for k in ("activation", "dgrad")
    ]
    at0 = {r["kind"]: r for r in lines if r["step"] == 0}
    assert at0["activation"]["tensors"]["frozen/output0"][0] == tokens * D
    assert at0["activation"]["tensors"]["policy.0/input0"][0] == tokens * D
    at1 = {r["kind"]: r for r in lines if r["step"] == 1}
    for kind in ("activation", "dgrad"):
        expected = {s: torch.cat([t.reshape(-1) for t in v]) for s, v in want[kind].items()}
        check_line(at1[kind], expected, kind)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="kinds"):
        TensorStatsMonitor(kinds=["weights"])
    with pytest.raises(ValueError, match="activation_every_n_steps"):
        TensorStatsMonitor(activation_every_n_steps=0)
    with pytest.raises(ValueError, match="layer_pattern"):
        TensorStatsMonitor(layer_pattern=r"layers\.\d+")
    with pytest.raises(TypeError, match="exclude"):
        TensorStatsMonitor(exclude="head/*")
    with pytest.raises(ValueError, match="kernel"):
        TensorStatsMonitor(kernel="cuda")
    with pytest.raises(TypeError, match="module_types"):
        TensorStatsMonitor(module_types=[int])  # a class, but no module class
    with pytest.raises(ValueError, match="kinds"):
        TensorStatsMonitor(kinds="gradient")
    # one kind or one class needs no list, as MemoryMonitor(reduce="min") and NormMonitor take one
    assert TensorStatsMonitor(kinds="grad").kinds == ("grad",)
    assert TensorStatsMonitor(module_types=nn.Linear).module_types == (nn.Linear,)


@pytest.mark.parametrize("where", ["forward", "backward", "step_end"])
def test_failure_inside_its_hooks_never_breaks_the_step(tmp_path: Path, monkeypatch, where) -> None:
    # Work done inside forward/gradient hooks runs outside the callback guard: a failure there
    # (e.g. out of memory in the kernel) must leave the step running, the activation/dgrad
    # sites of that one step out (not partially merged), and the next logging step complete.
    import trainvitals.callbacks.tensor_stats_monitor as mod

    monkeypatch.setenv("TRAINVITALS_STRICT", "0")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kernel="eager")
    state = {"step": -1, "phase": None}
    original = mod.MomentAccumulator.add

    def failing_add(self, *args, **kwargs):
        if state["step"] == 1 and state["phase"] == where:
            raise RuntimeError("simulated out of memory")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(mod.MomentAccumulator, "add", failing_add)
    reduce = monitor._reduce_deferred

    def reduce_at(*args):  # the batched reduction: in a hook, or at the step's end
        if state["phase"] is None:
            state["phase"] = "step_end"
        return reduce(*args)

    monitor._reduce_deferred = reduce_at
    base = sum(len(m._forward_hooks) for m in model.modules())
    with Vitals([monitor], writer=Recorder(), run_dir=tmp_path, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        for step, ids in enumerate(batches(3)):
            state["step"] = step
            with (
                pytest.warns(RuntimeWarning, match="raised RuntimeError: simulated")
                if (step == 1)
                else _nothing()
            ):
                vitals.batch(ids)
                state["phase"] = "forward"
                loss = model(ids).logsumexp(-1).mean()
                state["phase"] = "backward"
                loss.backward()
                state["phase"] = None
                opt.step()
            opt.zero_grad()
            assert sum(len(m._forward_hooks) for m in model.modules()) == base
    lines = read_lines(tmp_path / "tensor_stats.jsonl")
    act = {line["step"]: line["tensors"] for line in lines if line["kind"] == "activation"}
    dgrad = {line["step"]: line["tensors"] for line in lines if line["kind"] == "dgrad"}
    params = {line["step"]: line["tensors"] for line in lines if line["kind"] == "param"}
    # step 0 leaves out the two fc1 outputs that ReLU(inplace) changes (see the in-place rule)
    assert len(act[0]) == 2 * len(SITE_MODULES) - 3
    assert len(act[2]) == 2 * len(SITE_MODULES) - 1  # emb has no float input
    assert len(dgrad[0]) > 0 and len(dgrad[2]) > 0
    assert act[1] == {} and dgrad[1] == {}  # that step's sites are left out, not partial
    assert set(params[1]) == set(params[0])  # the rest of the step is measured


def test_failure_of_the_parameter_kernel_leaves_that_step_out(tmp_path: Path, monkeypatch) -> None:
    # A rank-local failure in the parameter/gradient kernels must not skip the step's
    # collectives (it would hang the other ranks): the rows go on as NaN and are left out.
    import trainvitals.stats.moments as moments_mod

    monkeypatch.setenv("TRAINVITALS_STRICT", "0")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_now = [0]
    original = moments_mod.partial_moments

    def failing(*args, **kwargs):
        if step_now[0] == 1:
            raise RuntimeError("simulated kernel failure")
        return original(*args, **kwargs)

    import trainvitals.callbacks.tensor_stats_monitor as mod

    monkeypatch.setattr(mod, "partial_moments", failing)
    writer = Recorder()
    monitor = TensorStatsMonitor(kinds=["param", "grad"], kernel="eager")
    with Vitals([monitor], writer=writer, run_dir=tmp_path, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        for step, ids in enumerate(batches(3)):
            step_now[0] = step
            with (
                pytest.warns(RuntimeWarning, match="simulated kernel failure")
                if (step == 1)
                else _nothing()
            ):
                vitals.batch(ids)
                model(ids).logsumexp(-1).mean().backward()
                opt.step()
            opt.zero_grad()
    by = {(x["step"], x["kind"]): x["tensors"] for x in read_lines(tmp_path / "tensor_stats.jsonl")}
    for kind in ("param", "grad"):
        assert by[(1, kind)] == {}
        assert set(by[(0, kind)]) == set(by[(2, kind)]) == {n for n, _ in model.named_parameters()}
    assert not monitor._disabled  # the callback itself goes on


def test_a_glob_matching_no_tensor_is_warned_once(tmp_path: Path) -> None:
    monitor = TensorStatsMonitor(
        include=["layers.*", "head*", "encoder.*"], exclude=["lm_head/*", "head/output0"]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        two_plain_steps(tmp_path, monitor, Recorder())
    messages = [str(w.message) for w in caught if "matches no" in str(w.message)]
    assert len(messages) == 2, messages  # each unmatched glob once, not once per step
    assert "include glob 'encoder.*'" in messages[0]
    assert "exclude glob 'lm_head/*'" in messages[1]
    names = set(read_lines(tmp_path / "tensor_stats.jsonl")[-1]["tensors"])
    assert "head/input0" in names and "head/output0" not in names  # the others did their job


def test_a_new_run_from_step_0_moves_the_earlier_runs_file_aside(tmp_path: Path) -> None:
    # Two new runs in one run_dir (the driver's default run_dir is fixed): each earlier run's
    # file is kept whole, as JsonlSink keeps metrics.jsonl, not emptied by the step-0 resume rule.
    path = tmp_path / "tensor_stats.jsonl"
    runs = []
    for _ in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            two_plain_steps(tmp_path, TensorStatsMonitor(kernel="eager"), Recorder())
        runs.append(path.read_bytes())
        assert [(r["step"], r["kind"]) for r in read_lines(path)] == [
            (s, k) for s in range(2) for k in ("param", "grad", "activation", "dgrad")
        ]
        moved = [str(w.message) for w in caught if "held an earlier run" in str(w.message)]
        kept = f"tensor_stats.jsonl.{len(runs) - 1}"
        want = f"TensorStatsMonitor: {path} held an earlier run; moved it to {kept}"
        assert moved == ([want] if len(runs) > 1 else [])
    assert (tmp_path / "tensor_stats.jsonl.1").read_bytes() == runs[0]
    assert (tmp_path / "tensor_stats.jsonl.2").read_bytes() == runs[1]


def test_resume_reads_a_large_file_line_by_line(tmp_path: Path) -> None:
    import tracemalloc

    from trainvitals.callbacks.tensor_stats_monitor import _prepare_jsonl

    def line(step: int) -> bytes:
        tensors = {f"layers.{i}.weight": [float(step + i)] * len(FIELDS) for i in range(400)}
        record = {
            "version": 1,
            "step": step,
            "kind": "param",
            "time": 1.0,
            "fields": list(FIELDS),
            "tensors": tensors,
        }
        return json.dumps(record, separators=(",", ":")).encode() + b"\n"

    lines = [line(s) for s in range(8)]  # about 27 kB each
    cut = '{"version":1,"step":8,"kind":"param","tensors":{"é'.encode()[:-1]  # mid-character
    path = tmp_path / "tensor_stats.jsonl"
    with open(path, "wb") as f:
        for _ in range(40):  # 8.7 MB of steps 0..7 repeated, then a crash mid-line
            f.writelines(lines)
        f.write(cut)
    size = path.stat().st_size
    # expected: every line of steps < 5 in file order, the cut tail gone (independent filter)
    want = b"".join(raw for _ in range(40) for raw in lines if json.loads(raw)["step"] < 5)
    tracemalloc.start()
    try:
        with pytest.warns(RuntimeWarning, match=f"dropped {40 * 3 + 1} line"):
            _prepare_jsonl(path, first_step=5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert path.read_bytes() == want
    # a few lines at a time, not the file (a run's tensor_stats.jsonl can be gigabytes)
    assert peak < 8 * len(lines[0]) < size / 10, (peak, size)


def test_an_append_cut_part_way_leaves_the_next_record_intact(tmp_path: Path, monkeypatch) -> None:
    # A full disk cuts an append mid-line; with several ranks the callback keeps running, so its
    # next line must start on a line of its own (readers skip the cut one), not be glued to it.
    import builtins

    from trainvitals.report import read_tensor_stats

    monitor = TensorStatsMonitor()
    monitor._path = tmp_path / "tensor_stats.jsonl"

    def record(step: int) -> str:
        return json.dumps({"version": 1, "step": step, "kind": "param", "tensors": {}})

    monitor._append_lines([record(0)])
    real_open = builtins.open

    class DiskFull:
        def __init__(self, f: Any) -> None:
            self.f = f

        def __enter__(self) -> DiskFull:
            return self

        def __exit__(self, *exc: Any) -> None:
            self.f.close()

        def write(self, text: str) -> int:
            self.f.write(text[: len(text) // 2])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(builtins, "open", lambda *a, **k: DiskFull(real_open(*a, **k)))
    with pytest.raises(OSError):
        monitor._append_lines([record(1)])
    monkeypatch.setattr(builtins, "open", real_open)
    monitor._append_lines([record(2)])
    with pytest.warns(RuntimeWarning, match="unreadable line"):
        steps = [r["step"] for r in read_tensor_stats(monitor._path)]
    assert steps == [0, 2]


@pytest.mark.parametrize("hook", ["before_optimizer_step", "micro_batch_start"])
def test_a_callback_disabled_on_an_activation_step_leaves_no_hooks(
    tmp_path: Path, monkeypatch, hook: str
) -> None:
    # One process: a hook that raises disables the callback, and then none of its later hooks
    # runs (step_end, run_end). The forward and gradient hooks it had installed for the step
    # must go at once, or they keep measuring (and holding tensor hooks) on every later
    # forward and stay on the model after the run.
    monkeypatch.setenv("TRAINVITALS_STRICT", "0")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kernel="eager")
    target = "_trainable_parameters" if hook == "before_optimizer_step" else "_install"
    original = getattr(monitor, target)
    calls = {"n": 0}

    def failing(ctx):
        calls["n"] += 1
        if hook == "before_optimizer_step" or calls["n"] == 2:  # at step 1's first micro-batch
            if hook == "micro_batch_start":
                original(ctx)  # installed, then something after the install raised
            raise RuntimeError("simulated")
        return original(ctx)

    monkeypatch.setattr(monitor, target, failing)
    base_forward = sum(len(m._forward_hooks) for m in model.modules())
    counts = []
    with (
        pytest.warns(RuntimeWarning, match="disabled for the rest of the run"),
        Vitals([monitor], writer=Recorder(), run_dir=tmp_path, log_every_n_steps=1) as vitals,
    ):
        vitals.attach(model, opt)
        for ids in batches(3):
            vitals.batch(ids)
            model(ids).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
            counts.append(sum(len(m._forward_hooks) for m in model.modules()) - base_forward)
    assert monitor._disabled
    assert counts == [0, 0, 0]
    assert monitor._handles == [] and monitor._deferred == [] and monitor._acc == {}


def _rollback_run(
    run_dir: Path, *, every: int, steps: int, back_to: int, replay: int
) -> tuple[dict[int, dict[str, torch.Tensor]], list[int]]:
    """The driver with its own writer (``metrics.jsonl``): ``steps`` steps, then a rollback in
    the same process to the checkpoint taken before step ``back_to`` (model, optimizer and
    ``Vitals`` restored, as ``accelerator.load_state`` does), then ``replay`` more steps. Returns
    the parameters (float64) each replayed step measured and the steps of ``metrics.jsonl``."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kinds=["param", "activation"], kernel="eager")
    measured: dict[int, dict[str, torch.Tensor]] = {}

    def one_step(vitals: Vitals, ids: torch.Tensor) -> None:
        vitals.batch(ids)
        logits = model(ids)
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1)).backward()
        measured[vitals.step] = {
            n: p.detach().double().clone() for n, p in model.named_parameters()
        }
        opt.step()
        opt.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the writer's own rollback warnings
        with Vitals([monitor], run_dir=run_dir, log_every_n_steps=every) as vitals:
            vitals.attach(model, opt)
            for i, ids in enumerate(batches(steps)):
                if i == back_to:
                    saved = copy.deepcopy(
                        (model.state_dict(), opt.state_dict(), vitals.state_dict())
                    )
                one_step(vitals, ids)
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            with pytest.warns(RuntimeWarning, match=f"went back to step {back_to}"):
                vitals.load_state_dict(saved[2])
                measured = {s: m for s, m in measured.items() if s < back_to}
                for ids in batches(replay, seed=1):  # the replay sees other data
                    one_step(vitals, ids)
    metrics = sorted({r["step"] for r in read_lines(run_dir / "metrics.jsonl")})
    return measured, metrics


def test_rollback_in_process_rewrites_the_replayed_steps_once(tmp_path: Path) -> None:
    # 6 steps, back to step 2, replay steps 2 and 3 on other data: the file holds steps 0-3
    # once per kind, as metrics.jsonl does, and steps 2-3 hold the replayed parameters
    measured, metrics = _rollback_run(tmp_path, every=1, steps=6, back_to=2, replay=2)
    lines = read_lines(tmp_path / "tensor_stats.jsonl")
    assert [(r["step"], r["kind"]) for r in lines] == [
        (s, k) for s in range(4) for k in ("param", "activation")
    ]
    assert metrics == [0, 1, 2, 3]
    params = {r["step"]: r for r in lines if r["kind"] == "param"}
    for step in range(4):
        check_line(params[step], measured[step], f"param at step {step}")


def test_rollback_ending_before_the_next_logging_step_drops_the_abandoned_steps(
    tmp_path: Path,
) -> None:
    # every 3 steps: the abandoned timeline wrote steps 0 and 3; back to step 2 and one replayed
    # step (not a logging one) before the run ends: step 3 was never reached again
    # (metrics.jsonl is cut back only at the new writer's first write, which never comes here)
    measured, _ = _rollback_run(tmp_path, every=3, steps=5, back_to=2, replay=1)
    lines = read_lines(tmp_path / "tensor_stats.jsonl")
    assert [(r["step"], r["kind"]) for r in lines] == [(0, "param"), (0, "activation")]
    check_line(lines[0], measured[0], "param at step 0")


@pytest.mark.parametrize("package", ["lightning.pytorch"])
def test_lightning_fit_from_an_earlier_checkpoint_into_the_same_folder(
    tmp_path: Path, package: str, caplog: pytest.LogCaptureFixture
) -> None:
    lightning = pytest.importorskip(package)

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()
            self.params: dict[int, dict[str, torch.Tensor]] = {}

        def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
            logits = self.net(ids)
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))

        def on_before_optimizer_step(self, optimizer) -> None:
            self.params[self.global_step] = {
                f"net.{n}": p.detach().double().clone() for n, p in self.net.named_parameters()
            }

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    # one callback instance in both fits, as a script that retries in the same process does
    monitor = TensorStatsMonitor(kinds=["param"], kernel="eager")
    ckpts = tmp_path / "ckpts"
    first = quiet_trainer(
        package,
        max_steps=6,
        log_every_n_steps=1,
        callbacks=[
            monitor,
            lightning.callbacks.ModelCheckpoint(
                dirpath=ckpts, every_n_train_steps=2, save_top_k=-1
            ),
        ],
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    first.fit(Module(), torch.utils.data.DataLoader(batches(6), batch_size=None))
    [at2] = [p for p in ckpts.iterdir() if "step=2" in p.name]
    module = Module()
    second = quiet_trainer(
        package, max_steps=4, log_every_n_steps=1, callbacks=[monitor], default_root_dir=tmp_path
    )
    # the lines after the checkpoint's step, none cut by a crash: an INFO log, no warning
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, "trainvitals"):
        warnings.filterwarnings("error", "TensorStatsMonitor", RuntimeWarning)
        second.fit(
            module, torch.utils.data.DataLoader(batches(6, seed=1), batch_size=None), ckpt_path=at2
        )
    ours = [r.levelno for r in caplog.records if r.message.startswith("TensorStatsMonitor")]
    assert ours == [logging.INFO] and "dropped 4 line" in caplog.text
    lines = read_lines(tmp_path / "tensor_stats.jsonl")
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    for r in lines[2:]:
        check_line(r, module.params[r["step"]], f"param at step {r['step']}")


class TwoLinear(nn.Module):
    """The smallest compiled model of the tests: two Linears with a ReLU between, outputs of
    8192 elements (the chunked kernel); ``in_place`` applies the ReLU to fc1's output in place,
    after fc1's hooks saw it."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 128)
        self.fc2 = nn.Linear(128, 128)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h.relu_() if self.in_place else torch.relu(h))


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("in_place", [False, True])
def test_compiled_model_first_step_is_measured_exactly(tmp_path: Path, in_place: bool) -> None:
    # Under torch.compile, Dynamo traced the monitor's hooks: the moments kernel run inside a
    # hook (a full batch of 8 deferred tensors) failed under fake tensors, so step 0 lost every
    # activation and dgrad (and a version read in traced code is a constant of the trace: a
    # Linear output written by inductor's out= kernel can look changed in place). The hooks
    # now run eagerly: step 0 is exact, and a real in-place change made by the compiled graph
    # (relu_ on fc1's output) is still caught and that site reduced in its hook after.
    torch.manual_seed(0)
    model = TwoLinear(in_place)
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kinds = ("activation",) if in_place else ("activation", "dgrad")
    monitor = TensorStatsMonitor(kinds=kinds, kernel="eager")
    xs = [torch.randn(64, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    want: list[dict[str, dict[str, list[torch.Tensor]]]] = []
    with contextlib.ExitStack() as stack:
        records = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        vitals = stack.enter_context(
            Vitals([monitor], writer=Recorder(), run_dir=tmp_path, log_every_n_steps=1)
        )
        vitals.attach(compiled, opt)
        for step in range(2):
            # the reference: the same weights and inputs in float64, uncompiled
            ref = copy.deepcopy(model).double()
            sites: dict[str, dict[str, list[torch.Tensor]]] = {"activation": {}, "dgrad": {}}
            for x in xs[2 * step : 2 * step + 2]:  # two micro-batches: 8 tensors per step
                vitals.batch(x)
                (compiled(x).pow(2).mean() / 2).backward()
                x64 = x.double()
                h = ref.fc1(x64)
                r = torch.relu(h)
                out = ref.fc2(r)
                seen = {"fc1/input0": x64, "fc1/output0": h, "fc2/input0": r, "fc2/output0": out}
                grads = torch.autograd.grad(out.pow(2).mean() / 2, [h, r, out])
                for site, t in seen.items():
                    sites["activation"].setdefault(site, []).append(t.detach().reshape(-1))
                for site, g in zip(
                    ("fc1/output0", "fc2/input0", "fc2/output0"), grads, strict=True
                ):
                    sites["dgrad"].setdefault(site, []).append(g.reshape(-1))
            want.append(sites)
            opt.step()
            opt.zero_grad()
    messages = [str(w.message) for w in records]
    assert not [m for m in messages if "raised" in m], messages
    changed = [m for m in messages if "modified in place" in m]
    assert len(changed) == in_place and all("fc1/output0" in m for m in changed), changed
    lines = read_lines(tmp_path / "tensor_stats.jsonl")
    assert [(r["step"], r["kind"]) for r in lines] == [(s, k) for s in (0, 1) for k in kinds]
    for r in lines:
        expected = {s: torch.cat(v) for s, v in want[r["step"]][r["kind"]].items()}
        if in_place and r["step"] == 0:  # changed before its deferred reduction: left out
            del expected["fc1/output0"]
        check_line(r, expected, f"{r['kind']} at step {r['step']}, in_place={in_place}")
