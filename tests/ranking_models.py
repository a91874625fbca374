"""Learning to rank and dense retrieval as allRank / PT-Ranking / DPR / CLIP-style code writes
it: a listwise scorer over padded lists of query-document feature vectors (``make_scorer``),
ListNet, ListMLE (Plackett-Luce via ``logcumsumexp`` from the tail), LambdaLoss with delta-NDCG
weights over the ideal DCG, RankNet, and a dual encoder (``make_dual_encoder``) mean-pooling
token embeddings under a padding mask, trained with InfoNCE over in-batch negatives and a
learnable temperature ``logit_scale.exp()``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FEAT, LIST, VOCAB, CTX, DIM = 8, 6, 40, 7, 16


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


def lists(g: torch.Generator, queries: int, empty: int | None = None,
          no_relevant: int | None = None) -> dict:
    """Feature lists, graded labels 0-4 (-1 on padding, allRank's PADDED_Y_VALUE) and their
    mask; ``empty``: that query has no document left (filtered out); ``no_relevant``: every
    label of that query is 0."""
    x = torch.randn(queries, LIST, FEAT, generator=g)
    n = torch.randint(2, LIST + 1, (queries,), generator=g)
    mask = torch.arange(LIST) < n[:, None]
    y = torch.randint(0, 5, (queries, LIST), generator=g).float()
    if no_relevant is not None:
        y[no_relevant] = 0
    if empty is not None:
        mask[empty] = False
    y = y.masked_fill(~mask, -1.0)
    return {"x": x, "mask": mask, "y": y}


def listnet(scores, y, mask):
    """ListNet's top-one cross entropy: softmax over the list's real documents."""
    target = F.softmax(y.masked_fill(~mask, float("-inf")), dim=1)
    logp = F.log_softmax(scores, dim=1)
    return -(target * logp.masked_fill(~mask, 0.0)).sum(1).mean()


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


def dcg(gains, k=None):
    disc = 1.0 / torch.log2(torch.arange(gains.shape[1], dtype=gains.dtype) + 2.0)
    return ((2 ** gains - 1) * disc).sum(1)


def lambda_loss(scores, y, mask, sigma: float = 1.0, eps: float = 1e-10):
    """LambdaLoss's NDCG-Loss2++ flavour (allRank): pairwise logistic terms weighted by
    |delta NDCG|, the gain over the ideal DCG of the query."""
    y = y.clamp_min(0)
    ideal = y.sort(1, descending=True).values
    idcg = dcg(ideal)
    rank = scores.argsort(1, descending=True).argsort(1).float()
    disc = 1.0 / torch.log2(rank + 2.0)
    gain = (2 ** y - 1) / idcg[:, None]  # a query with no relevant document: 0 / 0
    delta = (gain[:, :, None] - gain[:, None, :]).abs() * \
        (disc[:, :, None] - disc[:, None, :]).abs()
    pair = mask[:, :, None] & mask[:, None, :] & (y[:, :, None] > y[:, None, :])
    diff = (scores[:, :, None] - scores[:, None, :]).masked_fill(~pair, 0.0)
    loss = -torch.log2(torch.sigmoid(sigma * diff).clamp(min=eps)) * delta
    return loss[pair].sum() / mask.shape[0]


def ranknet(scores, y, mask):
    """RankNet as first written: log of sigmoid of the score difference of each ordered pair."""
    pair = mask[:, :, None] & mask[:, None, :] & (y[:, :, None] > y[:, None, :])
    diff = scores[:, :, None] - scores[:, None, :]
    p = torch.sigmoid(diff[pair])
    return -torch.log(p).mean()  # sigmoid rounds to 0 below -88: log(0)


class DualEncoder(nn.Module):
    """A DPR/CLIP-style bi-encoder: token embeddings, a shared MLP, masked mean pooling, and
    CLIP's learnable temperature ``logit_scale`` (init log(1/0.07))."""

    def __init__(self, logit_scale: float = math.log(1 / 0.07)):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.enc = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.logit_scale = nn.Parameter(torch.tensor(float(logit_scale)))

    def encode(self, ids, mask):
        h = self.enc(self.emb(ids))
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1)  # an all-padding row: 0 / 0
        return F.normalize(pooled, dim=-1)

    def forward(self, q_ids, q_mask, d_ids, d_mask):
        q = self.encode(q_ids, q_mask)
        d = self.encode(d_ids, d_mask)
        return self.logit_scale.exp() * q @ d.T  # CLIP clamps logit_scale at log(100)


def make_dual_encoder(logit_scale: float = math.log(1 / 0.07)) -> nn.Module:
    torch.manual_seed(0)
    return DualEncoder(logit_scale)


def pairs(g: torch.Generator, batch: int, empty_query: int | None = None) -> dict:
    """Query / positive-document token ids with right padding and their masks."""
    out = {}
    for side in ("q", "d"):
        ids = torch.randint(1, VOCAB, (batch, CTX), generator=g)
        n = torch.randint(1, CTX + 1, (batch,), generator=g)
        mask = torch.arange(CTX) < n[:, None]
        if side == "q" and empty_query is not None:
            mask[empty_query] = False  # a query tokenised to nothing
        out[f"{side}_ids"], out[f"{side}_mask"] = ids.masked_fill(~mask, 0), mask
    return out


def info_nce(logits):
    """Symmetric InfoNCE with in-batch negatives: the diagonal holds the positives."""
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def approx_ndcg(scores, y, mask, alpha: float = 10.0):
    """approxNDCG (Qin et al., allRank): each document's rank as a sum of sigmoids of the score
    differences, NDCG from those smooth ranks, over the ideal DCG of the query."""
    y = y.clamp_min(0)
    s = scores.masked_fill(~mask, -1e4)
    diff = s[:, None, :] - s[:, :, None]  # [q, i, j]: s_j - s_i
    approx_rank = 1.0 + (torch.sigmoid(alpha * diff) * mask[:, None, :]).sum(-1) - 0.5
    gain = (2 ** y - 1) * mask
    approx_dcg = (gain / torch.log2(1.0 + approx_rank)).sum(1)
    ndcg = approx_dcg / dcg(y.sort(1, descending=True).values)  # no relevant document: 0 / 0
    return -ndcg.mean()


class EuclidEncoder(DualEncoder):
    """The bi-encoder scoring by negative Euclidean distance, as metric-learning retrieval
    code writes it by hand."""

    def forward(self, q_ids, q_mask, d_ids, d_mask):
        q, d = self.pool(q_ids, q_mask), self.pool(d_ids, d_mask)
        d2 = ((q[:, None, :] - d[None, :, :]) ** 2).sum(-1)
        return -d2.sqrt()  # a document equal to its query: sqrt's gradient at 0

    def pool(self, ids, mask):
        h = self.enc(self.emb(ids))
        m = mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp_min(1)


def make_euclid_encoder() -> nn.Module:
    torch.manual_seed(0)
    return EuclidEncoder()


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
