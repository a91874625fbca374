"""Heads whose output is a signed amplitude, for ``test_signed_amplitude``: a magnitude made
positive by exp or softplus, given a sign by a factor that is never 0.

- ``Polarity``: ``exp(s) * polarity``, a +-1 buffer per channel (an inverted sensor's
  channel; a dipole's orientation), its loss a Gaussian residual ``(y - mu) / amp``.
- ``SignedSoftplus``: ``torch.sign(direction) * softplus(v)``, the sign of a learned
  per-channel direction, its loss a log-amplitude term ``log(amp.abs())`` plus the residual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

K = 2  # channels


class Polarity(nn.Module):
    def __init__(self):
        super().__init__()
        self.mean = nn.Linear(4, K)
        self.log_amp = nn.Linear(4, K)
        self.register_buffer("polarity", torch.tensor([1.0, -1.0]))

    def forward(self, x):
        return self.mean(x), torch.exp(self.log_amp(x)) * self.polarity


class SignedSoftplus(nn.Module):
    def __init__(self):
        super().__init__()
        self.mean = nn.Linear(4, K)
        self.scale = nn.Linear(4, K)
        self.direction = nn.Parameter(torch.tensor([0.5, -0.5]))

    def forward(self, x):
        return self.mean(x), torch.sign(self.direction) * F.softplus(self.scale(x))


def make_polarity() -> Polarity:
    torch.manual_seed(0)
    return Polarity()


def make_signed_softplus() -> SignedSoftplus:
    torch.manual_seed(0)
    return SignedSoftplus()


def residual_loss(out, y):
    mu, amp = out
    return (((y - mu) / amp) ** 2).mean()


def log_amp_loss(out, y):
    mu, amp = out
    return (torch.log(amp.abs()) + 0.5 * ((y - mu) / amp) ** 2).mean()
