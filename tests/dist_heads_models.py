"""Probabilistic output heads built on ``torch.distributions`` as training code writes them: a
mixture density network (``MixtureSameFamily`` of ``Independent(Normal)``) and a low-rank
Gaussian head (``LowRankMultivariateNormal``) and a Gumbel-softmax bottleneck
(``RelaxedOneHotCategorical.rsample`` at a temperature the loop anneals). For ``test_dist_heads.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import (
    Categorical,
    Independent,
    LowRankMultivariateNormal,
    MixtureSameFamily,
    Normal,
    RelaxedOneHotCategorical,
)

IN, HID, K, D, RANK = 4, 16, 3, 2, 2


class MDN(nn.Module):
    """Bishop's mixture density network: mixture logits, means and scales of K Gaussians."""

    def __init__(self, sigma: str = "exp"):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, HID), nn.Tanh())
        self.pi = nn.Linear(HID, K)
        self.mu = nn.Linear(HID, K * D)
        self.log_sigma = nn.Linear(HID, K * D)
        self.sigma = sigma

    def forward(self, x):
        h = self.body(x)
        s = self.log_sigma(h).view(-1, K, D)
        if self.sigma == "exp":
            sigma = torch.exp(s)
        elif self.sigma == "relu":
            sigma = F.relu(s)
        else:
            sigma = F.softplus(s)
        return self.pi(h), self.mu(h).view(-1, K, D), sigma


def mdn_nll(out, y):
    logits, mu, sigma = out
    mix = MixtureSameFamily(Categorical(logits=logits), Independent(Normal(mu, sigma), 1))
    return -mix.log_prob(y).mean()


class LowRankHead(nn.Module):
    """A Gaussian with a low-rank-plus-diagonal covariance; the diagonal from a ReLU."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, HID), nn.Tanh())
        self.loc = nn.Linear(HID, D)
        self.factor = nn.Linear(HID, D * RANK)
        self.diag = nn.Linear(HID, D)

    def forward(self, x):
        h = self.body(x)
        return self.loc(h), self.factor(h).view(-1, D, RANK), F.relu(self.diag(h))


def low_rank_nll(out, y):
    loc, factor, diag = out
    return -LowRankMultivariateNormal(loc, factor, diag).log_prob(y).mean()


class Concrete(nn.Module):
    """Relaxed one-hot codes of the input, decoded back: the temperature a buffer the loop
    anneals (``model.temperature.fill_(...)``)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(IN, K)
        self.dec = nn.Linear(K, IN)
        self.register_buffer("temperature", torch.tensor(1.0))

    def forward(self, x):
        z = RelaxedOneHotCategorical(self.temperature, logits=self.enc(x)).rsample()
        return self.dec(z)


def make_concrete() -> Concrete:
    torch.manual_seed(0)
    return Concrete()


def make_mdn(sigma: str = "exp") -> MDN:
    torch.manual_seed(0)
    return MDN(sigma)


def make_low_rank_head() -> LowRankHead:
    torch.manual_seed(0)
    return LowRankHead()
