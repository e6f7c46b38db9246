"""trainvitals: training-telemetry callbacks for PyTorch Lightning, Accelerate and plain loops.

``import trainvitals`` needs torch only; the callbacks are re-exported lazily so that optional
backends are imported where they are used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_CALLBACKS = (
    "MoEMetricsMonitor",
    "LoadBalanceMonitor",
    "TensorStatsMonitor",
    "NormMonitor",
    "MemoryMonitor",
    "ThroughputMonitor",
    "RuntimeMonitor",
)

__all__ = ["__version__", *_CALLBACKS]


def __getattr__(name: str) -> Any:
    if name in _CALLBACKS:
        return getattr(importlib.import_module("trainvitals.callbacks"), name)
    raise AttributeError(f"module 'trainvitals' has no attribute {name!r}")
