"""The block of the ``torch.compile`` tests: ``ResidualBlock`` is ``x + fc2(relu(fc1(x)))``
with width 8 and hidden 16, the smallest block with two Linear sites that per-block compilation
(torchtitan style) applies to."""

from __future__ import annotations

import torch
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))
