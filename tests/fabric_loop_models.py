"""Models, losses and data of a custom Lightning Fabric training loop
(``tests/test_fabric_loop.py``): a sensor-window regressor over per-step readings and a
validity mask, with a hand-written softmax attention pooling over time (exp of the scores,
normalised by their sum), a masked mean-squared loss written as users write it (the sum over
the labelled targets divided by their count), and a ``DataLoader`` of dicts."""

from __future__ import annotations

import torch
from torch import nn

T, F_IN, D, OUT = 8, 4, 16, 3


class ExpPool(nn.Module):
    """Attention pooling over time written out: exp of each step's score, masked by the
    validity mask, divided by the masked sum (no max subtracted)."""

    def __init__(self, d: int):
        super().__init__()
        self.score = nn.Linear(d, 1)

    def forward(self, h, valid):
        w = torch.exp(self.score(h).squeeze(-1)) * valid
        w = w / (w.sum(-1, keepdim=True) + 1e-6)
        return (w.unsqueeze(-1) * h).sum(1)


class WindowRegressor(nn.Module):
    """(B, T, F) readings and their (B, T) validity -> (B, OUT) targets."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(F_IN, D), nn.GELU(), nn.Linear(D, D))
        self.pool = ExpPool(D)
        self.head = nn.Linear(D, OUT)

    def forward(self, x, valid):
        return self.head(self.pool(self.encoder(x), valid.to(x.dtype)))


class PathRegressor(WindowRegressor):
    """Adds the path length of the encoded window (the distance between consecutive steps'
    encodings, summed over the valid steps) as a pooled feature."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D + 1, OUT)

    def forward(self, x, valid):
        h = self.encoder(x)
        step = (h[:, 1:] - h[:, :-1]).pow(2).sum(-1).sqrt()
        path = (step * valid[:, 1:]).sum(-1, keepdim=True)
        return self.head(torch.cat([self.pool(h, valid.to(x.dtype)), path], -1))


def make_regressor() -> WindowRegressor:
    torch.manual_seed(0)
    return WindowRegressor()


class MaskedMSE(nn.Module):
    """Mean squared error over the labelled targets only (``label_mask`` 1 where a target
    was measured)."""

    def forward(self, pred, target, label_mask):
        err = (pred.float() - target) ** 2 * label_mask
        return err.sum() / label_mask.sum()


class SensorWindows(torch.utils.data.Dataset):
    """Windows of T readings with 2..T valid steps (the rest zero-padded), OUT targets each.
    ``nan``: records with a NaN reading (a sensor dropout); ``loud``: records whose readings
    are 1e4x (logged in the wrong unit); ``unlabelled``: records with no measured target;
    ``full``: every window all T steps; ``offset``: channel 0 a barometer in hPa (``offset``
    plus noise of std 3)."""

    def __init__(self, n: int, nan=(), loud=(), unlabelled=(), full=False, offset=None):
        g = torch.Generator().manual_seed(1)
        self.lengths = torch.randint(2, T + 1, (n,), generator=g)
        self.x = torch.randn(n, T, F_IN, generator=g)
        if full:
            self.lengths[:] = T
        if offset is not None:
            self.x[..., 0] = self.x[..., 0] * 3 + offset
        self.y = torch.randn(n, OUT, generator=g)
        self.label_mask = torch.ones(n, OUT)
        for i in nan:
            self.x[i, 1, 2] = float("nan")
        for i in loud:
            self.x[i] *= 1e4
        for i in unlabelled:
            self.label_mask[i] = 0.0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        valid = (torch.arange(T) < self.lengths[i]).float()
        return {"x": self.x[i] * valid[:, None], "valid": valid, "y": self.y[i],
                "label_mask": self.label_mask[i]}


def make_path_regressor() -> PathRegressor:
    torch.manual_seed(0)
    return PathRegressor()


class FastStandardize(nn.Module):
    """Per-window standardisation of each channel with the one-pass variance
    ``E[x^2] - E[x]^2`` (one reduction less than ``torch.var``)."""

    def forward(self, x):
        mean = x.mean(1, keepdim=True)
        var = (x * x).mean(1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var + 1e-5)


class StandardizedRegressor(WindowRegressor):
    """The readings standardised per window before the encoder."""

    def __init__(self):
        super().__init__()
        self.standardize = FastStandardize()

    def forward(self, x, valid):
        return super().forward(self.standardize(x), valid)


def make_standardized_regressor() -> StandardizedRegressor:
    torch.manual_seed(0)
    return StandardizedRegressor()


class GaussianLikelihood(nn.Module):
    """The negative log-likelihood of the targets under N(pred, sigma^2), written from the
    density (the labelled targets only, averaged over them)."""

    def __init__(self, sigma: float = 0.5):
        super().__init__()
        self.sigma = sigma

    def forward(self, pred, target, label_mask):
        z = (target - pred.float()) / self.sigma
        density = torch.exp(-0.5 * z * z) / (self.sigma * 2.5066282746)
        nll = -torch.log(density) * label_mask
        return nll.sum() / label_mask.sum().clamp_min(1)
