"""Models for ``test_changed_mid_run``: a classifier whose loop changes it, its optimizer or its
loss while the recorder is attached (a block grown, ``weight_norm`` registered, a loss
swapped, a checkpoint resumed, a cast to bfloat16, a backbone unfrozen)."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.backbone(x))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


class Grown(nn.Module):
    """A residual stack grown block by block (progressive growing)."""

    def __init__(self, n_blocks: int = 1):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(n_blocks)])
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for b in self.blocks:
            h = h + torch.relu(b(h))
        return self.out(h)


def make_grown() -> Grown:
    torch.manual_seed(0)
    return Grown()


class NaiveFocal(nn.Module):
    """Focal loss written from the probabilities: log(p) is -inf where p underflows to 0."""

    def __init__(self, gamma: float = 2.0):
        super().__init__()
        self.gamma = gamma

    def forward(self, logits, y):
        p = torch.softmax(logits, -1).gather(1, y[:, None]).squeeze(1)
        return (-(1 - p) ** self.gamma * torch.log(p)).mean()


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
