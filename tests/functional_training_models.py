"""Training written with ``torch.autograd.functional``, ``checkpoint_sequential`` and sparse
graph products, as users write it: a contractive autoencoder whose loss adds the Frobenius
norm of ``jacobian(encoder, x, create_graph=True)``; a classifier whose loss adds a Hutchinson
estimate of its Hessian's trace in the input by ``hvp``; a deep MLP run segment by segment by
``checkpoint_sequential``; a two-layer GCN over a sparse adjacency normalised on the fly by
``D^-1/2 A D^-1/2`` with ``torch.sparse.mm``. Each data source can plant one natural bug."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.functional import hvp, jacobian
from torch.utils.checkpoint import checkpoint_sequential


class SignedSqrt(nn.Module):
    """``sign(x) * sqrt(|x|)``, a heavy-tail feature transform: finite at 0, its slope is not."""

    def forward(self, x):
        return torch.sign(x) * torch.sqrt(x.abs())


class ContractiveAE(nn.Module):
    def __init__(self, d: int = 6, h: int = 3):
        super().__init__()
        self.encoder = nn.Sequential(SignedSqrt(), nn.Linear(d, h), nn.Tanh())
        self.decoder = nn.Linear(h, d)

    def forward(self, x):
        return self.decoder(self.encoder(x))


class ContractiveLoss(nn.Module):
    """Reconstruction plus ``lam * ||d encoder / d x||_F^2`` per record (the rows of the batch
    are independent, so the Jacobian of the summed code is each record's own)."""

    def __init__(self, encoder: nn.Module, lam: float = 0.1):
        super().__init__()
        self.encoder, self.lam = encoder, lam

    def forward(self, recon, x):
        jac = jacobian(lambda v: self.encoder(v).sum(0), x, create_graph=True)
        return F.mse_loss(recon, x) + self.lam * jac.pow(2).sum() / len(x)


def make_cae() -> ContractiveAE:
    torch.manual_seed(0)
    return ContractiveAE()


def cae_batches(zero_at: tuple[int, int] | None = None, steps: int = 4, n: int = 8):
    """Records away from 0; ``zero_at=(step, row)``: that record's feature 2 is an exact 0."""
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.rand(n, 6, generator=g) + 0.5
        if zero_at is not None and zero_at[0] == step:
            x[zero_at[1], 2] = 0.0
        yield x


class L2Norm(nn.Module):
    """Row-wise L2 normalisation with the eps outside the sqrt: 0 / (0 + eps) is finite, the
    sqrt's slope at 0 is not."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x / (torch.sqrt((x ** 2).sum(dim=1, keepdim=True)) + self.eps)


def make_deep_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16, bias=False), L2Norm(), nn.ReLU(),
        nn.Linear(16, 16), nn.ReLU(),
        nn.Linear(16, 16), nn.ReLU(),
        nn.Linear(16, 3),
    )


def mlp_batches(blank_at: tuple[int, int] | None = None, steps: int = 4, n: int = 8):
    """Classification records; ``blank_at=(step, row)``: that record is all zeros, so the
    bias-free first layer hands ``L2Norm`` a zero row."""
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        x, y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
        if blank_at is not None and blank_at[0] == step:
            x[blank_at[1]] = 0.0
        yield x, y


def checkpointed(model: nn.Sequential, x, segments: int = 3, use_reentrant: bool = False):
    return checkpoint_sequential(model, segments, x, use_reentrant=use_reentrant)


class GCNLayer(nn.Module):
    """``D^-1/2 A D^-1/2 H W`` with the degree of ``adj`` computed on the fly."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, h, adj):
        deg = torch.sparse.sum(adj, dim=1).to_dense()
        dinv = deg.pow(-0.5).unsqueeze(1)
        return dinv * torch.sparse.mm(adj, dinv * self.lin(h))


class GCN(nn.Module):
    def __init__(self, d: int = 5, h: int = 8, classes: int = 3):
        super().__init__()
        self.conv1, self.conv2 = GCNLayer(d, h), GCNLayer(h, classes)

    def forward(self, x, adj):
        return self.conv2(F.relu(self.conv1(x, adj)), adj)


def make_gcn() -> GCN:
    torch.manual_seed(0)
    return GCN()


def graph(isolated: int | None = None, n: int = 10):
    """A ring of ``n`` nodes (both directions) as a sparse COO adjacency; ``isolated``: that
    node's edges dropped, as a node that lost its links in a data split is."""
    src = torch.arange(n)
    dst = (src + 1) % n
    row, col = torch.cat([src, dst]), torch.cat([dst, src])
    if isolated is not None:
        keep = (row != isolated) & (col != isolated)
        row, col = row[keep], col[keep]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 5, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    adj = torch.sparse_coo_tensor(torch.stack([row, col]), torch.ones(len(row)), (n, n),
                                  check_invariants=True)
    return x, adj.coalesce(), y


class CheckpointedMLP(nn.Module):
    """The deep MLP with its body run by ``checkpoint_sequential`` inside ``forward``."""

    def __init__(self, segments: int = 3, use_reentrant: bool = False):
        super().__init__()
        self.body = make_deep_mlp()
        self.segments, self.use_reentrant = segments, use_reentrant

    def forward(self, x):
        if self.use_reentrant and not x.requires_grad:
            x = x.detach().requires_grad_()  # else the reentrant checkpoint's weights get no grad
        return checkpoint_sequential(self.body, self.segments, x,
                                     use_reentrant=self.use_reentrant)


def make_checkpointed(use_reentrant: bool = False) -> CheckpointedMLP:
    return CheckpointedMLP(use_reentrant=use_reentrant)


class PowerFeatures(nn.Module):
    """``|x| ** 1.5``: its slope at 0 is 0, its second derivative there is not finite."""

    def forward(self, x):
        return x.abs().pow(1.5)


def make_curved() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(PowerFeatures(), nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


class CurvatureReg(nn.Module):
    """Cross-entropy plus a Hutchinson estimate of its Hessian's trace in the input,
    ``v . (H v)`` for a Rademacher ``v``, by ``hvp`` (or ``vhp``) with ``create_graph``."""

    def __init__(self, model: nn.Module, lam: float = 0.01, by=hvp):
        super().__init__()
        self.model, self.lam, self.by = model, lam, by

    def forward(self, out, y, x):
        v = torch.randint(0, 2, x.shape).float() * 2 - 1
        _, hv = self.by(lambda inp: F.cross_entropy(self.model(inp), y, reduction="sum"),
                        x, v, create_graph=True)
        return F.cross_entropy(out, y) + self.lam * (v * hv).sum() / len(x)


def curved_batches(zero_at: tuple[int, int] | None = None, steps: int = 4, n: int = 8):
    """Records away from 0 with labels; ``zero_at=(step, row)``: that record's feature 1 is
    an exact 0."""
    g = torch.Generator().manual_seed(4)
    for step in range(steps):
        x, y = torch.rand(n, 6, generator=g) + 0.5, torch.randint(0, 3, (n,), generator=g)
        if zero_at is not None and zero_at[0] == step:
            x[zero_at[1], 1] = 0.0
        yield x, y
