"""Associative memories and energy-based attention as their papers and repositories write
them, for ``test_associative_memory``:

- ``HopfieldNet``: a Hopfield layer of Ramsauer et al. (``hopfield-layers``' ``Hopfield``):
  state patterns ``xi`` and stored patterns ``Y`` projected, one update
  ``softmax(beta * xi Y^T) Y`` with a large inverse temperature, then a classifier head; the
  softmax by hand (``exp`` over its row sum) in ``make_hopfield_by_hand``.
- ``HopfieldPooling``: DeepRC / hopfield-layers' ``HopfieldPooling`` for multiple-instance
  learning: a learned query retrieves from each bag's instances, bags of varying size padded
  and masked with ``masked_fill(~mask, -inf)``, given to ``forward`` as an extra argument.
- ``DenseAM``: Krotov & Hopfield's dense associative memory (2016) as a classifier: the
  rectified polynomial energy ``F(x) = relu(x)^n`` and the label update
  ``tanh(beta * sum_mu [F(xi_mu . v + xi_mu,a) - F(xi_mu . v - xi_mu,a)])``, trained with the
  paper's loss ``|c - t|^m``.
- ``EnergyRetrieval``: retrieval by gradient descent on the modern Hopfield energy
  ``E = -lse(beta, X^T xi) + xi.xi / 2`` inside ``forward`` (``autograd.grad`` with
  ``create_graph=True``), a step size given at construction.
- ``CLOOB``: Fürst et al.'s Hopfield retrieval of both modalities from the batch's embeddings
  and the InfoLOOB loss by hand (the positive over the sum of the other samples).
- ``ClassMemories``: each class's logit the negative Hopfield energy of its memories, the
  log-sum-exp written out as ``log(sum(exp(beta s)))``.
- ``BankRetrieval``: a Hopfield lookup into a FIFO queue of past embeddings (a buffer written
  in ``forward``), normalised by hand.
- ``PMANet``: multiple-instance pooling by ``nn.MultiheadAttention`` with a learned query and
  the bags' ``key_padding_mask`` (set transformers' PMA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D = 16


# ---------------------------------------------------------------------------------------------
# modern Hopfield layer


class Hopfield(nn.Module):
    """One retrieval ``softmax(beta * Q K^T) V`` with learned stored patterns."""

    def __init__(self, dim: int = D, patterns: int = 32, beta: float = 1.0,
                 by_hand: bool = False):
        super().__init__()
        self.stored = nn.Parameter(torch.randn(patterns, dim))
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.beta, self.by_hand = beta, by_hand

    def forward(self, xi):
        q, k, v = self.q(xi), self.k(self.stored), self.v(self.stored)
        scores = self.beta * q @ k.t()
        if self.by_hand:  # the bug: exp outside log-space, e^(beta x) past x = 88 / beta
            e = torch.exp(scores)
            attn = e / e.sum(-1, keepdim=True)
        else:
            attn = scores.softmax(-1)
        return attn @ v


class HopfieldNet(nn.Module):
    def __init__(self, beta: float = 1.0, by_hand: bool = False, classes: int = 4):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.hopfield = Hopfield(beta=beta, by_hand=by_hand)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, classes)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.norm(h + self.hopfield(h)))


def make_hopfield() -> HopfieldNet:
    torch.manual_seed(0)
    return HopfieldNet(beta=8.0)


def make_hopfield_by_hand() -> HopfieldNet:
    torch.manual_seed(0)
    return HopfieldNet(beta=8.0, by_hand=True)


def pattern_batch(g: torch.Generator, loud_row: int | None = None, n: int = 16):
    """Noisy copies of 4 prototypes; ``loud_row``: a record whose features are 30x the scale
    of the others (an unnormalised sensor dump)."""
    protos = torch.randn(4, D, generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, 4, (n,), generator=g)
    x = protos[y] + 0.3 * torch.randn(n, D, generator=g)
    if loud_row is not None:
        x[loud_row] *= 30.0
    return x, y


# ---------------------------------------------------------------------------------------------
# Hopfield pooling for multiple-instance learning


class HopfieldPooling(nn.Module):
    """A learned state pattern (the query) retrieves from the bag's instances."""

    def __init__(self, dim: int = D, heads: int = 2, beta: float | None = None,
                 empty_to_zero: bool = False):
        super().__init__()
        self.query = nn.Parameter(torch.randn(heads, dim) * 0.1)
        self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.beta = beta if beta is not None else dim ** -0.5
        self.empty_to_zero = empty_to_zero

    def forward(self, x, mask):
        scores = self.beta * torch.einsum("hd,bnd->bhn", self.query, self.k(x))
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        attn = scores.softmax(-1)  # a bag with every instance masked: a row of all -inf
        if self.empty_to_zero:  # the usual guard: an empty bag pools to 0
            attn = attn.nan_to_num(0.0)
        return torch.einsum("bhn,bnd->bhd", attn, self.v(x)).flatten(1)


class MILNet(nn.Module):
    def __init__(self, heads: int = 2, empty_to_zero: bool = False):
        super().__init__()
        self.instance = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
        self.pool = HopfieldPooling(heads=heads, empty_to_zero=empty_to_zero)
        self.head = nn.Linear(heads * D, 1)

    def forward(self, x, mask):
        return self.head(self.pool(self.instance(x), mask)).squeeze(-1)


def make_mil() -> MILNet:
    torch.manual_seed(0)
    return MILNet()


def make_mil_guarded() -> MILNet:
    torch.manual_seed(0)
    return MILNet(empty_to_zero=True)


class Bags(torch.utils.data.Dataset):
    """Bags of 1..8 instances; positive when one instance carries the witness pattern.
    ``empty``: the index of a bag left with no instances (a slide whose tiles were all
    filtered out as background)."""

    def __init__(self, n: int = 64, empty: int | None = None, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        witness = torch.randn(D, generator=torch.Generator().manual_seed(3))
        self.bags, self.labels = [], []
        for i in range(n):
            size = 0 if i == empty else int(torch.randint(1, 9, (1,), generator=g))
            bag = torch.randn(size, D, generator=g)
            label = float(torch.rand(1, generator=g) < 0.5)
            if label and size:
                bag[0] += 2 * witness
            self.bags.append(bag)
            self.labels.append(label)

    def __len__(self):
        return len(self.bags)

    def __getitem__(self, i):
        return self.bags[i], self.labels[i]


def pad_bags(items):
    """The collate function: pad to the largest bag, True where an instance is real."""
    width = max(1, max(b.shape[0] for b, _ in items))
    x = torch.zeros(len(items), width, D)
    mask = torch.zeros(len(items), width, dtype=torch.bool)
    for i, (b, _) in enumerate(items):
        x[i, :b.shape[0]], mask[i, :b.shape[0]] = b, True
    return x, mask, torch.tensor([lab for _, lab in items])


# ---------------------------------------------------------------------------------------------
# dense associative memory (Krotov & Hopfield 2016)


class DenseAM(nn.Module):
    """Memories ``xi`` over the visible (pixels) and label neurons; one update of the labels
    from the rectified polynomial energy of power ``n``."""

    def __init__(self, visible: int = 2 * D, classes: int = 4, memories: int = 20,
                 n: int = 20, beta: float = 0.05):
        super().__init__()
        self.mem = nn.Parameter(torch.randn(memories, visible + classes) * 0.3)
        self.visible, self.classes, self.n, self.beta = visible, classes, n, beta

    def forward(self, v):
        xi_v, xi_c = self.mem[:, :self.visible], self.mem[:, self.visible:]
        # labels start at -1: A = xi_v . v + sum_c xi_c * (-1), then flip label a to +1 or -1
        base = v @ xi_v.t() - xi_c.sum(1)  # (B, K)
        plus = F.relu(base[:, :, None] + 2 * xi_c[None]) ** self.n  # the bug: x^n past 1e38
        minus = F.relu(base[:, :, None]) ** self.n
        return torch.tanh(self.beta * (plus - minus).sum(1))  # (B, classes)


def make_dense_am() -> DenseAM:
    torch.manual_seed(0)
    return DenseAM()


def dense_am_loss(c, target, m: int = 4):
    """The paper's loss: the m-th power of the distance to the +-1 targets."""
    t = F.one_hot(target, c.shape[1]).float() * 2 - 1
    return (c - t).abs().pow(m).sum(1).mean()


def pixel_batch(g: torch.Generator, bright_row: int | None = None, n: int = 16):
    """Binary-ish images in [-1, 1]; ``bright_row``: an image read as 0..255 instead of the
    [-1, 1] the others were scaled to."""
    protos = torch.randn(4, 2 * D, generator=torch.Generator().manual_seed(5)).sign()
    y = torch.randint(0, 4, (n,), generator=g)
    flip = torch.rand(n, 2 * D, generator=g) < 0.1
    v = torch.where(flip, -protos[y], protos[y])
    if bright_row is not None:
        v[bright_row] = (v[bright_row] + 1) * 127.5
    return v, y


# ---------------------------------------------------------------------------------------------
# retrieval by gradient descent on the energy


class EnergyRetrieval(nn.Module):
    """xi <- xi - lr * dE/dxi for a few steps, the energy differentiated inside forward."""

    def __init__(self, steps: int = 40, lr: float = 0.5, beta: float = 4.0, classes: int = 4):
        super().__init__()
        self.memories = nn.Parameter(torch.randn(24, D) * 0.5)
        self.encode = nn.Linear(D, D)
        self.head = nn.Linear(D, classes)
        self.steps, self.lr, self.beta = steps, lr, beta

    def energy(self, xi):
        lse = torch.logsumexp(self.beta * xi @ self.memories.t(), -1) / self.beta
        return -lse + 0.5 * (xi * xi).sum(-1)

    def forward(self, x):
        xi = self.encode(x)
        if not xi.requires_grad:  # (evaluation under no_grad still descends)
            xi = xi.detach().requires_grad_()
        for _ in range(self.steps):
            with torch.enable_grad():
                grad, = torch.autograd.grad(self.energy(xi).sum(), xi, create_graph=True)
            xi = xi - self.lr * grad  # lr > 2 leaves (1 - lr) xi growing each step
        return self.head(xi)


def make_energy() -> EnergyRetrieval:
    torch.manual_seed(0)
    return EnergyRetrieval()


def make_energy_big_step() -> EnergyRetrieval:
    torch.manual_seed(0)
    return EnergyRetrieval(lr=12.0, steps=40)


def make_dense_am_high_power() -> DenseAM:
    """n = 40 (the paper's sharpest memories) with memories at unit scale: relu(x)^40 passes
    float32's largest value once x reaches 9.2."""
    torch.manual_seed(0)
    model = DenseAM(n=40, beta=1e-30)
    with torch.no_grad():
        model.mem.normal_()
    return model


# ---------------------------------------------------------------------------------------------
# CLOOB: Hopfield retrieval of both modalities, the InfoLOOB loss


class CLOOB(nn.Module):
    """Fürst et al.'s CLOOB: image and text embeddings, each modality's batch retrieved from
    the batch's stored embeddings by a Hopfield update, then L2-normalised."""

    def __init__(self, beta: float = 8.0):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D))
        self.text = nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D))
        self.beta = beta

    def retrieve(self, state, stored):
        return (self.beta * state @ stored.t()).softmax(-1) @ stored

    def forward(self, img, txt):
        x, y = F.normalize(self.image(img), dim=-1), F.normalize(self.text(txt), dim=-1)
        u_x, u_y = self.retrieve(x, x), self.retrieve(y, x)
        v_x, v_y = self.retrieve(x, y), self.retrieve(y, y)
        return tuple(F.normalize(t, dim=-1) for t in (u_x, u_y, v_x, v_y))


def info_loob(a, b, inv_tau: float = 30.0):
    """InfoLOOB by hand: the positive pair over the sum of the others (leave one out); a
    batch of one sample has no other, its sum is 0."""
    s = inv_tau * a @ b.t()
    e = torch.exp(s)  # (s of unit vectors is at most inv_tau: e^30 is finite)
    pos = e.diagonal()
    neg = (e * (1 - torch.eye(len(s)))).sum(1)
    return -torch.log(pos / neg).mean()


def cloob_loss(u_x, u_y, v_x, v_y, inv_tau: float = 30.0):
    return (info_loob(u_x, u_y, inv_tau) + info_loob(v_y, v_x, inv_tau)) / inv_tau


def make_cloob() -> CLOOB:
    torch.manual_seed(0)
    return CLOOB()


class Pairs(torch.utils.data.Dataset):
    """Paired views: a text feature a noisy linear map of its image's."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.img = torch.randn(n, D, generator=g)
        mix = torch.randn(D, D, generator=torch.Generator().manual_seed(11)) / D ** 0.5
        self.txt = self.img @ mix + 0.1 * torch.randn(n, D, generator=g)

    def __len__(self):
        return len(self.img)

    def __getitem__(self, i):
        return self.img[i], self.txt[i]


# ---------------------------------------------------------------------------------------------
# a classifier by the energy of each class's memories


class ClassMemories(nn.Module):
    """Each class stores memories; its logit is the negative Hopfield energy of the query,
    ``lse(beta, M_c q) = log(sum_mu exp(beta m_mu . q)) / beta``, written out by hand."""

    def __init__(self, classes: int = 4, per_class: int = 8, beta: float = 40.0):
        super().__init__()
        self.query = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
        self.memories = nn.Parameter(torch.randn(classes, per_class, D))
        self.beta = beta

    def forward(self, x):
        s = torch.einsum("cmd,bd->bcm", self.memories, self.query(x))
        return torch.log(torch.exp(self.beta * s).sum(-1)) / self.beta  # the bug: not lse


def make_class_memories() -> ClassMemories:
    torch.manual_seed(0)
    return ClassMemories()


# ---------------------------------------------------------------------------------------------
# a Hopfield lookup into a queue of past embeddings


class BankRetrieval(nn.Module):
    """The stored patterns are a FIFO queue of the last batches' embeddings (a MoCo-style
    memory bank, a buffer), L2-normalised by hand before the retrieval; the queue starts as
    zeros, filled batch by batch."""

    def __init__(self, slots: int = 64, beta: float = 8.0, classes: int = 4):
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D))
        self.head = nn.Linear(2 * D, classes)
        self.register_buffer("bank", torch.zeros(slots, D))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.beta = beta

    def forward(self, x):
        z = F.normalize(self.encode(x), dim=-1)
        keys = self.bank / self.bank.norm(dim=-1, keepdim=True)  # the bug: 0/0 in empty slots
        out = (self.beta * z @ keys.t()).softmax(-1) @ keys
        if self.training:
            with torch.no_grad():
                i = int(self.ptr)
                self.bank[i:i + len(z)] = z.detach()
                self.ptr.fill_((i + len(z)) % len(self.bank))
        return self.head(torch.cat([z, out], -1))


def make_bank() -> BankRetrieval:
    torch.manual_seed(0)
    return BankRetrieval()


def make_bank_random() -> BankRetrieval:
    """MoCo's start: the queue filled with normalised random vectors."""
    torch.manual_seed(0)
    model = BankRetrieval()
    model.bank.copy_(F.normalize(torch.randn_like(model.bank), dim=-1))
    return model


# ---------------------------------------------------------------------------------------------
# pooling by torch's multi-head attention with a learned query (set transformers' PMA)


class PMAPooling(nn.Module):
    def __init__(self, dim: int = D, heads: int = 2):
        super().__init__()
        self.seed = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x, mask):
        q = self.seed.expand(len(x), -1, -1)
        out, _ = self.mha(q, x, x, key_padding_mask=~mask)  # True: padding, ignored
        return out.squeeze(1)


class PMANet(nn.Module):
    def __init__(self):
        super().__init__()
        self.instance = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
        self.pool = PMAPooling()
        self.head = nn.Linear(D, 1)

    def forward(self, x, mask):
        return self.head(self.pool(self.instance(x), mask)).squeeze(-1)


def make_pma() -> PMANet:
    torch.manual_seed(0)
    return PMANet()


def make_dense_am_steep() -> DenseAM:
    """n = 40 with memories at 0.4: relu(x) ** 40 stays below float32's largest value (x up
    to 9.0), but its derivative 40 x ** 39 does not."""
    torch.manual_seed(0)
    model = DenseAM(n=40, beta=1e-30)
    with torch.no_grad():
        model.mem.normal_().mul_(0.4)
    return model
