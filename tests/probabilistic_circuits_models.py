"""Tractable probabilistic models trained by gradient descent, as their practitioners write
them: an EinsumNetworks-style probabilistic circuit (Gaussian leaves with a learnable
log-variance, product layers, sum layers computing log-einsum-exp with a max-shift, mixture
weights through ``log_softmax``; missing features marginalised by a leaf log-likelihood of
0), an HMM trained by the forward algorithm in log space over masked variable-length
sequences, and a GMM with Cholesky-parametrised covariances fit by minibatch NLL. Each has the
switches that plant the domain's bugs."""

from __future__ import annotations

import math

import torch
from torch import nn


class GaussianLeaves(nn.Module):
    """``K`` univariate Gaussians per feature: ``(B, D)`` -> log-densities ``(B, D, K)``;
    a feature marked missing gets a log-likelihood of 0 (marginalised out)."""

    def __init__(self, d: int, k: int, min_log_var: float | None = -6.0):
        super().__init__()
        self.mu = nn.Parameter(torch.randn(d, k))
        self.log_var = nn.Parameter(torch.zeros(d, k))
        self.min_log_var = min_log_var

    def forward(self, x, missing):
        log_var = self.log_var
        if self.min_log_var is not None:
            log_var = log_var.clamp_min(self.min_log_var)
        var = torch.exp(log_var)
        diff = x.unsqueeze(-1) - self.mu
        ll = -0.5 * (math.log(2 * math.pi) + log_var + diff * diff / var)
        return ll.masked_fill(missing.unsqueeze(-1), 0.0)


def log_einsum_exp(ll_a, ll_b, log_w):
    """``log sum_ij w_kij exp(a_i + b_j)`` with the max-shift of EinsumNetworks."""
    ma = ll_a.max(-1, keepdim=True).values
    mb = ll_b.max(-1, keepdim=True).values
    pa, pb = torch.exp(ll_a - ma), torch.exp(ll_b - mb)
    prob = torch.einsum("npi,npj,pkij->npk", pa, pb, log_w.exp())
    return torch.log(prob) + ma + mb


class EinsumLayer(nn.Module):
    """Pairs the regions ``2p, 2p+1``: products of their ``K x K`` densities mixed into ``K``
    sums per pair. ``stable=False`` is the textbook sum-then-log (no max-shift);
    ``log_of_softmax`` takes the log of softmax weights instead of ``log_softmax``."""

    def __init__(self, regions: int, k: int, stable: bool = True, log_of_softmax=False):
        super().__init__()
        self.logits = nn.Parameter(torch.randn(regions // 2, k, k, k) * 0.1)
        self.stable, self.log_of_softmax = stable, log_of_softmax
        self.temperature = 1.0  # annealed by the loop towards hard (max-product) weights

    def log_weights(self):
        flat = self.logits.flatten(-2) / self.temperature
        if self.log_of_softmax:
            return torch.log(torch.softmax(flat, -1)).view_as(self.logits)
        return torch.log_softmax(flat, -1).view_as(self.logits)

    def forward(self, ll):
        a, b = ll[:, 0::2], ll[:, 1::2]
        log_w = self.log_weights()
        if self.stable:
            return log_einsum_exp(a, b, log_w)
        prob = torch.einsum("npi,npj,pkij->npk", a.exp(), b.exp(), log_w.exp())
        return torch.log(prob)  # sum, then log


class RootSum(nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(k))

    def forward(self, ll):
        return torch.logsumexp(ll[:, 0] + torch.log_softmax(self.logits, -1), -1)


class EinsumNet(nn.Module):
    """A balanced binary region graph over ``d`` (a power of 2) features."""

    def __init__(self, d: int = 8, k: int = 4, stable: bool = True, log_of_softmax=False,
                 min_log_var: float | None = -6.0):
        super().__init__()
        self.leaves = GaussianLeaves(d, k, min_log_var)
        layers, regions = [], d
        while regions > 1:
            layers.append(EinsumLayer(regions, k, stable, log_of_softmax))
            regions //= 2
        self.layers = nn.ModuleList(layers)
        self.root = RootSum(k)

    def forward(self, x, missing):
        ll = self.leaves(x, missing)
        for layer in self.layers:
            ll = layer(ll)
        return self.root(ll)


class NegLogLik(nn.Module):
    """The circuit's minibatch NLL (``loss_fn``): the mean of ``-log p(x)``."""

    def forward(self, log_px):
        return -log_px.mean()


def make_circuit():
    torch.manual_seed(0)
    return EinsumNet()


def make_textbook_circuit():
    torch.manual_seed(0)
    return EinsumNet(d=16, stable=False)


def make_softmax_circuit():
    torch.manual_seed(0)
    return EinsumNet(log_of_softmax=True)


def make_free_variance_circuit():
    torch.manual_seed(0)
    return EinsumNet(min_log_var=None)


def tabular(n: int = 256, d: int = 8, seed: int = 0):
    """Correlated tabular data in two clusters and its missingness mask (all observed)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(0, 2, (n, 1), generator=g).float() * 2 - 1
    x = z + 0.5 * torch.randn(n, d, generator=g)
    return x, torch.zeros(n, d, dtype=torch.bool)


# HMM: the forward algorithm in log space

class HMM(nn.Module):
    """A categorical-emission HMM, ``log p(x_1..T)`` by the forward recursion in log space.
    Padded steps keep alpha (``torch.where`` on the length mask). ``pad_emission``: the
    emission log-probability of a padded step (0: marginalised; -inf: the planted bug).
    ``own_lse``: a hand-written logsumexp with a max-shift; ``keep=False`` runs the recursion
    over the padding too (the final alpha is then the padded step's)."""

    def __init__(self, states: int = 4, symbols: int = 6, pad_emission: float = 0.0,
                 own_lse: bool = False, keep: bool = True):
        super().__init__()
        self.keep = keep
        self.start = nn.Parameter(torch.randn(states) * 0.1)
        self.trans = nn.Parameter(torch.randn(states, states) * 0.1)
        self.emit = nn.Parameter(torch.randn(states, symbols) * 0.1)
        self.pad_emission, self.own_lse = pad_emission, own_lse

    def lse(self, a, dim):
        if not self.own_lse:
            return torch.logsumexp(a, dim)
        m = a.max(dim, keepdim=True).values
        return (a - m).exp().sum(dim).log() + m.squeeze(dim)

    def forward(self, tokens, mask):
        log_a = torch.log_softmax(self.trans, -1)
        log_b = torch.log_softmax(self.emit, -1)
        e = log_b[:, tokens].permute(1, 2, 0)  # (B, T, S)
        e = e.masked_fill(~mask.unsqueeze(-1), self.pad_emission)
        alpha = torch.log_softmax(self.start, -1) + e[:, 0]
        for t in range(1, tokens.shape[1]):
            step = self.lse(alpha.unsqueeze(-1) + log_a + e[:, t].unsqueeze(1), 1)
            alpha = torch.where(mask[:, t, None], step, alpha) if self.keep else step
        return self.lse(alpha, -1)


def make_hmm():
    torch.manual_seed(0)
    return HMM()


def make_hmm_pad_neg_inf():
    torch.manual_seed(0)
    return HMM(pad_emission=float("-inf"))


def make_hmm_own_lse_pad_neg_inf():
    torch.manual_seed(0)
    return HMM(pad_emission=float("-inf"), own_lse=True, keep=False)


def sequences(n: int = 128, t: int = 12, symbols: int = 6, seed: int = 0, short=()):
    """Token sequences of lengths 6..t (padded with 0) and their masks; rows in ``short``
    have length 4."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, symbols, (n, t), generator=g)
    lengths = torch.randint(t // 2, t + 1, (n,), generator=g)
    lengths[list(short)] = 4
    mask = torch.arange(t) < lengths[:, None]
    return tokens.masked_fill(~mask, 0), mask


# GMM: Cholesky-parametrised covariances

class CholeskyGMM(nn.Module):
    """A ``K``-component full-covariance GMM: ``L_k`` lower-triangular with a diagonal
    ``exp(log_diag)``; ``log p(x)`` by the Mahalanobis form through a triangular solve.
    ``raw_diag``: the diagonal taken as is (started at 1), no positivity constraint."""

    def __init__(self, d: int = 2, k: int = 3, raw_diag: bool = False):
        super().__init__()
        self.raw_diag = raw_diag
        self.logits = nn.Parameter(torch.zeros(k))
        self.mu = nn.Parameter(torch.randn(k, d))
        self.log_diag = nn.Parameter(torch.zeros(k, d))
        self.off = nn.Parameter(torch.zeros(k, d, d))

    def forward(self, x):
        d = x.shape[-1]
        diag = self.log_diag + 1.0 if self.raw_diag else self.log_diag.exp()
        L = torch.tril(self.off, -1) + torch.diag_embed(diag)
        diff = (x[:, None, :] - self.mu).unsqueeze(-1)  # (B, K, D, 1)
        z = torch.linalg.solve_triangular(L, diff, upper=False).squeeze(-1)
        maha = (z * z).sum(-1)
        log_det = torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1)
        comp = -0.5 * (d * math.log(2 * math.pi) + maha) - log_det
        return torch.logsumexp(comp + torch.log_softmax(self.logits, -1), -1)


def make_gmm():
    torch.manual_seed(0)
    return CholeskyGMM()


def make_raw_cholesky_gmm():
    torch.manual_seed(0)
    return CholeskyGMM(raw_diag=True)


def blobs(n: int = 256, seed: int = 0, duplicated: int = 0):
    """Three 2-D clusters; ``duplicated`` copies of one point appended (a de-duplication step
    the pipeline skipped)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.tensor([[-2.0, 0.0], [2.0, 0.0], [0.0, 2.5]])
    x = centers[torch.randint(0, 3, (n,), generator=g)] + 0.4 * torch.randn(n, 2, generator=g)
    if duplicated:
        x = torch.cat([x, x[:1].repeat(duplicated, 1)])
    return x
