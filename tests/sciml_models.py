"""Scientific-ML training code: a physics-informed network (PINN) for the Poisson equation
-Δu = 4 on the unit disk (solution 1 - r²), whose loss differentiates the model output twice
with respect to its input coordinates (``torch.autograd.grad(..., create_graph=True)``; the
collocation points are a root input with ``requires_grad_(True)``). The network takes polar
features, ``r = sqrt(x² + y²)``: finite at the origin, but its derivative is infinite there."""

from __future__ import annotations

import torch
from torch import nn


class PolarFeatures(nn.Module):
    def forward(self, xy):
        x, y = xy[:, :1], xy[:, 1:]
        r = torch.sqrt(x ** 2 + y ** 2)  # the bug: d r / d x = x / r is 0/0 at the origin
        theta = torch.atan2(y, x)
        return torch.cat([r, torch.cos(theta), torch.sin(theta), x, y], dim=1)


class PINN(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2):
        super().__init__()
        self.features = PolarFeatures()
        layers, d = [], 5
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.Tanh()]
            d = width
        self.mlp = nn.Sequential(*layers, nn.Linear(d, 1))

    def forward(self, xy):
        return self.mlp(self.features(xy))


def make_model() -> PINN:
    torch.manual_seed(0)
    return PINN()


def residual(u, xy):
    """The residual of -Δu = 4 at the collocation points ``xy``, one row each."""
    g = torch.autograd.grad(u, xy, torch.ones_like(u), create_graph=True)[0]
    u_x, u_y = g[:, :1], g[:, 1:]
    u_xx = torch.autograd.grad(u_x, xy, torch.ones_like(u_x), create_graph=True)[0][:, :1]
    u_yy = torch.autograd.grad(u_y, xy, torch.ones_like(u_y), create_graph=True)[0][:, 1:]
    return -(u_xx + u_yy) - 4.0


def pde_residual_loss(u, xy):
    """Mean squared residual at the collocation points ``xy``."""
    return (residual(u, xy) ** 2).mean()


def collocation(step: int, g: torch.Generator, grid_from: int) -> torch.Tensor:
    """Random points, then (from step ``grid_from`` on) a uniform 7 x 7 grid, whose centre,
    row 24, is the origin."""
    if step >= grid_from:
        s = torch.linspace(-0.75, 0.75, 7)
        xy = torch.cartesian_prod(s, s)
    else:
        xy = torch.rand(49, 2, generator=g) * 1.5 - 0.75
    return xy.requires_grad_(True)


def boundary(g: torch.Generator) -> torch.Tensor:
    th = torch.rand(16, 1, generator=g) * 6.2832
    return torch.cat([torch.cos(th), torch.sin(th)], 1)


def train_step(model, opt, loss_fn, xy, xb) -> float:
    """One step: the residual at the collocation points (a loss taking the model's own
    input), then the boundary condition u = 0 on a second forward."""
    opt.zero_grad()
    loss = loss_fn(model(xy), xy) + model(xb).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item()


class Classifier(nn.Module):
    """A small classifier whose first layer has no bias: a zero-padded row reaches every
    ReLU at exactly 0, so its input gradient is exactly 0."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32, bias=False), nn.ReLU(), nn.Linear(32, 32),
                                  nn.ReLU())
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.body(x))


def make_classifier() -> Classifier:
    torch.manual_seed(0)
    return Classifier()


def input_gradient_norm(loss, x):
    """Double backprop's penalty (Drucker & LeCun 1992): the mean norm of each sample's input
    gradient, differentiable (create_graph=True). sqrt of an exactly 0 sum has an infinite
    derivative, which the step's backward multiplies by 0: NaN."""
    gx = torch.autograd.grad(loss, x, create_graph=True)[0]
    return torch.sqrt((gx ** 2).sum(1)).mean()


def double_backprop_loss(out, y, x):
    """Cross entropy plus the penalty, with the input it differentiates by as an argument."""
    loss = nn.functional.cross_entropy(out, y)
    return loss + 0.1 * input_gradient_norm(loss, x)


def classifier_batch(step: int, g: torch.Generator, pad_at: int):
    x = torch.randn(16, 10, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    if step == pad_at:
        x[5] = 0.0  # a zero-padded row
    return x.requires_grad_(True), y


class Energy(nn.Module):
    """A learned Hamiltonian H(q, p) with a radial feature |(q, p)|."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, hidden), nn.Linear(hidden, 1)

    def forward(self, x):
        r = torch.sqrt((x ** 2).sum(1, keepdim=True))  # the bug: its derivative at rest is 0/0
        return self.l2(torch.tanh(self.l1(torch.cat([x, r], 1))))


class HNN(nn.Module):
    """Hamiltonian neural network (Greydanus et al. 2019): the forward returns the symplectic
    gradient (dH/dp, -dH/dq) of the learned energy, through autograd.grad of its own."""

    def __init__(self):
        super().__init__()
        self.H = Energy()

    def forward(self, x):
        with torch.enable_grad():
            x = x if x.requires_grad else x.detach().requires_grad_(True)
            dh = torch.autograd.grad(self.H(x).sum(), x, create_graph=True)[0]
        return torch.cat([dh[:, 1:], -dh[:, :1]], dim=1)


def make_hnn() -> HNN:
    torch.manual_seed(0)
    return HNN()


def pendulum_batch(step: int, g: torch.Generator, rest_at: int):
    """States (q, p) and their time derivatives; at step ``rest_at`` row 7 is the pendulum at
    rest at the bottom, q = p = 0."""
    x = torch.rand(32, 2, generator=g) * 4 - 2
    dx = torch.cat([x[:, 1:], -3 * torch.sin(x[:, :1])], 1)
    if step == rest_at:
        x[7], dx[7] = 0.0, 0.0
    return x, dx


class VectorField(nn.Module):
    """dy/dt = f(y) - y³: a learned field with cubic damping, stiff for a large state (the
    explicit RK4 step is stable only while dt * 3y² stays below about 2.8)."""

    def __init__(self, dim: int = 2, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Softplus(), nn.Linear(hidden, dim))

    def forward(self, t, y):
        return self.net(y) - y ** 3


class NeuralODE(nn.Module):
    """A neural ODE integrated by a hand-written fixed-step RK4 loop in ``forward``; returns
    the trajectory ``(B, T, D)``."""

    def __init__(self, steps: int = 20, dt: float = 0.25):
        super().__init__()
        self.func = VectorField()
        self.steps, self.dt = steps, dt

    def forward(self, y0):
        ys, y, t, h = [y0], y0, 0.0, self.dt
        for _ in range(self.steps):
            k1 = self.func(t, y)
            k2 = self.func(t + h / 2, y + h / 2 * k1)
            k3 = self.func(t + h / 2, y + h / 2 * k2)
            k4 = self.func(t + h, y + h * k3)
            y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            t += h
            ys.append(y)
        return torch.stack(ys, dim=1)


def make_ode() -> NeuralODE:
    torch.manual_seed(0)
    return NeuralODE()


def ode_batch(step: int, g: torch.Generator, far_at: int) -> torch.Tensor:
    """Initial states near the origin; at step ``far_at`` row 5 starts at (3.1, -3.1), where the
    cubic damping is too stiff for the solver's step."""
    y0 = (torch.rand(16, 2, generator=g) - 0.5) * 0.5
    if step == far_at:
        y0[5] = torch.tensor([3.1, -3.1])
    return y0


class SmoothedPolarFeatures(nn.Module):
    """The radius smoothed, as a first fix does; the angle keeps its pole."""

    def forward(self, xy):
        x, y = xy[:, :1], xy[:, 1:]
        r = torch.sqrt(x ** 2 + y ** 2 + 1e-12)
        theta = torch.atan2(y, x)  # the bug: its derivative (-y, x) / (x² + y²) is 1/0 at 0
        return torch.cat([r, torch.cos(theta), torch.sin(theta), x, y], dim=1)


def make_smoothed_model() -> PINN:
    model = make_model()
    model.features = SmoothedPolarFeatures()
    return model
