"""PyTorch-Ignite training as its users write it, for ``test_ignite_stack``: a set classifier
whose ``forward(x, mask)`` pools a padded set of items over its mask (the batch is
``((x, mask), y)``, unpacked by a ``prepare_batch`` and ``model_fn``), a tabular regressor, a
hand-written softmax NLL, and the handlers an Ignite loop attaches between iterations (a
structured pruning step, a row renormalisation of the classifier head)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

F_IN, ITEMS, HID, CLASSES = 6, 5, 16, 3


class SetClassifier(nn.Module):
    """DeepSets: items embedded, mean-pooled over the mask, then the pooled vector and its
    length (a hand-written norm) classified."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(F_IN, HID), nn.ReLU(), nn.Linear(HID, HID))
        self.head = nn.Linear(HID + 1, CLASSES)

    def forward(self, x, mask):
        h = self.embed(x) * mask.unsqueeze(-1)
        z = h.sum(1) / mask.sum(1, keepdim=True).clamp_min(1.0)
        length = torch.sqrt((z * z).sum(1, keepdim=True))  # backward 1/(2*0) at an empty set
        return self.head(torch.cat([z, length], 1))


def make_set():
    torch.manual_seed(0)
    return SetClassifier()


def make_regressor():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(F_IN, HID), nn.Tanh(), nn.Linear(HID, 1))


def sets(n, nan_at=(), empty_at=(), scaled_at=(), scale=1e4):
    """``n`` sets of up to ``ITEMS`` items: rows ``nan_at`` with a NaN feature, ``empty_at``
    with no item, ``scaled_at`` with features ``scale`` times too large (a unit error) and
    labelled with the next class (an annotator's slip on the same broken record)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, ITEMS, F_IN, generator=g)
    lengths = torch.randint(1, ITEMS + 1, (n,), generator=g)
    mask = (torch.arange(ITEMS)[None] < lengths[:, None]).float()
    y = (x[:, :, 0] * mask).sum(1).gt(0).long() + (lengths > 3).long()
    for i in nan_at:
        x[i, 0, 2] = float("nan")
    for i in empty_at:
        mask[i] = 0.0
    for i in scaled_at:
        x[i] *= scale
        y[i] = (y[i] + 1) % CLASSES
    return TensorDataset(x, mask, y)


def tabular(n):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, F_IN, generator=g)
    return TensorDataset(x, (x @ torch.linspace(-1, 1, F_IN)).unsqueeze(1))


def prepare_batch(batch, device=None, non_blocking=False):
    """Ignite's ``prepare_batch`` for ``(x, mask, y)``: ``((x, mask), y)``."""
    x, mask, y = (t.to(device) if device else t for t in batch)
    return (x, mask), y


def model_fn(model, xm):
    return model(*xm)


class SoftmaxNLL(nn.Module):
    """A hand-written negative log-likelihood of softmax probabilities (no log_softmax)."""

    def forward(self, logits, y):
        p = logits.softmax(1)
        return -p.gather(1, y[:, None]).log().mean()


def prune_weakest_rows(linear, k=1):
    """Structured pruning in place: the ``k`` rows of smallest L2 norm set to 0."""
    with torch.no_grad():
        rows = linear.weight.norm(dim=1).argsort()[:k]
        linear.weight[rows] = 0.0


def renormalise_rows(linear):
    """A cosine head's constraint: each row of the weight scaled to unit length."""
    with torch.no_grad():
        linear.weight.div_(linear.weight.norm(dim=1, keepdim=True))


class FastLayerNorm(nn.Module):
    """A hand-written layer norm with the one-pass variance ``E[h^2] - E[h]^2``."""

    def __init__(self, eps=1e-5):
        super().__init__()
        self.eps = eps

    def forward(self, h):
        mean = h.mean(-1, keepdim=True)
        var = (h * h).mean(-1, keepdim=True) - mean * mean
        return (h - mean) / torch.sqrt(var + self.eps)


def make_normed_regressor():
    torch.manual_seed(0)
    return nn.Sequential(FastLayerNorm(), nn.Linear(F_IN, HID), nn.Tanh(), nn.Linear(HID, 1))


def offset_tabular(n, offset_at=(), offset=3e4):
    """``tabular`` with rows ``offset_at`` shifted by ``offset`` (a sensor's raw counts)."""
    ds = tabular(n)
    x, y = ds.tensors
    for i in offset_at:
        x[i] += offset
    return TensorDataset(x, y)
