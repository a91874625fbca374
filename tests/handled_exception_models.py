"""Tiny models for loops that handle an exception and go on (tests/test_handled_exceptions.py):
a normaliser without eps (a constant row is 0/0 in ``norm``) before an MLP whose forward raises
what ``RAISE`` holds (an out-of-memory error, a Ctrl-C), and one that refuses a malformed batch
(NaN features) with a ``ValueError`` before any layer runs."""

from __future__ import annotations

import torch
import torch.nn as nn

D_IN, N_CLASSES = 6, 3
RAISE: dict[str, BaseException] = {}  # "body" -> raised by the next Body.forward


class Norm(nn.Module):
    def forward(self, x):
        return (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)  # the bug: no eps


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, N_CLASSES)

    def forward(self, x):
        h = self.act(self.fc1(x))
        if (e := RAISE.pop("body", None)) is not None:
            raise e
        return self.fc2(h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.body = Norm(), Body()

    def forward(self, x):
        return self.body(self.norm(x))


class Checked(Net):
    def forward(self, x):
        if torch.isnan(x).any():
            raise ValueError("malformed batch: NaN features")
        return super().forward(x)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def make_checked() -> Checked:
    torch.manual_seed(0)
    return Checked()


def batches(n: int, blank: int | None = None, row: int = 4, malformed: int | None = None):
    """``n`` (x, y) batches of 8; batch ``blank``'s ``row`` constant (0/0 in ``norm``), batch
    ``malformed``'s holding a NaN feature."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(8, D_IN, generator=g), torch.randint(0, N_CLASSES, (8,), generator=g)
        if i == blank:
            x[row] = 2.0
        if i == malformed:
            x[1, 2] = float("nan")
        out.append((x, y))
    return out
