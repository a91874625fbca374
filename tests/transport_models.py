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


def sinkhorn_loss(x, y, valid=None, eps: float = 0.1, iters: int = 30):
    """Entropic OT cost between clouds ``x`` (B, N, D) and ``y`` (B, M, D), Sinkhorn-Knopp
    scaling in the plain domain; the plan's cost ``<P, C>`` averaged over the batch.
    ``valid`` (B, N): the predicted points that count, the others' kernel rows and weights
    zeroed (a padded set)."""
    C = torch.cdist(x, y) ** 2
    K = torch.exp(-C / eps)  # underflows to 0 where C / eps > ~103 (float32)
    a, b = uniform(x.shape[1], C), uniform(y.shape[1], C.transpose(1, 2))
    if valid is not None:
        K = K * valid.unsqueeze(-1)
        a = valid / valid.sum(-1, keepdim=True)
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


def hand_distances(x, y):
    """Euclidean distances written out, as a cost for OT with p = 1 (GeomLoss ships its own
    ``Sqrt0`` for this; a hand-written loss takes ``.sqrt()``)."""
    return (x.unsqueeze(-2) - y.unsqueeze(-3)).pow(2).sum(-1).sqrt()


def log_ot(C, eps: float, iters: int):
    """Entropic OT cost <P, C> by log-domain Sinkhorn with uniform marginals."""
    log_a = uniform(C.shape[-2], C).log()
    log_b = uniform(C.shape[-1], C.transpose(-2, -1)).log()
    f, g = torch.zeros_like(log_a), torch.zeros_like(log_b)
    for _ in range(iters):
        f = eps * log_a - eps * torch.logsumexp((g.unsqueeze(-2) - C) / eps, dim=-1)
        g = eps * log_b - eps * torch.logsumexp((f.unsqueeze(-1) - C) / eps, dim=-2)
    return (torch.exp((f.unsqueeze(-1) + g.unsqueeze(-2) - C) / eps) * C).sum((-2, -1))


def sinkhorn_divergence(x, y, eps: float = 0.1, iters: int = 20):
    """Debiased Sinkhorn divergence S(x, y) = OT(x, y) - (OT(x, x) + OT(y, y)) / 2 with the
    distance as cost (p = 1): the self terms' costs have a zero diagonal."""
    xy = log_ot(hand_distances(x, y), eps, iters)
    xx = log_ot(hand_distances(x, x), eps, iters)
    yy = log_ot(hand_distances(y, y), eps, iters)
    return (xy - 0.5 * (xx + yy)).mean()


class SoftDTW(nn.Module):
    """Soft-DTW (Cuturi & Blondel) between predicted and target series, the ``R`` recursion
    with ``+inf`` borders and the max-shifted softmin of pytorch-softdtw's CPU kernel;
    ``stable=False`` is the textbook ``-gamma * log(sum(exp(-r / gamma)))``."""

    def __init__(self, gamma: float = 1.0, stable: bool = True):
        super().__init__()
        self.gamma, self.stable = gamma, stable

    def softmin(self, r0, r1, r2):
        r = torch.stack([r0, r1, r2], -1) / -self.gamma
        if self.stable:
            return -self.gamma * torch.logsumexp(r, -1)
        return -self.gamma * torch.log(r.exp().sum(-1))

    def forward(self, x, y):
        D = (x.unsqueeze(2) - y.unsqueeze(1)).pow(2).sum(-1)  # (B, N, M) squared distances
        B, N, M = D.shape
        inf = torch.full((B,), float("inf"))
        R = [[inf] * (M + 1) for _ in range(N + 1)]
        R[0][0] = torch.zeros(B)
        for i in range(1, N + 1):
            for j in range(1, M + 1):
                R[i][j] = D[:, i - 1, j - 1] + self.softmin(R[i - 1][j - 1], R[i - 1][j],
                                                            R[i][j - 1])
        return R[N][M].mean()


class Forecaster(nn.Module):
    """A GRU encoder and a linear head emitting the next ``HORIZON`` steps of a series."""

    def __init__(self, horizon: int = 8):
        super().__init__()
        self.horizon = horizon
        self.gru = nn.GRU(1, 16, batch_first=True)
        self.head = nn.Linear(16, horizon)

    def forward(self, past):
        _, h = self.gru(past)
        return self.head(h[-1]).unsqueeze(-1)  # (B, HORIZON, 1)


def make_forecaster() -> nn.Module:
    torch.manual_seed(0)
    return Forecaster()


def series_batch(g: torch.Generator, batch: int = 4, spike: int | None = None,
                 height: float = 40.0):
    """Sine waves with random phase: the past 12 steps and the next 8; ``spike``: that row's
    future holds a sensor spike of ``height``."""
    t = torch.arange(20.0)
    phase = torch.rand(batch, 1, generator=g) * 6.28
    s = torch.sin(0.5 * t + phase) + 0.1 * torch.randn(batch, 20, generator=g)
    if spike is not None:
        s[spike, 15] = height
    return s[:, :12, None], s[:, 12:, None]


def unbalanced_ot(x, y, a, b, eps: float = 0.1, rho: float = 1.0, iters: int = 30):
    """Unbalanced entropic OT (Chizat et al.'s scaling, log domain) between weighted clouds,
    the marginals' KL penalties rho * KL(P 1 | a) computed in the primal as
    sum(p * log(p / a) - p + a); padded points carry weight 0."""
    C = torch.cdist(x, y) ** 2
    log_a, log_b = a.log(), b.log()
    lam = rho / (rho + eps)
    f, g = torch.zeros_like(a), torch.zeros_like(b)
    for _ in range(iters):
        f = -lam * eps * torch.logsumexp((g + eps * log_b).unsqueeze(-2) / eps - C / eps, -1)
        g = -lam * eps * torch.logsumexp((f + eps * log_a).unsqueeze(-1) / eps - C / eps, -2)
    P = torch.exp(log_a.unsqueeze(-1) + log_b.unsqueeze(-2)
                  + (f.unsqueeze(-1) + g.unsqueeze(-2) - C) / eps)
    p1, p2 = P.sum(-1), P.sum(-2)

    def kl(p, q):
        return (p * (p / q).log() - p + q).sum(-1)

    return ((P * C).sum((-2, -1)) + rho * (kl(p1, a) + kl(p2, b))).mean()


def weighted_batch(g: torch.Generator, batch: int = 4, pad_at: int | None = None,
                   valid: int = 12):
    """Latent codes, target clouds and uniform weights over each cloud's points; ``pad_at``:
    that row's predicted cloud keeps only ``valid`` points (the rest padding, weight 0)."""
    z, y = point_batch(g, batch)
    a = torch.full((batch, POINTS), 1.0 / POINTS)
    if pad_at is not None:
        a[pad_at] = torch.arange(POINTS).lt(valid).float() / valid
    return z, y, a, torch.full((batch, POINTS), 1.0 / POINTS)


class _BandedSoftDTW(torch.autograd.Function):
    """Soft-DTW with a Sakoe-Chiba band as pytorch-softdtw-cuda's CPU kernels compute it: the
    forward's R recursion, and the backward's E recursion from R (Cuturi & Blondel, Alg. 2),
    whose cells outside the band keep R's +inf."""

    @staticmethod
    def forward(ctx, D, gamma: float, band: int):
        B, N, M = D.shape
        R = torch.full((B, N + 2, M + 2), float("inf"), dtype=D.dtype)
        R[:, 0, 0] = 0
        for i in range(1, N + 1):
            for j in range(1, M + 1):
                if abs(i - j) > band:
                    continue  # outside the band: R stays +inf
                r = torch.stack([R[:, i - 1, j - 1], R[:, i - 1, j], R[:, i, j - 1]], -1)
                R[:, i, j] = D[:, i - 1, j - 1] - gamma * torch.logsumexp(-r / gamma, -1)
        ctx.save_for_backward(D, R)
        ctx.gamma = gamma
        return R[:, N, M]

    @staticmethod
    def backward(ctx, grad):
        D, R = ctx.saved_tensors
        gamma, (B, N, M) = ctx.gamma, D.shape
        D_ = torch.zeros(B, N + 2, M + 2, dtype=D.dtype)
        D_[:, 1:N + 1, 1:M + 1] = D
        E = torch.zeros(B, N + 2, M + 2, dtype=D.dtype)
        E[:, -1, -1] = 1
        R = R.clone()
        R[:, :, -1] = -float("inf")
        R[:, -1, :] = -float("inf")
        R[:, -1, -1] = R[:, -2, -2]
        for j in range(M, 0, -1):
            for i in range(N, 0, -1):
                # (the kernel's "if isinf(R[i, j]): R[i, j] = -inf" is missing here)
                a = torch.exp((R[:, i + 1, j] - R[:, i, j] - D_[:, i + 1, j]) / gamma)
                b = torch.exp((R[:, i, j + 1] - R[:, i, j] - D_[:, i, j + 1]) / gamma)
                c = torch.exp((R[:, i + 1, j + 1] - R[:, i, j] - D_[:, i + 1, j + 1]) / gamma)
                E[:, i, j] = E[:, i + 1, j] * a + E[:, i, j + 1] * b + E[:, i + 1, j + 1] * c
        return grad[:, None, None] * E[:, 1:N + 1, 1:M + 1], None, None


class BandedSoftDTW(nn.Module):
    def __init__(self, gamma: float = 1.0, band: int = 2):
        super().__init__()
        self.gamma, self.band = gamma, band

    def forward(self, x, y):
        D = (x.unsqueeze(2) - y.unsqueeze(1)).pow(2).sum(-1)
        return _BandedSoftDTW.apply(D, self.gamma, self.band).mean()
