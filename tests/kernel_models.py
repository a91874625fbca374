"""A model with a layer whose kernel takes half types and float32 only, as fused kernels do
(FlashAttention's takes float16 and bfloat16): its float64 re-run raises."""

import torch
from torch import nn


class FusedGelu(nn.Module):
    """GELU through a "fused kernel" that refuses float64."""

    def forward(self, x):
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise RuntimeError(f"fused_gelu: only float16, bfloat16 and float32 are supported, "
                               f"got {x.dtype}")
        return nn.functional.gelu(x)


def make_fused_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), FusedGelu(), nn.Linear(16, 1))


class LogCoshLoss(nn.Module):
    """The log-cosh regression loss, written as its formula: ``cosh`` overflows float32 once
    a residual passes ~89."""

    def forward(self, pred, y):
        return torch.log(torch.cosh(pred.squeeze(-1) - y)).mean()


class LogTargetLoss(nn.Module):
    """Squared error against the log of a positive target, taken in the loss."""

    def forward(self, pred, y):
        return nn.functional.mse_loss(pred.squeeze(-1), torch.log(y))
