"""Attach an auxiliary loss to the autograd graph without changing the forward value.

The idea is Megatron-LM's ``MoEAuxLossAutoScaler`` (``moe_utils.py``): an autograd function that
returns the activation unchanged in the forward and, in the backward, hands the activation's
gradient through and gives the auxiliary loss the gradient ``scale`` (as if ``scale * aux_loss``
had been added to the main loss). The loss therefore trains the router as soon as anything
downstream of the activation is backpropagated, with no change to the model's loss value.

``scale`` defaults to 1.0; set it with :func:`set_aux_loss_backward_scale` to what the main loss
is multiplied by before ``backward()``: ``1 / accumulation steps`` when the loop (or Lightning)
divides the loss by the number of micro-batches, and pass the fp16 AMP ``GradScaler`` as
``grad_scaler``: the gradients are unscaled by its scale before the optimizer step, so an
injected gradient without it ends up ``scale``-times (65536 at the start) too small. Megatron-LM
does the same: ``forward_step`` in ``pipeline_parallel/schedules.py`` sets
``MoEAuxLossAutoScaler.set_loss_scale(grad_scale_func(ones) / num_microbatches)``.
"""

from __future__ import annotations

from typing import Any

import torch

_BACKWARD_SCALE = [1.0]
# The fp16 loss scaler whose scale multiplies the injected gradient, read in each backward.
_GRAD_SCALER: list[Any] = [None]


def set_aux_loss_backward_scale(scale: float, grad_scaler: Any = None) -> None:
    """Set the factor applied to the gradient of every attached auxiliary loss.

    Args:
        scale: what the loop multiplies the main loss by before ``backward()`` apart from loss
            scaling, usually ``1 / accumulation steps``.
        grad_scaler: the fp16 loss scaler the main loss goes through (``torch.amp.GradScaler``,
            FSDP's ``ShardedGradScaler``, ``accelerator.scaler``, Lightning's
            ``trainer.precision_plugin.scaler``: anything with ``scale(tensor)``), or ``None``.
            Its current scale multiplies the injected gradient in every backward, as a device
            tensor (``grad_scaler.scale(...)``): no host synchronisation, and it follows the
            scaler's updates without being set again. A disabled scaler multiplies by 1.
    """
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale >= 0:
        raise ValueError(f"scale must be a number >= 0, got {scale!r}")
    if grad_scaler is not None and not callable(getattr(grad_scaler, "scale", None)):
        raise TypeError(
            f"grad_scaler must be None or a loss scaler with a scale(tensor) method, "
            f"got {type(grad_scaler).__name__}"
        )
    _BACKWARD_SCALE[0] = float(scale)
    _GRAD_SCALER[0] = grad_scaler


def get_aux_loss_backward_scale() -> float:
    """The ``scale`` last set (without the loss scaler's factor)."""
    return _BACKWARD_SCALE[0]


def get_aux_loss_grad_scaler() -> Any:
    """The ``grad_scaler`` last set, or ``None``."""
    return _GRAD_SCALER[0]


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux_loss)
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (aux_loss,) = ctx.saved_tensors
        grad = torch.full_like(aux_loss, _BACKWARD_SCALE[0])
        grad_scaler = _GRAD_SCALER[0]
        if grad_scaler is not None:
            # the scaler's current scale, the one the main loss was multiplied by in this
            # backward (it changes only in update(), after the step); a device multiply, no sync
            grad = grad_scaler.scale(grad)
        return grad_output, grad


def attach_aux_loss(activation: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``activation`` unchanged, with ``aux_loss``'s gradient injected in the backward."""
    return _AttachAuxLoss.apply(activation, aux_loss)
