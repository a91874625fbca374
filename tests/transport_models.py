"""Optimal transport and soft dynamic programming as research code writes them by hand
(``test_transport.py``): entropic OT by Sinkhorn iterations in the plain domain
(``K = exp(-C / eps)``, ``u = a / (K @ v)``, as POT's ``sinkhorn_knopp``) and in the log domain
(``logsumexp`` updates, GeomLoss-style), used as a point-cloud matching loss; soft-DTW's
``R`` recursion with ``+inf`` borders (Cuturi & Blondel's ``softmin``); NeuralSort's
relaxed permutation matrix with a temperature; unbalanced OT's KL marginal penalty."""

from __future__ import annotations

import torch
from torch import nn

POINTS, DIM = 16, 2


class PointDecoder(nn.Module):
    """A latent code to a cloud of ``POINTS`` 2-D points (a set generator)."""

    def __init__(self, latent: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(latent, 64), nn.ReLU(), nn.Linear(64, POINTS * DIM))

    def forward(self, z):
        return self.net(z).view(len(z), POINTS, DIM)


def make_decoder() -> nn.Module:
    torch.manual_seed(0)
    return PointDecoder()


def uniform(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape[:-2] + (n,), 1.0 / n, dtype=like.dtype, device=like.device)


def sinkhorn_loss(x, y, eps: float = 0.1, iters: int = 30):
    """Entropic OT cost between clouds ``x`` (B, N, D) and ``y`` (B, M, D), Sinkhorn-Knopp
    scaling in the plain domain; the plan's cost ``<P, C>`` averaged over the batch."""
    C = torch.cdist(x, y) ** 2
    K = torch.exp(-C / eps)  # underflows to 0 where C / eps > ~103 (float32)
    a, b = uniform(x.shape[1], C), uniform(y.shape[1], C.transpose(1, 2))
    v = torch.ones_like(b)
    for _ in range(iters):
        u = a / (K @ v.unsqueeze(-1)).squeeze(-1)
        v = b / (K.transpose(1, 2) @ u.unsqueeze(-1)).squeeze(-1)
    P = u.unsqueeze(-1) * K * v.unsqueeze(-2)
    return (P * C).sum((1, 2)).mean()


def log_sinkhorn_loss(x, y, allowed=None, eps: float = 0.1, iters: int = 30):
    """Sinkhorn in the log domain (dual potentials ``f``, ``g``, logsumexp updates), with
    forbidden pairs (``allowed`` False) given an infinite cost, as OT label assignment and
    masked matching write them."""
    C = torch.cdist(x, y) ** 2
    if allowed is not None:
        C = C.masked_fill(~allowed, float("inf"))
    log_a = uniform(x.shape[1], C).log()
    log_b = uniform(y.shape[1], C.transpose(1, 2)).log()
    f, g = torch.zeros_like(log_a), torch.zeros_like(log_b)
    for _ in range(iters):
        f = eps * log_a - eps * torch.logsumexp((g.unsqueeze(-2) - C) / eps, dim=-1)
        g = eps * log_b - eps * torch.logsumexp((f.unsqueeze(-1) - C) / eps, dim=-2)
    P = torch.exp((f.unsqueeze(-1) + g.unsqueeze(-2) - C) / eps)
    return (P * C.masked_fill(C.isinf(), 0)).sum((1, 2)).mean()


def point_batch(g: torch.Generator, batch: int = 4, far: int | None = None,
                scale: float = 30.0):
    """Latent codes and target clouds; ``far``: that row's target cloud recorded in other
    units (centimetres instead of metres), so its squared costs are ``scale**2`` larger."""
    z = torch.randn(batch, 8, generator=g)
    y = torch.randn(batch, POINTS, DIM, generator=g) * 0.5
    if far is not None:
        y[far] = y[far] * scale + scale
    return z, y
