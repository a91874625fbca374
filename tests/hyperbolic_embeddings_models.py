"""Hyperbolic representation learning as its repositories write it, for
``test_hyperbolic_embeddings``: Poincare embeddings of a tree with hyptorch's distance
(``2 artanh |(-u) (+) v|``) and a negative-sampling loss that masks the known positives with
-inf; HGCN-style hyperbolic layers with a learned curvature and Ganea et al.'s hyperbolic
multinomial logistic regression; Nickel & Kiela's Riemannian SGD written in the loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_ENT = 31  # a complete binary tree of depth 4
MIN_NORM = 1e-15


# --- the Poincare ball (hyptorch's pmath, curvature c) --------------------------------------


def artanh(x):
    """hyptorch's Artanh, clamped inside (-1, 1) by its own float32 margin."""
    return torch.atanh(x.clamp(-1 + 1e-5, 1 - 1e-5))


def mobius_add(x, y, c=1.0):
    xy = (x * y).sum(-1, keepdim=True)
    x2, y2 = (x * x).sum(-1, keepdim=True), (y * y).sum(-1, keepdim=True)
    num = (1 + 2 * c * xy + c * y2) * x + (1 - c * x2) * y
    return num / (1 + 2 * c * xy + c ** 2 * x2 * y2).clamp_min(MIN_NORM)


def dist(x, y, c=1.0):
    """hyptorch's ``_dist``: 2 / sqrt(c) artanh(sqrt(c) |(-x) (+) y|)."""
    sqrt_c = c ** 0.5
    return 2 / sqrt_c * artanh(sqrt_c * mobius_add(-x, y, c).norm(dim=-1, p=2))


def expmap0(u, c=1.0):
    sqrt_c = c ** 0.5
    un = u.norm(dim=-1, keepdim=True).clamp_min(MIN_NORM)
    return torch.tanh(sqrt_c * un) * u / (sqrt_c * un)


def logmap0(y, c=1.0):
    sqrt_c = c ** 0.5
    yn = y.norm(dim=-1, keepdim=True).clamp_min(MIN_NORM)
    return artanh(sqrt_c * yn) * y / (yn * sqrt_c)


def project(x, c=1.0, eps: float = 1e-3):
    """hyptorch's ``project``: back inside the ball of radius (1 - eps) / sqrt(c)."""
    norm = x.norm(dim=-1, keepdim=True).clamp_min(MIN_NORM)
    maxnorm = (1 - eps) / c ** 0.5
    return torch.where(norm > maxnorm, x / norm * maxnorm, x)


# --- Poincare embeddings of a hierarchy -----------------------------------------------------


def tree_batch(g: torch.Generator, n: int = 16, k: int = 8, resample_self: bool = False) -> tuple:
    """(child, ancestor) pairs of the tree's transitive closure and ``k`` uniform negatives
    each, with the mask of the negatives that are the anchor's known ancestors or itself
    (poincare-embeddings' sampler excludes them; here the loss masks them); with
    ``resample_self`` a negative equal to its child is replaced by the next entity."""
    child = torch.randint(1, N_ENT, (n,), generator=g)
    up = torch.randint(1, 4, (n,), generator=g)
    parent = child.clone()
    for _ in range(3):  # (climb up to 3 levels, never above the root)
        step = (parent - 1) // 2
        parent = torch.where((up > 0) & (parent > 0), step, parent)
        up = up - 1
    neg = torch.randint(0, N_ENT, (n, k), generator=g)
    if resample_self:
        neg = torch.where(neg == child[:, None], (neg + 1) % N_ENT, neg)
    return child, parent, neg, known(child, neg)


def known(child: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """Negatives that are the child itself or one of its ancestors."""
    mask = neg == child[:, None]
    a = child.clone()
    for _ in range(5):
        a = torch.where(a > 0, (a - 1) // 2, a)
        mask |= (neg == a[:, None]) & (child[:, None] > 0)
    return mask


class PoincareEmbedding(nn.Module):
    """``forward(u, v, neg, known)``: minus the distances of (u, v) and of (u, each negative),
    the negatives that are known positives set to -inf (they must not be pushed away)."""

    def __init__(self, n: int = N_ENT, dim: int = 2, dtype=torch.float32):
        super().__init__()
        self.emb = nn.Embedding(n, dim, dtype=dtype)
        nn.init.uniform_(self.emb.weight, -1e-3, 1e-3)

    def forward(self, u, v, neg, known):
        eu = self.emb(u)
        pos = -dist(eu, self.emb(v))
        negs = (-dist(eu[:, None], self.emb(neg))).masked_fill(known, float("-inf"))
        return torch.cat([pos[:, None], negs], 1)


class MinusLate(PoincareEmbedding):
    """The same logits with the minus written before the call chain: ``-d.masked_fill`` is
    ``-(d.masked_fill(...))``, so the masked negatives leave as +inf."""

    def forward(self, u, v, neg, known):
        eu = self.emb(u)
        pos = -dist(eu, self.emb(v))
        negs = -dist(eu[:, None], self.emb(neg)).masked_fill(known, float("-inf"))
        return torch.cat([pos[:, None], negs], 1)


class MaskedDistances(PoincareEmbedding):
    """The model returns distances, the known ancestors' at +inf on purpose (masked as -inf
    scores, then negated back); :func:`distance_loss` negates them into logits."""

    def forward(self, u, v, neg, known):
        return -super().forward(u, v, neg, known)


def make_poincare(minus_late: bool = False, distances: bool = False,
                  dtype: str = "float32") -> PoincareEmbedding:
    torch.manual_seed(0)
    model = MinusLate() if minus_late else MaskedDistances() if distances else \
        PoincareEmbedding()
    return model.to(getattr(torch, dtype))


def acosh_dist(u, v):
    """poincare-embeddings' PoincareDistance: arcosh(1 + 2|u-v|^2 / ((1-|u|^2)(1-|v|^2)))."""
    sq = ((u - v) ** 2).sum(-1)
    alpha, beta = 1 - (u * u).sum(-1), 1 - (v * v).sum(-1)
    return torch.acosh(1 + 2 * sq / (alpha * beta))


class NickelKiela(PoincareEmbedding):
    """The same model with Nickel & Kiela's own arcosh distance, whose points must stay
    strictly inside the ball (their loop's projection keeps them 1e-5 from the boundary);
    ``masked=False`` leaves the known ancestors among the negatives."""

    def __init__(self, dtype=torch.float64, masked: bool = True):
        super().__init__(dtype=dtype)
        self.masked = masked

    def forward(self, u, v, neg, known):
        eu = self.emb(u)
        pos = -acosh_dist(eu, self.emb(v))
        negs = -acosh_dist(eu[:, None], self.emb(neg))
        if self.masked:
            negs = negs.masked_fill(known, float("-inf"))
        return torch.cat([pos[:, None], negs], 1)


def make_nickel_kiela(dtype: str = "float64", masked: bool = True) -> NickelKiela:
    """In float64, as poincare-embeddings trains."""
    torch.manual_seed(0)
    return NickelKiela(dtype=getattr(torch, dtype), masked=masked)


def ranking_loss(logits):
    """Nickel & Kiela's loss: softmax over (positive, negatives), the positive first."""
    return F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long))


def distance_loss(dists):
    return ranking_loss(-dists)


@torch.no_grad()
def rsgd_(w: torch.Tensor, lr: float, eps: float = 1e-5):
    """Riemannian SGD on the ball, in the loop: the gradient rescaled by the inverse metric
    (1 - |x|^2)^2 / 4, then the projection back inside the ball to 1 - eps."""
    scale = (1 - (w * w).sum(-1, keepdim=True)) ** 2 / 4
    w.add_(w.grad * scale, alpha=-lr)
    w.copy_(torch.renorm(w, 2, 0, 1 - eps))


# --- a hyperbolic classifier: HGCN-style layers, Ganea et al.'s hyperbolic MLR --------------


class HypLinear(nn.Module):
    """HGCN's HypLinear + HypAct: log map to the origin's tangent space, a linear map and a
    ReLU there, exp map back and the projection."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, h, c):
        return project(expmap0(F.relu(self.lin(logmap0(h, c))), c), c)


class HypMLR(nn.Module):
    """Ganea et al. (2018)'s hyperbolic multinomial logistic regression (hyptorch's
    ``HyperbolicMLR``): a hyperplane per class through p_k with normal a_k."""

    def __init__(self, dim: int, classes: int):
        super().__init__()
        self.a_vals = nn.Parameter(torch.randn(classes, dim) * 0.1)
        self.p_vals = nn.Parameter(torch.randn(classes, dim) * 0.1)

    def forward(self, x, c):
        p = expmap0(self.p_vals, c)
        conf = 1 - c * (p * p).sum(1, keepdim=True)
        a = self.a_vals * conf
        logits = []
        for k in range(len(p)):
            z = mobius_add(-p[k], x, c)
            za = (z * a[k]).sum(-1)
            an = a[k].norm()
            lam = 2 / (1 - c * (z * z).sum(-1))
            arg = 2 * c ** 0.5 * za * lam / an
            logits.append(lam.new_tensor(2.0) * an / c ** 0.5 * torch.asinh(arg / 2))
        return torch.stack(logits, 1)


class HyperbolicNet(nn.Module):
    """Features to the ball, two hyperbolic layers, hyperbolic MLR; HGCN's trained
    curvature ``c = nn.Parameter(torch.Tensor([1.]))`` when ``learn_c``."""

    def __init__(self, d_in: int = 8, hidden: int = 16, classes: int = 4, learn_c: bool = True):
        super().__init__()
        self.c = nn.Parameter(torch.tensor([1.0]), requires_grad=learn_c)
        self.l1, self.l2 = HypLinear(d_in, hidden), HypLinear(hidden, hidden)
        self.mlr = HypMLR(hidden, classes)

    def forward(self, x):
        c = self.c
        h = project(expmap0(x, c), c)
        return self.mlr(self.l2(self.l1(h, c), c), c)


def make_hypnet(learn_c: bool = True) -> HyperbolicNet:
    torch.manual_seed(0)
    return HyperbolicNet(learn_c=learn_c)


def features(g: torch.Generator, n: int = 32, d: int = 8, classes: int = 4) -> tuple:
    """Four Gaussian clusters, a class each."""
    y = torch.randint(0, classes, (n,), generator=g)
    centres = torch.linspace(-1.5, 1.5, classes)[:, None].expand(classes, d)
    return centres[y] + 0.3 * torch.randn(n, d, generator=g), y


# --- the Lorentz model: points as tangent vectors at the origin -----------------------------


def lorentz_expmap0(v):
    """exp_o(v) on the hyperboloid: (cosh |v|, sinh |v| v / |v|), without a floor on |v|."""
    n = v.norm(dim=-1, keepdim=True)
    return torch.cat([torch.cosh(n), torch.sinh(n) * v / n], -1)


def lorentz_dist(x, y, eps: float = 1e-6):
    """acosh(-<x, y>_L), clamped to 1 + eps (the rounding below 1 handled)."""
    inner = -x[..., :1] * y[..., :1] + (x[..., 1:] * y[..., 1:]).sum(-1, keepdim=True)
    return torch.acosh((-inner).clamp_min(1 + eps)).squeeze(-1)


class LorentzEmbedding(nn.Module):
    """``forward(u, v, neg)``: minus the Lorentz distances of (u, v) and of (u, each negative);
    entity 0 is padding (a batch's negative lists padded to one length), its row all 0."""

    def __init__(self, n: int = N_ENT + 1, dim: int = 4):
        super().__init__()
        self.emb = nn.Embedding(n, dim, padding_idx=0)
        with torch.no_grad():
            self.emb.weight[1:].uniform_(-0.1, 0.1)

    def forward(self, u, v, neg):
        x = lorentz_expmap0(self.emb(u))
        pos = -lorentz_dist(x, lorentz_expmap0(self.emb(v)))
        negs = -lorentz_dist(x[:, None], lorentz_expmap0(self.emb(neg)))
        return torch.cat([pos[:, None], negs], 1)


def make_lorentz() -> LorentzEmbedding:
    torch.manual_seed(0)
    return LorentzEmbedding()


class ClosureDataset(torch.utils.data.Dataset):
    """(child, ancestor) pairs of the tree (ids shifted by 1: 0 pads), each with its own
    number of sampled negatives (poincare-embeddings' sampler draws until it has enough
    non-ancestors)."""

    def __init__(self, seed: int = 0, k: int = 6):
        g = torch.Generator().manual_seed(seed)
        child = torch.arange(1, N_ENT)
        self.pairs = torch.stack([child, (child - 1) // 2], 1) + 1
        self.negs = [torch.randint(1, N_ENT + 1, (int(torch.randint(2, k + 1, (1,),
                                                                    generator=g)),),
                                   generator=g) for _ in child]

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i], self.negs[i]


def collate(items):
    """Negative lists padded with entity 0 to the batch's longest."""
    pairs = torch.stack([p for p, _ in items])
    neg = nn.utils.rnn.pad_sequence([n for _, n in items], batch_first=True)
    return pairs[:, 0], pairs[:, 1], neg
