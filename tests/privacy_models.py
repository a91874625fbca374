"""Models of the differential-privacy tests (``test_privacy.py``): DP-SGD by hand, the Opacus
way (per-sample gradients from module hooks, per-sample clipping, Gaussian noise)."""

from __future__ import annotations

import torch
from torch import nn


def make_classifier() -> nn.Module:
    """A small tabular classifier, as the Opacus tutorials train (Adult, credit scoring)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))


def make_logit_model() -> nn.Module:
    """A classifier whose head returns log-probabilities (log_softmax), as DP tutorials do
    with NLLLoss."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 2), nn.LogSoftmax(-1))


class MaskedCrossEntropy(nn.Module):
    """Cross-entropy summed over the real records of a padded batch (``keep`` is 0 on padding
    rows), the fixed-shape batches that per-sample-gradient code pads to."""

    def forward(self, logits: torch.Tensor, y: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return (nn.functional.cross_entropy(logits, y, reduction="none") * keep).sum()


class PerSampleMaskedCrossEntropy(nn.Module):
    """Each record's cross-entropy, 0 on padding rows (``keep`` = 0): the per-sample losses
    that ghost clipping reweights by each sample's clip factor before its second backward."""

    def forward(self, logits: torch.Tensor, y: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, y, reduction="none") * keep


class GradSampleModule(nn.Module):
    """Opacus's wrapper as ``PrivacyEngine.make_private`` returns it: the model kept as
    ``_module``, called through (its per-sample hooks left out here)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._module = module

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)
