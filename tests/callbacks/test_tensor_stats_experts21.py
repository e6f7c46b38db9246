"""TensorStatsMonitor: the fused experts modules of transformers 5.x MoE models are default
activation/dgrad sites (their 3-d expert weights have no ``nn.Linear`` to hook)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.callbacks.test_tensor_stats_monitor import check_line, read_lines
from tests.scripts.vitals_testing import RecordingWriter as Recorder
from trainvitals.adapters.loop import Vitals
from trainvitals.callbacks import TensorStatsMonitor

transformers = pytest.importorskip("transformers")

VOCAB = 64
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def tiny(family: str) -> nn.Module:
    """A one-layer model of ``family`` with four experts, two per token (from_config)."""
    t = transformers
    if family == "mixtral":
        cfg = t.MixtralConfig(
            **COMMON, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2
        )
        return t.MixtralForCausalLM(cfg)
    if family == "qwen3_moe":
        cfg = t.Qwen3MoeConfig(
            **COMMON,
            intermediate_size=8,
            moe_intermediate_size=8,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        return t.Qwen3MoeForCausalLM(cfg)
    if family == "olmoe":
        cfg = t.OlmoeConfig(
            **COMMON,
            intermediate_size=8,
            num_experts=4,
            num_experts_per_tok=2,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=None,
        )
        return t.OlmoeForCausalLM(cfg)
    assert family == "deepseek_v3"
    cfg = t.DeepseekV3Config(
        **COMMON,
        intermediate_size=8,
        moe_intermediate_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        n_shared_experts=1,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    )
    return t.DeepseekV3ForCausalLM(cfg)


FAMILIES = {
    "mixtral": "MixtralExperts",
    "qwen3_moe": "Qwen3MoeExperts",
    "olmoe": "OlmoeExperts",
    "deepseek_v3": "DeepseekV3Experts",
}
EXPERTS = "model.layers.0.mlp.experts"
SITES = (f"{EXPERTS}/input0", f"{EXPERTS}/output0")


class Capture:
    """The experts module's first argument and output, and their gradients, in float64, per
    micro-batch (hooks of the test's own, on the same tensors as the monitor's)."""

    def __init__(self, module: nn.Module) -> None:
        self.seen: dict[str, list[torch.Tensor]] = {}
        module.register_forward_hook(self._hook)

    def _keep(self, key: str, t: torch.Tensor) -> None:
        self.seen.setdefault(key, []).append(t.detach().double().flatten().clone())

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        # the hidden states; args[1] are the top-k expert indices (integers), args[2] weights
        x, y = args[0], output
        assert not args[1].is_floating_point()
        for site, t in zip(SITES, (x, y), strict=True):
            self._keep(f"activation/{site}", t)
            t.register_hook(lambda g, site=site: self._keep(f"dgrad/{site}", g))

    def whole(self, kind: str) -> dict[str, torch.Tensor]:
        return {s: torch.cat(self.seen[f"{kind}/{s}"]) for s in SITES}


def run(tmp: Path, model: nn.Module, monitor: TensorStatsMonitor, micro: int = 1) -> dict:
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. transformers' notes on the tiny configs
        with Vitals([monitor], writer=Recorder(), run_dir=tmp, log_every_n_steps=1) as vitals:
            vitals.attach(model, opt)
            for _ in range(micro):
                ids = torch.randint(0, VOCAB, (2, 6))
                vitals.batch(ids)
                (model(input_ids=ids, labels=ids).loss / micro).backward()
            opt.step()
            opt.zero_grad()
    return {r["kind"]: r for r in read_lines(tmp / "tensor_stats.jsonl")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_experts_are_default_sites_with_exact_moments(tmp_path: Path, family: str) -> None:
    # Before: the sites of these models were the attention projections, the router, the
    # embedding, lm_head (and DeepSeek's shared-expert Linears): nothing of the routed experts.
    torch.manual_seed(0)
    model = tiny(family)
    model.train()
    experts = model.get_submodule(EXPERTS)
    assert type(experts).__name__ == FAMILIES[family]
    assert not any(isinstance(m, nn.Linear) for m in experts.modules())
    records = run(
        tmp_path, model, TensorStatsMonitor(kinds=["activation", "dgrad"], kernel="eager")
    )
    for kind in ("activation", "dgrad"):
        names = set(records[kind]["tensors"])
        assert set(SITES) <= names, (kind, sorted(names))
        # the default sites stay: attention projections, router, embedding, lm_head
        assert "model.layers.0.mlp.gate/input0" in names
        assert "model.layers.0.self_attn.o_proj/output0" in names
        assert "lm_head/output0" in names
        # no site for the integer top-k indices or a third argument: input0/output0 only
        assert not {n for n in names if n.startswith(EXPERTS)} - set(SITES)
    # exact against float64 by hand: include= keeps only the experts' sites (also checks that
    # include still selects them); two micro-batches merged into one step
    torch.manual_seed(0)
    model = tiny(family)
    model.train()
    cap = Capture(model.get_submodule(EXPERTS))
    monitor = TensorStatsMonitor(
        kinds=["activation", "dgrad"], include=["*.experts/*"], kernel="eager"
    )
    records = run(tmp_path / "exact", model, monitor, micro=2)
    assert len(cap.seen[f"activation/{SITES[0]}"]) == 2
    check_line(records["activation"], cap.whole("activation"), f"{family}/activation")
    check_line(records["dgrad"], cap.whole("dgrad"), f"{family}/dgrad")


def test_exclude_and_user_module_types_still_rule(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny("mixtral")
    records = run(
        tmp_path / "exclude",
        model,
        TensorStatsMonitor(kinds=["activation"], exclude=["*experts/*"], kernel="eager"),
    )
    names = set(records["activation"]["tensors"])
    assert not {n for n in names if "experts" in n} and "lm_head/input0" in names
    # module_types= replaces the default set: Linear only, no router and no experts sites
    records = run(
        tmp_path / "types",
        model,
        TensorStatsMonitor(kinds=["activation"], module_types=nn.Linear, kernel="eager"),
    )
    names = set(records["activation"]["tensors"])
    assert not {n for n in names if "experts" in n or ".gate/" in n}
    assert "model.layers.0.self_attn.q_proj/input0" in names
    # ... and naming the experts class makes it the only site
    cls = type(model.get_submodule(EXPERTS))
    records = run(
        tmp_path / "experts_only",
        model,
        TensorStatsMonitor(kinds=["activation"], module_types=cls, kernel="eager"),
    )
    assert set(records["activation"]["tensors"]) == set(SITES)


class ToyExperts(nn.ModuleList):
    """Per-expert MLPs of nn.Linear (as NllbMoeExperts/SwitchTransformersExperts): the Linears
    are the sites; the list is not one (its tensors would count twice)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self)


class FlatExperts(nn.Module):
    """Expert weights kept in a child as 2-d ``[E * F, H]`` (as DbrxExperts' DbrxExpertGLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.w1 = nn.Parameter(torch.randn(3 * 5, 4))

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        w = self.mlp.w1.view(3, 5, 4)[index]  # [tokens, F, H]: each token's expert
        return torch.einsum("tfh,th->tf", w, x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.listed = ToyExperts([nn.Linear(4, 4) for _ in range(2)])
        self.flat = FlatExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = (x.abs().sum(-1) * 10).long() % 3
        return self.flat(self.listed(x), index).pow(2).mean()


def test_experts_rule_takes_flat_weights_not_a_list_of_linears(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    captured: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        captured["flat/input0"] = args[0].detach().double().clone()
        captured["flat/output0"] = output.detach().double().clone()

    model.flat.register_forward_hook(keep)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = TensorStatsMonitor(kinds=["activation"], kernel="eager")
    with Vitals([monitor], writer=Recorder(), run_dir=tmp_path, log_every_n_steps=1) as vitals:
        vitals.attach(model, opt)
        x = torch.randn(6, 4)
        vitals.batch(x)
        model(x).backward()
        opt.step()
    line = read_lines(tmp_path / "tensor_stats.jsonl")[0]
    want = {
        "listed.0/input0",
        "listed.0/output0",
        "listed.1/input0",
        "listed.1/output0",
        "flat/input0",
        "flat/output0",
    }
    assert set(line["tensors"]) == want
    flat = {n: line["tensors"][n] for n in ("flat/input0", "flat/output0")}
    check_line({**line, "tensors": flat}, captured, "flat")
