"""Long-tailed and multi-label recognition, written as the reference repositories write it
(Cui et al.'s class-balanced loss, LDAM-DRW's ``losses.py``, Menon et al.'s logit adjustment,
Balanced Softmax, focal loss, Alibaba's ASL, decoupling's cRT / tau-normalisation), for
``test_long_tail``.

- ``Net``: a small backbone (the image features of a pretrained encoder, 16 wide) and a
  linear classifier; ``TauNormNet``: the classifier of Kang et al.'s decoupling, its weights
  divided by ``||w||**tau`` per class (cRT re-trains it from a re-initialised classifier).
- ``class_counts``: the class counts of an exponentially long-tailed training split
  (imbalance ratio ``rho``), with classes the split may hold none of.
- ``ClassBalancedLoss``: CE weighted by the inverse effective number ``(1-beta)/(1-beta**n)``,
  normalised to sum to the number of classes.
- ``LDAMLoss``: label-distribution-aware margins ``C / n**0.25`` scaled to ``max_m``.
- ``BalancedSoftmax``: CE of ``logits + log(prior)`` (logit adjustment with tau = 1).
- ``FocalLoss``: ``alpha (1 - p_t)**gamma CE`` with ``p_t = exp(-CE)``.
- ``AsymmetricLoss``: ASL for multi-label, probability shifting by ``clip`` of the negatives,
  ``gamma_neg`` / ``gamma_pos`` focusing, the logs clamped to ``eps``.
- ``pos_weight_from_counts``: BCEWithLogitsLoss's ``pos_weight = negatives / positives``.
- ``mixup``: mixup of a batch with ``lam ~ Beta(alpha, alpha)``.
- ``LongTailSet``: a map-style dataset (features, label) whose per-class sampling weights
  feed a ``WeightedRandomSampler`` (class-aware sampling).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

CLASSES, DIM = 6, 16


class Net(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = 32, classes: int = CLASSES):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.LayerNorm(hidden), nn.GELU(),
                                      nn.Linear(hidden, hidden), nn.GELU())
        self.classifier = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.classifier(self.backbone(x))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


class NormedLinear(nn.Module):
    """LDAM-DRW's ``NormedLinear``: cosine logits, ``normalize(x) @ normalize(w)``, times a
    scale ``s`` (the cosine classifiers of long-tail recognition)."""

    def __init__(self, hidden: int, classes: int, s: float = 30.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, classes).uniform_(-1, 1))
        self.s = s

    def forward(self, x):
        return self.s * F.normalize(x, dim=1).mm(F.normalize(self.weight, dim=0))


class NormedNet(Net):
    def __init__(self, s: float = 30.0):
        super().__init__()
        self.classifier = NormedLinear(32, CLASSES, s=s)


def make_normed_net() -> NormedNet:
    torch.manual_seed(0)
    return NormedNet()


def make_cosine_net() -> NormedNet:
    """The cosine classifier at a face-recognition scale, s = 64."""
    torch.manual_seed(0)
    return NormedNet(s=64.0)


class TauNormClassifier(nn.Module):
    """Kang et al. 2020's tau-normalised classifier: ``w_i / ||w_i||**tau``, no bias."""

    def __init__(self, hidden: int, classes: int, tau: float = 1.0, zero_init: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(classes, hidden))
        self.tau = tau
        if zero_init:  # the bug: cRT's classifier re-initialised to 0 ("start from scratch")
            nn.init.zeros_(self.weight)
        else:
            nn.init.normal_(self.weight, std=0.1)

    def forward(self, feat):
        norms = torch.norm(self.weight, p=2, dim=1, keepdim=True)
        w = self.weight / torch.pow(norms, self.tau)  # the bug: no eps, 0/0 on a zero row
        return feat @ w.t()


class TauNormNet(nn.Module):
    """cRT: the backbone of stage one, frozen, and a re-trained tau-normalised classifier."""

    def __init__(self, zero_init: bool = False):
        super().__init__()
        self.backbone = Net().backbone
        self.classifier = TauNormClassifier(32, CLASSES, zero_init=zero_init)
        for p in self.backbone.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.classifier(self.backbone(x))


def make_taunorm() -> TauNormNet:
    torch.manual_seed(0)
    return TauNormNet()


def make_taunorm_zero() -> TauNormNet:
    torch.manual_seed(0)
    return TauNormNet(zero_init=True)


def class_counts(n_max: int = 100, rho: float = 100.0, classes: int = CLASSES,
                 absent: tuple[int, ...] = ()) -> torch.Tensor:
    """``n_i = n_max * rho**(-i / (C - 1))``; ``absent``: classes the split holds no record of
    (a rare class that fell entirely into the validation split)."""
    i = torch.arange(classes, dtype=torch.float32)
    counts = torch.floor(n_max * rho ** (-i / (classes - 1)))
    for c in absent:
        counts[c] = 0.0
    return counts


class ClassBalancedLoss(nn.Module):
    """Cui et al. 2019, ``CB_loss`` of the reference implementation (softmax variant)."""

    def __init__(self, counts: torch.Tensor, beta: float = 0.999):
        super().__init__()
        self.register_buffer("counts", counts.clone())
        self.beta = beta

    def forward(self, logits, labels):
        effective_num = 1.0 - torch.pow(self.beta, self.counts)
        weights = (1.0 - self.beta) / effective_num  # the bug: a class of count 0 gives 1/0
        weights = weights / weights.sum() * logits.shape[1]
        return F.cross_entropy(logits, labels, weight=weights)


class LDAMLoss(nn.Module):
    """Cao et al. 2019 (github.com/kaidic/LDAM-DRW): margins ``1 / n**0.25`` scaled so the
    largest is ``max_m``, subtracted from the label's logit, then scaled by ``s``."""

    def __init__(self, counts: torch.Tensor, max_m: float = 0.5, s: float = 30.0,
                 weight: torch.Tensor | None = None):
        super().__init__()
        m_list = 1.0 / torch.sqrt(torch.sqrt(counts))
        m_list = m_list * (max_m / torch.max(m_list))
        self.register_buffer("m_list", m_list)
        self.s = s
        self.weight = weight  # DRW's per-class weights, a plain attribute as LDAM-DRW keeps it

    def forward(self, x, target):
        index = F.one_hot(target, x.shape[1]).bool()
        batch_m = self.m_list[None, :] @ index.float().t()
        x_m = x - batch_m.view(-1, 1)
        output = torch.where(index, x_m, x)
        return F.cross_entropy(self.s * output, target, weight=self.weight)


class BalancedSoftmax(nn.Module):
    """Ren et al. 2020 / logit adjustment (Menon et al. 2021) with tau: the training logits
    plus ``tau * log(prior)``, the class prior from the training split's counts."""

    def __init__(self, counts: torch.Tensor, tau: float = 1.0, label_smoothing: float = 0.0):
        super().__init__()
        self.register_buffer("prior", counts / counts.sum())
        self.tau, self.label_smoothing = tau, label_smoothing

    def forward(self, logits, labels):
        adjusted = logits + self.tau * torch.log(self.prior)  # log 0 for an absent class
        return F.cross_entropy(adjusted, labels, label_smoothing=self.label_smoothing)


class FocalLoss(nn.Module):
    """Lin et al. 2017, as the long-tail repositories write it: ``p_t = exp(-CE)``."""

    def __init__(self, gamma: float = 2.0, alpha: float = 0.25):
        super().__init__()
        self.gamma, self.alpha = gamma, alpha

    def forward(self, logits, labels):
        ce = F.cross_entropy(logits, labels, reduction="none")
        p_t = torch.exp(-ce)
        loss = self.alpha * (1 - p_t) ** self.gamma * ce  # gamma < 1: d/dp of 0**gamma is inf
        return loss.mean()


class AsymmetricLoss(nn.Module):
    """Ridnik et al. 2021 (github.com/Alibaba-MIIL/ASL), ``AsymmetricLoss``."""

    def __init__(self, gamma_neg: float = 4.0, gamma_pos: float = 1.0, clip: float = 0.05,
                 eps: float | None = 1e-8):
        super().__init__()
        self.gamma_neg, self.gamma_pos, self.clip, self.eps = gamma_neg, gamma_pos, clip, eps

    def forward(self, x, y):
        xs_pos = torch.sigmoid(x)
        xs_neg = 1 - xs_pos
        if self.clip is not None and self.clip > 0:
            xs_neg = (xs_neg + self.clip).clamp(max=1)  # probability shifting
        if self.eps is not None:
            xs_pos, xs_neg = xs_pos.clamp(min=self.eps), xs_neg.clamp(min=self.eps)
        los_pos = y * torch.log(xs_pos)  # the bug: no eps, log 0 of a saturated sigmoid
        los_neg = (1 - y) * torch.log(xs_neg)
        loss = los_pos + los_neg
        pt = xs_pos * y + xs_neg * (1 - y)
        gamma = self.gamma_pos * y + self.gamma_neg * (1 - y)
        loss = loss * torch.pow(1 - pt, gamma)
        return -loss.sum()


def pos_weight_from_counts(pos: torch.Tensor, n: int) -> torch.Tensor:
    """BCEWithLogitsLoss's ``pos_weight``: negatives over positives per label."""
    return (n - pos) / pos  # the bug: a label with no positive is inf


def mixup(x: torch.Tensor, y: torch.Tensor, alpha: float, gen: torch.Generator):
    """Zhang et al. 2018: ``lam ~ Beta(alpha, alpha)``, a permutation of the batch."""
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    perm = torch.randperm(x.shape[0], generator=gen)
    return lam * x + (1 - lam) * x[perm], y, y[perm], lam


def mixup_criterion(crit, pred, y_a, y_b, lam: float):
    return lam * crit(pred, y_a) + (1 - lam) * crit(pred, y_b)


def long_tail_data(counts: torch.Tensor, seed: int = 0):
    """Features of Gaussian clusters, one per class, ``counts[i]`` records of class i."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, DIM, generator=g) * 2.0
    labels = torch.cat([torch.full((int(c),), i) for i, c in enumerate(counts.tolist())])
    x = centers[labels] + torch.randn(len(labels), DIM, generator=g)
    return x, labels


def multilabel_data(n: int = 128, labels: int = CLASSES, absent: tuple[int, ...] = (),
                    seed: int = 0):
    """Multi-hot targets with label frequencies from 0.5 down to 0.03 (a long tail), the
    features a noisy linear map of them; ``absent``: labels no record carries."""
    g = torch.Generator().manual_seed(seed)
    freq = 0.5 * (0.06 ** (torch.arange(labels) / (labels - 1)))
    y = (torch.rand(n, labels, generator=g) < freq).float()
    for c in absent:
        y[:, c] = 0.0
    proj = torch.randn(labels, DIM, generator=g)
    x = y @ proj + 0.5 * torch.randn(n, DIM, generator=g)
    return x, y


class LongTailSet(Dataset):
    """Map-style (features, label); ``corrupt``: the index of a record whose decoded image
    held NaN (a truncated file decoded to NaN after normalisation)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, corrupt: int | None = None):
        self.x, self.y, self.corrupt = x, y, corrupt

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i].clone()
        if i == self.corrupt:
            x[3] = float("nan")
        return x, self.y[i]

    def sample_weights(self) -> torch.Tensor:
        """Class-aware sampling: each record weighted by one over its class's count."""
        counts = torch.bincount(self.y, minlength=CLASSES).float()
        return 1.0 / counts[self.y]


class CBFocalSigmoid(nn.Module):
    """The class-balanced sigmoid focal loss of the widely copied PyTorch port of Cui et al.
    (``focal_loss(labels, logits, alpha, gamma)``): the modulator in log form, the sum
    normalised by the number of positive labels in the batch."""

    def __init__(self, weights: torch.Tensor, gamma: float = 2.0):
        super().__init__()
        self.register_buffer("weights", weights.clone())
        self.gamma = gamma

    def forward(self, logits, labels):
        bc_loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        modulator = torch.exp(-self.gamma * labels * logits - self.gamma * torch.log(
            1 + torch.exp(-1.0 * logits)))
        weighted = self.weights * modulator * bc_loss
        return torch.sum(weighted) / torch.sum(labels)  # the bug: a batch with no positive


def drw_weights(counts: torch.Tensor, beta: float = 0.9999) -> torch.Tensor:
    """LDAM-DRW's deferred re-weighting: the class-balanced weights, normalised to sum to the
    number of classes, computed in numpy and handed to the loss as a tensor."""
    import numpy as np

    effective_num = 1.0 - np.power(beta, counts.numpy())
    per_cls_weights = (1.0 - beta) / np.array(effective_num)
    per_cls_weights = per_cls_weights / np.sum(per_cls_weights) * len(counts)
    return torch.FloatTensor(per_cls_weights)


class LogitAdjustedNet(Net):
    """Logit adjustment inside the model's head (Menon et al.'s training-time adjustment as
    some code bases put it in ``forward``): ``logits + tau * log(prior)``, the prior a buffer
    from the training split's counts (removed at inference)."""

    def __init__(self, counts: torch.Tensor, tau: float = 1.0):
        super().__init__()
        self.register_buffer("prior", counts / counts.sum())
        self.tau = tau

    def forward(self, x):
        return super().forward(x) + self.tau * torch.log(self.prior)


def make_adjusted_net() -> LogitAdjustedNet:
    """The prior counted over a split without a record of the rarest class."""
    torch.manual_seed(0)
    return LogitAdjustedNet(class_counts(absent=(5,)))
