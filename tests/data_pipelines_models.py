"""Models and datasets of the data-pipeline tests (tests/test_data_pipelines.py): the factories
``nanreplay`` imports from the tests directory, and the datasets their loaders read."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

D = 8


class Chunks(Dataset):
    """A dataset served in ready-made batches that are slices of its own tensors
    (``DataLoader(ds, batch_size=None)``): each batch views the dataset's storage."""

    def __init__(self, n: int = 320, bs: int = 32, bad_row: int | None = None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, D, generator=g)
        self.y = self.x.sum(1) + 0.1 * torch.randn(n, generator=g)
        if bad_row is not None:
            self.x[bad_row, 2] = float("nan")  # a corrupt record
        self.bs = bs

    def __len__(self) -> int:
        return len(self.x) // self.bs

    def __getitem__(self, i: int):
        s = slice(i * self.bs, (i + 1) * self.bs)
        return self.x[s], self.y[s]


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def make_regressor() -> nn.Module:
    torch.manual_seed(0)
    return Regressor()
