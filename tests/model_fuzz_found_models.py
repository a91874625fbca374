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
