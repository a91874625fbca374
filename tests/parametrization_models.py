"""Small models under PyTorch's parametrizations, as training code builds them
(``test_parametrizations``):

- ``make_weight_norm``: an MLP whose first layer is under the new
  ``torch.nn.utils.parametrizations.weight_norm`` (``original0`` the magnitude g,
  ``original1`` the direction v; the weight is ``g * v / |v|`` row by row);
- ``make_old_weight_norm``: the same under the old hook-based ``torch.nn.utils.weight_norm``
  (``weight_g``, ``weight_v``, a forward pre-hook);
- ``make_discriminator``: a GAN discriminator under ``parametrizations.spectral_norm``
  (``make_old_discriminator``: under the hook-based ``nn.utils.spectral_norm``);
- ``make_orthogonal``: a classifier whose square hidden layer is kept orthogonal;
- ``make_variance_net``: a heteroscedastic regressor whose variance is the user's own
  positivity parametrization, ``exp`` of an unconstrained parameter;
- ``make_symmetric``: a layer whose weight the user keeps symmetric (``X.triu() + X.triu(1).T``).

All are ``nn.Sequential``s of torch's modules except the variance net (a user class).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

D_IN, HIDDEN, N_CLASSES = 8, 16, 3


def make_weight_norm() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(parametrizations.weight_norm(nn.Linear(D_IN, HIDDEN)), nn.ReLU(),
                         nn.Linear(HIDDEN, N_CLASSES))


def make_old_weight_norm() -> nn.Sequential:
    torch.manual_seed(0)
    with warnings.catch_warnings():  # (deprecated in favour of parametrizations.weight_norm)
        warnings.simplefilter("ignore", FutureWarning)
        first = nn.utils.weight_norm(nn.Linear(D_IN, HIDDEN))
    return nn.Sequential(first, nn.ReLU(), nn.Linear(HIDDEN, N_CLASSES))


def make_discriminator() -> nn.Sequential:
    torch.manual_seed(0)
    sn = parametrizations.spectral_norm
    return nn.Sequential(sn(nn.Linear(D_IN, HIDDEN)), nn.LeakyReLU(0.2),
                         sn(nn.Linear(HIDDEN, 1)))


def make_old_discriminator() -> nn.Sequential:
    """The discriminator under the hook-based ``nn.utils.spectral_norm`` (``weight_orig``,
    ``weight_u``, ``weight_v``, a forward pre-hook)."""
    torch.manual_seed(0)
    sn = nn.utils.spectral_norm
    return nn.Sequential(sn(nn.Linear(D_IN, HIDDEN)), nn.LeakyReLU(0.2),
                         sn(nn.Linear(HIDDEN, 1)))


def make_orthogonal() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(),
                         parametrizations.orthogonal(nn.Linear(HIDDEN, HIDDEN)), nn.Tanh(),
                         nn.Linear(HIDDEN, N_CLASSES))


class Exp(nn.Module):
    """A positivity parametrization: the model sees ``exp(original)``."""

    def forward(self, x):
        return torch.exp(x)

    def right_inverse(self, v):
        return torch.log(v)


class Symmetric(nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


class VarianceNet(nn.Module):
    """A mean head and a learned per-output variance ``var`` (``exp`` of its parameter)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh())
        self.mean = nn.Linear(HIDDEN, 1)
        self.noise = nn.Module()
        self.noise.var = nn.Parameter(torch.ones(1))
        parametrize.register_parametrization(self.noise, "var", Exp())

    def forward(self, x):
        mu = self.mean(self.body(x)).squeeze(-1)
        return mu, self.noise.var.expand_as(mu)


def make_variance_net() -> VarianceNet:
    torch.manual_seed(0)
    return VarianceNet()


def make_symmetric() -> nn.Sequential:
    torch.manual_seed(0)
    sym = nn.Linear(HIDDEN, HIDDEN)
    parametrize.register_parametrization(sym, "weight", Symmetric())
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), sym, nn.ReLU(),
                         nn.Linear(HIDDEN, N_CLASSES))
