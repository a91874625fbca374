"""Energy-based models and implicit layers as their well-known repositories write them, for
``test_implicit_energy``:

- an EBM trained by contrastive divergence with short-run Langevin dynamics inside the step
  (IGEBM / JEM / the UvA deep-learning tutorial's ``Sampler``): a replay buffer of past
  samples re-initialised with probability 0.05, ``autograd.grad`` of the energy w.r.t. the
  samples, ``x - step / 2 * grad + noise * sqrt(step)`` clamped to the data range, and the
  energy regularisation ``alpha * (E+² + E-²)``; and the tutorial's sampler, which steps one
  tensor in place through ``.data``;
- a deep-equilibrium layer (locuslab/deq, the implicit-layers tutorial): the fixed point
  ``z = f(z, x)`` solved under ``no_grad`` (naive iteration, or Anderson acceleration with
  ``torch.linalg.solve`` on a regularised Gram matrix), one differentiable ``f`` call, and the
  implicit backward by a gradient hook that solves ``g = Jᵀ g + grad`` by iteration.

(Denoising score matching over a sigma schedule reaching 0 and a Hutchinson Jacobian penalty
with a sqrt at a saturated sample were tried too: the product named them right already.)
"""

from __future__ import annotations

import math

import torch
from torch import nn

D = 8


# ---------------------------------------------------------------------------------------------
# EBM: contrastive divergence with short-run Langevin dynamics


class EnergyMLP(nn.Module):
    """E(x): a Swish MLP, one energy per sample (low energy = data)."""

    def __init__(self, d: int = D, h: int = 32, prior: float = 0.0, standardise: bool = False,
                 laplace: float = 0.0):
        super().__init__()
        self.laplace = laplace
        self.standardise = standardise  # per-record z-score, no eps: 0/0 on a constant record
        self.net = nn.Sequential(nn.Linear(d, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU(),
                                 nn.Linear(h, 1))
        self.prior = prior  # a Gaussian base measure: + prior * ‖x‖² / 2

    def forward(self, x):
        if self.standardise:
            x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)
        e = self.net(x).squeeze(-1) + self.prior * x.pow(2).sum(1) / 2
        if self.laplace:  # a Laplace base measure, + laplace * ‖x‖: sqrt'(0) is inf
            e = e + self.laplace * x.pow(2).sum(1).sqrt()
        return e


def make_ebm(prior: float = 0.0, standardise: bool = False, laplace: float = 0.0) -> EnergyMLP:
    torch.manual_seed(0)
    return EnergyMLP(prior=prior, standardise=standardise, laplace=laplace)


def sample_in_place(model, x, steps: int = 20, step_size: float = 10.0):
    """The UvA deep-learning tutorial's ``Sampler.generate_samples``: the samples written in
    place through ``.data``, the gradient from ``backward()`` clamped to ±0.03."""
    model.eval()
    for p in model.parameters():
        p.requires_grad = False
    x.requires_grad = True
    noise = torch.randn(x.shape)
    for _ in range(steps):
        noise.normal_(0, 0.005)
        x.data.add_(noise.data)
        x.data.clamp_(min=-1.0, max=1.0)
        model(x).sum().backward()  # (the tutorial's -score is this energy)
        x.grad.data.clamp_(-0.03, 0.03)
        x.data.add_(-step_size * x.grad.data)
        x.grad.detach_()
        x.grad.zero_()
        x.data.clamp_(min=-1.0, max=1.0)
    for p in model.parameters():
        p.requires_grad = True
    model.train()
    return x


def langevin(model, x, steps: int = 10, step_size: float = 0.01, noise: float = 0.005,
             clamp: bool = True):
    """Short-run SGLD from ``x``: the model's parameters frozen while it samples, as IGEBM does;
    ``clamp``: to the data range."""
    for p in model.parameters():
        p.requires_grad_(False)
    x = x.detach()
    for _ in range(steps):
        x.requires_grad_(True)
        g = torch.autograd.grad(model(x).sum(), x)[0]
        x = x - step_size / 2 * g + noise * math.sqrt(step_size) * torch.randn_like(x)
        x = (x.clamp(-1.0, 1.0) if clamp else x).detach()
    for p in model.parameters():
        p.requires_grad_(True)
    return x


def sample_jem(model, x, steps: int = 10, step_size: float = 1.0, noise: float = 0.01):
    """JEM's SGLD: ``x_k.data += lr * f'(x_k) + std * randn`` on one tensor requiring grad
    (f = -E, the log-density), its gradient from ``autograd.grad``."""
    x.requires_grad_(True)
    for _ in range(steps):
        g = torch.autograd.grad(model(x).sum(), x)[0]
        x.data += -step_size * g + noise * torch.randn_like(x)
    return x.detach()


class ReplayBuffer:
    """Past samples; each chain restarts from uniform noise with probability ``reinit``."""

    def __init__(self, n: int = 64, d: int = D, reinit: float = 0.05, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.data = torch.rand(n, d, generator=self.g) * 2 - 1
        self.reinit = reinit

    def sample(self, k: int):
        idx = torch.randint(0, len(self.data), (k,), generator=self.g)
        x = self.data[idx]
        fresh = torch.rand(k, generator=self.g) < self.reinit
        x[fresh] = torch.rand(int(fresh.sum()), x.shape[1], generator=self.g) * 2 - 1
        return x, idx

    def push(self, idx, x):
        self.data[idx] = x.detach()


def cd_loss(e_pos, e_neg, alpha: float = 0.1):
    """Contrastive divergence with IGEBM's energy regularisation."""
    return e_pos.mean() - e_neg.mean() + alpha * (e_pos ** 2 + e_neg ** 2).mean()


def ebm_data(g: torch.Generator, n: int = 16, d: int = D):
    """A two-mode mixture in [-1, 1]^d."""
    centre = torch.where(torch.rand(n, 1, generator=g) < 0.5, -0.5, 0.5)
    return (centre + 0.1 * torch.randn(n, d, generator=g)).clamp(-1, 1)


# ---------------------------------------------------------------------------------------------
# deep equilibrium layer


def anderson(f, x0, m: int = 4, lam: float = 1e-4, max_iter: int = 20, tol: float = 1e-4,
             beta: float = 1.0):
    """locuslab/deq's Anderson acceleration, batched over the samples (``x0``: (B, n))."""
    bsz, n = x0.shape
    X = torch.zeros(bsz, m, n, dtype=x0.dtype)
    F = torch.zeros(bsz, m, n, dtype=x0.dtype)
    X[:, 0], F[:, 0] = x0, f(x0)
    X[:, 1], F[:, 1] = F[:, 0], f(F[:, 0])
    H = torch.zeros(bsz, m + 1, m + 1, dtype=x0.dtype)
    H[:, 0, 1:] = H[:, 1:, 0] = 1
    y = torch.zeros(bsz, m + 1, 1, dtype=x0.dtype)
    y[:, 0] = 1
    k = 1
    for k in range(2, max_iter):
        k_ = min(k, m)
        G = F[:, :k_] - X[:, :k_]
        H[:, 1:k_ + 1, 1:k_ + 1] = torch.bmm(G, G.transpose(1, 2)) + lam * torch.eye(k_)[None]
        alpha = torch.linalg.solve(H[:, :k_ + 1, :k_ + 1], y[:, :k_ + 1])[:, 1:k_ + 1, 0]
        X[:, k % m] = beta * (alpha[:, None] @ F[:, :k_])[:, 0] \
            + (1 - beta) * (alpha[:, None] @ X[:, :k_])[:, 0]
        F[:, k % m] = f(X[:, k % m])
        res = (F[:, k % m] - X[:, k % m]).norm() / (1e-5 + F[:, k % m].norm())
        if res < tol:
            break
    return X[:, k % m]


def naive(f, x0, max_iter: int = 30, tol: float = 1e-4):
    z = x0
    for _ in range(max_iter):
        z_next = f(z)
        if (z_next - z).norm() < tol * (1e-5 + z_next.norm()):
            return z_next
        z = z_next
    return z


class DEQCell(nn.Module):
    """f(z, x) = tanh(W z + U x), the implicit-layers tutorial's TanhFixedPointLayer with a
    linear input injection."""

    def __init__(self, d: int = D, h: int = 16, scale: float = 0.3, inj: float = 1.0,
                 act: str = "tanh"):
        super().__init__()
        self.act = torch.tanh if act == "tanh" else torch.relu
        self.W = nn.Linear(h, h, bias=False)
        self.U = nn.Linear(d, h, bias=False)
        with torch.no_grad():
            self.W.weight.mul_(scale)
            self.U.weight.mul_(inj)

    def forward(self, z, x):
        return self.act(self.W(z) + self.U(x))


class DEQ(nn.Module):
    """locuslab/deq's DEQFixedPoint: the solve under no_grad, one differentiable f call, the
    implicit backward by a hook on its output."""

    def __init__(self, d: int = D, h: int = 16, classes: int = 3, solver: str = "anderson",
                 scale: float = 0.3, inj: float = 1.0, lam: float = 1e-4, b_iter: int = 30,
                 act: str = "tanh", f_iter: int = 30):
        super().__init__()
        self.f = DEQCell(d, h, scale, inj, act)
        self.head = nn.Linear(h, classes)
        self.h, self.solver, self.lam = h, solver, lam
        self.b_iter, self.f_iter = b_iter, f_iter

    def solve(self, f, z0):
        if self.solver == "anderson":
            return anderson(f, z0, lam=self.lam)
        return naive(f, z0, self.f_iter)

    def forward(self, x):
        with torch.no_grad():
            z = self.solve(lambda z: self.f(z, x), torch.zeros(x.shape[0], self.h))
        z = self.f(z, x)  # re-engage the tape at the fixed point
        if self.training:
            z0 = z.clone().detach().requires_grad_()
            f0 = self.f(z0, x)

            def backward_hook(grad):
                g = grad
                for _ in range(self.b_iter):  # g = Jᵀ g + grad by fixed-point iteration
                    g = torch.autograd.grad(f0, z0, g, retain_graph=True)[0] + grad
                return g

            z.register_hook(backward_hook)
        return self.head(z)


def make_deq(**kw) -> DEQ:
    torch.manual_seed(0)
    return DEQ(**kw)


def deq_data(g: torch.Generator, n: int = 16, d: int = D, classes: int = 3):
    x = torch.randn(n, d, generator=g)
    return x, torch.randint(0, classes, (n,), generator=g)
