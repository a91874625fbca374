"""Models whose forward decomposes or inverts a matrix (``test_linalg_errors``): an exact GP
with a learned lengthscale, a whitening layer on the batch's covariance, and a layer
unprojecting each sample's points through the inverse of its camera matrix."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RBF(nn.Module):
    """A squared-exponential kernel, its lengthscale learned through softplus."""

    def __init__(self, lengthscale: float = 0.05):
        super().__init__()
        self.raw_lengthscale = nn.Parameter(torch.tensor(math.log(math.expm1(lengthscale))))

    def forward(self, x):
        ls = F.softplus(self.raw_lengthscale)
        return torch.exp(-0.5 * torch.cdist(x, x).square() / ls.square())


class MarginalLikelihood(nn.Module):
    """The exact GP's negative log marginal likelihood, with a fixed jitter (float32's
    usual 1e-6 is what keeps it alive; 1e-7 is too small once the kernel is smooth)."""

    def __init__(self, jitter: float = 1e-7):
        super().__init__()
        self.jitter = jitter

    def forward(self, k, y):
        return gp_nll(k, y, self.jitter)


def gp_nll(k, y, jitter: float = 1e-7):
    """The negative log marginal likelihood (a plain loss function too)."""
    L = torch.linalg.cholesky(k + jitter * torch.eye(k.shape[0]))  # the bug: jitter too small
    alpha = torch.cholesky_solve(y[:, None], L)
    return 0.5 * (y[:, None] * alpha).sum() + L.diagonal().log().sum()


class ExactGP(nn.Module):
    def __init__(self):
        super().__init__()
        self.kernel = RBF()
        self.mll = MarginalLikelihood()

    def forward(self, x, y):
        return self.mll(self.kernel(x), y)


def make_gp():
    torch.manual_seed(0)
    return ExactGP()


def gp_data(n: int = 16):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=g)
    return x, torch.sin(3 * x[:, 0])


class Whiten(nn.Module):
    """ZCA-style whitening by the batch covariance's Cholesky factor (no ridge)."""

    def forward(self, x):
        xc = x - x.mean(0)
        cov = xc.T @ xc / x.shape[0]
        L = torch.linalg.cholesky(cov)  # the bug: no eps * I, a constant feature kills it
        return torch.linalg.solve_triangular(L, xc.T, upper=False).T


class WhitenNet(nn.Module):
    def __init__(self, d: int = 6):
        super().__init__()
        self.whiten = Whiten()
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.whiten(x))


def make_whiten():
    torch.manual_seed(0)
    return WhitenNet()


def whiten_batches(steps: int, dead_at: int, n: int = 32, d: int = 6):
    """Sensor batches; at step ``dead_at`` sensor 2 is stuck at 0 for the whole batch."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(n, d, generator=g) @ torch.randn(d, d, generator=g)
        if step == dead_at:
            x[:, 2] = 0.0
        yield x, torch.randint(0, 3, (n,), generator=g)


class Unproject(nn.Module):
    """Each sample's pixel (u, v, 1) back through the inverse of its camera matrix."""

    def forward(self, cams, pix):
        return (torch.linalg.inv(cams) @ pix[..., None])[..., 0]  # the bug: no check of cams


class RayNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.unproject = Unproject()
        self.head = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, cams, pix):
        return self.head(self.unproject(cams, pix))


def make_raynet():
    torch.manual_seed(0)
    return RayNet()


def ray_batches(steps: int, blank_at: int, row: int, n: int = 8):
    """Camera matrices with their pixels; at step ``blank_at`` record ``row``'s camera is a
    blank record (all zeros: a missing calibration)."""
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        f = 400 + 100 * torch.rand(n, generator=g)
        cams = torch.zeros(n, 3, 3)
        cams[:, 0, 0], cams[:, 1, 1], cams[:, 2, 2] = f, f, 1.0
        cams[:, 0, 2], cams[:, 1, 2] = 320.0, 240.0
        pix = torch.cat([640 * torch.rand(n, 2, generator=g), torch.ones(n, 1)], 1)
        if step == blank_at:
            cams[row] = 0.0
        yield cams, pix, torch.randn(n, 1, generator=g)


class StandardWhiten(nn.Module):
    """Standardise each feature, then ZCA through ``eigh`` of the correlation matrix."""

    def forward(self, x):
        xc = x - x.mean(0)
        z = xc / xc.square().mean(0).sqrt()  # the bug: no eps, 0/0 for a constant feature
        vals, vecs = torch.linalg.eigh(z.T @ z / x.shape[0])
        return z @ vecs / vals.clamp_min(1e-5).sqrt()


class ZcaNet(nn.Module):
    def __init__(self, d: int = 6):
        super().__init__()
        self.zca = StandardWhiten()
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.zca(x))


def make_zca():
    torch.manual_seed(0)
    return ZcaNet()


def make_kernel():
    """The GP's kernel alone: the loop computes the marginal likelihood as its loss_fn."""
    torch.manual_seed(0)
    return RBF()
