"""Differentiable dynamic programming and sorting as their public repositories write them, for
``test_differentiable_dp.py``:

- a span-based constituency parser with a tree CRF (supar's ``CRFConstituency`` / torch-struct's
  ``LogSemiring``): endpoint-difference span scores of a BiLSTM, the inside algorithm in log
  space over a chart, trained on partial brackets (Pereira & Schabes) as
  ``logZ(all trees) - logZ(trees agreeing with the brackets)``;
- a Gumbel-Sinkhorn permutation learner (Mena et al., google/gumbel_sinkhorn's sorting task),
  its Sinkhorn normalisation written in probability space (``exp(log_alpha / tau)`` divided
  by its row and column sums) instead of ``sinkhorn_ops.py``'s log space;
- an L2X-style feature selector (Chen et al.) with Xie & Ermon's relaxed subset sampling
  ("soft top-k": ``k`` successive softmaxes, each taking ``log(1 - onehot)`` of the last);
- NeuralSort (Grover et al., ermongroup/neuralsort): the relaxed sort matrix
  ``softmax(((n + 1 - 2i) s - A_s 1) / tau)`` of a scorer's outputs, trained with a
  temperature schedule.

The factories live at module level so that ``nanreplay`` rebuilds them from the bundle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, WORDS = 40, 16, 6
NEG_INF = float("-inf")


# -- tree CRF (inside algorithm) -----------------------------------------------------------

class SpanParser(nn.Module):
    """supar-style span scorer: BiLSTM states at the fenceposts, span (i, j) scored by an MLP
    of ``h[j] - h[i]`` (Stern et al.'s minimal span parser features)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.lstm = nn.LSTM(WIDTH, WIDTH // 2, batch_first=True, bidirectional=True)
        self.span = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))

    def forward(self, words):
        h, _ = self.lstm(self.embed(words))
        fence = F.pad(h, (0, 0, 1, 0))  # (B, n + 1, W): fencepost 0 before the first word
        diff = fence.unsqueeze(1) - fence.unsqueeze(2)  # [b, i, j] = h[j] - h[i]
        return self.span(diff).squeeze(-1)  # (B, n + 1, n + 1) span scores


def make_parser() -> nn.Module:
    torch.manual_seed(0)
    return SpanParser()


def inside(scores, lengths, safe: bool = False):
    """log Z of the binary trees over each sentence, the CKY chart in the log semiring:
    ``chart[i, j] = score[i, j] + logsumexp_k(chart[i, k] + chart[k, j])``. ``safe``: a cell no
    split can build is set to -inf outside the logsumexp (which is given zeros there), so
    its gradient is 0 instead of exp(-inf - -inf) = NaN."""
    B, n1, _ = scores.shape
    chart = {(i, i + 1): scores[:, i, i + 1] for i in range(n1 - 1)}
    for w in range(2, n1):
        for i in range(n1 - w):
            j = i + w
            splits = torch.stack([chart[i, k] + chart[k, j] for k in range(i + 1, j)], -1)
            if safe:
                dead = torch.isneginf(splits.max(-1).values)
                lse = torch.logsumexp(splits.masked_fill(dead[:, None], 0.0), -1)
                lse = lse.masked_fill(dead, NEG_INF)
            else:
                lse = torch.logsumexp(splits, -1)
            chart[i, j] = scores[:, i, j] + lse
    return torch.stack([chart[0, int(n)][b] for b, n in enumerate(lengths)])


def crossing(brackets, n: int) -> torch.Tensor:
    """(n + 1, n + 1) True where span (i, j) crosses one of the gold brackets."""
    out = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    for a, b in brackets:
        for i in range(n + 1):
            for j in range(i + 1, n + 1):
                out[i, j] |= (i < a < j < b) or (a < i < b < j)
    return out


class PartialBracketLoss(nn.Module):
    """-log P(trees agreeing with the brackets) = logZ - logZ(spans crossing one masked)."""

    def __init__(self, safe: bool = False):
        super().__init__()
        self.safe = safe

    def forward(self, scores, lengths, cross):
        allowed = scores.masked_fill(cross, NEG_INF)
        return (inside(scores, lengths, self.safe)
                - inside(allowed, lengths, self.safe)).mean()


def parse_batch(g: torch.Generator, brackets: list[list[tuple[int, int]]]):
    """Sentences of WORDS words (the last two of sentence 1 padding: a shorter one), their
    lengths and the spans crossing each sentence's partial brackets."""
    words = torch.randint(1, VOCAB, (len(brackets), WORDS), generator=g)
    lengths = torch.full((len(brackets),), WORDS)
    lengths[1] = WORDS - 2
    words[1, WORDS - 2:] = 0
    cross = torch.stack([crossing(b, WORDS) for b in brackets])
    return words, lengths, cross


# -- Gumbel-Sinkhorn sorting ----------------------------------------------------------------

N_SORT = 5


class SinkhornSorter(nn.Module):
    """gumbel_sinkhorn's sorting network: each number to a row of N logits (log_alpha), made a
    doubly stochastic matrix at temperature ``tau`` (annealed by the loop)."""

    def __init__(self, iters: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, N_SORT))
        self.tau, self.iters = 1.0, iters

    def forward(self, x, valid=None):
        log_alpha = self.net(x.unsqueeze(-1))  # (B, N, N)
        if valid is not None:  # a padded list: no item goes to a padded slot
            log_alpha = log_alpha.masked_fill(~valid[:, None, :], float("-inf"))
        P = torch.exp(log_alpha / self.tau)
        for _ in range(self.iters):
            P = P / P.sum(2, keepdim=True)
            P = P / P.sum(1, keepdim=True)
        return P.transpose(1, 2) @ x.unsqueeze(-1)  # the numbers permuted into sorted order


def make_sorter() -> nn.Module:
    torch.manual_seed(0)
    return SinkhornSorter()


def sort_loss(pred, x):
    return F.mse_loss(pred.squeeze(-1), x.sort(-1).values)


def padded_sort_loss(pred, x, valid):
    """Over the valid slots only: padded values sort last (2 is above every value)."""
    target = x.masked_fill(~valid, 2.0).sort(-1).values
    return ((pred.squeeze(-1) - target) ** 2 * valid).sum() / valid.sum()


# -- L2X with relaxed subset sampling (soft top-k) ------------------------------------------

FEATURES, TOP_K = 10, 3


def continuous_topk(w, k: int, t: float, clamp: bool = False):
    """Xie & Ermon's relaxed k-hot: after each softmax, the chosen mass is removed from the
    logits by ``log(1 - onehot)``; their code clamps ``1 - onehot`` at 1e-20 first."""
    khot = torch.zeros_like(w)
    onehot = torch.zeros_like(w)
    for _ in range(k):
        mask = 1.0 - onehot
        if clamp:
            mask = mask.clamp(min=1e-20)
        w = w + torch.log(mask)
        onehot = F.softmax(w / t, dim=-1)
        khot = khot + onehot
    return khot


class L2X(nn.Module):
    """A selector scores the features, Gumbel noise and the soft top-k make a mask, and a
    predictor classifies the masked input."""

    def __init__(self, tau: float = 0.1, clamp: bool = False):
        super().__init__()
        self.selector = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(),
                                      nn.Linear(32, FEATURES))
        self.predictor = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 2))
        self.tau, self.clamp = tau, clamp

    def forward(self, x, gumbel):
        mask = continuous_topk(self.selector(x) + gumbel, TOP_K, self.tau, self.clamp)
        return self.predictor(x * mask)


def make_l2x() -> nn.Module:
    torch.manual_seed(0)
    return L2X()


def make_l2x_clamped() -> nn.Module:
    torch.manual_seed(0)
    return L2X(clamp=True)


# -- NeuralSort -------------------------------------------------------------------------------

N_LIST = 6


def neuralsort(s, tau):
    """ermongroup/neuralsort's ``util.neural_sort``: s is (B, n, 1) scores."""
    n = s.size(1)
    one = torch.ones((n, 1), dtype=s.dtype)
    A_s = torch.abs(s - s.permute(0, 2, 1))
    B = torch.matmul(A_s, torch.matmul(one, one.transpose(0, 1)))
    scaling = (n + 1 - 2 * (torch.arange(n, dtype=s.dtype) + 1))
    C = torch.matmul(s, scaling.unsqueeze(0))
    P_max = (C - B).permute(0, 2, 1)
    return F.softmax(P_max / tau, dim=-1)


class NeuralSortRanker(nn.Module):
    """A scorer of list items whose relaxed sort permutes the items' targets: trained so that
    the soft-sorted targets come out in descending order (the paper's quantile regression)."""

    def __init__(self):
        super().__init__()
        self.scorer = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.tau = 1.0

    def forward(self, items, targets):
        P_hat = neuralsort(self.scorer(items), self.tau)
        return (P_hat @ targets.unsqueeze(-1)).squeeze(-1)


def make_ranker() -> nn.Module:
    torch.manual_seed(0)
    return NeuralSortRanker()


def ranked_loss(sorted_targets, targets):
    return F.mse_loss(sorted_targets, targets.sort(-1, descending=True).values)


def unlikelihood_loss(logits, wrong):
    """Welleck et al.'s unlikelihood term: push the probability of the classes marked wrong
    to 0 with ``-log(1 - p)``; their code clamps ``1 - p`` at 1e-5 first."""
    p = F.softmax(logits, dim=-1)
    return -(torch.log(1 - p) * wrong).sum(-1).mean()


def unlikelihood_loss_clamped(logits, wrong):
    p = F.softmax(logits, dim=-1)
    return -(torch.log((1 - p).clamp(min=1e-5)) * wrong).sum(-1).mean()
