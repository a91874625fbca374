"""Learning to rank as allRank / PT-Ranking code writes it: a listwise scorer over padded lists
of query-document feature vectors (``make_scorer``) whose padded slots score ``-inf``, ListMLE
(Plackett-Luce via ``logcumsumexp`` from the tail), RankNet, and LambdaRank's delta-NDCG
weights over the ideal DCG."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEAT, LIST = 8, 6


class Scorer(nn.Module):
    """allRank's FCModel: per-document MLP scores of a [queries, LIST, FEAT] batch."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FEAT, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x, mask):
        s = self.mlp(x).squeeze(-1)
        return s.masked_fill(~mask, float("-inf"))  # padded slots out of every softmax


def make_scorer() -> nn.Module:
    torch.manual_seed(0)
    return Scorer()


def lists(g: torch.Generator, queries: int) -> dict:
    """Feature lists of 2 to LIST documents, graded labels 0-4 (-1 on padding, allRank's
    PADDED_Y_VALUE) and their mask; a short list's labels may all be 0 (no relevant document)."""
    x = torch.randn(queries, LIST, FEAT, generator=g)
    n = torch.randint(2, LIST + 1, (queries,), generator=g)
    mask = torch.arange(LIST) < n[:, None]
    y = torch.randint(0, 5, (queries, LIST), generator=g).float()
    y = y.masked_fill(~mask, -1.0)
    return {"x": x, "mask": mask, "y": y}


def listmle(scores, y, mask):
    """ListMLE (allRank): sort by label, Plackett-Luce negative log-likelihood from the tail."""
    order = y.argsort(dim=1, descending=True)
    s = scores.gather(1, order)
    m = mask.gather(1, order)
    s_max = s.masked_fill(~m, -1e4).max(1, keepdim=True).values
    s = s - s_max
    tail = torch.logcumsumexp(s.flip(1), dim=1).flip(1)
    nll = (tail - s) * m  # padded slots: -inf - (-inf)
    return nll.sum(1).mean()


def dcg(gains):
    disc = 1.0 / torch.log2(torch.arange(gains.shape[1], dtype=gains.dtype) + 2.0)
    return ((2 ** gains - 1) * disc).sum(1)


def ranknet(scores, y, mask):
    """RankNet as first written: log of sigmoid of the score difference of each ordered pair."""
    pair = mask[:, :, None] & mask[:, None, :] & (y[:, :, None] > y[:, None, :])
    diff = scores[:, :, None] - scores[:, None, :]
    p = torch.sigmoid(diff[pair])
    return -torch.log(p).mean()  # sigmoid rounds to 0 below -88: log(0)


def lambdarank(scores, y, mask, sigma: float = 1.0):
    """LambdaRank as PT-Ranking writes it: |delta NDCG| of swapping each pair, computed from the
    labels and the current ranking without gradient, weighting RankNet's pairwise softplus."""
    y = y.clamp_min(0)
    with torch.no_grad():
        idcg = dcg(y.sort(1, descending=True).values)
        rank = scores.argsort(1, descending=True).argsort(1).float()
        disc = 1.0 / torch.log2(rank + 2.0)
        gain = 2 ** y - 1
        delta = (gain[:, :, None] - gain[:, None, :]).abs() * \
            (disc[:, :, None] - disc[:, None, :]).abs() / idcg[:, None, None]
    pair = (mask[:, :, None] & mask[:, None, :] & (y[:, :, None] > y[:, None, :])).float()
    s = scores.masked_fill(~mask, 0.0)
    pairwise = F.softplus(-sigma * (s[:, :, None] - s[:, None, :]))
    return (delta * pairwise * pair).sum() / len(scores)
