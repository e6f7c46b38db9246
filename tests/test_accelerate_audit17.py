"""Accelerate audit (session 17): the Vitals driver under an ``Accelerator`` with several
optimizers sharing its fp16 GradScaler."""

from __future__ import annotations

import math

import pytest


def test_fp16_two_optimizers_clipped_together_report_the_unclipped_unscaled_norms():
    """Two prepared models, two optimizers, Accelerate's fp16 GradScaler (set up by hand on CPU,
    as on CUDA), accumulation over 2 micro-batches, ``accelerator.clip_grad_norm_`` over every
    parameter before both optimizers step. Accelerate's ``opt.step()`` is ``scaler.step(inner)``
    then ``scaler.update()``, so the second optimizer's ``scaler.step`` unscales its (already
    unscaled and clipped) gradients a second time. NormMonitor must report the norms the clip
    measured: float64, unscaled, before clipping (what ``clip_grad_norm_`` returns), over both
    optimizers' parameters, and count every non-finite gradient of an overflowing step."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.adapters.accelerate import Vitals
    from trainvitals.callbacks.norm_monitor import NormMonitor

    overflow_batch = 3  # the second step's last micro-batch: an inf loss
    expected: list[tuple[float, float, float]] = []  # (norms of a, of b; clip's return)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="fp16", gradient_accumulation_steps=2)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        accelerator.native_amp = True  # unscale_gradients() unscales, as on CUDA
        torch.manual_seed(0)
        net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)
        opt_a = torch.optim.SGD(net_a.parameters(), lr=0.1)
        opt_b = torch.optim.AdamW(net_b.parameters(), lr=0.1)
        data = torch.utils.data.TensorDataset(torch.randn(36, 4))
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        net_a, net_b, opt_a, opt_b, loader = accelerator.prepare(net_a, net_b, opt_a, opt_b, loader)
        writer = RecordingWriter()
        vitals = Vitals(
            [NormMonitor()], accelerator=accelerator, writer=writer, log_every_n_steps=1
        )
        vitals.attach(torch.nn.ModuleDict({"a": net_a, "b": net_b}), [opt_a, opt_b])
        params = [*net_a.parameters(), *net_b.parameters()]
        for i, (x,) in enumerate(loader):
            vitals.batch((x,))
            with accelerator.accumulate(net_a, net_b):
                loss = net_b(torch.relu(net_a(x))).pow(2).mean()
                if i == overflow_batch:
                    loss = loss * math.inf
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    scale = accelerator.scaler.get_scale()
                    sq = [float((p.grad.double() / scale).pow(2).sum()) for p in params]
                    total = accelerator.clip_grad_norm_(params, 0.05)
                    expected.append((sum(sq[:2]) ** 0.5, sum(sq[2:]) ** 0.5, float(total)))
                opt_a.step()
                opt_b.step()
                opt_a.zero_grad()
                opt_b.zero_grad()
        vitals.close()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()

    # 9 micro-batches, 2 per step, the last one alone at the end of the loader: 5 steps
    assert len(expected) == 5
    assert sorted(writer.rows) == [0, 1, 2, 3, 4]
    for step, (norm_a, norm_b, total) in enumerate(expected):
        row = writer.rows[step]
        if step == 1:  # the overflow: every gradient holds inf
            assert row["l2_norm/grad/nonfinite_count"] == 4
            assert math.isnan(row["l2_norm/grad/global"]) and math.isnan(total)
            continue
        assert row["l2_norm/grad/nonfinite_count"] == 0
        assert total > 0.05  # the clip scaled them down: the reported norm is before it
        assert row["l2_norm/grad/global"] == pytest.approx(math.hypot(norm_a, norm_b), rel=1e-6)
        assert row["l2_norm/grad/global"] == pytest.approx(total, rel=1e-6)
        # shown all at once (the clip of every optimizer's parameters): no per-optimizer keys
        assert not any("optimizer_" in key for key in row)
