"""Poles the data reaches in its ordinary course: a running mean over a padding mask in the
loss (``cumsum(err * mask) / cumsum(mask)``, 0 / 0 at a left-padded row's leading positions),
and a diffusion time ``t ~ U[0, 1]`` embedded by ``1 / t`` or ``sqrt(gain * t)`` (a learned
scale: its gradient ``t / (2 sqrt(gain t))`` is 0 * inf at ``t = 0``, a legal draw)."""

from __future__ import annotations

import torch
from torch import nn


class SeqHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x).squeeze(-1)


def running_mean_loss(pred, y):
    mask = (y != 0).float()  # (a label of 0 is padding)
    err = (pred - y) ** 2 * mask
    running = torch.cumsum(err, 1) / torch.cumsum(mask, 1)  # the mean error so far
    return running.mean()


class InverseTime(nn.Module):
    def __init__(self):
        super().__init__()
        self.temb = nn.Linear(1, 8)
        self.net = nn.Linear(12, 4)

    def forward(self, x, t):
        e = self.temb((1 / t)[:, None])
        return self.net(torch.cat([x, torch.tanh(e)], -1))


class SqrtTime(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))
        self.temb = nn.Linear(1, 8)
        self.net = nn.Linear(12, 4)

    def forward(self, x, t):
        e = self.temb(torch.sqrt(t * self.gain)[:, None])
        return self.net(torch.cat([x, torch.tanh(e)], -1))
