"""Domain adaptation and semi-supervised models and losses for ``test_adaptation``.

Written the way DANN / Transfer-Learning-Library / FixMatch / Mean Teacher repos write them;
the factories and losses live at module level so ``nanreplay`` rebuilds them from the bundle.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

D_IN, CLASSES, FEAT = 10, 4, 16


class GradientReverse(torch.autograd.Function):
    """DANN's gradient reversal layer: identity forward, ``-lambda * grad`` backward."""

    @staticmethod
    def forward(ctx, x, coeff):
        ctx.coeff = coeff
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.neg() * ctx.coeff, None


def grl_coeff(progress: float, gamma: float = 10.0) -> float:
    """Ganin & Lempitsky's schedule: 2 / (1 + exp(-gamma p)) - 1."""
    return 2.0 / (1.0 + math.exp(-gamma * progress)) - 1.0


class DANN(nn.Module):
    """Feature extractor, label classifier and domain discriminator behind a GRL. Source and
    target rows go through one forward; ``domain`` (0 source, 1 target) says which is which."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(D_IN, FEAT), nn.ReLU(), nn.Linear(FEAT, FEAT))
        self.classifier = nn.Linear(FEAT, CLASSES)
        self.discriminator = nn.Sequential(nn.Linear(FEAT, 8), nn.ReLU(), nn.Linear(8, 1))
        self.coeff = 0.0

    def forward(self, x, domain):
        f = self.features(x)
        logits = self.classifier(f)
        d = self.discriminator(GradientReverse.apply(f, self.coeff)).squeeze(-1)
        return logits, d, f


def make_dann() -> nn.Module:
    torch.manual_seed(0)
    return DANN()


def gaussian_mmd(fs, ft):
    """MMD with one Gaussian kernel whose bandwidth is the median pairwise squared distance.
    The distances are taken from the differences (cdist's exact form): two equal rows are 0
    apart on every CPU, where the matrix-product form ``|x|^2 + |y|^2 - 2 x.y`` (cdist's
    default past 25 rows) leaves them 0 or a residue depending on the kernels."""
    z = torch.cat([fs, ft])
    d2 = torch.cdist(z, z, compute_mode="donot_use_mm_for_euclid_dist").pow(2)
    sigma = d2.detach().median()
    k = torch.exp(-d2 / sigma)
    n = len(fs)
    return k[:n, :n].mean() + k[n:, n:].mean() - 2 * k[:n, n:].mean()


def coral(fs, ft):
    """Deep CORAL: the squared Frobenius distance of the two domains' feature covariances."""
    def cov(f):
        f = f - f.mean(0, keepdim=True)
        return f.t() @ f / (len(f) - 1)
    d = fs.shape[1]
    return (cov(fs) - cov(ft)).pow(2).sum() / (4 * d * d)


def entropy(logits):
    """Entropy minimisation on target predictions, -sum p log p, written out by hand."""
    p = logits.softmax(-1)
    return -(p * p.log()).sum(-1).mean()


def dann_loss(out, y, domain, align: str = "mmd", temp: float = 1.0):
    """The source rows' cross-entropy, the domain discriminator's BCE over every row, and
    an alignment term between the domains' features (or the target rows' entropy)."""
    logits, d, f = out
    src, tgt = domain == 0, domain == 1
    loss = F.cross_entropy(logits[src], y[src]) + F.binary_cross_entropy_with_logits(
        d, domain.float())
    if align == "mmd":
        loss = loss + gaussian_mmd(f[src], f[tgt])
    elif align == "coral":
        loss = loss + coral(f[src], f[tgt])
    elif align == "coral_cov":
        loss = loss + coral_torch_cov(f[src], f[tgt])
    elif align == "entropy":
        loss = loss + 0.1 * entropy(logits[tgt] / temp)
    elif align == "guarded_entropy":
        loss = loss + 0.1 * guarded_entropy(logits[tgt] / temp)
    return loss


class WideNet(nn.Module):
    """A small classifier, the student and (by EMA) the teacher of Mean Teacher and FixMatch."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return WideNet()


def fixmatch_loss(logits_x, y, logits_w, logits_s, threshold: float = 0.95):
    """FixMatch: supervised CE plus CE of the strong view on the weak view's confident
    pseudo-labels, averaged over the confident rows only (the bug: none may be confident)."""
    sup = F.cross_entropy(logits_x, y)
    probs = logits_w.detach().softmax(-1)
    conf, pseudo = probs.max(-1)
    mask = (conf >= threshold).float()
    unsup = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).sum() / mask.sum()
    return sup + unsup


def mean_teacher_loss(student_logits, y, labelled, teacher_logits, weight: float = 1.0):
    """CE on the labelled rows and a softmax MSE consistency to the EMA teacher on all."""
    sup = F.cross_entropy(student_logits[labelled], y[labelled])
    cons = F.mse_loss(student_logits.softmax(-1), teacher_logits.softmax(-1))
    return sup + weight * cons


class MeanTeacher(nn.Module):
    """The student and its EMA teacher in one module; the optimizer holds the student only,
    and the loop writes the teacher's weights after each ``optimizer.step()``."""

    def __init__(self):
        super().__init__()
        self.student = make_net()
        self.teacher = make_net().requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            t = self.teacher(x)
        return self.student(x), t


def make_mean_teacher() -> nn.Module:
    return MeanTeacher()


def fixmatch_indexed_loss(logits_x, y, logits_w, logits_s, threshold: float = 0.95):
    """FixMatch with the confident rows selected by a boolean index: the cross-entropy of no
    row (none confident) is a mean over nothing."""
    conf, pseudo = logits_w.detach().softmax(-1).max(-1)
    m = conf >= threshold
    return F.cross_entropy(logits_x, y) + F.cross_entropy(logits_s[m], pseudo[m])


def pi_model_loss(logits_x, y, logits_w, logits_s, weight: float = 1.0):
    """Supervised CE plus the Pi-model/UDA consistency between the weak and strong views."""
    return F.cross_entropy(logits_x, y) + weight * F.mse_loss(
        logits_s.softmax(-1), logits_w.detach().softmax(-1))


def guarded_entropy(logits):
    """The entropy with its 0 * log 0 guarded in the forward only: torch.where's untaken
    branch still back-propagates log's 1/p = inf at p = 0, times the where's 0: NaN."""
    p = logits.softmax(-1)
    return -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1).mean()


class DANNAlpha(DANN):
    """fungtion/DANN's signature: the GRL coefficient is passed to each forward."""

    def forward(self, x, domain, alpha=0.0):
        self.coeff = alpha
        return super().forward(x, domain)


def make_dann_alpha() -> nn.Module:
    torch.manual_seed(0)
    return DANNAlpha()


def coral_torch_cov(fs, ft):
    """Deep CORAL through torch.cov (correction=1: n - 1 = 0 for one target row)."""
    d = fs.shape[1]
    return (torch.cov(fs.t()) - torch.cov(ft.t())).pow(2).sum() / (4 * d * d)
