"""Knowledge-graph and hyperbolic embeddings as their well-known repositories write them, for
``test_geometry.py``: TransE (L1/L2 distance, margin ranking loss over corrupted triples),
RotatE (complex rotations from ``torch.polar``, self-adversarial negative weights, KGE's
``-logsigmoid`` loss), ComplEx over ``complex64`` embeddings (N3 regularizer), and Poincare
embeddings (Nickel & Kiela: the arcosh distance, Riemannian SGD written by hand, a
geoopt-style ``ManifoldParameter`` with its Riemannian optimizer)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

N_ENT, N_REL, DIM = 40, 5, 16


def triples(g: torch.Generator, n: int = 16) -> torch.Tensor:
    """A batch of (head, relation, tail) ids."""
    return torch.stack([torch.randint(0, N_ENT, (n,), generator=g),
                        torch.randint(0, N_REL, (n,), generator=g),
                        torch.randint(0, N_ENT, (n,), generator=g)], 1)


def corrupt(g: torch.Generator, pos: torch.Tensor, k: int = 8) -> torch.Tensor:
    """``k`` negatives per positive, tails replaced by uniform entities (head-batch mode
    aside): ``[B, k]`` tail ids."""
    return torch.randint(0, N_ENT, (len(pos), k), generator=g)


# --- TransE ---------------------------------------------------------------------------------


class TransE(nn.Module):
    """TransE as OpenKE writes it, with its L2 distance spelled out (a sqrt of the sum of
    squares, as many ports write it, instead of ``torch.norm``)."""

    def __init__(self, p: int = 2, max_norm: float | None = None):
        super().__init__()
        self.p = p
        # id 0 of each table pads a batch filled to a fixed size: zero vectors (no padding_idx:
        # their gradient is not masked); entities renormed to max_norm in the lookup
        self.ent = nn.Embedding(N_ENT, DIM, max_norm=max_norm)
        self.rel = nn.Embedding(N_REL, DIM)
        bound = 6 / math.sqrt(DIM)
        with torch.no_grad():
            for w in (self.ent.weight, self.rel.weight):
                nn.init.uniform_(w, -bound, bound)
                w[0] = 0

    def dist(self, h, r, t):
        d = h + r - t
        if self.p == 1:
            return d.abs().sum(-1)
        return torch.sqrt((d * d).sum(-1))

    def forward(self, pos, neg_tails):
        h, r = self.ent(pos[:, 0]), self.rel(pos[:, 1])
        pos_d = self.dist(h, r, self.ent(pos[:, 2]))
        neg_d = self.dist(h[:, None], r[:, None], self.ent(neg_tails))
        return pos_d, neg_d


def make_transe(p: int = 2, max_norm: float | None = None) -> TransE:
    torch.manual_seed(0)
    return TransE(p, max_norm)


class MarginLoss(nn.Module):
    """OpenKE's MarginLoss: max(pos - neg, -margin).mean() + margin."""

    def __init__(self, margin: float = 4.0):
        super().__init__()
        self.margin = margin

    def forward(self, out, _unused=None):
        pos_d, neg_d = out
        return (torch.clamp(pos_d[:, None] - neg_d, min=-self.margin)).mean() + self.margin


# --- RotatE ---------------------------------------------------------------------------------


class RotatE(nn.Module):
    """RotatE (Sun et al.): entities are complex64 vectors, a relation is a phase vector whose
    rotation ``torch.polar(1, phase)`` multiplies the head; the distance is the modulus of
    ``h * r - t`` summed over dimensions, scored as ``gamma - distance``."""

    def __init__(self, gamma: float = 12.0, modulus: str = "abs"):
        super().__init__()
        self.gamma, self.modulus = gamma, modulus
        rng = (gamma + 2.0) / DIM
        self.ent = nn.Parameter(torch.complex(torch.empty(N_ENT, DIM).uniform_(-rng, rng),
                                              torch.empty(N_ENT, DIM).uniform_(-rng, rng)))
        self.phase = nn.Parameter(torch.empty(N_REL, DIM).uniform_(-math.pi, math.pi))

    def score(self, h, phase, t):
        d = h * torch.polar(torch.ones_like(phase), phase) - t
        if self.modulus == "abs":
            m = d.abs()
        else:  # the stacked (re, im) distance, square root written out
            m = torch.sqrt(d.real ** 2 + d.imag ** 2)
        return self.gamma - m.sum(-1)

    def forward(self, pos, neg_tails):
        h, ph = self.ent[pos[:, 0]], self.phase[pos[:, 1]]
        pos_s = self.score(h, ph, self.ent[pos[:, 2]])
        neg_s = self.score(h[:, None], ph[:, None], self.ent[neg_tails])
        return pos_s, neg_s


def make_rotate(modulus: str = "abs") -> RotatE:
    torch.manual_seed(0)
    return RotatE(modulus=modulus)


def self_adversarial_loss(out, temperature: float = 1.0):
    """RotatE's loss: negatives weighted by softmax(score * temperature), detached."""
    pos_s, neg_s = out
    w = F.softmax(neg_s * temperature, dim=1).detach()
    neg = (w * F.logsigmoid(-neg_s)).sum(1)
    return -(F.logsigmoid(pos_s).mean() + neg.mean()) / 2


def self_adversarial_loss_by_hand(out, temperature: float = 1.0):
    """The same weights written as exp / sum(exp), without the max subtracted."""
    pos_s, neg_s = out
    e = torch.exp(neg_s * temperature)
    w = (e / e.sum(1, keepdim=True)).detach()
    neg = (w * F.logsigmoid(-neg_s)).sum(1)
    return -(F.logsigmoid(pos_s).mean() + neg.mean()) / 2


# --- ComplEx --------------------------------------------------------------------------------


class ComplEx(nn.Module):
    """ComplEx (Trouillon et al.; kbc's 1-N scoring): Re(<h, r, conj(t)>) against every entity,
    complex64 embeddings, and the factors N3 regularizes."""

    def __init__(self, init: float = 1e-3):
        super().__init__()
        self.ent = nn.Parameter(init * torch.randn(N_ENT, DIM, dtype=torch.cfloat))
        self.rel = nn.Parameter(init * torch.randn(N_REL, DIM, dtype=torch.cfloat))

    def forward(self, pos):
        h, r, t = self.ent[pos[:, 0]], self.rel[pos[:, 1]], self.ent[pos[:, 2]]
        scores = ((h * r) @ self.ent.conj().T).real
        return scores, (h.abs(), r.abs(), t.abs())


def make_complex() -> ComplEx:
    torch.manual_seed(0)
    return ComplEx()


class N3Loss(nn.Module):
    """kbc's cross-entropy over all tails plus the weighted N3 norm of the factors."""

    def __init__(self, weight: float = 1e-2):
        super().__init__()
        self.weight = weight

    def forward(self, out, tails):
        scores, factors = out
        reg = sum((f ** 3).sum() for f in factors) / len(tails)
        return F.cross_entropy(scores, tails) + self.weight * reg


# --- Poincare embeddings --------------------------------------------------------------------

BALL_EPS = 1e-5


def poincare_dist(u, v):
    """arcosh(1 + 2|u-v|^2 / ((1-|u|^2)(1-|v|^2))), as poincare-embeddings' model writes it."""
    sq = ((u - v) ** 2).sum(-1)
    alpha = 1 - (u * u).sum(-1)
    beta = 1 - (v * v).sum(-1)
    return torch.acosh(1 + 2 * sq / (alpha * beta))


class Poincare(nn.Module):
    """A hierarchy embedded in the Poincare ball: ``forward(ids)`` takes ``[B, 2 + k]`` rows of
    (u, v, negatives...) and returns minus the distances, the logits of the ranking loss."""

    def __init__(self, n: int = N_ENT, dim: int = 2, dtype=torch.float64, sparse: bool = False):
        super().__init__()
        self.emb = nn.Embedding(n, dim, dtype=dtype, sparse=sparse)
        nn.init.uniform_(self.emb.weight, -1e-3, 1e-3)

    def forward(self, ids):
        e = self.emb(ids)
        return -poincare_dist(e[:, :1], e[:, 1:])


def make_poincare(dtype: str = "float64", sparse: bool = False) -> Poincare:
    torch.manual_seed(0)
    return Poincare(dtype=getattr(torch, dtype), sparse=sparse)


def ranking_loss(neg_dists, _target=None):
    """The first column is the positive: cross entropy against class 0."""
    return F.cross_entropy(neg_dists, torch.zeros(len(neg_dists), dtype=torch.long))


def hierarchy_pairs(g: torch.Generator, n: int = 16, k: int = 6) -> torch.Tensor:
    """(child, parent, negatives...) rows of a complete binary tree over the entities."""
    child = torch.randint(1, N_ENT, (n,), generator=g)
    parent = (child - 1) // 2
    return torch.cat([child[:, None], parent[:, None],
                      torch.randint(0, N_ENT, (n, k), generator=g)], 1)


@torch.no_grad()
def rsgd_step(w: torch.Tensor, lr: float, project: bool = True):
    """Nickel & Kiela's Riemannian SGD on the ball, written in the loop: the Euclidean
    gradient scaled by the inverse metric ((1 - |x|^2)^2 / 4), then the projection back
    inside the ball (``renorm`` to 1 - eps) that keeps every point off the boundary."""
    g = w.grad
    scale = ((1 - (w * w).sum(-1, keepdim=True)) ** 2) / 4
    w.add_(g * scale, alpha=-lr)
    if project:
        w.copy_(torch.renorm(w, 2, 0, 1 - BALL_EPS))


# --- geoopt-style ManifoldParameter ---------------------------------------------------------


class PoincareBall:
    """geoopt's PoincareBall (curvature -1): Mobius addition, expmap, the projection."""

    def __init__(self, eps: float = 1e-5):
        self.eps = eps

    def mobius_add(self, x, y):
        xy = (x * y).sum(-1, keepdim=True)
        x2, y2 = (x * x).sum(-1, keepdim=True), (y * y).sum(-1, keepdim=True)
        num = (1 + 2 * xy + y2) * x + (1 - x2) * y
        return num / (1 + 2 * xy + x2 * y2)

    def lambda_x(self, x):
        return 2 / (1 - (x * x).sum(-1, keepdim=True))

    def expmap(self, x, u):
        """exp_x(u) = x (+) tanh(lambda_x |u| / 2) u / |u|: no clamp on |u|."""
        un = u.norm(dim=-1, keepdim=True)
        return self.mobius_add(x, torch.tanh(self.lambda_x(x) * un / 2) * u / un)

    def egrad2rgrad(self, x, g):
        return g / self.lambda_x(x) ** 2

    def projx(self, x):
        norm = x.norm(dim=-1, keepdim=True).clamp_min(1e-15)
        maxnorm = 1 - self.eps
        return torch.where(norm > maxnorm, x / norm * maxnorm, x)


class ManifoldTensor(torch.Tensor):
    """geoopt's ManifoldTensor: a tensor that carries its manifold."""

    def __new__(cls, data, manifold=None, requires_grad=False):
        instance = torch.Tensor._make_subclass(cls, data, requires_grad)
        instance.manifold = manifold
        return instance


class ManifoldParameter(ManifoldTensor, nn.Parameter):
    """geoopt's ManifoldParameter, which its Riemannian optimizers tell by ``p.manifold``."""

    def __new__(cls, data, manifold=None, requires_grad=True):
        instance = ManifoldTensor._make_subclass(cls, data, requires_grad)
        instance.manifold = manifold
        return instance


class RiemannianSGD(torch.optim.Optimizer):
    """geoopt's RiemannianSGD without momentum: rgrad, expmap retraction, projection."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = getattr(p, "manifold", None)
                if m is None:
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                rg = m.egrad2rgrad(p, p.grad)
                p.copy_(m.projx(m.expmap(p, -group["lr"] * rg)))


class GeooptPoincare(nn.Module):
    """Poincare embeddings whose table is a geoopt ``ManifoldParameter``."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        self.ball = PoincareBall()
        w = torch.empty(N_ENT, 2, dtype=dtype).uniform_(-1e-3, 1e-3)
        self.weight = ManifoldParameter(w, manifold=self.ball)

    def forward(self, ids):
        e = self.weight[ids]
        return -poincare_dist(e[:, :1], e[:, 1:])


def make_geoopt() -> dict:
    torch.manual_seed(0)
    return {"model": GeooptPoincare(), "optimizer": lambda groups: RiemannianSGD(groups)}


# --- a hyperbolic network (HNN / HGCN layers on the ball) -----------------------------------

MIN_NORM = 1e-15


def artanh(x, eps: float = 1e-15):
    """HGCN's artanh, without its cast to float64: 1 - 1e-15 is 1.0 in float32."""
    return torch.atanh(x.clamp(-1 + eps, 1 - eps))


def expmap0(u, c=1.0):
    sqrt_c = c ** 0.5
    un = u.norm(dim=-1, keepdim=True).clamp_min(MIN_NORM)
    return torch.tanh(sqrt_c * un) * u / (sqrt_c * un)


def logmap0(y, c=1.0, eps: float = 1e-15):
    sqrt_c = c ** 0.5
    yn = y.norm(dim=-1, keepdim=True).clamp_min(MIN_NORM)
    return artanh(sqrt_c * yn, eps) * y / (yn * sqrt_c)


def proj(x, c=1.0, eps: float = 1e-15):
    """Back inside the ball of radius 1/sqrt(c); HGCN's float64 eps, a no-op in float32."""
    norm = x.norm(dim=-1, keepdim=True).clamp_min(MIN_NORM)
    maxnorm = (1 - eps) / c ** 0.5
    return torch.where(norm > maxnorm, x / norm * maxnorm, x)


class HypLayer(nn.Module):
    """HGCN's HypLinear + HypAct: the features mapped to the ball, through a linear map in
    the tangent space at the origin, and back."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, h, c=1.0, eps: float = 1e-15):
        return proj(expmap0(F.relu(self.lin(logmap0(h, c, eps))), c), c)


class HNN(nn.Module):
    """Euclidean features mapped to the ball, two hyperbolic layers, a tangent-space decoder;
    HGCN's ``c=None`` trains the curvature, ``nn.Parameter(torch.Tensor([1.]))``."""

    def __init__(self, d_in: int = 8, hidden: int = 16, classes: int = 3, c: float | None = 1.0,
                 eps: float = 1e-15):
        super().__init__()
        self.c = nn.Parameter(torch.tensor([1.0])) if c is None else c
        self.eps = eps
        self.l1, self.l2 = HypLayer(d_in, hidden), HypLayer(hidden, hidden)
        self.dec = nn.Linear(hidden, classes)

    def forward(self, x):
        c, eps = self.c, self.eps
        h = proj(expmap0(x, c), c)
        return self.dec(logmap0(self.l2(self.l1(h, c, eps), c, eps), c, eps))


def make_hnn(c: float | None = 1.0, eps: float = 1e-15) -> HNN:
    torch.manual_seed(0)
    return HNN(c=c, eps=eps)


class UnitRotatE(nn.Module):
    """RotatE whose relations are free complex64 vectors put on the unit circle by
    ``r / r.abs()`` (instead of a phase parameter); relation 0 pads a batch filled to a fixed
    size and is initialised to 0, as ``padding_idx`` would."""

    def __init__(self, gamma: float = 12.0):
        super().__init__()
        self.gamma = gamma
        self.ent = nn.Parameter(torch.randn(N_ENT, DIM, dtype=torch.cfloat) / DIM ** 0.5)
        rel = torch.randn(N_REL, DIM, dtype=torch.cfloat)
        rel[0] = 0
        self.rel = nn.Parameter(rel)

    def forward(self, pos, neg_tails):
        h, r = self.ent[pos[:, 0]], self.rel[pos[:, 1]]
        r = r / r.abs()
        pos_s = self.gamma - (h * r - self.ent[pos[:, 2]]).abs().sum(-1)
        neg_s = self.gamma - (h[:, None] * r[:, None] - self.ent[neg_tails]).abs().sum(-1)
        return pos_s, neg_s


def make_unit_rotate() -> UnitRotatE:
    torch.manual_seed(0)
    return UnitRotatE()


class UnitCircle(nn.Module):
    """Relations put on the unit circle, as a module of their own."""

    def forward(self, r):
        return r / r.abs()


class ModularRotatE(UnitRotatE):
    """UnitRotatE whose normalisation is a submodule: the NaN is made inside it."""

    def __init__(self):
        super().__init__()
        self.unit = UnitCircle()

    def forward(self, pos, neg_tails):
        h, r = self.ent[pos[:, 0]], self.unit(self.rel[pos[:, 1]])
        pos_s = self.gamma - (h * r - self.ent[pos[:, 2]]).abs().sum(-1)
        neg_s = self.gamma - (h[:, None] * r[:, None] - self.ent[neg_tails]).abs().sum(-1)
        return pos_s, neg_s


def make_modular_rotate() -> ModularRotatE:
    torch.manual_seed(0)
    return ModularRotatE()


class Lorentz(nn.Module):
    """Nickel & Kiela (2018)'s Lorentz model: a point is its space coordinates v, lifted to
    the hyperboloid x = (sqrt(1 + |v|^2), v); distance acosh(-<x, y>_L), in float32."""

    def __init__(self, dim: int = 2):
        super().__init__()
        self.emb = nn.Embedding(N_ENT, dim)
        nn.init.uniform_(self.emb.weight, -1.0, 1.0)

    def forward(self, ids):
        v = self.emb(ids)
        x0 = torch.sqrt(1 + (v * v).sum(-1))
        u0, w0 = x0[:, :1], x0[:, 1:]
        inner = -u0 * w0 + (v[:, :1] * v[:, 1:]).sum(-1)
        return -torch.acosh(-inner)


def make_lorentz() -> Lorentz:
    torch.manual_seed(0)
    return Lorentz()


def mobius_matvec(m, x):
    """HNN's Mobius matrix-vector product, HGCN's torch.where for a zero product, ported
    without HGCN's clamp_min(min_norm) on the norms."""
    x_norm = x.norm(dim=-1, keepdim=True)
    mx = x @ m.transpose(-1, -2)
    mx_norm = mx.norm(dim=-1, keepdim=True)
    res_c = torch.tanh(mx_norm / x_norm * artanh(x_norm, 1e-5)) * mx / mx_norm
    cond = (mx == 0).all(-1, keepdim=True)
    return torch.where(cond, torch.zeros_like(res_c), res_c)


class MobiusMLP(nn.Module):
    """Features mapped to the ball, a Mobius linear layer, decoded at the origin's tangent."""

    def __init__(self, d_in: int = 8, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, d_in) / d_in ** 0.5)
        self.dec = nn.Linear(hidden, classes)

    def forward(self, x):
        h = proj(expmap0(x), eps=1e-5)
        return self.dec(logmap0(mobius_matvec(self.weight, h), eps=1e-5))


def make_mobius() -> MobiusMLP:
    torch.manual_seed(0)
    return MobiusMLP()
