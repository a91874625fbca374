"""Models, losses, data and schedules of a custom Hugging Face Accelerate training loop
(``tests/test_accelerate_loop.py``): a token tagger over token ids and per-token sensor
features, with a hand-written exp attention layer, a masked token loss written as users write
it (a sum over the mask divided by its token count), padded batches from a ``DataLoader`` of
dicts, and a linear-warmup / inverse-sqrt schedule for ``LambdaLR``."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, FEATS, D, TAGS, T = 24, 3, 16, 5, 6


class ExpAttention(nn.Module):
    """Self-attention written out: exp of the scores, normalised by their row sum (no max
    subtracted), the padding masked out by a multiplicative key mask."""

    def __init__(self, d: int):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, h, mask):
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        w = torch.exp(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]))
        w = w * mask[:, None, :]
        w = w / (w.sum(-1, keepdim=True) + 1e-6)
        return h + self.out(w @ v)


class Tagger(nn.Module):
    """Token ids and their sensor features -> per-token tag logits."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D, padding_idx=0)
        self.feat_proj = nn.Linear(FEATS, D)
        self.attn = ExpAttention(D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, TAGS)

    def forward(self, input_ids, feats, attention_mask):
        h = self.embed(input_ids) + self.feat_proj(feats)
        h = self.attn(h, attention_mask.to(h.dtype))
        return self.head(self.norm(h))


class UnitTagger(Tagger):
    """The token embeddings scaled to unit length (a cosine embedding), padding left at 0 with
    ``torch.where``; its embedding table has no ``padding_idx``, so the pad id's row is a
    learned vector held at 0 by its zero initialisation."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        with torch.no_grad():
            self.embed.weight[0] = 0.0

    def forward(self, input_ids, feats, attention_mask):
        e = self.embed(input_ids)
        real = attention_mask[..., None] > 0
        e = torch.where(real, e / e.norm(dim=-1, keepdim=True), 0.0)
        h = e + self.feat_proj(feats)
        h = self.attn(h, attention_mask.to(h.dtype))
        return self.head(self.norm(h))


def make_unit_tagger() -> UnitTagger:
    torch.manual_seed(0)
    return UnitTagger()


def make_tagger() -> Tagger:
    torch.manual_seed(0)
    return Tagger()


class MaskedTokenLoss(nn.Module):
    """Cross-entropy per token, averaged over the real tokens of the batch."""

    def forward(self, logits, labels, attention_mask):
        per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                    reduction="none")
        m = attention_mask.flatten().float()
        return (per_token * m).sum() / m.sum()


class TaggingData(torch.utils.data.Dataset):
    """Sequences of 2..T tokens (0 pads), three features per token, a tag per token.
    ``nan``: records whose features hold a NaN (a sensor dropout); ``loud``: records whose
    features are 1000x (a sensor logged in the wrong unit); ``empty``: records with no token
    (an empty text, all padding)."""

    def __init__(self, n: int, nan=(), loud=(), empty=()):
        g = torch.Generator().manual_seed(1)
        self.lengths = torch.randint(2, T + 1, (n,), generator=g)
        self.ids = torch.randint(1, VOCAB, (n, T), generator=g)
        self.feats = torch.randn(n, T, FEATS, generator=g)
        self.tags = torch.randint(0, TAGS, (n, T), generator=g)
        for i in nan:
            self.feats[i, 1, 2] = float("nan")
        for i in loud:
            self.feats[i] *= 1000.0
        for i in empty:
            self.lengths[i] = 0

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        mask = (torch.arange(T) < self.lengths[i]).long()
        return {"input_ids": self.ids[i] * mask, "feats": self.feats[i] * mask[:, None],
                "attention_mask": mask, "labels": self.tags[i]}


def warmup_inverse_sqrt(warmup: int):
    """Linear warmup to the peak, then lr ~ 1 / sqrt(steps since warmup) — written with the
    off-by-one that makes the first step after warmup sqrt(warmup / 0) = inf (numpy floats
    divide by 0 without raising)."""
    def factor(s):
        if s < warmup:
            return (s + 1) / warmup
        return float(np.sqrt(np.float64(warmup) / np.float64(s - warmup)))
    return factor
