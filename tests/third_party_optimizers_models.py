"""Training with the optimizers of ``pytorch_optimizer`` (4.1.0) swapped in as its users do:
a small tabular classifier (a feature mask passed into ``forward``), its ``DataLoader``, and
the factories the replay rebuilds the model from. Planted bugs live in the data generator (a
feature column that is 0 in every record, a NaN record) and in the optimizers' settings the
tests pick (an eps of 0, Lion's lr, Prodigy's d0), or in the model (a positive scale SAM's
perturbation pushes below 0)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 8, 3


class Tabular(nn.Module):
    """An MLP over features with a per-feature ``mask`` (1 = measured) passed into forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 16)
        self.act = nn.GELU()
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x, mask):
        return self.out(self.act(self.inp(x * mask)))


class ScaledTabular(Tabular):
    """A learned per-feature noise scale, its std taken as ``sqrt(scale)`` of a positive
    parameter kept near 0 (a heteroscedastic input layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((FEATURES,), 1e-4))

    def forward(self, x, mask):
        std = torch.sqrt(self.scale)  # the bug: a parameter near 0 under sqrt, no softplus
        return self.out(self.act(self.inp(x * mask / (1 + std))))


class LabelSmoothed(nn.Module):
    """A user-defined loss wrapper: cross-entropy with label smoothing, mean over the batch."""

    def __init__(self, smoothing: float = 0.05) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss(label_smoothing=smoothing)

    def forward(self, logits, y):
        return self.ce(logits, y)


def data(n: int = 128, dead_feature: int | None = None, nan_row: int | None = None,
         seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    mask = torch.ones(n, FEATURES)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    if dead_feature is not None:  # a sensor that never reported: 0 in every record
        x[:, dead_feature] = 0.0
    if nan_row is not None:
        x[nan_row, 3] = float("nan")
    return x, mask, y


def loader(batch_size: int = 16, **kw) -> DataLoader:
    return DataLoader(TensorDataset(*data(**kw)), batch_size=batch_size, shuffle=False)


def make_model() -> Tabular:
    torch.manual_seed(0)
    return Tabular()


def make_scaled() -> ScaledTabular:
    torch.manual_seed(0)
    return ScaledTabular()
