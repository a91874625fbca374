"""Models built on the user's own ops, written as people write fused kernels: a
``torch.library.custom_op`` with a Python implementation, its fake and its autograd formula; one
that writes its result into an ``out`` buffer (``mutates_args``); and a
``torch.autograd.Function`` with a hand-written backward. The factories rebuild them for the
replay (``custom_ops_models:make_normed``)."""

from __future__ import annotations

import torch
from torch import nn

BATCH, D_IN, HIDDEN, N_CLASSES = 8, 6, 10, 3


@torch.library.custom_op("userops::fused_norm", mutates_args=())
def fused_norm(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)  # the bug: no eps, 0/0 of an all-zero row


@fused_norm.register_fake
def _(x):
    return torch.empty_like(x)


def _norm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output)


def _norm_backward(ctx, grad):
    x, y = ctx.saved_tensors
    return (grad - y * (grad * y).sum(-1, keepdim=True)) / x.norm(dim=-1, keepdim=True)


torch.library.register_autograd("userops::fused_norm", _norm_backward,
                                setup_context=_norm_setup)


@torch.library.custom_op("userops::scale_into", mutates_args=("out",))
def scale_into(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x / scale)  # the bug: a row whose largest magnitude is 0 is 0/0


class FusedNorm(nn.Module):
    def forward(self, x):
        return torch.ops.userops.fused_norm(x)


class MaxScale(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        torch.ops.userops.scale_into(x, x.abs().amax(-1, keepdim=True), out)
        return out


class Gain(torch.autograd.Function):
    """``x * g``, whose hand-written backward takes g's gradient as ``grad * y / g``."""

    @staticmethod
    def forward(ctx, x, g):
        y = x * g
        ctx.save_for_backward(x, g, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, g, y = ctx.saved_tensors
        return grad * g, (grad * y * g / x).sum(0)  # the bug: / x, 0/0 where x is 0


class Gained(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return Gain.apply(x, self.g)


def _head(first: nn.Module) -> nn.Sequential:
    return nn.Sequential(first, nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, N_CLASSES))


def make_normed() -> nn.Module:
    torch.manual_seed(0)
    return _head(FusedNorm())


def make_scaled() -> nn.Module:
    torch.manual_seed(0)
    return _head(MaxScale())


def make_gained() -> nn.Module:
    torch.manual_seed(0)
    return _head(Gained(D_IN))


def make_all() -> nn.Module:
    """All three, for a healthy run."""
    torch.manual_seed(0)
    return nn.Sequential(Gained(D_IN), FusedNorm(), MaxScale(), nn.Linear(D_IN, N_CLASSES))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D_IN, generator=g), torch.randint(0, N_CLASSES, (BATCH,), generator=g)
