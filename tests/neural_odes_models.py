"""Neural ODEs and continuous normalising flows written by hand, as torchdiffeq's examples,
FFJORD, RNODE, torchode and the Latent ODE paper write them, for ``test_neural_odes``.

- ``AdaptiveODE``: a Dormand-Prince 5(4) solver with one step size per sample (torchode's
  batched layout): Hairer's initial step selection (``h0 = 0.01 d0 / d1``, then
  ``d2 = |f1 - f0| / h0``), the error ratio's RMS norm against ``atol + rtol |y|``, rejected
  steps, the step controller ``h * clamp(0.9 ratio^-1/5, 0.2, 10)`` in a Python while loop.
- ``IgnitionODE``: a fixed-step RK4 rollout of a learned field with an Arrhenius-like
  ``exp(y)`` term (thermal runaway: ``y' = e^y`` blows up in finite time).
- ``CNF``: FFJORD's continuous normalising flow; the ODE function takes ``autograd.grad`` of
  its output with ``create_graph=True`` inside ``forward`` (the Hutchinson trace estimator with
  noise from ``torch.randn_like``), RNODE's kinetic-energy and Jacobian-Frobenius terms, and
  the standard normal's log-density of ``z`` in the loss; ``make_cnf_rbf``: its dynamics an
  RBF network whose centres were picked from training points (a hand-written distance's sqrt).
- ``LatentODE``: Rubanova et al.'s latent ODE for irregularly sampled series: a GRU encoder
  over the reversed observations, the latent state decoded at each sample's own observation
  times (given to ``forward`` as a tensor), RK4 sub-steps between consecutive times.
- ``AdjointODE``: the adjoint method as a custom ``torch.autograd.Function`` that integrates
  the augmented state ``(y, a, a_theta)`` backwards in time in its ``backward``; with a
  strongly damped field (``make_adjoint_damped``) that reverse solve is unstable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# Dormand-Prince 5(4), one step size per sample

C = [0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0]
A = [[], [1 / 5], [3 / 40, 9 / 40], [44 / 45, -56 / 15, 32 / 9],
     [19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729],
     [9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656],
     [35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84]]
B5 = [35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0.0]
B4 = [5179 / 57600, 0.0, 7571 / 16695, 393 / 640, -92097 / 339200, 187 / 2100, 1 / 40]
E = [b5 - b4 for b5, b4 in zip(B5, B4)]


class ODEFunc(nn.Module):
    """torchdiffeq's ode_demo field, with its call counter."""

    def __init__(self, dim: int = 2, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.nfe = 0

    def forward(self, t, y):
        self.nfe += 1
        return self.net(y)


def rms(x):
    return x.pow(2).mean(dim=1).sqrt()


def initial_step(func, t0, y0, f0, rtol, atol, guard: bool):
    """Hairer, Norsett & Wanner's starting step size, per sample."""
    scale = atol + y0.abs() * rtol
    d0, d1 = rms(y0 / scale), rms(f0 / scale)
    h0 = 0.01 * d0 / d1
    if guard:  # torchdiffeq's guard: a state or slope near 0 starts from 1e-6
        h0 = torch.where((d0 < 1e-5) | (d1 < 1e-5), torch.full_like(h0, 1e-6), h0)
    f1 = func(t0 + h0, y0 + h0[:, None] * f0)
    d2 = rms((f1 - f0) / scale) / h0  # the bug: h0 = 0 for a state at exactly 0
    h1 = (0.01 / torch.max(d1, d2)) ** (1 / 5)
    return torch.min(100 * h0, h1)


class AdaptiveODE(nn.Module):
    """y(t1) of each sample by an adaptive Dormand-Prince solve from t = 0, then a linear head."""

    def __init__(self, guard: bool = False, rtol: float = 1e-3, atol: float = 1e-4):
        super().__init__()
        self.func, self.head = ODEFunc(), nn.Linear(2, 2)
        self.guard, self.rtol, self.atol = guard, rtol, atol

    def forward(self, y0, t1):
        y, t = y0, torch.zeros_like(t1)
        f = self.func(t, y)
        with torch.no_grad():
            h = initial_step(self.func, t, y, f, self.rtol, self.atol, self.guard)
        for _ in range(40):  # max_num_steps
            done = t >= t1
            if bool(done.all()):
                break
            h = torch.min(h, t1 - t)
            k = [f]
            for i in range(1, 7):
                yi = y + h[:, None] * sum(a * kj for a, kj in zip(A[i], k))
                k.append(self.func(t + C[i] * h, yi))
            y_new = y + h[:, None] * sum(b * kj for b, kj in zip(B5, k))
            with torch.no_grad():
                err = h[:, None] * sum(e * kj for e, kj in zip(E, k))
                ratio = rms(err / (self.atol + self.rtol * torch.max(y.abs(), y_new.abs())))
                accept = (ratio <= 1) & ~done
                factor = (0.9 * ratio ** -0.2).clamp(0.2, 10.0)
            y = torch.where(accept[:, None], y_new, y)
            f = torch.where(accept[:, None], k[6], f)  # FSAL
            t = torch.where(accept, t + h, t)
            h = torch.where(done, h, h * factor)
        return self.head(y)


def make_adaptive() -> AdaptiveODE:
    torch.manual_seed(0)
    return AdaptiveODE()


def make_adaptive_guarded() -> AdaptiveODE:
    torch.manual_seed(0)
    return AdaptiveODE(guard=True)


def spiral_batch(g: torch.Generator, zero_row: int | None = None, n: int = 16):
    """Initial states on a spiral, end times in [0.5, 1], targets a rotation of the state;
    ``zero_row``: a sample starting exactly at the origin (the spiral's centre)."""
    theta = torch.rand(n, generator=g) * 6
    r = 0.2 + 0.1 * theta
    y0 = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], 1)
    if zero_row is not None:
        y0[zero_row] = 0.0
    t1 = 0.5 + 0.5 * torch.rand(n, generator=g)
    target = torch.stack([-y0[:, 1], y0[:, 0]], 1)
    return y0, t1, target


# ---------------------------------------------------------------------------------------------
# fixed-step RK4 through thermal runaway


class IgnitionField(nn.Module):
    """A learned correction plus an Arrhenius-like source: y' = net(y) - y + a e^y."""

    def __init__(self, dim: int = 2, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.log_a = nn.Parameter(torch.zeros(dim))

    def forward(self, t, y):
        return self.net(y) - y + self.log_a.exp() * torch.exp(y)  # the bug: e^y past y = 88


def rk4(func, y, t0: float, t1: float, steps: int):
    h, t = (t1 - t0) / steps, t0
    for _ in range(steps):
        k1 = func(t, y)
        k2 = func(t + h / 2, y + h / 2 * k1)
        k3 = func(t + h / 2, y + h / 2 * k2)
        k4 = func(t + h, y + h * k3)
        y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        t = t + h
    return y


class IgnitionODE(nn.Module):
    def __init__(self, steps: int = 10, t1: float = 0.5):
        super().__init__()
        self.func, self.steps, self.t1 = IgnitionField(), steps, t1

    def forward(self, y0):
        return rk4(self.func, y0, 0.0, self.t1, self.steps)


def make_ignition() -> IgnitionODE:
    torch.manual_seed(0)
    return IgnitionODE()


def ignition_batch(g: torch.Generator, hot_row: int | None = None, n: int = 16):
    """Initial temperatures (log scale) well below ignition; ``hot_row`` starts at 1.2, whose
    runaway time e^-1.2 = 0.3 falls inside the horizon."""
    y0 = torch.rand(n, 2, generator=g) * 0.4 - 1.0
    if hot_row is not None:
        y0[hot_row] = 1.2
    return y0, torch.zeros(n, 2)


# ---------------------------------------------------------------------------------------------
# FFJORD / RNODE continuous normalising flow


class CNFFunc(nn.Module):
    """FFJORD's ODEfunc: the dynamics and the Hutchinson estimate of their divergence,
    e^T (df/dz) e, by autograd.grad with create_graph=True; RNODE's regularisers."""

    def __init__(self, dim: int = 2, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim + 1, hidden), nn.Softplus(),
                                 nn.Linear(hidden, hidden), nn.Softplus(), nn.Linear(hidden, dim))
        self.e = None

    def before_odeint(self, z):
        self.e = torch.randn_like(z)  # one noise draw per solve, as FFJORD does

    def forward(self, t, z):
        with torch.enable_grad():
            z = z.requires_grad_(True) if not z.requires_grad else z
            tt = torch.full_like(z[:, :1], t)
            dz = self.net(torch.cat([z, tt], 1))
            e_dzdz = torch.autograd.grad(dz, z, self.e, create_graph=True)[0]
        div = (e_dzdz * self.e).sum(1)
        kinetic = dz.pow(2).sum(1)
        frobenius = e_dzdz.pow(2).sum(1)
        return dz, -div, kinetic, frobenius


class CNF(nn.Module):
    """x -> z by RK4 on [0, 1]; returns z, the log-density change and the regularisers."""

    def __init__(self, steps: int = 4):
        super().__init__()
        self.odefunc, self.steps = CNFFunc(), steps

    def forward(self, x):
        self.odefunc.before_odeint(x)
        h = 1.0 / self.steps
        state = (x, torch.zeros(len(x)), torch.zeros(len(x)), torch.zeros(len(x)))
        for i in range(self.steps):
            t = i * h
            k1 = self.odefunc(t, state[0])
            k2 = self.odefunc(t + h / 2, state[0] + h / 2 * k1[0])
            k3 = self.odefunc(t + h / 2, state[0] + h / 2 * k2[0])
            k4 = self.odefunc(t + h, state[0] + h * k3[0])
            state = tuple(s + h / 6 * (a + 2 * b + 2 * c + d)
                          for s, a, b, c, d in zip(state, k1, k2, k3, k4))
        return state


def make_cnf() -> CNF:
    torch.manual_seed(0)
    return CNF()


def standard_normal_logprob(z):
    return -0.5 * math.log(2 * math.pi) - z.pow(2) / 2  # z² overflows past 1.8e19


def cnf_loss(z, delta_logp, kinetic, frobenius, ke_weight=0.01, jf_weight=0.01):
    logpx = standard_normal_logprob(z).sum(1) - delta_logp
    return -logpx.mean() + ke_weight * kinetic.mean() + jf_weight * frobenius.mean()


def moons_batch(g: torch.Generator, fill_row: int | None = None, n: int = 32):
    """Two moons, standardised; ``fill_row`` holds netCDF's default _FillValue 1e20 (a missing
    measurement nobody masked)."""
    t = torch.rand(n, generator=g) * math.pi
    upper = torch.rand(n, generator=g) < 0.5
    x = torch.stack([torch.where(upper, torch.cos(t), 1 - torch.cos(t)),
                     torch.where(upper, torch.sin(t), 0.5 - torch.sin(t))], 1)
    x = x + 0.05 * torch.randn(n, 2, generator=g)
    if fill_row is not None:
        x[fill_row, 1] = 1e20
    return x


# ---------------------------------------------------------------------------------------------
# Latent ODE on irregularly sampled series


class LatentField(nn.Module):
    def __init__(self, latent: int = 4, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(latent, hidden), nn.Tanh(), nn.Linear(hidden, latent))
        self.decay = nn.Parameter(torch.ones(latent))

    def forward(self, t, z):
        return self.net(z) - F.softplus(self.decay) * z


class LatentODE(nn.Module):
    def __init__(self, obs: int = 3, latent: int = 4, substeps: int = 4):
        super().__init__()
        self.encoder = nn.GRU(obs + 1, 16, batch_first=True)
        self.to_z0 = nn.Linear(16, 2 * latent)
        self.func = LatentField(latent)
        self.decoder = nn.Linear(latent, obs)
        self.substeps = substeps

    def forward(self, x, times):  # x (B, T, obs), times (B, T), increasing within each row
        dts = torch.diff(times, dim=1, prepend=times[:, :1])
        _, hidden = self.encoder(torch.cat([x, dts[..., None]], -1).flip(1))
        mean, logvar = self.to_z0(hidden[-1]).chunk(2, -1)
        z = mean + torch.randn_like(mean) * torch.exp(0.5 * logvar)
        zs = [z]
        for i in range(times.shape[1] - 1):
            h = (times[:, i + 1] - times[:, i])[:, None] / self.substeps
            for _ in range(self.substeps):
                k1 = self.func(times[:, i], z)
                k2 = self.func(times[:, i], z + h / 2 * k1)
                k3 = self.func(times[:, i], z + h / 2 * k2)
                k4 = self.func(times[:, i], z + h * k3)
                z = z + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            zs.append(z)
        return self.decoder(torch.stack(zs, 1)), mean, logvar


def make_latent() -> LatentODE:
    torch.manual_seed(0)
    return LatentODE()


def latent_loss(pred, mean, logvar, x, mask):
    nll = ((pred - x) ** 2 * mask).sum((1, 2)) / mask.sum((1, 2)).clamp_min(1)
    kl = -0.5 * (1 + logvar - mean ** 2 - logvar.exp()).sum(1)
    return (nll + 0.1 * kl).mean()


def irregular_batch(g: torch.Generator, unsorted_row: int | None = None, n: int = 8, T: int = 6):
    """Damped oscillations observed at random times in [0, 5] hours; ``unsorted_row``'s last
    timestamp is in minutes (a unit mix-up in one record), a span of -300 hours."""
    times = torch.sort(torch.rand(n, T, generator=g) * 5, dim=1).values
    times[:, 0] = 0.0
    if unsorted_row is not None:
        times[unsorted_row, -2] = 300.0
    phase = torch.rand(n, 1, generator=g) * 6
    base = torch.exp(-0.3 * times) * torch.sin(times + phase)
    x = torch.stack([base, 0.5 * base, -base], -1) + 0.01 * torch.randn(n, T, 3, generator=g)
    mask = (torch.rand(n, T, 3, generator=g) < 0.8).float()
    return x * mask, times, mask


# ---------------------------------------------------------------------------------------------
# the adjoint method


class OdeintAdjoint(torch.autograd.Function):
    """y(t1) by RK4 without a graph; the backward integrates (y, a, a_theta) from t1 to t0:
    a' = -a df/dy, a_theta' = -a df/dtheta (Chen et al. 2018, Alg. 1)."""

    @staticmethod
    def forward(ctx, y0, func, t1, steps, *params):
        with torch.no_grad():
            y1 = rk4(func, y0, 0.0, t1, steps)
        ctx.func, ctx.t1, ctx.steps = func, t1, steps
        ctx.save_for_backward(y1, *params)
        return y1

    @staticmethod
    def backward(ctx, grad_y1):
        y1, *params = ctx.saved_tensors
        func, n = ctx.func, y1.numel()

        def augmented(t, s):
            y, a = s[:n].view_as(y1), s[n:2 * n].view_as(y1)
            with torch.enable_grad():
                y = y.detach().requires_grad_(True)
                f = func(t, y)
                vjp = torch.autograd.grad(f, (y, *params), -a, allow_unused=True)
            vjp = [torch.zeros_like(p) if v is None else v for v, p in zip(vjp, (y, *params))]
            return torch.cat([f.reshape(-1)] + [v.reshape(-1) for v in vjp])

        s = torch.cat([y1.reshape(-1), grad_y1.reshape(-1)]
                      + [torch.zeros(p.numel()) for p in params])
        s = rk4(augmented, s, ctx.t1, 0.0, ctx.steps)
        grads, i = [], 2 * n
        for p in params:
            grads.append(s[i:i + p.numel()].view_as(p))
            i += p.numel()
        return (s[n:2 * n].view_as(y1), None, None, None, *grads)


class AdjointODE(nn.Module):
    def __init__(self, steps: int = 8):
        super().__init__()
        self.func, self.head, self.steps = ODEFunc(), nn.Linear(2, 2), steps

    def forward(self, y0):
        y1 = OdeintAdjoint.apply(y0, self.func, 1.0, self.steps, *self.func.parameters())
        return self.head(y1)


def make_adjoint() -> AdjointODE:
    torch.manual_seed(0)
    return AdjointODE()


class DampedField(nn.Module):
    """A learned field with a strong linear damping: y' = net(y) - k y (a dissipative system,
    contracting forward in time, expanding when run backward)."""

    def __init__(self, dim: int = 2, hidden: int = 32, damping: float = 200.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.damping = damping

    def forward(self, t, y):
        return self.net(y) - self.damping * y


def make_adjoint_damped() -> AdjointODE:
    """The adjoint's backward rebuilds y(t) by integrating from y(t1) back to t0: for a
    dissipative field that reverse solve is unstable (ANODE, Gholami et al. 2019)."""
    torch.manual_seed(0)
    model = AdjointODE(steps=80)
    model.func = DampedField()
    return model


class RBF(nn.Module):
    """Laplacian radial basis features exp(-|u - c_k| / s) of the (z, t) input, the centres
    picked from training points at t = 0 (as an RBF network's are, from its data)."""

    def __init__(self, centres: torch.Tensor, scale: float = 0.5):
        super().__init__()
        self.register_buffer("centres", centres.clone())  # fixed centres, learned weights
        self.scale = scale

    def forward(self, u):
        r = ((u[:, None, :] - self.centres[None]) ** 2).sum(-1).sqrt()  # the bug: sqrt'(0) = inf
        return torch.exp(-r / self.scale)


def make_cnf_rbf() -> CNF:
    """FFJORD's CNF with an RBF network for dynamics; the Hutchinson estimator differentiates
    it in forward, at a centre too."""
    torch.manual_seed(0)
    model = CNF()
    points = moons_batch(torch.Generator().manual_seed(5), n=8)
    centres = torch.cat([points, torch.zeros(8, 1)], 1)
    model.odefunc.net = nn.Sequential(RBF(centres), nn.Linear(8, 2))
    return model


def moons_with_centre(g: torch.Generator, centre_row: int | None = None, n: int = 32):
    """Two moons; ``centre_row`` is the training point the RBF's first centre was picked from."""
    x = moons_batch(g, n=n)
    if centre_row is not None:
        x[centre_row] = moons_batch(torch.Generator().manual_seed(5), n=8)[0]
    return x


def make_adaptive_zero_init() -> AdaptiveODE:
    """The ODE function's last layer zero-initialised, so that the flow starts as the
    identity (as CNFs and RNODE do): its slope f0 is 0 everywhere at the first step."""
    model = make_adaptive()
    nn.init.zeros_(model.func.net[-1].weight)
    nn.init.zeros_(model.func.net[-1].bias)
    return model
