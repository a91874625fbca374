"""Models of tests/test_trainer_fuzz_found.py (the replay imports them by name)."""

from __future__ import annotations

import torch
from torch import nn

D, C = 8, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D, 16)
        self.act = nn.Tanh()
        self.l2 = nn.Linear(16, C)

    def forward(self, x):
        return self.l2(self.act(self.l1(x)))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()
