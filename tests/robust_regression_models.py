"""Probabilistic and robust regression written the way statisticians and ML engineers write
it (Nix & Weigend's mean-variance network, Bishop's mixture density network, Koenker's
quantile regression, Barron's general robust loss, Tobin's censored model, Amini et al.'s deep
evidential regression): the factories, losses and data of ``test_robust_regression.py``.

- ``heteroscedastic``: a 1-d regression with noise growing in x, a few heavy-tailed outliers,
  and a censoring threshold (readings above ``CEIL`` stored as ``CEIL``, the flag beside them).
- ``MeanVarianceNet``: a shared trunk, a mean head and a log-variance head
  (``GaussianNLL``, hand-written: ``0.5 (log_var + (y - mu)^2 exp(-log_var))``), or a softplus
  scale for ``nn.GaussianNLLLoss``, ``StudentTNLL`` and ``LaplaceNLL`` (``torch.distributions``);
  a ReLU scale, or the head's value taken as the variance as is.
- ``MixtureDensityNet`` + ``MDNLoss``: K components, softmax weights, per-component sigma,
  the likelihood summed over components (``logsumexp`` of log-weights and log-densities, or
  the textbook density sum then ``log``).
- ``QuantileNet`` + ``PinballLoss``: several quantiles, the pinball loss and a penalty on
  crossed quantiles.
- ``BarronLoss``: Barron's general robust loss with learnable shape ``alpha`` and scale ``c``
  (Huber, Cauchy and Tukey's biweight beside it as ``RobustLoss(kind)``, and the biweight as
  IRLS, ``TukeyIRLS``: detached weights, the weighted mean normalised by their sum).
- ``BoxCoxNLL``: a Gaussian NLL in Box-Cox space with a learnable lambda and the Jacobian term
  ``(lambda - 1) log y``; ``YeoJohnson`` the transform for targets of either sign.
- ``TobitNLL``: the censored likelihood, ``log pdf`` for observed rows, ``log(1 - Phi(z))`` for
  the rows at the ceiling (``log_ndtr(-z)`` in the stable form).
- ``EvidentialNet`` + ``EvidentialLoss``: Normal-Inverse-Gamma outputs (gamma, nu, alpha,
  beta) and the NIG NLL with the evidence regulariser.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

HIDDEN, CEIL = 16, 3.0


def heteroscedastic(n: int = 256, seed: int = 0):
    """(x (n, 1), y (n,), censored (n,) 0/1): y = sin(3x) + x + noise growing in |x|, a few
    Student-t outliers, readings above CEIL stored as CEIL and flagged."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g) * 4 - 2
    noise = torch.randn(n, generator=g) * (0.1 + 0.3 * x[:, 0].abs())
    y = torch.sin(3 * x[:, 0]) + x[:, 0] + noise
    outliers = torch.rand(n, generator=g) < 0.03
    y = torch.where(outliers, y + 4 * torch.randn(n, generator=g), y)
    censored = (y > CEIL).float()
    return x, y.clamp(max=CEIL), censored


def positive_targets(n: int = 256, seed: int = 1):
    """(x, y > 0): a skewed positive target (log-normal), for a Box-Cox transform."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g) * 2
    y = torch.exp(0.5 + x[:, 0] + 0.4 * torch.randn(n, generator=g))
    return x, y


class Trunk(nn.Module):
    def __init__(self, d_in: int = 1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, HIDDEN), nn.Tanh(),
                                 nn.Linear(HIDDEN, HIDDEN), nn.Tanh())

    def forward(self, x):
        return self.net(x)


class MeanVarianceNet(nn.Module):
    """Mean and log-variance heads (``scale="log_var"``), or mean and a std: softplus,
    ReLU (``"relu"``) or the head's value as is (``"raw"``)."""

    def __init__(self, scale: str = "log_var"):
        super().__init__()
        self.scale = scale
        self.trunk = Trunk()
        self.mean = nn.Linear(HIDDEN, 1)
        self.spread = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        h = self.trunk(x)
        mu, s = self.mean(h)[:, 0], self.spread(h)[:, 0]
        if self.scale == "log_var":
            return mu, s
        if self.scale == "relu":  # (a positive scale by ReLU: 0 for every x past its kink)
            return mu, F.relu(s)
        if self.scale == "raw":  # (the variance read off the head as is)
            return mu, s
        return mu, F.softplus(s) + 1e-4


class GaussianNLL(nn.Module):
    """Nix & Weigend's NLL with a predicted log-variance."""

    def forward(self, out, y):
        mu, log_var = out
        return (0.5 * (log_var + (y - mu) ** 2 * torch.exp(-log_var))).mean()


class TorchGaussianNLL(nn.Module):
    """``nn.GaussianNLLLoss`` on the predicted std squared to a variance, or (``squared=
    False``) on the head's output taken as the variance itself."""

    def __init__(self, squared: bool = True):
        super().__init__()
        self.nll = nn.GaussianNLLLoss(eps=1e-6)
        self.squared = squared

    def forward(self, out, y):
        mu, std = out
        return self.nll(mu, y, std ** 2 if self.squared else std)


class StudentTNLL(nn.Module):
    """Student-t likelihood with a learnable degrees of freedom (``df = 2 + softplus``)."""

    def __init__(self):
        super().__init__()
        self.raw_df = nn.Parameter(torch.tensor(1.0))

    def forward(self, out, y):
        mu, std = out
        df = 2 + F.softplus(self.raw_df)
        return -torch.distributions.StudentT(df, mu, std).log_prob(y).mean()


class LaplaceNLL(nn.Module):
    def forward(self, out, y):
        mu, b = out
        return -torch.distributions.Laplace(mu, b).log_prob(y).mean()


class MixtureDensityNet(nn.Module):
    """Bishop's MDN: K mixing logits, means and log-sigmas from one trunk."""

    def __init__(self, k: int = 3):
        super().__init__()
        self.trunk = Trunk()
        self.pi = nn.Linear(HIDDEN, k)
        self.mu = nn.Linear(HIDDEN, k)
        self.log_sigma = nn.Linear(HIDDEN, k)

    def forward(self, x):
        h = self.trunk(x)
        return self.pi(h), self.mu(h), self.log_sigma(h)


class MDNLoss(nn.Module):
    """The mixture NLL: ``stable`` through logsumexp, else the textbook density sum."""

    def __init__(self, stable: bool = True):
        super().__init__()
        self.stable = stable

    def forward(self, out, y):
        logits, mu, log_sigma = out
        z = (y[:, None] - mu) / torch.exp(log_sigma)
        log_pdf = -0.5 * z ** 2 - log_sigma - 0.5 * math.log(2 * math.pi)
        if self.stable:
            return -torch.logsumexp(F.log_softmax(logits, -1) + log_pdf, -1).mean()
        pdf = torch.softmax(logits, -1) * torch.exp(log_pdf)
        return -torch.log(pdf.sum(-1)).mean()


QUANTILES = (0.1, 0.5, 0.9)


class QuantileNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = Trunk()
        self.head = nn.Linear(HIDDEN, len(QUANTILES))

    def forward(self, x):
        return self.head(self.trunk(x))


class PinballLoss(nn.Module):
    """Koenker's check loss over several quantiles, plus a penalty on crossed quantiles."""

    def __init__(self, crossing: float = 1.0):
        super().__init__()
        self.register_buffer("tau", torch.tensor(QUANTILES))
        self.crossing = crossing

    def forward(self, q, y):
        r = y[:, None] - q
        pinball = torch.maximum(self.tau * r, (self.tau - 1) * r).sum(-1)
        crossed = F.relu(q[:, :-1] - q[:, 1:]).sum(-1)
        return (pinball + self.crossing * crossed).mean()


class PointNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = Trunk()
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        return self.head(self.trunk(x))[:, 0]


class BarronLoss(nn.Module):
    """Barron (2019), the general form with a learnable shape and scale:
    ``|a-2|/a * (((x/c)^2 / |a-2| + 1)^(a/2) - 1)``, a = 2 the L2 loss in the limit."""

    def __init__(self, alpha: float = 1.0, scale: float = 1.0):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(alpha))
        self.log_c = nn.Parameter(torch.tensor(math.log(scale)))

    def forward(self, pred, y):
        a, c = self.alpha, torch.exp(self.log_c)
        b = torch.abs(a - 2)
        sq = ((pred - y) / c) ** 2
        return (b / a * ((sq / b + 1) ** (a / 2) - 1)).mean()


class RobustLoss(nn.Module):
    """Huber, Cauchy (Lorentzian) or Tukey's biweight of the residual at scale ``c``."""

    def __init__(self, kind: str = "huber", c: float = 1.0):
        super().__init__()
        self.kind, self.c = kind, c

    def forward(self, pred, y):
        r = pred - y
        if self.kind == "huber":
            return F.huber_loss(pred, y, delta=self.c)
        if self.kind == "cauchy":
            return (0.5 * self.c ** 2 * torch.log1p((r / self.c) ** 2)).mean()
        inside = (1 - (r / self.c) ** 2).clamp(min=0) ** 3
        return (self.c ** 2 / 6 * (1 - inside)).mean()


class TukeyIRLS(nn.Module):
    """Tukey's biweight as iteratively reweighted least squares: each residual's weight
    ``(1 - (r / c)^2)^2`` inside c, 0 outside, held fixed (detached), and the weighted mean
    of the squared residuals, normalised by the weights' sum."""

    def __init__(self, c: float = 4.685):
        super().__init__()
        self.c = c

    def forward(self, pred, y):
        r = pred - y
        w = ((1 - (r / self.c) ** 2).clamp(min=0) ** 2).detach()
        return (w * r ** 2).sum() / w.sum()


class BoxCoxNLL(nn.Module):
    """A Gaussian NLL of the Box-Cox transformed target with a learnable lambda, plus the
    Jacobian ``(lambda - 1) log y`` so lambda is a maximum-likelihood estimate."""

    def __init__(self, lam: float = 0.5):
        super().__init__()
        self.lam = nn.Parameter(torch.tensor(lam))

    def transform(self, y):
        lam = self.lam
        return torch.where(lam.abs() < 1e-6, torch.log(y), (y ** lam - 1) / lam)

    def forward(self, out, y):
        mu, log_var = out
        t = self.transform(y)
        nll = 0.5 * (log_var + (t - mu) ** 2 * torch.exp(-log_var))
        return (nll - (self.lam - 1) * torch.log(y)).mean()


class YeoJohnson(nn.Module):
    """Yeo-Johnson with a learnable lambda, for targets of either sign."""

    def __init__(self, lam: float = 1.0):
        super().__init__()
        self.lam = nn.Parameter(torch.tensor(lam))

    def forward(self, y):
        lam = self.lam
        pos = ((y.clamp(min=0) + 1) ** lam - 1) / lam
        neg = -((1 - y.clamp(max=0)) ** (2 - lam) - 1) / (2 - lam)
        return torch.where(y >= 0, pos, neg)


class TobitNLL(nn.Module):
    """The censored (Tobit) likelihood: observed rows by their density, rows at the ceiling by
    ``P(Y* > CEIL) = 1 - Phi(z)``; ``stable`` through ``log_ndtr(-z)``."""

    def __init__(self, stable: bool = True):
        super().__init__()
        self.stable = stable

    def forward(self, out, y, censored):
        mu, std = out
        z = (y - mu) / std
        observed = -0.5 * z ** 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)
        if self.stable:
            tail = torch.special.log_ndtr(-z)
        else:
            normal = torch.distributions.Normal(0.0, 1.0)
            tail = torch.log(1 - normal.cdf(z))
        return -torch.where(censored > 0, tail, observed).mean()


class EvidentialNet(nn.Module):
    """Deep evidential regression: gamma, nu > 0, alpha > 1, beta > 0 from softplus heads."""

    def __init__(self):
        super().__init__()
        self.trunk = Trunk()
        self.head = nn.Linear(HIDDEN, 4)

    def forward(self, x):
        gamma, nu, alpha, beta = self.head(self.trunk(x)).unbind(-1)
        return gamma, F.softplus(nu), F.softplus(alpha) + 1, F.softplus(beta)


class EvidentialLoss(nn.Module):
    """The NIG negative log-likelihood plus ``coeff * |y - gamma| (2 nu + alpha)``."""

    def __init__(self, coeff: float = 0.01):
        super().__init__()
        self.coeff = coeff

    def forward(self, out, y):
        gamma, nu, alpha, beta = out
        omega = 2 * beta * (1 + nu)
        nll = (0.5 * torch.log(math.pi / nu) - alpha * torch.log(omega)
               + (alpha + 0.5) * torch.log(nu * (y - gamma) ** 2 + omega)
               + torch.lgamma(alpha) - torch.lgamma(alpha + 0.5))
        reg = (y - gamma).abs() * (2 * nu + alpha)
        return (nll + self.coeff * reg).mean()


def make_mean_variance():
    torch.manual_seed(0)
    return MeanVarianceNet("log_var")


def make_softplus_scale():
    torch.manual_seed(0)
    return MeanVarianceNet("softplus")


def make_relu_scale():
    torch.manual_seed(0)
    return MeanVarianceNet("relu")


def make_raw_scale():
    torch.manual_seed(0)
    return MeanVarianceNet("raw")


def make_mdn():
    torch.manual_seed(0)
    return MixtureDensityNet()


def make_quantile():
    torch.manual_seed(0)
    return QuantileNet()


def make_point():
    torch.manual_seed(0)
    return PointNet()


def make_evidential():
    torch.manual_seed(0)
    return EvidentialNet()
