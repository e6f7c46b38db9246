"""Router capture, audit 17: the labels of an encoder-decoder MoE (Switch Transformers) say
which stack a router is in, and the aux loss of the Hugging Face Switch-loss families uses the
top-k and probabilities that transformers' ``load_balancing_loss_func`` uses (a softmax in the
logits' dtype: bf16 near ties pick other experts than the router's float32 softmax), while the
loads stay the router's own selection."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers.moe_models import HF_TINY, HF_VOCAB, tiny_switch_transformers
from trainvitals.moe.capture import RouterCapture, find_routers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

VOCAB = HF_VOCAB
E, K = 8, 2


# ---------------------------------------------------------------- labels of two stacks


def _switch_model(sparse_encoder: int, sparse_decoder: int) -> nn.Module:
    return tiny_switch_transformers(
        VOCAB, num_sparse_encoder_layers=sparse_encoder, num_sparse_decoder_layers=sparse_decoder
    )


def test_switch_transformers_labels_name_the_stack() -> None:
    capture = RouterCapture(_switch_model(4, 4))  # every block of both stacks sparse
    names = [r.name for r in capture.routers]
    # every encoder block number is also a decoder block number: each such pair is labelled
    # with the full module names (they differ in the stack, not in a router index)
    expected = {n: n.replace(".", "_") for n in names}
    assert capture.layer_labels == [expected[n] for n in names]
    for r in capture.routers:
        stack = r.name.split(".")[0]
        assert stack in ("encoder", "decoder")
        assert r.label.startswith(stack + "_block_")
    # order stays numeric by block (then by the rest of the name): encoder and decoder block b
    # side by side
    assert [r.layer for r in capture.routers] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_switch_transformers_unmatched_block_keeps_its_number() -> None:
    # sparse encoder block 1; sparse decoder blocks 1 and 3: only block 1 is in both stacks
    capture = RouterCapture(_switch_model(1, 2))
    assert [(r.name, r.label) for r in capture.routers] == [
        ("encoder.block.1.layer.1.mlp.router", "encoder_block_1_layer_1_mlp_router"),
        ("decoder.block.1.layer.2.mlp.router", "decoder_block_1_layer_2_mlp_router"),
        ("decoder.block.3.layer.2.mlp.router", "3"),  # no clash: the block number
    ]


class _Gate(nn.Module):
    num_experts = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _counts(module: nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
    return torch.zeros(3)


def test_routers_of_one_block_keep_integer_labels_and_stacks_get_names() -> None:
    model = nn.Module()
    model.encoder = nn.ModuleList([nn.Module() for _ in range(2)])
    model.decoder = nn.ModuleList([nn.Module() for _ in range(2)])
    for i in range(2):
        model.encoder[i].sub = nn.ModuleList([_Gate(), _Gate()])  # two routers of one block
        model.decoder[i].ffn = nn.ModuleList([nn.Module(), _Gate()])  # one, at sub-index 1
    routers = find_routers(model, extractors=[(_Gate, _counts, 3)])
    by_name = {r.name: r.label for r in routers}
    # block i: encoder.i.sub.0, encoder.i.sub.1 and decoder.i.ffn.1 share the number i; the
    # integers of the names would give encoder i_0, i_1 and decoder i_1, which clashes with
    # the encoder's second router and says nothing of the stack: full names
    for i in range(2):
        assert by_name[f"encoder.{i}.sub.0"] == f"encoder_{i}_sub_0"
        assert by_name[f"encoder.{i}.sub.1"] == f"encoder_{i}_sub_1"
        assert by_name[f"decoder.{i}.ffn.1"] == f"decoder_{i}_ffn_1"

    single = nn.Module()
    single.layers = nn.ModuleList([nn.Module() for _ in range(2)])
    for i in range(2):
        single.layers[i].experts = nn.ModuleList([_Gate(), _Gate()])
    labels = [r.label for r in find_routers(single, extractors=[(_Gate, _counts, 3)])]
    assert labels == ["0_0", "0_1", "1_0", "1_1"]  # one stack: all the integers of the name


# ---------------------------------------------------------------- bf16 loss top-k


def _hf_loss_term(logits: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """transformers' own Mixtral load_balancing_loss_func of one layer, / top_k."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return float(load_balancing_loss_func((logits,), E, K, mask)) / K


def test_bf16_near_tie_loss_counts_are_transformers_not_the_routers() -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = transformers.MixtralConfig(hidden_size=E, num_local_experts=E, num_experts_per_tok=K)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].gate = MixtralTopKRouter(config).to(torch.bfloat16)
    with torch.no_grad():  # logits = the input exactly (products with 1 and 0)
        model.layers[0].gate.weight.copy_(torch.eye(E))
    capture = RouterCapture(model)
    model.train()
    # per token: expert 0 clearly first; experts 3 and 5 one bf16 step apart for the second
    # place (5 above 3), their probabilities equal once rounded to bf16
    logits = torch.full((6, E), -1.0, dtype=torch.bfloat16)
    logits[:, 0] = 1.0
    low = torch.tensor(0.1, dtype=torch.bfloat16)
    logits[:, 3] = low
    logits[:, 5] = (low.view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 number
    own_indices = model.layers[0].gate(logits)[2]
    # the premise: transformers' loss (bf16 softmax) and the router (float32 softmax) differ
    loss_topk = torch.softmax(logits, dim=-1).topk(K, dim=-1).indices
    router_topk = torch.softmax(logits.float(), dim=-1).topk(K, dim=-1).indices
    assert not torch.equal(loss_topk.sort(-1).values, router_topk.sort(-1).values)
    assert torch.equal(own_indices, router_topk)

    # the loads: the router's own selection, experts 0 and 5 for every token
    own = np.bincount(own_indices.reshape(-1).numpy(), minlength=E)
    np.testing.assert_array_equal(capture.loads().numpy()[0], own)
    assert own[5] == 6 and own[3] == 0
    # the aux loss: transformers' value, with its own (bf16) top-k and probabilities
    aux_sum, aux_count = capture.aux_losses()
    assert int(aux_count[0]) == 1
    np.testing.assert_allclose(float(aux_sum[0]), _hf_loss_term(logits), rtol=1e-6)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss", "phimoe"])
def test_bf16_model_aux_loss_equals_transformers_with_padding(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    torch.manual_seed(0)
    sizes = dict(num_hidden_layers=2, num_experts=E, num_local_experts=E, num_experts_per_tok=K)
    sizes |= dict(max_position_embeddings=128, router_aux_loss_coef=1.0)
    config = CONFIG_MAPPING[model_type](**HF_TINY | sizes)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    capture = RouterCapture(model)
    own: dict[str, list[torch.Tensor]] = {r.name: [] for r in capture.routers}
    for r in capture.routers:  # the routers' own selection, by a hook of the test's own
        r.module.register_forward_hook(
            lambda m, i, out, n=r.name: own[n].append(out[2].detach().clone())
        )
    model.train()
    gen = torch.Generator().manual_seed(1)
    mask = torch.ones(4, 64, dtype=torch.long)
    mask[1, 40:] = 0
    mask[3, :10] = 0
    x = torch.randint(3, VOCAB, (4, 64), generator=gen)
    out = model(input_ids=x, attention_mask=mask, output_router_logits=True)
    expected_aux = [_hf_loss_term(lg.detach(), mask) for lg in out.router_logits]
    # bf16 near ties: the loss's top-k differs from the float32 one somewhere
    differ = sum(
        int(
            (
                torch.bincount(torch.softmax(lg, -1).topk(K, -1).indices.reshape(-1), minlength=E)
                - torch.bincount(
                    torch.softmax(lg.float(), -1).topk(K, -1).indices.reshape(-1), minlength=E
                )
            )
            .abs()
            .sum()
        )
        for lg in out.router_logits
    )
    assert differ > 0
    aux_sum, aux_count = capture.aux_losses()
    np.testing.assert_array_equal(aux_count.numpy(), [1, 1])
    np.testing.assert_allclose(aux_sum.numpy(), expected_aux, rtol=1e-6)
    valid = mask.reshape(-1).bool()
    for row, r in enumerate(capture.routers):
        (indices,) = own[r.name]
        expected = np.bincount(indices[valid].reshape(-1).numpy(), minlength=E)
        np.testing.assert_array_equal(capture.loads().numpy()[row], expected)


# ---------------------------------------------------------------- more transformers families

FAMILY_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    top_k_experts=2,
    enable_moe_block=True,  # Gemma 4
    max_position_embeddings=64,
    pad_token_id=0,
    use_cache=False,
    router_aux_loss_coef=1.0,
)
# model type -> the router classes its MoE layers have
MORE_FAMILIES = {
    "gemma4_text": {"Gemma4TextRouter"},  # no num_experts attribute: E is proj.out_features
    "deepseek_v4": {"DeepseekV4HashRouter", "DeepseekV4TopKRouter"},  # 3 hash layers, 1 top-k
    "inkling_text": {"InklingTopkRouter"},  # a fourth output (shared experts' gammas)
}


@pytest.mark.parametrize("model_type", sorted(MORE_FAMILIES))
def test_more_families_count_the_experts_input(model_type: str) -> None:
    import warnings

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**FAMILY_TINY))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # neither unrecognised nor unsupported
        capture = RouterCapture(model)
        assert {type(r.module).__name__ for r in capture.routers} == MORE_FAMILIES[model_type]
        assert capture.num_experts == 4
        # the routing the model really did: the expert indices its experts module receives
        seen: list[torch.Tensor] = []
        for module in model.modules():
            if type(module).__name__.endswith("Experts") and "Shared" not in type(module).__name__:
                module.register_forward_pre_hook(
                    lambda m, args: seen.append(args[1].detach().clone())
                )
        model.train()
        x = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
        out = model(input_ids=x, output_router_logits=True)
    assert len(seen) == len(capture.routers) == 4  # in layer order, one forward each
    expected = np.stack([np.bincount(idx.reshape(-1).numpy(), minlength=4) for idx in seen])
    np.testing.assert_array_equal(capture.loads().numpy(), expected)
    aux_sum, aux_count = capture.aux_losses()
    if model_type == "deepseek_v4":
        # transformers' load_balancing_loss_func sees the top-k router's logits only (its
        # router_logits output records DeepseekV4TopKRouter): the hash layers have no aux loss
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import load_balancing_loss_func

        assert [r.has_aux_loss for r in capture.routers] == [False, False, False, True]
        (logits,) = out.router_logits
        expected_aux = float(load_balancing_loss_func((logits.detach(),), 4, 2)) / 2
        np.testing.assert_array_equal(aux_count.numpy(), [0, 0, 0, 1])
        np.testing.assert_allclose(float(aux_sum[3]), expected_aux, rtol=1e-6)
    else:  # no load_balancing_loss_func in their modeling module
        assert not any(r.has_aux_loss for r in capture.routers)
