"""MoE: the per-layer metrics tracker, a reference top-k router, and a tiny MoE model.

Import-light: torch only.
"""

from __future__ import annotations

from trainvitals.moe._aux_loss import (
    get_aux_loss_backward_scale,
    get_aux_loss_grad_scaler,
    set_aux_loss_backward_scale,
)
from trainvitals.moe.router import TopKRouter, reset_global_tokens, update_expert_biases
from trainvitals.moe.tiny_model import TinyMoELM
from trainvitals.moe.tracker import (
    MoEMetricsTracker,
    destroy_moe_metrics_tracker,
    get_moe_metrics_tracker,
    set_moe_metrics_tracker,
)

__all__ = [
    "MoEMetricsTracker",
    "TinyMoELM",
    "TopKRouter",
    "destroy_moe_metrics_tracker",
    "get_aux_loss_backward_scale",
    "get_aux_loss_grad_scaler",
    "get_moe_metrics_tracker",
    "reset_global_tokens",
    "set_aux_loss_backward_scale",
    "set_moe_metrics_tracker",
    "update_expert_biases",
]

from trainvitals.moe.capture import RouterCapture, find_routers, register_router_extractor

__all__ += ["RouterCapture", "find_routers", "register_router_extractor"]
