"""A small GAN for the recorder tests: the discriminator is recorded, the generator is not."""

from __future__ import annotations

import torch
from torch import nn

Z, D_IN = 8, 12


def make_disc() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))


def make_gen() -> nn.Module:
    return nn.Sequential(nn.Linear(Z, 32), nn.ReLU(), nn.Linear(32, D_IN), nn.Tanh())


def real_batch(step: int, n: int = 16) -> torch.Tensor:
    return torch.tanh(torch.randn(n, D_IN, generator=torch.Generator().manual_seed(step)))
