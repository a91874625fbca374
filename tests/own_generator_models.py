"""Models that draw from generators they keep, for the rewind window's re-runs: a feature
dropout drawing its masks from ``self.rng`` (a NumPy ``Generator`` over ``Philox``, ``SFC64``
or ``MT19937``, or a ``torch.Generator``), and a loss adding noise from its own
``torch.Generator`` (label noise as a regulariser)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

BITS = {"philox": np.random.Philox, "sfc64": np.random.SFC64, "mt19937": np.random.MT19937}


class OwnDrop(nn.Module):
    """Drops features with masks from its own generator and rescales each row by the share it
    kept: a row that kept nothing is 0/0."""

    def __init__(self, kind: str, p: float = 0.6):
        super().__init__()
        self.p, self.kind = p, kind
        self.rng = torch.Generator().manual_seed(3) if kind == "torch" else \
            np.random.Generator(BITS[kind](3))

    def forward(self, x):
        if self.kind == "torch":
            u = torch.rand(x.shape, generator=self.rng, dtype=torch.float64).numpy()
        else:
            u = self.rng.random(tuple(x.shape))
        keep = torch.from_numpy(u > self.p).to(x.dtype)
        return x * keep / keep.mean(1, keepdim=True)


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), OwnDrop(kind), nn.Linear(6, 1))


def make_philox() -> nn.Module:
    return make("philox")


def make_sfc64() -> nn.Module:
    return make("sfc64")


def make_mt19937() -> nn.Module:
    return make("mt19937")


def make_torch() -> nn.Module:
    return make("torch")


class NoisyTargets(nn.Module):
    """MSE against targets with Gaussian noise from the loss's own generator."""

    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, out, y):
        return ((out - y - 0.1 * torch.randn(y.shape, generator=self.gen)) ** 2).mean()
