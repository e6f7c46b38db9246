"""trainvitals callbacks: one class per file, each usable in ``lightning.pytorch.Trainer(callbacks=
[...])`` and in the :class:`~trainvitals.adapters.loop.Vitals` driver."""

from __future__ import annotations

import importlib
from typing import Any

from trainvitals.callbacks.base import VitalsCallback

_MODULES = {
    "MoEMetricsMonitor": "moe_metrics_monitor",
    "LoadBalanceMonitor": "load_balance_monitor",
    "TensorStatsMonitor": "tensor_stats_monitor",
    "NormMonitor": "norm_monitor",
    "MemoryMonitor": "memory_monitor",
    "ThroughputMonitor": "throughput_monitor",
    "RuntimeMonitor": "runtime_monitor",
}

__all__ = ["VitalsCallback", *_MODULES]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        module = importlib.import_module(f"trainvitals.callbacks.{_MODULES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'trainvitals.callbacks' has no attribute {name!r}")
