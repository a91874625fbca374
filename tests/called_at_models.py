"""A dual encoder whose one encoder embeds the queries and the passages, on two lines of its
forward (DPR's shared tower), normalising each embedding by its norm without an eps: a passage
of all-zero features makes 0/0 in the encoder's *second* call (``test_called_at``)."""

from __future__ import annotations

import torch
from torch import nn


class Normalise(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)  # (no eps: a zero row is 0/0)


class DualEncoder(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)  # (no bias: a zero passage stays zero)
        self.norm = Normalise()

    def forward(self, queries, passages):
        q = self.norm(self.proj(queries))
        p = self.norm(self.proj(passages))
        return q @ p.T


class LoopEncoder(DualEncoder):
    """The same tower applied in a loop: both calls come from one line."""

    def forward(self, queries, passages):
        q, p = [self.norm(self.proj(x)) for x in (queries, passages)]
        return q @ p.T


def make_model():
    torch.manual_seed(0)
    return DualEncoder()


def make_loop_model():
    torch.manual_seed(0)
    return LoopEncoder()


def batch(step: int, blank: int | None = None):
    g = torch.Generator().manual_seed(step)
    queries, passages = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    if blank is not None:
        passages[blank] = 0.0  # (a passage whose features are all 0: an empty document)
    return queries, passages
