"""A heteroscedastic regressor whose variance head is a power of a number base (``2 ** s``,
``torch.pow(0.5, s)``, ``2 ** -exp(s)``): positive in exact arithmetic for every finite
exponent, so a 0 of it underflowed. The factories of ``test_number_base_power.py``."""

from __future__ import annotations

import torch
from torch import nn

FEATURES = 4


class Heteroscedastic(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.body = nn.Linear(FEATURES, 2)
        self.form = form

    def forward(self, x):
        mu, s = self.body(x).unbind(-1)
        if self.form == "log2":
            var = 2 ** s
        elif self.form == "half":
            var = torch.pow(0.5, s)
        else:  # a variance that decays with a positive rate, exp(s)
            var = 2 ** -s.exp()
        return mu, var


def make_log2():
    torch.manual_seed(0)
    return Heteroscedastic("log2")


def make_half():
    torch.manual_seed(0)
    return Heteroscedastic("half")


def make_decay():
    torch.manual_seed(0)
    return Heteroscedastic("decay")


def gaussian_nll(out, y):
    mu, var = out
    return (0.5 * (var.log() + (y - mu) ** 2 / var)).mean()
