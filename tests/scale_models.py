"""Models that use a learnable parameter as is inside an op that can go non-finite: CLIP's
``logit_scale.exp()`` (open_clip, without its clamp), and a learned noise scale taken the log of (a heteroscedastic
regression head that learns sigma itself, not its log)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class TinyClip(nn.Module):
    """Two augmented views through one encoder (SimCLR), scored as CLIP scores its pairs."""

    def __init__(self, scale: float = math.log(1 / 0.07)):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 8))
        self.logit_scale = nn.Parameter(torch.ones([]) * scale)

    def forward(self, view1, view2):
        z1 = F.normalize(self.encoder(view1), dim=-1)
        z2 = F.normalize(self.encoder(view2), dim=-1)
        return z1, z2, self.logit_scale.exp()


class ClipLoss(nn.Module):
    def forward(self, img, txt, logit_scale):
        logits = logit_scale * img @ txt.T
        labels = torch.arange(img.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class NoisyRegressor(nn.Module):
    """Predicts a mean and returns the Gaussian log-likelihood's ``log sigma`` term."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        self.sigma = nn.Parameter(torch.ones(1) * 0.5)

    def forward(self, x):
        return self.net(x), torch.log(self.sigma).expand(x.shape[0], 1)


class GaussianNLL(nn.Module):
    def forward(self, out, y):
        mu, log_sigma = out
        return (log_sigma + 0.5 * (y - mu) ** 2 / log_sigma.exp() ** 2).mean()


def make_clip() -> TinyClip:
    torch.manual_seed(0)
    return TinyClip()


def make_regressor() -> NoisyRegressor:
    torch.manual_seed(0)
    return NoisyRegressor()


def make_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


class WeightNormedStack(nn.Module):
    """A vocoder-style dilated conv stack with the hook-based ``torch.nn.utils.weight_norm``
    (deprecated, still in many repos): each conv's weight is made from ``weight_g`` and
    ``weight_v`` by a forward pre-hook of the conv."""

    def __init__(self):
        super().__init__()
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.convs = nn.ModuleList(
                [nn.utils.weight_norm(nn.Conv1d(4, 4, 3, padding=d, dilation=d))
                 for d in (1, 2)])

    def forward(self, x):
        for c in self.convs:
            x = x + F.leaky_relu(c(x), 0.1)
        return x.mean(1)


def make_weight_normed() -> WeightNormedStack:
    torch.manual_seed(0)
    return WeightNormedStack()


class SqrtGate(nn.Module):
    """``torch.where(h > 0, sqrt(...), 0)``: the backward of sqrt at 0 is NaN in the branch the
    where masks out; with ``clamp_min(0)`` inside, the clamp's backward zeroes that NaN again."""

    def __init__(self, clamped: bool = True):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.clamped = clamped

    def forward(self, x):
        h = self.lin(x)
        inner = h.clamp_min(0) if self.clamped else h
        return torch.where(h > 0, torch.sqrt(inner), torch.zeros_like(h))


def make_sqrt_gate(clamped: bool = True) -> SqrtGate:
    torch.manual_seed(0)
    return SqrtGate(clamped)


def make_bn_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
