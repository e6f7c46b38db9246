"""Router capture audit (session 21): Ernie 4.5-VL-MoE's aux loss per layer is the one term
transformers computes over both modality routers' logits.

transformers 5.23 ``Ernie4_5_VLMoeMoeBlock.forward`` scatters the text and the vision router's
logits into one ``[B * S, E]`` tensor (each token's row from its own modality's router), which
is the layer's ``router_logits`` output, and ``load_balancing_loss_func`` takes one term per
layer of it with the attention mask. The capture reported each router's own term over its own
tokens instead (two values per layer, neither the model's). The reference here is transformers'
own function on the model's own ``router_logits`` output, in float64.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

from tests.helpers.moe_models import HF_VOCAB
from trainvitals.moe.capture import RouterCapture

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from tests.moe.test_router_capture_modality19 import E, K, _micro_batches, _text_model


def test_ernie_vl_layer_aux_loss_is_the_models_term_over_both_modality_routers() -> None:
    model = _text_model()
    capture = RouterCapture(model)
    parents = [r.name.rsplit(".", 2)[-2] for r in capture.routers]
    assert parents == ["text_moe", "vision_moe"] * 2
    lbl = importlib.import_module(type(model).__module__).load_balancing_loss_func

    batches = _micro_batches()
    # a micro-batch of image tokens only: the text router routes no token
    batches.append((torch.ones(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)))
    gen = torch.Generator().manual_seed(1)
    per_layer: list[list[float]] = [[], []]
    for mask, types in batches:
        ids = torch.randint(3, HF_VOCAB, mask.shape, generator=gen)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            moe_mm_token_type_ids=types,
            output_router_logits=True,
        )
        out.last_hidden_state.pow(2).mean().backward()
        assert len(out.router_logits) == 2
        for layer, logits in enumerate(out.router_logits):
            per_layer[layer].append(float(lbl((logits.detach().double(),), E, K, mask)) / K)

    aux_sum, aux_count = capture.aux_losses()
    got = (aux_sum / aux_count.clamp(min=1)).numpy()[[0, 2]]
    np.testing.assert_allclose(got, [np.mean(v) for v in per_layer], rtol=1e-6)
    # the layer's loss is reported once, on its text router's row (every micro-batch)
    assert aux_count.tolist() == [4, 0, 4, 0]
    assert [r.has_aux_loss for r in capture.routers] == [True, False] * 2
