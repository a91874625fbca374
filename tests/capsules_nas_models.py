"""Capsule networks and differentiable architecture search as their well-known repositories
write them, for ``test_capsules_nas``.

CapsNet (Sabour et al.; gram-ai/capsule-networks, XifengGuo/CapsNet-Pytorch): ``squash``,
dynamic routing by agreement (a softmax over the routing logits, three iterations of
``b_ij += u_hat . v``) and the margin loss, here in the text CapsNet of Zhao et al. (2018),
which builds one primary capsule per token position and zeroes the padded ones.

DARTS (quark0/darts, khanrc/pt.darts): cells of mixed ops weighted by a softmax over the
architecture alphas (``none`` is the zero op, ``skip_connect`` the identity), the alphas
trained by their own Adam on validation batches, the weights by SGD with momentum on training
batches (first order); an entropy regulariser on the edge distributions pushes them to
one-hot. quark0/darts keeps the alphas as plain tensor attributes that require grad.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# capsules


def squash(s: torch.Tensor, dim: int = -1, eps_inside: bool = True) -> torch.Tensor:
    """v = |s|^2 / (1 + |s|^2) * s / |s|. ``eps_inside=False`` is the common version with the
    eps on the division only: its forward is finite at a zero capsule, but sqrt'(0) = inf."""
    n2 = (s ** 2).sum(dim=dim, keepdim=True)
    if eps_inside:
        return n2 / (1 + n2) * s / torch.sqrt(n2 + 1e-8)
    return n2 / (1 + n2) * s / (torch.sqrt(n2) + 1e-8)


class DigitCaps(nn.Module):
    """Dynamic routing from ``n_in`` capsules of ``d_in`` to ``n_out`` of ``d_out``."""

    def __init__(self, n_in: int, d_in: int, n_out: int, d_out: int, iters: int = 3,
                 eps_inside: bool = True):
        super().__init__()
        self.W = nn.Parameter(0.01 * torch.randn(1, n_in, n_out, d_out, d_in))
        self.iters, self.eps_inside = iters, eps_inside

    def forward(self, u):  # u: (B, n_in, d_in)
        u_hat = (self.W @ u[:, :, None, :, None]).squeeze(-1)  # (B, n_in, n_out, d_out)
        b = torch.zeros(u_hat.shape[:3], device=u.device)
        for i in range(self.iters):
            c = F.softmax(b, dim=2)  # each input capsule's coupling over the outputs
            v = squash((c[..., None] * u_hat).sum(1), eps_inside=self.eps_inside)
            if i < self.iters - 1:
                b = b + (u_hat * v[:, None]).sum(-1)  # agreement
        return v  # (B, n_out, d_out)


class TextCapsNet(nn.Module):
    """Zhao et al.'s capsules for text: an n-gram convolution, one primary capsule per token
    position and channel, those at padded positions zeroed by the mask, routed to classes."""

    def __init__(self, vocab: int = 30, n_classes: int = 3, length: int = 8,
                 eps_inside: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, 16, padding_idx=0)
        self.ngram = nn.Conv1d(16, 4 * 4, 3, padding=1)  # 4 capsule channels of 4 dims
        self.classes = DigitCaps(4 * length, 4, n_classes, 6)
        self.eps_inside = eps_inside

    def forward(self, tokens, lengths):
        h = self.ngram(self.embed(tokens).transpose(1, 2))  # (B, 16, L)
        mask = (torch.arange(tokens.shape[1]) < lengths[:, None]).type_as(h)  # (B, L)
        u = h.view(tokens.shape[0], 4, 4, -1).permute(0, 3, 1, 2)  # (B, L, 4 caps, 4)
        u = u * mask[:, :, None, None]  # padded positions hold no capsule
        u = squash(u, eps_inside=self.eps_inside).reshape(tokens.shape[0], -1, 4)
        return self.classes(u)


def make_text_capsnet(eps_inside: bool = False) -> TextCapsNet:
    torch.manual_seed(0)
    return TextCapsNet(eps_inside=eps_inside)


class MarginLoss(nn.Module):
    def forward(self, v, labels):
        lengths = v.norm(dim=-1)
        t = F.one_hot(labels, v.shape[1]).float()
        return (t * F.relu(0.9 - lengths) ** 2
                + 0.5 * (1 - t) * F.relu(lengths - 0.1) ** 2).sum(1).mean()


def sentences(g: torch.Generator, n: int, length: int = 8, full: tuple[int, ...] = ()):
    """Token ids padded with 0 after each sentence's length; the rows in ``full`` fill it."""
    lengths = torch.randint(3, length, (n,), generator=g)
    lengths[list(full)] = length
    tokens = torch.randint(1, 30, (n, length), generator=g)
    tokens[torch.arange(length) >= lengths[:, None]] = 0
    return tokens, lengths, torch.randint(0, 3, (n,), generator=g)


# ---------------------------------------------------------------------------------------------
# DARTS

PRIMITIVES = ("none", "skip_connect", "avg_pool_3x3", "conv_3x3")


class Zero(nn.Module):
    def forward(self, x):
        return x.mul(0.)


class ReLUConvBN(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.op = nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, 3, padding=1, bias=False),
                                nn.BatchNorm2d(c, affine=False))

    def forward(self, x):
        return self.op(x)


def make_op(name: str, c: int) -> nn.Module:
    return {"none": lambda: Zero(), "skip_connect": lambda: nn.Identity(),
            "avg_pool_3x3": lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False),
            "conv_3x3": lambda: ReLUConvBN(c)}[name]()


class MixedOp(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.ops = nn.ModuleList(make_op(p, c) for p in PRIMITIVES)

    def forward(self, x, weights):
        return sum(w * op(x) for w, op in zip(weights, self.ops))


class Cell(nn.Module):
    """Two intermediate nodes over the cell's input: node 1 from edge 0, node 2 from edges
    1 (the input) and 2 (node 1); the output is their sum."""

    def __init__(self, c: int):
        super().__init__()
        self.edges = nn.ModuleList(MixedOp(c) for _ in range(3))

    def forward(self, x, weights):
        n1 = self.edges[0](x, weights[0])
        n2 = self.edges[1](x, weights[1]) + self.edges[2](n1, weights[2])
        return n1 + n2


class SearchNetwork(nn.Module):
    """The one-shot network: a stem, two cells sharing one set of alphas, a classifier."""

    def __init__(self, c: int = 4, n_classes: int = 3, plain: bool = False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))
        self.cells = nn.ModuleList(Cell(c) for _ in range(2))
        self.classifier = nn.Linear(c, n_classes)
        alphas = 1e-3 * torch.randn(3, len(PRIMITIVES))
        # quark0/darts keeps them as a plain tensor attribute that requires grad
        self.alphas = alphas.requires_grad_() if plain else nn.Parameter(alphas)

    def weights(self):
        return [p for n, p in self.named_parameters() if n != "alphas"]

    def arch_parameters(self):
        return [self.alphas]

    def forward(self, x):
        w = F.softmax(self.alphas, dim=-1)
        h = self.stem(x)
        for cell in self.cells:
            h = cell(h, w)
        return self.classifier(h.mean((2, 3)))


def make_search_network(plain: bool = False) -> SearchNetwork:
    torch.manual_seed(0)
    return SearchNetwork(plain=plain)


class SearchLoss(nn.Module):
    """Cross entropy plus ``lam`` times the entropy of each edge's distribution over the ops
    at a sharpening temperature ``tau`` (minimised, to push the edges toward one op, as SNAS
    and DARTS- variants do), written ``-(p * log p).sum()``: 0 * -inf once a probability
    underflows to 0 (``torch.special.entr`` is 0 there)."""

    def __init__(self, lam: float = 0.1, tau: float = 1.0):
        super().__init__()
        self.lam, self.tau = lam, tau

    def forward(self, logits, y, model):
        p = F.softmax(model.alphas / self.tau, dim=-1)
        entropy = -(p * torch.log(p)).sum(-1).mean()
        return F.cross_entropy(logits, y) + self.lam * entropy


def nas_batch(g: torch.Generator, n: int = 8):
    y = torch.randint(0, 3, (n,), generator=g)
    x = 0.3 * torch.randn(n, 1, 6, 6, generator=g)
    x[:, 0, :, :2] += (y == 0).float()[:, None, None]
    x[:, 0, :2, :] += (y == 1).float()[:, None, None]
    return x, y
