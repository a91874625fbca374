"""Models whose own code edits the autograd graph: gradient hooks registered in a forward,
custom autograd Functions, penalties that differentiate the model (create_graph=True)."""

from __future__ import annotations

import torch
from torch import nn

D_IN, HIDDEN, N_CLASSES = 10, 32, 3


class GradNormalised(nn.Module):
    """A hidden layer whose incoming gradient a tensor hook normalises per sample (a gradient
    normalisation trick): a row whose gradient is all 0 (a padded label the loss ignores)
    is 0 / 0."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if h.requires_grad:
            h.register_hook(lambda g: g / g.norm(dim=1, keepdim=True))  # BUG: no eps
        return self.fc2(h)


def make_grad_normalised() -> GradNormalised:
    torch.manual_seed(0)
    return GradNormalised()


def batch(step: int, n: int = 16):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, D_IN, generator=g), torch.randint(0, N_CLASSES, (n,), generator=g)
