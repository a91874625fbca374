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


class Sequences(Dataset):
    """Token sequences of varying length (3 to 11) and a class each."""

    def __init__(self, n: int = 96):
        g = torch.Generator().manual_seed(1)
        self.seqs = [torch.randint(1, 50, (int(torch.randint(3, 12, (1,), generator=g)),),
                                   generator=g) for _ in range(n)]
        self.labels = [int(s.sum()) % 3 for s in self.seqs]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int):
        return self.seqs[i], self.labels[i]


def pad_with_additive_mask(items):
    """Pad to the longest sequence; the mask is additive: 0 on tokens, -inf on padding."""
    seqs, labels = zip(*items)
    T = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.full((len(seqs), T), float("-inf"))
    for i, s in enumerate(seqs):
        tokens[i, :len(s)], mask[i, :len(s)] = s, 0.0
    return tokens, mask, torch.tensor(labels)


class AttentionPool(nn.Module):
    """Embeds tokens and pools them with one learned query, padding masked additively."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.score = nn.Linear(16, 1)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens, mask):
        h = self.emb(tokens)
        w = torch.softmax(self.score(h).squeeze(-1) + mask, dim=1)
        return self.head((w.unsqueeze(-1) * h).sum(1))


def make_attention_pool() -> nn.Module:
    torch.manual_seed(0)
    return AttentionPool()


class MissingTable(Dataset):
    """Tabular rows with values missing as NaN (10% of the first D - 1 columns); the last
    column is never missing, but for ``late_missing`` (a record whose last value was lost)."""

    def __init__(self, n: int = 256, late_missing: int | None = None):
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(n, D, generator=g)
        self.y = self.x[:, :4].sum(1) + 0.1 * torch.randn(n, generator=g)
        miss = torch.rand(n, D, generator=g) < 0.1
        miss[:, -1] = False
        if late_missing is not None:
            miss[late_missing, -1] = True
        self.x[miss] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Imputing(nn.Module):
    """Fills each missing value with a learned per-column value and tells the MLP which were
    missing; ``leak``: one raw feature goes in without imputation (a log-scaled last column
    added later, assumed never missing)."""

    def __init__(self, leak: bool = False):
        super().__init__()
        self.leak = leak
        self.fill = nn.Parameter(torch.zeros(D))
        self.mlp = nn.Sequential(nn.Linear(2 * D + 1, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        missing = torch.isnan(x)
        filled = torch.where(missing, self.fill.expand_as(x), x)
        extra = x[:, -1:].abs().log1p() if self.leak else torch.zeros_like(x[:, :1])
        return self.mlp(torch.cat([filled, missing.float(), extra], dim=1)).squeeze(-1)


def make_imputing(leak: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return Imputing(leak)


class RowNorm(nn.Module):
    """Standardises each row, without an epsilon: a constant row is 0/0."""

    def forward(self, x):
        return (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)


class ImputedRowNorm(nn.Module):
    """Zero-fills the missing values, then standardises each row."""

    def __init__(self):
        super().__init__()
        self.norm = RowNorm()
        self.mlp = nn.Sequential(nn.Linear(2 * D, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        missing = torch.isnan(x)
        x = torch.nan_to_num(x, nan=0.0)
        return self.mlp(torch.cat([self.norm(x), missing.float()], dim=1)).squeeze(-1)


def make_imputed_row_norm() -> nn.Module:
    torch.manual_seed(0)
    return ImputedRowNorm()


class Features(Dataset):
    """Standardised tabular features and 3 classes; ``corrupt``: one record whose value was
    read as 3e38 (a sentinel of a broken export) after standardisation."""

    def __init__(self, n: int = 600, corrupt: int | None = None):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, D, generator=g)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 1).long()
        if corrupt is not None:
            self.x[corrupt, 3] = 3e38

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.01 * torch.randn(D), self.y[i]  # jitter drawn in the worker


class BatchNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(D)
        self.mlp = nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.mlp(self.bn(x))


def make_batch_norm_mlp() -> nn.Module:
    torch.manual_seed(0)
    return BatchNormMLP()


def missing_labels(n: int = 256, k: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and ``k`` regression targets per row, 20% of the targets missing as NaN."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(n, D, generator=g), torch.randn(n, k, generator=g)
    y[torch.rand(n, k, generator=g) < 0.2] = float("nan")
    return x, y


def nanmean_mse(pred, y):
    """Skips the missing targets in the value only: its backward multiplies their NaN."""
    return ((pred - y) ** 2).nanmean()


def masked_mse(pred, y):
    """Selects the present targets before the op: finite forward and backward."""
    present = ~torch.isnan(y)
    return ((pred[present] - y[present]) ** 2).mean()


def make_multi_target() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, 3))


class UnitNorm(nn.Module):
    """Scales each row to unit length, without an epsilon: an all-zero row is 0/0."""

    def forward(self, x):
        return x / x.norm(dim=1, keepdim=True)


def make_unit_norm_classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(UnitNorm(), nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 2))


class WeightedRecords(Dataset):
    """Dict records with a per-sample loss weight; ``bad``: a record whose weight is NaN."""

    def __init__(self, n: int = 256, bad: int | None = None):
        g = torch.Generator().manual_seed(6)
        self.x, self.y = torch.randn(n, D, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.w = torch.rand(n, generator=g) + 0.5
        if bad is not None:
            self.w[bad] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return {"x": self.x[i], "y": self.y[i], "w": self.w[i], "id": f"rec{i:04d}"}


def make_mlp3() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 3))
