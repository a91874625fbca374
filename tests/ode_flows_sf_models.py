"""Continuous-time and density models written with the domain's own libraries, as their users
write them: torchdiffeq 0.2.5 (``odeint`` with ``dopri5``/``rk4``, ``odeint_adjoint``), zuko
1.6.0 (``zuko.flows.NSF``/``MAF``, conditional flows trained by maximum likelihood) and
schedulefree 1.4.1 (``AdamWScheduleFree``/``SGDScheduleFree``, their ``train()``/``eval()``
swaps of the weights outside ``step()``).

- ``ODEClassifier``: a neural ODE classifier (encoder, an ``ODEBlock`` solving ``dh/dt =
  f(h)`` on [0, 1] with ``dopri5`` and rtol/atol, a linear head), cross entropy.
- ``GrowthODE``: a population model whose learned growth rate multiplies ``y²`` (a
  Riccati term): a record of out-of-scale density blows up within the horizon.
- ``RadialAdjointODE``: ``odeint_adjoint`` over a field scaled by the state's radius
  ``sqrt(sum y²)``; the backward solves the adjoint ODE, calling the field's vjp again.
- ``flow_nsf``/``flow_maf``/``flow_cnf``: zuko's conditional flows (the CNF an adaptive
  solve under zuko's own adjoint); ``nll(dist, x)`` the maximum likelihood loss on the
  distribution the flow returns.
- ``LogitFlow``: a Glow/RealNVP-style image-density flow: dequantised pixels through the logit
  preprocessing ``log(x) - log(1 - x)``, then a zuko MAF on the logits.
- ``iwae_nll``: a mixture of a conditional flow's densities over K context draws, averaged as
  densities (``exp(log_prob).mean()``) rather than in log space.
"""

from __future__ import annotations

import math

import torch
import zuko
from torch import nn
from torchdiffeq import odeint, odeint_adjoint

# ---------------------------------------------------------------- neural ODE classifier


class ODEFunc(nn.Module):
    """``dh/dt = f(t, h)``: the tanh MLP of torchdiffeq's ``odenet_mnist`` (without convs)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)
        self.nfe = 0

    def forward(self, t, h):
        self.nfe += 1
        return self.fc2(torch.tanh(self.fc1(h)))


class ODEBlock(nn.Module):
    def __init__(self, func: nn.Module, method: str = "dopri5", rtol: float = 1e-3,
                 atol: float = 1e-4):
        super().__init__()
        self.func = func
        self.method, self.rtol, self.atol = method, rtol, atol
        self.register_buffer("t", torch.tensor([0.0, 1.0]))

    def forward(self, h):
        return odeint(self.func, h, self.t, method=self.method, rtol=self.rtol,
                      atol=self.atol)[-1]


class ODEClassifier(nn.Module):
    def __init__(self, features: int = 8, dim: int = 16, classes: int = 3):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, dim), nn.Tanh())
        self.ode = ODEBlock(ODEFunc(dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.ode(self.encoder(x)))


def make_classifier() -> nn.Module:
    torch.manual_seed(0)
    return ODEClassifier()


def classification_data(n: int = 64, features: int = 8, classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, :classes].argmax(1)).long()
    return x, y


# ---------------------------------------------------------------- growth ODE (Riccati term)


class GrowthField(nn.Module):
    """``dy/dt = r y² - d y + g(y)``: births proportional to encounters (``y²``), deaths, and
    a learned correction. For ``y0 > d / r`` the exact solution blows up at a finite time."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.log_r = nn.Parameter(torch.full((dim,), math.log(0.5)))
        self.log_d = nn.Parameter(torch.zeros(dim))
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, dim))

    def forward(self, t, y):
        return self.log_r.exp() * y * y - self.log_d.exp() * y + 0.1 * self.net(y)


class GrowthODE(nn.Module):
    """Populations ``y0`` (per species) followed to ``t = 1`` with a fixed-step RK4 (the
    torchdiffeq option ``step_size``), the end state regressed on the census."""

    def __init__(self, dim: int = 4, method: str = "rk4"):
        super().__init__()
        self.field = GrowthField(dim)
        self.method = method
        self.register_buffer("t", torch.tensor([0.0, 1.0]))

    def forward(self, y0):
        if self.method == "rk4":
            return odeint(self.field, y0, self.t, method="rk4", options={"step_size": 0.05})[-1]
        return odeint(self.field, y0, self.t, method="dopri5", rtol=1e-4, atol=1e-6)[-1]


def make_growth() -> nn.Module:
    torch.manual_seed(0)
    return GrowthODE()


def make_growth_adaptive() -> nn.Module:
    torch.manual_seed(0)
    return GrowthODE(method="dopri5")


def growth_data(n: int = 32, dim: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y0 = torch.rand(n, dim, generator=g) * 0.5
    return y0, y0 * 0.8


# ---------------------------------------------------------------- adjoint ODE, radial field


class RadialField(nn.Module):
    """A field that turns the state and scales it by its radius: ``f(y) = r · W y`` with
    ``r = sqrt(sum y²)``, the speed proportional to the distance from the origin."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=False)

    def forward(self, t, y):
        r = torch.sqrt((y * y).sum(-1, keepdim=True))
        return -r * self.lin(y)


class RadialAdjointODE(nn.Module):
    """The adjoint method (Chen et al.): no graph through the solver, the backward solves the
    augmented adjoint ODE with the field's vjp."""

    def __init__(self, features: int = 6, dim: int = 4):
        super().__init__()
        self.encoder = nn.Linear(features, dim, bias=False)
        self.field = RadialField(dim)
        self.register_buffer("t", torch.tensor([0.0, 0.5]))

    def forward(self, x):
        y0 = self.encoder(x)
        return odeint_adjoint(self.field, y0, self.t, method="rk4",
                              options={"step_size": 0.1})[-1]


def make_adjoint() -> nn.Module:
    torch.manual_seed(0)
    return RadialAdjointODE()


def adjoint_data(n: int = 16, features: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return x, 0.5 * x[:, :4]


# ---------------------------------------------------------------- zuko flows


def flow_nsf() -> nn.Module:
    torch.manual_seed(0)
    return zuko.flows.NSF(features=3, context=2, transforms=2, hidden_features=(32, 32))


def flow_maf() -> nn.Module:
    torch.manual_seed(0)
    return zuko.flows.MAF(features=3, context=2, transforms=2, hidden_features=(32, 32))


def nll(dist, x):
    """Maximum likelihood: the mean negative log-density of the data under the flow."""
    return -dist.log_prob(x).mean()


def flow_data(n: int = 64, seed: int = 0):
    """(x, c): a 3-d target whose mean and scale depend on a 2-d context."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(n, 2, generator=g)
    x = torch.randn(n, 3, generator=g) * (0.5 + c[:, :1].abs()) + c.sum(1, keepdim=True)
    return x, c


class FlowDataset(torch.utils.data.Dataset):
    def __init__(self, x, c):
        self.x, self.c = x, c

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.c[i]


# ---------------------------------------------------------------- logit-space image flow


class LogitFlow(nn.Module):
    """Dequantised 8-bit pixels ``(x + u) / 256`` squeezed into ``[a, 1 - a]`` and mapped
    through the logit (RealNVP's preprocessing), a zuko MAF on the logits; returns the
    log-density of the pixels in bits per dimension's numerator (nats, per sample)."""

    def __init__(self, pixels: int = 4, alpha: float = 0.05):
        super().__init__()
        self.alpha = alpha
        self.flow = zuko.flows.MAF(features=pixels, transforms=2, hidden_features=(16,))

    def forward(self, x, u):
        a = self.alpha
        p = a + (1 - 2 * a) * (x + u) / 256.0
        logit = torch.log(p) - torch.log(1 - p)
        # log |d logit / d x| = log(1 - 2a) - log 256 - log p - log(1 - p)
        ldj = (math.log(1 - 2 * a) - math.log(256.0) - torch.log(p) - torch.log(1 - p)).sum(-1)
        return self.flow().log_prob(logit) + ldj


def make_logit_flow() -> nn.Module:
    torch.manual_seed(0)
    return LogitFlow()


def make_logit_flow_unsqueezed() -> nn.Module:
    """The logit of the dequantised pixels themselves, ``alpha = 0``."""
    torch.manual_seed(0)
    return LogitFlow(alpha=0.0)


def pixel_data(n: int = 32, pixels: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, pixels), generator=g).float()
    u = torch.rand(n, pixels, generator=g)
    return x, u


def mean_nll(log_px):
    return -log_px.mean()


# ---------------------------------------------------------------- density mixture (IWAE)


def mixture_nll(dist, x):
    """-log of the flow's density averaged over the K context draws (dim 0) — in density
    space: ``exp(log_prob)`` then ``mean`` then ``log`` (logsumexp would keep it finite)."""
    lp = dist.log_prob(x)  # (K, B)
    return -torch.log(lp.exp().mean(0)).mean()


class ContextDraws(nn.Module):
    """A conditional NSF whose context is an encoder's Gaussian, drawn K times (the flow
    returns the distribution over x for each draw, batch shape (K, B))."""

    def __init__(self, k: int = 4):
        super().__init__()
        self.k = k
        self.enc = nn.Linear(2, 4)
        self.flow = zuko.flows.NSF(features=3, context=2, transforms=2, hidden_features=(16,))

    def forward(self, c):
        mu, log_sigma = self.enc(c).chunk(2, -1)
        eps = torch.randn((self.k, *mu.shape), dtype=mu.dtype)
        return self.flow(mu + log_sigma.exp() * eps)


def make_context_draws() -> nn.Module:
    torch.manual_seed(0)
    return ContextDraws()


def flow_cnf() -> nn.Module:
    """zuko's continuous normalising flow (FFJORD): an adaptive solver with its own adjoint,
    the exact log-determinant by autograd inside the field's solve."""
    torch.manual_seed(0)
    return zuko.flows.CNF(features=3, context=2, hidden_features=(16, 16))


class FlowMixture(nn.Module):
    """Two conditional NSFs mixed by learned weights normalised by their sum (not a softmax):
    ``p(x|c) = sum_k w_k p_k(x|c) / sum_k w_k``, returned as its log per sample."""

    def __init__(self):
        super().__init__()
        self.flows = nn.ModuleList(
            zuko.flows.NSF(features=3, context=2, transforms=1, hidden_features=(16,))
            for _ in range(2))
        self.weights = nn.Parameter(torch.tensor([0.9, 0.1]))

    def forward(self, x, c):
        lp = torch.stack([f(c).log_prob(x) for f in self.flows], -1)  # (B, K)
        w = self.weights / self.weights.sum()
        return torch.log((lp.exp() * w).sum(-1))


def make_flow_mixture() -> nn.Module:
    torch.manual_seed(0)
    return FlowMixture()
