"""Differentiable control and trajectory optimisation written as practitioners write it, for
``test_differentiable_control``.

- ``BarrierPolicy``: a point-mass (double integrator) policy trained by backpropagation
  through a rollout, the state limit ``|p| <= p_max`` as the interior-point log barrier
  ``-mu (log(p_max - p) + log(p_max + p))`` in the loss (``barrier_loss``).
- ``RiccatiMPC``: a differentiable LQR/iLQR layer (Amos et al. 2018, mpc.pytorch's backward
  pass) over learned linear dynamics ``A, B``: the pendulum swing-up cost ``1 - cos(theta)``
  expanded at each sample's start, ``Q_uu = R + B^T V_xx B``, ``K = -Q_uu^-1 Q_ux`` by
  ``cholesky`` and ``cholesky_solve``; ``gauss_newton`` clamps the cost's curvature at 0, as
  iLQR implementations do to keep ``Q_uu`` positive-definite.
- ``CartPolePolicy``: a policy trained through a differentiable cart-pole (Barto, Sutton &
  Anderson's equations, gym's ``CartPoleEnv``), semi-implicit Euler with each episode's own
  ``dt`` (domain randomisation of the control period).
- ``PendulumDynamics``: a learned dynamics model trained on padded episodes of transitions
  ``(cos th, sin th, th_dot, u)``; the loss compares angles wrapped by ``atan2``.
"""

from __future__ import annotations

import torch
from torch import nn

# ---------------------------------------------------------------------------------------------
# a point mass with a log barrier on its position

P_MAX, DT_PM, HORIZON = 1.0, 0.1, 12


class BarrierPolicy(nn.Module):
    """pi(x) -> u in [-u_max, u_max]; returns the rolled-out positions and controls."""

    def __init__(self, hidden: int = 32, u_max: float = 2.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, 1))
        self.u_max = u_max

    def forward(self, x0):
        p, v = x0[:, 0], x0[:, 1]
        ps, us = [], []
        for _ in range(HORIZON):
            u = self.u_max * torch.tanh(self.net(torch.stack([p, v], 1)))[:, 0]
            v = v + DT_PM * u
            p = p + DT_PM * v
            ps.append(p)
            us.append(u)
        return torch.stack(ps, 1), torch.stack(us, 1)


def barrier_loss(ps, us, goal, mu: float = 0.01):
    """Tracking cost plus the log barrier of the box |p| <= P_MAX."""
    track = ((ps - goal[:, None]) ** 2).sum(1) + 0.01 * (us ** 2).sum(1)
    barrier = -mu * (torch.log(P_MAX - ps) + torch.log(P_MAX + ps)).sum(1)
    return (track + barrier).mean()


def control_barrier_loss(ps, actions, goal, mu: float = 0.01):
    """Tracking cost plus a barrier on the control limit, -mu log(1 - a^2), of the policy's
    normalised actions a = tanh(z) (an actuator's saturation kept out of reach)."""
    track = ((ps - goal[:, None]) ** 2).sum(1)
    barrier = -mu * torch.log(1 - actions ** 2).sum(1)
    return (track + barrier).mean()


class ReluBarrierPolicy(nn.Module):
    """A ReLU policy (unbounded pre-activations) acting in normalised units, a = tanh(z) in
    (-1, 1), which the point mass scales by u_max; returns positions and those actions."""

    def __init__(self, hidden: int = 32, u_max: float = 2.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, 1))
        self.u_max = u_max

    def forward(self, x0):
        p, v = x0[:, 0], x0[:, 1]
        ps, actions = [], []
        for _ in range(HORIZON):
            a = torch.tanh(self.net(torch.stack([p, v], 1)))[:, 0]
            v = v + DT_PM * self.u_max * a
            p = p + DT_PM * v
            ps.append(p)
            actions.append(a)
        return torch.stack(ps, 1), torch.stack(actions, 1)


def make_relu_barrier() -> ReluBarrierPolicy:
    torch.manual_seed(0)
    return ReluBarrierPolicy()


def make_barrier() -> BarrierPolicy:
    torch.manual_seed(0)
    return BarrierPolicy()


def start_states(g: torch.Generator, n: int = 16, outside: int | None = None,
                 fast: int | None = None):
    """Starts inside the box, at rest-ish; ``outside``: a start sampled past the limit (a
    dataset of start states drawn from a wider range than the constraint); ``fast``: a
    velocity logged in mm/s among m/s."""
    x0 = torch.stack([(torch.rand(n, generator=g) - 0.5) * 1.2,
                      (torch.rand(n, generator=g) - 0.5) * 0.4], 1)
    if outside is not None:
        x0[outside] = torch.tensor([1.3, 0.0])
    if fast is not None:
        x0[fast, 1] = 600.0
    goal = (torch.rand(n, generator=g) - 0.5) * 1.0
    return x0, goal


# ---------------------------------------------------------------------------------------------
# differentiable MPC: a Riccati backward pass over learned linear dynamics

NX, NU, T_MPC = 2, 1, 10


class RiccatiMPC(nn.Module):
    """The LQR controller of the swing-up cost's quadratic expansion at x0, over dynamics
    x' = A x + B u learned by imitating an expert's first controls."""

    def __init__(self, gauss_newton: bool = False, r: float = 0.01, dt: float = 0.1):
        super().__init__()
        # initialised at the upright linearisation (g / l = 10), then learned
        self.A = nn.Parameter(torch.eye(NX) + dt * torch.tensor([[0.0, 1.0], [10.0, 0.0]]))
        self.B = nn.Parameter(torch.tensor([[0.0], [dt]]))
        self.log_qdot = nn.Parameter(torch.tensor(-3.9))
        self.gauss_newton, self.r = gauss_newton, r

    def cost_hessian(self, x0):
        """l_xx of (1 - cos th) + q_dot th_dot^2 / 2 at x0: cos(th) on the angle."""
        curv = torch.cos(x0[:, 0])
        if self.gauss_newton:
            curv = curv.clamp_min(0.0)
        qdot = self.log_qdot.exp().expand_as(curv)
        return torch.diag_embed(torch.stack([curv, qdot], 1))

    def forward(self, x0):
        n = len(x0)
        A, B = self.A.expand(n, NX, NX), self.B.expand(n, NX, NU)
        Q = self.cost_hessian(x0)
        R = self.r * torch.eye(NU).expand(n, NU, NU)
        V = Q
        for _ in range(T_MPC):
            Q_uu = R + B.mT @ V @ B
            Q_ux = B.mT @ V @ A
            L = torch.linalg.cholesky(Q_uu)
            K = -torch.cholesky_solve(Q_ux, L)
            V = Q + A.mT @ V @ A + Q_ux.mT @ K
            V = (V + V.mT) / 2
        return (K @ x0[:, :, None])[:, :, 0]  # the first control of the horizon


def make_mpc() -> RiccatiMPC:
    torch.manual_seed(0)
    return RiccatiMPC()


def make_mpc_gauss_newton() -> RiccatiMPC:
    torch.manual_seed(0)
    return RiccatiMPC(gauss_newton=True)


def pendulum_states(g: torch.Generator, n: int = 16, fallen: int | None = None):
    """States near upright (stabilisation data) and the expert's PD controls;
    ``fallen``: a record of the pendulum hanging down (a reset logged into the dataset)."""
    x0 = torch.stack([(torch.rand(n, generator=g) - 0.5) * 0.6,
                      (torch.rand(n, generator=g) - 0.5) * 0.5], 1)
    if fallen is not None:
        x0[fallen] = torch.tensor([3.1, 0.0])
    u_star = -(4.0 * x0[:, :1] + 1.5 * x0[:, 1:])
    return x0, u_star


# ---------------------------------------------------------------------------------------------
# cart-pole: policy learning through a differentiable simulator

GRAVITY, M_CART, M_POLE, LENGTH, F_MAX = 9.8, 1.0, 0.1, 0.5, 10.0


def cartpole_step(s, force, dt):
    """gym's CartPoleEnv dynamics, semi-implicit Euler; ``dt`` of shape (B,)."""
    x, x_dot, th, th_dot = s.unbind(1)
    cos, sin = torch.cos(th), torch.sin(th)
    total = M_CART + M_POLE
    temp = (force + M_POLE * LENGTH * th_dot ** 2 * sin) / total
    th_acc = (GRAVITY * sin - cos * temp) / (
        LENGTH * (4.0 / 3.0 - M_POLE * cos ** 2 / total))
    x_acc = temp - M_POLE * LENGTH * th_acc * cos / total
    x_dot = x_dot + dt * x_acc
    x = x + dt * x_dot
    th_dot = th_dot + dt * th_acc
    th = th + dt * th_dot
    return torch.stack([x, x_dot, th, th_dot], 1)


class CartPolePolicy(nn.Module):
    def __init__(self, hidden: int = 32, steps: int = 20):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.steps = steps

    def forward(self, s0, dt):
        s, states = s0, []
        for _ in range(self.steps):
            force = F_MAX * torch.tanh(self.net(s))[:, 0]
            s = cartpole_step(s, force, dt)
            states.append(s)
        return torch.stack(states, 1)


def cartpole_cost(states):
    """Keep the pole up and the cart centred."""
    return (states[..., 2] ** 2 + 0.1 * states[..., 0] ** 2
            + 0.01 * states[..., 3] ** 2).mean()


def make_cartpole() -> CartPolePolicy:
    torch.manual_seed(0)
    return CartPolePolicy()


def cartpole_batch(g: torch.Generator, n: int = 16, slow: int | None = None):
    """Starts near upright and control periods of 10-30 ms; ``slow``: an episode whose
    period was logged in milliseconds (20 read as 20 s)."""
    s0 = (torch.rand(n, 4, generator=g) - 0.5) * 0.1
    dt = 0.01 + 0.02 * torch.rand(n, generator=g)
    if slow is not None:
        dt[slow] = 20.0
    return s0, dt


# ---------------------------------------------------------------------------------------------
# a learned pendulum model on padded episodes


class PendulumDynamics(nn.Module):
    """Predicts the next (cos th, sin th, th_dot) from (cos th, sin th, th_dot, u), residually."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                                 nn.SiLU(), nn.Linear(hidden, 3))

    def forward(self, obs, u, mask):  # obs (B, T, 3), u (B, T, 1), mask (B, T)
        pred = obs + self.net(torch.cat([obs, u], -1))
        return pred * mask[..., None]  # the padded steps' predictions zeroed like the targets


def angle_loss(pred, target, mask):
    """The wrapped angle error plus the angular velocity's, over the real steps."""
    th_p = torch.atan2(pred[..., 1], pred[..., 0])
    th_t = torch.atan2(target[..., 1], target[..., 0])
    d = torch.remainder(th_p - th_t + torch.pi, 2 * torch.pi) - torch.pi
    err = d ** 2 + 0.1 * (pred[..., 2] - target[..., 2]) ** 2
    return (err * mask).sum() / mask.sum()


def angle_loss_on_circle(pred, target, mask, w: float = 0.1):
    """``angle_loss`` plus a penalty keeping the predicted (cos, sin) on the unit circle,
    its radius written out by hand (the padded steps' predictions are 0)."""
    radius = torch.sqrt(pred[..., 0] ** 2 + pred[..., 1] ** 2)
    return angle_loss(pred, target, mask) + w * (((radius - 1) ** 2) * mask).sum() / mask.sum()


def make_dynamics() -> PendulumDynamics:
    torch.manual_seed(0)
    return PendulumDynamics()


def episodes(g: torch.Generator, n: int = 8, t: int = 10, short: int | None = None):
    """Pendulum transitions under random torques; ``short``: an episode that ended early,
    its tail padded with zeros (observations, targets and mask alike)."""
    th = (torch.rand(n, 1, generator=g) - 0.5) * 6
    th_dot = (torch.rand(n, 1, generator=g) - 0.5) * 2
    u = (torch.rand(n, t + 1, 1, generator=g) - 0.5) * 4
    ths, dots = [], []
    for k in range(t + 1):
        ths.append(th)
        dots.append(th_dot)
        th_dot = th_dot + 0.05 * (-9.8 * torch.sin(th) + u[:, k])
        th = th + 0.05 * th_dot
    th, th_dot = torch.cat(ths, 1), torch.cat(dots, 1)
    obs = torch.stack([torch.cos(th), torch.sin(th), th_dot], -1)
    mask = torch.ones(n, t)
    if short is not None:
        mask[short, t // 2:] = 0
    x, y = obs[:, :-1] * mask[..., None], obs[:, 1:] * mask[..., None]
    return x, u[:, :-1] * mask[..., None], y, mask


# ---------------------------------------------------------------------------------------------
# PI-Net: a differentiable MPPI planner over a learned model, trained by imitation


class PINet(nn.Module):
    """Okada et al.'s path-integral network: K control sequences sampled around a nominal
    one, rolled out through a learned point-mass model, weighted by exp(-S / lambda), and the
    weighted first control returned; the model and the cost's weights are learned end to end
    from an expert's controls. ``stable``: the weights by softmax (the cost's minimum
    subtracted), as mppi implementations do."""

    def __init__(self, stable: bool = False, samples: int = 32, horizon: int = 10,
                 lam: float = 1.0, hidden: int = 32):
        super().__init__()
        self.dyn = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 2))
        self.log_q = nn.Parameter(torch.zeros(2))
        self.stable, self.k, self.t, self.lam = stable, samples, horizon, lam

    def forward(self, x0):
        n = len(x0)
        u = 0.5 * torch.randn(n, self.k, self.t)
        x, cost = x0[:, None].expand(n, self.k, 2), torch.zeros(n, self.k)
        for i in range(self.t):
            x = x + 0.1 * self.dyn(torch.cat([x, u[..., i:i + 1]], -1))
            cost = cost + (self.log_q.exp() * x ** 2).sum(-1) + 0.01 * u[..., i] ** 2
        if self.stable:
            w = torch.softmax(-cost / self.lam, 1)
        else:
            w = torch.exp(-cost / self.lam)
            w = w / w.sum(1, keepdim=True)
        return (w * u[..., 0]).sum(1, keepdim=True)


def make_pinet() -> PINet:
    torch.manual_seed(0)
    return PINet()


def make_pinet_softmax() -> PINet:
    torch.manual_seed(0)
    return PINet(stable=True)


def expert_batch(g: torch.Generator, n: int = 16, far: int | None = None):
    """States around the goal and an LQR expert's controls; ``far``: a record 12 units away
    (a reset logged in another frame's coordinates)."""
    x0 = (torch.rand(n, 2, generator=g) - 0.5) * 2
    if far is not None:
        x0[far] = torch.tensor([12.0, 0.0])
    return x0, -(1.0 * x0[:, :1] + 1.7 * x0[:, 1:])
