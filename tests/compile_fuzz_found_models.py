"""The model of ``tests/test_compile_fuzz_found.py``: a small regressor."""

from __future__ import annotations

import torch
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(6, 6)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x):
        return self.body(torch.relu(self.pre(x)))


def make_model():
    return Regressor()


def batch(step: int, n: int = 8):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)
