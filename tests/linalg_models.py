"""Models for ``tests/test_linalg.py``: linear-algebra-heavy training written as the usual
repositories write it (a Glow flow's invertible 1x1 convolution, an exact GP's marginal
likelihood, deep kernel learning under autocast, a matrix square root through eigh,
Newton-Schulz whitening), each with a NaN bug planted that the domain is known for.

Factories are named ``make_*``; tests record with ``factory="linalg_models:make_*"`` and
replay from this directory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

C, D_IN, HIDDEN = 4, 3, 16


class InvConv(nn.Module):
    """Glow's invertible 1x1 convolution on flat features, its weight a random rotation from
    QR (as Glow initialises it). BUG: ``torch.logdet`` instead of ``slogdet``'s logabsdet: a
    weight whose determinant is negative has a NaN log-determinant."""

    def __init__(self, c: int):
        super().__init__()
        w = torch.linalg.qr(torch.randn(c, c))[0]
        self.weight = nn.Parameter(w)

    def forward(self, x):
        return x @ self.weight.T, torch.logdet(self.weight).expand(len(x))


class SlogdetInvConv(InvConv):
    """The same layer written as Glow writes it, ``slogdet``'s logabsdet: right for either
    sign, -inf for a singular weight."""

    def forward(self, x):
        return x @ self.weight.T, torch.linalg.slogdet(self.weight).logabsdet.expand(len(x))


class Coupling(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(c // 2, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, c))

    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        s, t = self.net(a).chunk(2, dim=1)
        s = torch.tanh(s)
        return torch.cat([a, b * torch.exp(s) + t], dim=1), s.sum(1)


class GlowFlow(nn.Module):
    def __init__(self, conv=InvConv):
        super().__init__()
        self.conv0, self.coup0 = conv(C), Coupling(C)
        self.conv1, self.coup1 = conv(C), Coupling(C)

    def forward(self, x):
        logdet = torch.zeros(len(x))
        for layer in (self.conv0, self.coup0, self.conv1, self.coup1):
            x, ld = layer(x)
            logdet = logdet + ld
        return x, logdet


def make_glow(seed: int = 0):
    torch.manual_seed(seed)
    return GlowFlow()


def make_glow_zero_channel():
    """Glow with slogdet, its second 1x1 convolution's last output channel zero-initialised
    (as a residual branch would be, "for stability"): that weight is singular."""
    torch.manual_seed(0)
    flow = GlowFlow(SlogdetInvConv)
    with torch.no_grad():
        flow.conv1.weight[-1] = 0
    return flow


def flow_nll(out, _unused=None):
    z, logdet = out
    return (0.5 * (z ** 2).sum(1) - logdet).mean()


class ExactGP(nn.Module):
    """Exact GP regression on a mini-batch (the batch is the training set of the step): RBF
    kernel with softplus lengthscale and noise, negative log marginal likelihood. BUG: a noise
    of 2e-9, below float32's resolution next to the kernel's diagonal of 1 (rounded away):
    two identical inputs make K singular, and float32 rounding makes it indefinite. Through
    ``cholesky_ex`` (no error check, no host sync) the factorisation fails silently and the
    factor's diagonal holds the negative pivot, whose log is NaN; with ``logdet=True`` (the
    textbook ``solve`` and ``torch.logdet``) the determinant comes out negative, its log NaN."""

    def __init__(self, logdet: bool = False):
        super().__init__()
        self.logdet = logdet
        self.raw_lengthscale = nn.Parameter(torch.tensor(0.5))
        self.raw_noise = nn.Parameter(torch.tensor(-20.0))  # softplus(-20) ~ 2e-9

    def forward(self, x, y):
        ls, noise = F.softplus(self.raw_lengthscale), F.softplus(self.raw_noise)
        d2 = torch.cdist(x / ls, x / ls).pow(2)
        k = torch.exp(-0.5 * d2) + noise * torch.eye(len(x))
        if self.logdet:
            alpha = torch.linalg.solve(k, y)
            return 0.5 * (y @ alpha) + 0.5 * torch.logdet(k)
        chol = torch.linalg.cholesky_ex(k).L
        alpha = torch.cholesky_solve(y.unsqueeze(-1), chol).squeeze(-1)
        return 0.5 * (y @ alpha) + chol.diagonal().log().sum()


def make_exact_gp():
    torch.manual_seed(0)
    return ExactGP()


def make_exact_gp_logdet():
    torch.manual_seed(0)
    return ExactGP(logdet=True)


class NewtonSchulzWhiten(nn.Module):
    """Iterative batch whitening (IterNorm): the covariance's inverse square root by
    Newton-Schulz iterations. BUG: the covariance is not divided by its trace first, and the
    iteration converges only for a spectral norm below 3: a batch with one huge record makes
    it diverge, doubly exponentially, until float32 overflows."""

    def __init__(self, d: int, iters: int = 8):
        super().__init__()
        self.iters = iters
        self.eps = 1e-5
        self.d = d

    def forward(self, h):
        hc = h - h.mean(0, keepdim=True)
        sigma = hc.T @ hc / len(h) + self.eps * torch.eye(self.d)
        p = torch.eye(self.d)
        for _ in range(self.iters):
            p = 0.5 * (3.0 * p - torch.linalg.matrix_power(p, 3) @ sigma)
        return hc @ p


class IterNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.white = NewtonSchulzWhiten(HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        return self.head(torch.relu(self.white(self.lin(x)))).squeeze(-1)


def make_iternorm():
    torch.manual_seed(0)
    return IterNormNet()


class EighSqrtm(nn.Module):
    """The covariance's matrix square root through eigh (a Bures-Wasserstein / Frechet
    distance between the batch's features and a Gaussian target). BUG: ``evals.sqrt()``
    without a clamp: a covariance of fewer samples than features is singular, and rounding
    leaves its zero eigenvalues slightly negative."""

    def forward(self, h):
        hc = h - h.mean(0, keepdim=True)
        cov = hc.T @ hc / (len(h) - 1)
        evals, evecs = torch.linalg.eigh(cov)
        return evecs @ torch.diag_embed(evals.sqrt()) @ evecs.T


class BuresNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 8))
        self.sqrtm = EighSqrtm()

    def forward(self, x):
        return self.sqrtm(self.enc(x))


def make_bures():
    torch.manual_seed(0)
    return BuresNet()


def bures_loss(root, _unused=None):
    """Squared Bures distance to the identity: tr(C) + d - 2 tr(C^1/2)."""
    return (root @ root).diagonal().sum() + root.shape[0] - 2 * root.diagonal().sum()


class DeepKernelGP(nn.Module):
    """Deep kernel learning under bfloat16 autocast: a feature net, a linear kernel on its
    features (``feats @ feats.T``, which autocast runs in bfloat16), cast to float32 with a
    jitter, and the GP's negative log marginal likelihood through ``cholesky_ex``. BUG: the
    kernel matrix is computed in bfloat16, whose 8-bit mantissa makes a matrix of rank
    ``FEAT`` < n indefinite by far more than the jitter."""

    FEAT = 4

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, self.FEAT))

    def forward(self, x, y):
        f = self.net(x)
        k = (f @ f.T).float() + 1e-4 * torch.eye(len(x))
        chol = torch.linalg.cholesky_ex(k).L
        alpha = torch.cholesky_solve(y.unsqueeze(-1), chol).squeeze(-1)
        return 0.5 * (y @ alpha) + chol.diagonal().log().sum()


def make_deep_kernel_gp():
    torch.manual_seed(0)
    return DeepKernelGP()


class ConditionalLinearFlow(nn.Module):
    """A conditional linear flow: each sample's map ``A(c) = I + c * W`` from its scalar
    context ``c``, log-likelihood ``log N(A x) + log det A``. BUG: ``torch.logdet`` of each
    sample's matrix instead of ``slogdet``'s ``log|det|``, the change of variables' term: a
    context that flips the map's orientation (a negative determinant) makes that sample NaN."""

    def __init__(self, d: int = C):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) * 0.5)
        self.register_buffer("eye", torch.eye(d))

    def forward(self, x, c):
        a = self.eye + c[:, None, None] * self.w  # (B, d, d)
        z = (a @ x.unsqueeze(-1)).squeeze(-1)
        return z, torch.logdet(a)


def make_conditional_flow():
    torch.manual_seed(0)
    return ConditionalLinearFlow()


class OrthoProjection(nn.Module):
    """Features projected on an orthonormal basis of ``k`` learned directions, made by QR at
    every call (differentiated through). BUG: nothing keeps the directions independent: once
    two coincide, R has a 0 on its diagonal and QR's backward divides by it."""

    def __init__(self, d: int = 8, k: int = 4):
        super().__init__()
        self.dirs = nn.Parameter(torch.randn(d, k))

    def forward(self, h):
        q, _ = torch.linalg.qr(self.dirs)
        return h @ q


class OrthoNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(D_IN, 8)
        self.proj = OrthoProjection()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.relu(self.proj(self.enc(x)))).squeeze(-1)


def make_ortho_net():
    torch.manual_seed(0)
    return OrthoNet()


class PatchNormals(nn.Module):
    """Point-cloud normals, differentiable: each patch's normal is the eigenvector of the
    smallest eigenvalue of its covariance (batched eigh). BUG: a patch whose points coincide
    has a zero covariance, three equal eigenvalues, and eigh's backward divides by their
    differences."""

    def forward(self, p):  # p (B, K, 3)
        pc = p - p.mean(1, keepdim=True)
        evals, evecs = torch.linalg.eigh(pc.transpose(1, 2) @ pc / p.shape[1])
        return evecs[..., 0]


class NormalNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.offset = nn.Linear(3, 3)  # a learned deformation of the points
        self.normals = PatchNormals()

    def forward(self, p):
        return self.normals(p + 0.1 * self.offset(p))


def make_normal_net():
    torch.manual_seed(0)
    return NormalNet()


def normal_loss(n, target):
    """1 - |cos| to the target normal (a normal's sign is arbitrary)."""
    return (1 - (n * target).sum(-1).abs()).mean()


class ResidualCovarianceNLL(nn.Module):
    """Multivariate regression's Gaussian NLL with the residuals' own covariance (a
    seemingly-unrelated-regressions / multi-output loss): ``Σ = RᵀR / n``, then Cholesky for
    its log-determinant and the whitened residuals. Singular when the batch has fewer rows
    than outputs (the last, short batch of an epoch)."""

    def forward(self, pred, target):
        r = pred - target
        cov = r.T @ r / r.shape[0]
        chol = torch.linalg.cholesky(cov)
        white = torch.linalg.solve_triangular(chol, r.T, upper=False)
        return 0.5 * (white.pow(2).sum(0).mean() + 2 * torch.log(torch.diagonal(chol)).sum())


def make_multi_output():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 3))


def residual_covariance_nll(pred, target):
    return ResidualCovarianceNLL()(pred, target)
