"""Bayesian deep learning and probabilistic regression as the well-known repositories write it,
for ``test_bayesian``: a mixture density network with Bishop's density-domain loss, evidential
regression's Normal-Inverse-Gamma head (Amini et al.), evidential classification's Dirichlet
(Sensoy et al.), and Bayes-by-backprop layers with Blundell's scale-mixture prior, their
log prior and posterior kept aside by the layers and added to the loss by the loop."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MDN(nn.Module):
    """Bishop's mixture density network: mixing weights by softmax, means, widths by exp."""

    def __init__(self, k: int = 3, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                  nn.Tanh())
        self.pi = nn.Linear(hidden, k)
        self.mu = nn.Linear(hidden, k)
        self.sigma = nn.Linear(hidden, k)

    def forward(self, x):
        h = self.body(x)
        return torch.softmax(self.pi(h), -1), self.mu(h), torch.exp(self.sigma(h))


def make_mdn():
    torch.manual_seed(0)
    return MDN()


def mdn_loss(out, y):
    """The density-domain loss many MDN tutorials write: the mixture's density, then its log
    (the bug: a target far from every component makes every density 0, and log(0) = -inf;
    ``logsumexp(log_softmax(pi) + Normal(mu, sigma).log_prob(y))`` is the stable form)."""
    pi, mu, sigma = out
    density = torch.exp(-0.5 * ((y - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    return -torch.log((pi * density).sum(-1)).mean()


class EvidentialRegressor(nn.Module):
    """Deep evidential regression: a Normal-Inverse-Gamma head (gamma, nu, alpha, beta),
    positivity by softplus, as the paper's ``DenseNormalGamma`` layer."""

    def __init__(self, d_in: int = 4, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                  nn.ReLU())
        self.head = nn.Linear(hidden, 4)

    def forward(self, x):
        gamma, lognu, logalpha, logbeta = self.head(self.body(x)).unbind(-1)
        nu, beta = F.softplus(lognu), F.softplus(logbeta)
        alpha = F.softplus(logalpha) + 1.0
        return gamma, nu, alpha, beta


def make_evidential():
    torch.manual_seed(0)
    return EvidentialRegressor()


def nig_nll(out, y, coeff: float = 1e-2):
    """The NIG negative log-likelihood plus the evidence regulariser, as in the paper's code:
    ``0.5 * log(pi / nu)`` (the bug: no eps under nu, whose softplus can round to 0)."""
    gamma, nu, alpha, beta = out
    omega = 2 * beta * (1 + nu)
    nll = (0.5 * torch.log(math.pi / nu) - alpha * torch.log(omega)
           + (alpha + 0.5) * torch.log(nu * (y - gamma) ** 2 + omega)
           + torch.lgamma(alpha) - torch.lgamma(alpha + 0.5))
    reg = (y - gamma).abs() * (2 * nu + alpha)
    return (nll + coeff * reg).mean()


class EvidentialClassifier(nn.Module):
    """Evidential deep learning for classification: Dirichlet concentrations
    ``alpha = evidence + 1`` with ``evidence = exp(logits)`` (the variant without clamping)."""

    def __init__(self, d_in: int = 4, k: int = 3, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, k))

    def forward(self, x):
        return torch.exp(self.body(x)) + 1.0


def make_edl():
    torch.manual_seed(0)
    return EvidentialClassifier()


def edl_digamma_loss(alpha, y, kl_weight: float = 0.1):
    """Sensoy's expected cross-entropy under the Dirichlet plus the annealed KL to Dir(1)."""
    onehot = F.one_hot(y, alpha.shape[-1]).float()
    s = alpha.sum(-1, keepdim=True)
    ce = (onehot * (torch.digamma(s) - torch.digamma(alpha))).sum(-1)
    a = onehot + (1 - onehot) * alpha
    sa = a.sum(-1, keepdim=True)
    kl = (torch.lgamma(sa).squeeze(-1) - math.lgamma(alpha.shape[-1])
          - torch.lgamma(a).sum(-1)
          + ((a - 1) * (torch.digamma(a) - torch.digamma(sa))).sum(-1))
    return (ce + kl_weight * kl).mean()


class BayesLinear(nn.Module):
    """Bayes by backprop: a Gaussian posterior per weight, ``sigma = log1p(exp(rho))``, one
    reparameterised sample per forward; the forward keeps its ``log_prior`` (Blundell's scale
    mixture, written with densities) and ``log_posterior`` aside for the loop's ELBO."""

    def __init__(self, d_in, d_out, pi=0.5, neg_log_sigma1=2.0, neg_log_sigma2=6.0,
                 rho0=-3.0):
        super().__init__()
        self.w_mu = nn.Parameter(torch.empty(d_out, d_in).uniform_(-0.2, 0.2))
        self.w_rho = nn.Parameter(torch.full((d_out, d_in), rho0))
        self.b_mu = nn.Parameter(torch.zeros(d_out))
        self.b_rho = nn.Parameter(torch.full((d_out,), rho0))
        self.pi = pi
        self.sigma1, self.sigma2 = math.exp(-neg_log_sigma1), math.exp(-neg_log_sigma2)
        self.log_prior = self.log_posterior = torch.zeros(())

    def _gauss(self, x, sigma):
        return torch.exp(-0.5 * (x / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))

    def _prior(self, w):
        return torch.log(self.pi * self._gauss(w, self.sigma1)
                         + (1 - self.pi) * self._gauss(w, self.sigma2)).sum()

    def forward(self, x):
        w_sigma = torch.log1p(torch.exp(self.w_rho))
        b_sigma = torch.log1p(torch.exp(self.b_rho))
        w = self.w_mu + w_sigma * torch.randn_like(w_sigma)
        b = self.b_mu + b_sigma * torch.randn_like(b_sigma)
        self.log_prior = self._prior(w) + self._prior(b)
        self.log_posterior = (torch.distributions.Normal(self.w_mu, w_sigma).log_prob(w).sum()
                              + torch.distributions.Normal(self.b_mu, b_sigma).log_prob(b).sum())
        return F.linear(x, w, b)


class BayesMLP(nn.Module):
    def __init__(self, d_in=4, hidden=16, **kw):
        super().__init__()
        self.l1 = BayesLinear(d_in, hidden, **kw)
        self.l2 = BayesLinear(hidden, 1, **kw)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))).squeeze(-1)

    def kl(self):
        return sum(m.log_posterior - m.log_prior for m in (self.l1, self.l2))


def make_bayes_mlp(**kw):
    torch.manual_seed(0)
    return BayesMLP(**kw)
