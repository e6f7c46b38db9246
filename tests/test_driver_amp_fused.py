"""The Vitals driver with a fused optimizer under a ``torch.amp.GradScaler``: such an optimizer
unscales its gradients inside its own ``step()`` (the scaler hands it the scale), so at its
step pre-hook they are still multiplied by the loss scale. The callbacks must not see them
there; after an explicit ``scaler.unscale_(optimizer)`` they are unscaled and shown."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.scripts.vitals_testing import RecordingWriter
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.norm_monitor import NormMonitor

SCALE = 1024.0


def _run(explicit_unscale: bool) -> tuple[RecordingWriter, list[float], list[str]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    assert optimizer._step_supports_amp_scaling  # (the path under test)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    writer = RecordingWriter()
    expected: list[float] = []  # float64 norm of the unscaled gradients each step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Vitals([NormMonitor()], writer=writer, log_every_n_steps=1) as vitals:
            vitals.attach(model, optimizer, scaler=scaler)
            for _ in range(3):
                x = torch.randn(5, 4)
                vitals.batch(x)
                scaler.scale(model(x).pow(2).sum()).backward()
                expected.append(
                    sum(float((p.grad.double() / SCALE).pow(2).sum()) for p in model.parameters())
                    ** 0.5
                )
                if explicit_unscale:
                    scaler.unscale_(optimizer)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
    return writer, expected, [str(w.message) for w in caught if w.category is RuntimeWarning]


def test_a_fused_optimizer_stepped_by_the_scaler_shows_no_scaled_gradients():
    # before: l2_norm/grad/global was the scaled norm, 1024x the true one
    writer, expected, warned = _run(explicit_unscale=False)
    grads = {
        s: r["l2_norm/grad/global"] for s, r in writer.rows.items() if "l2_norm/grad/global" in r
    }
    assert grads == {}, {s: (g, expected[s]) for s, g in grads.items()}
    assert sum("fused" in w for w in warned) == 1  # warned once


def test_a_fused_optimizer_unscaled_by_the_loop_first_is_measured():
    writer, expected, warned = _run(explicit_unscale=True)
    assert sorted(writer.rows) == [0, 1, 2]
    for step, row in writer.rows.items():
        assert row["l2_norm/grad/global"] == pytest.approx(expected[step], rel=1e-5)
    assert not any("fused" in w for w in warned)
