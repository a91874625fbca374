"""A model built from run-time configuration, as training scripts build theirs: ``train.py``
parses ``--scale`` into ``CONFIG`` and the factory reads it, so a replay in a fresh process
(``CONFIG`` at its default) builds a different model unless the value is handed back to the
factory (``factory_kwargs``)."""

from __future__ import annotations

import replay_models as R
import torch
from torch import nn

CONFIG = {"scale": 1.0, "sqrt_features": True, "hidden": R.HIDDEN}  # set from the command line by train.py


class Scale(nn.Module):
    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, x):
        return x * self.value


class ScaledLogNet(nn.Module):
    """``replay_models.LogNet`` with its hidden features scaled by a configured factor."""

    def __init__(self, scale: float):
        super().__init__()
        self.lin = nn.Linear(R.D_IN, R.HIDDEN)
        self.scale = Scale(scale)
        self.act = R.ShiftedLog()
        self.head = nn.Linear(R.HIDDEN, R.N_CLASSES)

    def forward(self, x):
        return self.head(self.act(self.scale(self.lin(x))))


def make_scaled_net(scale: float | None = None) -> nn.Module:
    """The factory: the scale from the keyword argument, else from the global config."""
    return ScaledLogNet(CONFIG["scale"] if scale is None else scale)


class SqrtFeatures(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)  # NaN for a negative feature: never ran with --no-sqrt-features


class OptionalSqrtNet(nn.Module):
    """``replay_models.LogNet`` with an optional parameter-free feature transform: the same
    parameters either way, another computation."""

    def __init__(self, sqrt_features: bool):
        super().__init__()
        self.use_sqrt = sqrt_features
        self.lin = nn.Linear(R.D_IN, R.HIDDEN)
        self.sqrt = SqrtFeatures()
        self.act = R.ShiftedLog()
        self.head = nn.Linear(R.HIDDEN, R.N_CLASSES)

    def forward(self, x):
        h = self.lin(x)
        if self.use_sqrt:
            h = self.sqrt(h)
        return self.head(self.act(h))


def make_optional_sqrt_net(sqrt_features: bool | None = None) -> nn.Module:
    return OptionalSqrtNet(CONFIG["sqrt_features"] if sqrt_features is None else sqrt_features)


class WideLogNet(nn.Module):
    """``replay_models.LogNet`` with a configured hidden width (``--hidden``): another width
    gives parameters of other shapes."""

    def __init__(self, hidden: int):
        super().__init__()
        self.lin = nn.Linear(R.D_IN, hidden)
        self.act = R.ShiftedLog()
        self.head = nn.Linear(hidden, R.N_CLASSES)

    def forward(self, x):
        return self.head(self.act(self.lin(x)))


def make_wide_net(hidden: int | None = None) -> nn.Module:
    return WideLogNet(CONFIG["hidden"] if hidden is None else hidden)


def make_critic(spectral: bool = False) -> nn.Module:
    """A GAN critic; ``spectral``: with spectral_norm on its linear layers, as a run may add
    them after building the model."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(10, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    if spectral:
        for layer in (m[0], m[2]):
            nn.utils.parametrizations.spectral_norm(layer)
    return m


class DensityMap(nn.Module):
    """A crowd-counting head: a learned gain over an image's density map. Its count is the sum
    of 262,144 pixels, which a CPU sums in one chunk per thread."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, density):
        return density * self.gain


def make_density_map() -> nn.Module:
    return DensityMap()


def inverse_count_error(pred, count):
    """1 / (predicted count - true count): infinite where the two agree to the last bit."""
    return (pred.sum() - count).reciprocal()
