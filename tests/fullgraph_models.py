"""Small models for ``test_compile_modes``: training that compiles the way users ask beyond
``torch.compile(model)``'s defaults (``fullgraph=True``, ``model.compile()``, a compiled
``forward``, a submodule kept eager by ``torch.compiler.disable``, a compiled loss alone,
``dynamic=True`` over varying batch sizes). The planted bug: a per-sample normaliser divides
by the count of a sample's positive features, which is 0 for an all-negative row."""

from __future__ import annotations

import torch
from torch import nn

D_IN, HIDDEN, N_CLASSES = 6, 8, 3


class CountNorm(nn.Module):
    """Each row divided by how many of its features are positive (a "mean of the active"):
    BUG: no clamp, a row with none is 0/0."""

    def forward(self, x):
        active = (x > 0).float()
        return (x * active) / active.sum(-1, keepdim=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = CountNorm()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(self.norm(x))))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, n: int = 8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, D_IN, generator=g).abs() + 0.1, torch.randint(0, N_CLASSES, (n,), generator=g)
