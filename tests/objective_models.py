"""Models and losses of training objectives outside vision and NLP, for ``test_objectives``.

The factories and losses live at module level so that ``nanreplay`` rebuilds them from the
bundle (``objective_models:make_hetero``, ``objective_models:GaussianNLL``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class HeteroMLP(nn.Module):
    """Tabular regression with a mean head and a variance head (softplus keeps it > 0)."""

    def __init__(self, d_in: int = 6, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.mean_head = nn.Linear(hidden, 1)
        self.var_head = nn.Linear(hidden, 1)

    def forward(self, x):
        h = self.body(x)
        return self.mean_head(h).squeeze(-1), F.softplus(self.var_head(h)).squeeze(-1)


def make_hetero() -> nn.Module:
    torch.manual_seed(0)
    return HeteroMLP()


class GaussianNLL(nn.Module):
    """``nn.GaussianNLLLoss`` on the model's ``(mean, var)`` pair."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.inner = nn.GaussianNLLLoss(eps=eps)

    def forward(self, out, y):
        mean, var = out
        return self.inner(mean, y, var)


def make_count_regressor() -> nn.Module:
    """Counts per hour regressed on the rate itself, with no positive activation on it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1), nn.Flatten(0))


def make_student() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 5))


class DistillLoss(nn.Module):
    """Hinton distillation against the teacher's log-probabilities (``log_target=True``)."""

    def __init__(self, temperature: float = 2.0):
        super().__init__()
        self.temperature = temperature
        self.kl = nn.KLDivLoss(reduction="batchmean", log_target=True)

    def forward(self, student_logits, teacher_logp):
        t = self.temperature
        return self.kl(F.log_softmax(student_logits / t, -1), teacher_logp) * t * t


class BagOfWords(nn.Module):
    """A recommender over bags of item ids: ``EmbeddingBag(mode="sum")`` weighted per id."""

    def __init__(self, vocab: int = 200, d: int = 16):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, d, mode="sum")
        self.head = nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids, offsets, weights):
        return self.head(self.emb(ids, offsets, per_sample_weights=weights)).squeeze(-1)


def make_bag_of_words() -> nn.Module:
    torch.manual_seed(0)
    return BagOfWords()


def make_unscaled_regressor() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Linear(16, 1), nn.Flatten(0))


class MatrixFactorisation(nn.Module):
    """Ratings as dot products of sparse user and item embeddings, plus a global bias."""

    def __init__(self, users: int = 50, items: int = 60, d: int = 8):
        super().__init__()
        self.user = nn.Embedding(users, d, sparse=True)
        self.item = nn.Embedding(items, d, sparse=True)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, users, items):
        return (self.user(users) * self.item(items)).sum(-1) + self.bias


def make_matrix_factorisation() -> nn.Module:
    torch.manual_seed(0)
    return MatrixFactorisation()


def make_click_model() -> nn.Module:
    """Click-through rate: the probability itself is the output (a final Sigmoid)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1), nn.Sigmoid(),
                         nn.Flatten(0))


def bce(p, y):
    """Binary cross entropy written out on probabilities."""
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


class LearnedTemperatureCE(nn.Module):
    """Cross-entropy over logits scaled by a learned temperature, trained by the model's
    optimizer (as CLIP's and SimCLR-style losses keep ``logit_scale``)."""

    def __init__(self):
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(()))

    def forward(self, logits, y):
        return nn.functional.cross_entropy(logits * self.log_scale.exp(), y)
