"""Reservoir computing written by hand, as ReservoirPy, EchoTorch and the NG-RC paper write it,
for ``test_reservoir_computing``.

- ``ESN``: a leaky-integrator echo state network whose recurrent matrix is trainable (BPTT
  over the whole window) and rescaled to a target spectral radius in every forward, from
  ``torch.linalg.eigvals`` (EchoTorch's trainable reservoirs keep the echo state property
  this way); a washout, then a linear readout. ``make_esn_delay_line``: Rodan & Tino's delay
  line reservoir (a sub-diagonal shift matrix, nilpotent: every eigenvalue is 0).
- ``AttentionESN``: the same reservoir read out by attention pooling over time, the washout's
  scores masked with ``-inf``; ``make_attention_esn_long_washout``: a washout as long as the
  window.
- ``RidgeESN``: a fixed random reservoir and a ridge readout solved in closed form per batch
  (``torch.linalg.solve`` of the normal equations over the collected states), the input
  weights trained through it; by Cholesky in ``make_ridge_esn_cholesky``;
  ``make_ridge_esn_wide``: more units than states after washout, and no ridge term.
- ``FORCE``: FORCE learning's RLS readout updated under ``no_grad`` in the forward (the
  buffers ``P`` and ``w_out`` replaced at every call), input weights trained by BPTT;
  ``make_force_forgetting``: a forgetting factor of 0.7.
- ``NGRC``: next-generation reservoir computing (Gauthier et al.): linear features of ``k``
  delayed inputs, their unique quadratic and cubic monomials, a trained readout.
- ``mackey_glass`` and ``LorenzWindows``: the chaotic series, the latter a ``Dataset``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

# ---------------------------------------------------------------------------------------------
# data


def mackey_glass(n: int, tau: int = 17, dt: float = 1.0, x0: float = 1.2) -> torch.Tensor:
    """The Mackey-Glass delay equation by Euler steps, ``(n,)``."""
    hist = [x0] * (tau + 1)
    for _ in range(n + 200):
        x, xt = hist[-1], hist[-1 - tau]
        hist.append(x + dt * (0.2 * xt / (1 + xt ** 10) - 0.1 * x))
    return torch.tensor(hist[-n:], dtype=torch.float32)


def lorenz(n: int, start, dt: float = 0.01) -> torch.Tensor:
    """A Lorenz-63 trajectory by RK4, ``(n, 3)``."""
    def f(s):
        x, y, z = s
        return torch.stack([10 * (y - x), x * (28 - z) - y, x * y - 8 / 3 * z])
    s, out = torch.tensor(start, dtype=torch.float64), []
    for _ in range(n):
        k1 = f(s)
        k2 = f(s + dt / 2 * k1)
        k3 = f(s + dt / 2 * k2)
        k4 = f(s + dt * k3)
        s = s + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        out.append(s)
    return torch.stack(out).float()


class LorenzWindows(Dataset):
    """Windows of one Lorenz trajectory: ``(window, 3)`` inputs, the next state as target.
    ``unmasked`` holds the windows whose last x reading is missing, read from the netCDF file
    without its mask (the variable's fill value in its place; ``fill=nan``: read masked, as
    xarray does)."""

    def __init__(self, n: int = 32, window: int = 4, unmasked: tuple[int, ...] = (),
                 fill: float | None = None):
        traj = lorenz(n * 3 + window + 1, [1.0, 1.0, 1.0])
        self.items = []
        for i in range(n):
            w = traj[i * 3: i * 3 + window + 1].clone()
            if i in unmasked:
                w[-2, 0] = NC_FILL if fill is None else fill
            self.items.append((w[:-1], w[-1]))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


# ---------------------------------------------------------------------------------------------
# echo state network, trainable reservoir


def sparse_uniform(n: int, sparsity: float, g: torch.Generator) -> torch.Tensor:
    w = torch.rand(n, n, generator=g) * 2 - 1
    return w * (torch.rand(n, n, generator=g) >= sparsity)


def delay_line(n: int, weight: float = 0.5) -> torch.Tensor:
    """Rodan & Tino's DLR: unit i feeds unit i + 1 only."""
    return torch.diag(torch.full((n - 1,), weight), -1)


class Reservoir(nn.Module):
    """``h_t = (1 - a) h_{t-1} + a tanh(W_in x_t + W h_{t-1} + b)``, W rescaled to ``rho``."""

    def __init__(self, w: torch.Tensor, n_in: int, rho: float = 0.9, leak: float = 0.3):
        super().__init__()
        self.weight = nn.Parameter(w)
        self.w_in = nn.Linear(n_in, w.shape[0])
        self.rho, self.leak = rho, leak

    def recurrent(self) -> torch.Tensor:
        radius = torch.linalg.eigvals(self.weight).abs().max()
        return self.weight * (self.rho / radius)

    def forward(self, x):  # x: (B, T, n_in)
        w, u = self.recurrent(), self.w_in(x)
        h, states = x.new_zeros(x.shape[0], w.shape[0]), []
        for t in range(x.shape[1]):
            h = (1 - self.leak) * h + self.leak * torch.tanh(u[:, t] + h @ w.T)
            states.append(h)
        return torch.stack(states, 1)


class ESN(nn.Module):
    def __init__(self, w: torch.Tensor, n_in: int = 1, n_out: int = 1, washout: int = 5):
        super().__init__()
        self.reservoir = Reservoir(w, n_in)
        self.readout = nn.Linear(w.shape[0], n_out)
        self.washout = washout

    def forward(self, x):
        return self.readout(self.reservoir(x)[:, self.washout:])


class AttentionESN(nn.Module):
    """A trainable reservoir read out by attention pooling over time, the washout's states
    masked out of the softmax with ``-inf`` (they never reach the output)."""

    def __init__(self, w: torch.Tensor, washout: int = 5):
        super().__init__()
        self.reservoir = Reservoir(w, 1)
        self.query = nn.Linear(w.shape[0], 1)
        self.readout = nn.Linear(w.shape[0], 1)
        self.washout = washout

    def forward(self, x):
        states = self.reservoir(x)
        scores = self.query(states).squeeze(-1)
        washout = torch.arange(x.shape[1]) < self.washout
        scores = scores.masked_fill(washout, float("-inf"))
        pooled = (scores.softmax(-1)[..., None] * states).sum(1)
        return self.readout(pooled)


def make_attention_esn():
    return AttentionESN(sparse_uniform(32, 0.9, torch.Generator().manual_seed(0)))


def make_esn():
    return ESN(sparse_uniform(32, 0.9, torch.Generator().manual_seed(0)))


def make_esn_delay_line():
    return ESN(delay_line(32))


def mackey_glass_batches(steps: int, batch: int = 8, window: int = 20):
    """(x, y) pairs of one-step-ahead prediction windows, ``(B, T, 1)``."""
    s = mackey_glass(steps * batch * 3 + window + 1)
    s = (s - s.mean()) / s.std()
    for k in range(steps):
        starts = torch.arange(batch) * 3 + k * batch * 3
        w = torch.stack([s[i: i + window + 1] for i in starts.tolist()])[..., None]
        yield w[:, :-1], w[:, 1:]


# ---------------------------------------------------------------------------------------------
# fixed reservoir, closed-form ridge readout per batch


class RidgeReadout(nn.Module):
    """``W = (S^T S + beta I)^-1 S^T Y`` over the batch's states after washout, then ``S W``."""

    def __init__(self, beta: float, cholesky: bool = False):
        super().__init__()
        self.beta, self.cholesky = beta, cholesky

    def forward(self, states, targets):  # (B, T, N), (B, T, d)
        s = torch.cat([states, states.new_ones(*states.shape[:2], 1)], -1).flatten(0, 1)
        y = targets.flatten(0, 1)
        gram = s.T @ s + self.beta * torch.eye(s.shape[1])
        if self.cholesky:  # (the normal equations are symmetric positive definite: half the work)
            w = torch.cholesky_solve(s.T @ y, torch.linalg.cholesky(gram))
        else:
            w = torch.linalg.solve(gram, s.T @ y)
        return (s @ w).view_as(targets)


class RidgeESN(nn.Module):
    def __init__(self, rho: float = 0.9, beta: float = 1e-2, n: int = 24, washout: int = 5,
                 cholesky: bool = False, sparsity: float = 0.8):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        w = sparse_uniform(n, sparsity, g)
        self.register_buffer("w", w * (rho / torch.linalg.eigvals(w).abs().max()))
        self.w_in = nn.Linear(1, n)  # the input weights, trained through the solve
        self.readout = RidgeReadout(beta, cholesky)
        self.washout = washout

    def forward(self, x, targets):
        u, h, states = self.w_in(x), x.new_zeros(x.shape[0], self.w.shape[0]), []
        for t in range(x.shape[1]):
            h = torch.tanh(u[:, t] + h @ self.w.T)
            states.append(h)
        return self.readout(torch.stack(states, 1)[:, self.washout:], targets)


def make_ridge_esn():
    return RidgeESN()


def make_ridge_esn_cholesky():
    return RidgeESN(cholesky=True)


def make_ridge_esn_empty():
    """A connectivity of 0 typed as a sparsity of 1.0: no connection is kept."""
    return RidgeESN(sparsity=1.0)


def make_ridge_esn_wide():
    """More units than the batch has states after washout, and no ridge term."""
    return RidgeESN(beta=0.0, n=160, cholesky=True)


# ---------------------------------------------------------------------------------------------
# next-generation reservoir computing


class PolyFeatures(nn.Module):
    """A constant, the last ``k`` inputs, and their unique quadratic and cubic monomials."""

    def __init__(self, dim: int, k: int = 2):
        super().__init__()
        self.k, n = k, dim * k
        self.register_buffer("quad", torch.combinations(torch.arange(n), 2, True))
        self.register_buffer("cubic", torch.combinations(torch.arange(n), 3, True))

    def forward(self, x):  # (B, T, d)
        lin = x[:, -self.k:].flatten(1)
        quad = lin[:, self.quad[:, 0]] * lin[:, self.quad[:, 1]]
        cubic = lin[:, self.cubic[:, 0]] * lin[:, self.cubic[:, 1]] * lin[:, self.cubic[:, 2]]
        return torch.cat([torch.ones_like(lin[:, :1]), lin, quad, cubic], 1)


class NGRC(nn.Module):
    """Predicts the next state as the last one plus a linear readout of the features."""

    def __init__(self, dim: int = 3, k: int = 2):
        super().__init__()
        self.features = PolyFeatures(dim, k)
        n = dim * k
        n_feat = 1 + n + n * (n + 1) // 2 + n * (n + 1) * (n + 2) // 6
        self.readout = nn.Linear(n_feat, dim)
        nn.init.zeros_(self.readout.weight)

    def forward(self, x):
        return x[:, -1] + self.readout(self.features(x))


def make_ngrc():
    return NGRC()


# netCDF's default fill value for a float variable, read back unmasked
NC_FILL = 9.969209968386869e36


# ---------------------------------------------------------------------------------------------
# FORCE learning: a recursive-least-squares readout in the forward, input weights by BPTT


class FORCE(nn.Module):
    """Sussillo & Abbott's FORCE: a chaotic reservoir (gain ``g`` > 1) whose readout ``w`` is
    fitted online by RLS at every time step, ``k = P r / (lam + r^T P r)``,
    ``P <- (P - k r^T P) / lam``; the forgetting factor ``lam`` < 1 forgets old samples."""

    def __init__(self, n: int = 48, g: float = 1.5, alpha: float = 1.0, lam: float = 1.0):
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        w = torch.randn(n, n, generator=gen)
        self.register_buffer("w", w * (g / torch.linalg.eigvals(w).abs().max()))
        self.w_in = nn.Linear(1, n)
        self.register_buffer("P", torch.eye(n) / alpha)
        self.register_buffer("w_out", torch.zeros(n))
        self.lam = lam

    def forward(self, x, target):  # (1, T, 1) each: one trajectory, a chunk per step
        u, h, outs = self.w_in(x)[0], x.new_zeros(self.w.shape[0]), []
        P, w_out = self.P, self.w_out
        for t in range(x.shape[1]):
            h = torch.tanh(self.w @ h + u[t])
            z = h @ w_out
            outs.append(z)
            with torch.no_grad():  # RLS is not differentiated
                r = h.detach()
                k = P @ r
                den = self.lam + r @ k
                P = (P - torch.outer(k, k) / den) / self.lam
                w_out = w_out - (z.detach() - target[0, t, 0]) * k / den
        self.P, self.w_out = P, w_out
        return torch.stack(outs)[None, :, None]


def make_force():
    return FORCE()


def make_force_forgetting():
    return FORCE(lam=0.7)


def sine_chunks(steps: int, chunk: int = 50):
    """(x, y) chunks of one long trajectory: the input drives, the target is the sine ahead."""
    t = torch.arange(steps * chunk + 1, dtype=torch.float32) * 0.1
    s = torch.sin(t) + 0.5 * torch.sin(0.3 * t)
    for k in range(steps):
        yield s[k * chunk: (k + 1) * chunk, None][None], s[k * chunk + 1: (k + 1) * chunk + 1, None][None]


def make_attention_esn_long_washout():
    """A washout of 20 steps, set for long series, on windows of 20: every state is masked."""
    return AttentionESN(sparse_uniform(32, 0.9, torch.Generator().manual_seed(0)), washout=20)
