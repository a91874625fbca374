"""Bayesian optimisation with BoTorch 0.18.1 over GPyTorch 1.15.2, written as its users write it:
``SingleTaskGP`` / ``MixedSingleTaskGP`` with ``Normalize`` and ``Standardize``, an
``ExactMarginalLogLikelihood`` fitted with ``fit_gpytorch_mll`` (scipy's L-BFGS-B through
BoTorch's closures: no torch optimizer) or with a hand-written Adam loop, acquisition functions
optimised with ``optimize_acqf`` in a loop that refits each round, and a deep-kernel model (an
MLP feature extractor into a GP) trained with Adam.

GPyTorch's modules run ``forward`` without torch's hooks, so the step is a torch module holding
the model and the MLL (``GPStep``: ``-mll(model(x), y)``), and ``fit_gpytorch_mll`` is given a
closure over it (``step_closure``). ExactGP holds its training data, so each factory builds the
data too (seeded: the replay conditions on the points the run did)."""

from __future__ import annotations

import math

import gpytorch
import torch
from botorch.acquisition import (
    LogExpectedImprovement,
    UpperConfidenceBound,
    qLogNoisyExpectedImprovement,
)
from botorch.fit import fit_gpytorch_mll
from botorch.models import MixedSingleTaskGP, SingleTaskGP
from botorch.models.transforms.input import Normalize
from botorch.models.transforms.outcome import Standardize
from botorch.optim import optimize_acqf
from botorch.optim.closures import ForwardBackwardClosure
from botorch.sampling import SobolQMCNormalSampler
from gpytorch.mlls import ExactMarginalLogLikelihood
from torch import nn

BOUNDS = torch.tensor([[0.0, 0.0, 0.0], [10.0, 5.0, 1.0]], dtype=torch.float64)


def branin_like(x: torch.Tensor) -> torch.Tensor:
    """A smooth test objective over ``BOUNDS`` (a Branin-shaped bowl with a third, weak input)."""
    a, b, c = x[..., 0] / 10, x[..., 1] / 5, x[..., 2]
    return -((b - 5.1 / (4 * math.pi ** 2) * (15 * a - 5) ** 2 + 5 / math.pi * (15 * a - 5) - 6)
             ** 2 / 50 + 10 * (1 - 1 / (8 * math.pi)) * torch.cos(15 * a - 5) / 10 + 0.3 * c)


def initial_data(n=12, *, seed=0, dtype="float64", duplicates=0, bad_obs=None, scale=1.0):
    """A Sobol-like random design over ``BOUNDS`` and its observations. ``duplicates``: the first
    points evaluated again at the end (a re-submitted trial, same value); ``bad_obs``: a
    ``{row: value}`` of observations the evaluation returned broken (NaN, inf); ``scale``: the
    outcome's unit (a cost in raw currency)."""
    g, dtype = torch.Generator().manual_seed(seed), getattr(torch, dtype)
    lo, hi = BOUNDS.to(dtype)
    x = lo + (hi - lo) * torch.rand(n, 3, generator=g, dtype=dtype)
    y = (branin_like(x) * scale).unsqueeze(-1)
    if duplicates:
        x, y = torch.cat([x, x[:duplicates]]), torch.cat([y, y[:duplicates]])
    for row, value in (bad_obs or {}).items():  # (JSON keys and values: "5": "inf")
        y[int(row)] = float(value)
    return x, y


class GPStep(nn.Module):
    """The training loss as a torch module: ``-mll(model(x), y)``, so the recorder sees it."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.mll = ExactMarginalLogLikelihood(model.likelihood, model)

    def forward(self, x, y):
        return -self.mll(self.model(x), y)


def train_batch(step: GPStep):
    """The model's own training inputs and (transformed) targets, as ``fit_gpytorch_mll``
    gives them to the MLL."""
    return step.model.train_inputs[0], step.model.train_targets


def step_closure(step: GPStep) -> ForwardBackwardClosure:
    """``fit_gpytorch_mll(mll, closure=...)``'s closure running the recorded module."""
    x, y = train_batch(step)
    params = {n: p for n, p in step.mll.named_parameters() if p.requires_grad}
    return ForwardBackwardClosure(forward=lambda: step(x, y), parameters=params)


def make_stgp(n=12, *, dtype="float64", duplicates=0, bad_obs=None, scale=1.0,
              standardize=True, noise_floor=None, ls_prior=None, bounds=None):
    """A ``SingleTaskGP`` over ``initial_data(...)`` with ``Normalize`` (over ``bounds``,
    default ``BOUNDS``) and ``Standardize``; ``noise_floor`` the likelihood's noise constraint
    (``GreaterThan``), ``ls_prior`` the lengthscale prior."""
    torch.manual_seed(0)
    x, y = initial_data(n, dtype=dtype, duplicates=duplicates, bad_obs=bad_obs, scale=scale)
    kw = {}
    if noise_floor is not None:
        kw["likelihood"] = gpytorch.likelihoods.GaussianLikelihood(
            noise_constraint=gpytorch.constraints.GreaterThan(noise_floor))
    if ls_prior is not None:  # (concentration, rate) of a Gamma prior on the lengthscales
        kw["covar_module"] = gpytorch.kernels.RBFKernel(
            ard_num_dims=3, lengthscale_prior=gpytorch.priors.GammaPrior(*ls_prior))
    b = BOUNDS if bounds is None else torch.as_tensor(bounds, dtype=torch.float64)
    model = SingleTaskGP(x, y, input_transform=Normalize(d=3, bounds=b.to(x.dtype)),
                         outcome_transform=Standardize(m=1) if standardize else None, **kw)
    if noise_floor is not None:
        model.likelihood.noise = 2 * noise_floor
    return GPStep(model)


def make_mixed(n=16, *, bad_obs=None):
    """A ``MixedSingleTaskGP``: two continuous inputs and a categorical one (3 levels)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    x = torch.rand(n, 3, generator=g, dtype=torch.float64)
    x[:, 2] = torch.randint(0, 3, (n,), generator=g).double()
    y = (torch.sin(6 * x[:, 0]) + x[:, 1] + 0.5 * x[:, 2]).unsqueeze(-1)
    for row, value in (bad_obs or {}).items():
        y[row] = value
    model = MixedSingleTaskGP(x, y, cat_dims=[2], outcome_transform=Standardize(m=1))
    return GPStep(model)


class FeatureExtractor(nn.Sequential):
    def __init__(self, d_in=3, d_hidden=16, d_out=2):
        super().__init__(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_hidden),
                         nn.ReLU(), nn.Linear(d_hidden, d_out))


class DKLGP(gpytorch.models.ExactGP):
    """Deep kernel learning (GPyTorch's DKL tutorial): an MLP's features, scaled to [-1, 1] by
    ``ScaleToBounds``, into a scaled RBF kernel."""

    def __init__(self, x, y, likelihood, d_out=2):
        super().__init__(x, y, likelihood)
        self.feature_extractor = FeatureExtractor(x.shape[-1], d_out=d_out)
        self.scale_to_bounds = gpytorch.utils.grid.ScaleToBounds(-1.0, 1.0)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        z = self.scale_to_bounds(self.feature_extractor(x))
        return gpytorch.distributions.MultivariateNormal(self.mean_module(z),
                                                         self.covar_module(z))


def make_dkl(n=32, *, dead_bias=None, d_out=2):
    """A DKL GP on ``n`` normalised points (float32, as the tutorial). ``dead_bias``: the hidden
    layers' bias initialised to that value (a "dead ReLU" init)."""
    torch.manual_seed(0)
    x, y = initial_data(n, dtype="float32")
    lo, hi = BOUNDS.float()
    x = (x - lo) / (hi - lo)
    y = (y[:, 0] - y.mean()) / y.std()
    model = DKLGP(x, y, gpytorch.likelihoods.GaussianLikelihood(), d_out=d_out)
    if dead_bias is not None:
        for layer in (model.feature_extractor[0], model.feature_extractor[2]):
            nn.init.constant_(layer.bias, dead_bias)
    return GPStep(model)


def bo_loop(rounds=3, *, record=None):
    """A BO loop that refits each round: a ``SingleTaskGP`` fitted with ``fit_gpytorch_mll``
    (through ``step_closure``; under ``record(step)``, a context manager such as a
    ``FlightRecorder``, when given), then LogEI, qLogNEI (BoTorch's advised form of qNEI) and
    UCB in turn optimised with ``optimize_acqf`` over ``BOUNDS``, the candidate evaluated and
    appended. Returns the data."""
    x, y = initial_data(8)
    for r in range(rounds):
        torch.manual_seed(r)
        step = GPStep(SingleTaskGP(x, y, input_transform=Normalize(d=3, bounds=BOUNDS),
                                   outcome_transform=Standardize(m=1)))
        if record is None:
            fit_gpytorch_mll(step.mll, closure=step_closure(step))
        else:
            with record(step):
                fit_gpytorch_mll(step.mll, closure=step_closure(step))
        model = step.model
        acqf = (LogExpectedImprovement(model, best_f=y.max()) if r % 3 == 0 else
                qLogNoisyExpectedImprovement(model, X_baseline=x, prune_baseline=False,
                                          sampler=SobolQMCNormalSampler(torch.Size([32]), seed=r))
                if r % 3 == 1 else UpperConfidenceBound(model, beta=0.2))
        cand, _ = optimize_acqf(acqf, bounds=BOUNDS, q=1, num_restarts=2, raw_samples=16,
                                options={"maxiter": 20})
        x, y = torch.cat([x, cand]), torch.cat([y, branin_like(cand).unsqueeze(-1)])
    return x, y
