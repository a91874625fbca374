"""Small models and the losses users write around them, for targets outside a loss's domain
(tests/test_loss_target_domain.py): a regressor of positive values (a count, a price) under a
mean squared log error, a Hellinger distance, and a soft-label classifier under KLDivLoss.
Importable as the replay's factories; the lines a bad target reaches are found by text.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

F_IN = 4  # features of a sample
C = 3  # classes of the soft labels


class PositiveRegressor(nn.Module):
    """A positive value per sample (a count or a price): ``(B, F_IN)`` -> ``(B, 1)``."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(F_IN, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return F.softplus(self.head(torch.relu(self.hidden(x))))


class MSLELoss(nn.Module):
    """Mean squared log error, as Kaggle's RMSLE metrics are trained."""

    def forward(self, pred, target):
        return ((torch.log1p(pred) - torch.log1p(target)) ** 2).mean()


def hellinger(pred, target):
    """Squared Hellinger distance of intensities."""
    return ((pred.sqrt() - target.sqrt()) ** 2).mean()


def make_regressor():
    return PositiveRegressor()


def make_log_classifier():
    return nn.Sequential(nn.Linear(F_IN, 8), nn.ReLU(), nn.Linear(8, C), nn.LogSoftmax(-1))


class SeqRegressor(nn.Module):
    """A positive value per time step of a time-major sequence: ``(T, B, F_IN)`` ->
    ``(T, B, 1)`` (an ``nn.LSTM`` without ``batch_first``)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(F_IN, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return F.softplus(self.head(self.rnn(x)[0]))


def make_seq_regressor():
    return SeqRegressor()
