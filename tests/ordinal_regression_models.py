"""Ordinal regression written the way age-estimation, severity-grading and rating-prediction
code writes it, for ``test_ordinal_regression``.

- ``CumulativeLinkNet``: an MLP scoring each record with one logit ``f`` and a
  cumulative-link (proportional-odds) head whose thresholds are either ordered by
  construction (``cumsum(softplus(deltas))``, as spacecutter and most papers do) or a raw
  parameter (``make_cumlink_raw``). ``cumulative_link_loss`` pads the thresholds with ±inf and
  takes ``-log(sigmoid(t[y + 1] - f) - sigmoid(t[y] - f))``; ``CumulativeLinkNLL`` the same
  likelihood inside ``forward(x, y)``, one negative log-likelihood per record.
- ``CoralNet`` / ``coral_loss`` / ``corn_loss``: CORAL's rank-consistent head (one shared
  weight vector, K - 1 biases) and CORN's conditional subsets; ``corn_loss_unguarded`` takes
  each task's mean BCE over its subset without coral-pytorch's guard for an empty subset.
- ``SoftmaxAgeNet`` with ``WeightedSoftOrdinalCE`` (DLDL's Gaussian label distribution over
  the ordinal classes, class weights from the training set's label frequencies),
  ``triangular_smoothed_ce`` (ordinal label smoothing against ``log(softmax)``) and
  ``emd_loss`` (NIMA's squared Earth mover's distance on the CDFs, r = 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

K = 5  # severity grades / star ratings 0..4
FEATURES = 12


class Backbone(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.GELU(),
                                 nn.Dropout(0.1), nn.Linear(hidden, hidden), nn.GELU())

    def forward(self, x):
        return self.net(x)


class CumulativeLinkNet(nn.Module):
    """One logit per record, K - 1 thresholds; returns ``(f, thresholds)``."""

    def __init__(self, ordered: bool = True):
        super().__init__()
        self.body, self.score = Backbone(), nn.Linear(32, 1)
        self.ordered = ordered
        init = torch.linspace(-1.5, 1.5, K - 1)
        if ordered:  # first threshold free, the gaps positive
            self.first = nn.Parameter(init[:1].clone())
            self.deltas = nn.Parameter(torch.full((K - 2,), 0.5))
        else:
            self.thresholds = nn.Parameter(init)

    def cutpoints(self):
        if self.ordered:
            gaps = F.softplus(self.deltas)
            return torch.cat([self.first, self.first + torch.cumsum(gaps, 0)])
        return self.thresholds

    def forward(self, x):
        return self.score(self.body(x)).squeeze(-1), self.cutpoints()


def make_cumlink() -> CumulativeLinkNet:
    torch.manual_seed(0)
    return CumulativeLinkNet()


def make_cumlink_raw() -> CumulativeLinkNet:
    torch.manual_seed(0)
    return CumulativeLinkNet(ordered=False)


def cumulative_link_loss(f, thresholds, y):
    """Proportional odds: P(y = k) = sigmoid(t_k - f) - sigmoid(t_{k-1} - f)."""
    inf = thresholds.new_full((1,), float("inf"))
    t = torch.cat([-inf, thresholds, inf])
    upper, lower = t[y + 1], t[y]
    p = torch.sigmoid(upper - f) - torch.sigmoid(lower - f)
    return -torch.log(p).mean()


class CumulativeLinkNLL(nn.Module):
    """The cumulative-link model with its likelihood inside ``forward(x, y)``, returning each
    record's negative log-likelihood (as statsmodels-style ``OrderedModel`` ports do)."""

    def __init__(self):
        super().__init__()
        self.net = CumulativeLinkNet()

    def forward(self, x, y):
        f, thresholds = self.net(x)
        inf = thresholds.new_full((1,), float("inf"))
        t = torch.cat([-inf, thresholds, inf])
        p = torch.sigmoid(t[y + 1] - f) - torch.sigmoid(t[y] - f)
        return -torch.log(p)


def make_cumlink_nll() -> CumulativeLinkNLL:
    torch.manual_seed(0)
    return CumulativeLinkNLL()


class CoralNet(nn.Module):
    """CORAL (Cao et al.): a shared weight vector, one bias per rank; K - 1 logits."""

    def __init__(self):
        super().__init__()
        self.body = Backbone()
        self.fc = nn.Linear(32, 1, bias=False)
        self.bias = nn.Parameter(torch.linspace(1.0, -1.0, K - 1))

    def forward(self, x):
        return self.fc(self.body(x)) + self.bias


def make_coral() -> CoralNet:
    torch.manual_seed(0)
    return CoralNet()


def coral_loss(logits, y):
    levels = (torch.arange(K - 1) < y[:, None]).float()
    return -(F.logsigmoid(logits) * levels
             + (F.logsigmoid(logits) - logits) * (1 - levels)).sum(1).mean()


def corn_loss(logits, y):
    """coral-pytorch's corn_loss: task k trains on the records with y > k - 1."""
    losses, count = logits.new_zeros(()), 0
    for k in range(K - 1):
        sel = y > k - 1
        if not bool(sel.any()):
            continue
        target = (y[sel] > k).float()
        losses = losses + F.binary_cross_entropy_with_logits(logits[sel, k], target,
                                                             reduction="sum")
        count += int(sel.sum())
    return losses / count


def corn_loss_unguarded(logits, y):
    """CORN as often re-implemented: the mean BCE of each task over its subset, averaged."""
    losses = []
    for k in range(K - 1):
        sel = y > k - 1
        losses.append(F.binary_cross_entropy_with_logits(logits[sel, k], (y[sel] > k).float()))
    return torch.stack(losses).mean()


def coral_decode(logits):
    return (torch.sigmoid(logits) > 0.5).sum(1)


class SoftmaxAgeNet(nn.Module):
    """K-way softmax head, decoded by its expected value (DEX / DLDL)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = Backbone(), nn.Linear(32, K)

    def forward(self, x):
        return self.head(self.body(x))


def make_softmax() -> SoftmaxAgeNet:
    torch.manual_seed(0)
    return SoftmaxAgeNet()


def expected_value(logits):
    return (logits.softmax(-1) * torch.arange(K, dtype=logits.dtype)).sum(-1)


class WeightedSoftOrdinalCE(nn.Module):
    """DLDL's loss: cross-entropy against a Gaussian over the classes around the label,
    each class weighted by its inverse frequency in the training set."""

    def __init__(self, train_labels, sigma: float = 1.0):
        super().__init__()
        counts = torch.bincount(train_labels, minlength=K).float()
        self.register_buffer("class_weight", counts.sum() / (K * counts))
        self.sigma = sigma

    def forward(self, logits, y):
        grid = torch.arange(K, dtype=logits.dtype)
        q = torch.exp(-(grid - y[:, None].to(logits.dtype)) ** 2 / (2 * self.sigma ** 2))
        q = q / q.sum(1, keepdim=True)
        return -(self.class_weight * q * F.log_softmax(logits, -1)).sum(1).mean()


def triangular_smoothed_ce(logits, y, width: float = 2.0):
    """Ordinal label smoothing: a triangular kernel over the grades around the label (0 two
    grades away), cross-entropy against it."""
    grid = torch.arange(K, dtype=logits.dtype)
    q = (1 - (grid - y[:, None]).abs() / width).clamp(min=0)
    q = q / q.sum(1, keepdim=True)
    return -(q * torch.log(logits.softmax(-1))).sum(1).mean()


def one_hot_hist(y):
    """A record's score histogram, all its votes on one grade."""
    return F.one_hot(y, K).float()


def emd_loss(logits, target_hist):
    """NIMA's EMD (r = 2) between the predicted and the target score CDFs."""
    cdf_p = torch.cumsum(logits.softmax(-1), -1)
    cdf_t = torch.cumsum(target_hist, -1)
    return torch.sqrt(torch.mean((cdf_p - cdf_t) ** 2, -1)).mean()


def ratings(g: torch.Generator, n: int = 32, mild_only: bool = False):
    """Records whose latent score sets their grade, ``y`` in 0..K-1; with ``mild_only`` none
    of them is graded above 2 (a batch from a mild-cases-only clinic)."""
    x = torch.randn(n, FEATURES, generator=g)
    latent = x[:, :3].sum(1) + 0.3 * torch.randn(n, generator=g)
    y = torch.bucketize(latent, torch.tensor([-1.5, -0.5, 0.5, 1.5]))
    if mild_only:
        y = y.clamp(max=2)
    return x, y
