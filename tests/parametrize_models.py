"""Models with the user's own parametrizations (``register_parametrization``), for
test_parametrize.py: a symmetric weight, unit-norm rows (0/0 in a row of zeros), a positive
bias as ``exp`` of its raw parameter (which overflows once that passes ~88)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize


class Symmetric(nn.Module):
    def forward(self, X):
        return X.triu() + X.triu(1).T


class UnitRows(nn.Module):
    def forward(self, W):
        return W / W.norm(dim=1, keepdim=True)  # 0/0 when a row is all zero


class Positive(nn.Module):
    def forward(self, X):
        return torch.exp(X)  # overflows once X passes ~88


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.sym = nn.Linear(6, 6)
        self.lin = nn.Linear(6, 4)
        self.scale = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return self.lin(torch.tanh(self.sym(x))) * self.scale.exp()


def make_unit_rows() -> nn.Module:
    torch.manual_seed(0)
    net = Net()
    parametrize.register_parametrization(net.sym, "weight", Symmetric())
    parametrize.register_parametrization(net.lin, "weight", UnitRows())
    return net


class PosNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.sym = nn.Linear(6, 6)
        self.gain = nn.Linear(6, 4)

    def forward(self, x):
        return self.gain(torch.tanh(self.sym(x)))


def make_positive() -> nn.Module:
    torch.manual_seed(0)
    net = PosNet()
    parametrize.register_parametrization(net.sym, "weight", Symmetric())
    parametrize.register_parametrization(net.gain, "bias", Positive())
    return net


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
