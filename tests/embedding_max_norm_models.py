"""A click-through model whose embeddings are kept inside the unit ball by ``nn.Embedding(
max_norm=1.0)`` (torch renormalises the rows each forward looks up, in place), beside a log
count feature; importable as a factory (``embedding_max_norm_models:make_model``)."""

from __future__ import annotations

import torch
from torch import nn


class CountedBag(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, max_norm=1.0)
        self.head = nn.Linear(dim + 1, 2)

    def forward(self, ids, counts):
        feats = torch.cat([self.emb(ids).mean(1), counts.log().unsqueeze(1)], dim=1)
        return self.head(feats)


def make_model() -> CountedBag:
    torch.manual_seed(0)
    return CountedBag()


def batches(steps: int, zero_count_at: tuple[int, int] | None = None):
    """(ids, counts, y) per step; ``zero_count_at=(step, record)``: that record's count is 0
    (an impression logged with no views)."""
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        ids = torch.randint(0, 100, (8, 5), generator=g)
        counts = torch.randint(1, 50, (8,), generator=g).float()
        y = torch.randint(0, 2, (8,), generator=g)
        if zero_count_at is not None and step == zero_count_at[0]:
            counts[zero_count_at[1]] = 0.0
        yield ids, counts, y
