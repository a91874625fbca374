"""Small regressors and classifiers for tests/test_decay_divergence.py (the replay rebuilds
them by name)."""

from __future__ import annotations

import torch
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(x)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(x)


def make_regressor() -> Regressor:
    torch.manual_seed(0)
    return Regressor()


def make_classifier() -> Classifier:
    torch.manual_seed(0)
    return Classifier()


def data(classes: bool, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = torch.randint(0, 4, (n,), generator=g) if classes else torch.randn(n, 4, generator=g)
    return x, y
