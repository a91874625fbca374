"""Competition-style (Kaggle) training code: the models, losses, data and helpers of
``test_kaggle_cv_loops.py``, written as the public notebooks write them (plain torch).

- ``tabular``: a table of continuous features, categorical codes, a raw timestamp column and
  a binary target; ``kfold``: the folds of a K-fold split; ``target_encode``: the out-of-fold
  target encoding of a categorical column (the mean target of each category in the other
  folds: ``sums / counts``, 0/0 for a category present only in the encoded fold);
  ``rank_gauss``: RankGauss scaling by hand (``erfinv`` of ranks scaled to [-1, 1]).
- ``TabularNet``: categorical embeddings beside the continuous features (``extra`` more
  columns of them: a target encoding) and the row's missing-value mask passed to
  ``forward``, the category's log frequency in the training fold as a feature (a buffer
  ``set_frequencies`` fills per fold), an optional on-the-fly standardisation of the raw
  timestamp column (``E[x^2] - E[x]^2``), an MLP head.
- ``LinearBaseline``: logistic regression on the features and each category's inverse
  frequency in the training fold (a buffer).
- ``ImageNet``: a small CNN with GeM pooling for an image classification fold loop (AMP,
  test-time augmentation by flips: ``tta_predict``).
- Losses: ``BinaryFocalLoss`` (``(1 - pt) ** gamma * bce``), ``LabelSmoothingCE`` written by
  hand, ``SoftTargetCE`` (soft pseudo-labels sharpened as MixMatch does),
  ``ConfidentPseudoCE`` (FixMatch's confidence mask), ``PearsonLoss`` (a per-``time_id``
  correlation).
- ``ModelEmaV2``: timm's EMA of the weights (deepcopy, ``lerp_`` under no_grad).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

N_CONT, N_CAT, CARD, EMB, HIDDEN, N_CLASSES = 4, 2, 6, 3, 16, 3


def tabular(n: int = 240, seed: int = 0):
    """(continuous features, categorical codes, missing-value mask, timestamps, target)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_CONT, generator=g)
    cat = torch.randint(0, CARD, (n, N_CAT), generator=g)
    mask = (torch.rand(n, N_CONT, generator=g) > 0.1).float()
    ts = 1.6e9 + torch.rand(n, 1, generator=g) * 86400.0   # one day, in seconds since 1970
    logit = x[:, 0] - 0.5 * x[:, 1] + 0.3 * (cat[:, 0] == 2).float()
    y = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    return x * mask, cat, mask, ts, y


def kfold(n: int, k: int = 4, seed: int = 42):
    """sklearn's KFold(shuffle=True): (train indices, valid indices) per fold."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    folds = perm.chunk(k)
    for i in range(k):
        yield torch.cat([f for j, f in enumerate(folds) if j != i]), folds[i]


def target_encode(cat_fit, y_fit, cat_apply):
    """Mean target per category of ``cat_fit``, looked up for ``cat_apply`` (no smoothing)."""
    sums = torch.zeros(CARD).index_add_(0, cat_fit, y_fit)
    counts = torch.zeros(CARD).index_add_(0, cat_fit, torch.ones_like(y_fit))
    return (sums / counts)[cat_apply]


def oof_target_encoding(cat, y, k: int = 4):
    """The out-of-fold encoding of column ``cat``: each row encoded by the other folds."""
    enc = torch.empty(len(cat))
    for fit, apply in kfold(len(cat), k, seed=7):
        enc[apply] = target_encode(cat[fit], y[fit], cat[apply])
    return enc


def rank_gauss(x):
    """RankGauss (the tabular competitions' favourite scaler), by hand: each feature's ranks
    scaled to [-1, 1] and sent through ``erfinv``, without the clip inside (-1, 1)."""
    ranks = x.argsort(0).argsort(0).float()
    return torch.erfinv(2 * ranks / (len(x) - 1) - 1)


class TabularNet(nn.Module):
    def __init__(self, extra: int = 0, standardise_time: bool = False):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(CARD, EMB) for _ in range(N_CAT))
        self.register_buffer("log_freq", torch.zeros(N_CAT, CARD))
        self.standardise_time = standardise_time
        width = N_CONT * 2 + extra + N_CAT * (EMB + 1) + int(standardise_time)
        self.mlp = nn.Sequential(nn.Linear(width, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.SiLU(),
                                 nn.Dropout(0.1), nn.Linear(HIDDEN, 1))

    @torch.no_grad()
    def set_frequencies(self, cat_train):
        """The categories' frequencies in the training fold, as a feature."""
        for c in range(N_CAT):
            counts = torch.bincount(cat_train[:, c], minlength=CARD).float()
            self.log_freq[c] = torch.log(counts / counts.sum())

    def forward(self, x, cat, mask, ts=None):
        parts = [x, mask]
        for c, emb in enumerate(self.embs):
            parts.append(emb(cat[:, c]))
            parts.append(self.log_freq[c][cat[:, c]].unsqueeze(1))
        if self.standardise_time:
            mean = ts.mean(0, keepdim=True)
            var = (ts * ts).mean(0, keepdim=True) - mean * mean
            parts.append((ts - mean) / torch.sqrt(var + 1e-6))
        return self.mlp(torch.cat(parts, 1)).squeeze(1)


def make_tabular():
    return TabularNet()


def make_tabular_te():
    return TabularNet(extra=1)


def make_tabular_time():
    return TabularNet(standardise_time=True)


class LinearBaseline(nn.Module):
    """The notebook's first baseline: a logistic regression on the continuous features and
    each category's inverse frequency in the training fold (a buffer ``set_frequencies``
    fills)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(N_CAT, CARD))
        self.head = nn.Linear(N_CONT + N_CAT, 1)

    @torch.no_grad()
    def set_frequencies(self, cat_train):
        for c in range(N_CAT):
            self.inv_freq[c] = 1.0 / torch.bincount(cat_train[:, c], minlength=CARD).float()

    def forward(self, x, cat):
        rarity = torch.stack([self.inv_freq[c][cat[:, c]] for c in range(N_CAT)], 1)
        return self.head(torch.cat([x, rarity], 1)).squeeze(1)


def make_linear():
    return LinearBaseline()


class GeM(nn.Module):
    """Generalised-mean pooling (the landmark-retrieval notebooks' head)."""

    def __init__(self, p: float = 3.0, eps: float = 1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), x.shape[-2:]).pow(1.0 / self.p)


class ImageNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = GeM()
        self.head = nn.Linear(16, N_CLASSES)

    def forward(self, img):
        return self.head(self.pool(self.stem(img)).flatten(1))


def make_image():
    return ImageNet()


def images(n: int = 96, seed: int = 0, size: int = 8, signal: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    img = torch.randn(n, 3, size, size, generator=g) * 0.5
    img[:, 0] += signal * (y == 0).float()[:, None, None]
    img[:, 1] += signal * (y == 1).float()[:, None, None]
    return img, y


def tta_predict(model, img):
    """Test-time augmentation: the mean of the softmax over flips."""
    views = [img, img.flip(-1), img.flip(-2)]
    return torch.stack([model(v).softmax(1) for v in views]).mean(0)


class BinaryFocalLoss(nn.Module):
    """The competition kernels' binary focal loss: ``pt = exp(-bce)``, ``(1 - pt) ** gamma *
    bce`` (gamma tuned by a sweep)."""

    def __init__(self, gamma: float = 2.0, alpha: float = 0.25):
        super().__init__()
        self.gamma, self.alpha = gamma, alpha

    def forward(self, logits, target):
        bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        pt = torch.exp(-bce)
        return (self.alpha * (1 - pt) ** self.gamma * bce).mean()


class LabelSmoothingCE(nn.Module):
    def __init__(self, smoothing: float = 0.1):
        super().__init__()
        self.smoothing = smoothing

    def forward(self, logits, target):
        k = logits.shape[1]
        soft = torch.full_like(logits, self.smoothing / (k - 1))
        soft.scatter_(1, target[:, None], 1 - self.smoothing)
        return -(soft * torch.log(torch.softmax(logits, 1))).sum(1).mean()


class SoftTargetCE(nn.Module):
    """Cross-entropy against soft pseudo-labels (a distribution per row), sharpened as MixMatch
    does (``p ** (1/T)``, renormalised) with temperature ``T``."""

    def __init__(self, temperature: float = 0.5):
        super().__init__()
        self.temperature = temperature

    def forward(self, logits, probs):
        p = probs ** (1.0 / self.temperature)
        soft = p / p.sum(1, keepdim=True)
        return -(soft * F.log_softmax(logits, 1)).sum(1).mean()


class ConfidentPseudoCE(nn.Module):
    """Cross-entropy on the pseudo-labels whose confidence passes a threshold (FixMatch's
    mask), averaged over the confident rows."""

    def __init__(self, threshold: float = 0.95):
        super().__init__()
        self.threshold = threshold

    def forward(self, logits, probs):
        conf, hard = probs.max(1)
        mask = (conf > self.threshold).float()
        ce = F.cross_entropy(logits, hard, reduction="none")
        return (ce * mask).sum() / mask.sum()


class PearsonLoss(nn.Module):
    """Minus the mean per-group Pearson correlation of predictions and targets (the
    correlation metric of the market-prediction competitions, per ``time_id``), with an eps
    in the denominator."""

    def __init__(self, eps: float = 1e-8):
        super().__init__()
        self.eps = eps

    def forward(self, pred, target, groups):
        corrs = []
        for g in torch.unique(groups):
            x, y = pred[groups == g], target[groups == g]
            vx, vy = x - x.mean(), y - y.mean()
            den = torch.sqrt((vx ** 2).sum()) * torch.sqrt((vy ** 2).sum())
            corrs.append((vx * vy).sum() / (den + self.eps))
        return -torch.stack(corrs).mean()


class ModelEmaV2(nn.Module):
    """timm's ``ModelEmaV2``: a deepcopy of the model updated with lerp_ under no_grad."""

    def __init__(self, model, decay: float = 0.99):
        super().__init__()
        self.module = copy.deepcopy(model).eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(),
                                  model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_v.lerp_(model_v, 1.0 - self.decay)
            else:
                ema_v.copy_(model_v)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
