"""Point cloud networks written with plain PyTorch: clouds of different sizes passed as one
nested tensor (``torch.nested.nested_tensor``, no padding), each normalised to the unit sphere,
a shared per-point MLP and a max pooling per cloud (``test_point_clouds.py``)."""

from __future__ import annotations

import torch
from torch import nn


class NestedPointNet(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 64))
        self.head = nn.Linear(64, classes)

    def forward(self, clouds):
        parts = []
        for c in clouds.unbind():  # each cloud centred and scaled into the unit sphere
            c = c - c.mean(0)
            parts.append(c / c.norm(dim=1).max())  # the bug: a cloud of one point is 0 / 0
        f = self.mlp(torch.nested.nested_tensor(parts))
        return self.head(torch.stack([p.max(0).values for p in f.unbind()]))


def nested_pointnet() -> nn.Module:
    torch.manual_seed(0)
    return NestedPointNet()
