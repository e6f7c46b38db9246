"""MoEMetricsMonitor under pipeline parallelism (2 gloo ranks, one stage each): the mean over
the MoE layers divides by the MoE layers of every stage (found from the routers of all stages,
as without pipeline parallelism), not by every layer slot, and stage-local layer numbers (two
stages recording into the same slot, which the tracker's pipeline SUM would add together) are a
ValueError on every rank at run start. Numbers against float64 router losses recomputed here
from the routers' own inputs and weights."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from tests.callbacks.test_moe_metrics_monitor import ref_losses
from tests.helpers.dist import run_distributed
from tests.helpers.moe_models import HIDDEN, LOSS_COEFFS, VOCAB, tiny_moe_lm


def _lm(num_layers: int, pattern: list[int]) -> nn.Module:
    return tiny_moe_lm(num_layers=num_layers, moe_layer_freq=pattern, **LOSS_COEFFS)


class Stage(nn.Module):
    """The blocks ``keep`` of ``full`` (a TinyMoELM), under their global names ``layers.<i>``."""

    def __init__(self, full: nn.Module, keep: list[int]) -> None:
        super().__init__()
        self.embed = full.embed
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in keep})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.layers.values():
            h = block(h)
        return h.pow(2).mean()


def _capture(model: nn.Module) -> list[tuple[int, list, list]]:
    """(0-based global layer, router input, router weight) of every training forward."""
    from trainvitals.moe import TopKRouter

    seen: list[tuple[int, list, list]] = []
    for module in model.modules():
        if isinstance(module, TopKRouter):

            def hook(mod, args, out):
                if mod.training and torch.is_grad_enabled():
                    x = args[0].detach().double().reshape(-1, HIDDEN)
                    seen.append((mod.layer_number - 1, x.tolist(), mod.weight.double().tolist()))

            module.register_forward_hook(hook)
    return seen


def _train(model: nn.Module, rank: int) -> tuple[dict, list]:
    from tests.scripts.vitals_testing import RecordingWriter
    from trainvitals.adapters.loop import Vitals
    from trainvitals.callbacks import MoEMetricsMonitor
    from trainvitals.distributed import ProcessGroups, world_group
    from trainvitals.moe import MoEMetricsTracker, set_moe_metrics_tracker

    set_moe_metrics_tracker(MoEMetricsTracker())
    seen = _capture(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    monitor = MoEMetricsMonitor(per_layer_logging=True, writer=writer)
    vitals = Vitals([monitor], groups=ProcessGroups(pp=world_group()), log_every_n_steps=1)
    vitals.attach(model, opt)
    train_two_steps(vitals, model, opt)
    return writer.rows, seen


def train_two_steps(vitals, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """2 optimizer steps of 2 micro-batches of random tokens (the same tokens on every stage),
    then ``vitals.close()``."""
    gen = torch.Generator().manual_seed(7)  # the same tokens on both stages
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(2):  # 2 optimizer steps of 2 micro-batches
            for _ in range(2):
                x = torch.randint(0, VOCAB, (2, 6), generator=gen)
                vitals.batch(x)
                model(x).backward()
            opt.step()
            opt.zero_grad()
        vitals.close()


def _body(rank: int, world_size: int) -> dict:
    out: dict = {}
    keep = [0, 1] if rank == 0 else [2, 3]
    for name, pattern in (("alternate", [1, 0, 1, 0]), ("dense_first_stage", [0, 0, 1, 0])):
        out[name] = _train(Stage(_lm(4, pattern), keep), rank)
    # Stage-local numbering: each stage built as its own 2-layer model, so both stages'
    # first router has layer_number=1.
    try:
        _train(Stage(_lm(2, [1, 1]), [0, 1]), rank)
        out["local_numbers"] = None
    except ValueError as exc:
        out["local_numbers"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_body, 2, timeout=240)


@pytest.mark.parametrize(
    ("case", "moe_layers"), [("alternate", [0, 2]), ("dense_first_stage", [2])]
)
def test_pipeline_stages_average_over_every_stages_moe_layers(results, case, moe_layers):
    seen = [entry for r in results for entry in r[case][1]]  # both stages' router forwards
    # 2 steps x 2 micro-batches per MoE layer; 4 forwards per step of each layer
    per_step = {}
    for n, (layer, x, w) in enumerate(sorted(seen, key=lambda e: e[0])):
        step = (n % 4) // 2
        values = ref_losses(torch.tensor(x), torch.tensor(w))
        for name, value in values.items():
            per_step.setdefault((step, name, layer), []).append(value)
    for step in (0, 1):
        for name in ("load_balancing_loss", "z_loss"):
            layer_means = {
                layer: math.fsum(per_step[(step, name, layer)]) / 2 for layer in moe_layers
            }
            expected = {f"moe/{name}_layer_{i}": v for i, v in layer_means.items()}
            expected[f"moe/{name}"] = math.fsum(layer_means.values()) / len(moe_layers)
            for rank, r in enumerate(results):
                row = r[case][0][step]
                written = {k for k in row if k.startswith(f"moe/{name}")}
                assert written == set(expected), (rank, step, sorted(written))
                for key, value in expected.items():
                    assert row[key] == pytest.approx(value, rel=1e-4), (rank, step, key)


def test_stage_local_layer_numbers_are_an_error_on_every_rank(results):
    for r in results:
        message = r["local_numbers"]
        assert message is not None, "stage-local layer numbers were reduced into one slot"
        assert "pipeline stages 0 and 1" in message and "layer_number=1" in message
