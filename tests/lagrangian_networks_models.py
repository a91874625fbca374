"""Hamiltonian and Lagrangian neural networks, as their papers' code writes them in PyTorch.

- ``HNN``: a scalar ``H(q, p)`` MLP; its vector field ``(dH/dp, -dH/dq)`` is taken with
  ``torch.autograd.grad(create_graph=True)`` inside ``forward``; a port-Hamiltonian variant adds a
  dissipation term (``Friction``: Coulomb friction ``-mu * p / |p|``), trained on state derivatives (``(B, 2d)`` states, a mask of valid rows).
- ``LNN``: a scalar ``L(q, qdot)`` MLP; accelerations solve ``d2L/dqdot2 qddot = dL/dq -
  d2L/dqdqdot qdot`` with ``torch.func`` (``jacrev``, ``hessian``) and ``torch.linalg.solve``, or
  the 1-DOF closed form (a division by ``d2L/dqdot2``).
- ``SeparableHNN``: ``H = p^T M^-1 p / 2 + V(q)``, the mass matrix ``M = L L^T`` from a
  Cholesky factor whose diagonal goes through softplus, ``V`` an MLP plus a learned spring;
  a leapfrog integrator unrolled in ``forward`` (a rollout loss on trajectories), and a
  log-determinant of ``M`` (a volume regulariser).

Data: a mass-spring system and a pendulum, simulated in float64 and stored in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HIDDEN = 32


def mlp(d_in: int, act=nn.Tanh) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, HIDDEN), act(), nn.Linear(HIDDEN, HIDDEN), act(),
                         nn.Linear(HIDDEN, 1))


# ---------------------------------------------------------------- data


def spring_states(n: int = 64, d: int = 1, seed: int = 0, at_rest: tuple = (),
                  nan_row: int | None = None):
    """States ``(q, p)`` of unit masses on unit springs and their derivatives ``(p, -q)``; the
    rows in ``at_rest`` have ``p = 0`` (released from rest); ``nan_row`` is a simulator's
    diverged record."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=g, dtype=torch.float64)
    p = torch.randn(n, d, generator=g, dtype=torch.float64)
    p[list(at_rest)] = 0.0
    x = torch.cat([q, p], 1).float()
    dx = torch.cat([p, -q], 1).float()
    if nan_row is not None:
        x[nan_row, 0] = float("nan")
    return x, dx


def spring_loader(batch_size: int = 16, **kw) -> DataLoader:
    x, dx = spring_states(**kw)
    mask = torch.ones(x.shape[0], dtype=torch.bool)
    return DataLoader(TensorDataset(x, dx, mask), batch_size=batch_size, shuffle=False)


def pendulum_states(n: int = 32, seed: int = 0):
    """``(theta, omega)`` of a unit pendulum and its accelerations ``-sin(theta)``."""
    g = torch.Generator().manual_seed(seed)
    th = (torch.rand(n, 1, generator=g, dtype=torch.float64) - 0.5) * 2.0
    om = torch.randn(n, 1, generator=g, dtype=torch.float64)
    return torch.cat([th, om], 1).float(), (-torch.sin(th)).float()


def double_spring_states(n: int = 32, seed: int = 0):
    """Two coupled masses: ``(q1, q2, qd1, qd2)`` and accelerations of ``q'' = -K q``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 2, generator=g, dtype=torch.float64)
    qd = torch.randn(n, 2, generator=g, dtype=torch.float64)
    k = torch.tensor([[2.0, -1.0], [-1.0, 2.0]], dtype=torch.float64)
    return torch.cat([q, qd], 1).float(), (-q @ k).float()


def spring_trajectories(n: int = 16, steps: int = 20, dt: float = 0.1, seed: int = 0):
    """Exact trajectories of a unit mass-spring from ``(q0, p0)``: ``(B, 2)`` starts and
    ``(B, T, 2)`` states at ``dt, 2 dt, ...``."""
    g = torch.Generator().manual_seed(seed)
    q0 = torch.randn(n, 1, generator=g, dtype=torch.float64)
    p0 = torch.randn(n, 1, generator=g, dtype=torch.float64)
    t = torch.arange(1, steps + 1, dtype=torch.float64) * dt
    q = q0 * torch.cos(t) + p0 * torch.sin(t)
    p = -q0 * torch.sin(t) + p0 * torch.cos(t)
    return torch.cat([q0, p0], 1).float(), torch.stack([q, p], -1).float()


# ---------------------------------------------------------------- dissipation


class Friction(nn.Module):
    """A port-Hamiltonian dissipation force on the momenta: Coulomb friction, its coefficient
    learned."""

    def __init__(self):
        super().__init__()
        self.raw = nn.Parameter(torch.tensor(-2.0))

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        c = F.softplus(self.raw)
        speed = p.norm(dim=-1, keepdim=True)
        return -c * p / speed  # the bug: 0/0 for a mass at rest


# ---------------------------------------------------------------- models


class HNN(nn.Module):
    """``dx/dt = (dH/dp, -dH/dq) + (0, friction)``; ``x`` is ``(B, 2d)``."""

    def __init__(self, d: int = 1, friction: bool = False, act=nn.Tanh):
        super().__init__()
        self.d = d
        self.H = mlp(2 * d, act)
        self.friction = Friction() if friction else None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        with torch.enable_grad():
            x = x if x.requires_grad else x.requires_grad_(True)
            h = self.H(x).sum()
            dh = torch.autograd.grad(h, x, create_graph=True)[0]
        dq, dp = dh[:, self.d:], -dh[:, :self.d]
        if self.friction is not None:
            dp = dp + self.friction(x[:, self.d:])
        out = torch.cat([dq, dp], 1)
        return out if mask is None else out * mask[:, None]


class LNN(nn.Module):
    """Accelerations of a learned Lagrangian ``L(q, qdot)``; ``x`` is ``(B, 2d)``."""

    def __init__(self, d: int = 1, act=nn.Tanh, closed_form: bool = False,
                 velocity_inputs: int | None = None):
        super().__init__()
        self.d, self.closed_form = d, closed_form
        self.keep = d if velocity_inputs is None else velocity_inputs
        self.L = mlp(d + self.keep, act)

    def lagrangian(self, q: torch.Tensor, qd: torch.Tensor) -> torch.Tensor:
        return self.L(torch.cat([q, qd[..., :self.keep]], -1)).squeeze(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, qd = x[:, :self.d], x[:, self.d:]
        if self.closed_form:
            return self.closed_form_accel(q, qd)

        def one(q1, qd1):
            g_q = torch.func.jacrev(self.lagrangian, 0)(q1, qd1)
            m = torch.func.hessian(self.lagrangian, 1)(q1, qd1)
            mix = torch.func.jacrev(torch.func.jacrev(self.lagrangian, 1), 0)(q1, qd1)
            return g_q - mix @ qd1, m
        rhs, mass = torch.func.vmap(one)(q, qd)
        return torch.linalg.solve(mass, rhs)  # d2L/dqdot2 qddot = dL/dq - d2L/dqdqdot qdot

    def closed_form_accel(self, q: torch.Tensor, qd: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            q = q.detach().requires_grad_(True) if not q.requires_grad else q
            qd = qd.detach().requires_grad_(True) if not qd.requires_grad else qd
            lag = self.lagrangian(q, qd).sum()
            l_q, l_qd = torch.autograd.grad(lag, (q, qd), create_graph=True)
            m = torch.autograd.grad(l_qd.sum(), qd, create_graph=True)[0]
            mix = torch.autograd.grad(l_qd.sum(), q, create_graph=True)[0]
        return (l_q - mix * qd) / m  # 1 DOF: qddot = (L_q - L_qdq qdot) / L_qdqd


class SeparableHNN(nn.Module):
    """``H = p^T M^-1 p / 2 + V(q) + k q^2 / 2`` with ``M = L L^T``; leapfrog rollouts."""

    def __init__(self, d: int = 1, dt: float = 0.1, steps: int = 20, softplus: bool = True,
                 with_start: bool = False):
        super().__init__()
        self.d, self.dt, self.steps, self.softplus = d, dt, steps, softplus
        self.with_start = with_start  # (the trajectory returned from its initial state on)
        self.diag = nn.Parameter(torch.full((d,), 0.5413))  # softplus(0.5413) = 1
        self.off = nn.Parameter(torch.zeros(d * (d - 1) // 2))
        self.V = mlp(d)
        self.log_k = nn.Parameter(torch.zeros(()))
        self.mass_head = nn.Linear(d, d)  # a state-dependent mass correction

    def cholesky_factor(self, q: torch.Tensor) -> torch.Tensor:
        raw = self.diag + self.mass_head(q)
        diag = F.softplus(raw) if self.softplus else raw  # the bug: a raw diagonal
        low = torch.diag_embed(diag)
        if self.d > 1:
            i, j = torch.tril_indices(self.d, self.d, -1)
            rows = torch.arange(q.shape[0])[:, None]
            low = low.index_put((rows, i[None], j[None]), self.off.expand(q.shape[0], -1))
        return low

    def log_det_mass(self, q: torch.Tensor) -> torch.Tensor:
        low = self.cholesky_factor(q)
        return 2.0 * torch.log(torch.diagonal(low, dim1=-2, dim2=-1)).sum(-1)

    def grad_v(self, q: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            q = q if q.requires_grad else q.detach().requires_grad_(True)
            v = self.V(q).sum() + 0.5 * self.log_k.exp() * (q * q).sum()
            return torch.autograd.grad(v, q, create_graph=True)[0]

    def velocity(self, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        low = self.cholesky_factor(q)
        return torch.cholesky_solve(p.unsqueeze(-1), low).squeeze(-1)  # M^-1 p

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        q, p = x0[:, :self.d], x0[:, self.d:]
        out = [x0] if self.with_start else []
        for _ in range(self.steps):  # leapfrog (kick, drift, kick)
            p = p - 0.5 * self.dt * self.grad_v(q)
            q = q + self.dt * self.velocity(q, p)
            p = p - 0.5 * self.dt * self.grad_v(q)
            out.append(torch.cat([q, p], -1))
        return torch.stack(out, 1)


class RolloutLoss(nn.Module):
    """The trajectory loss, plus a small log-det(M) volume regulariser of the learned mass."""

    def __init__(self, model: SeparableHNN | None = None, reg: float = 0.0):
        super().__init__()
        self.model, self.reg = model, reg

    def forward(self, pred: torch.Tensor, target: torch.Tensor, x0: torch.Tensor):
        loss = F.mse_loss(pred, target)
        if self.model is not None and self.reg:
            loss = loss + self.reg * self.model.log_det_mass(x0[:, :self.model.d]).pow(2).mean()
        return loss


class EuclideanRolloutLoss(nn.Module):
    """The mean Euclidean distance of the rolled-out states to the true ones (of the whole
    trajectory, its start included)."""

    def forward(self, pred: torch.Tensor, target: torch.Tensor, x0: torch.Tensor):
        target = torch.cat([x0[:, None], target], 1)
        return torch.sqrt(((pred - target) ** 2).sum(-1)).mean()  # the bug: 0 at the start


class MaskedMSE(nn.Module):
    """Mean squared error over the valid rows (a padded batch of trajectories' states)."""

    def forward(self, pred, target, mask):
        err = ((pred - target) ** 2).sum(-1) * mask
        return err.sum() / mask.sum().clamp_min(1)


# ---------------------------------------------------------------- factories


def make_hnn() -> HNN:
    torch.manual_seed(0)
    return HNN()


def make_coulomb_hnn() -> HNN:
    torch.manual_seed(0)
    return HNN(friction=True)


def make_relu_lnn() -> LNN:
    torch.manual_seed(0)
    return LNN(act=nn.ReLU, closed_form=True)


def make_lnn2() -> LNN:
    torch.manual_seed(0)
    return LNN(d=2)


def make_lnn2_one_velocity() -> LNN:
    torch.manual_seed(0)
    return LNN(d=2, velocity_inputs=1)  # the bug: the net sees only the first velocity


def make_shnn() -> SeparableHNN:
    torch.manual_seed(0)
    return SeparableHNN()


def make_shnn_with_start() -> SeparableHNN:
    torch.manual_seed(0)
    return SeparableHNN(with_start=True)


def make_shnn_big_dt() -> SeparableHNN:
    torch.manual_seed(0)
    m = SeparableHNN(dt=0.5, steps=40)  # the bug: dt * omega = 5 > 2, leapfrog is unstable
    with torch.no_grad():
        m.log_k.fill_(math.log(100.0))  # a stiff spring, omega = 10
    return m


def make_shnn_raw_diag() -> SeparableHNN:
    torch.manual_seed(0)
    m = SeparableHNN(softplus=False)
    with torch.no_grad():
        m.diag.fill_(1.0)
        m.mass_head.weight.fill_(1.5)
        m.mass_head.bias.zero_()
    return m


def fit_hnn(model, opt, loss_fn, loader, epochs: int = 1, clip: float = 1.0):
    """The HNN's epoch loop: derivative matching, gradient clipping."""
    for _ in range(epochs):
        for x, dx, mask in loader:
            opt.zero_grad()
            loss = loss_fn(model(x, mask), dx, mask)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()


def fit_states(model, opt, loss_fn, x, y, steps: int = 3):
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def fit_rollout(model, opt, loss_fn, x0, traj, steps: int = 3):
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x0), traj, x0).backward()
        opt.step()


class DeadRatio(nn.Module):
    """A ratio by a relu layer's output sum, every unit dead (no derivative taken): the control
    of the relu-Hessian hint."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 4), nn.ReLU())

    def forward(self, x):
        return x.sum(1, keepdim=True) / self.body(x).sum(1, keepdim=True)


def make_dead_ratio() -> DeadRatio:
    torch.manual_seed(0)
    m = DeadRatio()
    with torch.no_grad():
        m.body[0].weight.zero_()
        m.body[0].bias.fill_(-1.0)
    return m
