"""Models built of lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ``nn.LazyBatchNorm2d``),
whose input sizes the first forward infers, as scripts that do not want to compute a flattened
size write them; importable as factories (``lazy_models:make_cnn``)."""

from __future__ import annotations

import torch
from torch import nn


class LogTotal(nn.Module):
    """The log of each record's total intensity, a feature a spectrum or count model adds;
    NaN for a record whose total is negative."""

    def forward(self, x):
        return x.sum(dim=(1, 2, 3)).log().unsqueeze(1)


class LazyCnn(nn.Module):
    def __init__(self, classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.LazyConv2d(4, 3, padding=1), nn.LazyBatchNorm2d(),
                                      nn.ReLU(), nn.MaxPool2d(2))
        self.total = LogTotal()
        self.head = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(classes))

    def forward(self, x):
        return self.head(torch.cat([self.features(x).flatten(1), self.total(x)], dim=1))


def make_cnn() -> LazyCnn:
    torch.manual_seed(0)
    return LazyCnn()


def batches(steps: int, bad_step: int | None = None, bad_sample: int = 5):
    """(x, y) per step: 8 records of 2x8x8 positive intensities; at ``bad_step`` one record's
    sum is negative (a sign flipped by a bad calibration)."""
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        x = torch.rand(8, 2, 8, 8, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        if step == bad_step:
            x[bad_sample] = -x[bad_sample]
        yield x, y
