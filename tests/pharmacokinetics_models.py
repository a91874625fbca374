"""Population PK/PD models written the way neural-NLME code (DeepNLME-style covariate nets,
PK-informed neural nets) writes them, for ``test_pharmacokinetics``.

- ``OneCompartment``: an MLP maps each patient's standardised covariates to random effects
  ``eta`` around population log-parameters; ``ka, ke, V = exp(log_theta + eta)`` (log-normal
  individual parameters) and the Bateman function of first-order absorption
  ``C(t) = D/V * ka/(ka - ke) * (exp(-ke t) - exp(-ka t))`` at each record's time since dose
  (given to ``forward`` beside the covariates and the dose). ``clamp_time`` is the usual
  ``t.clamp(min=0)`` that makes pre-dose samples 0.
- ``AmortisedPK``: amortised inference, eta from an attention pool over each patient's
  observed records (padding masked with -inf) and the covariates.
- ``WeibullAbsorption``: the Weibull fraction absorbed ``1 - exp(-(t / td) ** beta)`` times
  first-order elimination.
- ``LogTimeMLP``: a data-driven surrogate, an MLP of the covariates, log dose and
  ``log1p(t)`` of each record.
- ``Infusion``: a one-compartment zero-order infusion, rate ``D / dur`` (the duration per
  patient given to ``forward``).
- ``EmaxPD``: the PK model above feeding a sigmoid Emax (Hill) effect
  ``E = E0 + Emax C^h / (EC50^h + C^h)`` with a learned Hill coefficient ``h = exp(log_h)``.
- ``PKLoss``: the NLME-style Gaussian NLL of a residual error model, ``sigma = a + b C``
  (combined) or ``b C`` (proportional only), ``0.5 (log sigma^2 + (y - C)^2 / sigma^2)`` over
  the observed (unpadded) records, with Beal's M3 for samples below the LLOQ
  (``-log Phi((LLOQ - C) / sigma)``) and the mean per patient then over patients.
- ``LogTransformLoss``: log-transform-both-sides, an additive error on log C.
"""

from __future__ import annotations

import math

import torch
from torch import nn

N_COV, N_OBS, N_PAT = 4, 6, 8
LLOQ = 0.05
TIMES = torch.tensor([0.5, 1.0, 2.0, 4.0, 8.0, 24.0])


class OneCompartment(nn.Module):
    """Covariates -> eta -> (ka, ke, V) -> concentration at each time since dose."""

    def __init__(self, log_theta=(0.4, -1.6, 2.3), clamp_time: bool = True,
                 zero_eta: bool = False):
        super().__init__()
        self.covnet = nn.Sequential(nn.Linear(N_COV, 16), nn.SiLU(), nn.Linear(16, 3))
        self.log_theta = nn.Parameter(torch.tensor(log_theta))
        self.clamp_time = clamp_time
        if zero_eta:  # random effects start at 0: every patient at the typical values
            nn.init.zeros_(self.covnet[2].weight)
            nn.init.zeros_(self.covnet[2].bias)

    def params(self, cov):
        eta = self.covnet(cov)
        return (self.log_theta + eta).exp().unbind(-1)

    def forward(self, cov, dose, tad):
        ka, ke, v = (p[:, None] for p in self.params(cov))
        t = tad.clamp(min=0) if self.clamp_time else tad
        return dose[:, None] / v * ka / (ka - ke) * (torch.exp(-ke * t) - torch.exp(-ka * t))


class AmortisedPK(OneCompartment):
    """Amortised inference of the random effects: an attention pool over each patient's
    observed records ``(t, log y)``, its padding masked with -inf before the softmax, with the
    covariates gives eta (the observations given to ``forward`` beside the times)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(2, 16), nn.SiLU())
        self.score = nn.Linear(16, 1)
        self.head = nn.Linear(16 + N_COV, 3)

    def forward(self, cov, dose, tad, y, mask):
        h = self.enc(torch.stack([tad, torch.log(y.clamp_min(LLOQ))], -1))
        w = self.score(h).squeeze(-1).masked_fill(~mask, float("-inf")).softmax(-1)
        eta = self.head(torch.cat([(w[..., None] * h).sum(1), cov], -1))
        ka, ke, v = ((self.log_theta + eta).exp()[:, None, i] for i in range(3))
        return dose[:, None] / v * ka / (ka - ke) * (torch.exp(-ke * tad) - torch.exp(-ka * tad))


class WeibullAbsorption(nn.Module):
    """Weibull-type absorption: the fraction absorbed by t is ``1 - exp(-(t / td) ** beta)``
    (a shape beta = exp(log_beta) learned per population, often below 1), times first-order
    elimination of the absorbed amount (the quick approximation of its convolution)."""

    def __init__(self):
        super().__init__()
        self.covnet = nn.Sequential(nn.Linear(N_COV, 16), nn.SiLU(), nn.Linear(16, 3))
        self.log_theta = nn.Parameter(torch.tensor([0.0, -1.6, 2.3]))  # td, ke, V
        self.log_beta = nn.Parameter(torch.tensor(math.log(0.8)))

    def forward(self, cov, dose, tad):
        td, ke, v = ((self.log_theta + self.covnet(cov)).exp()[:, None, i] for i in range(3))
        absorbed = 1 - torch.exp(-(tad / td) ** self.log_beta.exp())
        return dose[:, None] / v * absorbed * torch.exp(-ke * tad)


class LogTimeMLP(nn.Module):
    """A data-driven PK surrogate: an MLP of the covariates, log dose and log(1 + t) of each
    record (time on a log scale, as ML PK models take it) gives log C."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_COV + 2, 32), nn.SiLU(), nn.Linear(32, 1))

    def forward(self, cov, dose, tad):
        n, t = tad.shape
        x = torch.cat([cov[:, None].expand(n, t, N_COV), torch.log1p(tad)[..., None],
                       torch.log(dose)[:, None, None].expand(n, t, 1)], -1)
        return self.net(x).squeeze(-1).exp()


class Infusion(nn.Module):
    """A one-compartment zero-order infusion: rate ``R = D / dur`` over ``[0, dur]``, then
    first-order elimination; CL and V from the covariates as above."""

    def __init__(self):
        super().__init__()
        self.covnet = nn.Sequential(nn.Linear(N_COV, 16), nn.SiLU(), nn.Linear(16, 2))
        self.log_theta = nn.Parameter(torch.tensor([0.7, 2.3]))

    def forward(self, cov, dose, tad, dur):
        cl, v = ((self.log_theta + self.covnet(cov)).exp()[:, None, i] for i in range(2))
        ke, rate = cl / v, (dose / dur)[:, None]
        t_in = torch.minimum(tad, dur[:, None])  # time infused so far
        during = rate / cl * (1 - torch.exp(-ke * t_in))
        return during * torch.exp(-ke * (tad - t_in))


class EmaxPD(nn.Module):
    """PK (``OneCompartment``) then a sigmoid Emax effect of the concentration."""

    def __init__(self, hill: float = 0.7, safe_base: bool = False):
        super().__init__()
        self.pk = OneCompartment()
        self.e0 = nn.Parameter(torch.tensor(1.0))
        self.log_emax = nn.Parameter(torch.tensor(1.0))
        self.log_ec50 = nn.Parameter(torch.tensor(0.0))
        self.log_h = nn.Parameter(torch.tensor(math.log(hill)))  # 0.7: shallow, fractional
        self.safe_base = safe_base

    def forward(self, cov, dose, tad):
        c = self.pk(cov, dose, tad)
        h = self.log_h.exp()
        if self.safe_base:  # C = 0 (padding, pre-dose) gives 1 ** h, then 0: no pole
            on = c > 0
            ch = torch.where(on, c, 1.0) ** h * on
        else:
            ch = c ** h
        return self.e0 + self.log_emax.exp() * ch / (self.log_ec50.exp() ** h + ch)


class PKLoss(nn.Module):
    """Gaussian NLL of a residual error model with M3 for BLQ records, masked for padding."""

    def __init__(self, additive: float = 0.02, exact_tail: bool = True,
                 per_patient: bool = True, blq_only: bool = False):
        super().__init__()
        self.log_b = nn.Parameter(torch.tensor(math.log(0.1)))
        self.additive = additive
        self.exact_tail = exact_tail
        self.per_patient = per_patient
        self.blq_only = blq_only

    def m3(self, z):
        """-log P(y < LLOQ) of Beal's M3."""
        if self.exact_tail:
            return -torch.special.log_ndtr(z)
        # Phi through erf, as most NONMEM ports write it: 0 in float32 below z of about -5.5
        return -torch.log(0.5 * (1 + torch.erf(z / math.sqrt(2))))

    def forward(self, pred, y, mask, blq):
        sigma = self.additive + self.log_b.exp() * pred
        nll = 0.5 * (torch.log(sigma ** 2) + (y - pred) ** 2 / sigma ** 2)
        z = (LLOQ - pred) / sigma
        if self.blq_only:  # the M3 term of the BLQ records alone, scattered back
            cens = torch.zeros_like(pred)
            cens[mask & blq] = self.m3(z[mask & blq])
        else:
            cens = self.m3(z)
        # padded records hold 0 in y and tad, and a pre-dose 0 is no sample: keep them out
        nll = torch.where(mask & ~blq, nll, 0.0) + torch.where(mask & blq, cens, 0.0)
        if self.per_patient:
            return (nll.sum(1) / mask.sum(1)).mean()
        return nll.sum() / mask.sum()


class LogTransformLoss(nn.Module):
    """Log-transform-both-sides (LTBS): an additive error on log C, as NONMEM's exponential
    error model is fitted, over the observed records."""

    def __init__(self):
        super().__init__()
        self.log_sd = nn.Parameter(torch.tensor(-1.0))

    def forward(self, pred, y, mask, blq):
        res = (torch.log(y) - torch.log(pred)) / self.log_sd.exp()
        nll = self.log_sd + 0.5 * res ** 2
        return nll[mask].mean()


class EffectLoss(nn.Module):
    """The PD model's Gaussian NLL with a learned variance, masked for padding."""

    def __init__(self):
        super().__init__()
        self.log_sd = nn.Parameter(torch.tensor(-1.0))

    def forward(self, pred, y, mask, blq):
        nll = self.log_sd + 0.5 * ((y - pred) / self.log_sd.exp()) ** 2
        return (nll * mask).sum() / mask.sum()


def make_pk():
    torch.manual_seed(0)
    return OneCompartment()


def make_pk_untouched_time():
    torch.manual_seed(0)
    return OneCompartment(clamp_time=False)


def make_pk_same_rates():
    torch.manual_seed(0)
    return OneCompartment(log_theta=(0.0, 0.0, 2.3), zero_eta=True)


def make_pd():
    torch.manual_seed(0)
    return EmaxPD()


def make_pd_safe():
    torch.manual_seed(0)
    return EmaxPD(safe_base=True)


def make_pd_steep():
    """A steep concentration-effect curve (h = 10: a neuromuscular blocker's)."""
    torch.manual_seed(0)
    return EmaxPD(hill=10.0, safe_base=True)


def make_amortised():
    torch.manual_seed(0)
    return AmortisedPK()


def make_weibull():
    torch.manual_seed(0)
    return WeibullAbsorption()


def make_log_time():
    torch.manual_seed(0)
    return LogTimeMLP()


def make_infusion():
    torch.manual_seed(0)
    return Infusion()


def make_loss(**kw):
    torch.manual_seed(0)
    return PKLoss(**kw)


def patients(g: torch.Generator, n: int = N_PAT, padded: bool = True):
    """One batch of patients: covariates (standardised weight, age, CrCl, sex), a dose in mg,
    the time after dose of each record, observed concentrations (log-normal noise), the
    padding mask (patients have 4-6 records) and the BLQ flags (y recorded as LLOQ)."""
    cov = torch.randn(n, N_COV, generator=g)
    dose = 100.0 * torch.ones(n)
    tad = TIMES.repeat(n, 1) + 0.1 * torch.rand(n, N_OBS, generator=g)
    ka, ke, v = 1.5 * torch.ones(n, 1), 0.2 * (1 + 0.2 * cov[:, 2:3]).clamp(0.5), 10.0
    c = dose[:, None] / v * ka / (ka - ke) * (torch.exp(-ke * tad) - torch.exp(-ka * tad))
    y = c * torch.exp(0.1 * torch.randn(n, N_OBS, generator=g))
    n_obs = torch.randint(4, N_OBS + 1, (n,), generator=g) if padded else torch.full((n,), N_OBS)
    mask = torch.arange(N_OBS)[None] < n_obs[:, None]
    blq = mask & (y < LLOQ)
    y = torch.where(blq, LLOQ, y) * mask
    return cov, dose, tad * mask, y, mask, blq


def durations(n: int = N_PAT) -> torch.Tensor:
    """Each patient's infusion duration, 1 h (a short infusion)."""
    return torch.ones(n)


def plant_duration(dur, kind: str, bad: int):
    """A bolus coded as an infusion of duration 0 in patient ``bad``."""
    if kind != "zero_duration":
        return dur
    dur = dur.clone()
    dur[bad] = 0.0
    return dur


def plant(batch, kind: str, bad: int):
    """The data conditions of real PK datasets, in patient ``bad``."""
    cov, dose, tad, y, mask, blq = (t.clone() for t in batch)
    if kind == "blq_at_peak":  # a BLQ flag copied onto the wrong row: at tmax, ~8 mg/L predicted
        blq[bad, 2], y[bad, 2] = True, LLOQ
    elif kind == "predose":  # the pre-dose sample kept in: time -0.5 h, concentration 0
        tad[bad, 0], y[bad, 0] = -0.5, 0.0
    elif kind == "unsorted":  # records sorted by clock time across a day change: tad -150 h
        tad[bad, 3] = -150.0
    elif kind == "dose_in_ug":  # a dose entered in micrograms among milligrams
        dose[bad] = dose[bad] * 1000
    elif kind == "blq_as_zero":  # a BLQ result exported as 0 instead of flagged
        y[bad, 4] = 0.0
    elif kind == "no_obs":  # a patient dosed but every sample lost: all padding
        mask[bad], blq[bad], y[bad], tad[bad] = False, False, 0.0, 0.0
    return cov, dose, tad, y, mask, blq
