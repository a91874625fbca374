"""Recommender, tabular and time-series models and losses for ``test_recsys_timeseries``, at module level
so that ``nanreplay`` rebuilds them from the bundle (``recsys_models:make_dlrm``)."""

from __future__ import annotations

import torch
from torch import nn


class WeightedDLRM(nn.Module):
    """A DLRM-style click model over weighted categorical features, one ``EmbeddingBag`` per
    table, the batch a list of ids, offsets and per-id weights per table (as TorchRec's
    weighted ``KeyedJaggedTensor`` lays them out)."""

    def __init__(self, tables=(100, 50, 30), d: int = 8):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(4, d), nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, d, mode="sum") for n in tables)
        self.top = nn.Linear(d * (len(tables) + 1), 1)

    def forward(self, dense, ids, offsets, weights):
        pooled = [emb(i, o, per_sample_weights=w)
                  for emb, i, o, w in zip(self.tables, ids, offsets, weights)]
        return self.top(torch.cat([self.bottom(dense), *pooled], 1)).squeeze(-1)


def make_dlrm() -> nn.Module:
    torch.manual_seed(0)
    return WeightedDLRM()


class MaskedInstanceNorm(nn.Module):
    """A forecaster over series with missing readings (NaN): each series is standardised by
    its observed mean and std (RevIN-style, with a learned affine), and the missing steps are
    zeroed only afterwards."""

    def __init__(self, length: int = 20, channels: int = 2):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.head = nn.Linear(length * channels, 1)

    def forward(self, x):  # (B, L, C)
        missing = torch.isnan(x)
        mean = torch.nanmean(x, 1, keepdim=True)
        std = torch.sqrt(torch.nanmean((x - mean) ** 2, 1, keepdim=True) + 1e-5)
        z = (x - mean) / std * self.weight + self.bias
        z = torch.where(missing, torch.zeros_like(z), z)
        return self.head(z.flatten(1)).squeeze(-1)


def make_masked_norm() -> nn.Module:
    torch.manual_seed(0)
    return MaskedInstanceNorm()


class SparseMF(nn.Module):
    """Matrix factorisation with sparse embedding gradients (``sparse=True``): each user or
    item id the batch repeats adds one more row to its gradient's values (uncoalesced)."""

    def __init__(self, users: int = 40, items: int = 60, d: int = 8):
        super().__init__()
        self.user = nn.Embedding(users, d, sparse=True)
        self.item = nn.Embedding(items, d, sparse=True)

    def forward(self, users, items):
        return (self.user(users) * self.item(items)).sum(-1)


def make_sparse_mf() -> nn.Module:
    torch.manual_seed(0)
    return SparseMF()


class TCN(nn.Module):
    """A causal dilated TCN forecaster over series with missing readings (NaN), imputed as 0
    beside a missing-indicator channel; it outputs a mean and a log-std per series."""

    def __init__(self, channels: int = 2, hidden: int = 8):
        super().__init__()
        self.c1 = nn.Conv1d(2 * channels, hidden, 3, padding=2, dilation=1)
        self.c2 = nn.Conv1d(hidden, hidden, 3, padding=4, dilation=2)
        self.out = nn.Conv1d(hidden, 2, 1)

    def forward(self, x):  # (B, C, T)
        missing = torch.isnan(x)
        x = torch.nan_to_num(x)
        t = x.shape[-1]
        h = torch.relu(self.c1(torch.cat([x, missing.float()], 1))[..., :t])
        h = torch.relu(self.c2(h)[..., :t])
        return self.out(h)[..., -1]


def make_tcn() -> nn.Module:
    torch.manual_seed(0)
    return TCN()


class LogGaussianNLL(nn.Module):
    """Gaussian NLL of log1p-transformed counts, the variance from the predicted log-std."""

    def forward(self, out, y):
        mean, log_std = out[:, 0], out[:, 1]
        return nn.functional.gaussian_nll_loss(mean, torch.log1p(y), torch.exp(2 * log_std))


class BagsWithEnd(nn.Module):
    """Weighted bags in the CSR layout (``include_last_offset=True``: the offsets end with the
    total length, one more than the bags), as FBGEMM and TorchRec pass them."""

    def __init__(self, vocab: int = 100, d: int = 8):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, d, mode="sum", include_last_offset=True)
        self.head = nn.Linear(d, 1)

    def forward(self, ids, offsets, weights):
        return self.head(self.emb(ids, offsets, per_sample_weights=weights)).squeeze(-1)


def make_bags_with_end() -> nn.Module:
    torch.manual_seed(0)
    return BagsWithEnd()


class PooledGRU(nn.Module):
    """A churn model over a customer's daily activity with missing days (NaN rows): a GRU over
    the zero-filled series, then the mean of its states over the observed days only."""

    def __init__(self, features: int = 3, hidden: int = 8):
        super().__init__()
        self.gru = nn.GRU(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):  # (B, T, F)
        observed = ~torch.isnan(x).any(-1)
        h, _ = self.gru(torch.nan_to_num(x))
        pooled = (h * observed[..., None]).sum(1) / observed.sum(1, keepdim=True)
        return self.head(pooled).squeeze(-1)


def make_pooled_gru() -> nn.Module:
    torch.manual_seed(0)
    return PooledGRU()
