"""A sequence classifier that runs a time-major ``nn.LSTM`` (``batch_first=False``) inside a
batch-first forward: it transposes ``(B, T, F)`` in and out, so the layers after the LSTM see
``(B, T, H)``."""

import torch
from torch import nn


class LogFeatures(nn.Module):
    def __init__(self, h=8):
        super().__init__()
        self.lin = nn.Linear(h, h)

    def forward(self, h, weight):  # weight: (B,), a per-sample weight the loader gives
        return torch.log(self.lin(h).abs() * weight[:, None, None])  # the bug: log(0)


class Tagger(nn.Module):
    def __init__(self, f=5, h=8, n_classes=6):
        super().__init__()
        self.stem = nn.Linear(f, h)
        self.rnn = nn.LSTM(h, h)  # time-major
        self.feats = LogFeatures(h)
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, n_classes)

    def forward(self, x, weight):  # x: (B, T, F)
        h = self.rnn(torch.tanh(self.stem(x)).transpose(0, 1))[0].transpose(0, 1)
        return self.head(self.norm(h + self.feats(h, weight)).mean(1))


def make_model():
    return Tagger()


class SafeLog(nn.Module):
    """``where(x > 0, log(x), 0)``: finite forward, but log's derivative at an x of 0 is
    infinite, and the 0 where sends back times it is NaN (the gradient trap)."""

    def forward(self, x):
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x))


class Shared(nn.Module):
    """One ``SafeLog`` applied twice per forward; only its second input, gated by a mask of
    the first call's output, holds exact zeros (a product's backward passes the NaN on)."""

    def __init__(self, f=5, h=8, n_classes=3):
        super().__init__()
        self.inp, self.mid, self.head = nn.Linear(f, h), nn.Linear(h, h), nn.Linear(h, n_classes)
        self.feat = SafeLog()

    def forward(self, x):
        h = self.feat(self.inp(x))
        return self.head(self.feat(self.mid(h) * (h > 0)))


def make_shared():
    return Shared()
