"""A classifier whose normaliser has no epsilon, and the batches a loop that skips bad steps
trains on: a blank (all-zero) record at the steps ``BLANK`` names makes 0/0 in ``norm``."""

from __future__ import annotations

import torch
from torch import nn

D_IN, N_CLASSES, BATCH = 6, 3, 8
BLANK = {3: 2, 7: 5}  # step -> the row left blank


class UnsafeNorm(nn.Module):
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)  # no eps: 0/0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = UnsafeNorm()
        self.body = nn.Sequential(nn.Linear(D_IN, 16), nn.ReLU(), nn.Dropout(0.2),
                                  nn.Linear(16, N_CLASSES))

    def forward(self, x):
        return self.body(self.norm(x))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, D_IN, generator=g)
    y = x[:, :N_CLASSES].argmax(1)
    if step in BLANK:
        x[BLANK[step]] = 0.0
    return x, y
