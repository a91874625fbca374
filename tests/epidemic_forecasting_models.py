"""Epidemic forecasting models as torch code writes them (pyro/numpyro's SEIR tutorials,
Epidemia / EpiNow2's renewal model ported to torch, the CDC forecast-hub baselines), for
``test_epidemic_forecasting``. A batch is a set of regions over one window of days.

- ``SEIR``: an SEIR compartmental model integrated with explicit Euler sub-steps in the
  forward; the transmission rate beta(t) = softplus(MLP(mobility covariates)); the force of
  infection ``beta * S * I / N`` with each region's population given to ``forward``; returns
  the expected daily incidence (E -> I) and a learned negative binomial dispersion.
- ``Renewal``: new infections = R_t * sum_s w_s I_{t-s}, w a lognormal generation interval
  discretised by its CDF, truncated at ``max_gi`` days and renormalised; log R_t a random walk
  per region (its increments are parameters, their Gaussian prior in the loss); reported
  cases the infections convolved with a reporting-delay distribution (``conv1d``).
- ``LogForecaster``: a GRU over the log incidence of the last weeks, predicting the next
  week's log incidence (the hub's log-transformed targets, MSE).
- ``nb_nll``: the negative binomial log-likelihood in (mean, dispersion) form, over a region
  mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import LogNormal

REGIONS, DAYS, COVARIATES = 8, 21, 3


def nb_nll(mu, phi, cases, mask):
    """NB(mean mu, dispersion phi) negative log-likelihood, averaged over the observed days of
    the regions the mask keeps (padded regions have mask 0)."""
    ll = (torch.lgamma(cases + phi) - torch.lgamma(phi) - torch.lgamma(cases + 1)
          + phi * torch.log(phi / (phi + mu)) + cases * torch.log(mu / (phi + mu)))
    return -(ll * mask).sum() / mask.sum()


def seir_loss(out, cases, mask):
    mu, phi = out
    return nb_nll(mu, phi, cases, mask)


def where_masked_loss(out, cases, mask):
    """The likelihood with the padded regions' terms replaced by 0 (``torch.where``)."""
    mu, phi = out
    ll = (torch.lgamma(cases + phi) - torch.lgamma(phi) - torch.lgamma(cases + 1)
          + phi * torch.log(phi / (phi + mu)) + cases * torch.log(mu / (phi + mu)))
    return -torch.where(mask > 0, ll, torch.zeros_like(ll)).sum() / mask.sum()


def observed_loss(out, cases, mask):
    """The likelihood of the observed entries only, picked before any op."""
    mu, phi = out
    keep = mask > 0
    return nb_nll(mu[keep], phi, cases[keep], torch.ones_like(cases[keep]))


# ---------------------------------------------------------------------------------------------
# SEIR with a learned transmission rate


class SEIR(nn.Module):
    """Explicit Euler, ``substeps`` steps a day, of S -> E -> I -> R per region."""

    def __init__(self, substeps: int = 4, incubation: float = 5.2, infectious: float = 3.0,
                 hidden: int = 16, region_dispersion: bool = False):
        super().__init__()
        self.beta_net = nn.Sequential(nn.Linear(COVARIATES, hidden), nn.ReLU(),
                                      nn.Linear(hidden, 1))
        self.seed = nn.Parameter(torch.tensor(-6.0))  # logit of the initially infected share
        self.log_phi = nn.Parameter(torch.tensor(1.0))  # NB dispersion
        # (region_dispersion) NB2's overdispersion alpha per region, exp of a linear map of
        # its static features; the dispersion is phi = 1 / alpha
        self.disp = nn.Linear(2, 1) if region_dispersion else None
        self.substeps, self.sigma, self.gamma = substeps, 1 / incubation, 1 / infectious

    def forward(self, mobility, pop, features=None):
        beta = F.softplus(self.beta_net(mobility)).squeeze(-1)  # (B, T)
        dt = 1.0 / self.substeps
        e = i = pop * torch.sigmoid(self.seed)
        s = pop - e - i
        incidence = []
        for t in range(beta.shape[1]):
            new = torch.zeros_like(pop)
            for _ in range(self.substeps):
                force = beta[:, t] * s * i / pop
                s_to_e, e_to_i, i_to_r = dt * force, dt * self.sigma * e, dt * self.gamma * i
                s, e, i = s - s_to_e, e + s_to_e - e_to_i, i + e_to_i - i_to_r
                new = new + e_to_i
            incidence.append(new)
        if self.disp is None:
            return torch.stack(incidence, 1), self.log_phi.exp()
        alpha = torch.exp(self.disp(features))  # (B, 1)
        return torch.stack(incidence, 1), 1 / alpha


class MetapopSEIR(SEIR):
    """A metapopulation SEIR: each region's force of infection mixes the prevalence of the
    batch's regions by a contact matrix, the softmax of learned affinities of their mean
    mobility over the present regions only (padding masked with -inf); a padding region's
    population is taken as 1, its compartments stay 0 and so does its incidence."""

    def __init__(self):
        super().__init__()
        self.query, self.key = nn.Linear(COVARIATES, 8), nn.Linear(COVARIATES, 8)

    def forward(self, mobility, pop):
        present = pop > 0
        n = torch.where(present, pop, torch.ones_like(pop))
        m = mobility.mean(1)
        scores = self.query(m) @ self.key(m).T / 8 ** 0.5
        contact = torch.softmax(scores.masked_fill(~present[None, :], float("-inf")), -1)
        beta = F.softplus(self.beta_net(mobility)).squeeze(-1)  # (B, T)
        dt = 1.0 / self.substeps
        e = i = pop * torch.sigmoid(self.seed)
        s = pop - e - i
        incidence = []
        for t in range(beta.shape[1]):
            new = torch.zeros_like(pop)
            for _ in range(self.substeps):
                force = beta[:, t] * s * (contact @ (i / n))
                s_to_e, e_to_i, i_to_r = dt * force, dt * self.sigma * e, dt * self.gamma * i
                s, e, i = s - s_to_e, e + s_to_e - e_to_i, i + e_to_i - i_to_r
                new = new + e_to_i
            incidence.append(new)
        return torch.stack(incidence, 1), self.log_phi.exp()


def make_metapop() -> MetapopSEIR:
    torch.manual_seed(0)
    return MetapopSEIR()


def make_seir() -> SEIR:
    torch.manual_seed(0)
    return SEIR()


def make_seir_daily() -> SEIR:
    """One Euler step a day (dt = 1): the step most ports of a textbook SEIR take."""
    torch.manual_seed(0)
    return SEIR(substeps=1)


def make_seir_regional() -> SEIR:
    torch.manual_seed(0)
    return SEIR(region_dispersion=True)


def seir_batch(g: torch.Generator, padded: int | None = None, hot: int | None = None,
               features: bool = False, raw: int | None = None):
    """(mobility, pop), cases, mask of REGIONS regions. ``padded``: that slot is a padding
    region (population 0, no cases, mask 0); ``hot``: that region's mobility index comes in
    percent (0-100) rather than as a fraction."""
    mobility = torch.rand(REGIONS, DAYS, COVARIATES, generator=g)
    pop = torch.randint(20_000, 200_000, (REGIONS,), generator=g).float()
    days = torch.arange(DAYS).float()
    rate = pop[:, None] * 1e-3 * torch.exp(0.08 * days)
    cases = torch.poisson(rate, generator=g)
    mask = torch.ones(REGIONS, DAYS)
    if padded is not None:
        pop[padded], cases[padded], mask[padded] = 0.0, 0.0, 0.0
    if hot is not None:
        mobility[hot] = mobility[hot] * 100
    if not features:
        return (mobility, pop), (cases, mask)
    # static features: log population (standardised) and the share of people over 65;
    # ``raw``: that region's row joined from a table with the population unlogged
    density = torch.stack([(pop.log() - 11) / 2, 0.1 + 0.2 * torch.rand(REGIONS, generator=g)], 1)
    if raw is not None:
        density[raw, 0] = pop[raw]
    return (mobility, pop, density), (cases, mask)


# ---------------------------------------------------------------------------------------------
# Renewal equation with a random-walk R_t and a reporting delay


def discretised_delay(mean: float, sd: float, days: int) -> torch.Tensor:
    """A gamma reporting delay on days 0..days-1, by its CDF at the half days, renormalised."""
    shape, rate = (mean / sd) ** 2, mean / sd ** 2
    edges = torch.arange(days + 1).float() - 0.5
    cdf = torch.special.gammainc(torch.tensor(shape), rate * edges.clamp_min(0))
    p = cdf[1:] - cdf[:-1]
    return p / p.sum()


class Renewal(nn.Module):
    """Reported cases of each region over ``horizon`` days by the renewal equation."""

    def __init__(self, horizon: int = DAYS, max_gi: int = 14, max_delay: int = 10,
                 r0: float = 1.3, walk_sd: float = 0.0):
        super().__init__()
        self.log_r0 = nn.Parameter(torch.full((REGIONS,), float(torch.tensor(r0).log())))
        self.walk = nn.Parameter(walk_sd * torch.randn(REGIONS, horizon))  # log R_t increments
        self.log_phi = nn.Parameter(torch.tensor(2.0))
        self.register_buffer("delay", discretised_delay(4.0, 2.0, max_delay))
        self.max_gi = max_gi

    def generation_interval(self, gi_logmean, gi_logsd):
        """w_s, s = 1..max_gi: a lognormal's mass on each day, truncated and renormalised."""
        days = torch.arange(1, self.max_gi + 1).float()
        dist = LogNormal(gi_logmean[:, None], gi_logsd[:, None])
        w = dist.cdf(days + 0.5) - dist.cdf(days - 0.5)
        return w / w.sum(-1, keepdim=True)

    def forward(self, region, seed_cases, gi_logmean, gi_logsd):
        w = self.generation_interval(gi_logmean, gi_logsd)  # (B, S)
        walk = self.walk[region]
        rt = torch.exp(self.log_r0[region, None] + torch.cumsum(walk, 1))  # (B, T)
        infections = [seed_cases] * self.max_gi  # the seeding days, most recent last
        for t in range(rt.shape[1]):
            past = torch.stack(infections[::-1][:self.max_gi], 1)  # (B, S), lag 1 first
            infections.append(rt[:, t] * (past * w).sum(1))
        new = torch.stack(infections[self.max_gi:], 1)  # (B, T)
        kernel = self.delay.flip(0)[None, None]
        reported = F.conv1d(F.pad(new[:, None], (len(self.delay) - 1, 0)), kernel)[:, 0]
        return reported, self.log_phi.exp(), walk


def renewal_loss(out, cases, mask, walk_scale: float = 0.1):
    """NB likelihood of the reported cases plus the random walk's Gaussian prior."""
    mu, phi, walk = out
    return nb_nll(mu, phi, cases, mask) + 0.5 * (walk / walk_scale).pow(2).mean()


def make_renewal() -> Renewal:
    torch.manual_seed(0)
    return Renewal()


def make_renewal_long() -> Renewal:
    """A year's horizon, R_t starting at the literature's R0 = 2.5 with a noisy random walk."""
    torch.manual_seed(0)
    return Renewal(horizon=365, r0=2.5, walk_sd=0.02)


def renewal_batch(g: torch.Generator, hours: int | None = None, horizon: int = DAYS):
    """(region, seed cases, generation interval's log mean and log sd), cases, mask.
    ``hours``: that region's serial interval came from a table in hours, not days."""
    region = torch.arange(REGIONS)
    seed = torch.randint(5, 50, (REGIONS,), generator=g).float()
    gi_mean = torch.full((REGIONS,), 5.0) + torch.rand(REGIONS, generator=g)
    gi_sd = torch.full((REGIONS,), 0.3)
    if hours is not None:
        gi_mean[hours] = gi_mean[hours] * 24
    days = torch.arange(horizon).float()
    cases = torch.poisson(seed[:, None] * torch.exp(0.03 * days), generator=g)
    return (region, seed, gi_mean.log(), gi_sd), (cases, torch.ones(REGIONS, horizon))


# ---------------------------------------------------------------------------------------------
# A GRU forecaster of log incidence


class LogForecaster(nn.Module):
    def __init__(self, hidden: int = 16, ahead: int = 7):
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, ahead)

    def forward(self, log_history):  # (B, W)
        h, _ = self.gru(log_history[..., None])
        return self.head(h[:, -1])


def make_forecaster() -> LogForecaster:
    torch.manual_seed(0)
    return LogForecaster()


def log_incidence_batch(g: torch.Generator, silent: int | None = None, log1p: bool = False,
                        window: int = 21, ahead: int = 7):
    """Rolling windows of REGIONS regions' daily cases, log-transformed; ``silent``: that
    region reported no case at all in the window (a reporting freeze)."""
    days = torch.arange(window + ahead).float()
    cases = torch.poisson(20 * torch.exp(0.02 * days).expand(REGIONS, -1), generator=g)
    if silent is not None:
        cases[silent] = 0.0
    logged = torch.log1p(cases) if log1p else torch.log(cases)
    return (logged[:, :window],), (logged[:, window:],)
