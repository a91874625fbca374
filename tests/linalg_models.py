"""Models for ``tests/test_linalg.py``: linear-algebra-heavy training written as the usual
repositories write it (a Glow flow's invertible 1x1 convolution, a sparse variational GP's
kernel against inducing points, Procrustes alignment, Newton-Schulz whitening), each with a
NaN bug planted that the domain is known for.

Factories are named ``make_*``; tests record with ``factory="linalg_models:make_*"`` and
replay from this directory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

C, D_IN, HIDDEN, M_IND = 4, 3, 16, 8


class InvConv(nn.Module):
    """Glow's invertible 1x1 convolution on flat features, its weight a random rotation from
    QR (as Glow initialises it). BUG: ``torch.logdet`` instead of ``slogdet``'s logabsdet: a
    weight whose determinant is negative has a NaN log-determinant."""

    def __init__(self, c: int):
        super().__init__()
        w = torch.linalg.qr(torch.randn(c, c))[0]
        self.weight = nn.Parameter(w)

    def forward(self, x):
        return x @ self.weight.T, torch.logdet(self.weight).expand(len(x))


class Coupling(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(c // 2, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, c))

    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        s, t = self.net(a).chunk(2, dim=1)
        s = torch.tanh(s)
        return torch.cat([a, b * torch.exp(s) + t], dim=1), s.sum(1)


class GlowFlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv0, self.coup0 = InvConv(C), Coupling(C)
        self.conv1, self.coup1 = InvConv(C), Coupling(C)

    def forward(self, x):
        logdet = torch.zeros(len(x))
        for layer in (self.conv0, self.coup0, self.conv1, self.coup1):
            x, ld = layer(x)
            logdet = logdet + ld
        return x, logdet


def make_glow(seed: int = 0):
    torch.manual_seed(seed)
    return GlowFlow()


def flow_nll(out, _unused=None):
    z, logdet = out
    return (0.5 * (z ** 2).sum(1) - logdet).mean()


class InducingKernel(nn.Module):
    """A sparse variational GP's cross-covariance K(x, Z) between a batch and the inducing
    points, Matern-1/2 (exponential) kernel, lengthscale through softplus (gpytorch's Positive
    constraint). BUG: the distance is ``sqrt`` of the squared distance without a floor (gpytorch
    clamps it, ``clamp_min(1e-30)``): a sample lying on an inducing point has distance 0, whose
    square root has an infinite derivative."""

    def __init__(self, z: torch.Tensor):
        super().__init__()
        # gpytorch's learn_inducing_locations=False: the inducing points stay where they began
        self.register_buffer("inducing", z.clone())
        self.raw_lengthscale = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        ls = F.softplus(self.raw_lengthscale)
        d2 = ((x.unsqueeze(-2) - self.inducing.unsqueeze(-3)) / ls).pow(2).sum(-1)
        return torch.exp(-torch.sqrt(d2))  # BUG: sqrt(0) at an inducing point


class SVGPRegressor(nn.Module):
    """A deep-kernel SVGP's predictive mean: features, then K(x, Z) times the variational
    mean (the whitened parametrisation's K_xz K_zz^-1/2 m folded into one vector)."""

    def __init__(self, z: torch.Tensor):
        super().__init__()
        self.covar = InducingKernel(z)
        self.var_mean = nn.Parameter(torch.randn(z.shape[0]) * 0.1)

    def forward(self, x):
        return self.covar(x) @ self.var_mean


def inducing_init(n: int = M_IND) -> torch.Tensor:
    """gpytorch's SVGP example: the inducing points are the first training inputs."""
    return torch.randn(n, D_IN, generator=torch.Generator().manual_seed(99))


def make_svgp():
    torch.manual_seed(0)
    return SVGPRegressor(inducing_init())


class ExactGP(nn.Module):
    """Exact GP regression on a mini-batch (the batch is the training set of the step): RBF
    kernel with softplus lengthscale and noise, negative log marginal likelihood. BUG: the
    log-determinant is ``torch.logdet(K)`` of a kernel matrix whose noise drifted to ~0: two
    identical inputs make K singular up to the noise, and float32 rounding makes it not
    positive-definite: ``cholesky_ex`` (no error check, no host sync) fails silently and its
    factor's diagonal holds the negative pivot, whose log is NaN."""

    def __init__(self):
        super().__init__()
        self.raw_lengthscale = nn.Parameter(torch.tensor(0.5))
        self.raw_noise = nn.Parameter(torch.tensor(-20.0))  # softplus(-20) ~ 2e-9

    def forward(self, x, y):
        ls, noise = F.softplus(self.raw_lengthscale), F.softplus(self.raw_noise)
        d2 = torch.cdist(x / ls, x / ls).pow(2)
        k = torch.exp(-0.5 * d2) + noise * torch.eye(len(x))
        chol = torch.linalg.cholesky_ex(k).L
        alpha = torch.cholesky_solve(y.unsqueeze(-1), chol).squeeze(-1)
        return 0.5 * (y @ alpha) + chol.diagonal().log().sum()


def make_exact_gp():
    torch.manual_seed(0)
    return ExactGP()
