"""Models and batches of ``test_training_machinery.py`` (learning-rate schedules, several
optimizers and parameter groups, scalers, clipping), importable by the replay as factories
(``machinery_models:make_...``)."""

from __future__ import annotations

import torch
from torch import nn


class Classifier(nn.Module):
    """A two-layer MLP classifier."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def make_classifier() -> Classifier:
    torch.manual_seed(0)
    return Classifier()


def batch(step: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


class ZeroInitHead(nn.Module):
    """A classifier whose last layer starts at 0 (a common trick), then put under a
    parametrization (``weight_norm`` or ``spectral_norm``) that divides by the weight's norm."""

    def __init__(self, parametrize):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.head = nn.Linear(32, 4)
        nn.init.zeros_(self.head.weight)
        parametrize(self.head)

    def forward(self, x):
        return self.head(self.act(self.fc1(x)))


def make_weight_norm_head() -> ZeroInitHead:
    torch.manual_seed(0)
    return ZeroInitHead(torch.nn.utils.parametrizations.weight_norm)


def make_spectral_norm_head() -> ZeroInitHead:
    torch.manual_seed(0)
    return ZeroInitHead(torch.nn.utils.parametrizations.spectral_norm)
