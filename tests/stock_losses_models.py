"""Small models trained with ``torch.nn``'s stock loss modules (tests/test_stock_losses.py),
importable as the replay's factories, and the losses' user-written distance functions.

Each model takes one ``(B, ...)`` batch and returns what its loss takes (pairs and triplets go
through the same network in one call, ``(B, 2, F)`` and ``(B, 3, F)``). Lines a planted bug
reaches are marked ``# BUG <name>`` so the tests find them by text.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

F_IN = 6  # features of a sample
D = 4  # embedding width
C = 3  # classes


class Embedder(nn.Module):
    """Embeds every item of a ``(B, K, F_IN)`` batch: ``(B, K, D)`` (pairs, triplets)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(F_IN, 8), nn.ReLU(), nn.Linear(8, D))

    def forward(self, x):
        return self.body(x)


class Scorer(nn.Module):
    """One score per item: ``(B, K, F_IN)`` -> ``(B, K)`` (ranking pairs, margins)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(F_IN, 1)

    def forward(self, x):
        return self.lin(x).squeeze(-1)


class Classifier(nn.Module):
    """Logits of ``C`` classes (or labels): ``(B, F_IN)`` -> ``(B, C)``."""

    def __init__(self, log_probs: bool = False):
        super().__init__()
        self.lin = nn.Linear(F_IN, C)
        self.log_probs = log_probs

    def forward(self, x):
        z = self.lin(x)
        return torch.log_softmax(z, -1) if self.log_probs else z


class Regressor(nn.Module):
    """A value per output: ``(B, F_IN)`` -> ``(B, 2)``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(F_IN, 2)

    def forward(self, x):
        return self.lin(x)


class PoissonRate(nn.Module):
    """A Poisson rate per output, read as is (``PoissonNLLLoss(log_input=False)``): the bias
    starts at 3, so the rates of ordinary inputs are positive, those of far inputs need not be."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(F_IN, 2)
        with torch.no_grad():
            self.lin.weight.mul_(0.1)
            self.lin.bias.fill_(3.0)

    def forward(self, x):
        return self.lin(x)  # a rate with no softplus: negative for a far input


class GaussianHead(nn.Module):
    """A mean and a variance per output; the variance through ReLU, which is 0 for some inputs
    (``GaussianNLLLoss(eps=0)`` then takes ``log(0)``)."""

    def __init__(self):
        super().__init__()
        self.mean = nn.Linear(F_IN, 2)
        self.var = nn.Linear(F_IN, 2)
        with torch.no_grad():
            self.var.weight.fill_(0.1)  # the variance of a sample whose features sum
            self.var.bias.fill_(2.0)  # below -20 is 0

    def forward(self, x):
        return self.mean(x), F.relu(self.var(x))


def make_embedder():
    return Embedder()


def make_scorer():
    return Scorer()


def make_classifier():
    return Classifier()


def make_log_classifier():
    return Classifier(log_probs=True)


def make_regressor():
    return Regressor()


def make_poisson():
    return PoissonRate()


def make_gaussian():
    return GaussianHead()


def euclidean(a, b):
    """A triplet distance written by hand: no eps, so its gradient at a == b is 0 * inf."""
    return ((a - b) ** 2).sum(-1).sqrt()  # BUG euclid


def batch_hard(e, labels):
    """Batch-hard triplet mining: each sample's farthest same-label sample and nearest
    other-label one. A sample whose label is alone in the batch is its own farthest positive."""
    with torch.no_grad():
        d = torch.cdist(e, e)
        same = labels[:, None] == labels[None, :]
        pos = d.masked_fill(~same, -1.0).argmax(1)
        neg = d.masked_fill(same, float("inf")).argmin(1)
    return e, e[pos], e[neg]
