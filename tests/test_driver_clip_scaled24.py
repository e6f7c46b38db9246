"""``vitals.clip_grad_norm_`` called before the attached GradScaler unscaled the gradients
(torch's AMP recipe calls ``scaler.unscale_(optimizer)`` first). The driver showed the
gradients there, still multiplied by the loss scale: every grad norm and every ``grad`` tensor
statistic was the scale (1024 here) times too large, without a word. Now such a step shows no
gradients (warned once), as the driver already does for other scaled gradients; with
``scaler.unscale_`` first the gradients are shown unscaled and unclipped, exactly."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import NormMonitor, TensorStatsMonitor

SCALE = 1024.0


def _norm64(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


def _train(tmp_path, unscale_first: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    writer = RecordingWriter()
    monitors = [NormMonitor(), TensorStatsMonitor(kinds=("grad",), kernel="eager")]
    unscaled: list[dict[str, torch.Tensor]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals(monitors, writer=writer, run_dir=tmp_path, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt, scaler=scaler)
            for _ in range(3):
                x = torch.randn(16, 8)
                vitals.batch(x)
                scaler.scale(model(x).pow(2).mean()).backward()
                if unscale_first:
                    scaler.unscale_(opt)
                scale = 1.0 if unscale_first else scaler.get_scale()
                unscaled.append(
                    {n: p.grad.detach().double() / scale for n, p in model.named_parameters()}
                )
                vitals.clip_grad_norm_(model.parameters(), 1e-3)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
    path = tmp_path / "tensor_stats.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    messages = [str(w.message) for w in caught if "clip_grad_norm_" in str(w.message)]
    return writer.rows, lines, unscaled, messages


def test_clipping_before_unscale_shows_no_gradients(tmp_path):
    rows, lines, _, messages = _train(tmp_path, unscale_first=False)
    assert len(messages) == 1 and "scaler.unscale_(optimizer)" in messages[0]
    for step in range(3):
        assert not [k for k in rows.get(step, {}) if k.startswith("l2_norm/grad/")]
    assert not [line for line in lines if line["kind"] == "grad"]


def test_clipping_after_unscale_shows_the_unscaled_unclipped_gradients(tmp_path):
    rows, lines, unscaled, messages = _train(tmp_path, unscale_first=True)
    assert not messages
    for step in range(3):
        # (tensors under 8192 elements are normed in float32: docs/norms.md, below 5e-7)
        expected = _norm64(unscaled[step].values())
        assert rows[step]["l2_norm/grad/global"] == pytest.approx(expected, rel=1e-6)
        (line,) = [r for r in lines if r["kind"] == "grad" and r["step"] == step]
        for name, grad in unscaled[step].items():
            count, mean = line["tensors"][name][:2]
            assert count == grad.numel()
            assert mean == pytest.approx(float(grad.mean()), rel=1e-5, abs=1e-9)
