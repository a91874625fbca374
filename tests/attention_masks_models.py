"""A tiny decoder LM written the way current LLM code writes attention by hand (HF "eager"
path): RoPE, optional QK-norm (RMSNorm with a learned scale), grouped-query K/V heads, an
HF-style padding mask turned additive with ``torch.finfo(dtype).min`` and added to a causal
mask built the same way, and optional logit soft-capping. The factories of
``test_attention_masks.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, KV_HEADS, LENGTH, BATCH = 32, 16, 4, 2, 8, 6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, position_ids):
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = position_ids[:, None, :, None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


class Attention(nn.Module):
    def __init__(self, qk_norm_eps: float | None, softcap: float | None):
        super().__init__()
        self.hd = WIDTH // HEADS
        self.q = nn.Linear(WIDTH, HEADS * self.hd, bias=False)
        self.kv = nn.Linear(WIDTH, 2 * KV_HEADS * self.hd, bias=False)
        self.o = nn.Linear(WIDTH, WIDTH, bias=False)
        self.q_norm = RMSNorm(self.hd, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(self.hd, qk_norm_eps) if qk_norm_eps is not None else None
        self.softcap = softcap

    def forward(self, x, mask, position_ids):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, KV_HEADS, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, position_ids), rope(k, position_ids)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        s = q @ k.transpose(-1, -2) / self.hd ** 0.5
        if self.softcap is not None:
            s = self.softcap * torch.tanh(s / self.softcap)
        s = s + mask
        w = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o((w @ v).transpose(1, 2).reshape(b, t, -1))


class TinyLM(nn.Module):
    def __init__(self, qk_norm_eps=1e-6, softcap=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.attn = Attention(qk_norm_eps, softcap)
        self.norm = RMSNorm(WIDTH, 1e-6)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, mask, position_ids):
        h = self.embed(ids)
        h = h + self.attn(h, mask, position_ids)
        return self.head(self.norm(h))


def additive_mask(attention_mask, dtype=torch.float32):
    """HF's 4-d mask: causal and padding, each ``finfo.min`` where masked, added together."""
    t = attention_mask.shape[-1]
    neg = torch.finfo(dtype).min
    causal = torch.triu(torch.full((t, t), neg, dtype=dtype), diagonal=1)
    pad = (1.0 - attention_mask[:, None, None, :].to(dtype)) * neg
    return causal[None, None] + pad


def batch(g, pads):
    """Left-padded batch: row i has ``pads[i]`` pad tokens (id 0) first."""
    ids = torch.randint(1, VOCAB, (len(pads), LENGTH), generator=g)
    am = torch.ones(len(pads), LENGTH, dtype=torch.long)
    for i, p in enumerate(pads):
        ids[i, :p] = 0
        am[i, :p] = 0
    pos = (am.cumsum(-1) - 1).clamp_min(0)
    return ids, am, pos


def make_lm():
    torch.manual_seed(0)
    return TinyLM()


def make_lm_no_eps():
    torch.manual_seed(0)
    return TinyLM(qk_norm_eps=0.0)


def make_lm_softcap0():
    torch.manual_seed(0)
    return TinyLM(softcap=0.0)


def lm_loss(logits, ids, attention_mask):
    """Next-token cross-entropy over the kept tokens (pads labelled -100)."""
    labels = ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1),
                           ignore_index=-100)
