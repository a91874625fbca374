"""Item response theory models written as py-irt, VIBO (Wu et al.) and girth-style neural
calibration code writes them, for ``test_item_response_theory``.

A response matrix ``y`` (students x items, 1 correct, 0 wrong; a polytomous model's categories
0..K-1) with a mask ``m`` of observed responses (missing ones are 0 in ``y``); batches are
students (their ids and their rows of ``y`` and ``m``), drawn by a ``DataLoader``.

- ``IRT``: the 2PL/3PL/4PL ``p = c + (d - c) * sigmoid(a * (theta - b))`` with the
  discrimination ``a = exp(log_a)`` and the guessing ``c = sigmoid(logit_c)``; abilities
  ``theta`` and the item parameters are embeddings / parameters; a loading matrix makes it the
  multidimensional IRT ``a . theta - b``.
- ``GRM``: Samejima's graded response model, the category probabilities the differences of
  the cumulative ``P(Y >= k) = sigmoid(a (theta - b_k))`` over the ordered thresholds.
- ``PCM``: Masters' partial credit model, items scored on different numbers of categories,
  the missing ones masked with ``-inf`` before the softmax.
- ``VIBO``: variational IRT: an encoder of a student's response row gives a Gaussian posterior
  over the ability (``mu``, ``logvar``), the reparameterised sample feeds the 2PL decoder and
  the loss adds the KL to the N(0, 1) prior.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

STUDENTS, ITEMS, DIMS, CATEGORIES = 48, 12, 2, 4


class IRT(nn.Module):
    def __init__(self, params: int = 2, dims: int = 1):
        super().__init__()
        self.params = params
        self.theta = nn.Embedding(STUDENTS, dims)
        nn.init.normal_(self.theta.weight, 0.0, 0.5)
        self.b = nn.Parameter(torch.randn(ITEMS) * 0.5)
        self.log_a = nn.Parameter(torch.randn(ITEMS, dims) * 0.1)  # the loadings, in log scale
        self.logit_c = nn.Parameter(torch.full((ITEMS,), -2.0))  # guessing near 0.12
        self.logit_d = nn.Parameter(torch.full((ITEMS,), 3.0))  # slipping near 0.05

    def forward(self, students):
        theta = self.theta(students)  # (B, dims)
        a = torch.exp(self.log_a)  # (I, dims): a positive discrimination
        logits = theta @ a.T - self.b * a.sum(1)  # a (theta - b), summed over the dimensions
        p = torch.sigmoid(logits)
        if self.params >= 3:
            c = torch.sigmoid(self.logit_c)
            d = torch.sigmoid(self.logit_d) if self.params == 4 else torch.ones_like(c)
            p = c + (d - c) * p
        return p


def make_2pl() -> IRT:
    torch.manual_seed(0)
    return IRT(2)


def make_3pl() -> IRT:
    torch.manual_seed(0)
    return IRT(3)


def make_4pl() -> IRT:
    torch.manual_seed(0)
    return IRT(4)


def make_mirt() -> IRT:
    torch.manual_seed(0)
    return IRT(2, dims=DIMS)


class GRM(nn.Module):
    """Samejima's graded response model with the thresholds as free parameters (the bug
    ``make_grm_ordered`` avoids: nothing keeps ``b_1 < b_2 < b_3``)."""

    def __init__(self, ordered: bool = False):
        super().__init__()
        self.ordered = ordered
        self.theta = nn.Embedding(STUDENTS, 1)
        nn.init.normal_(self.theta.weight, 0.0, 0.5)
        self.log_a = nn.Parameter(torch.zeros(ITEMS))
        steps = torch.linspace(-1.0, 1.0, CATEGORIES - 1).expand(ITEMS, -1).clone()
        self.thresholds = nn.Parameter(steps)  # (I, K - 1), or the first and log-gaps

    def cuts(self):
        if not self.ordered:
            return self.thresholds
        gaps = F.softplus(self.thresholds[:, 1:])
        return torch.cat([self.thresholds[:, :1], self.thresholds[:, :1] + gaps.cumsum(1)], 1)

    def forward(self, students):
        theta = self.theta(students)[:, :, None]  # (B, 1, 1)
        a = torch.exp(self.log_a)[None, :, None]
        above = torch.sigmoid(a * (theta - self.cuts()[None]))  # P(Y >= k), k = 1..K-1
        ones, zeros = torch.ones_like(above[..., :1]), torch.zeros_like(above[..., :1])
        cumulative = torch.cat([ones, above, zeros], -1)
        return cumulative[..., :-1] - cumulative[..., 1:]  # (B, I, K) category probabilities


def make_grm() -> GRM:
    torch.manual_seed(0)
    return GRM()


def make_grm_ordered() -> GRM:
    torch.manual_seed(0)
    return GRM(ordered=True)


class PCM(nn.Module):
    """Masters' partial credit model: category k's logit is the sum of ``a (theta - b_j)``
    over the steps j <= k; items scored on fewer categories have their missing ones at -inf
    before the softmax (a (ITEMS, K) mask of each item's valid categories)."""

    def __init__(self):
        super().__init__()
        self.theta = nn.Embedding(STUDENTS, 1)
        nn.init.normal_(self.theta.weight, 0.0, 0.5)
        self.log_a = nn.Parameter(torch.zeros(ITEMS))
        self.steps = nn.Parameter(torch.linspace(-1.0, 1.0, CATEGORIES - 1).repeat(ITEMS, 1))
        valid = torch.ones(ITEMS, CATEGORIES, dtype=torch.bool)
        valid[ITEMS // 2:, -1] = False  # the second half of the items is scored 0..2
        self.register_buffer("valid", valid)

    def forward(self, students):
        theta = self.theta(students)[:, :, None]  # (B, 1, 1)
        step_logits = torch.exp(self.log_a)[None, :, None] * (theta - self.steps[None])
        zero = torch.zeros_like(step_logits[..., :1])
        logits = torch.cat([zero, step_logits], -1).cumsum(-1)  # (B, I, K)
        return logits.masked_fill(~self.valid, float("-inf"))


def make_pcm() -> PCM:
    torch.manual_seed(0)
    return PCM()


def pcm_loss(logits, y, m):
    """The observed categories' NLL over the observed responses."""
    logp = torch.log_softmax(logits, -1).gather(-1, y.long().unsqueeze(-1)).squeeze(-1)
    return -(logp * m).sum() / m.sum()


class VIBO(nn.Module):
    """Wu et al.'s variational IRT: amortised Gaussian posteriors over the abilities."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(2 * ITEMS, hidden), nn.ELU())
        self.mu = nn.Linear(hidden, 1)
        self.logvar = nn.Linear(hidden, 1)
        self.b = nn.Parameter(torch.zeros(ITEMS))
        self.log_a = nn.Parameter(torch.zeros(ITEMS))

    def forward(self, responses, mask):
        h = self.encoder(torch.cat([responses, mask], 1))
        mu, logvar = self.mu(h), self.logvar(h)
        std = torch.exp(0.5 * logvar)
        theta = mu + std * torch.randn_like(std)
        p = torch.sigmoid(torch.exp(self.log_a) * (theta - self.b))
        return p, mu, std


def make_vibo() -> VIBO:
    torch.manual_seed(0)
    return VIBO()


def bce(p, y):
    """The Bernoulli negative log-likelihood written out, as IRT code does."""
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p))


def irt_loss(p, y, m):
    """Each student's mean NLL over the items they answered, averaged over the batch."""
    nll = bce(p, y) * m
    per_student = nll.sum(1) / m.sum(1)
    return per_student.mean()


def irt_loss_eps(p, y, m):
    """The guarded form: probabilities clamped off 0 and 1, the count floored at 1."""
    p = p.clamp(1e-6, 1 - 1e-6)
    per_student = (bce(p, y) * m).sum(1) / m.sum(1).clamp_min(1)
    return per_student.mean()


def grm_loss(probs, y, m):
    """The graded model's NLL of the observed category, over the observed responses."""
    picked = probs.gather(-1, y.long().unsqueeze(-1)).squeeze(-1)
    return -(torch.log(picked) * m).sum() / m.sum()


def vibo_loss(out, y, m):
    """The negative ELBO: the masked Bernoulli NLL plus KL(N(mu, std) || N(0, 1))."""
    p, mu, std = out
    nll = (bce(p, y) * m).sum(1)
    kl = -torch.log(std) + 0.5 * (std ** 2 + mu ** 2) - 0.5
    return (nll + kl.squeeze(1)).mean()


def responses(seed: int = 0, categories: int = 2):
    """A simulated response matrix from a 2PL (or graded) model, 20% of responses missing."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(STUDENTS, 1, generator=g)
    b = torch.randn(ITEMS, generator=g)
    logits = 1.2 * (theta - b)
    if categories == 2:
        y = torch.bernoulli(torch.sigmoid(logits), generator=g)
    else:
        cuts = torch.tensor([-1.0, 0.0, 1.0])
        y = (logits[..., None] + torch.randn(STUDENTS, ITEMS, 1, generator=g) > cuts).sum(-1)
        y = y.float()
    m = (torch.rand(STUDENTS, ITEMS, generator=g) > 0.2).float()
    if categories > 2:  # the second half of the items is scored 0..2
        y[:, ITEMS // 2:] = y[:, ITEMS // 2:].clamp(max=categories - 2)
    return y * m, m
