"""Models for ``tests/test_linalg.py``: linear-algebra-heavy training written as the usual
repositories write it (a Glow flow's invertible 1x1 convolution, a sparse variational GP's
kernel against inducing points, Procrustes alignment, Newton-Schulz whitening), each with a
NaN bug planted that the domain is known for.

Factories are named ``make_*``; tests record with ``factory="linalg_models:make_*"`` and
replay from this directory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

C, D_IN, HIDDEN, M_IND = 4, 3, 16, 8


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
    def __init__(self):
        super().__init__()
        self.conv0, self.coup0 = InvConv(C), Coupling(C)
        self.conv1, self.coup1 = InvConv(C), Coupling(C)

    def forward(self, x):
        logdet = torch.zeros(len(x))
        for layer in (self.conv0, self.coup0, self.conv1, self.coup1):
            x, ld = layer(x)
            logdet = logdet + ld
        return x, logdet


def make_glow(seed: int = 0):
    torch.manual_seed(seed)
    return GlowFlow()


def flow_nll(out, _unused=None):
    z, logdet = out
    return (0.5 * (z ** 2).sum(1) - logdet).mean()


class InducingKernel(nn.Module):
    """A sparse variational GP's cross-covariance K(x, Z) between a batch and the inducing
    points, Matern-1/2 (exponential) kernel, lengthscale through softplus (gpytorch's Positive
    constraint). BUG: the distance is ``sqrt`` of the squared distance without a floor (gpytorch
    clamps it, ``clamp_min(1e-30)``): a sample lying on an inducing point has distance 0, whose
    square root has an infinite derivative."""

    def __init__(self, z: torch.Tensor):
        super().__init__()
        # gpytorch's learn_inducing_locations=False: the inducing points stay where they began
        self.register_buffer("inducing", z.clone())
        self.raw_lengthscale = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        ls = F.softplus(self.raw_lengthscale)
        d2 = ((x.unsqueeze(-2) - self.inducing.unsqueeze(-3)) / ls).pow(2).sum(-1)
        return torch.exp(-torch.sqrt(d2))  # BUG: sqrt(0) at an inducing point


class SVGPRegressor(nn.Module):
    """A deep-kernel SVGP's predictive mean: features, then K(x, Z) times the variational
    mean (the whitened parametrisation's K_xz K_zz^-1/2 m folded into one vector)."""

    def __init__(self, z: torch.Tensor):
        super().__init__()
        self.covar = InducingKernel(z)
        self.var_mean = nn.Parameter(torch.randn(z.shape[0]) * 0.1)

    def forward(self, x):
        return self.covar(x) @ self.var_mean


def inducing_init(n: int = M_IND) -> torch.Tensor:
    """gpytorch's SVGP example: the inducing points are the first training inputs."""
    return torch.randn(n, D_IN, generator=torch.Generator().manual_seed(99))


def make_svgp():
    torch.manual_seed(0)
    return SVGPRegressor(inducing_init())


class ExactGP(nn.Module):
    """Exact GP regression on a mini-batch (the batch is the training set of the step): RBF
    kernel with softplus lengthscale and noise, negative log marginal likelihood. BUG: the
    log-determinant is ``torch.logdet(K)`` of a kernel matrix whose noise drifted to ~0: two
    identical inputs make K singular up to the noise, and float32 rounding makes it not
    positive-definite: ``cholesky_ex`` (no error check, no host sync) fails silently and its
    factor's diagonal holds the negative pivot, whose log is NaN."""

    def __init__(self, logdet: bool = False):
        super().__init__()
        self.logdet = logdet
        self.raw_lengthscale = nn.Parameter(torch.tensor(0.5))
        self.raw_noise = nn.Parameter(torch.tensor(-20.0))  # softplus(-20) ~ 2e-9

    def forward(self, x, y):
        ls, noise = F.softplus(self.raw_lengthscale), F.softplus(self.raw_noise)
        d2 = torch.cdist(x / ls, x / ls).pow(2)
        k = torch.exp(-0.5 * d2) + noise * torch.eye(len(x))
        if self.logdet:  # the textbook formula: BUG, logdet of a matrix float32 made indefinite
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


class Procrustes(nn.Module):
    """Orthogonal Procrustes alignment of two embedding spaces (MUSE-style, differentiated
    end to end): the rotation is U V^T of the SVD of the batch's cross-covariance. BUG: a
    batch with fewer samples than dimensions makes that matrix rank-deficient, several singular
    values are 0 and equal, and the SVD's backward divides by their differences."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.src = nn.Linear(d, d)
        self.tgt = nn.Linear(d, d)

    def forward(self, x, y):
        a, b = self.src(x), self.tgt(y)
        u, _, vh = torch.linalg.svd(a.T @ b)
        return a @ (u @ vh), b


def make_procrustes():
    torch.manual_seed(0)
    return Procrustes()


def align_loss(out, _unused=None):
    aligned, b = out
    return (aligned - b).pow(2).sum(1).mean()


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
