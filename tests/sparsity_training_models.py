"""Sparse training written by hand, as L0-regularisation (Louizos et al.), gradual magnitude
pruning (Zhu & Gupta) and STR code write it, for ``test_sparsity_training``.

- ``PrunedMLP``: linear layers with a magnitude mask buffer recomputed every k steps from
  ``torch.topk`` of ``|w|`` at a cubic schedule's sparsity, the kept weights renormalised to the
  dense norm (``w * mask * ||w|| / ||w * mask||``), then a LayerNorm. ``make_pruned`` is healthy;
  a schedule whose final sparsity is 1.0 prunes a layer empty: ``||w * mask|| = 0``.
- ``GlobalPrunedMLP``: global magnitude pruning (one ``kthvalue`` threshold of ``|w|`` over all
  layers) with each neuron's kept weights renormalised to its row's dense norm: a global
  threshold empties whole rows of the layer with the smallest weights.
- ``MovementMLP``: movement pruning's learned scores through a straight-through ``topk``
  binarizer (a custom autograd Function); scores outside a fixed block layout are -inf inside
  the forward, before the topk (healthy, also under bf16 autocast).
- ``L0MLP``: hard-concrete gates on the hidden units, ``u ~ U(0, 1)`` from the module's own
  ``torch.Generator``, a temperature ``beta`` the loop anneals, the expected-L0 penalty
  returned next to the logits. ``make_l0`` is healthy; annealed to 0 the gate divides by 0;
  ``make_l0_positive_gamma`` types gamma as 0.1, and the penalty's ``np.log(-gamma / zeta)``
  is a numpy NaN (a warning, no error); ``make_l0_bf16_noise`` draws u in bf16, unclamped, so
  some u are exactly 0 and log(u) is -inf inside the gate (healthy: the gate closes).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def cubic_sparsity(step: int, final: float, begin: int = 0, end: int = 4) -> float:
    """Zhu & Gupta's gradual schedule: s_f + (s_i - s_f) (1 - t / n)^3, from s_i = 0."""
    t = min(max(step - begin, 0), end - begin)
    return final * (1 - (1 - t / (end - begin)) ** 3)


class MaskedLinear(nn.Linear):
    def __init__(self, n_in: int, n_out: int):
        super().__init__(n_in, n_out)
        self.register_buffer("mask", torch.ones_like(self.weight))

    @torch.no_grad()
    def prune(self, sparsity: float):
        k = round(sparsity * self.weight.numel())  # weights to drop
        self.mask.fill_(1.0)
        if k > 0:
            idx = torch.topk(self.weight.abs().flatten(), k, largest=False).indices
            self.mask.view(-1)[idx] = 0.0

    def forward(self, x):
        w = self.weight * self.mask
        w = w * (self.weight.norm() / w.norm())  # the bug: 0/0 scale once every weight is pruned
        return F.linear(x, w, self.bias)


class PrunedMLP(nn.Module):
    def __init__(self, final_sparsity: float = 0.8):
        super().__init__()
        self.fc1, self.fc2 = MaskedLinear(16, 32), MaskedLinear(32, 32)
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 4)
        self.final_sparsity = final_sparsity

    def update_masks(self, step: int):
        for layer in (self.fc1, self.fc2):
            layer.prune(cubic_sparsity(step, self.final_sparsity))

    def forward(self, x):
        return self.head(self.norm(F.relu(self.fc2(F.relu(self.fc1(x))))))


def make_pruned():
    torch.manual_seed(0)
    return PrunedMLP()


def make_pruned_full():
    torch.manual_seed(0)
    return PrunedMLP(final_sparsity=1.0)


class HardConcrete(nn.Module):
    """Louizos et al.'s hard-concrete gate over ``n`` units."""

    def __init__(self, n: int, beta: float = 2 / 3, gamma: float = -0.1, zeta: float = 1.1,
                 noise_dtype: torch.dtype | None = None):
        super().__init__()
        self.log_alpha = nn.Parameter(torch.full((n,), 2.0))
        self.beta, self.gamma, self.zeta = beta, gamma, zeta
        self.gen = torch.Generator().manual_seed(7)
        self.noise_dtype = noise_dtype  # (bf16 noise, unclamped: u is exactly 0 at times)

    def forward(self, x):
        if self.training:
            if self.noise_dtype is not None:
                # u = 0 makes log(u) = -inf inside: sigmoid(-inf) = 0, a closed gate, finite
                u = torch.rand(x.shape, generator=self.gen, dtype=self.noise_dtype).float()
            else:
                u = torch.rand(x.shape, generator=self.gen).clamp(1e-6, 1 - 1e-6)
            s = torch.sigmoid((u.log() - (1 - u).log() + self.log_alpha) / self.beta)
        else:
            s = torch.sigmoid(self.log_alpha).expand_as(x)
        s = (s * (self.zeta - self.gamma) + self.gamma).clamp(0.0, 1.0)
        return x * s

    def penalty(self):
        # (np.log, as many L0 repositories write it: a log of a negative is NaN, no error)
        return torch.sigmoid(self.log_alpha
                             - self.beta * np.log(-self.gamma / self.zeta)).sum()


class L0MLP(nn.Module):
    def __init__(self, noise_dtype: torch.dtype | None = None):
        super().__init__()
        self.fc1, self.head = nn.Linear(16, 32), nn.Linear(32, 4)
        self.gate = HardConcrete(32, noise_dtype=noise_dtype)

    def forward(self, x):
        return self.head(self.gate(F.relu(self.fc1(x)))), self.gate.penalty()


def make_l0():
    torch.manual_seed(0)
    return L0MLP()


def make_l0_bf16_noise():
    torch.manual_seed(0)
    return L0MLP(noise_dtype=torch.bfloat16)


def make_l0_positive_gamma():
    """gamma typed as the stretch interval's width (0.1), not its left end (-0.1)."""
    torch.manual_seed(0)
    model = L0MLP()
    model.gate.gamma = 0.1
    return model


def l0_loss(out, penalty, y):
    return F.cross_entropy(out, y) + 1e-3 * penalty


def batch(g: torch.Generator, n: int = 8):
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


class RowNormLinear(MaskedLinear):
    """Each output row's kept weights rescaled to that row's dense norm (a per-neuron
    renormalisation); the mask comes from a global threshold over every layer."""

    def forward(self, x):
        w = self.weight * self.mask
        scale = self.weight.norm(dim=1, keepdim=True) / w.norm(dim=1, keepdim=True)
        return F.linear(x, w * scale, self.bias)  # the bug: a row pruned empty is 0 * inf


class GlobalPrunedMLP(nn.Module):
    """Global magnitude pruning: one ``kthvalue`` threshold of ``|w|`` over all layers."""

    def __init__(self, final_sparsity: float = 0.9):
        super().__init__()
        self.fc1, self.fc2 = RowNormLinear(16, 32), RowNormLinear(32, 32)
        self.head = nn.Linear(32, 4)
        self.final_sparsity = final_sparsity

    @torch.no_grad()
    def update_masks(self, step: int):
        layers = (self.fc1, self.fc2)
        scores = torch.cat([m.weight.abs().flatten() for m in layers])
        k = round(cubic_sparsity(step, self.final_sparsity) * scores.numel())
        if k == 0:
            return
        threshold = scores.kthvalue(k).values
        for m in layers:
            m.mask.copy_((m.weight.abs() > threshold).float())

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def make_global():
    torch.manual_seed(0)
    return GlobalPrunedMLP()


class TopKBinarizer(torch.autograd.Function):
    """Movement pruning's binary mask of the top ``keep`` fraction of scores, with the
    straight-through gradient (Sanh et al.)."""

    @staticmethod
    def forward(ctx, scores, keep: float):
        k = max(1, int(keep * scores.numel()))
        mask = torch.zeros_like(scores)
        mask.view(-1)[scores.flatten().topk(k).indices] = 1.0
        return mask

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class MovementLinear(nn.Linear):
    """Learned movement scores; the entries of a fixed block-diagonal layout (``allowed``)
    never compete: their scores are -inf before the topk, inside the forward."""

    def __init__(self, n_in: int, n_out: int, keep: float = 0.5):
        super().__init__(n_in, n_out)
        self.scores = nn.Parameter(torch.zeros_like(self.weight).uniform_(-0.01, 0.01))
        blocks = torch.block_diag(*[torch.ones(n_out // 4, n_in // 4)] * 4).bool()
        self.register_buffer("allowed", blocks)
        self.keep = keep

    def forward(self, x):
        scores = self.scores.masked_fill(~self.allowed, float("-inf"))
        mask = TopKBinarizer.apply(scores, self.keep * self.allowed.float().mean().item())
        return F.linear(x, self.weight * mask, self.bias)


class MovementMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = MovementLinear(16, 32), MovementLinear(32, 32)
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 4)

    def update_masks(self, step: int):
        for m in (self.fc1, self.fc2):
            m.keep = 1 - cubic_sparsity(step, 0.5)

    def forward(self, x):
        return self.head(self.norm(F.relu(self.fc2(F.relu(self.fc1(x))))))


def make_movement():
    torch.manual_seed(0)
    return MovementMLP()
