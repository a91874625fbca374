"""Vision recipes as timm and torchvision's reference scripts write them: a ConvNeXt-style
LayerScale applied channels-last between permutes, a hand-written DropPath dividing by
keep_prob."""

from __future__ import annotations

import torch
from torch import nn


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float = 1.0):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


def drop_path(x, drop_prob: float = 0.0, training: bool = False):
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    random_tensor.div_(keep_prob)  # the bug at drop_prob=1: 0/0, timm guards keep_prob > 0
    return x * random_tensor


class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training)


class ConvNeXtish(nn.Module):
    """A stem (stochastic depth rate ``last_drop`` after it), a convolution whose LayerScale
    runs on NHWC (x.permute(0, 2, 3, 1), then back), and a pooled head."""

    def __init__(self, last_drop: float = 0.0, classes: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.conv = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.ls = LayerScale(16)
        self.drop = DropPath(last_drop)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.conv(self.drop(self.stem(x)))
        x = self.ls(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.fc(self.pool(x).flatten(1))


def make_convnext() -> ConvNeXtish:
    torch.manual_seed(0)
    return ConvNeXtish()


def make_convnext_dead_last() -> ConvNeXtish:
    torch.manual_seed(0)
    return ConvNeXtish(last_drop=1.0)


def batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
