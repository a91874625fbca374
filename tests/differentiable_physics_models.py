"""Differentiable physics and control, written as the well-known repositories write it, for
``test_differentiable_physics``. Every model is trained through an unrolled rollout.

- ``NBody``: system identification of an n-body system by the gradient of a trajectory loss
  through its leapfrog (kick-drift-kick) integrator: the accelerations are pmocz/nbody-python's
  ``getAcc`` in torch (pairwise ``dx = x.T - x``, ``inv_r3 = (r² + softening²)^-1.5`` where
  ``r² > 0``), the masses learned as logs. Systems of several sizes are padded to one particle
  count, the padded particles parked at the origin with mass 0 (PyG-style ``mask``).
- ``GNSSimulator``: DeepMind's learning_to_simulate / MeshGraphNets normaliser, as its PyTorch
  ports write it (echowve/meshGraphNets_pytorch ``normalization.py``: ``_acc_sum``,
  ``_acc_sum_squared``, ``_acc_count``, ``std = sqrt(E[x²] - E[x]²)`` then
  ``torch.maximum(std, std_epsilon)``), in front of an MLP that predicts accelerations, rolled
  out with semi-implicit Euler.
- ``DeLaN``: Deep Lagrangian Networks (Lutter et al. 2019; milutter/deep_lagrangian_networks):
  the mass matrix ``H(q) = L(q) L(q)ᵀ`` from a lower-triangular network with a positive
  diagonal, the potential's gradient by ``autograd.grad(create_graph=True)`` inside forward,
  and the forward dynamics ``q̈ = H⁻¹ (τ - g(q))`` by ``torch.linalg.solve``.
- ``LQRPolicy``: a differentiable finite-horizon LQR (locuslab/mpc.pytorch's LQR backward
  pass: ``Quu = R + Bᵀ P B``, ``K = -Quu⁻¹ Qux`` by ``torch.linalg.solve``), whose dynamics
  ``A, B`` are learned by imitating an expert's controls (Amos et al. 2018).
- ``KickedRotor``: a learned torque policy trained by backpropagation through a long
  semi-implicit Euler rollout of a kicked pendulum (the Chirikov standard map), the setting of
  Metz et al. 2021, "Gradients are not all you need": the state stays bounded, the gradient
  through time grows exponentially.
- ``BarrierContact``: particles falling onto a floor under IPC's log barrier
  (ipc-sim: ``b(d) = -(d - d̂)² log(d / d̂)`` for ``d < d̂``), integrated with semi-implicit
  Euler; the learned part is a drag network.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# n-body system identification (pmocz/nbody-python's getAcc and leapfrog)

N_BODIES, DT, G_CONST = 6, 0.01, 1.0


class Gravity(nn.Module):
    """Accelerations of every particle from every other (pmocz ``getAcc``). ``softening`` is
    the Plummer softening length; ``where_mask`` ports nbody-python's
    ``inv_r3[inv_r3 > 0] **= -1.5`` as a ``torch.where`` (the self-pair's r² = 0 kept out)."""

    def __init__(self, softening: float, where_mask: bool):
        super().__init__()
        self.softening, self.where_mask = softening, where_mask

    def forward(self, pos, mass, mask):  # pos (B, N, 2), mass (B, N), mask (B, N)
        dx = pos[:, None, :, 0] - pos[:, :, None, 0]
        dy = pos[:, None, :, 1] - pos[:, :, None, 1]
        r2 = dx ** 2 + dy ** 2 + self.softening ** 2
        if self.where_mask:
            inv_r3 = torch.where(r2 > 0, r2 ** -1.5, torch.zeros_like(r2))
        else:
            eye = torch.eye(pos.shape[1], dtype=pos.dtype)
            inv_r3 = (r2 + eye) ** -1.5 * (1 - eye)  # the self-pair's r² made 1, then dropped
        m = (mass * mask)[:, None, :]
        ax = G_CONST * (dx * inv_r3 * m).sum(-1)
        ay = G_CONST * (dy * inv_r3 * m).sum(-1)
        return torch.stack([ax, ay], -1) * mask[..., None]


class NBody(nn.Module):
    """Leapfrog rollout of ``steps`` steps; the masses are the learned parameters."""

    def __init__(self, softening: float = 0.1, where_mask: bool = False, steps: int = 10):
        super().__init__()
        self.log_mass = nn.Parameter(torch.zeros(N_BODIES))
        self.gravity = Gravity(softening, where_mask)
        self.steps = steps

    def forward(self, pos, vel, mask):
        mass = self.log_mass.exp().expand(len(pos), -1)
        acc, traj = self.gravity(pos, mass, mask), []
        for _ in range(self.steps):
            vel = vel + acc * DT / 2
            pos = pos + vel * DT
            acc = self.gravity(pos, mass, mask)
            vel = vel + acc * DT / 2
            traj.append(pos)
        return torch.stack(traj, 1)  # (B, T, N, 2)


def make_nbody():
    torch.manual_seed(0)
    return NBody()


def make_nbody_unsoftened_where():
    torch.manual_seed(0)
    return NBody(softening=0.0, where_mask=True)


def make_nbody_unsoftened():
    torch.manual_seed(0)
    return NBody(softening=0.0)


def nbody_batch(g: torch.Generator, sizes: list[int]):
    """Systems of ``sizes[i]`` particles, the rest padding parked at the origin, at rest."""
    b = len(sizes)
    pos = torch.rand(b, N_BODIES, 2, generator=g) * 2 - 1
    vel = (torch.rand(b, N_BODIES, 2, generator=g) - 0.5) * 0.2
    mask = (torch.arange(N_BODIES)[None] < torch.tensor(sizes)[:, None]).float()
    return pos * mask[..., None], vel * mask[..., None], mask


def trajectory_loss(traj, target, mask):
    """MSE over the real particles' positions."""
    w = mask[:, None, :, None]
    return ((traj - target) ** 2 * w).sum() / (w.sum() * traj.shape[1] * 2)


# ---------------------------------------------------------------------------------------------
# GNS / MeshGraphNets: a learned simulator behind a running-statistics normaliser


class Normalizer(nn.Module):
    """MeshGraphNets' online normaliser (echowve/meshGraphNets_pytorch)."""

    def __init__(self, size: int, max_accumulations: int = 10 ** 6, std_epsilon: float = 1e-8):
        super().__init__()
        self._max_accumulations = max_accumulations
        self.register_buffer("_std_epsilon", torch.tensor(std_epsilon))
        self.register_buffer("_acc_count", torch.tensor(0.0))
        self.register_buffer("_num_accumulations", torch.tensor(0.0))
        self.register_buffer("_acc_sum", torch.zeros(1, size))
        self.register_buffer("_acc_sum_squared", torch.zeros(1, size))

    def forward(self, batched_data, accumulate: bool = True):
        if accumulate and self._num_accumulations < self._max_accumulations:
            self._accumulate(batched_data.detach())
        return (batched_data - self._mean()) / self._std_with_epsilon()

    def _accumulate(self, data):
        self._acc_sum += data.sum(0, keepdim=True)
        self._acc_sum_squared += (data ** 2).sum(0, keepdim=True)
        self._acc_count += data.shape[0]
        self._num_accumulations += 1

    def _mean(self):
        return self._acc_sum / torch.clamp_min(self._acc_count, 1.0)

    def _std_with_epsilon(self):
        safe_count = torch.clamp_min(self._acc_count, 1.0)
        std = torch.sqrt(self._acc_sum_squared / safe_count - self._mean() ** 2)
        return torch.maximum(std, self._std_epsilon)


class GNSSimulator(nn.Module):
    """Node features: the last ``C`` velocities and the particle's material parameter (one
    value per scene); the MLP predicts the normalised acceleration."""

    C = 3

    def __init__(self, hidden: int = 32):
        super().__init__()
        width = 2 * self.C + 1
        self.node_normalizer = Normalizer(width)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, history, material):  # history (P, C + 1, 2) positions, material (P,)
        vel = history[:, 1:] - history[:, :-1]
        feats = torch.cat([vel.flatten(1), material[:, None]], 1)
        acc = self.mlp(self.node_normalizer(feats, accumulate=self.training))
        return history[:, -1] + vel[:, -1] + acc  # semi-implicit Euler, dt folded in


def make_gns():
    torch.manual_seed(0)
    return GNSSimulator()


def gns_batch(g: torch.Generator, particles: int = 64, material: float = 0.3):
    """A scene of ``particles`` sand particles under gravity, all of one material."""
    p0 = torch.rand(particles, 2, generator=g)
    v = (torch.rand(particles, 2, generator=g) - 0.5) * 0.01
    pos = [p0]
    for _ in range(GNSSimulator.C + 1):
        v = v + torch.tensor([0.0, -1e-3])
        pos.append(pos[-1] + v)
    traj = torch.stack(pos, 1)
    return traj[:, :-1], torch.full((particles,), material), traj[:, -1]


# ---------------------------------------------------------------------------------------------
# DeLaN: Deep Lagrangian Networks


class DeLaN(nn.Module):
    """``H(q) = L Lᵀ`` with L's diagonal through ``diag_act`` plus ``diag_eps`` (DeLaN uses
    SoftPlus and a positive offset), the potential ``V(q)`` a second head, the generalised
    gravity ``g = ∂V/∂q`` by ``autograd.grad`` inside forward."""

    def __init__(self, dof: int = 2, hidden: int = 32, diag_act=F.softplus, diag_eps=1e-3):
        super().__init__()
        self.dof, self.diag_act, self.diag_eps = dof, diag_act, diag_eps
        self.body = nn.Sequential(nn.Linear(dof, hidden), nn.Softplus(), nn.Linear(hidden, hidden),
                                  nn.Softplus())
        self.ld = nn.Linear(hidden, dof)
        self.lo = nn.Linear(hidden, dof * (dof - 1) // 2)
        self.potential = nn.Linear(hidden, 1)
        self.tril = torch.tril_indices(dof, dof, -1)

    def mass_matrix(self, h):
        b = len(h)
        lower = torch.zeros(b, self.dof, self.dof, dtype=h.dtype)
        lower[:, self.tril[0], self.tril[1]] = self.lo(h)
        lower = lower + torch.diag_embed(self.diag_act(self.ld(h)) + self.diag_eps)
        return lower @ lower.transpose(1, 2)

    def forward(self, q, qd, tau):
        with torch.enable_grad():
            q = q if q.requires_grad else q.detach().requires_grad_(True)
            h = self.body(q)
            g = torch.autograd.grad(self.potential(h).sum(), q, create_graph=True)[0]
        H = self.mass_matrix(h)
        return torch.linalg.solve(H, (tau - g)[..., None])[..., 0]  # q̈


def make_delan():
    torch.manual_seed(0)
    return DeLaN()


def make_delan_relu():
    """The diagonal through ReLU with no offset: a configuration whose pre-activation is
    below 0 has a zero pivot, H is singular there. Its bias starts at 0.3 (the diagonal's
    positive initial offset), so only some configurations are."""
    torch.manual_seed(0)
    model = DeLaN(diag_act=F.relu, diag_eps=0.0)
    with torch.no_grad():
        model.ld.bias.add_(0.3)
    return model


def pendulum2_batch(g: torch.Generator, n: int = 32):
    """A two-link arm's states, torques and accelerations (a unit mass matrix, gravity)."""
    q = (torch.rand(n, 2, generator=g) - 0.5) * 2
    qd = torch.randn(n, 2, generator=g)
    tau = torch.randn(n, 2, generator=g)
    qdd = tau - 9.81 * torch.stack([torch.sin(q[:, 0]), torch.sin(q[:, 1])], 1)
    return q, qd, tau, qdd


# ---------------------------------------------------------------------------------------------
# differentiable LQR (mpc.pytorch's backward Riccati pass), dynamics learned by imitation

NX, NU, HORIZON = 3, 2, 8


class LQRPolicy(nn.Module):
    """``x' = A x + B u``; costs ``xᵀ Q x + uᵀ R u``; returns the controls of the rollout from
    ``x0`` under the time-varying LQR gains. ``R`` is the user's fixed control cost."""

    def __init__(self, r_diag=(1.0, 1.0)):
        super().__init__()
        self.A = nn.Parameter(torch.eye(NX) + 0.1 * torch.randn(NX, NX))
        self.B = nn.Parameter(0.3 * torch.randn(NX, NU))
        self.register_buffer("Q", torch.eye(NX))
        self.register_buffer("R", torch.diag(torch.tensor(r_diag)))

    def gains(self):
        P, gains = self.Q, []
        for _ in range(HORIZON):
            Quu = self.R + self.B.T @ P @ self.B
            Qux = self.B.T @ P @ self.A
            K = -torch.linalg.solve(Quu, Qux)
            P = self.Q + self.A.T @ P @ self.A + Qux.T @ K
            gains.append(K)
        return gains[::-1]

    def forward(self, x0):  # x0 (B, NX) -> controls (B, HORIZON, NU)
        x, us = x0, []
        for K in self.gains():
            u = x @ K.T
            x = x @ self.A.T + u @ self.B.T
            us.append(u)
        return torch.stack(us, 1)


def make_lqr():
    torch.manual_seed(0)
    return LQRPolicy()


# ---------------------------------------------------------------------------------------------
# a long rollout of a chaotic system: the kicked rotor


class TorquePolicy(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, theta, omega):
        return 0.1 * torch.tanh(self.net(torch.stack([torch.sin(theta), omega], -1)))[..., 0]


class KickedRotor(nn.Module):
    """``ω += K sin θ + u``; ``θ += ω`` (semi-implicit Euler with the kick strength ``K``
    folding in ``g/l · dt²``), ``θ`` wrapped to [0, 2π) and ``ω`` to [-π, π): bounded.
    ``linear``: the small-angle kick ``K θ`` (with K = 1, Arnold's cat map on the torus)."""

    def __init__(self, kick: float = 12.0, steps: int = 60, linear: bool = False):
        super().__init__()
        self.policy = TorquePolicy()
        self.kick, self.steps, self.linear = kick, steps, linear

    def forward(self, theta, omega):
        cost = 0.0
        for _ in range(self.steps):
            force = theta if self.linear else torch.sin(theta)
            omega = omega + self.kick * force + self.policy(theta, omega)
            omega = torch.remainder(omega + math.pi, 2 * math.pi) - math.pi
            theta = torch.remainder(theta + omega, 2 * math.pi)
            cost = cost + (1 - torch.cos(theta - math.pi))  # swing up: θ = π is the goal
        return cost / self.steps


def make_rotor():
    torch.manual_seed(0)
    return KickedRotor()


def make_cat_map():
    torch.manual_seed(0)
    return KickedRotor(kick=1.0, steps=100, linear=True)


def make_short_rotor():
    torch.manual_seed(0)
    return KickedRotor(steps=20)


# ---------------------------------------------------------------------------------------------
# IPC barrier contact


class Drag(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, 2))

    def forward(self, vel):
        return 0.1 * self.net(vel)


class BarrierContact(nn.Module):
    """Particles under gravity above a floor at y = 0; IPC's barrier ``b(d)`` within ``d̂``
    of it, its force ``-∂b/∂d`` written out; semi-implicit Euler for ``steps`` steps."""

    def __init__(self, dt: float = 0.01, steps: int = 30, dhat: float = 0.05,
                 stiffness: float = 1e3):
        super().__init__()
        self.drag = Drag()
        self.dt, self.steps, self.dhat, self.kappa = dt, steps, dhat, stiffness

    def barrier_force(self, d):
        """``-∂b/∂d`` of ``b(d) = -(d - d̂)² log(d / d̂)`` inside the barrier, 0 outside."""
        dh = self.dhat
        inside = d < dh
        grad = -2 * (d - dh) * torch.log(d / dh) - (d - dh) ** 2 / d
        return torch.where(inside, -self.kappa * grad, torch.zeros_like(d))

    def forward(self, pos, vel):
        traj = []
        for _ in range(self.steps):
            f = torch.stack([torch.zeros_like(pos[:, 0]), self.barrier_force(pos[:, 1])], 1)
            vel = vel + self.dt * (f + torch.tensor([0.0, -9.81]) - self.drag(vel))
            pos = pos + self.dt * vel
            traj.append(pos)
        return torch.stack(traj, 1)


def make_contact():
    torch.manual_seed(0)
    return BarrierContact()


def contact_batch(g: torch.Generator, n: int = 16, fast_row: int | None = None):
    pos = torch.rand(n, 2, generator=g) * torch.tensor([1.0, 0.3]) + torch.tensor([0.0, 0.1])
    vel = torch.randn(n, 2, generator=g) * 0.1
    if fast_row is not None:
        vel[fast_row] = torch.tensor([0.0, -12.0])  # thrown at the floor: tunnels in one step
    return pos, vel


def make_lqr_weak():
    """A second actuator with no control cost and almost no effect (1e-4 of the first's)."""
    torch.manual_seed(0)
    model = LQRPolicy(r_diag=(1.0, 0.0))
    with torch.no_grad():
        model.B[:, 1] *= 1e-4
    return model
