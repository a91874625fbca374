"""Bayesian deep learning and probabilistic regression as the well-known repositories write it,
for ``test_bayesian``: Bayes-by-backprop layers with Blundell's scale-mixture prior (their log
prior and posterior kept aside by the layers and added to the loss by the loop), a deep
ensemble of Gaussian heads run by ``torch.vmap``, Beta and Gamma regression returning the
distribution, a sparse variational GP, sparse variational dropout (its KL computed by the loop
from the weights) and a Gaussian in natural parameters."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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


class GaussianMember(nn.Module):
    """One member of a deep ensemble (Lakshminarayanan et al.): a mean and a variance head,
    the variance through exp (the bug: unbounded; the paper's softplus + 1e-6 is the fix)."""

    def __init__(self, d_in: int = 4, hidden: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x):
        mean, log_var = self.fc2(torch.relu(self.fc1(x))).unbind(-1)
        return torch.stack([mean, torch.exp(log_var)], -1)


class VmapEnsemble(nn.Module):
    """A deep ensemble as PyTorch's model-ensembling tutorial writes it: the members' weights
    stacked by ``torch.func.stack_module_state``, the members run at once by ``torch.vmap``
    over ``functional_call`` of one stateless copy; output (members, batch, 2)."""

    def __init__(self, members: int = 4):
        super().__init__()
        nets = [GaussianMember() for _ in range(members)]
        params, _ = torch.func.stack_module_state(nets)
        self.names = list(params)
        self.stacked = nn.ParameterList([nn.Parameter(params[n]) for n in self.names])
        self._base = [GaussianMember().to("meta")]  # (a list: not a submodule)

    def forward(self, x):
        def one(params, x):
            return torch.func.functional_call(self._base[0], dict(zip(self.names, params)),
                                              (x,))
        return torch.vmap(one, in_dims=(0, None))(tuple(self.stacked), x)


def make_vmap_ensemble():
    torch.manual_seed(0)
    return VmapEnsemble()


def ensemble_nll(out, y):
    """Each member's Gaussian NLL, summed over the members (each trained on its own NLL)."""
    mean, var = out.unbind(-1)
    return F.gaussian_nll_loss(mean, y.expand_as(mean), var, reduction="mean") * len(out)


class BetaRegressor(nn.Module):
    """Regression of a rate in (0, 1) by a Beta likelihood, or of an amount > 0 (rainfall, a
    claim) by a Gamma one: the two parameters by softplus, the model returning the
    distribution."""

    def __init__(self, d_in: int = 4, hidden: int = 16, family: str = "beta"):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, 2))
        self.family = family

    def forward(self, x):
        c = F.softplus(self.body(x)) + 1e-3
        cls = torch.distributions.Beta if self.family == "beta" else torch.distributions.Gamma
        return cls(c[:, 0], c[:, 1], validate_args=False)


def make_beta(**kw):
    torch.manual_seed(0)
    return BetaRegressor(**kw)


def beta_nll(dist, y):
    return -dist.log_prob(y).mean()


def rbf(a, b, lengthscale, outputscale):
    d2 = ((a[:, None, :] - b[None, :, :]) / lengthscale).pow(2).sum(-1)
    return outputscale * torch.exp(-0.5 * d2)


class SVGP(nn.Module):
    """A sparse variational GP (Hensman et al.) in the whitened parametrisation: inducing
    points ``Z``, ``q(v) = N(m, L L^T)`` with ``u = chol(Kzz) v``; the lower-triangular
    ``L`` trained as it is (the bug: its diagonal is not kept positive, GPyTorch's
    ``CholeskyVariationalDistribution`` trains it so too but takes the log of its absolute
    value). Returns the predictive mean and variance and the KL to the prior."""

    def __init__(self, m: int = 8, d_in: int = 2, s0: float = 0.1):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.z = nn.Parameter(torch.rand(m, d_in, generator=g) * 4)
        self.m = nn.Parameter(torch.zeros(m))
        self.chol = nn.Parameter(torch.eye(m) * s0)
        self.raw_lengthscale = nn.Parameter(torch.zeros(d_in))
        self.raw_outputscale = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        ls, os = F.softplus(self.raw_lengthscale), F.softplus(self.raw_outputscale)
        kzz = rbf(self.z, self.z, ls, os) + 1e-4 * torch.eye(len(self.z))
        lz = torch.linalg.cholesky(kzz)
        a = torch.linalg.solve_triangular(lz, rbf(self.z, x, ls, os), upper=False)
        s_chol = torch.tril(self.chol)
        mean = a.T @ self.m
        var = (os - a.pow(2).sum(0) + (s_chol.T @ a).pow(2).sum(0)).clamp_min(1e-6)
        kl = 0.5 * ((s_chol ** 2).sum() + self.m @ self.m - len(self.m)
                    - 2 * torch.log(torch.diagonal(s_chol)).sum())
        return mean, var, kl


def make_svgp(**kw):
    torch.manual_seed(0)
    return SVGP(**kw)


def svgp_elbo(out, y, noise: float = 0.01, n_data: int = 256):
    """The negative ELBO per data point: the expected Gaussian log-likelihood under q(f),
    then the KL over the data set's size."""
    mean, var, kl = out
    ell = -0.5 * (math.log(2 * math.pi * noise) + ((y - mean) ** 2 + var) / noise)
    return -ell.mean() + kl / n_data


class LinearSVDO(nn.Module):
    """Sparse variational dropout (Molchanov et al. 2017): weights ``theta`` with a learned
    ``log_sigma``; ``log_alpha = 2 log_sigma - log(theta**2)``, clamped to [-8, 8] as the
    paper's code does, but without its 1e-8 under the log (the bug: a weight of exactly 0, a
    bias initialised to zeros, makes log(0) = -inf, which the clamp takes to 8 in the forward
    while its backward multiplies the log's infinite derivative by the clamp's 0)."""

    def __init__(self, d_in, d_out, bias_init: float = 0.0):
        super().__init__()
        self.theta = nn.Parameter(torch.randn(d_out, d_in) * 0.3)
        self.bias = nn.Parameter(torch.full((d_out,), bias_init))
        self.log_sigma = nn.Parameter(torch.full((d_out, d_in), -5.0))
        self.bias_log_sigma = nn.Parameter(torch.full((d_out,), -5.0))

    def _log_alpha(self, w, log_sigma):
        return torch.clamp(2 * log_sigma - torch.log(w ** 2), -8, 8)

    def forward(self, x):
        mean = F.linear(x, self.theta, self.bias)
        std = torch.sqrt(F.linear(x ** 2, torch.exp(2 * self.log_sigma)) + 1e-8)
        return mean + std * torch.randn_like(mean)

    def kl_reg(self):
        k1, k2, k3 = 0.63576, 1.8732, 1.48695
        kl = 0.0
        for w, s in ((self.theta, self.log_sigma), (self.bias, self.bias_log_sigma)):
            la = self._log_alpha(w, s)
            kl = kl + (k1 - k1 * torch.sigmoid(k2 + k3 * la) + 0.5 * torch.log1p(torch.exp(-la))
                       ).sum()
        return kl


class SVDONet(nn.Module):
    def __init__(self, d_in=4, hidden=16):
        super().__init__()
        self.l1 = LinearSVDO(d_in, hidden)
        self.l2 = LinearSVDO(hidden, 1)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x))).squeeze(-1)

    def kl(self):
        return self.l1.kl_reg() + self.l2.kl_reg()


def make_svdo():
    torch.manual_seed(0)
    return SVDONet()


def svdo_elbo(out, y, kl, kl_weight: float = 1e-3):
    """The sparse VD objective: the data term plus the weighted KL, the KL passed in."""
    return F.mse_loss(out, y) + kl_weight * kl


class NaturalGaussian(nn.Module):
    """Heteroscedastic regression in the Gaussian's natural parameters (Immer et al. 2023):
    ``eta1 = f1``, ``eta2 = -0.5 * exp(f2)`` (negative in exact arithmetic), so that the
    negative log-likelihood is convex in them."""

    def __init__(self, d_in: int = 4, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x):
        f = self.body(x)
        return f[:, 0], -0.5 * torch.exp(f[:, 1])


def make_natural():
    torch.manual_seed(0)
    return NaturalGaussian()


def natural_nll(out, y):
    """-log N(y; mu, var) with mu = -eta1 / (2 eta2), var = -1 / (2 eta2), in eta."""
    eta1, eta2 = out
    return (-0.5 * torch.log(-2 * eta2) - eta1 ** 2 / (4 * eta2) - eta1 * y - eta2 * y ** 2
            ).mean()
