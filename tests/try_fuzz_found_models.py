"""Models of ``test_try_fuzz_found.py``: small regressors the bundles name by factory
(``try_fuzz_found_models:make_...``), replayed from this directory."""

from __future__ import annotations

import torch
from torch import nn

D_IN, BATCH = 8, 16


def batch(step: int, n: int = BATCH):
    """Standard normal features and a noisy linear target."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, D_IN, generator=g)
    return x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)


class DeepRegressor(nn.Module):
    """Two ReLU layers and a linear head: its output grows as the product of the weights."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.body(x))


def make_deep_regressor() -> nn.Module:
    return DeepRegressor()
