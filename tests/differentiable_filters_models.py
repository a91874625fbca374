"""Differentiable filters as torch code writes them for learning dynamics and noise models
(Haarnoja et al.'s backprop KF, Kloss et al.'s differentiable filters, Jonschkowski's
differentiable particle filters, Karkus's soft resampling), for ``test_differentiable_filters``.

- ``KalmanNet``: a Kalman filter unrolled over a sequence, a learned transition ``F`` and a
  learned process noise ``Q = diag(softplus(q))``, a heteroscedastic observation noise
  ``R = diag(softplus(r_net(context)))`` per sample and time step, two sensors measuring the
  same position (``H`` of rank 1, so ``H P H^T`` is singular and ``R`` alone keeps ``S``
  positive-definite), the gain through ``torch.linalg.cholesky`` and ``cholesky_solve``, the
  Joseph-form update, and the Gaussian log-likelihood of the innovations as the loss.
- ``ParticleFilter``: a differentiable particle filter: a learned motion model with noise,
  an observation likelihood written as ``log(exp(-d^2 / 2 sigma^2))`` by a learned network,
  log-weights normalised with ``logsumexp``, Karkus's soft resampling (mixing with a uniform
  distribution, importance weights ``w / (a w + (1 - a) / N)``), the mean's MSE as the loss.
  ``make_particle_gated``: validation gating, a log-likelihood of -inf past a distance.
- ``RangeEKF``: an EKF with a range sensor, its Jacobian ``x / |x|`` written by hand.
- ``with_gaps``: tracks with readings missing from the log, as NaN beside a ``seen`` mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# Kalman filter with a learned heteroscedastic R

DT = 0.1
H_ROWS = [[1.0, 0.0], [1.0, 0.0]]  # two position sensors: H P H^T has rank 1


class KalmanNet(nn.Module):
    """The filtered means of a constant-velocity state (pos, vel) observed by two sensors."""

    def __init__(self, joseph: bool = True):
        super().__init__()
        self.F = nn.Parameter(torch.tensor([[1.0, DT], [0.0, 1.0]]))
        self.q = nn.Parameter(torch.full((2,), -3.0))
        self.r_net = nn.Linear(1, 2)  # log-linear in the signal strength
        with torch.no_grad():  # a stronger signal, less noise
            self.r_net.weight.fill_(-2.0)
            self.r_net.bias.fill_(0.5)
        self.register_buffer("H", torch.tensor(H_ROWS))
        self.joseph = joseph

    def forward(self, y, ctx, seen=None):
        """y: (B, T, 2) the two sensors' readings; ctx: (B, T, 1) each reading's signal
        strength (W), which sets R; seen: (B, T) bool, False where a reading is missing (then
        the prediction is kept). Returns the means and the innovations' NLL."""
        B, T, _ = y.shape
        x = y.new_zeros(B, 2)
        P = torch.eye(2).expand(B, 2, 2).clone()
        Q = torch.diag_embed(F.softplus(self.q))
        eye = torch.eye(2)
        nll, means = y.new_zeros(B), []
        for t in range(T):
            x = x @ self.F.T
            P = self.F @ P @ self.F.T + Q
            R = torch.diag_embed(F.softplus(self.r_net(ctx[:, t])))
            S = self.H @ P @ self.H.T + R
            L = torch.linalg.cholesky(S)
            PHt = P @ self.H.T
            K = torch.cholesky_solve(PHt.mT, L).mT  # K = P H^T S^-1
            v = y[:, t] - x @ self.H.T
            x_upd = x + (K @ v[..., None])[..., 0]
            IKH = eye - K @ self.H
            if self.joseph:
                P_upd = IKH @ P @ IKH.mT + K @ R @ K.mT
            else:
                P_upd = IKH @ P
            Sv = torch.cholesky_solve(v[..., None], L)[..., 0]
            logdet = 2 * torch.diagonal(L, dim1=-2, dim2=-1).log().sum(-1)
            step_nll = 0.5 * (logdet + (v * Sv).sum(-1) + 2 * math.log(2 * math.pi))
            if seen is None:
                x, P, nll = x_upd, P_upd, nll + step_nll
            else:  # a missing reading: keep the prediction, no likelihood term
                m = seen[:, t]
                x = torch.where(m[:, None], x_upd, x)
                P = torch.where(m[:, None, None], P_upd, P)
                nll = nll + torch.where(m, step_nll, torch.zeros_like(step_nll))
            means.append(x)
        return torch.stack(means, 1), nll


def make_kalman():
    torch.manual_seed(0)
    return KalmanNet()


def with_gaps(g: torch.Generator, bad: int | None, filled: bool, B: int = 8, T: int = 12):
    """Tracks with 20% of the readings missing, as a logger stores them: NaN, with a mask.
    ``filled``: the loader replaces the gaps by 0 (the mask alone says they are missing)."""
    y, ctx, truth = tracks(g, None, B, T)
    seen = torch.rand(B, T, generator=g) > 0.2
    seen[:, 0] = True
    if bad is not None:
        seen[bad, 4] = False
    y = y.masked_fill(~seen[..., None], 0.0 if filled else float("nan"))
    return y, ctx, seen, truth


def kalman_loss(means, nll, truth):
    """The filtered positions' MSE against the true track plus the innovations' NLL."""
    return F.mse_loss(means[..., 0], truth) + 1e-2 * nll.mean()


def tracks(g: torch.Generator, bad: int | None, B: int = 8, T: int = 12):
    """A batch of constant-velocity tracks read by two noisy sensors. ``bad``: one record whose
    signal strength is logged in mW (x1000): ``r_net`` is then -2000 and its softplus 0."""
    v = torch.randn(B, 1, generator=g)
    t = torch.arange(T, dtype=torch.float32) * DT
    truth = v * t + 0.1 * torch.randn(B, 1, generator=g)
    y = truth[..., None] + 0.1 * torch.randn(B, T, 2, generator=g)
    ctx = torch.rand(B, T, 1, generator=g)
    if bad is not None:
        ctx[bad] *= 1000.0
    return y, ctx, truth


# ---------------------------------------------------------------------------------------------
# Differentiable particle filter with soft resampling

N_PARTICLES = 32


def systematic(q):
    """Systematic resampling's indices: one uniform offset per sample, N evenly spaced points
    on the weights' CDF."""
    u = (torch.rand(q.shape[0], 1) + torch.arange(q.shape[1])) / q.shape[1]
    return torch.searchsorted(q.cumsum(1), u).clamp(max=q.shape[1] - 1)


class ParticleFilter(nn.Module):
    """The weighted particle mean of a 2-D position after each observation."""

    def __init__(self, alpha: float = 0.5, stable: bool = False, gate: float | None = None):
        super().__init__()
        self.motion = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
        self.obs = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
        self.log_sigma = nn.Parameter(torch.tensor(-1.0))
        self.alpha, self.stable, self.gate = alpha, stable, gate

    def log_likelihood(self, particles, z):
        d2 = (self.obs(particles) - z[:, None]).pow(2).sum(-1)
        sigma2 = self.log_sigma.exp() ** 2
        if self.gate is not None:  # validation gating: a particle this far off is impossible
            return (-0.5 * d2 / sigma2).masked_fill(d2 > self.gate, float("-inf"))
        if self.stable:
            return -0.5 * d2 / sigma2
        return torch.log(torch.exp(-0.5 * d2 / sigma2))  # the bug: exp underflows to 0

    def forward(self, z):
        """z: (B, T, 2) observations. Returns the (B, T, 2) particle means."""
        B, T, _ = z.shape
        particles = torch.randn(B, N_PARTICLES, 2)
        logw = torch.full((B, N_PARTICLES), -math.log(N_PARTICLES))
        means = []
        for t in range(T):
            particles = particles + self.motion(particles) + 0.1 * torch.randn_like(particles)
            logw = logw + self.log_likelihood(particles, z[:, t])
            logw = logw - torch.logsumexp(logw, dim=1, keepdim=True)
            w = logw.exp()
            means.append((w[..., None] * particles).sum(1))
            # Karkus et al.'s soft resampling: sample from a w + (1 - a) / N
            q = self.alpha * w + (1 - self.alpha) / N_PARTICLES
            idx = systematic(q.detach())
            particles = particles.gather(1, idx[..., None].expand(-1, -1, 2))
            # (the importance weights w / q in log space: an underflowed w stays finite there)
            logw = logw.gather(1, idx) - q.gather(1, idx).log()
            logw = logw - torch.logsumexp(logw, dim=1, keepdim=True)
        return torch.stack(means, 1)


def make_particle():
    torch.manual_seed(0)
    return ParticleFilter()


def make_particle_stable():
    torch.manual_seed(0)
    return ParticleFilter(stable=True)


def make_particle_gated():
    torch.manual_seed(0)
    return ParticleFilter(gate=100.0)


def walks(g: torch.Generator, bad: int | None, B: int = 8, T: int = 6):
    """2-D random walks and their noisy observations; ``bad``: one record whose observation at
    step 3 is an outlier (a sensor glitch reading 50 units off)."""
    truth = torch.cumsum(0.1 * torch.randn(B, T, 2, generator=g), 1)
    z = truth + 0.05 * torch.randn(B, T, 2, generator=g)
    if bad is not None:
        z[bad, 3] += 50.0
    return z, truth


# ---------------------------------------------------------------------------------------------
# Extended Kalman filter with a range sensor


class RangeEKF(nn.Module):
    """An EKF over a 2-D position under a learned drift, read by a range sensor at the origin:
    ``h(x) = |x|``, whose Jacobian ``x / |x|`` the filter writes by hand."""

    def __init__(self):
        super().__init__()
        self.drift = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
        self.log_q = nn.Parameter(torch.tensor(-4.0))
        self.log_r = nn.Parameter(torch.tensor(-2.0))

    def forward(self, x0, ranges):
        """x0: (B, 2) each track's initial fix; ranges: (B, T). Returns the (B, T, 2) means."""
        B, T = ranges.shape
        x, P = x0, 0.1 * torch.eye(2).expand(B, 2, 2)
        eye, means = torch.eye(2), []
        for t in range(T):  # update with the range at t, then predict t + 1
            r = x.norm(dim=-1, keepdim=True)
            H = (x / r)[:, None, :]  # the bug: a fix at the sensor itself, 0/0
            S = H @ P @ H.mT + self.log_r.exp()
            K = P @ H.mT / S
            x = x + (K * (ranges[:, t, None] - r)[:, None])[..., 0]
            P = (eye - K @ H) @ P
            means.append(x)
            x = x + 0.1 * self.drift(x)
            P = P + self.log_q.exp() * eye
        return torch.stack(means, 1)


def make_ekf():
    torch.manual_seed(0)
    return RangeEKF()


def ranged(g: torch.Generator, bad: int | None, B: int = 8, T: int = 8):
    """Tracks moving away from a range sensor; ``bad``: one whose initial fix was taken at the
    sensor's own position (0, 0)."""
    x0 = torch.rand(B, 2, generator=g) + 0.5
    vel = 0.1 * torch.randn(B, 1, 2, generator=g)
    truth = x0[:, None] + vel * torch.arange(1, T + 1, dtype=torch.float32)[:, None]
    ranges = truth.norm(dim=-1) + 0.01 * torch.randn(B, T, generator=g)
    if bad is not None:
        x0[bad] = 0.0
    return x0, ranges, truth
