"""Router capture on an encoder-decoder MoE (Switch Transformers, a tiny random model of
transformers 5.x) under reentrant activation checkpointing: each router's tokens are matched
with the attention mask of its own stack. The encoder layers are re-run in the backward pass,
after the decoder stack has recorded its mask; the encoder routers must still leave out the
encoder's padding, not the decoder's. The expected counts are the experts' own input (the
dispatch mask after the capacity drop, recorded by a hook of the test's own) over the tokens
whose own stack's mask is 1."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from tests.helpers.moe_models import tiny_switch_transformers
from trainvitals.moe.capture import RouterCapture

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

E, VOCAB = 4, 64


def _switch_model() -> torch.nn.Module:
    return tiny_switch_transformers(
        VOCAB,
        E,
        d_model=32,
        d_ff=32,
        expert_capacity=64,  # no drop: the re-run dispatches exactly as the first run
        router_jitter_noise=0.0,  # deterministic re-run
        dropout_rate=0.0,
    )


def test_encoder_routers_rerun_by_reentrant_checkpointing_keep_the_encoder_mask() -> None:
    model = _switch_model()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    capture = RouterCapture(model)
    names = [r.name for r in capture.routers]
    assert len(names) == 4 and len(set(capture.layer_labels)) == 4
    dispatched: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for name in names:
        experts = model.get_submodule(name.rpartition(".")[0] + ".experts")
        experts.register_forward_hook(
            lambda m, inputs, out, n=name: dispatched[n].append(inputs[1].detach().clone())
        )

    enc_a = torch.ones(2, 6, dtype=torch.long)
    enc_a[1, 2:] = 0
    dec_a = torch.ones(2, 6, dtype=torch.long)  # same size as the encoder's, other padding
    dec_a[0, 4:] = 0
    enc_b = torch.ones(2, 7, dtype=torch.long)
    enc_b[0, 5:] = 0
    dec_b = torch.ones(2, 5, dtype=torch.long)  # another size
    dec_b[1, 1:] = 0
    batches = [(enc_a, dec_a), (enc_b, dec_b)]
    gen = torch.Generator().manual_seed(3)
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # every mask matches its router
        for enc, dec in batches:
            x = torch.randint(3, VOCAB, enc.shape, generator=gen)
            y = torch.randint(3, VOCAB, dec.shape, generator=gen)
            out = model(input_ids=x, attention_mask=enc, labels=y, decoder_attention_mask=dec)
            out.loss.backward()

    loads = capture.loads().numpy()
    for row, r in enumerate(capture.routers):
        encoder = r.name.startswith("encoder")
        # every checkpointed layer runs twice: a no-grad first run, held back, and the re-run
        # in the backward pass, which is counted (the encoder's after the decoder's forward)
        runs = dispatched[r.name]
        assert len(runs) == 2 * len(batches)
        expected = np.zeros(E)
        for b, (enc, dec) in enumerate(batches):
            mask = enc if encoder else dec
            dispatch = runs[2 * b + 1].reshape(-1, E)  # the counted run (the re-run)
            np.testing.assert_array_equal(dispatch, runs[2 * b].reshape(-1, E))
            expected += dispatch[mask.reshape(-1).bool()].sum(0).numpy()
        np.testing.assert_array_equal(loads[row], expected, err_msg=r.name)
    # each layer counts the tokens of its own stack that are not padding
    valid = {"encoder": int(enc_a.sum() + enc_b.sum()), "decoder": int(dec_a.sum() + dec_b.sum())}
    for row, r in enumerate(capture.routers):
        assert loads[row].sum() == valid[r.name.split(".")[0]]
