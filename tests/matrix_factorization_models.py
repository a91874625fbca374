"""Matrix factorisation trained in torch as practitioners write it, for
``test_matrix_factorization``.

- ``PoissonMF``: non-negative factorisation of counts (users x items) by gradient: softplus
  factors, the generalised KL / Poisson loss ``v log(v / wh) - v + wh`` over the observed
  (user, item, count) triples a DataLoader gives.
- ``LeeSeungNMF``: the whole matrix factorised by Lee & Seung's multiplicative updates for the
  Frobenius loss, written in place in ``torch.no_grad()`` by the loop, no optimizer.
- ``NMFCoder``: online NMF / dictionary learning over documents (rows of a term matrix):
  ``forward`` infers each row's weights by Lee-Seung multiplicative updates in
  ``torch.no_grad()`` (``w *= (v H^T) / (w H H^T)``), the dictionary ``H`` is learned by
  projected gradient (Adam, then clamped to >= 0).
- ``ALSRecommender``: item factors learned by gradient, each user's factor solved in
  ``forward`` from the normal equations of the items that user rated, with ALS-WR's weighted
  regularisation ``lambda * n_u * I`` (Zhou et al. 2008), by ``torch.linalg.solve``.
- ``ProjectedNMF``: full-batch KL-NMF of weekly counts by projected gradient (Adam, then the
  factors clamped to >= 0, as Lin 2007's projected gradient does), the loss with xlogy.
- ``HeteroscedasticPMF``: probabilistic MF with Gaussian priors on the factors (a weight decay
  in MAP form) and a per-rating noise variance ``softplus`` of the item's side features, in a
  Gaussian negative log-likelihood ``0.5 log var + (r - mu)^2 / (2 var)``.
- ``SeenMaskedMF``: MF scoring every item for next-item prediction, the items each user has
  already interacted with masked out by ``masked_fill(seen, -inf)`` before the softmax
  cross-entropy (as implicit-feedback recommenders rank only unseen items).
- ``MaskedLowRank``: weighted low-rank approximation of a ratings matrix with missing
  entries, the squared error multiplied by the observation mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

USERS, ITEMS, TERMS, RANK = 24, 20, 30, 4

# ---------------------------------------------------------------------------------------------
# Poisson / KL-divergence NMF by gradient


class PoissonMF(nn.Module):
    def __init__(self, users: int = USERS, items: int = ITEMS, rank: int = RANK):
        super().__init__()
        self.user = nn.Embedding(users, rank)
        self.item = nn.Embedding(items, rank)
        nn.init.normal_(self.user.weight, 0.0, 0.3)
        nn.init.normal_(self.item.weight, 0.0, 0.3)

    def forward(self, u, i):
        w, h = F.softplus(self.user(u)), F.softplus(self.item(i))
        return (w * h).sum(-1)  # the Poisson rate WH of each (user, item)


def kl_loss(wh, v):
    """The generalised KL divergence (beta = 1), as in Lee & Seung."""
    return (v * torch.log(v / wh) - v + wh).mean()  # the bug: 0 * log(0) where v = 0


def kl_loss_xlogy(wh, v):
    """The same divergence with the convention 0 log 0 = 0 (scipy's and torch's xlogy)."""
    return (torch.xlogy(v, v) - torch.xlogy(v, wh) - v + wh).mean()


def make_poisson() -> PoissonMF:
    torch.manual_seed(0)
    return PoissonMF()


def count_triples(g: torch.Generator, n: int = 96, zero_at: int | None = None):
    """Observed (user, item, count) triples, counts >= 1 (a click log); ``zero_at``: that
    triple's count is 0 (an impression without a click joined in from another table)."""
    u = torch.randint(0, USERS, (n,), generator=g)
    i = torch.randint(0, ITEMS, (n,), generator=g)
    v = 1.0 + torch.poisson(torch.full((n,), 2.0), generator=g)
    if zero_at is not None:
        v[zero_at] = 0.0
    return u, i, v


# ---------------------------------------------------------------------------------------------
# projected-gradient KL-NMF of the whole matrix


class ProjectedNMF(nn.Module):
    def __init__(self, users: int = USERS, items: int = ITEMS, rank: int = RANK):
        super().__init__()
        self.W = nn.Parameter(torch.rand(users, rank) * 0.1)
        self.H = nn.Parameter(torch.rand(rank, items) + 0.5)

    def forward(self, users):
        return self.W[users] @ self.H

    @torch.no_grad()
    def project(self, floor: float = 0.0):
        """Back onto the feasible set after each step (the bug: a floor of 0, not eps)."""
        self.W.clamp_(min=floor)
        self.H.clamp_(min=floor)


def make_projected() -> ProjectedNMF:
    torch.manual_seed(0)
    return ProjectedNMF()


def weekly_counts(g: torch.Generator, silent: int | None = None):
    """One week's (users x items) counts; ``silent``: a user with no activity (a row of 0)."""
    v = torch.poisson(torch.full((USERS, ITEMS), 1.5), generator=g)
    if silent is not None:
        v[silent] = 0.0
    return v


# ---------------------------------------------------------------------------------------------
# Lee & Seung's multiplicative updates of the whole matrix, no optimizer


class LeeSeungNMF(nn.Module):
    def __init__(self, users: int = USERS, items: int = ITEMS, rank: int = RANK):
        super().__init__()
        self.W = nn.Parameter(torch.rand(users, rank) + 0.1, requires_grad=False)
        self.H = nn.Parameter(torch.rand(rank, items) + 0.1, requires_grad=False)

    def forward(self):
        return self.W @ self.H

    @torch.no_grad()
    def update(self, v, wh, eps: float = 0.0):
        """One multiplicative update of H then W (the bug: eps = 0)."""
        self.H.mul_((self.W.T @ v) / (self.W.T @ wh + eps))
        self.W.mul_((v @ self.H.T) / (self.W @ self.H @ self.H.T + eps))


def make_lee_seung() -> LeeSeungNMF:
    torch.manual_seed(0)
    return LeeSeungNMF()


def frobenius(wh, v):
    return 0.5 * (v - wh).pow(2).sum()


# ---------------------------------------------------------------------------------------------
# online NMF: multiplicative updates for the weights, projected gradient for the dictionary


class NMFCoder(nn.Module):
    def __init__(self, terms: int = TERMS, rank: int = RANK, iters: int = 10,
                 eps: float = 0.0):
        super().__init__()
        self.H = nn.Parameter(torch.rand(rank, terms) + 0.1)
        self.iters, self.eps = iters, eps

    def encode(self, v):
        """Lee-Seung's updates for ``w`` with ``H`` fixed (sklearn's _multiplicative_update_w)."""
        h = self.H.detach()
        w = torch.full((v.shape[0], h.shape[0]), 0.5)
        hht = h @ h.T
        for _ in range(self.iters):
            w = w * (v @ h.T) / (w @ hht + self.eps)  # the bug: eps = 0, 0/0 for an empty row
        return w

    def forward(self, v):
        with torch.no_grad():
            w = self.encode(v)
        return w @ self.H


def make_coder() -> NMFCoder:
    torch.manual_seed(0)
    return NMFCoder()


def make_coder_eps() -> NMFCoder:
    torch.manual_seed(0)
    return NMFCoder(eps=1e-10)


def documents(g: torch.Generator, n: int = 16, empty: int | None = None):
    """Term frequencies of ``n`` documents; ``empty``: a document left with no term after
    stop-word removal (a row of zeros)."""
    v = torch.poisson(torch.rand(n, TERMS, generator=g) * 2, generator=g)
    v = v / v.sum(1, keepdim=True).clamp_min(1.0)
    if empty is not None:
        v[empty] = 0.0
    return v


# ---------------------------------------------------------------------------------------------
# ALS-WR: user factors solved in forward from their normal equations


class ALSRecommender(nn.Module):
    def __init__(self, items: int = ITEMS, rank: int = RANK, lam: float = 0.1,
                 weighted: bool = True):
        super().__init__()
        self.item = nn.Parameter(torch.randn(items, rank) * 0.3)
        self.bias = nn.Parameter(torch.zeros(items))
        self.lam, self.weighted = lam, weighted

    def forward(self, ratings, mask):
        """``ratings``, ``mask``: (users, items); each user's factor is the ridge solution
        over the items they rated, then every item's rating is predicted."""
        y = self.item
        a = torch.einsum("ui,ik,il->ukl", mask, y, y)  # Y^T diag(m_u) Y per user
        n_u = mask.sum(1)
        reg = self.lam * (n_u if self.weighted else torch.ones_like(n_u))  # ALS-WR's lambda n_u
        a = a + reg[:, None, None] * torch.eye(y.shape[1])
        b = (mask * (ratings - self.bias)) @ y
        x = torch.linalg.solve(a, b)  # singular for a user with no ratings: n_u = 0
        return x @ y.T + self.bias


def make_als() -> ALSRecommender:
    torch.manual_seed(0)
    return ALSRecommender()


def make_als_ridge() -> ALSRecommender:
    torch.manual_seed(0)
    return ALSRecommender(weighted=False)


def als_loss(pred, ratings, mask):
    return ((pred - ratings) ** 2 * mask).sum() / mask.sum()


def rating_matrix(g: torch.Generator, n: int = 12, cold: int | None = None, missing=0.0):
    """A block of users' ratings (1-5) with about half observed; ``cold``: a user who has
    rated nothing yet (signed up, no history). ``missing``: the value unobserved entries hold
    (NaN when the matrix comes from a pandas pivot table)."""
    true = torch.randn(n, RANK, generator=g) @ torch.randn(RANK, ITEMS, generator=g)
    ratings = (3 + true).round().clamp(1, 5)
    mask = (torch.rand(n, ITEMS, generator=g) < 0.5).float()
    if cold is not None:
        mask[cold] = 0.0
    return torch.where(mask.bool(), ratings, torch.full_like(ratings, missing)), mask


# ---------------------------------------------------------------------------------------------
# probabilistic MF with a learned noise variance


class HeteroscedasticPMF(nn.Module):
    def __init__(self, users: int = USERS, items: int = ITEMS, rank: int = RANK,
                 features: int = 3, min_var: float = 0.0):
        super().__init__()
        self.user = nn.Embedding(users, rank)
        self.item = nn.Embedding(items, rank)
        nn.init.normal_(self.user.weight, 0.0, 0.1)
        nn.init.normal_(self.item.weight, 0.0, 0.1)
        self.mu = nn.Parameter(torch.tensor(3.0))
        self.noise = nn.Linear(features, 1)
        self.min_var = min_var

    def forward(self, u, i, side):
        mean = (self.user(u) * self.item(i)).sum(-1) + self.mu
        var = F.softplus(self.noise(side).squeeze(-1))  # the bug: no floor
        if self.min_var:  # (the fix: a floor on the variance)
            var = var + self.min_var
        return mean, var


def gaussian_nll(mean, var, r):
    return (0.5 * torch.log(var) + (r - mean) ** 2 / (2 * var)).mean()


def normal_nll(mean, var, r):
    """The same likelihood through torch.distributions (validate_args on, its default)."""
    return -torch.distributions.Normal(mean, var.sqrt()).log_prob(r).mean()


def make_pmf() -> HeteroscedasticPMF:
    torch.manual_seed(0)
    return HeteroscedasticPMF()


def make_pmf_floored() -> HeteroscedasticPMF:
    torch.manual_seed(0)
    return HeteroscedasticPMF(min_var=1e-4)


def rated_triples(g: torch.Generator, n: int = 64, raw_count_at: int | None = None):
    """(user, item, item side features, rating); the side features are standardised (log
    popularity, genre share, year); ``raw_count_at``: that record's popularity column holds the
    raw view count (2e5), a join against an unprocessed table."""
    u = torch.randint(0, USERS, (n,), generator=g)
    i = torch.randint(0, ITEMS, (n,), generator=g)
    side = torch.randn(n, 3, generator=g)
    if raw_count_at is not None:
        side[raw_count_at, 0] = 2e5
    r = torch.randint(1, 6, (n,), generator=g).float()
    return u, i, side, r


# ---------------------------------------------------------------------------------------------
# full softmax over the items, the seen ones masked out


class SeenMaskedMF(nn.Module):
    def __init__(self, users: int = USERS, items: int = ITEMS, rank: int = RANK):
        super().__init__()
        self.user = nn.Embedding(users, rank)
        self.item = nn.Embedding(items, rank)

    def forward(self, u, seen):
        scores = self.user(u) @ self.item.weight.T
        return scores.masked_fill(seen, float("-inf"))  # rank only the items not yet seen


def make_seen_masked() -> SeenMaskedMF:
    torch.manual_seed(0)
    return SeenMaskedMF()


def next_items(g: torch.Generator, n: int = 16, leaked: int | None = None):
    """Users, their history (a bool mask over the items) and the next item they interacted
    with, never in their history; ``leaked``: that user's history was built from the whole
    log, the next item included (a split by row instead of by time)."""
    u = torch.randint(0, USERS, (n,), generator=g)
    seen = torch.rand(n, ITEMS, generator=g) < 0.3
    target = torch.randint(0, ITEMS, (n,), generator=g)
    seen[torch.arange(n), target] = False
    if leaked is not None:
        seen[leaked, target[leaked]] = True
    return u, seen, target


# ---------------------------------------------------------------------------------------------
# weighted low-rank approximation with an observation mask


class MaskedLowRank(nn.Module):
    def __init__(self, users: int = USERS, items: int = ITEMS, rank: int = RANK):
        super().__init__()
        self.U = nn.Parameter(torch.randn(users, rank) * 0.5)
        self.V = nn.Parameter(torch.randn(items, rank) * 0.5)
        self.user_bias = nn.Parameter(torch.zeros(users))
        self.mu = nn.Parameter(torch.tensor(3.0))

    def forward(self, users):
        return self.U[users] @ self.V.T + self.user_bias[users, None] + self.mu


def make_low_rank() -> MaskedLowRank:
    torch.manual_seed(0)
    return MaskedLowRank()


def masked_mse(pred, ratings, mask):
    return ((pred - ratings) ** 2 * mask).sum() / mask.sum()  # NaN * 0 is NaN


def masked_mse_where(pred, ratings, mask):
    err = torch.where(mask.bool(), pred - ratings, torch.zeros_like(pred))
    return (err ** 2).sum() / mask.sum()
