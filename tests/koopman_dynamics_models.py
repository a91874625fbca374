"""Koopman operator learning written as practitioners write it, for ``test_koopman_dynamics``.

- ``DeepKoopman``: Lusch, Kutz & Brunton's autoencoder: an MLP encoder to observables, a
  linear operator ``K`` (a bias-free ``nn.Linear``), a decoder; reconstruction, multi-step
  prediction with ``torch.linalg.matrix_power(K, k)`` over the horizon and a linearity loss.
  ``make_deep_koopman_gain``: ``K`` initialised orthogonal with the gain a recipe wrote for
  another layer (1.5: spectral radius 1.5, and 1.5^k overflows at the horizon's end).
- ``SpectralKoopman``: the same, plus a spectral-radius regulariser on the eigenvalues of
  ``K`` from ``torch.linalg.eig``; ``make_spectral_eye``: ``K`` initialised to the identity
  (the "start from the identity map" recipe), whose repeated eigenvalues put eig's backward
  at its pole.
- ``ContinuousKoopman``: a continuous-time generator ``L``; ``K(dt) = matrix_exp(L dt)`` per
  record, with each record's own time step from the dataset.
- ``LatentDMD``: Takeishi et al.'s learned observables with DMD in the latent space: the
  snapshot matrix's SVD, rank-r truncation, the operator ``U* Y V S^-1`` (the pseudo-inverse
  divides by the singular values); its encoder is bias-free, so a pendulum at rest (the
  equilibrium at the origin) lifts to a snapshot matrix of zeros.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

# ---------------------------------------------------------------------------------------------
# simulators and the dataset


def pendulum_rk4(theta0: float, omega0: float, steps: int, dt: float) -> torch.Tensor:
    """(steps, 2) states of the damped pendulum theta'' = -sin(theta) - 0.1 theta'."""
    def f(s):
        return torch.stack([s[1], -torch.sin(s[0]) - 0.1 * s[1]])
    s, out = torch.tensor([theta0, omega0]), []
    for _ in range(steps):
        out.append(s)
        k1 = f(s)
        k2 = f(s + dt / 2 * k1)
        k3 = f(s + dt / 2 * k2)
        k4 = f(s + dt * k3)
        s = s + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return torch.stack(out)


class PendulumTrajectories(Dataset):
    """Trajectories of random initial angles; ``rest``: indices released at rest at the bottom
    (theta = omega = 0, a fixed point: every snapshot the same); ``dt_ms``: indices whose time
    step was logged in milliseconds (a sensor export), not seconds."""

    def __init__(self, n: int = 16, steps: int = 12, dt: float = 0.1, seed: int = 0,
                 rest: tuple[int, ...] = (), dt_ms: tuple[int, ...] = ()):
        g = torch.Generator().manual_seed(seed)
        init = (torch.rand(n, 2, generator=g) - 0.5) * torch.tensor([2.0, 1.0])
        self.traj = []
        for i in range(n):
            th, om = (0.0, 0.0) if i in rest else (float(init[i, 0]), float(init[i, 1]))
            self.traj.append(pendulum_rk4(th, om, steps, dt))
        self.dt = torch.tensor([dt * (1000.0 if i in dt_ms else 1.0) for i in range(n)])

    def __len__(self):
        return len(self.traj)

    def __getitem__(self, i):
        return self.traj[i], self.dt[i]


def lorenz_euler(s0: torch.Tensor, steps: int, dt: float, sigma: float = 10.0,
                 rho: float = 28.0, beta: float = 8 / 3) -> torch.Tensor:
    """(steps, 3) states of the Lorenz system by forward Euler (stable only for a small dt)."""
    s, out = s0.clone(), []
    for _ in range(steps):
        out.append(s)
        x, y, z = s
        s = s + dt * torch.stack([sigma * (y - x), x * (rho - z) - y, x * y - beta * z])
    return torch.stack(out)


class LorenzTrajectories(Dataset):
    """Lorenz trajectories scaled by 1/10 (the attractor's size); ``coarse``: indices
    simulated with a step of 0.5 (a config's coarse step for another system), where Euler
    is unstable and the states overflow to inf, then NaN."""

    def __init__(self, n: int = 32, steps: int = 12, dt: float = 0.01, seed: int = 0,
                 coarse: tuple[int, ...] = ()):
        g = torch.Generator().manual_seed(seed)
        init = torch.randn(n, 3, generator=g) * 5
        self.traj = [lorenz_euler(init[i], steps, 0.5 if i in coarse else dt) / 10
                     for i in range(n)]
        self.dt = torch.full((n,), dt)

    def __len__(self):
        return len(self.traj)

    def __getitem__(self, i):
        return self.traj[i], self.dt[i]


# ---------------------------------------------------------------------------------------------
# deep Koopman autoencoder


def mlp(i: int, h: int, o: int, bias: bool = True) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, h, bias=bias), nn.ELU(), nn.Linear(h, h, bias=bias),
                         nn.ELU(), nn.Linear(h, o, bias=bias))


class DeepKoopman(nn.Module):
    """x (B, T, n) -> reconstructions (B, T, n), predictions (B, T-1, n), the encoded and
    advanced observables for the linearity loss."""

    def __init__(self, n: int = 2, latent: int = 6, hidden: int = 32, gain: float = 1.0):
        super().__init__()
        self.encoder, self.decoder = mlp(n, hidden, latent), mlp(latent, hidden, n)
        self.K = nn.Linear(latent, latent, bias=False)
        nn.init.orthogonal_(self.K.weight, gain=gain)

    def forward(self, x):
        z = self.encoder(x)
        recon = self.decoder(z)
        horizon = x.shape[1] - 1
        # K^k z0 for k = 1..horizon, as the multi-step prediction loss writes it
        powers = torch.stack([torch.linalg.matrix_power(self.K.weight, k)
                              for k in range(1, horizon + 1)])
        z_adv = torch.einsum("kij,bj->bki", powers, z[:, 0])
        pred = self.decoder(z_adv)
        return recon, pred, z[:, 1:], z_adv


def koopman_loss(recon, pred, z_next, z_adv, x, w_pred: float = 1.0, w_lin: float = 0.1):
    rec = (recon - x).pow(2).mean()
    prd = (pred - x[:, 1:]).pow(2).mean()
    lin = (z_adv - z_next).pow(2).mean()
    return rec + w_pred * prd + w_lin * lin


def make_deep_koopman() -> DeepKoopman:
    torch.manual_seed(0)
    return DeepKoopman()


def make_deep_koopman_lorenz() -> DeepKoopman:
    torch.manual_seed(0)
    return DeepKoopman(n=3)


def make_deep_koopman_gain() -> DeepKoopman:
    torch.manual_seed(0)
    return DeepKoopman(gain=1.5)  # the bug: a recipe's gain for ReLU layers, not for K


# ---------------------------------------------------------------------------------------------
# spectral-radius regulariser through eig


class SpectralKoopman(DeepKoopman):
    def __init__(self, eye: bool = False, **kw):
        super().__init__(**kw)
        if eye:
            with torch.no_grad():
                self.K.weight.copy_(torch.eye(self.K.weight.shape[0]))  # start from identity

    def forward(self, x):
        recon, pred, z_next, z_adv = super().forward(x)
        lam, V = torch.linalg.eig(self.K.weight)  # complex; columns of V have unit norm
        # Koopman eigenfunctions phi = V^-1 z: each should advance by its eigenvalue
        z = torch.cat([z_adv[:, :1] * 0 + self.encoder(x[:, :1]), z_next], 1)
        phi = torch.linalg.solve(V, z.to(V.dtype).transpose(1, 2))  # (B, d, T)
        eig_res = (phi[..., 1:] - lam[:, None] * phi[..., :-1]).abs().pow(2).mean()
        return recon, pred, z_next, z_adv, lam.abs(), eig_res


def spectral_loss(recon, pred, z_next, z_adv, radius, eig_res, x, w_spec: float = 0.1):
    # pull the eigenvalues onto the unit circle, and the eigenfunctions to advance by them
    return (koopman_loss(recon, pred, z_next, z_adv, x) + w_spec * (radius - 1).pow(2).mean()
            + w_spec * eig_res)


def make_spectral() -> SpectralKoopman:
    torch.manual_seed(0)
    return SpectralKoopman()


def make_spectral_eye() -> SpectralKoopman:
    torch.manual_seed(0)
    return SpectralKoopman(eye=True)  # the bug: every eigenvalue is 1, eig's backward divides by 0


# ---------------------------------------------------------------------------------------------
# continuous-time generator


class ContinuousKoopman(nn.Module):
    """z_{t+1} = exp(L dt) z_t with each record's own dt: x (B, T, n), dt (B,)."""

    def __init__(self, n: int = 2, latent: int = 6, hidden: int = 32):
        super().__init__()
        self.encoder, self.decoder = mlp(n, hidden, latent), mlp(latent, hidden, n)
        self.L = nn.Parameter(0.1 * torch.randn(latent, latent))

    def forward(self, x, dt):
        z = self.encoder(x)
        K = torch.linalg.matrix_exp(self.L[None] * dt[:, None, None])  # (B, d, d)
        z_adv, preds = z[:, 0], []
        for _ in range(x.shape[1] - 1):
            z_adv = torch.einsum("bij,bj->bi", K, z_adv)
            preds.append(z_adv)
        z_adv = torch.stack(preds, 1)
        return self.decoder(z), self.decoder(z_adv), z[:, 1:], z_adv


def make_continuous() -> ContinuousKoopman:
    torch.manual_seed(0)
    return ContinuousKoopman()


# ---------------------------------------------------------------------------------------------
# DMD in a learned latent space


class LatentDMD(nn.Module):
    """Per record: observables Z = enc(x) (T, d); X = Z[:-1]^T, Y = Z[1:]^T; the rank-r exact
    DMD operator A = U_r^* Y V_r S_r^-1, then a one-step prediction with it."""

    def __init__(self, n: int = 2, latent: int = 6, hidden: int = 32, rank: int = 3):
        super().__init__()
        # bias-free: the equilibrium at the origin lifts to the latent origin, K's fixed point
        self.encoder, self.decoder = mlp(n, hidden, latent, bias=False), mlp(latent, hidden, n)
        self.rank = rank

    def forward(self, x):
        z = self.encoder(x)
        X, Y = z[:, :-1].transpose(1, 2), z[:, 1:].transpose(1, 2)  # (B, d, T-1)
        U, S, Vh = torch.linalg.svd(X, full_matrices=False)
        r = self.rank
        Ur, Sr, Vr = U[..., :r], S[..., :r], Vh[..., :r, :].transpose(1, 2)
        A = Ur.transpose(1, 2) @ Y @ Vr / Sr[:, None, :]  # the pseudo-inverse: 1 / S
        coef = Ur.transpose(1, 2) @ X  # (B, r, T-1)
        pred = Ur @ (A @ coef)  # (B, d, T-1)
        return self.decoder(pred.transpose(1, 2)), self.decoder(z)


def dmd_loss(pred, recon, x):
    return (pred - x[:, 1:]).pow(2).mean() + (recon - x).pow(2).mean()


def make_latent_dmd() -> LatentDMD:
    torch.manual_seed(0)
    return LatentDMD()
