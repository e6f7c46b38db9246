"""Hooks that trainvitals registers on a user's modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

_Hook = TypeVar("_Hook", bound=Callable[..., object])


def eager_hook(hook: _Hook) -> _Hook:
    """``hook`` excluded from ``torch.compile``.

    Dynamo traces the hooks registered on the modules of a compiled model: it breaks the graph
    inside them (at the autograd graph-task query) and compiles the rest, and what they call.
    Traced, a hook guards on the telemetry's Python state (held tensors, counts), which changes
    on every forward, so it is recompiled forward after forward up to Dynamo's recompile limit
    (RouterCapture); a kernel it runs fails under fake tensors (TensorStatsMonitor lost a
    compiled model's first logging step); and a ``_version`` read is a constant of the trace,
    not the counter of the tensor kept. Run eagerly, a hook holds the real tensor with its real
    version counter, which an in-place op of the compiled graph after the hook still bumps.
    It breaks the graph either way; the cost is well under a microsecond per call.
    """
    return torch.compiler.disable(hook)  # (no reason=: older torch 2.x lacks it)
