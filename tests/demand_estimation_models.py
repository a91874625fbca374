"""Structural demand estimation written the way empirical IO code writes it with neural nets
(pyblp's logit / nested logit shares, BLP's inversion, a neural utility): the factories,
losses and data of ``test_demand_estimation.py``.

- ``markets``: ``M`` markets of up to ``J`` products, padded into one batch: characteristics
  ``x (M, J, K)``, prices ``price (M, J)`` (0 at the padding), an availability mask, each
  product's nest id, and the observed inside shares ``shares (M, J)`` (their sum below 1: the
  outside good holds the rest).
- ``LogitDemand``: a neural utility ``mlp(x) + alpha * log(price)`` (``PriceUtility``: the
  price coefficient ``alpha = -exp(log_alpha)``), unavailable products masked to ``-inf``, the
  logit shares a softmax over the products and the outside good (its utility 0);
  ``levels=True`` puts prices in levels instead of logs and writes the shares by hand.
- ``NestedLogitDemand``: the nested logit: ``v / lam`` within nests, the inclusive value a
  log-sum-exp per nest, ``lam`` (in (0, 1]) a trained parameter; ``naive=True`` writes the
  within-nest shares as ``exp(v / lam) / sum exp(v / lam)``.
- ``ShareNLL``: the market-level likelihood ``-sum_j s_j log pred_j`` (outside good included);
  ``BLPInversionLoss``: the mean utility regressed on BLP's inversion ``log s_j - log s_0`` of
  the observed shares; ``outside="1-sum"`` takes the predicted outside share as ``1 - sum``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

M_MARKETS, J, K, NESTS, HIDDEN = 64, 6, 3, 2, 16


def markets(n: int = M_MARKETS, seed: int = 0, price_scale: float = 1.0,
            x_scale: float = 1.0) -> dict:
    """Padded markets: 3 to J products each, the rest padding (mask False, price 0, share 0)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(3, J + 1, (n,), generator=g)
    mask = torch.arange(J)[None, :] < sizes[:, None]
    x = torch.randn(n, J, K, generator=g) * mask[..., None] * x_scale
    price = (torch.rand(n, J, generator=g) * 2 + 0.5) * price_scale * mask
    nest = (torch.arange(J)[None, :] % NESTS).expand(n, J).clone()
    v = x @ torch.tensor([1.0, -0.5, 0.3]) - 1.5 * torch.log(price.clamp_min(1e-3))
    v = v.masked_fill(~mask, float("-inf"))
    s = torch.softmax(torch.cat([torch.zeros(n, 1), v], 1), 1)[:, 1:]
    cost = (torch.rand(n, J, generator=g) + 0.5) * mask                  # a cost shifter
    rivals = x[..., 0].sum(1, keepdim=True) - x[..., 0]                   # BLP instruments
    z = torch.stack([mask.float(), rivals, cost], -1)
    return {"x": x, "price": price, "mask": mask, "nest": nest, "shares": s, "z": z}


class PriceUtility(nn.Module):
    """``alpha * log(price)``, ``alpha = -exp(log_alpha)`` (demand slopes down)."""

    def __init__(self, levels: bool = False, guard: bool = True):
        super().__init__()
        self.log_alpha = nn.Parameter(torch.zeros(()))
        self.levels, self.guard = levels, guard

    def forward(self, price, mask):
        alpha = -torch.exp(self.log_alpha)
        if self.levels:
            return alpha * price
        if self.guard:  # the padding's price 0 replaced before the log
            price = torch.where(mask, price, torch.ones_like(price))
        return alpha * torch.log(price)  # without the guard: log(0) = -inf at the padding


class LogitDemand(nn.Module):
    """``linear(x) + mlp(x) + alpha * log(price)``: a linear index plus a neural correction."""

    def __init__(self, levels: bool = False, guard: bool = True):
        super().__init__()
        self.linear = nn.Linear(K, 1)
        self.mlp = nn.Sequential(nn.Linear(K, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
        self.price_utility = PriceUtility(levels, guard)
        self.levels = levels

    def utility(self, x, price, mask):
        v = (self.linear(x) + self.mlp(x)).squeeze(-1) + self.price_utility(price, mask)
        return v.masked_fill(~mask, float("-inf"))

    def forward(self, x, price, mask):
        v = self.utility(x, price, mask)
        if self.levels:  # the shares by hand: exp(v) / (1 + sum exp(v))
            e = torch.exp(v)
            inside = e / (1 + e.sum(1, keepdim=True))
            return torch.cat([1 - inside.sum(1, keepdim=True), inside], 1)
        return torch.softmax(torch.cat([torch.zeros_like(v[:, :1]), v], 1), 1)


class NestedLogitDemand(nn.Module):
    def __init__(self, lam: float = 0.9, naive: bool = False):
        super().__init__()
        self.linear = nn.Linear(K, 1)
        self.mlp = nn.Sequential(nn.Linear(K, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
        self.price_utility = PriceUtility()
        self.lam = nn.Parameter(torch.tensor(lam))
        self.naive = naive

    def forward(self, x, price, mask, nest):
        v = (self.linear(x) + self.mlp(x)).squeeze(-1) + self.price_utility(price, mask)
        onehot = F.one_hot(nest, NESTS).bool() & mask[..., None]          # (M, J, G)
        scaled = (v / self.lam)[..., None].masked_fill(~onehot, float("-inf"))
        if self.naive:
            e = torch.exp(scaled)
            within = (e / e.sum(1, keepdim=True)).sum(2)
            incl = torch.log(e.sum(1))
        else:
            incl = torch.logsumexp(scaled, 1)                              # (M, G)
            within = torch.exp(scaled - incl[:, None, :]).sum(2)
        outer = torch.cat([torch.zeros_like(incl[:, :1]), self.lam * incl], 1)
        nest_share = torch.softmax(outer, 1)                               # (M, 1 + G)
        inside = within * (onehot.float() @ nest_share[:, 1:, None]).squeeze(-1)
        return torch.cat([nest_share[:, :1], inside], 1)


class ShareNLL(nn.Module):
    """``-sum_j s_j log pred_j`` per market (the outside good's observed share ``1 - sum``)."""

    def forward(self, pred, shares, mask):
        obs = torch.cat([1 - shares.sum(1, keepdim=True), shares], 1)
        valid = torch.cat([torch.ones_like(mask[:, :1]), mask], 1)
        log_pred = torch.log(torch.where(valid, pred, torch.ones_like(pred)))
        return -(obs * log_pred).sum(1).mean()


class BLPInversionLoss(nn.Module):
    """Mean utilities regressed on ``log s_j - log s_0`` (BLP's inversion of the data)."""

    def forward(self, v, shares, mask):
        s0 = 1 - shares.sum(1, keepdim=True)
        delta = torch.log(shares) - torch.log(s0)
        err = torch.where(mask, v - delta, torch.zeros_like(v))
        return (err ** 2).sum() / mask.sum()


class GMMLoss(nn.Module):
    """Two-step GMM of the structural error ``xi = delta - v`` (``delta`` BLP's inversion of
    the observed shares) on instruments ``z (M, J, L)``: market moments ``g_m = sum_j z xi``,
    the weighting matrix the inverse of their covariance, ``gbar' W gbar``."""

    def forward(self, v, shares, mask, z):
        s0 = 1 - shares.sum(1, keepdim=True)
        delta = torch.log(torch.where(mask, shares, torch.ones_like(shares))) - torch.log(s0)
        xi = torch.where(mask, delta - v, torch.zeros_like(v))
        g = (z * xi[..., None]).sum(1)                                    # (M, L)
        gbar = g.mean(0)
        w = torch.linalg.inv(g.T @ g / len(g))
        return gbar @ w @ gbar


class MeanUtility(nn.Module):
    """The logit model's mean utilities alone (for the inversion loss)."""

    def __init__(self):
        super().__init__()
        self.demand = LogitDemand()

    def forward(self, x, price, mask):
        return self.demand.utility(x, price, mask).masked_fill(~mask, 0.0)


def make_logit() -> LogitDemand:
    torch.manual_seed(0)
    return LogitDemand()


def make_logit_unguarded() -> LogitDemand:
    torch.manual_seed(0)
    return LogitDemand(guard=False)


def make_logit_levels() -> LogitDemand:
    torch.manual_seed(0)
    return LogitDemand(levels=True)


def make_nested() -> NestedLogitDemand:
    torch.manual_seed(0)
    return NestedLogitDemand()


def make_nested_naive(lam: float = 0.9) -> NestedLogitDemand:
    torch.manual_seed(0)
    return NestedLogitDemand(lam, naive=True)


def make_mean_utility() -> MeanUtility:
    torch.manual_seed(0)
    return MeanUtility()


def make_nested_steep() -> NestedLogitDemand:
    """The naive nested logit started at a steep nesting parameter (``lam = 0.05``)."""
    return make_nested_naive(0.05)
