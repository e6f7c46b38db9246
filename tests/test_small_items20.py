"""Session 20 small items: expert biases left alone on a step fp16's GradScaler skipped, the
HTML report's count phrases and its last-step tables, and the JSONL sink's resume message."""

from __future__ import annotations

import json
import logging
import math
import warnings

import pytest
import torch

from tests.helpers.moe_models import fresh_tracker_fixture, tiny_moe_kwargs

fresh_tracker = fresh_tracker_fixture()


# --------------------------------------------------------------------------------------------
# 1. TinyMoELightningModule: a skipped optimizer step does not move the expert biases


def record_router_loads(module) -> tuple[list, list[list[torch.Tensor]]]:
    """A TinyMoE module's routers, and per router the tokens per expert (float64) of each
    training forward, recorded by forward hooks (the expected bias updates follow from them)."""
    routers = [r for _, r in module.model.routers()]
    loads: list[list[torch.Tensor]] = [[] for _ in routers]  # per router, per step (float64)
    for router, seen in zip(routers, loads, strict=True):
        router.register_forward_hook(
            lambda mod, args, out, seen=seen: (
                seen.append(out[1].detach().reshape(-1, out[1].shape[-1]).double().sum(dim=0))
                if mod.training
                else None
            )
        )
    return routers, loads


@pytest.mark.parametrize("fused", [False, True])
def test_lightning_16_mixed_skipped_step_leaves_expert_biases_alone(tmp_path, fused):
    # fused=True: an optimizer that unscales itself; GradScaler.step always calls its step(),
    # which skips inside (its step post hook runs either way: the biases moved before)
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from trainvitals.moe.tiny_model import RandomTokenDataset, TinyMoELightningModule

    rate = 0.125  # a power of two: the float32 bias holds the expected steps exactly

    class InfFirstStep(TinyMoELightningModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            # step 0: infinite loss, so non-finite gradients and GradScaler skips the step
            return loss * math.inf if batch_idx == 0 else loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=fused)

    torch.manual_seed(0)
    module = InfFirstStep(
        **tiny_moe_kwargs(num_layers=2, expert_bias=True, bias_update_rate=rate, z_loss_coeff=0.0)
    )
    routers, loads = record_router_loads(module)

    class Record(pl.Callback):
        def __init__(self):
            self.biases, self.weights, self.scales = [], [], []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.biases.append([r.expert_bias.detach().double().clone() for r in routers])
            self.weights.append(pl_module.model.lm_head.weight.detach().clone())
            self.scales.append(trainer.precision_plugin.scaler.get_scale())

    record = Record()
    initial_weight = module.model.lm_head.weight.detach().clone()
    loader = torch.utils.data.DataLoader(RandomTokenDataset(4, 8, 32, seed=3), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[MixedPrecision("16-mixed", device="cpu")],
        max_steps=2,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, loader)

    # the scaler did skip step 0 (weights unchanged, scale backed off) and took step 1
    assert torch.equal(record.weights[0], initial_weight)
    assert not torch.equal(record.weights[1], initial_weight)
    assert record.scales == [2.0**15, 2.0**15]
    for bias_0, bias_1, seen in zip(*record.biases, loads, strict=True):
        assert len(seen) == 2
        # skipped step: the biases stay at their initial zeros (before: moved by +-rate)
        assert torch.equal(bias_0, torch.zeros_like(bias_0))
        # step 1 moves them once, on the loads of both steps (the router did not change)
        load = seen[0] + seen[1]
        want = torch.sign(load.mean() - load) * rate
        assert torch.equal(bias_1, want)


# --------------------------------------------------------------------------------------------
# 2. trainvitals report: count phrases, and the last-step tables of a kind


def _empty_record(step: int, kind: str = "grad") -> str:
    from trainvitals.stats.moments import FIELDS

    rec = {"version": 1, "step": step, "kind": kind, "time": 0.0, "fields": list(FIELDS)}
    return json.dumps(rec | {"tensors": {}}) + "\n"


def test_report_counts_of_one_are_singular(tmp_path):
    from tests.report.test_query_cli import write_run
    from trainvitals.adapters import FanoutWriter, JsonlSink
    from trainvitals.report import render_report

    write_run(tmp_path, [4], lambda s: {"layers.0.w": torch.arange(6.0)})
    with FanoutWriter([JsonlSink(tmp_path / "metrics.jsonl")]) as writer:
        for step in (3, 4):
            writer.add_scalars({"train/loss": 1.0 + step}, step)
    text = render_report(tmp_path)
    assert f"{tmp_path / 'tensor_stats.jsonl'} (1 line)" in text  # before: (1 lines)
    assert "<small>1 step, 1 tensor</small>" in text  # before: 1 steps, 1 tensors
    assert "step 4: the 1 tensor</summary>" in text  # before: each of the 1 tensors
    assert "<small>1 key</small>" in text and "table of the 1 key (" in text  # before: keys
    assert "1 lines" not in text and "1 keys" not in text and "1 tensors" not in text


def test_report_last_step_tables_are_of_the_last_step_with_tensors(tmp_path):
    from tests.report.test_html_report import Page
    from tests.report.test_query_cli import write_run
    from trainvitals.report import render_report

    data = write_run(
        tmp_path,
        [0, 1],
        lambda s: {
            "layers.0.w": torch.randn(5, 3, generator=torch.Generator().manual_seed(s)),
            "layers.1.w": 2 + torch.randn(7, generator=torch.Generator().manual_seed(10 + s)),
        },
    )
    with open(tmp_path / "tensor_stats.jsonl", "a") as f:
        f.write(_empty_record(2))  # the last step of "grad": a record without tensors
        f.write(_empty_record(2, "param"))  # "param": no step with tensors at all
    text = render_report(tmp_path)
    page = Page(text)
    rows = page.rows("tensors-layers grad")  # before: no rows at all (the tables of step 2)
    assert list(rows) == ["all", "0", "1"]
    pooled = torch.cat([t.reshape(-1).double() for t in data[1].values()])
    assert rows["all"]["tensors"] == 2 and rows["all"]["count"] == pooled.numel()
    assert rows["all"]["mean"] == pytest.approx(pooled.mean().item(), rel=1e-12)
    assert rows["all"]["min"] == pooled.min().item() and rows["all"]["max"] == pooled.max().item()
    assert rows["1"]["mean"] == pytest.approx(data[1]["layers.1.w"].double().mean().item())
    assert set(page.rows("tensors-each grad")) == {"layers.0.w", "layers.1.w"}
    assert "<small>3 steps, 2 tensors</small>" in text and "<h3>step 1: " in text
    # a kind none of whose records holds tensors says so instead of showing empty tables
    section = text[text.index('data-kind="param"') :]
    assert section.index("No step of this kind holds tensors.") < section.index("</section>")
    assert "tensors-layers param" not in page.tables and "tensors-each param" not in page.tables


# --------------------------------------------------------------------------------------------
# 3. JsonlSink: the lines after the checkpoint's step are an INFO log on a resume, not a warning


def _jsonl_run(path, steps, value, resume_at=None):
    from trainvitals.adapters import FanoutWriter, JsonlSink

    with FanoutWriter([JsonlSink(path)], rank=0) as writer:
        if resume_at is not None:
            writer.resume_at(resume_at)
        for step in steps:
            writer.add_scalar("loss", value(step), step)


def _jsonl_losses(path):
    from trainvitals.adapters import read_jsonl

    return [(r["step"], r["metrics"]["loss"]) for r in read_jsonl(path)]


def test_jsonl_resume_drop_after_the_checkpoint_is_an_info_log(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    _jsonl_run(path, range(10), float)  # the interrupted run: steps 0..9, checkpoint at 6
    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, "trainvitals"):
        warnings.simplefilter("error", RuntimeWarning)  # before: a RuntimeWarning
        _jsonl_run(path, [6, 8], lambda s: -float(s), resume_at=6)
    logged = [r for r in caplog.records if "dropped" in r.message]
    assert [(r.name, r.levelno) for r in logged] == [
        ("trainvitals.adapters.sinks.jsonl", logging.INFO)
    ]
    assert "dropped 4 line(s) of steps >= 6" in logged[0].message  # steps 6, 7, 8, 9
    assert _jsonl_losses(path) == [(s, float(s)) for s in range(6)] + [(6, -6.0), (8, -8.0)]


@pytest.mark.parametrize("case", ["cut_by_a_crash", "below_the_checkpoint", "undeclared"])
def test_jsonl_unexpected_drops_still_warn(tmp_path, caplog, case):
    path = tmp_path / "metrics.jsonl"
    _jsonl_run(path, range(10), float)
    if case == "cut_by_a_crash":  # a line cut mid-write: not the checkpoint's lines only
        with open(path, "a") as f:
            f.write('{"step":10,"time":1.0,"metrics":{"lo')
        steps, resume_at, want = [6], 6, r"dropped 5 line\(s\) of steps >= 6"
    elif case == "below_the_checkpoint":  # declared 7, first logs 5: steps 5, 6 dropped too
        steps, resume_at, want = [5], 7, r"dropped 5 line\(s\) of steps >= 5"
    else:  # no resume_at: the sink guesses from its first step
        steps, resume_at, want = [6], None, r"dropped 4 line\(s\) of steps >= 6"
    with caplog.at_level(logging.INFO, "trainvitals"), pytest.warns(RuntimeWarning, match=want):
        _jsonl_run(path, steps, lambda s: -float(s), resume_at=resume_at)
    assert not [r for r in caplog.records if "dropped" in r.message]  # once, as a warning
    kept = min(steps[0], 6 if resume_at is None else resume_at)
    assert _jsonl_losses(path) == [(s, float(s)) for s in range(kept)] + [
        (s, -float(s)) for s in steps
    ]


def test_metrics_source_of_one_line_is_singular(tmp_path):
    from trainvitals.report.sources import load_metrics

    path = tmp_path / "metrics.jsonl"
    for lines in (1, 2):
        path.write_text(
            "".join(
                json.dumps({"step": s, "time": 1.0, "metrics": {"a": 1.0}}) + "\n"
                for s in range(lines)
            )
        )
        src = load_metrics(path, lambda key: True, None, None)
        assert src.description == f"{path} ({lines} line{'s' * (lines > 1)})"  # before: 1 lines
