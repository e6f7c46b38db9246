"""Attach an auxiliary loss to the autograd graph without changing the forward value.

The idea is Megatron-LM's ``MoEAuxLossAutoScaler`` (``moe_utils.py``): an autograd function that
returns the activation unchanged in the forward and, in the backward, hands the activation's
gradient through and gives the auxiliary loss the gradient ``scale`` (as if ``scale * aux_loss``
had been added to the main loss). The loss therefore trains the router as soon as anything
downstream of the activation is backpropagated, with no change to the model's loss value.

``scale`` defaults to 1.0; set it with :func:`set_aux_loss_backward_scale` to what the main loss
is multiplied by before ``backward()``: ``1 / accumulation steps`` when the loop (or Lightning)
divides the loss by the number of micro-batches, times the AMP ``GradScaler`` scale under fp16.
"""

from __future__ import annotations

import torch

_BACKWARD_SCALE = [1.0]


def set_aux_loss_backward_scale(scale: float) -> None:
    """Set the factor applied to the gradient of every attached auxiliary loss."""
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale >= 0:
        raise ValueError(f"scale must be a number >= 0, got {scale!r}")
    _BACKWARD_SCALE[0] = float(scale)


def get_aux_loss_backward_scale() -> float:
    return _BACKWARD_SCALE[0]


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux_loss)
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, _BACKWARD_SCALE[0])


def attach_aux_loss(activation: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``activation`` unchanged, with ``aux_loss``'s gradient injected in the backward."""
    return _AttachAuxLoss.apply(activation, aux_loss)
