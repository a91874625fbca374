"""Models built on ``torch.autograd.Function``s written with the less common APIs: a new-style
Function (``forward`` without ctx plus ``setup_context``) for a custom activation, an in-place
one (``ctx.mark_dirty``), a gradient-clipping one under ``@once_differentiable``, and an
argmax straight-through estimator returning its index too (``mark_non_differentiable``,
``set_materialize_grads(False)``). The factories rebuild them for the replay."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

BATCH, D_IN, HIDDEN, N_CLASSES = 8, 6, 10, 3


class LogCompress(torch.autograd.Function):
    """``log(1 + x)`` for inputs assumed to be >= 0, the new-style way."""

    @staticmethod
    def forward(x):
        return torch.log(1 + x)  # the bug: no clamp, a record below -1 is the log of a negative

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / (1 + x)


class Log1pInplace(torch.autograd.Function):
    """``log1p`` written into its input to save memory."""

    @staticmethod
    def forward(ctx, x):
        x.log1p_()  # the bug: an entry below -1 is the log of a negative
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * torch.exp(-y)


class RowNorm(torch.autograd.Function):
    """Each row's norm, with its gradient clipped to [-1, 1] in a hand-written backward."""

    @staticmethod
    def forward(ctx, x):
        n = x.norm(dim=-1, keepdim=True)
        ctx.save_for_backward(x, n)
        return n

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, n = ctx.saved_tensors
        return (grad * x / n).clamp(-1.0, 1.0)  # the bug: / n, 0/0 for an all-zero row


class ArgmaxSTE(torch.autograd.Function):
    """A one-hot of the argmax, with the softmax's gradient of the logits scaled by their
    largest magnitude passed straight through; the index comes back too and has no gradient."""

    @staticmethod
    def forward(ctx, logits):
        idx = logits.argmax(-1)
        hard = F.one_hot(idx, logits.shape[-1]).to(logits.dtype)
        scale = logits.abs().amax(-1, keepdim=True)
        ctx.save_for_backward((logits / scale.clamp_min(1e-6)).softmax(-1), scale)
        ctx.mark_non_differentiable(idx)
        ctx.set_materialize_grads(False)
        return hard, idx

    @staticmethod
    def backward(ctx, grad_hard, grad_idx):
        if grad_hard is None:
            return None
        p, scale = ctx.saved_tensors
        g = p * (grad_hard - (grad_hard * p).sum(-1, keepdim=True))
        return g / scale  # the bug: no clamp as in the forward, / 0 for all-zero logits


class Affine(nn.Module):
    """A learned per-feature scale and shift, starting as the identity."""

    def __init__(self, d: int):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x * self.w + self.b


class Compress(nn.Module):
    def forward(self, x):
        return LogCompress.apply(x)


class InplaceLog(nn.Module):
    def forward(self, x):
        return Log1pInplace.apply(x)


class WithNorm(nn.Module):
    """The rows with their (clipped-gradient) norm appended."""

    def forward(self, x):
        return torch.cat([x, RowNorm.apply(x)], dim=-1)


class Codes(nn.Module):
    """A discrete bottleneck: the argmax one-hot picks a learned code."""

    def __init__(self, d: int, k: int = 4, bias: bool = True):
        super().__init__()
        self.to_logits = nn.Linear(d, k, bias=bias)
        self.codes = nn.Parameter(torch.randn(k, d))
        self.register_buffer("usage", torch.zeros(k))

    def forward(self, x):
        hard, idx = ArgmaxSTE.apply(self.to_logits(x))
        if self.training:
            self.usage += torch.bincount(idx, minlength=self.usage.numel())
        return x + hard @ self.codes


def _head(*first: nn.Module, d: int = D_IN) -> nn.Sequential:
    return nn.Sequential(*first, nn.Linear(d, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, N_CLASSES))


def make_compressed() -> nn.Module:
    torch.manual_seed(0)
    return _head(Compress())


def make_inplace() -> nn.Module:
    torch.manual_seed(0)
    return _head(Affine(D_IN), InplaceLog())


def make_raw_inplace() -> nn.Module:
    """The in-place log straight on the batch (it writes into the loop's tensor)."""
    torch.manual_seed(0)
    return _head(InplaceLog())


def make_normed() -> nn.Module:
    torch.manual_seed(0)
    return _head(nn.Linear(D_IN, D_IN, bias=False), WithNorm(), d=D_IN + 1)


def make_coded() -> nn.Module:
    torch.manual_seed(0)
    return _head(nn.Linear(D_IN, D_IN, bias=False), Codes(D_IN, bias=False))


def make_all() -> nn.Module:
    """All four, for a healthy run."""
    torch.manual_seed(0)
    return nn.Sequential(Compress(), Affine(D_IN), InplaceLog(), Codes(D_IN), WithNorm(),
                         nn.Linear(D_IN + 1, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, N_CLASSES))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs in [0, 1), as the log compression expects."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.rand(BATCH, D_IN, generator=g), torch.randint(0, N_CLASSES, (BATCH,), generator=g)
