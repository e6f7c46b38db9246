"""Defects a review found in session 21's own changes, each fixed with its test here:
``NormMonitor(group_by=...)`` labels gathered over pipeline stages before the expert-parallel
ranks (a stage without plain experts got another union, and the totals' all-reduce over the
stages had different lengths: gloo's "collective mismatch"); the natural order of a label with
a superscript digit; an uncollated list of samples counted as its first sample's tokens; a
``TinyMoELightningModule`` that could not be pickled after a manual-optimization fit raised."""

from __future__ import annotations

import math
import pickle

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from tests.callbacks.test_norm_monitor_helpers import RecordingWriter
from tests.helpers.shared_ranks import SharedRanks
from trainvitals._natural import natural_order
from trainvitals.adapters.context import infer_num_tokens
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks.norm_monitor import NormMonitor
from trainvitals.moe.tiny_model import RandomTokenDataset, TinyMoELightningModule

EXPERT = r"experts\.(\d+)\."


# ------------------------------------------------- pipeline stages x expert-parallel ranks

ranks = SharedRanks(__name__)
case_runs, ran = ranks.fixtures()


def _stage_model(rank: int) -> nn.Module:
    """Rank ``rank`` of pp {0,2},{1,3} x ep {0,1},{2,3}: stage 0 (ranks 0, 1) dense only; stage 1
    plain experts numbered globally, rank 2 experts 0-1 and rank 3 experts 2-3."""
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    layer = model.layers[0]
    layer.dense = nn.Linear(3, 3)
    if rank >= 2:
        first = 2 * (rank - 2)
        torch.manual_seed(10 + first)
        layer.experts = nn.ModuleDict({str(e): nn.Linear(3, 3) for e in (first, first + 1)})
    return model


def _stage_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    layer = model.layers[0]
    experts = getattr(layer, "experts", {})
    return layer.dense(x).pow(2).sum() + sum(e(x).pow(2).sum() for e in experts.values())


def _pp_ep_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from trainvitals.distributed import ProcessGroups

    pp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    ep = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    model = _stage_model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = NormMonitor(group_by=EXPERT, per_param_kinds=("grad", "param"))
    writer = RecordingWriter()
    groups = ProcessGroups(pp=pp, ep=ep, dp=ep)
    with Vitals([monitor], writer=writer, log_every_n_steps=1, groups=groups) as vitals:
        vitals.attach(model, opt)
        x = torch.ones(2, 3)
        vitals.batch(x)
        _stage_loss(model, x).backward()
        opt.step()
    return {k: float(v) for k, v in writer.steps[0].items() if "/group/" in k}


@pytest.mark.slow
@ranks.on_ranks(4, _pp_ep_body)
def test_expert_groups_under_pipeline_and_expert_parallelism_agree_on_every_rank(ran):
    _, results = ran
    want: dict[str, float] = {}
    for rank in (2, 3):  # the experts, in float64
        model = _stage_model(rank).double()
        _stage_loss(model, torch.ones(2, 3, dtype=torch.float64)).backward()
        for e, expert in model.layers[0].experts.items():
            params = list(expert.parameters())
            want[f"l2_norm/param/group/{e}"] = math.sqrt(sum(float(p.pow(2).sum()) for p in params))
            want[f"l2_norm/grad/group/{e}"] = math.sqrt(
                sum(float(p.grad.pow(2).sum()) for p in params)
            )
    assert len(want) == 8
    for got in results:  # every rank (the dense stage too) writes every expert's group
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6), key


# ------------------------------------------------------------------ single process


def test_labels_with_a_superscript_digit_sort_and_group():
    assert sorted(["10", "1²", "2", "1"], key=natural_order) == ["1", "1²", "2", "10"]
    model = nn.ModuleDict({"x1²": nn.Linear(2, 2), "x2": nn.Linear(2, 2)})
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    writer = RecordingWriter()
    with Vitals([NormMonitor(group_by=r"^x([^.]+)\.")], writer=writer, log_every_n_steps=1) as v:
        v.attach(model, opt)
        x = torch.ones(3, 2)
        v.batch(x)
        (model["x1²"](x).sum() + model["x2"](x).pow(2).sum()).backward()
        want = {
            name[1:]: math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in m.parameters()))
            for name, m in model.items()
        }
        opt.step()
    row = writer.steps[0]
    assert [k for k in row if "/group/" in k] == ["l2_norm/grad/group/1²", "l2_norm/grad/group/2"]
    for label, value in want.items():
        # (float32 gradients normed by torch's float32 kernels: ~1e-7)
        assert row[f"l2_norm/grad/group/{label}"] == pytest.approx(value, rel=1e-6)


def test_an_uncollated_list_of_samples_is_not_counted_as_its_first_sample():
    samples = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in (5, 6, 7)]
    assert infer_num_tokens(samples) is None  # (not 5: a third of the tokens)
    # a (features, labels) batch still counts its features' input_ids
    features = {"pixel_values": torch.zeros(3, 4, 8), "input_ids": torch.ones(3, 5).long()}
    assert infer_num_tokens((features, torch.zeros(3, dtype=torch.long))) == 15
    assert infer_num_tokens([features, torch.zeros(3, dtype=torch.long)]) == 15


class _Manual(TinyMoELightningModule):
    """Manual optimization, its second batch raising after its step."""

    def __init__(self) -> None:
        super().__init__(
            lr=1e-2, vocab_size=16, hidden_size=8, num_layers=1, num_experts=4, top_k=2
        )
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        if batch_idx == 1:
            raise RuntimeError("boom")
        return loss


def test_tiny_moe_module_pickles_after_a_manual_optimization_fit_raised(tmp_path):
    module = _Manual()
    loader = torch.utils.data.DataLoader(
        RandomTokenDataset(num_samples=8, seq_len=6, vocab_size=16), batch_size=2
    )
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(module, loader)
    copy = pickle.loads(pickle.dumps(module))  # (on_train_end never ran)
    for a, b in zip(copy.state_dict().values(), module.state_dict().values(), strict=True):
        assert torch.equal(a, b)
