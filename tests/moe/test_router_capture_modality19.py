"""Router capture on Ernie 4.5-VL-MoE with image tokens: each decoder layer has a text and a
vision router (``text_moe.gate``, ``vision_moe.gate``), and with ``moe_mm_token_type_ids`` the
block sends each its own modality's tokens (transformers 5.23
``Ernie4_5_VLMoeMoeBlock.forward``). Padding must be told apart inside each router's subset of
the tokens, without a warning; the expected counts here take each router's tokens by boolean
indexing of the attention mask, as the block takes its hidden states.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from tests.helpers.moe_models import HF_TINY, HF_VOCAB
from trainvitals.moe.capture import RouterCapture

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

E, K, LAYERS = 4, 2, 2


def _text_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Ernie4_5_VLMoeConfig(
        text_config=HF_TINY
        | dict(
            num_hidden_layers=LAYERS,
            mlp_layer_types=["sparse"] * LAYERS,
            moe_num_experts=E,
            moe_k=K,
            moe_intermediate_size=[16, 16],
            moe_num_shared_experts=0,
            rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[3, 3, 2]),
        ),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32),
    )
    model = transformers.Ernie4_5_VLMoeForConditionalGeneration(config).model.language_model
    for module in model.modules():  # a random selection bias, so the choice is not softmax's
        statics = getattr(module, "moe_statics", None)
        if statics is not None:
            statics.e_score_correction_bias.data.uniform_(-0.2, 0.2)
    return model.train()


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(attention mask, token types) of three micro-batches: image tokens and padding on both
    sides; text only with padding (the vision router does not run); no token types."""
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, 5:] = 0
    types = torch.zeros(3, 8, dtype=torch.long)
    types[0, 3:6] = 1  # an image after the left padding
    types[1, 1:4] = 2  # a video
    types[2, 4:7] = 1  # an image, its last token padding
    text_mask = torch.ones(2, 8, dtype=torch.long)
    text_mask[1, 6:] = 0
    return [(mask, types), (text_mask, torch.zeros(2, 8, dtype=torch.long)), (text_mask, None)]


def test_each_modality_router_counts_its_own_tokens_without_padding() -> None:
    model = _text_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        capture = RouterCapture(model)
    assert [r.name.rsplit(".", 2)[-2] for r in capture.routers] == ["text_moe", "vision_moe"] * 2
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {r.name: [] for r in capture.routers}
    for r in capture.routers:

        def hook(module, args, output, name=r.name):
            seen[name].append((output[0].detach().clone(), output[2].detach().clone()))

        r.module.register_forward_hook(hook)

    expected = np.zeros((len(capture.routers), E))
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # padding told apart: no warning
        for mask, types in _micro_batches():
            for name in seen:
                seen[name].clear()
            ids = torch.randint(3, HF_VOCAB, mask.shape, generator=gen)
            out = model(input_ids=ids, attention_mask=mask, moe_mm_token_type_ids=types)
            out.last_hidden_state.pow(2).mean().backward()
            flat_mask = mask.reshape(-1)
            flat_types = torch.zeros_like(flat_mask) if types is None else types.reshape(-1)
            for row, r in enumerate(capture.routers):
                if not seen[r.name]:
                    continue
                (_logits, indices), *rest = seen[r.name]
                assert not rest
                vision = r.name.rsplit(".", 2)[-2] == "vision_moe"
                own = flat_mask[flat_types != 0] if vision else flat_mask[flat_types == 0]
                assert own.numel() == indices.shape[0]
                keep = own.bool()
                expected[row] += np.bincount(indices[keep].reshape(-1).numpy(), minlength=E)

    loads = capture.loads().numpy()
    np.testing.assert_array_equal(loads, expected)
    assert expected[1].sum() > 0 and expected[3].sum() > 0  # the vision routers routed
    # The aux loss is the layer's one term over both routers, on the text router's row (the
    # model's own load_balancing_loss_func over its block's router_logits:
    # tests/moe/test_capture_audit21.py); the vision routers report none.
    _, aux_count = capture.aux_losses()
    assert [r.has_aux_loss for r in capture.routers] == [True, False, True, False]
    assert aux_count.tolist() == [3, 0, 3, 0]
