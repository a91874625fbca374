"""Models for ``test_eval_loops``: a token classifier with masked mean pooling (0/0 for a
sequence whose mask is all 0), BatchNorm and dropout; a head whose eval branch normalises
``exp`` by hand (inf/inf where a logit overflows), which only a step run in eval mode takes."""

from __future__ import annotations

import torch
from torch import nn

T, D, C = 5, 4, 3


class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(D, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, C)

    def forward(self, x, mask):
        h = self.emb(x)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # no guard
        return self.head(self.drop(torch.relu(self.bn(pooled))))


def batch(seed: int, n: int = 8, empty: int | None = None):
    """``(x, mask, y)``; ``empty``: that row's mask all 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, T, D, generator=g)
    mask = (torch.rand(n, T, generator=g) > 0.3).float()
    mask[:, 0] = 1
    if empty is not None:
        mask[empty] = 0
    return x, mask, torch.randint(0, C, (n,), generator=g)


class ProbHead(nn.Module):
    """Logits in train mode; probabilities in eval mode, ``exp`` normalised by hand."""

    def forward(self, z):
        if self.training:
            return z
        e = torch.exp(z)
        return e / e.sum(-1, keepdim=True)


def prob_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(D, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(8, C), ProbHead())
