"""Models for ``tests/test_numerics.py``: numerical failure modes beyond a single op's pole —
a masked reduction over an empty row, linear algebra's gradients at degenerate inputs.

Every bug fires on a batch the loop plants at a known step, so the replay rebuilds it from the
bundle. Factories are named ``make_*``; tests record with ``factory="numerics_models:make_*"``
and replay from this directory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_IN, HIDDEN, BAG = 6, 12, 5


class LSEPool(nn.Module):
    """Smooth-max pooling over a bag's real instances: padding is masked to -inf first."""

    def forward(self, h, mask):  # h (B, N, D), mask (B, N): True for a real instance
        h = h.masked_fill(~mask.unsqueeze(-1), float("-inf"))
        return torch.logsumexp(2.0 * h, dim=1) / 2.0  # BUG: an empty bag gives -inf


class BagNet(nn.Module):
    """Multiple-instance learning: instance encoder, masked logsumexp pooling, bag score."""

    def __init__(self):
        super().__init__()
        self.inst = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN))
        self.pool = LSEPool()
        self.cls = nn.Linear(HIDDEN, 1)

    def forward(self, x, mask):
        return self.cls(self.pool(self.inst(x), mask)).squeeze(-1)


def make_bag_net():
    torch.manual_seed(0)
    return BagNet()


class Whiten(nn.Module):
    """ZCA batch whitening (decorrelated batch norm) through an eigen- or singular value
    decomposition of the batch covariance: a batch of identical samples has a covariance of
    eps * I, whose eigenvalues are all equal."""

    def __init__(self, svd: bool):
        super().__init__()
        self.svd = svd

    def forward(self, h):
        hc = h - h.mean(0, keepdim=True)
        cov = hc.T @ hc / h.shape[0] + 1e-5 * torch.eye(h.shape[1])
        if self.svd:
            u, s, _ = torch.linalg.svd(cov)
            return hc @ u @ torch.diag(s.rsqrt()) @ u.T
        evals, evecs = torch.linalg.eigh(cov)
        return hc @ evecs @ torch.diag(evals.rsqrt()) @ evecs.T


class WhitenNet(nn.Module):
    def __init__(self, svd: bool = False):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.white = Whiten(svd)
        self.head = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        return self.head(torch.relu(self.white(self.lin(x))))


def make_eigh_whiten_net():
    torch.manual_seed(0)
    return WhitenNet(svd=False)


def make_svd_whiten_net():
    torch.manual_seed(0)
    return WhitenNet(svd=True)


class ActNorm(nn.Module):
    """Glow's ActNorm with its data-dependent init written without an eps: the first batch's
    per-feature std sets the scale, so a feature constant in that batch gives log(0)."""

    def __init__(self, d: int):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(d))
        self.log_scale = nn.Parameter(torch.zeros(d))
        self.register_buffer("initialized", torch.tensor(False))

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0))
                self.log_scale.data.copy_(-torch.log(x.std(0)))  # BUG: no eps
                self.initialized.fill_(True)
        return (x + self.loc) * torch.exp(self.log_scale), self.log_scale.sum().expand(len(x))


class Coupling(nn.Module):
    """RealNVP affine coupling: half the features scale and shift the other half."""

    def __init__(self, d: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d // 2, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, d))

    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        s, t = self.net(a).chunk(2, dim=1)
        return torch.cat([b * torch.exp(s) + t, a], dim=1), s.sum(1)


class Flow(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm0, self.coup0 = ActNorm(D_IN), Coupling(D_IN)
        self.norm1, self.coup1 = ActNorm(D_IN), Coupling(D_IN)

    def forward(self, x):
        logdet = 0
        for layer in (self.norm0, self.coup0, self.norm1, self.coup1):
            x, ld = layer(x)
            logdet = logdet + ld
        return torch.cat([x, logdet.unsqueeze(1)], dim=1)


def flow_nll(out, target):
    """Negative log-likelihood under a standard normal base (``target`` is unused)."""
    z, logdet = out[:, :-1], out[:, -1]
    return (0.5 * (z ** 2).sum(1) - logdet).mean()


def make_flow():
    torch.manual_seed(0)
    return Flow()


class RegressionHead(nn.Module):
    """Two raw outputs per sample, which the loss turns into a distribution's parameters."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, 2)

    def forward(self, x):
        return self.lin(x)


def make_regression_head():
    torch.manual_seed(0)
    return RegressionHead()


def gamma_nll(raw, y):
    """Gamma regression (rainfall amounts): concentration and rate through softplus."""
    conc, rate = torch.nn.functional.softplus(raw).unbind(1)
    dist = torch.distributions.Gamma(conc, rate, validate_args=False)
    return -dist.log_prob(y).mean()


def make_tagger():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 5))


def multi_positive_loss(logits, labels):
    """Multi-label softmax loss: log-sum-exp over all tags minus over the positive ones (the
    others masked to -inf); a record with no tag has no positive: -inf."""
    lse_pos = torch.logsumexp(logits.masked_fill(~labels.bool(), float("-inf")), dim=1)
    return (torch.logsumexp(logits, dim=1) - lse_pos).mean()


class ArcMargin(nn.Module):
    """An ArcFace head: the angle between an embedding and each class's weight, a margin added
    to the true class's (``acos`` of a cosine of unit vectors, with no clamp)."""

    def __init__(self, dim: int = 32, classes: int = 10, s: float = 30.0, m: float = 0.5):
        super().__init__()
        self.W = nn.Parameter(torch.randn(classes, dim) * 0.1)
        self.s, self.m = s, m

    def forward(self, emb, labels):
        cos = F.linear(F.normalize(emb), F.normalize(self.W))
        theta = torch.acos(cos)  # BUG: no clamp into (-1, 1)
        onehot = F.one_hot(labels, cos.shape[1]).bool()
        return self.s * torch.where(onehot, torch.cos(theta + self.m), cos)


class ArcFaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
        self.head = ArcMargin()

    def forward(self, x, labels):
        return self.head(self.backbone(x), labels)


def make_arcface_net() -> nn.Module:
    torch.manual_seed(0)
    return ArcFaceNet()


class PatchNet(nn.Module):
    """A ViT stem: patch embedding, LayerNorm, pooled classifier."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 32, 8, 8)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        return self.head(self.norm(x).mean(1))


def make_patch_net() -> nn.Module:
    torch.manual_seed(0)
    return PatchNet()
