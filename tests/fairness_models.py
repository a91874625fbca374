"""Fairness-aware training on tabular data, as fairlearn/AIF360-style code writes it, for
``test_fairness``.

- ``tabular_set``: a synthetic credit data set (standardised features, a binary label, a
  sensitive attribute of ``GROUPS`` groups, the last a minority) and the inverse group
  frequency weights a ``WeightedRandomSampler`` draws it by.
- ``FairLogReg``: a fairness-regularised logistic model; ``group_bias`` adds a per-group
  intercept (group-specific thresholds), the group attribute passed into ``forward``.
- ``AdversarialDebiaser``: Zhang et al.'s adversarial debiasing: a predictor MLP and an
  adversary that predicts the group from the predictor's logit (and the label, for equalised
  odds) through a gradient reversal layer.
- ``DemographicParityLoss``: BCE plus ``lam`` times the gap between per-group positive rates
  (sums over a group mask divided by the group's count); ``floor`` keeps an absent group's count
  at 1, ``sqrt_gap`` writes the penalty as the root of the squared gaps.
- ``LagrangianLoss``: BCE plus multipliers times the equalised-odds violations, the
  multipliers updated by projected gradient ascent (``ascend``); ``floor`` keeps the
  count of a group with no positive at 1.
- ``GroupDROLoss``: Sagawa et al.'s online group DRO: per-group mean losses, group weights
  ``q = q * exp(eta * group_loss)`` normalised, the loss ``q @ group_loss``.
- ``AdversaryLoss``: the predictor's BCE plus the adversary's cross-entropy on the group,
  written ``log(softmax(...))`` (``stable=False``) or with ``cross_entropy``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, GROUPS = 6, 3


def tabular_set(g: torch.Generator, n: int = 96):
    """Standardised features, labels and groups (group 2 is 10% of the rows); the sampler
    weights are the inverse group frequencies."""
    group = (torch.rand(n, generator=g) < 0.45).long()
    group[torch.rand(n, generator=g) < 0.1] = 2
    x = torch.randn(n, FEATURES, generator=g)
    x[:, 0] += 0.8 * group  # a proxy of the sensitive attribute
    y = ((x[:, :3].sum(1) + 0.5 * torch.randn(n, generator=g)) > 0.5).float()
    freq = torch.bincount(group, minlength=GROUPS).float()
    weights = (1.0 / freq)[group]
    return x, y, group, weights


class FairLogReg(nn.Module):
    def __init__(self, group_bias: bool = False, zero_init: bool = False):
        super().__init__()
        self.linear = nn.Linear(FEATURES, 1)
        self.group_bias = nn.Parameter(torch.zeros(GROUPS)) if group_bias else None
        if zero_init:  # as logistic regression starts
            nn.init.zeros_(self.linear.weight)
            nn.init.zeros_(self.linear.bias)

    def forward(self, x, group=None):
        z = self.linear(x).squeeze(-1)
        if self.group_bias is not None:
            z = z + self.group_bias[group]  # a per-group intercept
        return z


def make_logreg() -> FairLogReg:
    torch.manual_seed(0)
    return FairLogReg()


def make_logreg_zero() -> FairLogReg:
    torch.manual_seed(0)
    return FairLogReg(zero_init=True)


def make_logreg_confident() -> FairLogReg:
    """A checkpoint trained long on separable features: large weights, confident logits."""
    model = make_logreg()
    with torch.no_grad():
        model.linear.weight.copy_(torch.tensor([[3.0, 3.0, 3.0, 0.0, 0.0, 0.0]]))
        model.linear.bias.fill_(-1.5)
    return model


def make_group_logreg() -> FairLogReg:
    torch.manual_seed(0)
    return FairLogReg(group_bias=True)


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class AdversarialDebiaser(nn.Module):
    def __init__(self, hidden: int = 16, reverse: float = 1.0):
        super().__init__()
        self.predictor = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(),
                                       nn.Linear(hidden, 1))
        self.adversary = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, GROUPS))
        self.reverse = reverse

    def forward(self, x, y):
        logit = self.predictor(x).squeeze(-1)
        h = GradReverse.apply(logit, self.reverse)
        adv = self.adversary(torch.stack([h, y], -1))  # equalised odds: the label too
        return logit, adv


def make_debiaser() -> AdversarialDebiaser:
    torch.manual_seed(0)
    return AdversarialDebiaser()


def make_debiaser_confident() -> AdversarialDebiaser:
    """A checkpoint whose adversary became very confident (its head's weights grew)."""
    torch.manual_seed(0)
    model = AdversarialDebiaser()
    with torch.no_grad():
        model.adversary[2].weight.mul_(3000.0)
    return model


class AdversaryLoss(nn.Module):
    def __init__(self, alpha: float = 1.0, stable: bool = True):
        super().__init__()
        self.alpha, self.stable = alpha, stable

    def forward(self, out, y, group):
        logit, adv = out
        task = F.binary_cross_entropy_with_logits(logit, y)
        if self.stable:
            adv_loss = F.cross_entropy(adv, group)
        else:
            p = torch.softmax(adv, -1)
            adv_loss = -torch.log(p.gather(1, group[:, None])).mean()
        return task + self.alpha * adv_loss


def group_rates(p, group, floor: bool = True):
    """Positive rate per group: sums over each group's mask divided by its count."""
    mask = F.one_hot(group, GROUPS).float()  # (B, G)
    count = mask.sum(0)
    return (p[:, None] * mask).sum(0) / (count.clamp_min(1) if floor else count)


class DemographicParityLoss(nn.Module):
    def __init__(self, lam: float = 1.0, floor: bool = True, sqrt_gap: bool = False):
        super().__init__()
        self.lam, self.floor, self.sqrt_gap = lam, floor, sqrt_gap

    def forward(self, logit, y, group):
        task = F.binary_cross_entropy_with_logits(logit, y)
        rates = group_rates(torch.sigmoid(logit), group, self.floor)
        gaps = rates - rates.mean()
        if self.sqrt_gap:
            penalty = torch.sqrt((gaps ** 2).sum())
        else:
            penalty = gaps.abs().sum()
        return task + self.lam * penalty


class LagrangianLoss(nn.Module):
    """BCE plus ``multipliers @ violations``: the true-positive-rate gaps of each group to the
    overall one (equalised odds, positives only); ``ascend`` takes a projected ascent step."""

    def __init__(self, eta: float = 0.5, floor: bool = True):
        super().__init__()
        self.register_buffer("multipliers", torch.zeros(GROUPS))
        self.eta, self.floor = eta, floor
        self.violations = torch.zeros(GROUPS)

    def forward(self, logit, y, group):
        task = F.binary_cross_entropy_with_logits(logit, y)
        p = torch.sigmoid(logit)
        positives = F.one_hot(group, GROUPS).float() * y[:, None]  # (B, G)
        count = positives.sum(0)
        tpr = (p[:, None] * positives).sum(0) / (count.clamp_min(1) if self.floor else count)
        overall = (p * y).sum() / y.sum().clamp_min(1)
        violations = (tpr - overall).abs()
        self.violations = violations.detach()
        return task + (self.multipliers * violations).sum()

    @torch.no_grad()
    def ascend(self):
        self.multipliers.copy_((self.multipliers + self.eta * self.violations).clamp_min(0))


class GroupDROLoss(nn.Module):
    """Online group DRO; ``floor`` gives an absent group a count of 1 (a mean loss of 0)."""

    def __init__(self, eta: float = 0.01, floor: bool = True):
        super().__init__()
        self.register_buffer("q", torch.full((GROUPS,), 1.0 / GROUPS))
        self.eta, self.floor = eta, floor

    def forward(self, logit, y, group):
        losses = F.binary_cross_entropy_with_logits(logit, y, reduction="none")
        mask = F.one_hot(group, GROUPS).float()
        count = mask.sum(0)
        group_loss = (losses[:, None] * mask).sum(0) / (count.clamp_min(1) if self.floor else count)
        with torch.no_grad():
            q = self.q * torch.exp(self.eta * group_loss)
            self.q.copy_(q / q.sum())
        return (self.q * group_loss).sum()


class ManualParityLoss(DemographicParityLoss):
    """The same penalty with the cross-entropy written out on ``sigmoid`` probabilities, in
    the logit's dtype (bf16 under autocast)."""

    def forward(self, logit, y, group):
        p = torch.sigmoid(logit)
        task = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
        rates = group_rates(p.float(), group, self.floor)
        return task + self.lam * (rates - rates.mean()).abs().sum()


def reweighted_bce(logit, y, weight):
    """Importance reweighting: each row's BCE times its inverse group frequency weight."""
    losses = F.binary_cross_entropy_with_logits(logit, y, reduction="none")
    return (weight * losses).sum() / weight.sum()
