"""Models, hooks and data of ``test_backward_pre_hooks.py``: training code that rewrites
gradients with module backward pre-hooks and installs torch's global module hooks, as
practitioners write it.

- DANN's gradient reversal layer: an ``nn.Identity`` before the domain head whose
  ``register_full_backward_pre_hook`` returns ``(-lambda * grad_output[0],)``, lambda from the
  paper's schedule ``2 / (1 + exp(-10 p)) - 1`` (``grl_hook``, ``dann_lambda``), or a
  ``GradReverse`` module the factory builds, its lambda an attribute the loop sets;
- a per-module gradient normaliser as a backward pre-hook, ``grad_output / its norm``
  (``unit_grad_output``);
- global logging hooks (``register_module_forward_hook``, ``register_module_full_backward_hook``)
  that read every module's output and gradient (``GlobalLogger``);
- a forward pre-hook standardising a layer's input with a running std (``RunningStandardise``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_full_backward_hook,
)

D_IN, HIDDEN, N_CLASSES = 8, 16, 3


class DANN(nn.Module):
    """A feature extractor, a label classifier and a domain head behind a gradient reversal
    layer (an identity whose backward pre-hook negates the gradient)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU())
        self.classifier = nn.Linear(HIDDEN, N_CLASSES)
        self.grl = nn.Identity()
        self.domain = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def forward(self, x):
        h = self.features(x)
        return torch.cat([self.classifier(h), self.domain(self.grl(h))], dim=1)


def make_dann() -> DANN:
    torch.manual_seed(0)
    return DANN()


def dann_lambda(step: int, total: int) -> float:
    """DANN's schedule of the reversal's weight, 0 at the start and 1 at the end."""
    p = torch.tensor(float(step)) / total  # the bug with total == 0: 0/0 at step 0
    return float(2.0 / (1.0 + torch.exp(-10.0 * p)) - 1.0)


def grl_hook(schedule: dict):
    """The gradient reversal as a full backward pre-hook reading lambda from ``schedule``."""
    def reverse(module, grad_output):
        return (-schedule["lambda"] * grad_output[0],)
    return reverse


def unit_grad_output(module, grad_output):
    """A per-module gradient normaliser: the gradient into the module scaled to norm 1."""
    g = grad_output[0]
    return (g / g.norm(),)  # the bug: no eps; a dead branch's gradient is all 0, 0/0


def make_normalised_dann() -> DANN:
    """The DANN with the gradient normaliser registered where it is built, on the domain head's
    first layer (before its ReLU)."""
    model = make_dann()
    model.domain[0].register_full_backward_pre_hook(unit_grad_output)
    return model


class GlobalLogger:
    """Logging through torch's global module hooks: every module's output mean and gradient
    norm, as a script installs it for a debugging session (and removes it after)."""

    def __init__(self):
        self.seen = []
        self.handles = [register_module_forward_hook(self.forward),
                        register_module_full_backward_hook(self.backward)]

    def forward(self, module, args, out):
        if isinstance(out, torch.Tensor):
            self.seen.append(out.detach().float().mean().item())

    def backward(self, module, grad_input, grad_output):
        if grad_output and isinstance(grad_output[0], torch.Tensor):
            self.seen.append(grad_output[0].norm().item())

    def remove(self):
        for h in self.handles:
            h.remove()


def data(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    d = (torch.arange(n) % 2).float()  # the domain: source 0, target 1
    return x, y, d


def batches(xs, bs: int = 16):
    x, y, d = xs
    return [(x[i:i + bs], y[i:i + bs], d[i:i + bs]) for i in range(0, len(x), bs)]


class DANNLoss(nn.Module):
    """Label cross entropy plus the domain head's binary cross entropy."""

    def forward(self, out, y, d):
        return nn.functional.cross_entropy(out[:, :N_CLASSES], y) + \
            nn.functional.binary_cross_entropy_with_logits(out[:, N_CLASSES], d)


class GradReverse(nn.Module):
    """The gradient reversal layer as a module: identity forward, its backward pre-hook
    negating the gradient by the weight the loop sets each step (``grl.lambd = ...``)."""

    def __init__(self):
        super().__init__()
        self.lambd = 0.0
        self.register_full_backward_pre_hook(lambda m, grad_output: (-m.lambd * grad_output[0],))

    def forward(self, x):
        return x.view_as(x)


def make_grl_dann() -> DANN:
    """The DANN with its reversal a :class:`GradReverse`, registered where it is built."""
    model = make_dann()
    model.grl = GradReverse()
    return model


class RunningStandardise:
    """A forward pre-hook standardising a layer's input with a running std of each feature
    (an exponential average of the batches' std), registered where the model is built."""

    def __init__(self, momentum: float = 0.1):
        self.momentum, self.std = momentum, None

    def __call__(self, module, args):
        x = args[0]
        s = x.detach().std(0)
        self.std = s if self.std is None else (1 - self.momentum) * self.std + self.momentum * s
        return (x / self.std,)  # the bug: no eps; a feature constant in every batch has std 0


def make_std_dann() -> DANN:
    """The DANN with the running standardisation on its first layer's input."""
    model = make_dann()
    model.features[0].register_forward_pre_hook(RunningStandardise())
    return model
