"""Losses that raise after a finite forward, for tests/test_loss_raises.py: a mask loss refusing
an empty mask (``ValueError``), a Gaussian-process-style loss whose Cholesky fails on a
repeated row (``LinAlgError``), a CTC loss given a target longer than its input
(``RuntimeError``), and a loss whose custom ``autograd.Function`` raises in backward."""

from __future__ import annotations

import handled_exception_models as M
import torch
import torch.nn as nn
import torch.nn.functional as F


class MaskedCE(nn.Module):
    """Cross-entropy over the rows whose target is not -1; an all-ignored batch refused."""

    def forward(self, out, y):
        keep = y >= 0
        if not keep.any():
            raise ValueError("empty mask: no labelled row in the batch")
        return F.cross_entropy(out[keep], y[keep])


class CholeskyLoss(nn.Module):
    """Cross-entropy plus the log-determinant of the outputs' covariance (a diversity term):
    a batch of one record repeated (a collate bug) makes it singular, which Cholesky refuses."""

    def forward(self, out, y):
        cov = out.T @ out / len(out)
        return F.cross_entropy(out, y) - 1e-3 * torch.linalg.cholesky(cov).diagonal().log().sum()


class CTC(nn.Module):
    """CTC over the outputs as 1-step sequences; a batch holding a target of -1 (a clip whose
    padded length was counted) gives an input length past the sequence's, which torch refuses."""

    def forward(self, out, y):
        n = len(out)
        lengths = torch.full((n,), 1 + int((y < 0).any()))
        return F.ctc_loss(out.log_softmax(-1).unsqueeze(0), y.clamp_min(1).unsqueeze(1), lengths,
                          torch.ones(n, dtype=torch.long))


class Refuse(torch.autograd.Function):
    """The identity, whose backward refuses a batch with an unlabelled row (-1)."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.unlabelled = bool((y < 0).any())
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.unlabelled:
            raise RuntimeError("Refuse.backward: an unlabelled row has no gradient rule")
        return g, None


class RefusingCE(nn.Module):
    def forward(self, out, y):
        return F.cross_entropy(Refuse.apply(out, y), y.clamp_min(0))


class Outlier(torch.autograd.Function):
    """The identity, whose backward refuses a batch holding an outlier feature (|x| > 100)."""

    @staticmethod
    def forward(ctx, h, x):
        ctx.outlier = bool((x.abs() > 100).any())
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.outlier:
            raise RuntimeError("Outlier.backward: no gradient rule for an outlier batch")
        return g, None


class Guarded(M.Net):
    """The normaliser and MLP with the outlier-refusing Function after the first layer."""

    def forward(self, x):
        b = self.body
        return b.fc2(b.act(Outlier.apply(b.fc1(self.norm(x)), x)))


def make_guarded() -> Guarded:
    torch.manual_seed(0)
    return Guarded()


def refused(kind: str, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of batch ``(x, y)`` made so that loss ``kind`` (or the guarded model's backward)
    raises on it; the model's forward stays finite."""
    x, y = x.clone(), y.clone()
    if kind == "target_out_of_range":
        y[3] = M.N_CLASSES + 4
    elif kind == "empty_mask":
        y[:] = -1
    elif kind in ("ctc_length", "backward_in_loss"):
        y[0] = -1
    elif kind == "cholesky":
        x[:] = x[0]  # (one record repeated: a rank-1 covariance)
    else:  # "backward_in_model"
        x[1, 1] = 500.0
    return x, y


LOSSES = {"target_out_of_range": nn.CrossEntropyLoss, "empty_mask": MaskedCE,
          "ctc_length": CTC, "cholesky": CholeskyLoss, "backward_in_loss": RefusingCE,
          "backward_in_model": nn.CrossEntropyLoss}
