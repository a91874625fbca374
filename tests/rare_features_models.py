"""Models and loops of ``test_rare_features.py``: PyTorch features training code uses rarely,
as their users write them.

- ``torch.autograd.graph.register_multi_grad_hook`` over all parameters, modes "all" (a global
  gradient norm logged once every gradient is ready) and "any" (the first gradient's peak);
- an inner optimizer built with ``differentiable=True`` (Meta-SGD's learned learning rate:
  the inner update itself in the outer graph) over clones of the parameters;
- a model made by ``torch.export.export(model, args).module()`` and then fine-tuned (a
  ``GraphModule`` of aten calls, no ``call_module`` of its submodules);
- ``torch.nn.utils.parametrize`` with ``unsafe=True`` (a weight stored flat, another with
  rows normalised);
- ``torch.func.functional_call`` with a mean teacher's EMA copy of the weights swapped in for
  the teacher's forward inside each step.
"""

from __future__ import annotations

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.func import functional_call

D_IN, HIDDEN, N_CLASSES = 8, 16, 3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Standardise(nn.Module):
    def forward(self, x):
        mean = x.mean(dim=1, keepdim=True)
        return (x - mean) / x.std(dim=1, keepdim=True)  # the bug: no eps, 0/0 on a constant row


class StandardisedMLP(MLP):
    def __init__(self):
        super().__init__()
        self.norm = Standardise()

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.norm(x))))


def make_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()


def make_exported() -> nn.Module:
    """The standardising MLP through ``torch.export`` (a dynamic batch size), as fine-tuned."""
    torch.manual_seed(0)
    batch = torch.export.Dim("batch")
    ep = torch.export.export(StandardisedMLP(), (torch.randn(4, D_IN),),
                             dynamic_shapes=({0: batch},))
    return ep.module()


class Flat(nn.Module):
    """A weight kept as a flat vector (a shape change: ``unsafe=True``)."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape

    def forward(self, w):
        return w.view(self.shape)

    def right_inverse(self, w):
        return w.reshape(-1)


class UnitRows(nn.Module):
    def forward(self, w):
        return w / w.norm(dim=1, keepdim=True)


def make_unsafe() -> MLP:
    model = make_mlp()
    parametrize.register_parametrization(model.fc1, "weight", Flat(model.fc1.weight.shape),
                                         unsafe=True)
    parametrize.register_parametrization(model.fc2, "weight", UnitRows(), unsafe=True)
    return model


def make_meta_sgd() -> MLP:
    """The MLP with Meta-SGD's learned (log) inner learning rate."""
    model = make_mlp()
    model.log_lr = nn.Parameter(torch.tensor(-3.0))
    return model


def log_gradients(model: nn.Module, log: list) -> None:
    """Multi-gradient hooks: the global norm once all are ready, the first one's peak."""
    params = list(model.parameters())
    torch.autograd.graph.register_multi_grad_hook(
        params, lambda gs: log.append(torch.stack([g.norm() for g in gs if g is not None]).norm()),
        mode="all")
    torch.autograd.graph.register_multi_grad_hook(params, lambda g: log.append(g.abs().max()),
                                                  mode="any")


def meta_sgd_loss(model: nn.Module, crit, x, y):
    """Meta-SGD's outer loss: one differentiable inner SGD step on the first half of the batch
    (clones of the weights, its rate ``exp(log_lr)`` learned), the loss of the adapted weights
    on the second half, differentiated through the update."""
    half = len(x) // 2
    names = [n for n, _ in model.named_parameters() if n != "log_lr"]
    inner = crit(model(x[:half]), y[:half])
    grads = torch.autograd.grad(inner, [model.get_parameter(n) for n in names],
                                create_graph=True)
    fast = {n: model.get_parameter(n).clone() for n in names}
    sgd = torch.optim.SGD(list(fast.values()), lr=model.log_lr.exp(), differentiable=True)
    for p, g in zip(fast.values(), grads):
        p.grad = g
    sgd.step()
    return crit(functional_call(model, fast, (x[half:],)), y[half:])


class MeanTeacher:
    """An EMA copy of the weights, swapped in by ``functional_call`` for the teacher's forward;
    ``bad_decay_step``: the step whose decay is NaN (a schedule over 0 steps)."""

    def __init__(self, model: nn.Module, bad_decay_step: int | None = None):
        self.ema = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.bad = bad_decay_step

    def targets(self, model: nn.Module, x):
        with torch.no_grad():
            return functional_call(model, self.ema, (x + 0.1,)).softmax(-1)

    def update(self, model: nn.Module, step: int) -> None:
        decay = float("nan") if step == self.bad else 0.9  # the bug
        with torch.no_grad():
            for n, p in model.named_parameters():
                self.ema[n].mul_(decay).add_(p, alpha=1 - decay)


def data(n: int = 64, nan_row: int | None = None, constant_row: int | None = None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, D_IN, generator=g)
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    if nan_row is not None:
        x[nan_row, 2] = float("nan")  # the bug: a missing value read as NaN
    if constant_row is not None:
        x[constant_row] = 0.5  # the bug: a blank record, standardised by its std of 0
    return x, y
