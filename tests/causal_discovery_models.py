"""Differentiable causal discovery written the way NOTEARS, DAGMA, GOLEM and ENCO write it in
torch, for ``test_causal_discovery``.

- ``SEMData``: a linear SEM on a random DAG (Erdos-Renyi, weights in ±[0.5, 2], Gaussian
  noise), as a ``Dataset`` (one observation per item).
- ``Notears``: a weighted adjacency ``W`` whose forward returns the reconstruction ``X W``,
  the acyclicity ``h(W) = tr(exp(W * W)) - d`` and the L1 norm; ``AugLagLoss`` holds the
  augmented Lagrangian's ``rho`` and ``alpha`` the outer loop updates (``rho *= 10`` while
  ``h`` stays above a quarter of its last value, ``alpha += rho * h``).
- ``Dagma``: DAGMA's log-det acyclicity ``-logdet(s I - W * W) + d log s`` (``torch.logdet``,
  where the reference code checks ``slogdet``'s sign first).
- ``Golem``: GOLEM-NV's likelihood: per node ``0.5 * log`` of its residual sum of squares,
  ``- logdet(I - W)``, from a ``W`` started at zero (GOLEM's init).
- ``Enco``: ENCO's edge existence logits ``gamma`` and orientation logits ``theta``, Gumbel
  (logistic) noise on a sigmoid per edge, the diagonal filled with ``-inf`` (no self-loops),
  and per node an MLP over its masked parents predicting its value.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class SEMData(torch.utils.data.Dataset):
    """``n`` observations of a linear Gaussian SEM over a random DAG on ``d`` nodes;
    ``constant`` names a node the sensor logged as a constant, ``copy`` a pair ``(j, k)``
    whose column j was written over by column k (a duplicated variable), ``scale`` columns
    logged in other units (``{j: 1000.0}``: millimetres among metres); ``standardise`` divides
    each column by its std, as the GOLEM and DAG-GNN scripts do before fitting."""

    def __init__(self, n: int = 128, d: int = 5, seed: int = 0, constant: int | None = None,
                 copy: tuple[int, int] | None = None, scale: dict | None = None,
                 standardise: bool = False):
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(d, generator=g)
        b = (torch.rand(d, d, generator=g) < 0.5).float().triu(1)
        b = b[order][:, order]
        sign = torch.where(torch.rand(d, d, generator=g) < 0.5, -1.0, 1.0)
        self.w_true = b * sign * (0.5 + 1.5 * torch.rand(d, d, generator=g))
        x = torch.zeros(n, d)
        for j in order.tolist():  # topological order of the permuted upper triangle
            x[:, j] = x @ self.w_true[:, j] + torch.randn(n, generator=g)
        if constant is not None:
            x[:, constant] = 3.0
        if copy is not None:
            x[:, copy[0]] = x[:, copy[1]]
        for j, c in (scale or {}).items():
            x[:, j] = x[:, j] * c
        x = x - x.mean(0)  # centred, as every NOTEARS script does before fitting
        self.x = x / x.std(0) if standardise else x  # (the bug: a constant column's std is 0)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


class Notears(nn.Module):
    """NOTEARS (linear): the reconstruction ``X W``, ``h(W)`` and ``|W|_1``."""

    def __init__(self, d: int = 5, init: float = 0.3):
        super().__init__()
        self.W = nn.Parameter(init * torch.randn(d, d) * (1 - torch.eye(d)))

    def acyclicity(self):
        d = self.W.shape[0]
        return torch.trace(torch.linalg.matrix_exp(self.W * self.W)) - d

    def forward(self, x):
        return x @ self.W, self.acyclicity(), self.W.abs().sum()


class Dagma(Notears):
    """DAGMA (linear): the log-det acyclicity on the M-matrix domain ``s I - W * W``."""

    def __init__(self, d: int = 5, s: float = 1.0, init: float = 0.1):
        super().__init__(d, init)
        self.s = s

    def acyclicity(self):
        d = self.W.shape[0]
        m = self.s * torch.eye(d) - self.W * self.W
        return -torch.logdet(m) + d * math.log(self.s)  # the bug: no slogdet sign check


class AugLagLoss(nn.Module):
    """NOTEARS' primal objective: least squares, L1, ``0.5 rho h^2 + alpha h``."""

    def __init__(self, lambda1: float = 0.01):
        super().__init__()
        self.lambda1, self.rho, self.alpha = lambda1, 1.0, 0.0

    def forward(self, recon, h, l1, x):
        score = 0.5 / x.shape[0] * ((x - recon) ** 2).sum()
        return score + self.lambda1 * l1 + 0.5 * self.rho * h * h + self.alpha * h


class Golem(nn.Module):
    """GOLEM-NV: returns the per-node residual sums of squares and ``logdet(I - W)``."""

    def __init__(self, d: int = 5):
        super().__init__()
        self.W = nn.Parameter(torch.zeros(d, d))  # GOLEM starts from the empty graph

    def forward(self, x):
        d = self.W.shape[0]
        resid = x - x @ self.W
        rss = (resid ** 2).sum(0)
        logdet = torch.slogdet(torch.eye(d) - self.W)[1]
        return rss, logdet, self.W.abs().sum(), torch.trace(torch.linalg.matrix_exp(self.W * self.W)) - d


def golem_nv_loss(rss, logdet, l1, h, lambda1: float = 2e-3, lambda2: float = 5.0):
    """GOLEM-NV: ``0.5 sum_j log(rss_j) - logdet(I - W)`` plus its soft DAG penalty."""
    return 0.5 * torch.log(rss).sum() - logdet + lambda1 * l1 + lambda2 * h


class Enco(nn.Module):
    """ENCO: edge probabilities ``sigmoid(gamma) * sigmoid(theta)`` sampled with logistic
    noise at temperature ``tau``; one small MLP per node over its masked parents."""

    def __init__(self, d: int = 5, hidden: int = 16, tau: float = 1.0):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(d, d))
        self.theta = nn.Parameter(torch.zeros(d, d))
        self.w1 = nn.Parameter(torch.randn(d, d, hidden) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(d, hidden) / math.sqrt(hidden))
        self.register_buffer("diag", torch.eye(d, dtype=torch.bool))
        self.tau = tau

    def forward(self, x):
        gamma = self.gamma.masked_fill(self.diag, float("-inf"))  # no self-loops
        theta = self.theta - self.theta.T  # orientation: theta_ij = -theta_ji
        u = torch.rand(x.shape[0], *gamma.shape).clamp(1e-6, 1 - 1e-6)
        logistic = torch.log(u) - torch.log1p(-u)
        mask = torch.sigmoid((gamma + logistic) / self.tau) * torch.sigmoid(theta)
        parents = x[:, :, None] * mask  # (B, parent, child)
        hid = torch.relu(torch.einsum("bpc,pch->bch", parents, self.w1))
        return (hid * self.w2).sum(-1)


def make_notears() -> Notears:
    torch.manual_seed(0)
    return Notears()


def make_dagma() -> Dagma:
    torch.manual_seed(0)
    return Dagma()


def make_golem() -> Golem:
    torch.manual_seed(0)
    return Golem()


def make_enco() -> Enco:
    torch.manual_seed(0)
    return Enco()
