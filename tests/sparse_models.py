"""A recommender shaped like the ones trained with two optimizers: a sparse ``EmbeddingBag``
updated by ``SparseAdam`` and a dense tower by ``Adam``, its rating through a final ReLU and a
loop-written loss in log space (``log`` of a rating that the ReLU makes exactly 0)."""

from __future__ import annotations

import torch
from torch import nn

ITEMS, DIM, BATCH, BAG = 200, 8, 16, 4


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.EmbeddingBag(ITEMS, DIM, mode="mean", sparse=True)
        self.tower = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 1), nn.ReLU())
        nn.init.constant_(self.tower[2].bias, 2.0)  # ratings start near the middle, above 0

    def forward(self, bags, offsets):
        return self.tower(self.items(bags, offsets)).squeeze(-1)


def make_recommender() -> nn.Module:
    torch.manual_seed(0)
    return Recommender()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat item ids, bag offsets, ratings in [1, 5]) of a step."""
    g = torch.Generator().manual_seed(500 + step)
    bags = torch.randint(0, ITEMS, (BATCH * BAG,), generator=g)
    return bags, torch.arange(0, BATCH * BAG, BAG), torch.rand(BATCH, generator=g) * 4 + 1


def log_loss(pred, rating):
    return (torch.log(pred) - torch.log(rating)).pow(2).mean()
