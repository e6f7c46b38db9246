"""A tiny decoder-only MoE language model built on :class:`TopKRouter`, for the demo, tests and
benchmarks (CPU-friendly: a few layers, a few experts, no host synchronisation in the forward).

Module paths follow the usual layout: ``layers.{i}.mlp.router`` is the router of block ``i``,
whose ``layer_number`` is ``i + 1`` (1-based, Megatron's convention) so the tracker's slot
``i`` and the key ``moe/{name}_layer_{i}`` name the module ``layers.{i}``.

Example:
    >>> model = TinyMoELM(vocab_size=64, hidden_size=32, num_layers=2, num_experts=4, top_k=2,
    ...                   ffn_hidden_size=64)
    >>> batch = next(iter(random_token_batches(1, batch_size=2, seq_len=16, vocab_size=64)))
    >>> out = model(batch["input_ids"], labels=batch["labels"])
    >>> out.logits.shape
    torch.Size([2, 16, 64])
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.moe.router import TopKRouter, reset_global_tokens, update_expert_biases

__all__ = [
    "RandomTokenDataset",
    "TinyMoELM",
    "TinyMoEOutput",
    "random_token_batches",
]


@dataclass
class TinyMoEOutput:
    """``loss`` (next-token cross entropy, ``None`` without labels) and ``logits``."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class _Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, h // self.num_heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class _DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoEMLP(nn.Module):
    """A router and ``E`` GELU experts. Every expert runs on every token (batched einsum) and
    the outputs are combined with the router's weights: wasteful at scale, but exact, with no
    data-dependent shapes and so no host synchronisation."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, router: TopKRouter) -> None:
        super().__init__()
        e = router.num_experts
        self.router = router
        self.w1 = nn.Parameter(torch.randn(e, hidden_size, ffn_hidden_size) * hidden_size**-0.5)
        self.b1 = nn.Parameter(torch.zeros(e, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.randn(e, ffn_hidden_size, hidden_size) * ffn_hidden_size**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, _ = self.router(x)  # [T, E]
        tokens = x.reshape(-1, x.shape[-1])
        h = F.gelu(torch.einsum("th,ehf->etf", tokens, self.w1) + self.b1.unsqueeze(1))
        y = torch.einsum("etf,efh->eth", h, self.w2)
        out = torch.einsum("te,eth->th", probs.to(y.dtype), y)
        return out.view_as(x)


class _Block(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size)
        self.attn = _Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyMoELM(nn.Module):
    """A small decoder-only LM whose MLPs are :class:`TopKRouter` mixtures of experts.

    Args:
        vocab_size, hidden_size, num_layers, num_experts, top_k, ffn_hidden_size: the sizes.
        num_heads: attention heads (divides ``hidden_size``).
        max_seq_len: learned position embeddings up to this length.
        aux_loss_type, aux_loss_coeff, z_loss_coeff: the routers' load-balancing losses.
        moe_layer_freq: which blocks are MoE: an int ``f`` (blocks ``i % f == 0``) or a 0/1
            list of length ``num_layers``; the others have a dense MLP.
        **router_kwargs: any other :class:`TopKRouter` argument (``capacity_factor``,
            ``expert_bias``, ``score_function``, ...).

    The routers record into the global tracker with ``layer_number = i + 1`` and
    ``num_layers``; :meth:`set_process_groups` gives them the data-parallel group;
    :meth:`moe_step_end` (after each optimizer step) updates expert biases (not after a step
    the optimizer skipped: ``optimizer_stepped=False``) and resets the global-aux-loss counts.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        num_layers: int = 4,
        num_experts: int = 8,
        top_k: int = 2,
        ffn_hidden_size: int = 128,
        num_heads: int = 4,
        max_seq_len: int = 256,
        aux_loss_type: str | None = "aux_loss",
        aux_loss_coeff: float = 1e-2,
        z_loss_coeff: float = 1e-3,
        moe_layer_freq: int | Sequence[int] = 1,
        **router_kwargs: Any,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("hidden_size", hidden_size),
            ("num_layers", num_layers),
            ("ffn_hidden_size", ffn_hidden_size),
            ("num_heads", num_heads),
            ("max_seq_len", max_seq_len),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if hidden_size % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide hidden_size ({hidden_size})")
        self.moe_layer_pattern = _layer_pattern(moe_layer_freq, num_layers)
        self.num_layers = num_layers
        self.max_seq_len = max_seq_len
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(max_seq_len, hidden_size)
        blocks = []
        for i in range(num_layers):
            if self.moe_layer_pattern[i]:
                router = TopKRouter(
                    hidden_size,
                    num_experts,
                    top_k,
                    aux_loss_type=aux_loss_type,
                    aux_loss_coeff=aux_loss_coeff,
                    z_loss_coeff=z_loss_coeff,
                    layer_number=i + 1,
                    **router_kwargs,
                )
                router.num_layers = num_layers
                mlp: nn.Module = MoEMLP(hidden_size, ffn_hidden_size, router)
            else:
                mlp = _DenseMLP(hidden_size, ffn_hidden_size)
            blocks.append(_Block(hidden_size, num_heads, mlp))
        self.layers = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def routers(self) -> Iterator[tuple[str, TopKRouter]]:
        """``(module path, router)`` of every MoE block, in layer order."""
        for name, module in self.named_modules():
            if isinstance(module, TopKRouter):
                yield name, module

    def set_process_groups(self, groups: Any) -> None:
        """Give every router the data-parallel group (``groups.dp_cp`` of a ProcessGroups, or
        a process group) for ``global_aux_loss`` and expert-bias updates."""
        group = getattr(groups, "dp_cp", groups)
        for _, router in self.routers():
            router.dp_group = group

    def moe_step_end(
        self, group: Any = None, *, optimizer_stepped: bool | torch.Tensor = True
    ) -> None:
        """After each optimizer step: update expert biases (one all-reduce for all routers
        when ``expert_bias`` is on) and reset the global-aux-loss token counts.

        ``optimizer_stepped=False`` (a step that fp16's ``GradScaler`` skipped, Accelerate's
        ``optimizer.step_was_skipped``): the biases stay as they are, as the weights do, and the
        skipped step's token counts go into the next update (the router did not change in
        between; torchtitan's step pre hook keeps them the same way); the global-aux-loss
        counts are reset all the same, as the next micro-batch starts a new step. A 0-d bool
        tensor does the same on the device (no read back to the host)."""
        if isinstance(optimizer_stepped, torch.Tensor):  # known on the device only
            update_expert_biases(self, group, stepped=optimizer_stepped)
        elif optimizer_stepped:
            update_expert_biases(self, group)
        reset_global_tokens(self)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> TinyMoEOutput:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        seq = input_ids.shape[1]
        if seq > self.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.max_seq_len}")
        positions = torch.arange(seq, device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        return TinyMoEOutput(loss=loss, logits=logits)


def _layer_pattern(moe_layer_freq: int | Sequence[int], num_layers: int) -> list[bool]:
    if isinstance(moe_layer_freq, int) and not isinstance(moe_layer_freq, bool):
        if moe_layer_freq <= 0:
            raise ValueError(f"moe_layer_freq must be positive, got {moe_layer_freq}")
        return [i % moe_layer_freq == 0 for i in range(num_layers)]
    pattern = list(moe_layer_freq)
    if len(pattern) != num_layers or any(x not in (0, 1) for x in pattern):
        raise ValueError(f"moe_layer_freq list must be {num_layers} zeros/ones, got {pattern}")
    return [bool(x) for x in pattern]


# ---------------------------------------------------------------------- data


class RandomTokenDataset(torch.utils.data.Dataset):
    """Learnable random sequences: ``x_t = (a + t * d) mod vocab`` with a random start ``a``
    and stride ``d`` per sample (seeded), so a model can lower its loss. Items are dicts with
    ``input_ids`` and ``labels`` (the next token), both ``[seq_len]`` int64."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
        for name, value in (
            ("num_samples", num_samples),
            ("seq_len", seq_len),
            ("vocab_size", vocab_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=gen)
        stride = torch.randint(1, max(vocab_size // 4, 2), (num_samples, 1), generator=gen)
        t = torch.arange(seq_len + 1).unsqueeze(0)
        self.tokens = (start + t * stride) % vocab_size

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.tokens[i]
        return {"input_ids": row[:-1], "labels": row[1:]}


def random_token_batches(
    num_batches: int, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """``num_batches`` batches of :class:`RandomTokenDataset` samples (dicts of ``[B, S]``)."""
    data = RandomTokenDataset(num_batches * batch_size, seq_len, vocab_size, seed)
    for i in range(num_batches):
        rows = data.tokens[i * batch_size : (i + 1) * batch_size]
        yield {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}


def __getattr__(name: str) -> Any:
    # TinyMoELightningModule needs lightning: imported only when asked for.
    if name == "TinyMoELightningModule":
        return importlib.import_module("trainvitals.moe._lightning").TinyMoELightningModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
