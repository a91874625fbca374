"""Models and data of the Opacus tests (``test_opacus_dp.py``): differentially private training
with the real Opacus library (``PrivacyEngine.make_private``: a GradSampleModule computing
per-sample gradients with its own hooks, a DPOptimizer clipping and noising them, a
DPDataLoader drawing Poisson batches)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_classifier() -> nn.Module:
    """A small tabular classifier, as the Opacus tutorials train (Adult, credit scoring)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))


def dataset(n: int = 256, seed: int = 1) -> TensorDataset:
    """Tabular records (10 features) and binary labels."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 10, generator=g), torch.randint(0, 2, (n,), generator=g))


class FocalLoss(nn.Module):
    """Focal loss (Lin et al.) with a focusing exponent below 1, ``(1 - p) ** gamma * -log p``:
    a record the model is sure of has p = 1 exactly in float32, and the power's derivative
    ``gamma * (1 - p) ** (gamma - 1)`` at 0 is inf, times the 0 of ``1 - p``'s path: NaN in the
    backward alone."""

    def __init__(self, gamma: float = 0.5):
        super().__init__()
        self.gamma = gamma

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logp = logits.log_softmax(-1).gather(1, y[:, None]).squeeze(1)
        return ((1 - logp.exp()) ** self.gamma * -logp).mean()


class RecordNorm(nn.Module):
    """A layer norm written by hand, ``gamma * (x - mean) / std + beta`` without an eps: a
    layer Opacus has no per-sample gradient rule for (it computes them with torch.func's vmap,
    its functorch fallback); a record whose features are one value is 0/0."""

    def __init__(self, n: int):
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gamma * (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True) + self.beta


def make_record_norm() -> nn.Module:
    """The classifier behind the hand-written norm (parameters Opacus's hooks do not know)."""
    torch.manual_seed(0)
    return nn.Sequential(RecordNorm(10), nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))


class SqrtGate(nn.Module):
    """A learned square-root activation, ``where(h > 0, sqrt(scale * h), 0)``: a layer
    Opacus has no rule for (its functorch fallback computes the per-sample gradients). The
    forward is finite, the sqrt of the negative entries discarded by ``where``; its backward
    multiplies their 0 gradient by sqrt's NaN derivative there."""

    def __init__(self, n: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.where(h > 0, (self.scale * h).sqrt(), torch.zeros_like(h))


def make_sqrt_gate() -> nn.Module:
    """The classifier with the learned square-root activation."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), SqrtGate(16), nn.Linear(16, 2))
