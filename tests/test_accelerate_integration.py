"""Vitals in an Accelerate script under ``torchrun --nproc_per_node 2`` (gloo, CPU): one step per
real optimizer step under gradient accumulation, global sums that count the rank with bigger
batches as such, and ``register_for_checkpointing`` save/load continuing counters and windows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.dist import torchrun
from tests.scripts.accelerate_vitals import ACC, SEQ, batch_size, step_seconds

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(out: Path, phase: int) -> None:
    torchrun(ROOT / "tests/scripts/accelerate_vitals.py", str(out), str(phase))


@pytest.mark.timeout(540)
def test_accelerate_torchrun_two_ranks_with_checkpoint_resume(tmp_path):
    _torchrun(tmp_path, 1)
    _torchrun(tmp_path, 2)
    total = sum(batch_size(r) for r in (0, 1))
    for rank in (0, 1):
        for phase, steps in ((1, range(0, 10)), (2, range(10, 20))):
            result = json.loads((tmp_path / f"rank{rank}_phase{phase}.json").read_text())
            assert result["step"] == steps[-1] + 1
            rows = {int(k): v for k, v in result["rows"].items()}
            assert sorted(rows) == [s for s in steps if s % 2 == 0]
            for step, row in rows.items():
                assert row["time/samples"] == ACC * total * (step + 1)
                assert row["time/tokens"] == ACC * total * SEQ * (step + 1)
                assert row["time/batches"] == 2 * ACC * (step + 1)
                train = ACC * sum(step_seconds(s) for s in range(step + 1))
                assert row["time/train_hours"] == pytest.approx(train / 3600, rel=1e-12)
                window = range(max(0, step - 2), step + 1)  # reaches into phase 1 at step 10
                seconds = ACC * sum(step_seconds(s) for s in window)
                assert row["throughput/samples_per_sec"] == pytest.approx(
                    ACC * total * len(window) / seconds, rel=1e-12
                )
                assert row["memory/rss_gb"] > 0
            if phase == 2:
                # Estimate continues: rate from steps 1..9 and 11..step, horizon 20.
                row = rows[18]
                rate_steps = [*range(1, 10), *range(11, 19)]
                rate = ACC * sum(step_seconds(s) for s in rate_steps) / len(rate_steps)
                assert row["time/seconds_per_step"] == pytest.approx(rate, rel=1e-12)
                assert row["time/remaining_hours"] == pytest.approx(rate / 3600, rel=1e-12)


def test_single_process_accumulation_and_clip_only_on_sync_steps():
    """In-process Accelerator: the driver sees one step per real optimizer step, and gradients
    are shown to the callbacks only on the micro-batch whose step is real, even when the loop
    clips on every micro-batch."""
    import torch
    from accelerate import Accelerator

    from tests.scripts.vitals_testing import RecordingWriter
    from tests.test_driver_loop import Recorder
    from trainvitals.adapters.accelerate import Vitals

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    rec = Recorder()
    vitals = Vitals([rec], accelerator=accelerator, writer=RecordingWriter())
    vitals.attach(model, optimizer)
    assert vitals.ctx.accumulate_grad_batches == 3
    for _ in range(9):
        x = torch.randn(2, 4)
        vitals.batch(x)
        with accelerator.accumulate(model):
            accelerator.backward(model(x).pow(2).mean())
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # every micro-batch
            optimizer.step()
            optimizer.zero_grad()
    vitals.close()
    assert vitals.step == 3
    assert [e for e in rec.events if e[0] == "end"] == [("end", s, 3) for s in range(3)]
    grads = [i for i, e in enumerate(rec.events) if e[0] == "grads"]
    mbs = [i for i, e in enumerate(rec.events) if e[0] == "mb"]
    # each step's gradients are seen after its third micro-batch started, never earlier
    assert [sum(m < g for m in mbs) for g in grads] == [3, 6, 9]


def test_accelerator_without_trackers_writes_jsonl_in_run_dir(tmp_path):
    import torch
    from accelerate import Accelerator

    from trainvitals.adapters import read_jsonl
    from trainvitals.adapters.accelerate import Vitals
    from trainvitals.callbacks.runtime_monitor import RuntimeMonitor

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    vitals = Vitals(
        [RuntimeMonitor(max_steps=3)],
        accelerator=accelerator,
        run_dir=tmp_path,
        log_every_n_steps=1,
    )
    vitals.attach(model, optimizer)
    for _ in range(3):
        x = torch.randn(5, 4)
        vitals.batch(x)
        accelerator.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
    vitals.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["metrics"]["time/samples"] for r in records] == [5, 10, 15]


def test_uneven_last_accumulation_window_with_a_tracker_and_clip_grad_norm(tmp_path):
    """An epoch of 10 batches under gradient_accumulation_steps=3 through a prepared
    DataLoader: Accelerate also steps at the end of the dataloader (sync_gradients), so each
    epoch has steps of 3, 3, 3 and 1 micro-batches. Every step reaches a user's GeneralTracker
    as Python floats, the global gradient norm is the float64 norm of the gradients the
    optimizer stepped with (the same value accelerator.clip_grad_norm_ returns), and the
    tracker is finished once, by end_training()."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.tracking import GeneralTracker

    from trainvitals.adapters.accelerate import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor
    from trainvitals.callbacks.runtime_monitor import RuntimeMonitor

    class RecordingTracker(GeneralTracker):
        name = "recording"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[dict[str, float], int | None]] = []
            self.finished = 0

        @property
        def tracker(self):
            return self

        def log(self, values, step=None, **kwargs):
            self.logged.append((dict(values), step))

        def finish(self):
            self.finished += 1

    tracker = RecordingTracker()
    try:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3, log_with=[tracker])
        accelerator.init_trackers("uneven")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        data = torch.utils.data.TensorDataset(torch.randn(20, 4), torch.randn(20, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=2)  # 10 batches per epoch
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        vitals = Vitals(
            [NormMonitor(), RuntimeMonitor(max_steps=8)],
            accelerator=accelerator,
            log_every_n_steps=1,
            run_dir=tmp_path,
        )
        vitals.attach(model, optimizer)
        grad_norms: list[float] = []  # float64, of the gradients each step used, unclipped
        clip_norms: list[float] = []
        batches: list[int] = []  # micro-batches consumed at the end of each step
        consumed = 0
        for _epoch in range(2):
            for x, y in loader:
                vitals.batch((x, y))
                consumed += 1
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        grads = [p.grad.double() for p in model.parameters()]
                        grad_norms.append(float(sum(g.pow(2).sum() for g in grads).sqrt()))
                        batches.append(consumed)
                        norm = accelerator.clip_grad_norm_(model.parameters(), 0.1)
                        clip_norms.append(float(norm))
                    optimizer.step()
                    optimizer.zero_grad()
        vitals.close()
        accelerator.end_training()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    assert batches == [3, 6, 9, 10, 13, 16, 19, 20]
    assert vitals.step == len(batches)
    assert tracker.finished == 1
    rows = {step: values for values, step in tracker.logged}
    assert sorted(rows) == list(range(len(batches)))
    for step, row in rows.items():
        assert all(type(v) is float for v in row.values())
        assert row["time/batches"] == batches[step]
        assert row["l2_norm/grad/global"] == pytest.approx(grad_norms[step], rel=1e-6)
        assert row["l2_norm/grad/global"] == pytest.approx(clip_norms[step], rel=1e-6)


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize(
    ("scaler", "clip"),
    [(False, "accelerator"), (True, "accelerator"), (True, "unscale_gradients"), (False, "vitals")],
)
def test_gan_clipping_each_network_with_accelerator_measures_it_at_its_own_step(scaler, clip):
    """A GAN on Accelerate clips each network with accelerator.clip_grad_norm_ right before its
    optimizer steps. Accelerate's unscale_gradients() (and its GradScaler) unscale every
    optimizer at the first clip, when the generator still holds the previous batch's gradients
    (none at the first batch): each network's gradients are shown at its own clip, as the
    optimizer uses them, never the generator's stale ones at the discriminator's clip. The
    same with accelerator.unscale_gradients(optimizer) before torch's clip_grad_norm_, and with
    Vitals.clip_grad_norm_. The GradScaler is the fp16 one Accelerate makes on CUDA, set up by
    hand on CPU; no RuntimeWarning (about scaled gradients) is raised."""

    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.adapters.accelerate import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor

    def unscaled_sq(net, scale):  # float64 sum of squares of the unscaled gradients
        return float(sum((p.grad.double() / scale).pow(2).sum() for p in net.parameters()))

    def clip_grad(net, optimizer):
        if clip == "accelerator":
            accelerator.clip_grad_norm_(net.parameters(), 100.0)
        elif clip == "unscale_gradients":
            accelerator.unscale_gradients(optimizer)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 100.0)
        else:
            vitals.clip_grad_norm_(net.parameters(), 100.0)

    try:
        if scaler:
            accelerator = Accelerator(cpu=True, mixed_precision="fp16")
            accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            accelerator.native_amp = True  # unscale_gradients() unscales, as on CUDA
        else:
            accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        gen = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        disc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt_d = torch.optim.SGD(disc.parameters(), lr=0.05)
        opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
        gen, disc, opt_g, opt_d = accelerator.prepare(gen, disc, opt_g, opt_d)
        assert (opt_d.scaler is not None) == scaler
        writer = RecordingWriter()
        vitals = Vitals(
            [NormMonitor()], accelerator=accelerator, writer=writer, log_every_n_steps=1
        )
        vitals.attach(torch.nn.ModuleDict({"g": gen, "d": disc}), [opt_d, opt_g])
        expected: list[tuple[float, float]] = []
        for _ in range(3):
            real, z = torch.randn(5, 4), torch.randn(5, 3)
            vitals.batch(real)
            opt_d.zero_grad()
            accelerator.backward(disc(gen(z).detach()).mean() - disc(real).mean())
            scale = accelerator.scaler.get_scale() if scaler else 1.0
            sq_d = unscaled_sq(disc, scale)
            clip_grad(disc, opt_d)
            opt_d.step()
            opt_g.zero_grad()
            accelerator.backward(-disc(gen(z)).mean())
            scale = accelerator.scaler.get_scale() if scaler else 1.0
            sq_g = unscaled_sq(gen, scale)
            clip_grad(gen, opt_g)
            opt_g.step()
            expected.append((sq_d, sq_g))
        vitals.close()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    assert sorted(writer.rows) == [0, 1, 2]
    for step, (sq_d, sq_g) in enumerate(expected):
        row = writer.rows[step]
        assert row["l2_norm/grad/optimizer_0"] == pytest.approx(sq_d**0.5, rel=1e-6)
        assert row["l2_norm/grad/optimizer_1"] == pytest.approx(sq_g**0.5, rel=1e-6)
        assert row["l2_norm/grad/global"] == pytest.approx((sq_d + sq_g) ** 0.5, rel=1e-6)


@pytest.mark.parametrize("skip", [False, True])
def test_fp16_gan_without_clipping_measures_each_network_at_its_scaler_step(tmp_path, skip):
    """A GAN on Accelerate under fp16, no clipping: each opt.step() is the scaler's step(inner)
    then update(). Each network's gradients are shown right after scaler.step unscales them,
    as that optimizer uses them (NormMonitor's and TensorStatsMonitor's grad values against
    the float64 unscaled gradients), also at a discriminator step the scaler skips (batch 1,
    an inf gradient), which stays in its batch's step although update() follows it at once.
    The GradScaler is the fp16 one Accelerate makes on CUDA, set up by hand on CPU."""
    import math
    import warnings

    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from tests.callbacks.test_tensor_stats_monitor import check_line, read_lines
    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.adapters.accelerate import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor
    from trainvitals.callbacks.tensor_stats_monitor import TensorStatsMonitor

    def unscaled(net, prefix):  # float64 gradients divided by the loss scale they carry
        scale = accelerator.scaler.get_scale()
        return {f"{prefix}.{n}": p.grad.double() / scale for n, p in net.named_parameters()}

    def sq(grads):
        return float(sum(float(g.pow(2).sum()) for g in grads.values()))

    try:
        accelerator = Accelerator(cpu=True, mixed_precision="fp16")
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        accelerator.native_amp = True
        torch.manual_seed(0)
        gen = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        disc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt_d = torch.optim.SGD(disc.parameters(), lr=0.05)
        opt_g = torch.optim.SGD(gen.parameters(), lr=0.05)
        gen, disc, opt_g, opt_d = accelerator.prepare(gen, disc, opt_g, opt_d)
        writer = RecordingWriter()
        vitals = Vitals(
            [NormMonitor(), TensorStatsMonitor(kinds=["grad"], kernel="eager")],
            accelerator=accelerator,
            writer=writer,
            run_dir=tmp_path,
            log_every_n_steps=1,
        )
        vitals.attach(torch.nn.ModuleDict({"d": disc, "g": gen}), [opt_d, opt_g])
        expected: list[tuple[dict, dict]] = []
        counted, skipped = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                real, z = torch.randn(5, 4), torch.randn(5, 3)
                vitals.batch(real)
                opt_d.zero_grad()
                accelerator.backward(disc(gen(z).detach()).mean() - disc(real).mean())
                if skip and step == 1:
                    disc[2].weight.grad[0, 3] = math.inf
                grads_d = unscaled(disc, "d")
                opt_d.step()
                skipped.append(opt_d.step_was_skipped)
                opt_g.zero_grad()
                accelerator.backward(-disc(gen(z)).mean())
                grads_g = unscaled(gen, "g")
                opt_g.step()
                counted.append(vitals.step)
                expected.append((grads_d, grads_g))
            vitals.close()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    assert skipped == [False, skip, False]
    assert counted == [0, 1, 2] and vitals.step == 3
    lines = [line for line in read_lines(tmp_path / "tensor_stats.jsonl") if line["kind"] == "grad"]
    assert sorted(writer.rows) == [line["step"] for line in lines] == [0, 1, 2]
    for step, (grads_d, grads_g) in enumerate(expected):
        row = writer.rows[step]
        sq_d, sq_g = sq(grads_d), sq(grads_g)
        if skip and step == 1:
            assert row["l2_norm/grad/optimizer_0"] == math.inf
            assert row["l2_norm/grad/global"] == math.inf
            assert row["l2_norm/grad/nonfinite_count"] == 1
        else:
            assert row["l2_norm/grad/optimizer_0"] == pytest.approx(sq_d**0.5, rel=1e-6)
            assert row["l2_norm/grad/global"] == pytest.approx((sq_d + sq_g) ** 0.5, rel=1e-6)
        assert row["l2_norm/grad/optimizer_1"] == pytest.approx(sq_g**0.5, rel=1e-6)
        check_line(lines[step], {**grads_d, **grads_g}, f"grad step {step}")
    assert not [w for w in caught if "still scaled" in str(w.message)]
