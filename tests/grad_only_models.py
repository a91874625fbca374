"""Training with gradients from ``torch.autograd.grad`` and an update by hand, no optimizer:
hand-written SGD (``grads = torch.autograd.grad(loss, params)``, then ``p -= lr * g``), and a
meta-learning loop whose inner step differentiates with ``create_graph=True``. Planted
backward-only traps: the sqrt of each row's spread from its minimum (the gradient of sqrt at 0
is +Inf at every row's minimum), and ``torch.where(x > 0, torch.log(x), 0)`` (the masked branch
still sends 0 / 0 back where a record holds a 0)."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

IN, HID, N = 4, 6, 8


class Spread(nn.Module):
    """Each feature's distance from its row's minimum, square-rooted (forward finite)."""

    def forward(self, h):
        return torch.sqrt(h - h.min(dim=1, keepdim=True).values)


class SafeLog(nn.Module):
    """The log of the positive scaled features, 0 elsewhere: finite forward, NaN backward (into
    the learned scale) at a 0."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(IN))

    def forward(self, x):
        x = x * self.gain
        return torch.where(x > 0, torch.log(x), 0.0)


class Net(nn.Module):
    def __init__(self, spread: bool = False):
        super().__init__()
        self.safelog = SafeLog()
        self.fc1 = nn.Linear(IN, HID)
        self.act = Spread() if spread else nn.Tanh()
        self.fc2 = nn.Linear(HID, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.safelog(x))))


def make_net() -> nn.Module:
    return Net()


def make_spread_net() -> nn.Module:
    return Net(spread=True)


def batches(steps: int, zero_at: tuple[int, int] | None = None, seed: int = 0):
    """``steps`` (x, y); x positive, but for record ``row`` of step ``step`` (``zero_at``),
    whose features are all 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        x, y = torch.rand(N, IN, generator=g) + 0.5, torch.randn(N, 1, generator=g)
        if zero_at is not None and s == zero_at[0]:
            x[zero_at[1]] = 0.0
        out.append((x, y))
    return out


def sgd_step(model: nn.Module, loss: torch.Tensor, lr: float) -> None:
    """Hand-written SGD on the gradients ``torch.autograd.grad`` returns."""
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= lr * g


def maml_step(model: nn.Module, support, query, lr: float, inner_lr: float = 0.1) -> torch.Tensor:
    """One second-order MAML step: an inner step on the support set by ``autograd.grad`` with
    ``create_graph=True`` (fast weights), the query loss through them, the meta-update by hand
    from ``autograd.grad`` of that loss. Returns the query loss."""
    names, params = zip(*model.named_parameters())
    crit = nn.MSELoss()
    inner = crit(model(support[0]), support[1])
    grads = torch.autograd.grad(inner, params, create_graph=True)
    fast = {n: p - inner_lr * g for n, p, g in zip(names, params, grads)}
    outer = crit(functional_call(model, fast, (query[0],)), query[1])
    meta = torch.autograd.grad(outer, params)
    with torch.no_grad():
        for p, g in zip(params, meta):
            p -= lr * g
    return outer


def penalty_step(model: nn.Module, x, y, weights, lr: float, beta: float = 0.01) -> torch.Tensor:
    """Hand SGD on a per-record weighted loss plus the norm of its gradient (a flatness
    penalty): that gradient taken by ``autograd.grad`` with ``create_graph=True`` in the step,
    its norm as the square root of a sum of squares. Returns the weighted loss."""
    params = list(model.parameters())
    loss = (weights * (model(x) - y) ** 2).mean()
    grads = torch.autograd.grad(loss, params, create_graph=True)
    norm = torch.sqrt(sum((g * g).sum() for g in grads))
    total = torch.autograd.grad(loss + beta * norm, params)
    with torch.no_grad():
        for p, g in zip(params, total):
            p -= lr * g
    return loss
