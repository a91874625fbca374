"""Training procedures that are not a plain backward and step: hand-written optimizers (LAMB's
trust ratio), SAM's two forward-backward passes per step (for tests/test_procedures.py)."""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
from torch import nn

D, H, C = 16, 32, 4


class LAMB(torch.optim.Optimizer):
    """LAMB as often written by hand: Adam's direction scaled by the trust ratio
    ||w|| / ||update||, which is 0/0 for a zero-initialised parameter with a zero gradient."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["step"] += 1
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m = st["m"] / (1 - b1 ** st["step"])
                v = st["v"] / (1 - b2 ** st["step"])
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                trust = p.norm() / update.norm()  # the bug: no guard for a zero norm
                p.sub_(group["lr"] * trust * update)


class TwoHead(nn.Module):
    """A trunk with a main head and an auxiliary head, zero-initialised, whose loss the loop
    adds only from some step on."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU())
        self.head = nn.Linear(H, C)
        self.aux = nn.Linear(H, 1)
        nn.init.zeros_(self.aux.weight)
        nn.init.zeros_(self.aux.bias)

    def forward(self, x):
        h = self.trunk(x)
        return self.head(h), self.aux(h)


def make_lamb_two_head() -> dict:
    return {"model": TwoHead(), "optimizer": lambda groups: LAMB(groups)}


def batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, D, generator=g)
    return x, x[:, :C].argmax(1)


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as the widely copied wrapper writes it (first_step /
    second_step around a base optimizer), with ``eps`` for the ascent's scale: 0 reproduces
    the copies that leave it out."""

    def __init__(self, params, base_optimizer, rho=0.05, eps=1e-12, **kwargs):
        super().__init__(params, {"rho": rho, "eps": eps, **kwargs})
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        norm = torch.norm(torch.stack([p.grad.norm() for g in self.param_groups
                                       for p in g["params"] if p.grad is not None]))
        for group in self.param_groups:
            scale = group["rho"] / (norm + group["eps"])  # rho / 0 = inf for a zero gradient
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * scale)
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        self.zero_grad()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, C)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_mlp() -> MLP:
    return MLP()


def labelled_ce(out, y, labelled):
    """Semi-supervised: cross entropy over the labelled rows only, averaged over the batch (a
    batch without labelled rows gives 0 and gradients of exactly 0)."""
    return (F.cross_entropy(out, y, reduction="none") * labelled).mean()


class Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al. 2019) around a base optimizer, as timm writes it: every k steps
    the slow weights move alpha of the way to the fast ones, which are reset to them. Its own
    state holds the slow weights; the base optimizer's moments are in ``base.state``."""

    def __init__(self, base, k=5, alpha=0.5):
        self.base, self.k, self.alpha = base, k, alpha
        self.param_groups, self.defaults = base.param_groups, base.defaults
        self.state = collections.defaultdict(dict)
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()
        for group in self.param_groups:
            group.setdefault("lookahead_step", 0)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.base.step(closure)
        for group in self.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % self.k:
                continue
            for p in group["params"]:
                slow = self.state[p].setdefault("slow", p.detach().clone())
                slow.add_(p - slow, alpha=self.alpha)
                p.copy_(slow)
        return loss


def make_lookahead_mlp() -> dict:
    return {"model": MLP(), "optimizer": lambda groups: Lookahead(torch.optim.Adam(groups))}
