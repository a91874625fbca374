"""Sparse activations and differentiable trees of ``tests/test_sparse_activations.py``, written
as their public repositories write them:

- ``sparsemax``: the sort / cumsum / support-size threshold of dreamquark-ai/tabnet
  (``pytorch_tabnet/sparsemax.py``) and deep-spin/entmax (``entmax/activations.py``):
  ``tau = (cumsum[k-1] - 1) / k`` with ``k`` the support size, 0 for a row of ``-inf``.
- ``TabNetStep``: TabNet's attentive transformer (``tab_network.AttentiveTransformer``):
  ``mask = sparsemax(bn(fc(a)) * prior)``, prior scales ``gamma - mask``, and the sparsity
  regulariser ``mean(sum(-M * log(M + eps)))`` (``tab_network.TabNetEncoder``; eps 1e-15 there).
- ``SoftTree``: a soft decision tree (Frosst & Hinton; kimhc6028/soft-decision-tree): the
  probability of a leaf is the product of sigmoid routings along its path, then ``log``.
- ``NodeLite``: NODE's feature choice (Qwicen/node ``lib/odst.py``) through entmax-1.5 as
  deep-spin/entmax's ``Entmax15Function``, over the record's available features.
- ``GumbelHead``: straight-through gumbel-softmax as ``torch.nn.functional.gumbel_softmax``
  writes it (``(logits + g) / tau``) with the temperature annealed by the training loop.

Tabular batches come from a DataLoader: numeric columns plus categorical codes through one
``nn.Embedding`` each. Factories live at module level so ``nanreplay`` rebuilds them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_NUM, CARDS, D_EMB, N_CLASSES = 4, (5, 3), 2, 3
N_FEAT = N_NUM + D_EMB * len(CARDS)


def loader(n: int = 64, batch: int = 16, seed: int = 0, mask_rows=(),
           partial: bool = False) -> DataLoader:
    """Numeric columns, categorical codes, a feature-availability mask (0: column missing for
    that record) and class labels. ``mask_rows`` lists records with every feature missing;
    ``partial`` leaves the numeric columns out of every third record (other features kept)."""
    g = torch.Generator().manual_seed(seed)
    num = torch.randn(n, N_NUM, generator=g)
    cat = torch.stack([torch.randint(0, c, (n,), generator=g) for c in CARDS], 1)
    avail = torch.ones(n, N_FEAT)
    if partial:
        avail[::3, :N_NUM] = 0
    for r in mask_rows:
        avail[r] = 0
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    return DataLoader(TensorDataset(num, cat, avail, y), batch_size=batch, shuffle=False)


class Embedder(nn.Module):
    """TabNet's ``EmbeddingGenerator``: numeric columns as they are, categoricals embedded."""

    def __init__(self):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, D_EMB) for c in CARDS)

    def forward(self, num, cat):
        return torch.cat([num, *[e(cat[:, i]) for i, e in enumerate(self.embs)]], 1)


def sparsemax(z: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sparsemax (Martins & Astudillo 2016) as entmax's ``_sparsemax_threshold_and_support``."""
    z_sorted, _ = torch.sort(z, dim=dim, descending=True)
    cumsum = z_sorted.cumsum(dim) - 1
    rho = torch.arange(1, z.size(dim) + 1, dtype=z.dtype, device=z.device)
    support = rho * z_sorted > cumsum
    k = support.sum(dim=dim, keepdim=True)
    tau = cumsum.gather(dim, (k - 1).clamp_min(0)) / k.to(z.dtype)
    return torch.clamp(z - tau, min=0)


class Entmax15Function(torch.autograd.Function):
    """entmax-1.5 as deep-spin/entmax's ``Entmax15Function`` (exact sort-based threshold)."""

    @staticmethod
    def forward(ctx, X, dim=-1):
        ctx.dim = dim
        max_val, _ = X.max(dim=dim, keepdim=True)
        X = X - max_val  # same numerical stability trick as for softmax
        X = X / 2  # divide by 2 to solve actual Entmax
        Xsrt, _ = torch.sort(X, dim=dim, descending=True)
        rho = torch.arange(1, X.size(dim) + 1, dtype=X.dtype, device=X.device)
        mean = Xsrt.cumsum(dim) / rho
        mean_sq = (Xsrt ** 2).cumsum(dim) / rho
        ss = rho * (mean_sq - mean ** 2)
        delta = (1 - ss) / rho
        tau = mean - torch.sqrt(torch.clamp(delta, 0))
        support_size = (tau <= Xsrt).sum(dim).unsqueeze(dim)
        tau_star = tau.gather(dim, support_size - 1)
        Y = torch.clamp(X - tau_star, min=0) ** 2
        ctx.save_for_backward(Y)
        return Y

    @staticmethod
    def backward(ctx, dY):
        Y, = ctx.saved_tensors
        gppr = Y.sqrt()  # = 1 / g'' (Y)
        dX = dY * gppr
        q = dX.sum(ctx.dim) / gppr.sum(ctx.dim)
        dX -= q.unsqueeze(ctx.dim) * gppr
        return dX, None


class FeatureChoice(nn.Module):
    """NODE's choice function over the available features (entmax15 of learned logits plus
    the record's availability mask), feeding one oblivious split per tree."""

    def __init__(self, trees: int = 4):
        super().__init__()
        self.logits = nn.Parameter(torch.rand(N_FEAT, trees))
        self.thresholds = nn.Parameter(torch.zeros(trees))
        self.log_temperatures = nn.Parameter(torch.zeros(trees))
        self.response = nn.Linear(trees, N_CLASSES)

    def forward(self, x, avail):
        bias = torch.zeros_like(avail).masked_fill(avail == 0, float("-inf"))
        z = self.logits.t()[None] + bias[:, None, :]  # (batch, trees, features)
        w = Entmax15Function.apply(z, -1)
        values = (w * x[:, None, :]).sum(-1)
        split = torch.sigmoid((values - self.thresholds) * torch.exp(-self.log_temperatures))
        return self.response(split)


class NodeLite(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedder = Embedder()
        self.choice = FeatureChoice()

    def forward(self, num, cat, avail):
        return self.choice(self.embedder(num, cat), avail)


def make_node() -> nn.Module:
    torch.manual_seed(0)
    return NodeLite()


class AttentiveTransformer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, N_FEAT, bias=False)
        self.bn = nn.BatchNorm1d(N_FEAT)

    def forward(self, priors, a, avail):
        z = self.bn(self.fc(a)) * priors
        # features missing for a record are masked out before the sparsemax, as in
        # TabNet forks that take a feature-availability mask
        z = z.masked_fill(avail == 0, float("-inf"))
        return sparsemax(z)


class TabNetStep(nn.Module):
    """Two decision steps of TabNet's encoder: attentive mask, prior update, sparsity loss."""

    def __init__(self, gamma: float = 1.3, eps: float = 1e-15, steps: int = 2, d: int = 8):
        super().__init__()
        self.gamma, self.eps, self.steps = gamma, eps, steps
        self.embedder = Embedder()
        self.initial = nn.Linear(N_FEAT, d)
        self.att = nn.ModuleList(AttentiveTransformer(d) for _ in range(steps))
        self.feat = nn.ModuleList(nn.Linear(N_FEAT, d) for _ in range(steps))
        self.head = nn.Linear(d, N_CLASSES)

    def forward(self, num, cat, avail):
        x = self.embedder(num, cat)
        prior = torch.ones_like(x)
        a = torch.relu(self.initial(x))
        out, m_loss = 0, 0
        for att, feat in zip(self.att, self.feat):
            M = att(prior, a, avail)
            m_loss = m_loss + torch.mean(torch.sum(torch.mul(M, torch.log(M + self.eps)), dim=1))
            prior = torch.mul(self.gamma - M, prior)
            a = torch.relu(feat(M * x))
            out = out + a
        return self.head(out), -m_loss / self.steps


def make_tabnet() -> nn.Module:
    torch.manual_seed(0)
    return TabNetStep()


def make_tabnet_eps0() -> nn.Module:
    torch.manual_seed(0)
    return TabNetStep(eps=0.0)


def tabnet_loss(out, y, lambda_sparse: float = 1e-3):
    logits, m_loss = out
    return nn.functional.cross_entropy(logits, y) + lambda_sparse * m_loss


class SoftTree(nn.Module):
    """A depth-``depth`` soft decision tree: each inner node routes right with
    ``sigmoid(beta * (w.x + b))``; a leaf's path probability is the product along its path,
    and the log-likelihood mixes ``log`` of each path probability with the leaves' own
    log-distributions. The loop anneals the inverse temperature ``beta`` up to sharpen the
    routing towards a hard tree."""

    def __init__(self, depth: int = 10, beta: float = 1.0):
        super().__init__()
        self.depth, self.beta = depth, beta
        self.embedder = Embedder()
        self.inner = nn.Linear(N_FEAT, 2 ** depth - 1)
        self.leaves = nn.Parameter(torch.randn(2 ** depth, N_CLASSES) * 0.1)

    def forward(self, num, cat):
        x = self.embedder(num, cat)
        p_right = torch.sigmoid(self.beta * self.inner(x))
        mu = x.new_ones(x.size(0), 1)
        begin = 0
        for level in range(self.depth):
            n = 2 ** level
            p = p_right[:, begin:begin + n]
            mu = torch.stack([mu * (1 - p), mu * p], 2).flatten(1)
            begin += n
        log_q = torch.log_softmax(self.leaves, 1)
        return torch.logsumexp(torch.log(mu)[:, :, None] + log_q, 1)


def make_soft_tree() -> nn.Module:
    torch.manual_seed(0)
    return SoftTree()


class GumbelHead(nn.Module):
    """Categorical latent with straight-through gumbel-softmax; ``tau`` is set by the loop."""

    def __init__(self, k: int = 6):
        super().__init__()
        self.embedder = Embedder()
        self.enc = nn.Linear(N_FEAT, k)
        self.dec = nn.Linear(k, N_CLASSES)
        self.tau = 1.0

    def forward(self, num, cat, gumbels):
        logits = self.enc(self.embedder(num, cat))
        y_soft = ((logits + gumbels) / self.tau).softmax(-1)
        index = y_soft.max(-1, keepdim=True)[1]
        y_hard = torch.zeros_like(logits).scatter_(-1, index, 1.0)
        return self.dec(y_hard - y_soft.detach() + y_soft)


def make_gumbel() -> nn.Module:
    torch.manual_seed(0)
    return GumbelHead()


def gumbel_noise(g: torch.Generator, n: int, k: int = 6) -> torch.Tensor:
    return -torch.empty(n, k).exponential_(generator=g).log()
