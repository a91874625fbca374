"""Models and losses that keep state outside what the bundle holds, as people write them: a
module-level cache of positional encodings by length and an ``functools.lru_cache``'d table
(an entry made before the recorder attached, holding NaN), a warm-up counted in an attribute
whose class default the first call shadows, and losses normalising by a running
average of past losses kept in a plain float: on the loss itself, on a plain object it holds,
or on a loss module, and a warm-up counted by a loss's own submodule (``replay.kept_outside``,
``replay.loss_started``, ``replay.loss_state``)."""

from __future__ import annotations

import functools

import torch
from torch import nn

_PE_CACHE: dict[int, torch.Tensor] = {}  # encodings by sequence length, filled by first calls


def positions(n: int) -> torch.Tensor:
    if n not in _PE_CACHE:
        _PE_CACHE[n] = torch.sin(torch.arange(n, dtype=torch.float32) / n)
    return _PE_CACHE[n]


@functools.lru_cache(maxsize=16)
def ramp(n: int) -> torch.Tensor:
    return torch.linspace(0, 1, n)


class Encoded(nn.Module):
    """Adds the cached encoding (``cache``: ``dict`` or ``lru``) to each row, then a linear."""

    def __init__(self, cache: str = "dict"):
        super().__init__()
        self.fc = nn.Linear(6, 1)
        self.cache = cache

    def forward(self, x):
        pe = positions(x.shape[1]) if self.cache == "dict" else ramp(x.shape[1])
        return self.fc(x + pe)


def make_encoded() -> nn.Module:
    torch.manual_seed(0)
    return Encoded()


def make_encoded_lru() -> nn.Module:
    torch.manual_seed(0)
    return Encoded("lru")


class WarmStart(nn.Module):
    """Scales its output up over a warm-up counted in ``self.calls``, a class default the
    first call shadows on the instance (after the recorder attached); then log-features: NaN
    for a negative input."""

    calls = 0
    warmup = 3

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 1)

    def forward(self, x):
        self.calls += 1
        if self.calls <= self.warmup:
            return self.fc(x) * (self.calls / self.warmup)
        return self.fc(torch.log(x))


def make_warm_start() -> nn.Module:
    torch.manual_seed(0)
    return WarmStart()


def make_linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 1))


class RunningMean:
    def __init__(self):
        self.mean = 0.0  # the bug: no bias correction, 0 before the first update


class EmaLoss:
    """MSE over the running mean of past losses, kept in a float on the loss object."""

    def __init__(self):
        self.mean = 0.0

    def __call__(self, out, y):
        raw = ((out - y) ** 2).mean()
        loss = raw / self.mean
        self.mean = 0.9 * self.mean + 0.1 * raw.item()
        return loss


class HeldEmaLoss:
    """The same, the running mean on a plain object the loss holds."""

    def __init__(self):
        self.stats = RunningMean()

    def __call__(self, out, y):
        raw = ((out - y) ** 2).mean()
        loss = raw / self.stats.mean
        self.stats.mean = 0.9 * self.stats.mean + 0.1 * raw.item()
        return loss


class EmaLossModule(nn.Module):
    """The same as a loss module."""

    def __init__(self):
        super().__init__()
        self.mean = 0.0

    def forward(self, out, y):
        raw = ((out - y) ** 2).mean()
        loss = raw / self.mean  # (as a module)
        self.mean = 0.9 * self.mean + 0.1 * raw.item()
        return loss


class Schedule(nn.Module):
    """Counts the calls of the loss that holds it (a submodule: ``<loss>.schedule``)."""

    def __init__(self, warmup: int):
        super().__init__()
        self.warmup, self.calls = warmup, 0

    def tick(self) -> bool:
        """Whether this call is still in the warm-up."""
        self.calls += 1
        return self.calls <= self.warmup


class WarmLogLoss(nn.Module):
    """Mean squared log error during a warm-up counted by its own submodule, then MSE (or,
    ``log_after``, the other way round)."""

    def __init__(self, warmup: int = 3, log_after: bool = False):
        super().__init__()
        self.schedule = Schedule(warmup)
        self.log_after = log_after

    def forward(self, out, y):
        if self.schedule.tick() != self.log_after:
            return ((out - torch.log(y)) ** 2).mean()
        return ((out - y) ** 2).mean()


class ScaledLoss(nn.Module):
    """MSE divided by a scale the loop sets before each loss call."""

    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def forward(self, out, y):
        return ((out - y) ** 2).mean() / self.scale


class LazyRampLoss:
    """MSE weighted by a ramp ``1 - calls / span`` over a count the first call creates (after
    the recorder attached): the weight divides, 0 at call ``span``."""

    def __init__(self, span: int = 3):
        self.span = span

    def __call__(self, out, y):
        if not hasattr(self, "calls"):
            self.calls = 0
        self.calls += 1
        return ((out - y) ** 2).mean() / (1.0 - self.calls / self.span)  # (lazy ramp)


class LazyRampLossModule(nn.Module):
    """The same as a loss module."""

    def forward(self, out, y):
        if not hasattr(self, "calls"):
            self.calls = 0
        self.calls += 1
        return ((out - y) ** 2).mean() / (1.0 - self.calls / 3)  # (lazy ramp, a module)


class ClassRampLoss:
    """The ramp over a count kept on the class (``type(self).calls += 1``)."""

    calls = 0

    def __call__(self, out, y):
        type(self).calls += 1
        return ((out - y) ** 2).mean() / (1.0 - type(self).calls / 3)  # (class ramp)


class ClassCounted(nn.Module):
    """A linear layer counting its calls on its class (``type(self).calls += 1``)."""

    calls = 0

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 1)

    def forward(self, x):
        type(self).calls += 1
        return self.fc(x) / (1.0 - type(self).calls / 4)


def make_class_counted():
    torch.manual_seed(0)
    return ClassCounted()
