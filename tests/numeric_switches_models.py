"""A model for tests/test_numeric_switches.py, importable by the replay as its factory."""

from __future__ import annotations

import torch
from torch import nn


class SoftAssign(nn.Module):
    """Soft assignment of each record to learned centres (an RBF kernel, normalised by hand,
    as deep clustering writes it): a record far from every centre has every kernel value
    subnormal, 0 when subnormals flush, and the row's weights are 0/0."""

    def __init__(self, n_centres: int = 3, dim: int = 4):
        super().__init__()
        self.centres = nn.Parameter(torch.randn(n_centres, dim) * 0.1)
        self.head = nn.Linear(n_centres, 2)

    def forward(self, x):
        d2 = (x[:, None, :] - self.centres[None]).pow(2).sum(-1)
        k = torch.exp(-d2 / 2)
        q = k / k.sum(-1, keepdim=True)
        return self.head(q)


def make_soft_assign() -> SoftAssign:
    return SoftAssign()


class PairPotential(nn.Module):
    """An energy with a softened log distance between a record's two coordinates, written for
    a float64 run (``torch.set_default_dtype(torch.float64)``): its eps 1e-60 is 0 in float32,
    where a coincident pair's log is -inf."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, x):
        r = torch.log((x[:, 0] - x[:, 1]).abs() + torch.tensor(1e-60))
        e = self.lin(x).squeeze(-1) * 1e-3 * r
        return torch.sqrt(e + 1.0)


def make_pair_potential() -> PairPotential:
    return PairPotential()
