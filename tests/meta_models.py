"""MAML's sine-regression network (Finn et al. 2017): the inner loop adapts its parameters with
``torch.func.functional_call``, so a step's later forwards run with weights the model does not
hold."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call


class SineNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                                 nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def make_model() -> SineNet:
    torch.manual_seed(0)
    return SineNet()


def task(g: torch.Generator):
    amp, phase = torch.rand(1, generator=g) * 4.9 + 0.1, torch.rand(1, generator=g) * 3.14
    x = torch.rand(20, 1, generator=g) * 10 - 5
    y = amp * torch.sin(x + phase)
    return x[:10], y[:10], x[10:], y[10:]


def meta_step(model, crit, opt, tasks, inner_lr: float) -> None:
    """One outer update over ``tasks``: one inner SGD step on each support set (a second-order
    graph), the query losses averaged."""
    opt.zero_grad()
    total = 0.0
    for xs, ys, xq, yq in tasks:
        params = dict(model.named_parameters())
        loss = crit(functional_call(model, params, (xs,)), ys)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        adapted = {n: p - inner_lr * g for (n, p), g in zip(params.items(), grads)}
        total = total + crit(functional_call(model, adapted, (xq,)), yq)
    (total / len(tasks)).backward()
    opt.step()
