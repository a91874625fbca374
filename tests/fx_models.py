"""A model traced by torch.fx (``symbolic_trace``, as feature extractors and graph rewrites
hand it back): a ``GraphModule`` whose ``forward`` is generated code; importable as a factory
(``fx_models:make_traced``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.fx import symbolic_trace


class WeightedRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(6, 16)
        self.l2 = nn.Linear(16, 1)

    def forward(self, x, w):
        h = torch.relu(self.l1(x))
        h = h / w.unsqueeze(1)  # (a record's weight of 0: 0/0 and x/0)
        return self.l2(h).squeeze(1)


def make_traced() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return symbolic_trace(WeightedRegressor())


def batches(steps: int, zero_weight_at: tuple[int, int] | None = None):
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
        w = torch.rand(8, generator=g) + 0.5
        if zero_weight_at is not None and step == zero_weight_at[0]:
            w[zero_weight_at[1]] = 0.0
        yield x, w, y
