"""Models whose samples' rows come with inputs that are not batch-major, as users pass them
beside the batch (``test_drop_companions.py``): a GCN over a sparse adjacency multiplied with
``@`` (COO or CSR, as ``to_sparse_csr()`` makes it), node attention under an additive
``(N, N)`` mask of a directed graph, and sequences packed into one ``(total, F)`` tensor with
their boundaries (flash-attention's ``cu_seqlens``) or per-sample counts (stack mode's
``batch_cnt``), mean-pooled per sample."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MeanGCN(nn.Module):
    """Mean aggregation over a node's neighbours, its degree read off the adjacency (no
    clamp: an isolated node is 0/0)."""

    def __init__(self, d_in: int = 8, classes: int = 3):
        super().__init__()
        self.lin = nn.Linear(d_in, 16)
        self.out = nn.Linear(16, classes)

    def forward(self, x, adj):
        deg = (adj @ torch.ones(x.shape[0], 1)).squeeze(1)
        h = (adj @ self.lin(x)) / deg[:, None]
        return self.out(F.relu(h))


class MaskedNodeAttention(nn.Module):
    """Attention among nodes, ``scores + mask`` (0 along an edge, -inf elsewhere)."""

    def __init__(self, d_in: int = 8, classes: int = 3):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d_in, 16) for _ in range(3))
        self.out = nn.Linear(16, classes)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).T / 4.0 + mask
        return self.out(torch.softmax(scores, -1) @ self.v(x))


class PackedMean(nn.Module):
    """Sequences packed row after row, mean-pooled per sample (no guard for an empty one)."""

    def __init__(self, d_in: int = 8, classes: int = 3, counts: bool = False):
        super().__init__()
        self.counts = counts
        self.lin = nn.Linear(d_in, 16)
        self.out = nn.Linear(16, classes)

    def forward(self, feats, sizes):
        lens = sizes if self.counts else sizes.diff()
        seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        total = torch.zeros(lens.numel(), 16).index_add_(0, seg, self.lin(feats))
        return self.out(total / lens[:, None])


class TablePooling(nn.Module):
    """Per-sample rows of a learned table the model holds, bounded by ``cu_seqlens``: no input
    has those rows."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.table = nn.Parameter(torch.randn(200, 16))
        self.out = nn.Linear(16, classes)

    def forward(self, cu_seqlens):
        lens = cu_seqlens.diff()
        seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        rows = self.table[:int(cu_seqlens[-1])]
        return self.out(torch.zeros(lens.numel(), 16).index_add_(0, seg, rows) / lens[:, None])


def mean_gcn() -> nn.Module:
    torch.manual_seed(0)
    return MeanGCN()


def masked_attention() -> nn.Module:
    torch.manual_seed(0)
    return MaskedNodeAttention()


def packed_mean(counts: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return PackedMean(counts=counts)


def table_pooling() -> nn.Module:
    torch.manual_seed(0)
    return TablePooling()
