"""Physics-informed neural networks, with DeepXDE 1.15 (pytorch backend) and by hand.

DeepXDE's problems: the 1-D Poisson equation ``-u'' = pi^2 sin(pi x)`` on [-1, 1] with
Dirichlet boundaries (``dde.data.PDE``), a 1-D heat equation ``u_t = a u_xx`` with an initial
condition (``dde.data.TimePDE``), solved by ``dde.nn.FNN`` through ``dde.Model``. The network is
``model.net``, the optimizer the one ``model.compile`` builds (``model.opt``); the factories
below rebuild the net for the replay.

By hand: the same Poisson PINN written with ``torch.autograd.grad(create_graph=True)``, its loss
a module taking the network's output and the collocation points (``PoissonLoss``), so that the
replay re-runs the residual; and an eikonal PINN ``|grad u| = 1`` on the unit square.
"""

from __future__ import annotations

import os

os.environ.setdefault("DDE_BACKEND", "pytorch")

import deepxde as dde  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

HIDDEN = 16


# ---------------------------------------------------------------- DeepXDE's problems


def poisson_pde(x, y):
    """The residual of ``-u'' = pi^2 sin(pi x)``."""
    dy_xx = dde.grad.hessian(y, x)
    return -dy_xx - np.pi ** 2 * torch.sin(np.pi * x)


def poisson_log_pde(x, y):
    """A nonlinear source in log u (as a Liouville-Bratu variant is written): u < 0 somewhere."""
    dy_xx = dde.grad.hessian(y, x)
    return -dy_xx - torch.log(y)  # the bug: the network's output is not kept positive


def make_net(activation: str = "tanh") -> nn.Module:
    """The FNN DeepXDE trains (and the replay's factory)."""
    torch.manual_seed(0)
    return dde.nn.FNN([1, HIDDEN, HIDDEN, 1], activation, "Glorot uniform")


def make_heat_net() -> nn.Module:
    torch.manual_seed(0)
    return dde.nn.FNN([2, HIDDEN, HIDDEN, 1], "tanh", "Glorot normal")


def poisson_model(pde=poisson_pde, anchors=None, loss_weights=None, n_domain: int = 16,
                  opt: str = "adam", lr: float = 1e-3):
    """A compiled ``dde.Model`` of the Poisson problem, its net from :func:`make_net`."""
    dde.config.set_random_seed(0)
    geom = dde.geometry.Interval(-1, 1)
    bc = dde.icbc.DirichletBC(geom, lambda x: 0, lambda _, on_boundary: on_boundary)
    data = dde.data.PDE(geom, pde, bc, n_domain, 2, anchors=anchors, num_test=20,
                        train_distribution="uniform")
    model = dde.Model(data, make_net())
    if opt == "L-BFGS":
        model.compile("L-BFGS", loss_weights=loss_weights)
    else:
        model.compile(opt, lr=lr, loss_weights=loss_weights)
    return model


HEAT_A = 0.4


def heat_pde(x, y):
    dy_t = dde.grad.jacobian(y, x, i=0, j=1)
    dy_xx = dde.grad.hessian(y, x, i=0, j=0)
    return dy_t - HEAT_A * dy_xx


def heat_model(loss_weights=None, lr: float = 1e-3):
    """``u_t = a u_xx`` on [0, 1] x [0, 1], u = 0 at the ends, u(x, 0) = sin(pi x)."""
    dde.config.set_random_seed(0)
    geom = dde.geometry.Interval(0, 1)
    timedomain = dde.geometry.TimeDomain(0, 1)
    geomtime = dde.geometry.GeometryXTime(geom, timedomain)
    bc = dde.icbc.DirichletBC(geomtime, lambda x: 0, lambda _, on_b: on_b)
    ic = dde.icbc.IC(geomtime, lambda x: np.sin(np.pi * x[:, 0:1]), lambda _, on_i: on_i)
    data = dde.data.TimePDE(geomtime, heat_pde, [bc, ic], num_domain=24, num_boundary=8,
                            num_initial=8, num_test=20, train_distribution="uniform")
    model = dde.Model(data, make_heat_net())
    model.compile("adam", lr=lr, loss_weights=loss_weights)
    return model


# ---------------------------------------------------------------- by hand


class MLP(nn.Module):
    """``u(x)``: a plain MLP, tanh or relu."""

    def __init__(self, d_in: int = 1, act: str = "tanh") -> None:
        super().__init__()
        a = nn.Tanh if act == "tanh" else nn.ReLU
        self.net = nn.Sequential(nn.Linear(d_in, HIDDEN), a(), nn.Linear(HIDDEN, HIDDEN), a(),
                                 nn.Linear(HIDDEN, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP(1, "tanh")


def make_relu_mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP(1, "relu")


def make_eikonal_mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP(2, "relu")


def second_derivative(u: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u_x = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
    u_xx = torch.autograd.grad(u_x, x, torch.ones_like(u_x), create_graph=True)[0]
    return u_x, u_xx


class PoissonLoss(nn.Module):
    """The Poisson PINN's loss: mean squared residual at the collocation points plus the
    boundary term (the two boundary points are the last two rows), weighted."""

    def __init__(self, bc_weight: float = 1.0, normalise: bool = False) -> None:
        super().__init__()
        self.bc_weight = bc_weight
        self.normalise = normalise

    def forward(self, u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        _, u_xx = second_derivative(u, x)
        res = -u_xx - np.pi ** 2 * torch.sin(np.pi * x)
        if self.normalise:
            # residual scaled by the curvature's size, so the sharp and the flat regions weigh
            # the same (the bug: u_xx of a relu network is 0 everywhere)
            res = res * u_xx.abs() / u_xx.abs().mean()
        pde = (res[:-2] ** 2).mean()
        bc = (u[-2:] ** 2).mean()
        return pde + self.bc_weight * bc


def poisson_points(n: int = 16, nan_row: int | None = None) -> torch.Tensor:
    """Collocation points in (-1, 1), then the boundary points -1 and 1."""
    x = torch.linspace(-0.9, 0.9, n).unsqueeze(1)
    if nan_row is not None:
        x[nan_row] = float("nan")
    return torch.cat([x, torch.tensor([[-1.0], [1.0]])]).requires_grad_()


class PorousLoss(nn.Module):
    """A porous-medium-type diffusion ``-D(u) u'' = f`` with ``D(u) = sqrt(u)`` where u > 0, 0
    elsewhere, written with ``torch.where`` (the forward is finite; sqrt's derivative at the
    negative u it also computed is NaN, and 0 * NaN is NaN in the backward)."""

    def forward(self, u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        _, u_xx = second_derivative(u, x)
        d = torch.where(u > 0, torch.sqrt(u), torch.zeros_like(u))  # the bug: sqrt of u < 0
        res = -d * u_xx - torch.sin(np.pi * x)
        return (res[:-2] ** 2).mean() + (u[-2:] ** 2).mean()


def lbfgs_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn, x: torch.Tensor) -> None:
    """One ``opt.step(closure)`` as PINN codes write L-BFGS's (DeepXDE's own included)."""
    def closure():
        opt.zero_grad()
        loss = loss_fn(model(x), x)
        loss.backward()
        return loss
    opt.step(closure)
