"""Training whose loss takes forward-mode derivatives, for ``test_forward_mode_training``.

- ``FlowNet`` with ``meanflow_loss``: a MeanFlow / consistency-model loss (Geng et al. 2025,
  Song et al. 2023): the time derivative of the network along the flow by
  ``torch.func.jvp(lambda z, t: model(z, t), (z, t), (v, ones))``, the tangent part of the
  regression target (stop-gradient), the model run under the jvp only; ``meanflow_terms`` the
  same loss given the plain forward's output and the model (the jvp inside ``loss_fn``). The
  time embedding is ``sqrt(t)``, infinite in slope at ``t = 0``: only the JVP sees it.
- ``jvp_penalty``: a Jacobian-vector smoothness penalty by ``torch.autograd.forward_ad``
  (``dual_level`` / ``make_dual`` / ``unpack_dual``), ``||J v|| / ||v||`` per sample (no eps:
  a direction masked to 0 is 0/0); ``smooth_loss`` the task loss plus it, given the model.
- ``dp_sgd_step``: DP-SGD by hand: per-sample gradients by ``vmap(grad(...))`` over
  ``functional_call``, each clipped by ``min(norm, C) / norm`` (no eps: a padding record's
  gradient is 0, its norm 0), the clipped mean written into ``p.grad`` and ``opt.step()``.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

# ---------------------------------------------------------------------------------------------
# MeanFlow: d/dt u(z_t, t) by torch.func.jvp


class FlowNet(nn.Module):
    def __init__(self, d: int = 4, hidden: int = 32):
        super().__init__()
        self.embed = nn.Linear(1, hidden)
        self.inp = nn.Linear(d, hidden)
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(hidden, d))

    def forward(self, z, t):
        # the bug: sqrt(t) as the time feature, its slope 1/(2 sqrt t) is inf at t = 0
        temb = self.embed(torch.sqrt(t)[:, None])
        return self.out(self.inp(z) + temb)


def make_flownet():
    torch.manual_seed(0)
    return FlowNet()


def meanflow_loss(model, x, noise, t):
    z = (1 - t[:, None]) * x + t[:, None] * noise
    v = noise - x
    u, dudt = jvp(lambda z_, t_: model(z_, t_), (z, t), (v, torch.ones_like(t)))
    target = (v - t[:, None] * dudt).detach()
    return ((u - target) ** 2).mean()


def flow_batches(steps: int, zero_t_at: int | None = None, row: int = 3, batch: int = 8):
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        x = torch.randn(batch, 4, generator=g)
        noise = torch.randn(batch, 4, generator=g)
        t = torch.rand(batch, generator=g)
        if step == zero_t_at:
            t[row] = 0.0  # a sampler that draws t from [0, 1] hits the end point
        yield x, noise, t


# ---------------------------------------------------------------------------------------------
# a Jacobian-vector penalty by torch.autograd.forward_ad


class Regressor(nn.Module):
    def __init__(self, d: int = 6, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


def make_regressor():
    torch.manual_seed(0)
    return Regressor()


def jvp_penalty(model, x, v):
    """``||J v|| / ||v||`` per sample, through a dual tensor."""
    with fwAD.dual_level():
        out = model(fwAD.make_dual(x, v))
        jv = fwAD.unpack_dual(out).tangent
    return (jv.norm(dim=-1) / v.norm(dim=-1)).mean()


def regression_batches(steps: int, zero_v_at: int | None = None, row: int = 5, batch: int = 8):
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        x = torch.randn(batch, 6, generator=g)
        y = x[:, :1] - 0.5 * x[:, 1:2]
        v = torch.randn(batch, 6, generator=g)
        if step == zero_v_at:
            v[row] = 0.0  # a direction masked by the loop's own feature mask, all off
        yield x, y, v


# ---------------------------------------------------------------------------------------------
# DP-SGD by hand: vmap(grad) over functional_call


class Classifier(nn.Module):
    def __init__(self, d: int = 6, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def make_classifier():
    torch.manual_seed(0)
    return Classifier()


def dp_sgd_step(model, opt, x, y, keep, clip: float = 1.0):
    """``keep``: 1 for a real record, 0 for the padding that fills the last batch."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_loss(p, xb, yb, kb):
        return F.cross_entropy(functional_call(model, p, (xb[None],)), yb[None]) * kb

    per = vmap(grad(sample_loss), in_dims=(None, 0, 0, 0))(params, x, y, keep)
    norms = torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in per.values()))
    scale = norms.clamp(max=clip) / norms  # the bug: a padding row's gradient is 0, 0/0
    opt.zero_grad()
    for name, p in model.named_parameters():
        p.grad = (per[name] * scale.view(-1, *[1] * (per[name].dim() - 1))).mean(0)
    opt.step()


def class_batches(steps: int, pad_at: int | None = None, row: int = 2, batch: int = 8):
    g = torch.Generator().manual_seed(4)
    for step in range(steps):
        x = torch.randn(batch, 6, generator=g)
        y = torch.randint(0, 3, (batch,), generator=g)
        keep = torch.ones(batch)
        if step == pad_at:
            keep[row] = 0.0
        yield x, y, keep


def smooth_loss(pred, y, model, x, v):
    """Regression loss plus the penalty, the model given to the loss for its JVP."""
    return F.mse_loss(pred, y) + 0.1 * jvp_penalty(model, x, v)


def meanflow_terms(u, model, x, noise, t):
    """The MeanFlow loss given the plain forward's ``u = model(z_t, t)``: the target's time
    derivative by jvp inside the loss, the model given to it."""
    z = (1 - t[:, None]) * x + t[:, None] * noise
    v = noise - x
    _, dudt = jvp(lambda z_, t_: model(z_, t_), (z, t), (v, torch.ones_like(t)))
    target = (v - t[:, None] * dudt).detach()
    return ((u - target) ** 2).mean()
