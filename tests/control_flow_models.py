"""Models whose forward branches or loops with torch's control-flow operators, as users write
them: ``torch.cond`` choosing between two submodules from a batch statistic, a
``torch.while_loop`` refining an estimate (Newton's square root), each with a bug planted in
the branch or the loop body."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

WIDTH = 8


class LogScale(nn.Module):
    """Log-compresses its input: no clamp, so a value below -shift is a NaN."""

    def __init__(self, shift: float = 3.0):
        super().__init__()
        self.shift = shift

    def forward(self, h):
        return torch.log(h + self.shift)  # no clamp: branch log


class CentredRoot(nn.Module):
    """A root of each row's distance from its minimum: finite, but d sqrt(u)/du at u = 0 is
    inf, times the 0 upstream: NaN in the backward only."""

    def forward(self, h):
        return torch.sqrt(h - h.min(dim=1, keepdim=True).values)  # 0 at the row minimum


class Gate(nn.Module):
    """``torch.cond(h.mean() > -1e3, self.pos.forward, self.neg, (h,))``: the branch a statistic
    picks; ``modules``: the submodule itself as the branch (its hooks run inside the cond)."""

    def __init__(self, pos: nn.Module, ckpt: bool = False, modules: bool = False):
        super().__init__()
        self.pos, self.ckpt, self.modules = pos, ckpt, modules

    def neg(self, h):
        return h.clone()

    def branch(self, h):
        with warnings.catch_warnings():  # (dynamo's tracing of cond reads a non-leaf's .grad)
            warnings.simplefilter("ignore", UserWarning)
            return torch.cond(h.mean() > -1e3, self.pos if self.modules else self.pos.forward,
                              self.neg, (h,))

    def forward(self, h):
        if self.ckpt:
            return checkpoint(self.branch, h, use_reentrant=False)
        return self.branch(h)


class NewtonRoot(nn.Module):
    """``torch.while_loop``: three Newton steps z <- (z + h / z) / 2 towards sqrt(h), from
    z = h: a row of zeros is 0 / 0."""

    def forward(self, h):
        def more(i, z):
            return i < 3

        def step(i, z):
            return i + 1, (z + h / z) / 2  # no eps: loop body

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.while_loop(more, step, (torch.zeros((), dtype=torch.long), h))[1]


class RootRefine(nn.Module):
    """``torch.while_loop`` iterating z <- sqrt(z * z + h) from z = h: finite, but a row of
    zeros is sqrt at 0, whose derivative is a pole: NaN in the backward only."""

    def forward(self, h):
        def more(i, z):
            return i < 2

        def step(i, z):
            return i + 1, torch.sqrt(z * z + h)  # no eps: loop root

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.while_loop(more, step, (torch.zeros((), dtype=torch.long), h))[1]


class LinearRefine(nn.Module):
    """``torch.while_loop`` whose body calls a submodule: z <- tanh(f(z)), twice."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        def more(i, z):
            return i < 2

        def step(i, z):
            return i + 1, torch.tanh(self.f(z))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.while_loop(more, step, (torch.zeros((), dtype=torch.long), h))[1]


class Net(nn.Module):
    def __init__(self, mid: nn.Module, squash: bool = False):
        super().__init__()
        self.inp = nn.Linear(4, WIDTH, bias=False)  # a record of zeros stays 0
        self.mid = mid
        self.squash = squash
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        h = self.inp(x)
        h = h * h if self.squash else h  # (non-negative for the square root)
        return self.head(torch.tanh(self.mid(h))).squeeze(-1)


def make_cond_log():
    return Net(Gate(LogScale()))


def make_cond_log_modules():
    return Net(Gate(LogScale(), modules=True))


def make_linear_refine():
    return Net(LinearRefine())


def make_cond_log_ckpt():
    return Net(Gate(LogScale(), ckpt=True))


def make_cond_root():
    return Net(Gate(CentredRoot()))


def make_newton():
    return Net(NewtonRoot(), squash=True)


def make_root_refine():
    return Net(RootRefine(), squash=True)


def make_compiled_cond_log():
    return torch.compile(make_cond_log(), backend="eager")
