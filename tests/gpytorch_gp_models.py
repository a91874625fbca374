"""Gaussian-process regression with the real GPyTorch library (gpytorch 1.15.2): exact GPs
(``ExactGP`` with ``ScaleKernel(RBFKernel)`` or ``MaternKernel``), a deep kernel (an MLP feature
extractor before the kernel), and an SVGP (``VariationalStrategy`` + ``VariationalELBO``).

ExactGP holds its training data, so every factory here builds the data too (seeded: the replay's
model conditions on the same points the run's did)."""

from __future__ import annotations

import math

import gpytorch
import torch
from torch import nn


def regression_data(n=24, *, seed=0, duplicates=0, nan_target=None, scale=1.0):
    """``y = sin(2 pi x) + noise`` on ``n`` points of ``[0, 1]``; the first ``duplicates`` points
    are repeated at the end (a logger that wrote the same reading twice), ``nan_target`` is an
    index whose target is NaN (a missing reading)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g) * scale
    y = torch.sin(2 * math.pi * x[:, 0] / scale) + 0.1 * torch.randn(n, generator=g)
    if duplicates:
        x = torch.cat([x, x[:duplicates]])
        y = torch.cat([y, y[:duplicates]])
    if nan_target is not None:
        y = y.clone()
        y[nan_target] = float("nan")
    return x, y


class ExactGPModel(gpytorch.models.ExactGP):
    """The GPyTorch tutorial's exact GP: constant mean, scaled RBF (or Matern 5/2) kernel."""

    def __init__(self, train_x, train_y, likelihood, kernel="rbf"):
        super().__init__(train_x, train_y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        base = (gpytorch.kernels.MaternKernel(nu=2.5) if kernel == "matern"
                else gpytorch.kernels.RBFKernel())
        self.covar_module = gpytorch.kernels.ScaleKernel(base)

    def forward(self, x):
        mean_x = self.mean_module(x)
        covar_x = self.covar_module(x)
        return gpytorch.distributions.MultivariateNormal(mean_x, covar_x)


def make_exact(n=24, duplicates=0, nan_target=None, noise_floor=None, kernel="rbf",
               scale=1.0, lengthscale=None, outputscale=None):
    """An exact GP over ``regression_data(...)``; ``noise_floor`` lowers the likelihood's noise
    constraint (``GreaterThan(noise_floor)``, gpytorch's default is 1e-4)."""
    x, y = regression_data(n, duplicates=duplicates, nan_target=nan_target, scale=scale)
    constraint = None if noise_floor is None else gpytorch.constraints.GreaterThan(noise_floor)
    likelihood = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=constraint)
    model = ExactGPModel(x, y, likelihood, kernel=kernel)
    if noise_floor is not None:
        likelihood.noise = noise_floor * 2
    if lengthscale is not None:
        model.covar_module.base_kernel.lengthscale = lengthscale
    if outputscale is not None:
        model.covar_module.outputscale = outputscale
    return model


class FeatureExtractor(nn.Sequential):
    def __init__(self, d_in=4, d_hidden=16, d_out=2):
        super().__init__(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))


class DKLModel(gpytorch.models.ExactGP):
    """Deep kernel learning: an MLP maps the inputs to 2 features, scaled to [-1, 1], before a
    scaled RBF kernel (GPyTorch's DKL tutorial)."""

    def __init__(self, train_x, train_y, likelihood):
        super().__init__(train_x, train_y, likelihood)
        self.feature_extractor = FeatureExtractor(train_x.shape[-1])
        self.scale_to_bounds = gpytorch.utils.grid.ScaleToBounds(-1.0, 1.0)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        z = self.scale_to_bounds(self.feature_extractor(x))
        return gpytorch.distributions.MultivariateNormal(self.mean_module(z),
                                                         self.covar_module(z))


def dkl_data(n=32, *, seed=1, blank_rows=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.sin(x[:, 0]) + 0.5 * x[:, 1] + 0.05 * torch.randn(n, generator=g)
    for r in blank_rows:
        x[r] = float("inf")
    return x, y


def make_dkl(n=32, blank_rows=()):
    torch.manual_seed(0)
    x, y = dkl_data(n, blank_rows=tuple(blank_rows))
    return DKLModel(x, y, gpytorch.likelihoods.GaussianLikelihood())


class SVGPModel(gpytorch.models.ApproximateGP):
    """A sparse variational GP: 16 learned inducing points, Cholesky variational distribution."""

    def __init__(self, inducing_points):
        dist = gpytorch.variational.CholeskyVariationalDistribution(inducing_points.size(0))
        strategy = gpytorch.variational.VariationalStrategy(
            self, inducing_points, dist, learn_inducing_locations=True)
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x),
                                                         self.covar_module(x))


def svgp_data(n=256, *, seed=2, nan_rows=()):
    x, y = regression_data(n, seed=seed)
    for r in nan_rows:
        y[r] = float("nan")
    return x, y


def make_svgp(m=16):
    torch.manual_seed(0)
    return SVGPModel(torch.linspace(0, 1, m).unsqueeze(-1))


class NegativeMLL(nn.Module):
    """The training step's loss as a torch module: ``-mll(model(x), y)``. GPyTorch's modules are
    called through ``gpytorch.Module.__call__``, which runs ``forward`` without torch's module
    hooks; the recorder is given this wrapper, whose call it sees."""

    def __init__(self, model, mll_class=gpytorch.mlls.ExactMarginalLogLikelihood, **mll_kw):
        super().__init__()
        self.model = model
        self.mll = mll_class(model.likelihood, model, **mll_kw)

    def forward(self, x, y):
        return -self.mll(self.model(x), y)


def make_exact_step(**kw):
    return NegativeMLL(make_exact(**kw))


def make_exp_scale_step(y_scale=1e3):
    """An exact GP whose outputscale is constrained positive through ``exp`` (a log-scale
    parameterisation, instead of gpytorch's softplus), on targets left in their raw units.
    Trained with Adam at lr=30, the raw lengthscale is driven far below 0 (the lengthscale to
    ~1e-21), and the kernel's ``x / lengthscale`` squared overflows float32."""
    x, y = regression_data(24)
    model = ExactGPModel(x, y * y_scale, gpytorch.likelihoods.GaussianLikelihood())
    model.covar_module = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.RBFKernel(),
        outputscale_constraint=gpytorch.constraints.Positive(transform=torch.exp,
                                                            inv_transform=torch.log))
    return NegativeMLL(model)


def make_dkl_step(**kw):
    return NegativeMLL(make_dkl(**kw))


def make_svgp_step(n_data=256):
    model = make_svgp()
    model.likelihood = gpytorch.likelihoods.GaussianLikelihood()
    return NegativeMLL(model, gpytorch.mlls.VariationalELBO, num_data=n_data)


class LaplaceKernel(gpytorch.kernels.Kernel):
    """A user-written exponential (Laplace, Matern 1/2) kernel ``exp(-|x - x'| / l)``: the
    distance as ``sqrt`` of the summed squares, with no floor under it (gpytorch's own
    ``covar_dist`` clamps it), so its derivative is 0 * inf = NaN on the diagonal."""

    has_lengthscale = True

    def forward(self, x1, x2, diag=False, **params):
        diff = (x1.unsqueeze(-2) - x2.unsqueeze(-3)) / self.lengthscale.unsqueeze(-2)
        dist = diff.pow(2).sum(-1).sqrt()  # the bug: sqrt(0) on the diagonal, inf derivative
        covar = torch.exp(-dist)
        return covar.diagonal(dim1=-2, dim2=-1) if diag else covar


class LaplaceGP(gpytorch.models.ExactGP):
    def __init__(self, train_x, train_y, likelihood):
        super().__init__(train_x, train_y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(LaplaceKernel())

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x),
                                                         self.covar_module(x))


def make_laplace_step(n=20):
    x, y = regression_data(n)
    return NegativeMLL(LaplaceGP(x, y, gpytorch.likelihoods.GaussianLikelihood()))
