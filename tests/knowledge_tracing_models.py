"""Knowledge tracing models written as pykt, the DKT/SAKT/AKT papers' code and DKT-Forget
write them, for ``test_knowledge_tracing``.

Students' interaction sequences: question ids ``q`` (padded with 0; ids start at 1),
responses ``r`` (1 correct, 0 wrong, padded with -1 as pykt does), timestamps ``t`` (seconds)
and a mask ``m`` of real interactions. Each model predicts the response to question
``q[:, 1:]`` from the interactions before it; the loss is BCE with logits at the real next
positions only.

- ``DKT``: Piech et al.'s LSTM over one-hot-like interaction embeddings ``q + Q r``;
  ``make_dkt_forget`` adds DKT-Forget's repeated time-gap feature ``log1p(gap in minutes)``,
  ``make_dkt_retention`` an Ebbinghaus retention ``exp(-gap / S)`` with a learned strength.
- ``SAKT``: Pandey & Karypis's self-attentive KT, hand-written causal attention (queries the
  next questions, keys/values the past interactions) with a ``-inf`` mask.
- ``AKT``: Ghosh et al.'s monotonic attention: Rasch embeddings (a difficulty scalar times a
  variation vector), the exponential decay ``exp(-theta * distance)`` with ``theta`` through
  softplus, the distance from the cumulative attention (``cumsum``), ``-1e32`` masking and the
  first row zero-padded (the knowledge retriever excludes the current item).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

NUM_Q = 20


def interactions(q, r):
    """pykt's interaction id ``q + Q r`` (padding's -1 response as wrong; a partial credit
    as correct from one half)."""
    return q + NUM_Q * (r >= 0.5).long()


class DKT(nn.Module):
    def __init__(self, emb: int = 16, hidden: int = 32, gap_feature: str | None = None):
        super().__init__()
        self.interaction_emb = nn.Embedding(2 * NUM_Q + 1, emb, padding_idx=0)
        self.gap_feature = gap_feature
        self.log_strength = nn.Parameter(torch.zeros(()))  # the memory strength S, in hours
        self.lstm = nn.LSTM(emb + int(gap_feature is not None), hidden, batch_first=True)
        self.dropout = nn.Dropout(0.1)
        self.out = nn.Linear(hidden, NUM_Q + 1)

    def forward(self, q, r, t=None):
        x = self.interaction_emb(interactions(q, r))
        if self.gap_feature == "log":  # DKT-Forget: log of the minutes since the last one
            gap = (t[:, 1:] - t[:, :-1]) / 60.0
            gap = torch.log1p(torch.cat([torch.zeros_like(gap[:, :1]), gap], 1))
            x = torch.cat([x, gap.unsqueeze(-1)], -1)
        elif self.gap_feature == "retention":  # an Ebbinghaus curve exp(-gap / S), S learned
            gap = torch.cat([torch.zeros_like(t[:, :1]), t[:, 1:] - t[:, :-1]], 1) / 3600.0
            retention = torch.exp(-gap / F.softplus(self.log_strength))
            x = torch.cat([x, retention.unsqueeze(-1)], -1)
        h, _ = self.lstm(x)
        logits = self.out(self.dropout(h))[:, :-1]  # position i predicts interaction i + 1
        return logits.gather(-1, q[:, 1:].unsqueeze(-1)).squeeze(-1)


def make_dkt() -> DKT:
    torch.manual_seed(0)
    return DKT()


def make_dkt_forget() -> DKT:
    torch.manual_seed(0)
    return DKT(gap_feature="log")


def make_dkt_retention() -> DKT:
    torch.manual_seed(0)
    return DKT(gap_feature="retention")


class CausalAttention(nn.Module):
    """One head of SAKT's attention, hand-written; ``strict``: the query at i sees the
    interactions before i only (the bug: SAKT's query i is already the next question, so
    interaction i is past and row 0 is left with nothing)."""

    def __init__(self, d: int, strict: bool):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.strict = strict

    def forward(self, query, key):
        L = query.shape[1]
        future = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=0 if self.strict else 1)
        scores = self.q(query) @ self.k(key).transpose(1, 2) / math.sqrt(query.shape[-1])
        scores = scores.masked_fill(future, float("-inf"))
        return torch.softmax(scores, -1) @ self.v(key)


class SAKT(nn.Module):
    def __init__(self, d: int = 32, max_len: int = 12, strict: bool = False):
        super().__init__()
        self.interaction_emb = nn.Embedding(2 * NUM_Q + 1, d)
        self.question_emb = nn.Embedding(NUM_Q + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, d)
        self.attn = CausalAttention(d, strict)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Dropout(0.1), nn.Linear(d, d))
        self.pred = nn.Linear(d, 1)

    def forward(self, q, r):
        x = self.interaction_emb(interactions(q, r))[:, :-1]
        x = x + self.pos_emb(torch.arange(x.shape[1]))
        e = self.question_emb(q[:, 1:])
        h = self.norm1(e + self.attn(e, x))
        h = self.norm2(h + self.ffn(h))
        return self.pred(h).squeeze(-1)


def make_sakt() -> SAKT:
    torch.manual_seed(0)
    return SAKT()


def make_sakt_strict() -> SAKT:
    torch.manual_seed(0)
    return SAKT(strict=True)


class MonotonicAttention(nn.Module):
    """AKT's attention with the context-aware distance decay, as its reference code."""

    def __init__(self, d: int, zero_pad: bool, fill: float = -1e32,
                 learn_distance: bool = False):
        super().__init__()
        self.q, self.v = nn.Linear(d, d), nn.Linear(d, d)  # kq_same: keys share the query map
        self.fill, self.learn_distance = fill, learn_distance
        self.gamma = nn.Parameter(torch.zeros(1))
        nn.init.xavier_uniform_(self.gamma[None])
        self.zero_pad = zero_pad

    @staticmethod
    def distance(scores, mask):
        """AKT's context-aware distance: the attention mass between two items times how far
        apart they are, square-rooted."""
        L = scores.shape[-1]
        s = F.softmax(scores.masked_fill(mask == 0, -1e32), -1) * mask.float()
        distcum = torch.cumsum(s, -1)
        total = s.sum(-1, keepdim=True)
        pos = torch.arange(L)
        position_effect = (pos[None, :] - pos[:, None]).abs().float()[None]
        return torch.clamp((total - distcum) * position_effect, min=0.0).sqrt()

    def forward(self, query, key, values, mask):
        d = query.shape[-1]
        qh, kh, vh = self.q(query), self.q(key), self.v(values)
        scores = qh @ kh.transpose(1, 2) / math.sqrt(d)
        if self.learn_distance:  # the bug: the distance's sqrt is differentiated at 0
            dist = self.distance(scores, mask)
        else:
            with torch.no_grad():
                dist = self.distance(scores, mask).detach()
        theta = -F.softplus(self.gamma)
        total_effect = torch.clamp((dist * theta).exp(), min=1e-5, max=1e5)
        scores = (scores * total_effect).masked_fill(mask == 0, self.fill)
        attn = F.softmax(scores, -1)
        if self.zero_pad:  # the first row saw nothing: zero it, as AKT does
            attn = torch.cat([torch.zeros_like(attn[:, :1]), attn[:, 1:]], 1)
        return attn @ vh


class AKT(nn.Module):
    def __init__(self, d: int = 32, num_c: int = 5, fill: float = -1e32,
                 learn_distance: bool = False):
        super().__init__()
        self.c_emb = nn.Embedding(num_c + 1, d)
        self.cr_emb = nn.Embedding(2 * num_c + 2, d)
        self.difficult = nn.Embedding(NUM_Q + 1, 1)  # Rasch: mu_q
        self.c_var = nn.Embedding(num_c + 1, d)  # d_c
        self.cr_var = nn.Embedding(2 * num_c + 2, d)
        nn.init.constant_(self.difficult.weight, 0.0)
        self.num_c = num_c
        self.encoder = MonotonicAttention(d, zero_pad=False, learn_distance=learn_distance)
        self.retriever = MonotonicAttention(d, zero_pad=True, fill=fill)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Sequential(nn.Linear(2 * d, d), nn.ReLU(), nn.Dropout(0.1), nn.Linear(d, 1))

    def forward(self, q, c, r):
        target = (r >= 0.5).long()
        mu = self.difficult(q)
        ce = self.c_emb(c) + mu * self.c_var(c)
        cre = self.cr_emb(c + self.num_c * target) + mu * (
            self.cr_var(c + self.num_c * target) + self.c_var(c))
        L = q.shape[1]
        causal = torch.tril(torch.ones(L, L), 0)[None]  # the encoder sees its own item
        past = torch.tril(torch.ones(L, L), -1)[None]  # the retriever excludes it
        y = self.norm(cre + self.encoder(cre, cre, cre, causal))
        h = self.retriever(ce, ce, y, past)
        return self.out(torch.cat([h, ce], -1)).squeeze(-1)[:, 1:]


def make_akt() -> AKT:
    torch.manual_seed(0)
    return AKT()


def make_akt_learned_distance() -> AKT:
    """AKT with its distance computed outside ``no_grad`` (to learn through it)."""
    torch.manual_seed(0)
    return AKT(learn_distance=True)


def make_akt_inf() -> AKT:
    """AKT with the retriever's ``-1e32`` turned into ``-inf``: its first row's softmax is
    NaN, which the zero padding then replaces (and masked_fill's backward zeroes)."""
    torch.manual_seed(0)
    return AKT(fill=float("-inf"))


def next_response_loss(logits, r, m):
    """BCE with logits at the real next positions, averaged per student first (each student
    counts once, however long their sequence), then over the batch."""
    target, valid = r[:, 1:].clamp_min(0).float(), m[:, 1:].float()
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    per_student = (bce * valid).sum(1) / valid.sum(1)  # the bug: 0/0 for a single interaction
    return per_student.mean()


def next_response_loss_eps(logits, r, m):
    target, valid = r[:, 1:].clamp_min(0).float(), m[:, 1:].float()
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    return ((bce * valid).sum(1) / valid.sum(1).clamp_min(1)).mean()


def student_batch(g: torch.Generator, n: int = 8, length: int = 12, short: int | None = None,
                  clock: int | None = None, ungraded: int | None = None):
    """Padded sequences of 4..length interactions; ``short``: that student answered one
    question only; ``clock``: that student's log has one timestamp recorded in milliseconds
    among seconds (a device with a different clock), so a later gap is negative;
    ``ungraded``: responses are partial credits, points / max points, and that student's
    fourth answer was to an open question nobody graded (0 of 0 points)."""
    lengths = torch.randint(4, length + 1, (n,), generator=g)
    if short is not None:
        lengths[short] = 1
    if clock is not None:
        lengths[clock] = length
    m = torch.arange(length)[None] < lengths[:, None]
    q = torch.randint(1, NUM_Q + 1, (n, length), generator=g) * m
    c = (q - 1) % 5 + 1
    r = torch.where(m, torch.randint(0, 2, (n, length), generator=g), -1)
    gaps = torch.randint(30, 3600, (n, length), generator=g).float()
    t = 1.7e6 + gaps.cumsum(1)  # seconds since the course opened (padding keeps counting)
    if clock is not None:
        t[clock, 3] *= 1000.0
    if ungraded is not None:
        points, most = r.float(), torch.ones(n, length)
        points[ungraded, 3] = most[ungraded, 3] = 0.0
        r = torch.where(m, points / most, -1.0)
    return q, c * m, r, t, m


def selected_loss(logits, r, m):
    """pykt's loss: BCE with logits over the real next positions picked by the mask."""
    sm = m[:, 1:]
    return F.binary_cross_entropy_with_logits(logits[sm], r[:, 1:][sm].float())


class SAKTLeftPadded(nn.Module):
    """SAKT as arshadshk/SAKT-pytorch writes it: sequences padded at the front,
    ``nn.MultiheadAttention`` given the causal mask and, added later, a key padding mask of the
    padded interactions (the bug: a padded query then has no key left)."""

    def __init__(self, d: int = 32, max_len: int = 12, heads: int = 2):
        super().__init__()
        self.interaction_emb = nn.Embedding(2 * NUM_Q + 1, d)
        self.question_emb = nn.Embedding(NUM_Q + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Dropout(0.1), nn.Linear(d, d))
        self.pred = nn.Linear(d, 1)

    def forward(self, q, r, m):
        x = self.interaction_emb(interactions(q, r))[:, :-1]
        x = x + self.pos_emb(torch.arange(x.shape[1]))
        e = self.question_emb(q[:, 1:])
        L = x.shape[1]
        future = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
        h, _ = self.attn(e, x, x, attn_mask=future, key_padding_mask=~m[:, :-1])
        h = self.norm1(e + h)
        h = self.norm2(h + self.ffn(h))
        return self.pred(h).squeeze(-1)


def make_sakt_left() -> SAKTLeftPadded:
    torch.manual_seed(0)
    return SAKTLeftPadded()


def left_padded(q, c, r, t, m):
    """The batch with each student's interactions moved to the end of the row."""
    shift = (m.shape[1] - m.sum(1)).tolist()
    rows = [[torch.roll(x[i], s) for i, s in enumerate(shift)] for x in (q, c, r, t, m)]
    return tuple(torch.stack(x) for x in rows)


class StudentLogs(torch.utils.data.Dataset):
    """Each student's own sequence of (question, response), of its own length; ``short``:
    that student answered one question only."""

    def __init__(self, n: int = 32, seed: int = 0, short: int | None = None):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, 13, (n,), generator=g)
        if short is not None:
            lengths[short] = 1
        self.logs = [(torch.randint(1, NUM_Q + 1, (int(k),), generator=g),
                      torch.randint(0, 2, (int(k),), generator=g)) for k in lengths]

    def __len__(self):
        return len(self.logs)

    def __getitem__(self, i):
        return self.logs[i]


def collate(batch):
    """pykt-style padding: questions with 0, responses with -1, the mask of real ones."""
    q = nn.utils.rnn.pad_sequence([b[0] for b in batch], batch_first=True, padding_value=0)
    r = nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=-1)
    return q, r, r >= 0
