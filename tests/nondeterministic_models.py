"""Models whose step draws from random generators of their own or computes with state kept
outside the model, as people write them: a feature dropout drawing its masks from NumPy's or
Python's generators (kept where the recorder finds them, or made afresh at each call), an
attention temperature annealed in a module-level dict or on the module, a stochastic-rounding
custom op (``torch.library.custom_op``) drawing from a fresh generator. Where the bundle cannot
hold the state, the replay's re-runs differ and the report names the op where they part ways
(``replay.diverging_op``)."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import torch
from torch import nn

MASKS = np.random.default_rng(0)  # a dropout's own generator, not np.random's
LEGACY_MASKS = np.random.RandomState(0)  # the same in NumPy's legacy API
ANNEAL = {"calls": 0}  # the attention's schedule, kept beside the model


class FeatureDrop(nn.Module):
    """Drops features with a generator of the code's own and rescales each row by the share
    it kept. ``source``: where the generator lives: ``module`` (``MASKS``), ``legacy``
    (``LEGACY_MASKS``), ``numpy_attr`` / ``random_attr`` (``self.rng``, NumPy's or Python's
    ``random.Random``), or ``fresh`` (``np.random.default_rng()`` at each call, seeded from
    the OS: nothing can draw the same again; ``numpy_view``: the same draw written by NumPy
    into a torch buffer through ``.numpy()``; ``clock``: a ``torch.Generator`` seeded from
    the clock at each call)."""

    def __init__(self, p: float, source: str):
        super().__init__()
        self.p, self.source = p, source
        if source == "numpy_attr":
            self.rng = np.random.default_rng(7)
        elif source == "random_attr":
            self.rng = random.Random(7)

    def draw(self, shape: tuple[int, ...]) -> np.ndarray:
        if self.source == "random_attr":
            return np.array([self.rng.random() for _ in range(math.prod(shape))]).reshape(shape)
        if self.source == "fresh":
            return np.random.default_rng().random(shape)
        rng = {"module": MASKS, "legacy": LEGACY_MASKS}.get(self.source, getattr(self, "rng", None))
        return rng.random(shape) if self.source != "legacy" else rng.random_sample(shape)

    def forward(self, x):
        if self.source == "numpy_view":  # (NumPy fills torch's buffer: no op, no version)
            u = torch.zeros_like(x)
            u.numpy()[...] = np.random.default_rng().random(tuple(x.shape))
            keep = (u > self.p).to(x.dtype)
        elif self.source == "clock":
            g = torch.Generator().manual_seed(time.time_ns())
            keep = (torch.rand(x.shape, generator=g) > self.p).to(x.dtype)
        else:
            keep = torch.from_numpy(self.draw(tuple(x.shape)) > self.p).to(x.dtype)
        return x * keep / keep.mean(1, keepdim=True)


def make_drop(source: str, p: float = 0.5, width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), FeatureDrop(p, source), nn.Linear(width, 1))


def make_drop_module() -> nn.Module:
    return make_drop("module")


def make_drop_legacy() -> nn.Module:
    return make_drop("legacy")


def make_drop_numpy_attr() -> nn.Module:
    return make_drop("numpy_attr")


def make_drop_random_attr() -> nn.Module:
    return make_drop("random_attr")


def make_drop_fresh() -> nn.Module:
    return make_drop("fresh", p=0.8, width=4)


def make_drop_numpy_view() -> nn.Module:
    return make_drop("numpy_view", p=0.8, width=4)


def make_drop_clock() -> nn.Module:
    return make_drop("clock", p=0.8, width=4)


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
    """floor(x + u), u ~ U[0, 1): unbiased rounding to integers (low-precision training), u
    from a generator seeded from the OS at each call."""
    u = torch.from_numpy(np.random.default_rng().random(tuple(x.shape))).to(x.dtype)
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


class Alternating(nn.Module):
    """Alternates its activation at every call, by a call count kept in ``ANNEAL`` (a schedule
    shared by several models): log-features of a tanh (negative: NaN) or of a sigmoid."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x):
        ANNEAL["calls"] += 1
        h = self.q(x)
        h = torch.tanh(h) if ANNEAL["calls"] % 2 else torch.sigmoid(h)
        return h.log().sum(1, keepdim=True)


def make_alternating() -> nn.Module:
    torch.manual_seed(0)
    return Alternating()


@torch.library.custom_op("nanreplay_tests::scatter_sum_unordered", mutates_args=())
def scatter_sum_unordered(src: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """``src``'s rows summed into ``n`` rows by ``index``, in an order that changes from call
    to call, as CUDA's atomic adds do: the same sums, rounded differently."""
    out = src.new_zeros(n, src.shape[1])
    for i in np.random.default_rng().permutation(len(index)).tolist():
        out[index[i]] += src[i]
    return out


@scatter_sum_unordered.register_fake
def _(src, index, n):
    return src.new_empty(n, src.shape[1])


def _scatter_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _scatter_grad(ctx, grad):
    (index,) = ctx.saved_tensors
    return grad[index], None, None


scatter_sum_unordered.register_autograd(_scatter_grad, setup_context=_scatter_context)


class GraphConv(nn.Module):
    """A graph layer summing (``mean=False``) or averaging (sum over edges / in-degree) each
    node's incoming messages with :func:`scatter_sum_unordered`; under the mean, a node no
    edge reaches is 0/0."""

    def __init__(self, d: int, mean: bool):
        super().__init__()
        self.msg = nn.Linear(d, d)
        self.mean = mean

    def forward(self, x, edges):
        src, dst = edges
        m = scatter_sum_unordered(self.msg(x)[src], dst, x.shape[0])
        if not self.mean:
            return torch.relu(m)
        deg = scatter_sum_unordered(torch.ones(len(dst), 1), dst, x.shape[0])
        return torch.relu(m / deg)


class TwoHopGNN(nn.Module):
    def __init__(self, d: int = 4):
        super().__init__()
        self.conv1, self.conv2 = GraphConv(d, mean=False), GraphConv(d, mean=True)
        self.out = nn.Linear(d, 1)

    def forward(self, x, edges):
        return self.out(self.conv2(self.conv1(x, edges), edges))


def make_mean_aggregation() -> nn.Module:
    torch.manual_seed(0)
    return TwoHopGNN()


class LabelNoise(nn.Module):
    """Target augmentation drawing from a generator of its own."""

    def __init__(self, sigma: float):
        super().__init__()
        self.sigma = sigma
        self.gen = torch.Generator().manual_seed(11)

    def forward(self, y):
        return y + self.sigma * torch.randn(y.shape, generator=self.gen)


class NoisyLogError(nn.Module):
    """A squared log error against noisy targets: ``log1p`` of a target the noise pushed
    below -1 is NaN."""

    def __init__(self, sigma: float = 0.5):
        super().__init__()
        self.noise = LabelNoise(sigma)

    def forward(self, pred, y):
        return (torch.log1p(pred.abs()) - torch.log1p(self.noise(y))).pow(2).mean()
