"""A reference top-k MoE router with Megatron-LM's load-balancing options, feeding the tracker.

Facts (formulas, option semantics) follow Megatron-LM's ``TopKRouter`` and ``moe_utils.py``
(read 2026-11; ``/work/shared/reference/nvidia-references.md``); the code is written here.

Shapes: the input is ``[..., hidden_size]``; its leading dims are flattened into ``T`` tokens.
For ``aux_loss_type="seq_aux_loss"`` it must be **batch-first** ``[batch, seq, hidden]`` (the
layout of Hugging Face and of :class:`~trainvitals.moe.tiny_model.TinyMoELM`; Megatron is
sequence-first: transpose before calling). ``forward`` returns

* ``probs`` ``[T, E]`` float32: the combine weights, zero where a token is not routed (or was
  dropped by the capacity limit);
* ``routing_map`` ``[T, E]`` bool: which tokens go to which expert (with ``pad_to_capacity``,
  also the padding tokens that fill every expert up to its capacity, with weight 0).

Load balancing (only in training with gradients enabled, only with a coefficient > 0, and only
for a forward with at least one token, except ``global_aux_loss``, whose all-reduce every rank
joins):

=========================  ======================================================================
``aux_loss``               Switch loss ``E/(k*T^2) * sum_i (sum_x p_xi) * tokens_i``: ``p`` the
                           scores over all experts (softmax, or sigmoid normalised per token when
                           ``k > 1``), ``tokens_i`` the tokens among whose top-k (of those scores)
                           expert ``i`` is. 1.0 at perfect balance (equal ``tokens_i``) before
                           the coefficient; sigmoid with ``k = 1`` (unnormalised scores, as in
                           Megatron) gives ``mean_x sum_i p_xi`` there instead (up to ``E``).
``seq_aux_loss``           the same per sequence (``T`` = sequence length), averaged over the
                           sequences of the batch.
``global_aux_loss``        ``tokens_i`` summed over ``dp_group`` and averaged over the micro-
                           batches since :meth:`reset_global_tokens`; ``T`` the tokens of all
                           ``dp_group`` ranks. Each rank's loss is its share; the tracker sums
                           them over ``dp_group``. **This issues one all-reduce over
                           ``dp_group`` in every training forward** (inherent in the method).
``z_loss``                 ``mean_x(logsumexp(logits_x)^2)`` (ST-MoE).
=========================  ======================================================================

Each loss times its coefficient is attached to the autograd graph without changing any forward
value (:mod:`trainvitals.moe._aux_loss`) and recorded in the global tracker
(:func:`~trainvitals.moe.tracker.get_moe_metrics_tracker`) divided by its coefficient, as
Megatron logs it, under ``load_balancing_loss``, ``seq_load_balancing_loss``,
``global_load_balancing_loss``, ``z_loss``; with a capacity also ``dropped_token_fraction``.
Recording needs :attr:`layer_number` and :attr:`num_layers` (set by the model, e.g.
:class:`~trainvitals.moe.tiny_model.TinyMoELM`); without them nothing is recorded.

Activation checkpointing: each training forward is recorded (and counted into
``local_tokens_per_expert`` and the ``global_aux_loss`` counts) once. A non-reentrant
checkpoint (``use_reentrant=False``) re-runs the forward in the backward pass (detected with
``torch._C._current_graph_task_id() != -1``): the re-run recomputes the same losses for the
gradient from the counts of the first run, without recording, counting or all-reducing again
(Megatron-LM records the re-run too, doubling its logged losses under recompute). A reentrant
checkpoint runs the first forward with autograd off (no loss, nothing recorded) and the re-run
is the one that records (also nested, and with ``no_grad`` forwards of a router that runs
with autograd on elsewhere, which are re-run by nothing). A ``global_aux_loss`` re-run takes
the token counts and total of its own first run (first runs queued, re-runs take them in
order: several calls per forward and pipeline schedules with forwards in flight are exact).
Under ``torch.compile`` the recompute stays inside the compiled backward.

Not handled: sequence/tensor-parallel splitting of the tokens inside the router (Megatron's
``tp_cp`` reductions).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.distributed import all_reduce_coalesced, group_size, is_distributed, world_group
from trainvitals.moe._aux_loss import attach_aux_loss
from trainvitals.moe._checkpointing import CheckpointRuns
from trainvitals.moe.tracker import get_moe_metrics_tracker

__all__ = ["TopKRouter", "reset_global_tokens", "update_expert_biases"]

_COUNTS = ("local_tokens_per_expert", "global_tokens_per_expert")

_AUX_LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _number(name: str, value: Any, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= minimum:
        raise ValueError(f"{name} must be a number >= {minimum}, got {value!r}")
    return float(value)


class TopKRouter(nn.Module):
    """Routes each token to its top-k experts.

    Args:
        hidden_size: size of the last input dim.
        num_experts: ``E``.
        top_k: experts per token, ``k``.
        score_function: ``"softmax"`` or ``"sigmoid"``.
        pre_softmax: softmax over all experts before the top-k (default: top-k of the logits,
            then softmax over the k selected ones). Softmax only.
        num_groups: group-limited routing: the experts form ``num_groups`` equal groups ...
        group_topk: ... and only the ``group_topk`` groups with the largest sum of their top
            ``k // group_topk`` scores are eligible (DeepSeek-V3's node-limited routing).
        capacity_factor: each expert takes at most ``ceil(T*k/E*capacity_factor)`` tokens.
        drop_policy: which tokens an over-full expert keeps: ``"probs"`` (highest weights) or
            ``"position"`` (earliest tokens).
        pad_to_capacity: fill every expert up to its capacity with weight-0 tokens.
        aux_loss_type: ``None``, ``"aux_loss"``, ``"seq_aux_loss"`` or ``"global_aux_loss"``.
        aux_loss_coeff: its coefficient (0 disables it).
        z_loss_coeff: coefficient of the z-loss (0 disables it).
        input_jitter_eps: in training, multiply the router's input by ``U(1-eps, 1+eps)``
            (Megatron jitters in evaluation too).
        expert_bias: aux-loss-free balancing: a per-expert bias added to the scores for the
            selection only; :meth:`update_expert_bias` after each optimizer step moves it by
            ``bias_update_rate * sign(mean_load - load_i)``.
        bias_update_rate: that step size.
        sinkhorn: select with Sinkhorn-normalised scores (training); no aux loss allowed.
        layer_number: 1-based layer number for the tracker (or set later).
        topk_scaling_factor: multiply the combine weights of the selected experts by this
            factor (Megatron's ``moe_router_topk_scaling_factor``, e.g. 2.5 in DeepSeek-V3);
            ``None`` = 1. Not with ``sinkhorn`` (Megatron ignores it there).

    Attributes:
        num_layers: the model's layer count (tracker vector length); set by the model.
        dp_group: process group of the ranks that see different tokens, for
            ``global_aux_loss`` and :meth:`update_expert_bias`; ``None`` = this rank only.
        last_aux_loss: detached aux loss of the last training forward divided by its
            coefficient (``None`` when no aux loss is enabled). For ``global_aux_loss`` it is
            this rank's share: the global loss is its sum over ``dp_group``.
        last_z_loss: the same for the z-loss.
        last_dropped_fraction: detached fraction of the ``T*k`` selections dropped by the
            capacity limit in the last forward (``None`` without a capacity).
        local_tokens_per_expert: with ``expert_bias``, tokens routed per expert since the last
            bias update (training forwards only), on the device.

    Example:
        >>> router = TopKRouter(hidden_size=16, num_experts=4, top_k=2,
        ...                     aux_loss_type="aux_loss", aux_loss_coeff=1e-2)
        >>> probs, routing_map = router(torch.randn(2, 8, 16))
        >>> probs.shape, routing_map.shape, int(routing_map.sum())
        (torch.Size([16, 4]), torch.Size([16, 4]), 32)
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        score_function: str = "softmax",
        pre_softmax: bool = False,
        num_groups: int | None = None,
        group_topk: int | None = None,
        capacity_factor: float | None = None,
        drop_policy: str = "probs",
        pad_to_capacity: bool = False,
        aux_loss_type: str | None = None,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        input_jitter_eps: float | None = None,
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
        sinkhorn: bool = False,
        layer_number: int | None = None,
        topk_scaling_factor: float | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.num_experts = _positive_int("num_experts", num_experts)
        self.top_k = _positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts})")
        if score_function not in ("softmax", "sigmoid"):
            raise ValueError(
                f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}"
            )
        if pre_softmax and score_function != "softmax":
            raise ValueError("pre_softmax=True needs score_function='softmax'")
        if topk_scaling_factor is not None:
            _number("topk_scaling_factor", topk_scaling_factor)
            if topk_scaling_factor <= 0:
                raise ValueError(f"topk_scaling_factor must be > 0, got {topk_scaling_factor}")
            if sinkhorn:
                raise ValueError("topk_scaling_factor cannot be combined with sinkhorn=True")
        if (num_groups is None) != (group_topk is None):
            raise ValueError("num_groups and group_topk must be given together")
        if num_groups is not None:
            _positive_int("num_groups", num_groups)
            _positive_int("group_topk", group_topk)
            if num_experts % num_groups:
                raise ValueError(
                    f"num_experts ({num_experts}) must be divisible by num_groups ({num_groups})"
                )
            if group_topk > num_groups:  # type: ignore[operator]
                raise ValueError(f"group_topk ({group_topk}) must be <= num_groups ({num_groups})")
            per_group = top_k // group_topk  # type: ignore[operator]
            if not 1 <= per_group <= num_experts // num_groups:
                raise ValueError(
                    f"top_k // group_topk ({per_group}) must be in [1, experts per group "
                    f"({num_experts // num_groups})]"
                )
        if capacity_factor is not None:
            _number("capacity_factor", capacity_factor)
            if capacity_factor <= 0:
                raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
        if drop_policy not in ("probs", "position"):
            raise ValueError(f"drop_policy must be 'probs' or 'position', got {drop_policy!r}")
        if pad_to_capacity and capacity_factor is None:
            raise ValueError("pad_to_capacity=True needs a capacity_factor")
        if aux_loss_type is not None and aux_loss_type not in _AUX_LOSS_NAMES:
            raise ValueError(
                f"aux_loss_type must be None or one of {sorted(_AUX_LOSS_NAMES)}, got {aux_loss_type!r}"
            )
        aux_loss_coeff = _number("aux_loss_coeff", aux_loss_coeff)
        z_loss_coeff = _number("z_loss_coeff", z_loss_coeff)
        if input_jitter_eps is not None:
            _number("input_jitter_eps", input_jitter_eps)
            if not 0 < input_jitter_eps < 1:
                raise ValueError(f"input_jitter_eps must be in (0, 1), got {input_jitter_eps}")
        bias_update_rate = _number("bias_update_rate", bias_update_rate)
        if sinkhorn and aux_loss_type is not None and aux_loss_coeff != 0:
            raise ValueError("sinkhorn=True needs aux_loss_coeff=0 (sinkhorn balances by itself)")
        if sinkhorn and (expert_bias or num_groups is not None):
            raise ValueError(
                "sinkhorn=True cannot be combined with expert_bias or group-limited routing"
            )
        if layer_number is not None:
            _positive_int("layer_number", layer_number)
        self._layer_number: int | None = None
        self._layer_slot: torch.Tensor | None = None

        self.score_function = score_function
        self.pre_softmax = bool(pre_softmax)
        self.topk_scaling_factor = (
            None if topk_scaling_factor is None else float(topk_scaling_factor)
        )
        self.num_groups = num_groups
        self.group_topk = group_topk
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.drop_policy = drop_policy
        self.pad_to_capacity = bool(pad_to_capacity)
        self.aux_loss_type = aux_loss_type
        self.aux_loss_coeff = aux_loss_coeff
        self.z_loss_coeff = z_loss_coeff
        self.input_jitter_eps = input_jitter_eps
        self.bias_update_rate = bias_update_rate
        self.sinkhorn = bool(sinkhorn)
        self._num_layers: int | None = None
        self.dp_group: Any = None

        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.layer_number = layer_number
        self.register_buffer(
            "expert_bias", torch.zeros(num_experts, dtype=torch.float32) if expert_bias else None
        )
        # The token counts are plain tensor attributes, not buffers: DistributedDataParallel
        # (broadcast_buffers=True, its default) copies rank 0's buffers to every rank before
        # each forward, which replaced a rank's own expert loads with rank 0's. They follow the
        # weight's device in _apply and the tokens' device in forward (FSDP2 moves buffers and
        # parameters without _apply).
        self.local_tokens_per_expert: torch.Tensor | None = (
            torch.zeros(num_experts, dtype=torch.float64) if expert_bias else None
        )
        self.global_tokens_per_expert: torch.Tensor | None = (
            torch.zeros(num_experts, dtype=torch.float64)
            if aux_loss_type == "global_aux_loss"
            else None
        )
        self.global_aux_micro_batches = 0
        # Activation checkpointing (CheckpointRuns): whether the forward running now records
        # and counts, and may be re-run by a non-reentrant checkpoint; the global_aux_loss
        # (total, mean tokens) of each such forward, oldest first, for its re-run (re-runs come
        # in forward order)
        self._runs = CheckpointRuns()
        self._first_run = True
        self._may_rerun = False
        self._rerun_global: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=256)
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None
        self.last_dropped_fraction: torch.Tensor | None = None

    def _apply(self, fn: Any, recurse: bool = True) -> TopKRouter:
        # model.to(torch.bfloat16) must not round the expert bias (float32, as Megatron's
        # _maintain_float32_expert_bias): keep its dtype and values, follow only the device.
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if (
            bias is not None
            and self.expert_bias is not None
            and self.expert_bias.dtype != bias.dtype
        ):
            self.expert_bias = bias.to(self.expert_bias.device)
        # the float64 counts (exact) and the layer slot are no buffers: they follow the weight
        for name in _COUNTS:
            self._on_device(name, self.weight.device)
        self.layer_number = self._layer_number  # (a meta slot has no value to move)
        return self

    def _on_device(self, name: str, device: torch.device) -> torch.Tensor | None:
        """Attribute ``name`` (a tensor that is not a buffer) moved to ``device``; kept
        dtype, kept values (zeros from a meta tensor)."""
        tensor = getattr(self, name)
        if tensor is not None and tensor.device != device:
            if tensor.is_meta:
                tensor = torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
            else:
                tensor = tensor.to(device)
            setattr(self, name, tensor)
        return tensor

    def _load_from_state_dict(
        self, state_dict: Any, prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # A state loaded into a router that has run (a resume, or a loop rolling back to an
        # earlier checkpoint in the middle of a step) starts a new timeline. The tokens counted
        # since the last bias update and the global_aux_loss counts of the step in progress
        # are not in the checkpoint (non-persistent): kept, they would move the replayed
        # step's bias and loss with the abandoned micro-batches' tokens.
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.local_tokens_per_expert is not None:
            self.local_tokens_per_expert.zero_()
        self.reset_global_tokens()

    @property
    def layer_number(self) -> int | None:
        """1-based layer number for the tracker (``None``: nothing recorded)."""
        return self._layer_number

    @layer_number.setter
    def layer_number(self, layer_number: int | None) -> None:
        if layer_number is not None:
            _positive_int("layer_number", layer_number)
            _check_layer(layer_number, getattr(self, "_num_layers", None))
        self._layer_number = layer_number
        # The tracker slot as a tensor, which the forward reads instead of the int (see
        # MoEMetricsTracker._record_at: an int compiles the forward once per layer).
        self._layer_slot = (
            None
            if layer_number is None
            else torch.tensor([layer_number - 1], device=self.weight.device)
        )

    @property
    def num_layers(self) -> int | None:
        """Length of the tracker's per-layer vectors (all layers of the model)."""
        return self._num_layers

    @num_layers.setter
    def num_layers(self, num_layers: int | None) -> None:
        if num_layers is not None:
            _positive_int("num_layers", num_layers)
            _check_layer(self._layer_number, num_layers)
        self._num_layers = num_layers

    def set_layer_number(self, layer_number: int, num_layers: int | None = None) -> None:
        """Set the 1-based layer number (and the model's layer count) used by the tracker."""
        _positive_int("layer_number", layer_number)
        if num_layers is not None:
            _positive_int("num_layers", num_layers)
        num_layers = self._num_layers if num_layers is None else num_layers
        _check_layer(layer_number, num_layers)  # the pair, before either changes
        self._num_layers = num_layers
        self.layer_number = layer_number

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_function={self.score_function!r}, layer_number={self.layer_number}"
        )

    # ------------------------------------------------------------------ forward

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(hidden, torch.Tensor) or hidden.ndim < 1:
            raise TypeError("hidden must be a tensor [..., hidden_size]")
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden has last dim {hidden.shape[-1]}, expected hidden_size={self.hidden_size}"
            )
        if self.aux_loss_type == "seq_aux_loss" and hidden.ndim != 3:
            raise ValueError("seq_aux_loss needs a batch-first input [batch, seq, hidden_size]")
        training = self.training and torch.is_grad_enabled()
        if self.training:
            if torch.compiler.is_compiling():
                # a compiled region recomputes inside its own backward, never through Python
                self._first_run, self._may_rerun = True, False
            else:
                self._first_run = self._runs.counts()
                self._may_rerun = self._runs.may_rerun
        x = hidden.reshape(-1, self.hidden_size)
        # No token (an empty micro-batch or rank): nothing to balance, and the losses divide
        # by the token count (ZeroDivisionError, or NaN recorded into the step's sums). Except
        # global_aux_loss: its all-reduce must be joined (this rank's share is then 0).
        with_losses = training and x.shape[0] > 0
        with_aux = with_losses or (training and self.aux_loss_type == "global_aux_loss")
        if training and not with_losses:  # no loss of this forward: none is "the last" one
            self.last_z_loss = None
            if not with_aux:
                self.last_aux_loss = None
        if self.training and self.input_jitter_eps is not None:
            eps = self.input_jitter_eps
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())  # [T, E]
            if with_losses and self.z_loss_coeff > 0:
                z_loss = torch.logsumexp(logits, dim=-1).square().mean()
                logits = attach_aux_loss(logits, z_loss * self.z_loss_coeff)
                self.last_z_loss = z_loss.detach()
                self._record("z_loss", self.last_z_loss)
            probs, routing_map, kept = self._route(logits)
            if with_aux and self.aux_loss_type is not None and self.aux_loss_coeff > 0:
                probs = self._apply_aux_loss(probs, logits, hidden.shape)
        if training and self.expert_bias is not None and self._first_run:
            with torch.no_grad():
                local = self._on_device("local_tokens_per_expert", kept.device)
                local += kept.sum(dim=0)
        return probs, routing_map

    # ------------------------------------------------------------------ routing

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k selection and combine weights, then the capacity limit.

        Returns ``probs [T, E]``, ``routing_map [T, E]`` and the routed tokens each expert
        keeps (bool ``[T, E]``, without the padding of ``pad_to_capacity``)."""
        k = self.top_k
        if self.sinkhorn:
            weights, top_idx = self._sinkhorn_topk(logits)
        else:
            if self.score_function == "softmax":
                scores = torch.softmax(logits, dim=-1) if self.pre_softmax else logits
            else:
                scores = torch.sigmoid(logits)
            for_selection = scores if self.expert_bias is None else scores + self.expert_bias
            top_idx = self._topk_indices(for_selection.detach())
            weights = scores.gather(1, top_idx)  # unbiased: the bias only shifts the selection
            if self.score_function == "softmax" and not self.pre_softmax:
                weights = torch.softmax(weights, dim=-1)
            elif self.score_function == "sigmoid" and k > 1:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            if self.topk_scaling_factor is not None:  # after the normalisation, as Megatron
                weights = weights * self.topk_scaling_factor
        num_tokens = logits.shape[0]
        selected = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_idx, True)
        probs = torch.zeros_like(logits).scatter(1, top_idx, weights)
        if self.capacity_factor is None:
            self.last_dropped_fraction = None
            return probs, selected, selected
        capacity = math.ceil(num_tokens * k / self.num_experts * self.capacity_factor)
        keep = self._capacity_mask(probs.detach(), selected, capacity)
        dropped = (selected & ~keep).sum().to(torch.float32) / max(num_tokens * k, 1)
        self.last_dropped_fraction = dropped
        if self.training and torch.is_grad_enabled() and num_tokens > 0:
            self._record("dropped_token_fraction", dropped)
        kept = selected & keep
        return probs * kept, keep if self.pad_to_capacity else kept, kept

    def _topk_indices(self, scores: torch.Tensor) -> torch.Tensor:
        k = self.top_k
        if self.num_groups is None:
            return torch.topk(scores, k, dim=-1).indices
        # Group-limited: a group's score is the sum of its top (k // group_topk) scores; only
        # the group_topk best groups are eligible (Megatron's group_limited_topk).
        num_tokens = scores.shape[0]
        grouped = scores.view(num_tokens, self.num_groups, -1)
        group_scores = grouped.topk(k // self.group_topk, dim=-1).values.sum(dim=-1)  # type: ignore[operator]
        best = group_scores.topk(self.group_topk, dim=-1).indices  # type: ignore[arg-type]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
        eligible = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, -1)
        return torch.topk(scores.masked_fill(~eligible, -math.inf), k, dim=-1).indices

    def _capacity_mask(
        self, probs: torch.Tensor, selected: torch.Tensor, capacity: int
    ) -> torch.Tensor:
        """Per expert, the ``capacity`` tokens it keeps (bool ``[T, E]``)."""
        num_tokens = probs.shape[0]
        cap = min(capacity, num_tokens)
        if self.drop_policy == "probs":
            # The highest weights first; with padding, the remaining slots go to weight-0 tokens.
            idx = torch.topk(probs, cap, dim=0).indices
            keep = torch.zeros_like(selected).scatter(0, idx, True)
            return keep if self.pad_to_capacity else keep & selected
        if not self.pad_to_capacity:
            return selected & (torch.cumsum(selected.long(), dim=0) <= capacity)
        # Position with padding: routed tokens first, in token order, then the earliest others.
        position = torch.arange(num_tokens, 0, -1, device=probs.device, dtype=torch.float64)
        priority = selected.to(torch.float64) * (num_tokens + 1) + position.unsqueeze(1)
        idx = torch.topk(priority, cap, dim=0).indices
        return torch.zeros_like(selected).scatter(0, idx, True)

    def _sinkhorn_topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's sinkhorn routing: in training the top-k of the Sinkhorn-balanced scores
        selects; the weights are sigmoid (k == 1) or softmax scores of the raw logits."""
        k = self.top_k
        activated = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, dim=-1)
        if self.training and logits.shape[0] > 0:  # (Sinkhorn's 1/T needs a token)
            with torch.no_grad():
                top_idx = torch.topk(_sinkhorn(logits.detach()), k, dim=-1).indices
        else:
            top_idx = torch.topk(activated.detach(), k, dim=-1).indices
        return activated.gather(1, top_idx), top_idx

    # ------------------------------------------------------------------ losses

    def _aux_scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores over all experts for the aux loss and the top-k count per token & expert."""
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            if self.top_k > 1:
                scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_idx = torch.topk(scores.detach(), self.top_k, dim=-1).indices
        chosen = torch.zeros_like(scores).scatter(1, top_idx, 1.0)
        return scores, chosen

    def _apply_aux_loss(
        self, probs: torch.Tensor, logits: torch.Tensor, shape: torch.Size
    ) -> torch.Tensor:
        scores, chosen = self._aux_scores(logits)
        num_tokens, num_experts, k = scores.shape[0], self.num_experts, self.top_k
        reduce_group = None
        if self.aux_loss_type == "aux_loss":
            loss = _switch_loss(scores, chosen.sum(dim=0), num_tokens, k)
        elif self.aux_loss_type == "seq_aux_loss":
            batch, seq = shape[0], shape[1]
            per_seq_scores = scores.view(batch, seq, num_experts).sum(dim=1)  # [B, E]
            per_seq_tokens = chosen.view(batch, seq, num_experts).sum(dim=1)  # [B, E]
            loss = (per_seq_scores * per_seq_tokens).sum() * num_experts / (k * seq * seq) / batch
        else:
            group = self.dp_group
            if group is None and is_distributed() and group_size(world_group()) > 1:
                warnings.warn(
                    "TopKRouter: global_aux_loss without dp_group counts this rank's tokens only; "
                    "set router.dp_group (e.g. ProcessGroups.dp_cp)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            global_tokens = self._on_device("global_tokens_per_expert", scores.device)
            assert global_tokens is not None
            if self._first_run or not self._rerun_global:
                count = torch.tensor([float(num_tokens)], device=scores.device)
                tokens, total = all_reduce_coalesced(
                    [chosen.detach().sum(dim=0).to(torch.float64), count], "sum", group
                )
                if self._first_run:
                    global_tokens += tokens.to(global_tokens.device)
                    self.global_aux_micro_batches += 1
                mean_tokens = global_tokens / max(self.global_aux_micro_batches, 1)
                if self._may_rerun:
                    self._rerun_global.append((total, mean_tokens))
            else:  # a non-reentrant re-run: the same loss as its first run, from its counts
                total, mean_tokens = self._rerun_global.popleft()
            loss = (scores.sum(dim=0) * mean_tokens.to(scores.dtype)).sum() * (
                num_experts / (k * total.to(scores.dtype).square())
            )
            loss = loss.reshape(())
            reduce_group = group
        self.last_aux_loss = loss.detach()
        self._record(
            _AUX_LOSS_NAMES[self.aux_loss_type],  # type: ignore[index]
            self.last_aux_loss,
            reduce_group=reduce_group,
            needs_dp_avg=reduce_group is None,
        )
        return attach_aux_loss(probs, loss * self.aux_loss_coeff)

    def _record(
        self, name: str, value: torch.Tensor, reduce_group: Any = None, needs_dp_avg: bool = True
    ) -> None:
        if self._layer_slot is None or self.num_layers is None or not self._first_run:
            return
        # kept on the values' device (FSDP2 moves the weight without _apply): one copy, not
        # a host-to-device copy in every forward
        slot = self._on_device("_layer_slot", value.device)
        get_moe_metrics_tracker()._record_at(
            name,
            value,
            slot,
            self.num_layers,
            reduce_group=reduce_group,
            needs_dp_avg=needs_dp_avg,
        )

    # ------------------------------------------------------------------ step-end maintenance

    def reset_global_tokens(self) -> None:
        """Start a new step for ``global_aux_loss`` (call after each optimizer step)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
        self.global_aux_micro_batches = 0
        self._rerun_global.clear()

    def update_expert_bias(self, group: Any = None) -> None:
        """Aux-loss-free balancing step (call after each optimizer step): sum the loads over
        ``group`` (default :attr:`dp_group`; one all-reduce) and move the bias. Not after a
        step the optimizer skipped (fp16's ``GradScaler``): the counts then go into the next
        update (:func:`update_expert_biases` with ``stepped=`` decides on the device)."""
        update_expert_biases([self], group)


def _check_layer(layer_number: int | None, num_layers: int | None) -> None:
    if layer_number is not None and num_layers is not None and layer_number > num_layers:
        raise ValueError(
            f"layer_number must be in [1, num_layers={num_layers}], got {layer_number}"
        )


def update_expert_biases(
    routers: Iterable[Any], group: Any = None, *, stepped: torch.Tensor | None = None
) -> None:
    """:meth:`TopKRouter.update_expert_bias` for many routers with ONE all-reduce over
    ``group`` (default: the first router's ``dp_group``). Accepts a model: its ``TopKRouter``
    modules are used. ``stepped``: a 0-d bool tensor saying on the device whether the optimizer
    step was taken (an fp16 skip seen without reading it back): where it is false the biases
    stay and the token counts are kept for the next update."""
    routers = _routers(routers)
    routers = [r for r in routers if r.expert_bias is not None]
    if not routers:
        return
    if group is None:
        group = routers[0].dp_group
    loads = all_reduce_coalesced([r.local_tokens_per_expert for r in routers], "sum", group)
    with torch.no_grad():
        for router, load in zip(routers, loads, strict=True):
            load = load.to(router.expert_bias.device, torch.float64)
            offset = load.mean() - load
            change = torch.sign(offset) * router.bias_update_rate
            if stepped is None:
                router.expert_bias += change.to(router.expert_bias.dtype)
                router.local_tokens_per_expert.zero_()
                continue
            taken = stepped.to(device=load.device, dtype=torch.float64)
            router.expert_bias += (change * taken).to(router.expert_bias.dtype)
            counts = router.local_tokens_per_expert
            counts.mul_((1 - taken).to(device=counts.device, dtype=counts.dtype))


def reset_global_tokens(routers: Iterable[Any]) -> None:
    """:meth:`TopKRouter.reset_global_tokens` for every router (or every router of a model)."""
    for router in _routers(routers):
        router.reset_global_tokens()


def _routers(obj: Iterable[Any]) -> list[TopKRouter]:
    if isinstance(obj, nn.Module):
        return [m for m in obj.modules() if isinstance(m, TopKRouter)]
    return [r for r in obj if isinstance(r, TopKRouter)]


def _switch_loss(
    scores: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int, top_k: int
) -> torch.Tensor:
    """``E/(k*T^2) * sum_i (sum_x p_xi) * tokens_i`` (Switch Transformer, Megatron's form)."""
    num_experts = scores.shape[-1]
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (
        num_experts / (top_k * num_tokens * num_tokens)
    )


def _sinkhorn(logits: torch.Tensor, iterations: int = 50) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of ``exp(logits)`` (rows sum to 1/T, columns to 1/E), in the
    log domain and with a fixed number of iterations: Megatron iterates until a tolerance,
    which needs a host synchronisation per iteration."""
    logits = logits.float()
    num_tokens, num_experts = logits.shape
    log_row = -math.log(num_tokens)
    log_col = -math.log(num_experts)
    u = torch.zeros(num_tokens, device=logits.device)
    v = torch.zeros(num_experts, device=logits.device)
    for _ in range(iterations):
        u = log_row - torch.logsumexp(logits + v, dim=1)
        v = log_col - torch.logsumexp(logits + u.unsqueeze(1), dim=0)
    return torch.exp(logits + u.unsqueeze(1) + v)
