"""Insurance pricing models written the way actuaries write neural GLMs (Schelldorfer &
Wüthrich's CANN, Wüthrich & Merz's "Statistical Foundations of Actuarial Learning", the
freMTPL2 notebooks): the factories, losses and data of ``test_insurance_pricing.py``.

- ``portfolio``: a motor portfolio, continuous rating factors min-max scaled to [0, 1] with
  the training set's range (driver age, vehicle age, bonus-malus, log density), categorical
  ones (region, vehicle brand) as integer codes for ``nn.Embedding``, the exposure in years
  (a policy cancelled on its first day has exposure 0), claim counts, claim amounts and the
  pure premium (amount per year at risk, 0 for most policies).
- ``FrequencyNet``: the CANN frequency model: embeddings + an MLP, the canonical log link and
  the ``log(exposure)`` offset inside ``forward``; ``PoissonDeviance`` (the unit deviance
  ``2 (y log(y/mu) - y + mu)`` with the ``y = 0`` term kept out by ``torch.where``) and
  ``PoissonDevianceXlogy`` (the same through ``torch.xlogy``), both weighted.
- ``SeverityNet`` + ``GammaDeviance``: severity on the policies with a claim, ``mu =
  exp(net)``, the Gamma unit deviance ``2 (y/mu - log(y/mu) - 1)`` weighted by claim counts.
- ``TweedieNet`` + ``TweedieDeviance``: pure premium with a power ``p`` in (1, 2), the terms
  ``y mu^(1-p) / (1-p)`` and ``mu^(2-p) / (2-p)``; the power either fixed or learned (a
  parameter clamped to the open interval).
- ``balance_correction``: Wüthrich's balance property restored after training: the output
  bias shifted by ``log(sum y / sum mu)`` so the predictions sum to the observed claims.
"""

from __future__ import annotations

import torch
from torch import nn

N_CONT, REGIONS, BRANDS, EMB, HIDDEN = 4, 6, 5, 2, 16


def min_max(raw, lo, hi):
    """Continuous rating factors scaled with the training set's range."""
    return (raw - lo) / (hi - lo)


def portfolio(n: int = 256, seed: int = 0):
    """A motor portfolio: (scaled continuous factors, categorical codes, exposure, claim
    counts, claim amounts (total per policy), pure premium (amount / exposure))."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.stack([torch.randint(18, 90, (n,), generator=g).float(),   # driver age
                       torch.randint(0, 20, (n,), generator=g).float(),    # vehicle age
                       torch.randint(50, 150, (n,), generator=g).float(),  # bonus-malus
                       torch.rand(n, generator=g) * 10], 1)                # log density
    xc = min_max(raw, raw.min(0).values, raw.max(0).values)
    xcat = torch.stack([torch.randint(0, REGIONS, (n,), generator=g),
                        torch.randint(0, BRANDS, (n,), generator=g)], 1)
    exposure = torch.rand(n, generator=g) * 0.95 + 0.05
    rate = 0.1 * torch.exp(0.8 * xc[:, 2] - 0.5 * xc[:, 0])
    counts = torch.poisson(rate * exposure * 4, generator=g)
    amounts = counts * torch.distributions.Gamma(2.0, 2.0 / 1500).sample((n,))
    return xc, xcat, exposure, counts, amounts, amounts / exposure


class RatingFactors(nn.Module):
    """Embeddings of the categorical factors beside the scaled continuous ones."""

    def __init__(self):
        super().__init__()
        self.region = nn.Embedding(REGIONS, EMB)
        self.brand = nn.Embedding(BRANDS, EMB)

    def forward(self, xc, xcat):
        return torch.cat([xc, self.region(xcat[:, 0]), self.brand(xcat[:, 1])], 1)


class FrequencyNet(nn.Module):
    """CANN frequency: log mu = log(exposure) + MLP(features)."""

    def __init__(self):
        super().__init__()
        self.factors = RatingFactors()
        self.mlp = nn.Sequential(nn.Linear(N_CONT + 2 * EMB, HIDDEN), nn.Tanh(),
                                 nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.out = nn.Linear(HIDDEN, 1)
        nn.init.constant_(self.out.bias, -2.0)  # the portfolio's log frequency

    def forward(self, xc, xcat, exposure):
        offset = torch.log(exposure)
        return self.out(self.mlp(self.factors(xc, xcat)))[:, 0] + offset  # log mu


def make_frequency() -> nn.Module:
    torch.manual_seed(0)
    return FrequencyNet()


class PoissonDeviance(nn.Module):
    """Weighted Poisson deviance of counts ``y`` given ``log mu``; ``y log(y/mu)`` is 0 at
    ``y = 0``, kept out with ``torch.where``."""

    def forward(self, log_mu, y, weight):
        mu = torch.exp(log_mu)
        ylogy = torch.where(y > 0, y * torch.log(y / mu), torch.zeros_like(y))
        dev = 2 * (ylogy - y + mu)
        return (weight * dev).sum() / weight.sum()


class PoissonDevianceNanToNum(nn.Module):
    """The same deviance with ``y log(y/mu)``'s NaN at ``y = 0`` replaced by 0 afterwards."""

    def forward(self, log_mu, y, weight):
        mu = torch.exp(log_mu)
        dev = 2 * (torch.nan_to_num(y * torch.log(y / mu)) - y + mu)
        return (weight * dev).sum() / weight.sum()


class PoissonDevianceXlogyRatio(nn.Module):
    """The same deviance with ``xlogy(y, y / mu)``: 0 at ``y = 0`` in the forward."""

    def forward(self, log_mu, y, weight):
        mu = torch.exp(log_mu)
        dev = 2 * (torch.xlogy(y, y / mu) - y + mu)
        return (weight * dev).sum() / weight.sum()


class PoissonDevianceXlogy(nn.Module):
    """The same deviance with ``xlogy`` and ``log mu`` used directly."""

    def forward(self, log_mu, y, weight):
        dev = 2 * (torch.xlogy(y, y) - y * log_mu - y + torch.exp(log_mu))
        return (weight * dev).sum() / weight.sum()


class SeverityNet(nn.Module):
    """Severity: mean claim size exp(MLP(features) + bias near log 1500)."""

    def __init__(self):
        super().__init__()
        self.factors = RatingFactors()
        self.mlp = nn.Sequential(nn.Linear(N_CONT + 2 * EMB, HIDDEN), nn.ReLU())
        self.out = nn.Linear(HIDDEN, 1)
        nn.init.constant_(self.out.bias, 7.3)

    def forward(self, xc, xcat):
        return torch.exp(self.out(self.mlp(self.factors(xc, xcat)))[:, 0])  # mu


def make_severity() -> nn.Module:
    torch.manual_seed(0)
    return SeverityNet()


class GammaDeviance(nn.Module):
    """Gamma unit deviance 2 (y/mu - log(y/mu) - 1), weighted by the claim counts."""

    def forward(self, mu, y, weight):
        ratio = y / mu
        dev = 2 * (ratio - torch.log(ratio) - 1)
        return (weight * dev).sum() / weight.sum()  # mean over the claims


class TweedieNet(nn.Module):
    """Pure premium: log mu from an MLP; with ``learn_power`` also the Tweedie power,
    started at the Poisson end (the deviance keeps it inside (1, 2))."""

    def __init__(self, learn_power: bool = False):
        super().__init__()
        self.factors = RatingFactors()
        self.mlp = nn.Sequential(nn.Linear(N_CONT + 2 * EMB, HIDDEN), nn.ReLU())
        self.out = nn.Linear(HIDDEN, 1)
        nn.init.constant_(self.out.bias, 5.0)
        self.power = nn.Parameter(torch.tensor(1.0)) if learn_power else None

    def forward(self, xc, xcat):
        log_mu = self.out(self.mlp(self.factors(xc, xcat)))[:, 0]
        if self.power is None:
            return log_mu
        return log_mu, self.power


def make_tweedie() -> nn.Module:
    torch.manual_seed(0)
    return TweedieNet()


def make_tweedie_power() -> nn.Module:
    torch.manual_seed(0)
    return TweedieNet(learn_power=True)


class TweedieDeviance(nn.Module):
    """Tweedie deviance for 1 < p < 2 (the ``y^(2-p)`` term, constant in mu, left out); a
    learned power given with the output is clamped into the open interval."""

    def __init__(self, p: float = 1.5):
        super().__init__()
        self.p = p

    def forward(self, out, y, weight):
        log_mu, p = out if isinstance(out, tuple) else (out, self.p)
        if isinstance(p, torch.Tensor):
            p = p.clamp(1 + 1e-8, 2 - 1e-8)
        mu = torch.exp(log_mu)
        dev = -y * mu ** (1 - p) / (1 - p) + mu ** (2 - p) / (2 - p)
        return (weight * dev).sum() / weight.sum()


@torch.no_grad()
def balance_correction(model, log_mu, claims):
    """The balance property: shift the output bias so that the predictions sum to the
    observed claims of the (mini-)portfolio."""
    model.out.bias += torch.log(claims.sum() / torch.exp(log_mu).sum())
