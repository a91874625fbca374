"""Research-script training with no ``torch.optim``: a small regressor whose loop updates the
weights itself (``p -= lr * p.grad``, ``p.data.add_(p.grad.data, alpha=-lr)``, or gradients from
``torch.autograd.grad``), with planted bugs: a blank record under a log or a norm's sqrt, a
learning-rate schedule that jumps at one step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IN, HID = 4, 8


class Regressor(nn.Module):
    """``log_inputs``: the features are log-transformed in the forward (log(0) of a blank
    record); ``norm_penalty``: the output adds the norm of the first layer's projection, a
    sqrt of a sum of squares (0 for a blank record: its backward is 0/0); ``linear``: no
    tanh between the layers, whose output then grows with the inputs' scale."""

    def __init__(self, log_inputs: bool = False, norm_penalty: bool = False,
                 linear: bool = False):
        super().__init__()
        self.log_inputs, self.norm_penalty, self.linear = log_inputs, norm_penalty, linear
        self.fc1 = nn.Linear(IN, HID)
        self.fc2 = nn.Linear(HID, 1)

    def forward(self, x):
        if self.log_inputs:
            x = torch.log(x.abs())
        h = self.fc1(x)
        out = self.fc2(h if self.linear else torch.tanh(h))
        if self.norm_penalty:
            z = F.linear(x, self.fc1.weight)
            out = out + torch.sqrt((z * z).sum(1, keepdim=True))
        return out


def make_regressor() -> nn.Module:
    return Regressor()


def make_linear_regressor() -> nn.Module:
    return Regressor(linear=True)


def make_log_regressor() -> nn.Module:
    return Regressor(log_inputs=True)


def make_norm_regressor() -> nn.Module:
    return Regressor(norm_penalty=True)


def batches(steps: int, blank_step: int | None = None, blank_row: int = 0, n: int = 8):
    """``steps`` batches of ``n`` records; record ``blank_row`` of batch ``blank_step`` all 0."""
    g = torch.Generator().manual_seed(0)
    out = []
    for s in range(steps):
        x = torch.randn(n, IN, generator=g) + 2.0
        y = torch.randn(n, 1, generator=g)
        if s == blank_step:
            x[blank_row] = 0.0
        out.append((x, y))
    return out


def sgd_by_hand(model: nn.Module, lr: float, style: str) -> None:
    """One update as research scripts write it, after ``loss.backward()``."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                continue
            if style == "sub":
                p -= lr * p.grad
                p.grad.zero_()
            else:  # the old style, and the gradient dropped
                p.data.add_(p.grad.data, alpha=-lr)
                p.grad = None
