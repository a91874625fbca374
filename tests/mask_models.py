"""Attention pooling over padded sequences, written by hand the way users write it: scores
masked with ``-inf`` at the padding, then a temperature, then a softmax (``torch.softmax`` or
``exp`` over a sum). The factories of ``test_made_beside_masks.py``."""

from __future__ import annotations

import torch
from torch import nn

FEATURES, WIDTH, CLASSES, LENGTH, BATCH = 6, 16, 3, 7, 8


class MaskedPool(nn.Module):
    def __init__(self, width: int, manual_softmax: bool):
        super().__init__()
        self.score = nn.Linear(width, 1)
        self.temperature = 1.0  # annealed by the training loop
        self.manual_softmax = manual_softmax

    def forward(self, h, mask):
        s = self.score(h).squeeze(-1).masked_fill(~mask, float("-inf"))
        s = s / self.temperature
        if self.manual_softmax:
            w = torch.exp(s)
            w = w / w.sum(-1, keepdim=True)
        else:
            w = torch.softmax(s, -1)
        return (w.unsqueeze(-1) * h).sum(1)


class PooledClassifier(nn.Module):
    def __init__(self, manual_softmax: bool = False):
        super().__init__()
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.pool = MaskedPool(WIDTH, manual_softmax)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, mask):
        return self.head(self.pool(self.embed(x), mask))


def make_pooled():
    torch.manual_seed(0)
    return PooledClassifier()


def make_pooled_manual():
    torch.manual_seed(0)
    return PooledClassifier(manual_softmax=True)


def batch(step: int):
    """Sequences of lengths 2..LENGTH (the padding masked), and labels."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, LENGTH, FEATURES, generator=g)
    lengths = torch.randint(2, LENGTH + 1, (BATCH,), generator=g)
    mask = torch.arange(LENGTH) < lengths[:, None]
    return x, mask, torch.randint(0, CLASSES, (BATCH,), generator=g)
