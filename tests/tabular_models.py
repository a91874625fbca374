"""Statistical and tabular models of ``tests/test_tabular.py``, written as their communities
write them: numeric columns with values missing as NaN that the model imputes, categorical
columns through one ``nn.Embedding`` each, and hand-written likelihoods (discrete-time
hazards, quantile heads). The factories live at module level so that ``nanreplay`` rebuilds
them from the bundle (``tabular_models:make_hazards``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

N_NUM, CARDS, BINS = 4, (5, 3), 6


def table(n: int = 96, seed: int = 0, missing: float = 0.1):
    """Numeric columns (NaN where missing), categorical codes, and a generator for targets."""
    g = torch.Generator().manual_seed(seed)
    num = torch.randn(n, N_NUM, generator=g)
    num[torch.rand(n, N_NUM, generator=g) < missing] = float("nan")
    cat = torch.stack([torch.randint(0, c, (n,), generator=g) for c in CARDS], 1)
    return num, cat, g


class Backbone(nn.Module):
    """Imputes each numeric column with a learned value (and says which were missing), embeds
    each categorical column, and runs an MLP over the concatenation."""

    def __init__(self, d_emb: int = 3, hidden: int = 16):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, d_emb) for c in CARDS)
        self.fill = nn.Parameter(torch.zeros(N_NUM))
        self.mlp = nn.Sequential(nn.Linear(2 * N_NUM + d_emb * len(CARDS), hidden), nn.ReLU())

    def forward(self, num, cat):
        miss = torch.isnan(num)
        num = torch.where(miss, self.fill.expand_as(num), num)
        embedded = [emb(cat[:, i]) for i, emb in enumerate(self.embs)]
        return self.mlp(torch.cat([num, miss.float(), *embedded], 1))


class Hazards(nn.Module):
    """DeepHit-style discrete-time survival: one hazard per time bin, a sigmoid each."""

    def __init__(self):
        super().__init__()
        self.body = Backbone()
        self.head = nn.Linear(16, BINS)

    def forward(self, num, cat):
        return torch.sigmoid(self.head(self.body(num, cat)))


def make_hazards() -> nn.Module:
    torch.manual_seed(0)
    return Hazards()


class HazardNLL(nn.Module):
    """Negative log-likelihood of discrete hazards ``h``: survived every bin before the
    sample's bin, then had the event there (or was censored), written out as
    log(h) and log(1 - h)."""

    def forward(self, h, t_bin, event):
        bins = torch.arange(h.shape[1], device=h.device)
        before = (bins[None] < t_bin[:, None]).float()
        ll = (before * torch.log(1 - h)).sum(1)
        h_t = h.gather(1, t_bin[:, None]).squeeze(1)
        ll = ll + event * torch.log(h_t) + (1 - event) * torch.log(1 - h_t)
        return -ll.mean()


def survival_data(n: int = 96, bad: int | None = None):
    """Features, time bins and event flags; record ``bad`` holds an unnormalised reading."""
    num, cat, g = table(n)
    t_bin = torch.randint(0, BINS, (n,), generator=g)
    event = (torch.rand(n, generator=g) < 0.5).float()
    if bad is not None:
        num[bad] = torch.tensor([3e4, -3e4, 3e4, -3e4])
    return TensorDataset(num, cat, t_bin, event)


class Quantiles(nn.Module):
    """One output per quantile level (0.1, 0.5, 0.9)."""

    def __init__(self):
        super().__init__()
        self.body = Backbone()
        self.head = nn.Linear(16, 3)

    def forward(self, num, cat):
        return self.head(self.body(num, cat))


def make_quantiles() -> nn.Module:
    torch.manual_seed(0)
    return Quantiles()


class RiskScore(nn.Module):
    """A Cox model's log partial hazard per sample."""

    def __init__(self):
        super().__init__()
        self.body = Backbone()
        self.head = nn.Linear(16, 1)

    def forward(self, num, cat):
        return self.head(self.body(num, cat)).squeeze(-1)


def make_risk_score() -> nn.Module:
    torch.manual_seed(0)
    return RiskScore()


def cox_ph_loss(log_h, durations, events):
    """Negative Cox partial log-likelihood (Breslow ties), as pycox writes it: risk sets as a
    logcumsumexp over the samples sorted by decreasing time, averaged over the events."""
    order = durations.sort(descending=True)[1]
    log_h, events = log_h[order], events[order]
    return -(log_h - torch.logcumsumexp(log_h, 0)).mul(events).sum().div(events.sum())


class MixtureDensity(nn.Module):
    """A mixture density network: weights softmax(logits / temperature), means, and scales
    exp(log_sigma) per component."""

    def __init__(self, k: int = 3, temperature: float = 1.0):
        super().__init__()
        self.body = Backbone()
        self.pi, self.mu, self.log_sigma = (nn.Linear(16, k) for _ in range(3))
        self.temperature = temperature

    def forward(self, num, cat):
        h = self.body(num, cat)
        return (torch.softmax(self.pi(h) / self.temperature, -1), self.mu(h),
                self.log_sigma(h).exp())


def make_mixture_density() -> nn.Module:
    torch.manual_seed(0)
    return MixtureDensity()


class MixtureNLL(nn.Module):
    """Negative log-likelihood of a Gaussian mixture, a logsumexp over the components."""

    def forward(self, out, y):
        pi, mu, sigma = out
        z = (y[:, None] - mu) / sigma
        log_n = -0.5 * z ** 2 - torch.log(sigma) - 0.9189385332046727
        return -torch.logsumexp(torch.log(pi) + log_n, -1).mean()
