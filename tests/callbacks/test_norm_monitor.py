"""NormMonitor in one process: the driver and a Lightning Trainer, against float64 references."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import (
    RecordingWriter,
    TiedLM,
    float64_norms,
    lm_loss,
)
from tests.scripts.vitals_testing import quiet_trainer
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.norm_monitor import NormMonitor
from trainvitals.distributed import collective_counter
from trainvitals.stats import norms as norms_module
from trainvitals.stats.norms import (
    canonical_name,
    dedupe_named_tensors,
    group_named_tensors,
    local_sq_norms,
)

REL = 1e-6


def _batches(n: int, seed: int = 0, vocab: int = 13) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (4, 6), generator=g) for _ in range(n)]


def _run_driver(monitor: NormMonitor, steps: int, interval: int, **kwargs):
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    writer = RecordingWriter()
    refs: dict[int, tuple[float, float]] = {}
    grads: dict[int, dict[str, torch.Tensor]] = {}
    with Vitals([monitor], writer=writer, log_every_n_steps=interval, **kwargs) as vitals:
        vitals.attach(model, opt)
        for step, ids in enumerate(_batches(steps)):
            vitals.batch(ids)
            lm_loss(model, ids).backward()
            refs[step] = float64_norms(list(model.parameters()))
            grads[step] = {n: p.grad.double().clone() for n, p in model.named_parameters()}
            grads[step].update(
                {f"param:{n}": p.detach().double().clone() for n, p in model.named_parameters()}
            )
            opt.step()
            opt.zero_grad()
    return model, writer, refs, grads


def test_driver_global_norms_equal_float64_reference_and_tied_weight_counts_once():
    _, writer, refs, _ = _run_driver(NormMonitor(), steps=5, interval=2)
    assert sorted(writer.steps) == [0, 2, 4]
    for step, row in writer.steps.items():
        p_ref, g_ref = refs[step]
        assert row["l2_norm/param/global"] == pytest.approx(p_ref, rel=REL)
        assert row["l2_norm/grad/global"] == pytest.approx(g_ref, rel=REL)
        assert row["l2_norm/grad/nonfinite_count"] == 0


def test_tied_weight_is_counted_once():
    torch.manual_seed(0)
    model = TiedLM()
    named = list(model.named_parameters(remove_duplicate=False))
    assert len(named) == len(list(model.parameters())) + 1  # the head repeats the embedding
    assert [n for n, _ in dedupe_named_tensors(named)] == [n for n, _ in model.named_parameters()]
    # A second Parameter object over the same memory is the same tensor too.
    alias = nn.Parameter(model.embed.weight.data)
    assert len(dedupe_named_tensors([("a", model.embed.weight), ("b", alias)])) == 1
    # ... but a different view of it (one row) is not.
    row = nn.Parameter(model.embed.weight.data[0])
    assert len(dedupe_named_tensors([("a", model.embed.weight), ("b", row)])) == 2


def test_per_param_globs_write_grad_and_param_norms():
    monitor = NormMonitor(per_param=["up.*", "embed.weight"], per_param_kinds=("grad", "param"))
    _, writer, _, grads = _run_driver(monitor, steps=1, interval=1)
    row = writer.steps[0]
    per_param = {k for k in row if k.count("/") == 2 and not k.endswith(("global", "count"))}
    names = ["up.weight", "up.bias", "embed.weight"]
    assert per_param == {f"l2_norm/{kind}/{n}" for kind in ("grad", "param") for n in names}
    for n in names:
        assert row[f"l2_norm/grad/{n}"] == pytest.approx(float(grads[0][n].norm()), rel=REL)
        param_ref = float(grads[0][f"param:{n}"].norm())
        assert row[f"l2_norm/param/{n}"] == pytest.approx(param_ref, rel=REL)
    assert "head.weight" not in str(sorted(row))  # tied head is reported under its first name


def test_a_glob_matching_a_tied_alias_selects_the_parameter_under_its_first_name():
    # The head is tied to the embedding (named_parameters lists it as embed.weight first): a
    # glob naming the head, as docs/norms.md's "*lm_head.weight" example does, selects it.
    monitor = NormMonitor(per_param="head.weight", per_param_kinds=("grad", "param"))
    _, writer, _, grads = _run_driver(monitor, steps=1, interval=1)
    row = writer.steps[0]
    per_param = {k for k in row if k.count("/") == 2 and not k.endswith(("global", "count"))}
    assert per_param == {"l2_norm/grad/embed.weight", "l2_norm/param/embed.weight"}
    grad_ref = float(grads[0]["embed.weight"].norm())
    assert row["l2_norm/grad/embed.weight"] == pytest.approx(grad_ref, rel=REL)
    param_ref = float(grads[0]["param:embed.weight"].norm())
    assert row["l2_norm/param/embed.weight"] == pytest.approx(param_ref, rel=REL)
    # a second Parameter object over the embedding's memory: its names are aliases too
    torch.manual_seed(0)
    model = TiedLM()
    alias = nn.Parameter(model.embed.weight.data)
    grouped = group_named_tensors(
        [*model.named_parameters(remove_duplicate=False), ("extra", alias)]
    )
    assert grouped[0][0] == "embed.weight"
    assert grouped[0][2] == ("embed.weight", "head.weight", "extra")
    assert [names for _, _, names in grouped[1:]] == [(n,) for n, _, _ in grouped[1:]]


def test_param_norm_is_taken_before_the_update():
    torch.manual_seed(0)
    ref_model = TiedLM()
    before = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in ref_model.parameters()))
    _, writer, _, _ = _run_driver(NormMonitor(), steps=1, interval=1)
    assert writer.steps[0]["l2_norm/param/global"] == pytest.approx(before, rel=REL)


def test_nonfinite_gradients_are_counted_and_named():
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = RecordingWriter()
    monitor = NormMonitor(max_nonfinite_names=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([monitor], writer=writer, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            for step, ids in enumerate(_batches(3)):
                vitals.batch(ids)
                lm_loss(model, ids).backward()
                if step >= 1:
                    model.down.weight.grad[0, 0] = float("nan")
                    model.norm.bias.grad[1] = float("inf")
                opt.step()
                opt.zero_grad()
    assert writer.steps[0]["l2_norm/grad/nonfinite_count"] == 0
    assert writer.steps[1]["l2_norm/grad/nonfinite_count"] == 2
    assert math.isnan(writer.steps[1]["l2_norm/grad/global"])
    assert math.isfinite(writer.steps[1]["l2_norm/param/global"])
    messages = [str(w.message) for w in caught if "NaN/Inf" in str(w.message)]
    assert len(messages) == 2  # steps 1 and 2
    assert "down.weight" in messages[0] and "and 1 more" in messages[0]
    assert "step 1" in messages[0]
    assert monitor.state_dict() == {
        "first_nonfinite_step": 1,
        "first_nonfinite_names": ["down.weight"],
        "nonfinite_logging_steps": 2,
    }
    restored = NormMonitor()
    restored.load_state_dict(monitor.state_dict())
    assert restored.state_dict() == monitor.state_dict()


def test_a_failed_norm_computation_is_nan_not_a_nonfinite_gradient(monkeypatch):
    # A rank-local failure (say, out of memory) must not skip the step's collectives; the step
    # is written as NaN ("not measured"), never as non-finite gradients, and the monitor goes on.
    import trainvitals.callbacks.norm_monitor as mod

    monkeypatch.setenv("TRAINVITALS_STRICT", "0")
    calls = [0]
    original = mod.local_sq_norms

    def failing(tensors, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("simulated out of memory")
        return original(tensors, *args, **kwargs)

    monkeypatch.setattr(mod, "local_sq_norms", failing)
    monitor = NormMonitor(per_param="*")
    with pytest.warns(RuntimeWarning, match="simulated out of memory"):
        _, writer, refs, _ = _run_driver(monitor, steps=3, interval=1)
    bad = writer.steps[1]
    assert math.isnan(bad["l2_norm/grad/global"]) and math.isnan(bad["l2_norm/param/global"])
    assert math.isnan(bad["l2_norm/grad/up.weight"])
    assert bad["l2_norm/grad/nonfinite_count"] == 0
    assert monitor.first_nonfinite_step is None and not monitor._disabled
    for step in (0, 2):
        assert writer.steps[step]["l2_norm/grad/global"] == pytest.approx(refs[step][1], rel=REL)


def test_non_logging_steps_compute_nothing(monkeypatch):
    calls = []
    real = norms_module.local_sq_norms

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("trainvitals.callbacks.norm_monitor.local_sq_norms", counting)
    before = sum(collective_counter.values())
    _, writer, _, _ = _run_driver(NormMonitor(), steps=7, interval=3)
    assert sorted(writer.steps) == [0, 3, 6]
    assert len(calls) == 3
    assert sum(collective_counter.values()) == before  # single process: no collective at all


def test_glob_matching_nothing_is_an_error_at_run_start():
    monitor = NormMonitor(per_param=["up.*", "decoder.layers.*"])
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vitals = Vitals([monitor], writer=RecordingWriter(), log_every_n_steps=1).attach(model, opt)
    with pytest.raises(ValueError, match=r"decoder\.layers\.\*"):
        vitals.batch(_batches(1)[0])


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"log_every_n_steps": 0}, ValueError),
        ({"log_every_n_steps": -3}, ValueError),
        ({"per_param_kinds": ("grads",)}, ValueError),
        ({"per_param_kinds": ()}, ValueError),
        ({"per_param": [""]}, TypeError),
        ({"per_param": 3}, TypeError),
        ({"max_nonfinite_names": 0}, ValueError),
    ],
)
def test_bad_arguments(kwargs, error):
    with pytest.raises(error):
        NormMonitor(**kwargs)


def test_canonical_names_strip_wrappers():
    assert canonical_name("module._orig_mod.layers.0.weight") == "layers.0.weight"
    assert canonical_name("_forward_module.model.w") == "model.w"
    assert (
        canonical_name("layers.1._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.weight")
        == "layers.1.mlp.weight"
    )
    assert canonical_name("encoder.module.weight") == "encoder.module.weight"


def test_wrapped_model_reports_original_names():
    torch.manual_seed(0)
    model = TiedLM()
    wrapped = nn.DataParallel(model)  # CPU: a plain wrapper whose params are named module.*
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    with Vitals([NormMonitor(per_param="up.weight")], writer=writer, log_every_n_steps=1) as v:
        v.attach(wrapped, opt)
        ids = _batches(1)[0]
        v.batch(ids)
        lm_loss(wrapped, ids).backward()
        expected = float(model.up.weight.grad.double().norm())
        opt.step()
    assert writer.steps[0]["l2_norm/grad/up.weight"] == pytest.approx(expected, rel=REL)


def test_local_sq_norms_are_accurate_for_large_and_low_precision_tensors():
    g = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(3_000_001, generator=g) * 3 + 1,  # torch's own fp32 CPU norm is off ~1e-4
        torch.randn(5000, generator=g).bfloat16(),
        None,
        torch.randn(0, 4),
        torch.randn(2048, 3, generator=g, dtype=torch.float64) * 1e3,
        torch.randn(300, generator=g),  # shorter than one row
        torch.randn(64, 48, generator=g).t(),  # not contiguous
        torch.randn(200, 100, generator=g).t() - 2,  # large and not contiguous
        torch.randn(8191, generator=g) * 3 + 1,  # the largest tensor normed whole
        torch.randn(8192, generator=g) * 3 + 1,  # the smallest normed by rows
    ]
    got = local_sq_norms(tensors)
    assert got.dtype == torch.float64
    for value, t in zip(got.tolist(), tensors, strict=True):
        ref = 0.0 if t is None else float(t.double().pow(2).sum())
        assert value == pytest.approx(ref, rel=1e-6, abs=1e-12)


# ---------------------------------------------------------------------------------- Lightning


def _lightning_module_cls(package: str = "lightning.pytorch"):
    import importlib

    pl = importlib.import_module(package)

    class LitTied(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = TiedLM()
            self.refs: dict[int, tuple[float, float]] = {}

        def training_step(self, batch, batch_idx):
            return lm_loss(self.model, batch[0])

        def on_before_optimizer_step(self, optimizer):
            # unscaled, before Lightning's gradient clipping
            self.refs[self.trainer.global_step] = float64_norms(list(self.parameters()))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return LitTied


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_single_device_with_accumulation_and_clipping(tmp_path, package):
    pytest.importorskip(package)
    data = torch.utils.data.TensorDataset(torch.cat(_batches(6)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    module = _lightning_module_cls(package)()
    writer = RecordingWriter()
    trainer = quiet_trainer(
        package,
        devices=1,
        max_steps=3,
        accumulate_grad_batches=2,
        gradient_clip_val=1e-3,
        log_every_n_steps=1,
        callbacks=[NormMonitor(writer=writer, per_param="model.up.weight")],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, loader)
    assert sorted(writer.steps) == [0, 1, 2]
    for step, row in writer.steps.items():
        p_ref, g_ref = module.refs[step]
        assert row["l2_norm/param/global"] == pytest.approx(p_ref, rel=REL)
        # clipping to 1e-3 happened after: the logged norm is the unclipped one
        assert row["l2_norm/grad/global"] == pytest.approx(g_ref, rel=REL)
        assert g_ref > 1e-2
        assert "l2_norm/grad/model.up.weight" in row


# ------------------------------------------------------------------------- the real writer


def test_real_fanout_writer_and_jsonl_sink(tmp_path):
    from trainvitals.adapters import FanoutWriter, JsonlSink, metric_history, read_jsonl

    path = tmp_path / "metrics.jsonl"
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    refs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        writer = FanoutWriter([JsonlSink(path)])
        with Vitals([NormMonitor(per_param="norm.*")], writer=writer, log_every_n_steps=1) as v:
            v.attach(model, opt)
            for step, ids in enumerate(_batches(2)):
                v.batch(ids)
                lm_loss(model, ids).backward()
                if step == 1:
                    model.up.bias.grad[0] = float("inf")
                refs[step] = float64_norms(list(model.parameters()))
                opt.step()
                opt.zero_grad()
    records = read_jsonl(path)
    grad = dict(metric_history(records, "l2_norm/grad/global"))
    param = dict(metric_history(records, "l2_norm/param/global"))
    count = dict(metric_history(records, "l2_norm/grad/nonfinite_count"))
    assert sorted(grad) == [0, 1]
    assert grad[0] == pytest.approx(refs[0][1], rel=REL)
    assert param[0] == pytest.approx(refs[0][0], rel=REL)
    assert param[1] == pytest.approx(refs[1][0], rel=REL)
    assert count == {0: 0, 1: 1}
    assert grad[1] == math.inf  # an Inf gradient makes the global norm Inf, stored as such
    assert {"l2_norm/grad/norm.weight", "l2_norm/grad/norm.bias"} <= set(records[0]["metrics"])


def test_lightning_default_writer_is_a_jsonl_file(tmp_path):
    pytest.importorskip("lightning.pytorch")
    from trainvitals.adapters import metric_history, read_jsonl

    data = torch.utils.data.TensorDataset(torch.cat(_batches(3)))
    module = _lightning_module_cls()()
    trainer = quiet_trainer(
        devices=1,
        max_steps=3,
        log_every_n_steps=2,
        callbacks=[NormMonitor()],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    (path,) = tmp_path.rglob("metrics.jsonl")
    grad = dict(metric_history(read_jsonl(path), "l2_norm/grad/global"))
    assert sorted(grad) == [0, 2]
    for step, value in grad.items():
        assert value == pytest.approx(module.refs[step][1], rel=REL)


class FullyShardedDataParallel(nn.Module):
    """Stands for torch's FSDP1 wrapper (NormMonitor recognises it by name)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._fsdp_wrapped_module = module

    def forward(self, ids):
        return self._fsdp_wrapped_module(ids)


def test_fsdp1_layout_writes_nothing_and_warns():
    torch.manual_seed(0)
    model = FullyShardedDataParallel(TiedLM())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    vitals = Vitals([NormMonitor()], writer=writer, log_every_n_steps=1)
    with pytest.warns(RuntimeWarning, match="FSDP1"), vitals:
        vitals.attach(model, opt)
        ids = _batches(1)[0]
        vitals.batch(ids)
        lm_loss(model, ids).backward()
        opt.step()
    assert writer.steps == {}


# ------------------------------------------------------------------ sparse gradients


def test_sparse_gradients_are_normed_exactly():
    # nn.Embedding(sparse=True) gives uncoalesced COO gradients (one entry per looked-up
    # token, indices repeated); their norm is that of the dense gradient.
    torch.manual_seed(0)
    embed = nn.Embedding(20, 4, sparse=True)
    head = nn.Linear(4, 1)
    model = nn.Sequential(embed, head)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    ids = torch.tensor([[1, 1, 2, 7, 7, 7]])
    with Vitals([NormMonitor(per_param="0.weight")], writer=writer, log_every_n_steps=1) as v:
        v.attach(model, opt)
        v.batch(ids)
        model(ids).pow(2).sum().backward()
        sparse = embed.weight.grad
        assert sparse.is_sparse and not sparse.is_coalesced()
        dense = [sparse.to_dense().double(), head.weight.grad.double(), head.bias.grad.double()]
        g_ref = math.sqrt(sum(float(g.pow(2).sum()) for g in dense))
        e_ref = float(dense[0].norm())
        opt.step()
    row = writer.steps[0]
    assert row["l2_norm/grad/global"] == pytest.approx(g_ref, rel=REL)
    assert row["l2_norm/grad/0.weight"] == pytest.approx(e_ref, rel=REL)
    assert row["l2_norm/grad/nonfinite_count"] == 0
    assert math.isfinite(row["l2_norm/param/global"])


def test_local_sq_norms_of_sparse_layouts():
    g = torch.Generator().manual_seed(2)
    dense = torch.randn(6, 5, generator=g) * (torch.rand(6, 5, generator=g) > 0.5)
    coo = torch.sparse_coo_tensor(
        torch.tensor([[0, 0, 3, 5], [1, 1, 2, 4]]), torch.tensor([1.5, -2.0, 3.0, 0.25]), (6, 5)
    )  # uncoalesced: (0, 1) twice
    tensors = [coo, dense.to_sparse_csr(), dense.to_sparse_csc()]
    got = local_sq_norms(tensors).tolist()
    for value, t in zip(got, tensors, strict=True):
        assert value == pytest.approx(float(t.to_dense().double().pow(2).sum()), rel=1e-6)


# ------------------------------------------------------------------ pipeline: a frozen stage


def _frozen_stage_body(rank: int, world_size: int) -> dict:
    from trainvitals.distributed import ProcessGroups, world_group

    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    if rank == 0:  # stage 0 trains nothing (a frozen stage), stage 1 trains
        model.requires_grad_(False)
    x = torch.randn(5, 4)
    writer = RecordingWriter()
    groups = ProcessGroups(pp=world_group())
    with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1, groups=groups) as v:
        v.attach(model, opt)
        for _ in range(2):
            v.batch(x)
            out = model(x).pow(2).sum()
            if out.requires_grad:
                out.backward()
            opt.step()
            opt.zero_grad()
    return {"steps": writer.steps}


@pytest.mark.timeout(180)
def test_a_frozen_pipeline_stage_still_joins_the_totals_collective():
    # A stage without trainable parameters that skipped the all-reduce over the pipeline
    # group left the other stages waiting in it.
    from tests.helpers.dist import run_distributed

    results = run_distributed(_frozen_stage_body, 2, timeout=120)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    model(torch.randn(5, 4).double()).pow(2).sum().backward()
    p_ref, g_ref = float64_norms(list(model.parameters()))
    for res in results:
        for step in (0, 1):
            row = res["steps"][step]
            assert row["l2_norm/param/global"] == pytest.approx(p_ref, rel=1e-6)
            assert row["l2_norm/grad/global"] == pytest.approx(g_ref, rel=1e-6)


# ------------------------------------------------------------------ state with flags in flight


def test_state_dict_waits_for_flags_still_in_flight():
    # On CUDA the non-finite flags reach the host through an asynchronous copy; a checkpoint
    # taken before it lands must still hold the step and names.
    from trainvitals.callbacks.norm_monitor import _PendingFlags, _Tracked

    class InFlight:
        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True

    monitor = NormMonitor()
    params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    monitor._tracked = [_Tracked(f"p{i}", p, ()) for i, p in enumerate(params)]
    flags = torch.tensor([False, True, True])
    names = [t.name for t in monitor._tracked]
    monitor._pending = _PendingFlags(7, names, flags, InFlight())
    monitor._report_pending(block=False)  # step_end: not arrived yet
    assert monitor.first_nonfinite_step is None
    with pytest.warns(RuntimeWarning, match="at step 7"):
        state = monitor.state_dict()
    expected = [f"p{i}" for i in flags.nonzero().flatten().tolist()]
    assert state == {
        "first_nonfinite_step": 7,
        "first_nonfinite_names": expected,
        "nonfinite_logging_steps": 1,
    }


# ------------------------------------------------------------------ complex parameters


def test_local_sq_norms_of_complex_tensors_count_the_imaginary_parts():
    # |z|**2 = re**2 + im**2: a cast to a real dtype dropped the imaginary part (about half
    # the sum of squares of a random tensor).
    g = torch.Generator().manual_seed(3)
    big = torch.randn(9000, dtype=torch.complex64, generator=g)
    tensors = [
        torch.randn(100, dtype=torch.complex64, generator=g),  # normed whole
        big,  # normed by rows
        torch.randn(120, 80, dtype=torch.complex64, generator=g).t(),  # not contiguous
        big.conj(),  # a lazily conjugated view
        torch.randn(50, dtype=torch.complex128, generator=g),
    ]
    got = local_sq_norms(tensors)
    for value, t in zip(got.tolist(), tensors, strict=True):
        ref = float((t.real.double().pow(2) + t.imag.double().pow(2)).sum())
        assert value == pytest.approx(ref, rel=1e-6)


def test_complex_parameter_norms_equal_float64_reference():
    torch.manual_seed(0)
    model = nn.Linear(6, 5, dtype=torch.complex64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    x = torch.randn(3, 6, dtype=torch.complex64)
    with Vitals([NormMonitor(per_param="weight")], writer=writer, log_every_n_steps=1) as v:
        v.attach(model, opt)
        v.batch(x)
        model(x).abs().pow(2).sum().backward()
        params = [p.detach().to(torch.complex128) for p in model.parameters()]
        grads = [p.grad.to(torch.complex128) for p in model.parameters()]
        p_ref = math.sqrt(sum(float(p.abs().pow(2).sum()) for p in params))
        g_ref = math.sqrt(sum(float(g.abs().pow(2).sum()) for g in grads))
        w_ref = float(grads[0].abs().pow(2).sum().sqrt())
        opt.step()
    row = writer.steps[0]
    assert row["l2_norm/param/global"] == pytest.approx(p_ref, rel=REL)
    assert row["l2_norm/grad/global"] == pytest.approx(g_ref, rel=REL)
    assert row["l2_norm/grad/weight"] == pytest.approx(w_ref, rel=REL)


# ------------------------------------------------------------------ requires_grad changes


def test_parameters_unfrozen_after_run_start_count_from_then_on():
    # Lightning's BackboneFinetuning freezes before training and unfreezes at a later epoch:
    # the trainable set is the one of the step being measured, not the one at run start.
    torch.manual_seed(0)
    model = TiedLM()
    model.up.requires_grad_(False)  # frozen at run start
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    monitor = NormMonitor(per_param=["up.*", "down.weight"])
    refs = {}
    with Vitals([monitor], writer=writer, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        for step, ids in enumerate(_batches(4)):
            if step == 2:
                model.up.requires_grad_(True)  # unfrozen
            if step == 3:
                model.down.requires_grad_(False)  # frozen again
                model.down.weight.grad = model.down.bias.grad = None
            vitals.batch(ids)
            lm_loss(model, ids).backward()
            trainable = [p for p in model.parameters() if p.requires_grad]
            refs[step] = float64_norms(trainable)
            refs[step, "up.weight"] = None if step < 2 else float(model.up.weight.grad.norm())
            opt.step()
            opt.zero_grad()
    for step in range(4):
        row = writer.steps[step]
        assert row["l2_norm/param/global"] == pytest.approx(refs[step][0], rel=REL)
        assert row["l2_norm/grad/global"] == pytest.approx(refs[step][1], rel=REL)
        if refs[step, "up.weight"] is None:
            assert "l2_norm/grad/up.weight" not in row
        else:
            assert row["l2_norm/grad/up.weight"] == pytest.approx(refs[step, "up.weight"], rel=REL)
        assert ("l2_norm/grad/down.weight" in row) == (step < 3)


def test_an_instance_reused_after_an_unsupported_layout_measures_the_next_run():
    # The refusal belongs to the run whose model had the layout, not to the instance.
    monitor = NormMonitor()
    torch.manual_seed(0)
    wrapped = FullyShardedDataParallel(TiedLM())
    first = RecordingWriter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Vitals([monitor], writer=first, log_every_n_steps=1) as vitals:
            vitals.attach(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1))
            ids = _batches(1)[0]
            vitals.batch(ids)
            lm_loss(wrapped, ids).backward()
            vitals.ctx.optimizers[0].step()
        assert first.steps == {}
        _, second, refs, _ = _run_driver(monitor, steps=2, interval=1)
    assert sorted(second.steps) == [0, 1]
    for step, row in second.steps.items():
        assert row["l2_norm/grad/global"] == pytest.approx(refs[step][1], rel=REL)
