"""Active learning and uncertainty-driven data selection written as its repositories write it,
for ``test_active_learning``.

- ``pool_dataset``: four Gaussian blobs in 16 dimensions, the whole pool; ``initial_split``
  draws the first labelled indices (a class may have none yet), the rest is the unlabelled
  pool; both are ``Subset`` views of one ``TensorDataset``.
- ``MCDropoutNet``: Gal et al.'s MC-dropout classifier (features and logits); ``bald`` is
  BALD's mutual information over ``T`` stochastic passes (entropy of the mean prediction minus
  the mean entropy, ``p * log p``), ``batchbald_joint_entropy`` BatchBALD's joint entropy of two
  candidates, ``acquire`` the top-k of the pool. Semi-supervised rounds add entropy
  minimisation on an unlabelled batch (``entropy_min``); ``imprint_head`` sets the head's
  rows to the classes' mean normalised features between rounds (weight imprinting).
- ``class_balanced_ce``: cross-entropy weighted by inverse class counts of the labelled pool,
  normalised to sum to the number of classes (``class_weights``).
- ``LearningLossNet``: Yoo & Kweon's learning-loss module: a backbone whose intermediate
  features feed a ``LossNet`` (global pooling, a linear per level, concat), trained with the
  margin ranking loss between the predicted losses of sample pairs (``LossPredLoss``; a
  softplus "soft margin" form ``SoftRankLoss`` with a temperature).
- ``coreset_greedy``: Sener & Savarese's k-center greedy over ``cdist``; ``KCenterRegularizer``
  the batch's nearest-neighbour distance term (sqrt of squared distances) some core-set
  variants train with.
- ``Ensemble``: a deep ensemble of small members, the mean of their softmaxes;
  ``RegressionEnsemble`` Lakshminarayanan et al.'s regression members (a mean and a
  log-variance each, stacked members first) under a hand-written Gaussian NLL, trained on the
  targets an oracle gives the acquired records (``oracle_targets``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Subset, TensorDataset

K = 4  # classes
D_IN = 16


def pool_dataset(n: int = 256, seed: int = 0, scale: float = 3.0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % K
    centres = torch.eye(K, D_IN) * scale
    x = centres[y] + torch.randn(n, D_IN, generator=g)
    return TensorDataset(x, y)


def initial_split(ds: TensorDataset, n_labelled: int = 64, without: int | None = None,
                  seed: int = 0):
    """The first labelled indices (``without``: a class none of whose records is labelled yet,
    as a random seed set of a rare class leaves it) and the unlabelled rest."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(ds), generator=g)
    ys = ds.tensors[1][order]
    if without is not None:
        order = order[ys != without]
    lab = order[:n_labelled].tolist()
    rest = sorted(set(range(len(ds))) - set(lab))
    return Subset(ds, lab), Subset(ds, rest)


# ---------------------------------------------------------------------------------------------
# MC dropout, BALD, BatchBALD


class MCDropoutNet(nn.Module):
    def __init__(self, p: float = 0.25, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, hidden), nn.ReLU(), nn.Dropout(p),
                                  nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(p))
        self.head = nn.Linear(hidden, K)

    def forward(self, x):
        return self.head(self.body(x))


def make_mc_net():
    torch.manual_seed(0)
    return MCDropoutNet()


@torch.no_grad()
def mc_probs(model, x, T: int = 8):
    model.train()  # dropout on at test time
    return torch.stack([F.softmax(model(x), -1) for _ in range(T)])  # (T, N, K)


def bald(probs: torch.Tensor) -> torch.Tensor:
    mean = probs.mean(0)
    entropy_mean = -(mean * torch.log(mean + 1e-10)).sum(-1)
    mean_entropy = -(probs * torch.log(probs + 1e-10)).sum(-1).mean(0)
    return entropy_mean - mean_entropy


def batchbald_joint_entropy(probs: torch.Tensor, i: int, j: int) -> torch.Tensor:
    joint = torch.einsum("tk,tl->kl", probs[:, i], probs[:, j]) / probs.shape[0]
    return -(joint * torch.log(joint + 1e-10)).sum()


def acquire(model, pool: Subset, k: int = 16) -> list[int]:
    x = torch.stack([pool[i][0] for i in range(len(pool))])
    scores = bald(mc_probs(model, x))
    return [pool.indices[i] for i in scores.topk(k).indices.tolist()]


def entropy_min(logits: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """Grandvalet & Bengio's entropy minimisation on an unlabelled batch."""
    p = F.softmax(logits, dim=1)
    if eps is None:
        return -(p * torch.log(p)).sum(1).mean()  # the bug: 0 * log 0 where p underflows
    return -(p * torch.log(p + eps)).sum(1).mean()


class SemiSupervisedLoss(nn.Module):
    def __init__(self, lam: float = 0.5, eps: float | None = None):
        super().__init__()
        self.lam, self.eps = lam, eps

    def forward(self, logits, y, pool_logits):
        return F.cross_entropy(logits, y) + self.lam * entropy_min(pool_logits, self.eps)


# ---------------------------------------------------------------------------------------------
# class-balanced training on the labelled pool


def class_weights(labels: torch.Tensor, floor: float | None = None) -> torch.Tensor:
    counts = torch.bincount(labels, minlength=K).float()
    if floor is not None:
        counts = counts.clamp_min(floor)
    w = 1.0 / counts  # inverse class frequency
    return w / w.sum() * K  # the bug (floor None): inf / inf at a class with no label yet


def class_balanced_ce(weights: torch.Tensor) -> nn.CrossEntropyLoss:
    return nn.CrossEntropyLoss(weight=weights)


# ---------------------------------------------------------------------------------------------
# learning loss (Yoo & Kweon 2019)


class LossNet(nn.Module):
    def __init__(self, dims=(32, 32), interm: int = 16):
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(d, interm) for d in dims)
        self.linear = nn.Linear(interm * len(dims), 1)

    def forward(self, features):
        out = [F.relu(fc(f)) for fc, f in zip(self.fcs, features)]
        return self.linear(torch.cat(out, 1)).view(-1)


class LearningLossNet(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.block1 = nn.Sequential(nn.Linear(D_IN, hidden), nn.ReLU())
        self.block2 = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())
        self.fc = nn.Linear(hidden, K)
        self.lossnet = LossNet((hidden, hidden))

    def forward(self, x):
        f1 = self.block1(x)
        f2 = self.block2(f1)
        # the backbone's features feed the loss module detached after epoch 120 in the paper;
        # here from the start
        return self.fc(f2), self.lossnet([f1.detach(), f2.detach()])


def make_ll_net():
    torch.manual_seed(0)
    return LearningLossNet()


class LossPredLoss(nn.Module):
    """The paper's pairwise margin ranking loss: the first half of the batch against its flip."""

    def __init__(self, margin: float = 1.0):
        super().__init__()
        self.margin = margin

    def forward(self, pred, target):
        assert len(pred) % 2 == 0, "the batch size should be even"
        target = target.detach()
        pred = (pred - pred.flip(0))[:len(pred) // 2]
        target = (target - target.flip(0))[:len(target) // 2]
        one = 2 * torch.sign(torch.clamp(target, min=0)) - 1
        return torch.clamp(self.margin - one * pred, min=0).mean()


class SoftRankLoss(nn.Module):
    """A smooth margin ranking: ``log(1 + exp(-sign * (p_i - p_j) / tau))``, written out."""

    def __init__(self, tau: float = 0.01, stable: bool = False, log1p: bool = True):
        super().__init__()
        self.tau, self.stable, self.log1p = tau, stable, log1p

    def forward(self, pred, target):
        target = target.detach()
        dp = (pred - pred.flip(0))[:len(pred) // 2]
        dt = (target - target.flip(0))[:len(target) // 2]
        z = -torch.sign(dt) * dp / self.tau
        if self.stable:
            return F.softplus(z).mean()
        if not self.log1p:
            return torch.log(1 + torch.exp(z)).mean()  # (the same bug, the textbook form)
        return torch.log1p(torch.exp(z)).mean()  # the bug: exp overflows past z = 88


class LearningLossObjective(nn.Module):
    def __init__(self, rank: nn.Module, weight: float = 1.0):
        super().__init__()
        self.rank, self.weight = rank, weight

    def forward(self, out, y):
        logits, pred_loss = out
        target_loss = F.cross_entropy(logits, y, reduction="none")
        return target_loss.mean() + self.weight * self.rank(pred_loss, target_loss)


# ---------------------------------------------------------------------------------------------
# core-set


def pairwise_dist(a: torch.Tensor, b: torch.Tensor, eps: float = 0.0,
                  clamp: bool = True) -> torch.Tensor:
    sq = (a * a).sum(1, keepdim=True) + (b * b).sum(1) - 2 * a @ b.T
    if not clamp:  # the bug: |a|^2 + |b|^2 - 2ab cancels below 0 in low precision
        return torch.sqrt(sq + eps)
    return torch.sqrt(sq.clamp_min(0) + eps)  # the bug (eps 0): d sqrt / d x at 0 on the diagonal


@torch.no_grad()
def coreset_greedy(feats: torch.Tensor, labelled: list[int], k: int) -> list[int]:
    mind = torch.cdist(feats, feats[labelled]).min(1).values
    chosen = []
    for _ in range(k):
        i = int(mind.argmax())
        chosen.append(i)
        mind = torch.minimum(mind, torch.cdist(feats, feats[i:i + 1]).squeeze(1))
    return chosen


class CoresetNet(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(D_IN, hidden), nn.ReLU(), nn.Linear(hidden, 16))
        self.fc = nn.Linear(16, K)

    def forward(self, x):
        f = self.embed(x)
        return self.fc(F.relu(f)), f


def make_coreset_net():
    torch.manual_seed(0)
    return CoresetNet()


class KCenterRegularizer(nn.Module):
    """Cross-entropy minus ``lam`` times the mean nearest-neighbour distance in the batch
    (spread the labelled features, as a k-center cover wants)."""

    def __init__(self, lam: float = 0.05, eps: float = 0.0, clamp: bool = True):
        super().__init__()
        self.lam, self.eps, self.clamp = lam, eps, clamp

    def forward(self, out, y):
        logits, f = out
        d = pairwise_dist(f, f, self.eps, self.clamp)
        eye = torch.eye(len(f), dtype=torch.bool)
        nn_d = d.masked_fill(eye, float("inf")).min(1).values
        return F.cross_entropy(logits, y) - self.lam * nn_d.mean()


# ---------------------------------------------------------------------------------------------
# deep ensembles


class Ensemble(nn.Module):
    def __init__(self, members: int = 3, hidden: int = 32):
        super().__init__()
        self.members = nn.ModuleList(
            nn.Sequential(nn.Linear(D_IN, hidden), nn.ReLU(), nn.Linear(hidden, K))
            for _ in range(members))

    def forward(self, x):
        return torch.stack([m(x) for m in self.members])  # (M, N, K)


def make_ensemble():
    torch.manual_seed(0)
    return Ensemble()


def ensemble_nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each member trained on its own NLL (summed over members)."""
    m = logits.shape[0]
    return F.cross_entropy(logits.reshape(-1, K), y.repeat(m), reduction="sum") / len(y)


class RegressionEnsemble(nn.Module):
    """Lakshminarayanan et al.'s regression ensemble: each member a mean and a log-variance."""

    def __init__(self, members: int = 3, hidden: int = 32):
        super().__init__()
        self.members = nn.ModuleList(
            nn.Sequential(nn.Linear(D_IN, hidden), nn.ReLU(), nn.Linear(hidden, 2))
            for _ in range(members))

    def forward(self, x):
        out = torch.stack([m(x) for m in self.members])  # (M, N, 2)
        return out[..., 0], out[..., 1]


def make_regression_ensemble():
    torch.manual_seed(0)
    return RegressionEnsemble()


def gaussian_nll(out, y: torch.Tensor) -> torch.Tensor:
    mu, logvar = out
    return (0.5 * (logvar + (y - mu) ** 2 / logvar.exp())).mean()


def oracle_targets(ds: TensorDataset) -> torch.Tensor:
    """A regression target the oracle labels each acquired record with."""
    x = ds.tensors[0]
    return x[:, :4].sum(1) + 0.1 * x[:, 4]


@torch.no_grad()
def imprint_head(model: MCDropoutNet, x: torch.Tensor, y: torch.Tensor) -> None:
    """Weight imprinting between rounds (Qi et al.): each class's row of the head is the
    normalised mean feature of its labelled records."""
    model.eval()
    f = F.normalize(model.body(x), dim=1)
    for c in range(K):
        model.head.weight[c] = F.normalize(f[y == c].mean(0), dim=0)  # NaN for a class with none
    model.train()
