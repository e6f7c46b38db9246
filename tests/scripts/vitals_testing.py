"""Small helpers shared by the driver/Lightning/Accelerate tests and the torchrun scripts."""

from __future__ import annotations

from typing import Any

import torch


class RecordingWriter:
    """A writer that keeps every value as a float: ``rows[step][key] = value``."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}
        self.flushed = 0
        self.closed = False

    def add_scalar(self, name: str, value: Any, step: int) -> None:
        self.add_scalars({name: value}, step)

    def add_scalars(self, mapping: dict[str, Any], step: int) -> None:
        row = self.rows.setdefault(int(step), {})
        for key, value in mapping.items():
            row[key] = float(value.item() if isinstance(value, torch.Tensor) else value)

    def flush(self) -> None:
        self.flushed += 1

    def close(self) -> None:
        self.closed = True

    def key(self, name: str) -> dict[int, float]:
        """``{step: value}`` of one key."""
        return {s: row[name] for s, row in sorted(self.rows.items()) if name in row}


class FakeClock:
    """A clock the test moves by hand: ``clock.t += 1.5``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
