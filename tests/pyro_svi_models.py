"""Stochastic variational inference with Pyro (pyro-ppl 1.9.2) as its users write it.

Pyro's own training loop (``SVI(model, guide, optim, loss=Trace_ELBO()).step(x, y)``) steps a
``pyro.optim`` wrapper, which is no ``torch.optim.Optimizer``; the loop Pyro documents for
PyTorch users ("Using the PyTorch optimizer", the SVI part III tutorial) is the one a recorder
attaches to: ``loss = Trace_ELBO().differentiable_loss(model, guide, x, y); loss.backward();
optimizer.step()`` over the guide's parameters. The model and guide are both modules
(``PyroModule``, ``AutoNormal``), so the module given to the recorder is the pair whose
``forward`` returns the ELBO (:class:`ELBOModule`): its calls reach every pyro site, and its
parameters are the guide's (and any the model learns).

- ``BayesRegression``: the Pyro tutorial's Bayesian linear regression, a ``PyroModule[nn.Linear]``
  with ``PyroSample`` priors on its weight and bias and a learned noise ``sigma``, an AutoNormal
  guide.
- ``CountRegression``: a Poisson GLM (counts of events), the rate ``exp(x @ w)``.
- ``ScaleGuide``: a hand-written mean-field guide with ``PyroParam`` loc and scale, as the
  tutorials' ``pyro.param("scale", ..., constraint=positive)`` (or, planted, no constraint).
- ``VAE``: the Pyro VAE tutorial's model and guide, a decoder network registered with
  ``pyro.module``; its observation noise ``softplus`` of a decoder head.
- ``ShrinkRegression``: a regression whose guide the analytic-KL ELBO
  (``TraceMeanField_ELBO``) compares with a tight prior.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.infer import Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from pyro.nn import PyroModule, PyroParam, PyroSample
from torch import nn
from torch.distributions import constraints

D = 3  # features


class BayesRegression(PyroModule):
    """The tutorial's ``BayesianRegression``: ``y ~ Normal(linear(x), sigma)``."""

    def __init__(self, d: int = D, prior_scale: float = 1.0):
        super().__init__()
        self.linear = PyroModule[nn.Linear](d, 1)
        self.linear.weight = PyroSample(dist.Normal(0., prior_scale).expand([1, d]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(0., 10.).expand([1]).to_event(1))
        self.sigma = PyroParam(torch.tensor(1.0), constraint=constraints.positive)

    def forward(self, x, y=None):
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, self.sigma), obs=y)
        return mean


class CountRegression(PyroModule):
    """A Poisson GLM: ``y ~ Poisson(exp(x @ w + b))``, ``w`` and ``b`` learned point estimates
    (the guide is empty, as ``pyro.param`` regression)."""

    def __init__(self, d: int = D):
        super().__init__()
        self.w = PyroParam(torch.full((d,), 0.1))
        self.b = PyroParam(torch.tensor(0.0))

    def forward(self, x, y=None):
        rate = torch.exp(x @ self.w + self.b)  # the bug: no floor, exp of -120 is 0 in float32
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Poisson(rate), obs=y)
        return rate


class ScaleModel(PyroModule):
    """``z ~ Normal(0, 1)``, ``y ~ Normal(z, 0.5)`` (one latent mean per feature)."""

    def forward(self, x, y=None):
        z = pyro.sample("z", dist.Normal(torch.zeros(x.shape[-1]), 1.).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(z, 0.5).to_event(1), obs=x)
        return z


class ScaleGuide(PyroModule):
    """The tutorials' mean-field guide, ``q(z) = Normal(loc, scale)``; ``positive=False`` is the
    planted bug: the scale learned raw, with nothing keeping it above 0."""

    def __init__(self, d: int = D, positive: bool = True, scale: float = 0.1):
        super().__init__()
        self.loc = PyroParam(torch.zeros(d))
        if positive:
            self.scale = PyroParam(torch.full((d,), scale), constraint=constraints.positive)
        else:
            self.scale = nn.Parameter(torch.full((d,), scale))  # the bug: no constraint

    def forward(self, x, y=None):
        return pyro.sample("z", dist.Normal(self.loc, self.scale).to_event(1))


class VAE(nn.Module):
    """The Pyro VAE tutorial's model and guide, with a Gaussian decoder whose noise is a
    decoder head's ``softplus`` (continuous data)."""

    def __init__(self, d: int = 6, z_dim: int = 2, hidden: int = 8):
        super().__init__()
        self.z_dim = z_dim
        self.decoder = nn.Sequential(nn.Linear(z_dim, hidden), nn.Tanh(), nn.Linear(hidden, 2 * d))
        self.encoder = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 2 * z_dim))

    def model(self, x, y=None):
        pyro.module("decoder", self.decoder)
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(self.z_dim), 1.).to_event(1))
            mu, s = self.decoder(z).chunk(2, -1)
            scale = F.softplus(s)  # the bug: no floor, softplus of -200 is 0
            pyro.sample("x", dist.Normal(mu, scale).to_event(1), obs=x)

    def guide(self, x, y=None):
        pyro.module("encoder", self.encoder)
        with pyro.plate("data", x.shape[0]):
            loc, s = self.encoder(x).chunk(2, -1)
            pyro.sample("z", dist.Normal(loc, torch.exp(0.5 * s)).to_event(1))


class ELBOModule(nn.Module):
    """The model and guide as one module whose ``forward`` is the ELBO Pyro's PyTorch-style loop
    differentiates: ``Trace_ELBO().differentiable_loss(model, guide, x, y)``."""

    def __init__(self, model, guide, elbo=None):
        super().__init__()
        self.model, self.guide = model, guide
        self.elbo = elbo if elbo is not None else Trace_ELBO()

    def forward(self, x, y=None):
        return self.elbo.differentiable_loss(self.model, self.guide, x, y)


class VAEModule(nn.Module):
    """The VAE's ELBO as a module (the networks are the VAE's submodules)."""

    def __init__(self, vae: VAE):
        super().__init__()
        self.vae = vae
        self.elbo = Trace_ELBO()

    def forward(self, x):
        return self.elbo.differentiable_loss(self.vae.model, self.vae.guide, x)


def _init(module: nn.Module, *args) -> nn.Module:
    """Run the guide once under ``torch.no_grad`` so its lazy parameters exist (AutoNormal makes
    them at its first call), as one does before building a torch optimizer over them."""
    pyro.clear_param_store()
    with torch.no_grad():
        module(*args)
    return module


def make_regression(auto: str = "normal", prior_scale: float = 1.0, meanfield: bool = False):
    torch.manual_seed(0)
    model = BayesRegression(prior_scale=prior_scale)
    guide = (AutoNormal if auto == "normal" else AutoDiagonalNormal)(model)
    elbo = TraceMeanField_ELBO() if meanfield else Trace_ELBO()
    x, y = regression_data(4)
    return _init(ELBOModule(model, guide, elbo), x, y)


def make_count():
    torch.manual_seed(0)
    model = CountRegression()
    x, y = count_data(4)
    return _init(ELBOModule(model, lambda x, y=None: None), x, y)


def make_scale(positive: bool = True, scale: float = 0.1):
    torch.manual_seed(0)
    x, _ = regression_data(4)
    return _init(ELBOModule(ScaleModel(), ScaleGuide(positive=positive, scale=scale)), x)


def make_vae():
    torch.manual_seed(0)
    x = vae_data(4)
    return _init(VAEModule(VAE()), x)


def regression_data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.3 + 0.1 * torch.randn(n, generator=g)
    return x, y


def count_data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    y = torch.poisson(torch.exp(x @ torch.tensor([0.3, -0.2, 0.1])), generator=g)
    return x, y


def vae_data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g)
