"""Models whose step computes with state the bundle does not hold, as people write them: a
feature dropout drawing its masks from its own ``numpy.random.default_rng``, an attention
temperature annealed in a module-level dict, a stochastic-rounding custom op
(``torch.library.custom_op``) with a generator of its own. Each replay's re-runs differ; the
report names the op where they part ways (``replay.diverging_op``)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

MASKS = np.random.default_rng(0)  # the dropout's own generator, not np.random's
ANNEAL = {"calls": 0}  # the attention's schedule, kept beside the model
ROUNDING = np.random.default_rng(1)


class FeatureDrop(nn.Module):
    """Drops features with a NumPy Generator and rescales each row by the share it kept."""

    def __init__(self, p: float = 0.8):
        super().__init__()
        self.p = p

    def forward(self, x):
        keep = torch.from_numpy(MASKS.random(tuple(x.shape)) > self.p).to(x.dtype)
        return x * keep / keep.mean(1, keepdim=True)


def make_drop() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), FeatureDrop(), nn.Linear(4, 1))


class Annealed(nn.Module):
    """Attention pooling whose softmax temperature halves at every call: the call count in
    ``ANNEAL`` (``global_schedule``) or on the module (``own_schedule``)."""

    def __init__(self, global_schedule: bool = True):
        super().__init__()
        self.q = nn.Linear(6, 6)
        self.global_schedule = global_schedule
        self.calls = 0

    def forward(self, x):
        if self.global_schedule:
            ANNEAL["calls"] += 1
            calls = ANNEAL["calls"]
        else:
            self.calls += 1
            calls = self.calls
        t = 0.5 ** calls
        w = torch.softmax(self.q(x) / t, 1)
        return (w * x).sum(1, keepdim=True)


def make_annealed() -> nn.Module:
    torch.manual_seed(0)
    return Annealed()


def make_annealed_own() -> nn.Module:
    torch.manual_seed(0)
    return Annealed(global_schedule=False)


@torch.library.custom_op("nanreplay_tests::stochastic_round", mutates_args=())
def stochastic_round(x: torch.Tensor) -> torch.Tensor:
    """floor(x + u), u ~ U[0, 1): unbiased rounding to integers (low-precision training)."""
    u = torch.from_numpy(ROUNDING.random(tuple(x.shape))).to(x.dtype)
    return torch.floor(x + u)


@stochastic_round.register_fake
def _(x):
    return torch.empty_like(x)


def _straight_through(ctx, grad):
    return grad


stochastic_round.register_autograd(_straight_through)


class RoundedNorm(nn.Module):
    """Activations rounded stochastically to integers, then scaled per row by their absmax."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        q = stochastic_round(self.inp(x))
        return self.out(q / q.abs().amax(1, keepdim=True))


def make_rounded() -> nn.Module:
    torch.manual_seed(0)
    return RoundedNorm()
