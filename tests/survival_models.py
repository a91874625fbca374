"""Survival models of ``tests/test_survival.py``, written as DeepSurv, pycox and torchsurv
write them: an MLP risk score (log partial hazard) under a hand-written Cox partial
likelihood, a DeepHit head of logits over time bins, a Weibull AFT head of log-scale and
log-shape. The factories live at module level so that ``nanreplay`` rebuilds them."""

from __future__ import annotations

import torch
from torch import nn

N_FEAT, BINS = 6, 8


def cohort(n: int = 128, seed: int = 0):
    """Covariates, follow-up times (> 0) and event flags (1: died, 0: censored)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_FEAT, generator=g)
    # exponential times, hazard exp(0.5 x0), drawn from ``g`` (by inversion)
    time = -torch.log(torch.rand(n, generator=g)) * torch.exp(-0.5 * x[:, 0]) + 0.01
    event = (torch.rand(n, generator=g) < 0.6).float()
    return x, time, event


class DeepSurv(nn.Module):
    """DeepSurv's risk network: an MLP with ReLU and a linear output, the log hazard ratio."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_FEAT, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def make_deepsurv() -> nn.Module:
    torch.manual_seed(0)
    return DeepSurv()


def deepsurv_loss(risk, time, event):
    """DeepSurv's negative log partial likelihood, as its Theano/PyTorch ports write it: the
    risk set's sum as a cumulative sum of exp(risk) over the samples sorted by decreasing
    time, no max subtracted."""
    order = torch.argsort(time, descending=True)
    risk, event = risk[order], event[order]
    log_risk = torch.log(torch.cumsum(torch.exp(risk), 0))
    return -((risk - log_risk) * event).sum() / event.sum()


class DeepHit(nn.Module):
    """DeepHit (single risk): logits over the time bins; the pmf is their softmax."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_FEAT, hidden), nn.ReLU(), nn.Linear(hidden, BINS))

    def forward(self, x):
        return self.net(x)


def make_deephit() -> nn.Module:
    torch.manual_seed(0)
    return DeepHit()


class Weibull(nn.Module):
    """A Weibull AFT model: per sample the log of the scale and of the shape."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_FEAT, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x):
        return self.net(x)


def make_weibull() -> nn.Module:
    torch.manual_seed(0)
    return Weibull()


def weibull_nll(params, time, event):
    """Censored Weibull negative log-likelihood: events log f(t), censored log S(t), with
    log f = log k - log lam + (k - 1)(log t - log lam) - (t / lam)^k and log S = -(t/lam)^k."""
    log_lam, log_k = params.unbind(-1)
    k = torch.exp(log_k)
    z = torch.log(time) - log_lam
    cum_hazard = torch.exp(k * z)
    log_f = log_k - log_lam + (k - 1) * z - cum_hazard
    return -(event * log_f - (1 - event) * cum_hazard).mean()


def deephit_nll(logits, t_bin, event):
    """DeepHit's likelihood part: an event's pmf at its bin, a censored sample's survival
    past its bin (1 - CDF), with the pmf as a softmax and then its log, as ports write it."""
    pmf = torch.softmax(logits, 1)
    cdf = pmf.cumsum(1)
    p_event = pmf.gather(1, t_bin[:, None]).squeeze(1)
    surv = 1 - cdf.gather(1, t_bin[:, None]).squeeze(1)
    return -(event * torch.log(p_event) + (1 - event) * torch.log(surv)).mean()


def lognormal_nll(params, time, event):
    """Censored log-normal AFT negative log-likelihood: events log f(t), censored log S(t),
    with S(t) = 1 - Phi((log t - mu) / sigma) written out through the normal's cdf."""
    mu, log_sigma = params.unbind(-1)
    std = torch.distributions.Normal(0.0, 1.0)
    z = (torch.log(time) - mu) / torch.exp(log_sigma)
    log_f = std.log_prob(z) - log_sigma - torch.log(time)
    log_s = torch.log(1 - std.cdf(z))
    return -(event * log_f + (1 - event) * log_s).mean()


def cox_loss_selected(risk, time, event):
    """Cox partial likelihood (Breslow), the events' terms selected by a boolean mask and
    averaged: ``[event.bool()].mean()``, as many hand-written losses take them."""
    order = torch.argsort(time, descending=True)
    risk, event = risk[order], event[order]
    return -(risk - torch.logcumsumexp(risk, 0))[event.bool()].mean()


def stratified_cox_loss(risk, time, event, stratum):
    """A stratified Cox partial likelihood: each stratum's risk sets hold only its own
    subjects, the others masked to -inf before one logcumsumexp per stratum; each stratum's
    event terms are picked with ``torch.where``."""
    order = torch.argsort(time, descending=True)
    risk, event, stratum = risk[order], event[order], stratum[order]
    total = risk.new_zeros(())
    for s in stratum.unique():
        mine = stratum == s
        log_risk = torch.logcumsumexp(risk.masked_fill(~mine, float("-inf")), 0)
        total = total + torch.where(mine & event.bool(), risk - log_risk, 0).sum()
    return -total / event.sum()


def weibull_nll_hazard(params, time, event):
    """Censored Weibull negative log-likelihood as log hazard minus cumulative hazard:
    ``(t / lam) ** k`` for every subject, the log hazard only where an event happened,
    picked with ``torch.where``."""
    log_lam, log_k = params.unbind(-1)
    k = torch.exp(log_k)
    cum_hazard = (time / torch.exp(log_lam)) ** k
    log_h = log_k - log_lam + (k - 1) * (torch.log(time) - log_lam)
    return -(torch.where(event.bool(), log_h, 0) - cum_hazard).mean()


def cox_loss_ascending(risk, time, event):
    """The same partial likelihood with the batch sorted by increasing time: each risk set
    (everyone still followed) is a reverse cumulative sum, flip, cumsum, flip."""
    order = torch.argsort(time)
    risk, event = risk[order], event[order]
    at_risk = torch.flip(torch.cumsum(torch.flip(torch.exp(risk), [0]), 0), [0])
    return -((risk - torch.log(at_risk)) * event).sum() / event.sum()
