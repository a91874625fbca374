"""Differentiable optimisation layers written as practitioners write them without qpth,
cvxpylayers or Theseus, for ``test_differentiable_optimization_layers``.

- ``BarrierQP``: an OptNet-style layer. A network predicts the linear cost ``p`` of a small QP
  ``min 1/2 z^T Q z + p^T z  s.t.  lo <= z <= hi,  sum z <= budget`` with a learned
  positive-definite ``Q = L L^T + eps I``; forward solves it by an unrolled log-barrier
  interior-point method (Newton steps on ``t f(z) - sum log s`` with slacks ``s = h - G z``,
  a fraction-to-the-boundary step, ``t`` raised geometrically), started at the box's centre,
  and returns the solution with the barrier objective at it (the layer's smoothed optimal
  value). Gradients flow by autograd through the unrolled iterations. The number of outer
  iterations follows from the duality gap wanted, ``m / t < gap``.
- ``KKTQP``: the same QP with equality constraints ``A z = b`` only, solved in closed form and
  differentiated implicitly: a custom ``autograd.Function`` whose backward solves the KKT
  system ``[[Q, A^T], [A, 0]]`` with ``torch.linalg.solve`` (OptNet's backward pass); forward
  takes the solution by the null-space method (``lstsq``), so it never inverts the KKT matrix.
- ``SparsemaxAttention``: a pointer/attention head over padded candidate sets whose weights are
  sparsemax (Martins & Astudillo 2016), the Euclidean projection onto the simplex by sorting;
  padding is ``-inf`` in the scores.
- ``PGDDecision``: decision-focused learning (predict-then-optimise): predicted item costs, a
  decision ``argmin c^T z + gamma/2 |z|^2`` over the simplex by unrolled projected gradient
  descent (the projection by sorting), trained on the regret of that decision under the true
  costs (``regret``, ``masked_regret`` pricing unavailable items out).
- ``LowRankQP``: an unconstrained QP with a learned factor-model ``Q = L L^T + eps I`` (``L``
  of low rank) solved by ``cholesky`` and ``cholesky_solve``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

N_VAR, N_FEAT, N_ITEMS = 4, 6, 10


def box_budget_constraints(n: int) -> torch.Tensor:
    """G of ``z <= hi``, ``-z <= -lo``, ``1^T z <= budget`` (rows of ``G z <= h``)."""
    eye = torch.eye(n)
    return torch.cat([eye, -eye, torch.ones(1, n)])


class BarrierQP(nn.Module):
    """Features -> predicted cost p -> the QP's solution z* by an unrolled barrier method."""

    def __init__(self, n: int = N_VAR, feats: int = N_FEAT, eps: float = 1e-3,
                 gap: float = 1e-6, mu: float = 10.0, newton: int = 4):
        super().__init__()
        self.cost = nn.Sequential(nn.Linear(feats, 32), nn.ReLU(), nn.Linear(32, n))
        self.L = nn.Parameter(torch.eye(n) + 0.1 * torch.randn(n, n))
        self.register_buffer("G", box_budget_constraints(n))
        self.eps, self.mu, self.newton = eps, mu, newton
        m = self.G.shape[0]
        # Boyd & Vandenberghe 11.3: m / t < gap after ceil(log(m / (t0 gap)) / log mu) rounds
        self.outer = math.ceil(math.log(m / gap) / math.log(mu))

    def forward(self, feats, lo, hi, budget):
        p = self.cost(feats)
        Q = self.L @ self.L.T + self.eps * torch.eye(self.L.shape[0])
        h = torch.cat([hi, -lo, budget[:, None]], 1)
        z = (lo + hi) / 2  # the box's centre: strictly inside the box
        t = 1.0
        for _ in range(self.outer):
            for _ in range(self.newton):
                s = h - z @ self.G.T
                grad = t * (z @ Q + p) + (1 / s) @ self.G
                H = t * Q + torch.einsum("mi,bm,mj->bij", self.G, 1 / s ** 2, self.G)
                dz = -torch.linalg.solve(H, grad)
                # fraction to the boundary: stay strictly feasible
                Gdz = dz @ self.G.T
                # (the divisor made safe where the step moves away, or 0 * the infinite
                # derivative of s / 0 at an exact Gdz == 0 is a NaN gradient)
                away = Gdz > 0
                ratio = torch.where(away, s / torch.where(away, Gdz, 1.0),
                                    torch.full_like(s, float("inf")))
                alpha = (0.99 * ratio.min(1, keepdim=True).values).clamp(max=1.0)
                z = z + alpha * dz
            t = t * self.mu
        s = h - z @ self.G.T
        value = 0.5 * ((z @ Q) * z).sum(1) + (p * z).sum(1) - torch.log(s).sum(1) / t
        return z, value


def make_qp() -> BarrierQP:
    torch.manual_seed(0)
    return BarrierQP()


def make_qp_tight_gap() -> BarrierQP:
    """A duality gap asked 'as small as possible': 1e-40 is 42 rounds of mu = 10."""
    torch.manual_seed(0)
    return BarrierQP(gap=1e-40)


def qp_loss(z, value, z_target):
    """Imitation of the expert's decisions (OptNet's Sudoku/denoising losses are MSE)."""
    return ((z - z_target) ** 2).sum(1).mean()


def qp_batch(g: torch.Generator, n: int = 8, tight: int | None = None):
    """Features, box bounds, budgets and the expert's decisions. ``tight``: a record whose
    budget is below the box's centre (a week whose spend was cut after the boxes were set):
    the problem is feasible (lo sums below it) but the solver's start is not."""
    feats = torch.randn(n, N_FEAT, generator=g)
    lo = torch.rand(n, N_VAR, generator=g) * 0.2
    hi = lo + 0.5 + torch.rand(n, N_VAR, generator=g)
    budget = (lo + hi).sum(1) / 2 + 0.5 + torch.rand(n, generator=g)
    if tight is not None:
        budget[tight] = lo[tight].sum() + 0.3
    target = lo + (hi - lo) * torch.rand(n, N_VAR, generator=g) * 0.5
    return feats, lo, hi, budget, target


# ---------------------------------------------------------------------------------------------
# equality-constrained QP with OptNet's implicit backward


class KKTSolve(torch.autograd.Function):
    """z* of ``min 1/2 z^T Q z + p^T z  s.t.  A z = b`` and its multipliers; backward by
    implicit differentiation of the KKT conditions (Amos & Kolter 2017, eq. 7)."""

    @staticmethod
    def forward(ctx, Q, p, A, b):
        # OSQP's quasi-definite system: a -delta corner keeps it solvable when a record's
        # constraint rows are dependent (z is then the solution on the rows that constrain)
        n = Q.shape[-1]
        z = torch.linalg.solve(kkt_matrix(Q, A, KKT_DELTA), torch.cat([-p, b], 1))[:, :n]
        ctx.save_for_backward(Q, A, z)
        return z

    @staticmethod
    def backward(ctx, dz):
        Q, A, z = ctx.saved_tensors
        n, k = Q.shape[-1], A.shape[-2]
        K = kkt_matrix(Q, A, 0.0)
        rhs = torch.cat([-dz, torch.zeros(dz.shape[0], k, dtype=dz.dtype)], 1)
        d = torch.linalg.solve(K, rhs)
        dzs, dnu = d[:, :n], d[:, n:]
        dQ = 0.5 * (dzs[:, :, None] * z[:, None, :] + z[:, :, None] * dzs[:, None, :])
        return dQ, dzs, None, -dnu


KKT_DELTA = 1e-6


def kkt_matrix(Q: torch.Tensor, A: torch.Tensor, delta: float) -> torch.Tensor:
    """``[[Q, A^T], [A, -delta I]]`` per record."""
    B, n, k = Q.shape[0], Q.shape[-1], A.shape[-2]
    K = torch.zeros(B, n + k, n + k, dtype=Q.dtype)
    K[:, :n, :n] = Q
    K[:, :n, n:] = A.transpose(-1, -2)
    K[:, n:, :n] = A
    K[:, n:, n:] = -delta * torch.eye(k, dtype=Q.dtype)
    return K


class KKTQP(nn.Module):
    """Features -> cost p; the allocation z of a portfolio-like QP under each record's
    equality constraints (full investment, sector targets)."""

    def __init__(self, n: int = N_VAR, feats: int = N_FEAT, eps: float = 1e-2):
        super().__init__()
        self.cost = nn.Sequential(nn.Linear(feats, 32), nn.Tanh(), nn.Linear(32, n))
        self.L = nn.Parameter(torch.eye(n) + 0.1 * torch.randn(n, n))
        self.eps = eps

    def forward(self, feats, A, b):
        p = self.cost(feats)
        n = self.L.shape[0]
        Q = (self.L @ self.L.T + self.eps * torch.eye(n)).expand(feats.shape[0], n, n)
        return KKTSolve.apply(Q, p, A, b)


def make_kkt() -> KKTQP:
    torch.manual_seed(0)
    return KKTQP()


def kkt_batch(g: torch.Generator, n: int = 8, empty: int | None = None):
    """Features, constraints ``A z = b`` (full investment and a sector target) and the expert's
    allocations. ``empty``: a record whose sector lost all its assets to a filter, so its target
    row of ``A`` is all zeros (a constraint list built per record without dropping empty rows).
    (Not a duplicated row: whether LU rounds two equal rows to an exactly zero pivot is the
    LAPACK kernel's business, and one CI machine's did not do it the same in every run.)"""
    feats = torch.randn(n, N_FEAT, generator=g)
    sector = (torch.rand(n, N_VAR, generator=g) < 0.5).float()
    sector[:, 0], sector[:, 1] = 1.0, 0.0
    A = torch.stack([torch.ones(n, N_VAR), sector], 1)
    b = torch.stack([torch.ones(n), 0.3 + 0.4 * torch.rand(n, generator=g)], 1)
    if empty is not None:
        A[empty, 1] = 0.0
    target = torch.softmax(torch.randn(n, N_VAR, generator=g), 1)
    return feats, A, b, target


# ---------------------------------------------------------------------------------------------
# sparsemax attention over padded candidate sets


def sparsemax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The projection of ``scores`` onto the simplex (Martins & Astudillo 2016, Algorithm 1);
    ``-inf`` entries get weight 0."""
    z, _ = torch.sort(scores, dim=dim, descending=True)
    k = torch.arange(1, z.shape[dim] + 1, dtype=z.dtype)
    cs = z.cumsum(dim)
    support = (1 + k * z) > cs
    k_z = support.sum(dim, keepdim=True)
    tau = (cs.gather(dim, k_z - 1) - 1) / k_z
    return torch.clamp(scores - tau, min=0)


class SparsemaxAttention(nn.Module):
    """A query attends over a padded set of candidates with sparsemax weights."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, 1)

    def forward(self, query, cands, mask):
        scores = (self.k(cands) @ self.q(query)[:, :, None])[..., 0] / math.sqrt(cands.shape[-1])
        w = sparsemax(scores.masked_fill(~mask, float("-inf")))
        return (w[..., None] * self.v(cands)).sum(1)[:, 0], w


def make_sparsemax() -> SparsemaxAttention:
    torch.manual_seed(0)
    return SparsemaxAttention()


def sparse_loss(pred, w, y):
    return ((pred - y) ** 2).mean()


def candidate_batch(g: torch.Generator, n: int = 8, sets: int = 6):
    query = torch.randn(n, 8, generator=g)
    cands = torch.randn(n, sets, 8, generator=g)
    lengths = torch.randint(2, sets + 1, (n,), generator=g)
    mask = torch.arange(sets)[None] < lengths[:, None]
    y = torch.randn(n, generator=g)
    return query, cands, mask, y


# ---------------------------------------------------------------------------------------------
# decision-focused learning: predicted costs -> a smoothed argmin over the simplex by unrolled
# projected gradient descent -> the regret of that decision under the true costs


def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of each row onto the probability simplex (by sorting)."""
    return sparsemax(v)


class PGDDecision(nn.Module):
    """Features -> predicted item costs c; z = argmin c^T z + gamma/2 |z|^2 over the simplex,
    by ``iters`` projected gradient steps of 1 / gamma (unrolled: autograd through them)."""

    def __init__(self, n: int = N_ITEMS, feats: int = N_FEAT, gamma: float = 1.0,
                 iters: int = 20):
        super().__init__()
        self.cost = nn.Sequential(nn.Linear(feats, 32), nn.ReLU(), nn.Linear(32, n))
        self.gamma, self.iters = gamma, iters

    def forward(self, feats):
        c = self.cost(feats)
        z = torch.full_like(c, 1.0 / c.shape[1])
        for _ in range(self.iters):
            z = project_simplex(z - 0.5 / self.gamma * (c + self.gamma * z))
        return z


def make_pgd() -> PGDDecision:
    torch.manual_seed(0)
    return PGDDecision()


def regret(z, true_cost, best):
    """Decision-focused loss: the true cost of the decision taken minus the best one's."""
    return ((true_cost * z).sum(1) - best).mean()


def decision_batch(g: torch.Generator, n: int = 8, out_of_stock: int | None = None):
    """Features, true item costs and the best decision's cost. ``out_of_stock``: a record whose
    unavailable item is priced ``inf`` so that no decision takes it (its best is still finite)."""
    feats = torch.randn(n, N_FEAT, generator=g)
    true_cost = feats[:, :1].abs() + torch.rand(n, N_ITEMS, generator=g)
    if out_of_stock is not None:
        true_cost[out_of_stock, 2] = float("inf")
    best = true_cost.min(1).values
    return feats, true_cost, best


def masked_regret(z, true_cost, available, best):
    """The regret with unavailable items priced out (``inf``: no decision should take one)."""
    cost = true_cost.masked_fill(~available, float("inf"))
    return ((cost * z).sum(1) - best).mean()


def availability_batch(g: torch.Generator, n: int = 8, out_of_stock: int | None = None):
    """Features, true costs, which items are in stock, and the best in-stock decision's cost;
    ``out_of_stock``: a record with one item unavailable."""
    feats, true_cost, _ = decision_batch(g, n)
    available = torch.ones(n, N_ITEMS, dtype=torch.bool)
    if out_of_stock is not None:
        available[out_of_stock, 2] = False
    best = true_cost.masked_fill(~available, float("inf")).min(1).values
    return feats, true_cost, available, best


# ---------------------------------------------------------------------------------------------
# a learned low-rank-plus-ridge Q: the unconstrained QP's argmin by Cholesky


class LowRankQP(nn.Module):
    """Features -> cost p; z = argmin 1/2 z^T Q z + p^T z = -Q^-1 p with a learned
    ``Q = L L^T + eps I``, ``L`` of rank ``rank`` (a factor-model covariance, as in
    Markowitz layers), solved by ``cholesky`` and ``cholesky_solve``."""

    def __init__(self, n: int = N_VAR * 2, feats: int = N_FEAT, rank: int = 3,
                 eps: float = 1e-2):
        super().__init__()
        self.cost = nn.Sequential(nn.Linear(feats, 32), nn.ReLU(), nn.Linear(32, n))
        self.L = nn.Parameter(torch.randn(n, rank) / rank ** 0.5)
        self.eps = eps

    def forward(self, feats):
        p = self.cost(feats)
        Q = self.L @ self.L.T + self.eps * torch.eye(self.L.shape[0])
        C = torch.linalg.cholesky(Q)
        return -torch.cholesky_solve(p.T, C).T


def make_lowrank() -> LowRankQP:
    torch.manual_seed(0)
    return LowRankQP()


def make_lowrank_no_ridge() -> LowRankQP:
    """The ridge dropped ('Q is L L^T, positive-definite by construction')."""
    torch.manual_seed(0)
    return LowRankQP(eps=0.0)


def allocation_batch(g: torch.Generator, n: int = 8):
    feats = torch.randn(n, N_FEAT, generator=g)
    return feats, torch.randn(n, N_VAR * 2, generator=g) * 0.1


def roomy_batch(g: torch.Generator, n: int = 8):
    """Boxes and budgets far from the decisions (no constraint active at the optimum: the
    slacks stay of order 1 however large t grows)."""
    feats = torch.randn(n, N_FEAT, generator=g)
    lo = -5 - torch.rand(n, N_VAR, generator=g)
    hi = 5 + torch.rand(n, N_VAR, generator=g)
    budget = 50 + torch.rand(n, generator=g)
    target = 0.3 * torch.randn(n, N_VAR, generator=g)
    return feats, lo, hi, budget, target
