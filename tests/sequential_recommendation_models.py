"""Sequential recommenders written as SASRec, BERT4Rec, gSASRec and RecBole write them, for
``test_sequential_recommendation``.

- ``SASRec``: item embeddings with ``padding_idx=0`` over left-padded sequences, learned
  positions scaled by ``sqrt(d)``, ``nn.MultiheadAttention`` blocks under a causal mask, the
  timeline mask zeroing padded positions after each block (pmixer's SASRec.pytorch); the last
  position's state scores candidate items by a dot product with their embeddings.
- ``BERT4Rec``: bidirectional blocks with hand-written attention, the padding mask filled with
  ``-inf`` before the softmax, trained with the cloze objective (a ``[MASK]`` item id).
- losses: sampled softmax with the logQ correction from the training set's popularity counts
  (``LogQLoss``), BPR (``BPRLoss``), gSASRec's gBCE (``GBCELoss``), and in-batch negatives with the accidental
  positives masked to ``-inf`` (``InBatchSoftmax``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

N_ITEMS, MAX_LEN, D = 60, 8, 16
MASK_ID = N_ITEMS + 1  # BERT4Rec's [MASK] token, after the items 1..N_ITEMS


class SASRecBlock(nn.Module):
    def __init__(self, d: int, heads: int = 2, dropout: float = 0.1, key_padding: bool = False):
        super().__init__()
        self.key_padding = key_padding
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Dropout(dropout), nn.Linear(d, d))

    def forward(self, x, causal, timeline):
        q = self.ln1(x)
        # the bug (key_padding): a left-padded position sees only padded keys under the causal
        # mask, its whole row masked
        pad = (timeline.squeeze(-1) == 0) if self.key_padding else None
        a, _ = self.attn(q, x, x, attn_mask=causal, key_padding_mask=pad)
        x = q + a
        x = x + self.ffn(self.ln2(x))
        return x * timeline


class SASRec(nn.Module):
    def __init__(self, n_items: int = N_ITEMS, d: int = D, max_len: int = MAX_LEN,
                 blocks: int = 2, key_padding: bool = False):
        super().__init__()
        self.item_emb = nn.Embedding(n_items + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, d)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(SASRecBlock(d, key_padding=key_padding) for _ in range(blocks))
        self.last_ln = nn.LayerNorm(d)

    def forward(self, seq, candidates):
        """seq (B, L) left-padded with 0; candidates (B, C) item ids: the scores (B, C)."""
        length = seq.shape[1]
        x = self.item_emb(seq) * math.sqrt(self.item_emb.embedding_dim)
        x = self.drop(x + self.pos_emb.weight[:length])
        timeline = (seq != 0).unsqueeze(-1).to(x.dtype)
        x = x * timeline
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=seq.device), 1)
        for block in self.blocks:
            x = block(x, causal, timeline)
        state = self.last_ln(x)[:, -1]  # left padding: the last position is the latest item
        return (self.item_emb(candidates) * state.unsqueeze(1)).sum(-1)


def make_sasrec() -> SASRec:
    torch.manual_seed(0)
    return SASRec()


def make_sasrec_key_padding() -> SASRec:
    """SASRec given the padding as ``key_padding_mask`` on top of the causal mask."""
    torch.manual_seed(0)
    return SASRec(key_padding=True)


def make_sasrec_item2vec() -> SASRec:
    """SASRec warm-started from item2vec vectors as they were saved: unnormalised, their norms
    grown with each item's frequency (the table is overwritten, as practitioners load one)."""
    model = make_sasrec()
    g = torch.Generator().manual_seed(3)
    vectors = torch.randn(N_ITEMS + 1, D, generator=g)
    vectors *= torch.linspace(1.0, 16.0, N_ITEMS + 1).unsqueeze(1)
    vectors[0] = 0.0
    with torch.no_grad():
        model.item_emb.weight.copy_(vectors)
    return model


class BERT4RecAttention(nn.Module):
    def __init__(self, d: int, heads: int = 2, fill: float = float("-inf")):
        super().__init__()
        self.heads, self.dk, self.fill = heads, d // heads, fill
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, pad):  # pad (B, L): True at padding
        b, length, d = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, self.dk).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.dk)
        scores = scores.masked_fill(pad[:, None, None, :], self.fill)
        attn = torch.softmax(scores, dim=-1)
        return self.out((attn @ v).transpose(1, 2).reshape(b, length, d))


class BERT4RecBlock(nn.Module):
    def __init__(self, d: int, fill: float):
        super().__init__()
        self.attn = BERT4RecAttention(d, fill=fill)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, pad):
        x = self.ln1(x + self.attn(x, pad))
        return self.ln2(x + self.ffn(x))


class BERT4Rec(nn.Module):
    def __init__(self, n_items: int = N_ITEMS, d: int = D, max_len: int = MAX_LEN,
                 fill: float = float("-inf")):
        super().__init__()
        self.item_emb = nn.Embedding(n_items + 2, d, padding_idx=0)  # + [MASK]
        self.pos_emb = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(BERT4RecBlock(d, fill) for _ in range(2))
        self.head = nn.Linear(d, n_items + 2)

    def forward(self, seq):
        pad = seq == 0
        x = self.item_emb(seq) + self.pos_emb.weight[:seq.shape[1]]
        for block in self.blocks:
            x = block(x, pad)
        return self.head(x)  # (B, L, items): the full softmax over the catalogue


def make_bert4rec() -> BERT4Rec:
    torch.manual_seed(0)
    return BERT4Rec()


def make_bert4rec_finite_fill() -> BERT4Rec:
    """RecBole's mask: a large finite negative number, -10000, for padded keys."""
    torch.manual_seed(0)
    return BERT4Rec(fill=-10000.0)


class LogQLoss(nn.Module):
    """Sampled softmax over [positive, negatives] with the logQ correction: each logit minus the
    log of its item's sampling probability, estimated from the training set's counts."""

    def __init__(self, counts: torch.Tensor):
        super().__init__()
        self.register_buffer("counts", counts.float())

    def forward(self, scores, candidates):  # the positive in column 0
        q = self.counts[candidates] / self.counts.sum()
        logits = scores - torch.log(q)  # the bug: an item the training set never saw has q = 0
        return F.cross_entropy(logits, torch.zeros(len(scores), dtype=torch.long))


class BPRLoss(nn.Module):
    def __init__(self, stable: bool = False):
        super().__init__()
        self.stable = stable

    def forward(self, scores):  # scores (B, 2): positive, negative
        diff = scores[:, 0] - scores[:, 1]
        if self.stable:
            return -F.logsigmoid(diff).mean()
        return -torch.log(torch.sigmoid(diff)).mean()  # the bug: sigmoid underflows to 0


class InBatchSoftmax(nn.Module):
    """Each user's positive against the other users' positives; an in-batch item equal to the
    user's own positive is an accidental positive, masked to -inf."""

    def forward(self, logits, positives):  # logits (B, B): user i against positive j
        same = positives.unsqueeze(1) == positives.unsqueeze(0)
        eye = torch.eye(len(positives), dtype=torch.bool)
        logits = logits.masked_fill(same & ~eye, float("-inf"))
        return F.cross_entropy(logits, torch.arange(len(positives)))


class GBCELoss(nn.Module):
    """gSASRec's gBCE: the positive's probability raised to beta, from the negative sampling
    rate alpha and the calibration t, over [positive, negatives]."""

    def __init__(self, negatives: int, n_items: int = N_ITEMS, t: float = 0.75,
                 stable: bool = False):
        super().__init__()
        alpha = negatives / (n_items - 1)
        self.beta = alpha * (t * (1 - 1 / alpha) + 1 / alpha)
        self.stable = stable

    def forward(self, scores):  # the positive in column 0
        pos, neg = scores[:, :1], scores[:, 1:]
        if self.stable:  # gSASRec's own code: float64, the probabilities kept off 0 and 1
            eps, top = 1e-10, torch.finfo(torch.float64).max
            pos_probs = torch.clamp(torch.sigmoid(pos.double()), eps, 1 - eps)
            adjusted = torch.clamp(pos_probs.pow(-self.beta), 1 + eps, top)
            pos_logits = torch.clamp(1.0 / (adjusted - 1), eps, top).log().to(neg.dtype)
        else:
            pos_probs = torch.sigmoid(pos)
            pos_logits = torch.log(1.0 / (pos_probs.pow(-self.beta) - 1))  # the bug: sigmoid 1
        logits = torch.cat([pos_logits, neg], 1)
        labels = torch.zeros_like(logits)
        labels[:, 0] = 1.0
        return F.binary_cross_entropy_with_logits(logits, labels)
