"""A small decoder-only LM with the stability tricks of LLM pretraining, written as nanoGPT,
OLMo, Gemma and PaLM write them, for ``test_llm_stability``.

- ``GPT``: tied input/output embeddings, RMSNorm pre-norm blocks, RoPE (a configurable base
  and position interpolation) or ALiBi slopes, optional QK-layernorm, attention scale
  ``1/sqrt(d)`` or muP's ``1/d``, a muP output multiplier, Gemma's final-logit soft-cap
  ``cap * tanh(logits / cap)``.
- Packed sequences: ``forward(tokens, doc_ids)`` builds the block-diagonal causal mask of the
  documents packed in each row (``doc_ids == -1`` is padding, masked as a key) and fills the
  masked scores with ``-inf`` before the softmax.
- ``lm_loss``: next-token cross-entropy (``ignore_index=-100`` on padding) plus PaLM's z-loss
  ``1e-4 * logsumexp(logits)^2``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 16


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq: int, base: float, interp: float = 1.0):
    """cos/sin of RoPE's angles; ``interp`` < 1 is position interpolation (long context)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    pos = torch.arange(seq).float() * interp
    angles = torch.outer(pos, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def alibi_slopes(n_heads: int):
    """Press et al.'s geometric slopes, ``2 ** (-8 / n)`` to the power of each head."""
    start = 2 ** (-8 / n_heads)
    return torch.tensor([start ** (i + 1) for i in range(n_heads)])


def packed_mask(doc_ids, self_attend: bool = True):
    """(B, 1, T, T) True where query t may attend key s: same document, s <= t, s not padding.
    ``self_attend``: every position also attends itself, so a padding query keeps one key."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    real_key = (doc_ids >= 0)[:, None, :]
    mask = causal & same & real_key
    if self_attend:
        mask = mask | torch.eye(T, dtype=torch.bool, device=doc_ids.device)
    return mask[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.heads = cfg["heads"]
        self.head_dim = cfg["width"] // cfg["heads"]
        self.qkv = nn.Linear(cfg["width"], 3 * cfg["width"], bias=False)
        self.proj = nn.Linear(cfg["width"], cfg["width"], bias=False)
        self.q_norm = RMSNorm(self.head_dim) if cfg["qk_norm"] else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim) if cfg["qk_norm"] else nn.Identity()
        if cfg["alibi"]:
            self.register_buffer("slopes", alibi_slopes(self.heads), persistent=False)
        else:
            cos, sin = rope_tables(self.head_dim, SEQ, cfg["rope_base"], cfg["rope_interp"])
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        if not self.cfg["alibi"]:
            q, k = apply_rope(q, self.cos[:T], self.sin[:T]), apply_rope(k, self.cos[:T], self.sin[:T])
        scale = 1.0 / self.head_dim if self.cfg["mup_attn"] else 1.0 / math.sqrt(self.head_dim)
        scores = (q @ k.transpose(-2, -1)) * scale
        if self.cfg["alibi"]:
            pos = torch.arange(T, device=x.device)
            scores = scores - self.slopes[:, None, None] * (pos[:, None] - pos[None, :]).abs()
        scores = scores.masked_fill(~mask, float("-inf"))
        att = F.softmax(scores, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(cfg["width"]), RMSNorm(cfg["width"])
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg["width"], 4 * cfg["width"]), nn.GELU(),
                                 nn.Linear(4 * cfg["width"], cfg["width"]))

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, **overrides):
        super().__init__()
        cfg = dict(width=WIDTH, heads=HEADS, layers=LAYERS, qk_norm=True, mup_attn=False,
                   alibi=False, rope_base=10000.0, rope_interp=1.0, output_mult=1.0,
                   softcap=30.0, self_attend=True)
        cfg.update(overrides)
        self.cfg = cfg
        self.wte = nn.Embedding(VOCAB, cfg["width"])
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg["layers"]))
        self.ln_f = RMSNorm(cfg["width"])
        self.lm_head = nn.Linear(cfg["width"], VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, tokens, doc_ids):
        mask = packed_mask(doc_ids, self.cfg["self_attend"])
        x = self.wte(tokens)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.lm_head(self.ln_f(x)) * self.cfg["output_mult"]
        cap = self.cfg["softcap"]
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)  # Gemma 2's final_logit_softcapping
        return logits


def lm_loss(logits, targets, z_weight: float = 1e-4):
    """Cross-entropy over the non-padding targets plus PaLM's z-loss on the same positions."""
    flat = logits.reshape(-1, logits.shape[-1])
    ce = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100)
    valid = targets.reshape(-1) != -100
    z = torch.logsumexp(flat[valid], dim=-1)
    return ce + z_weight * z.pow(2).mean()


def make_gpt():
    torch.manual_seed(0)
    return GPT()


def make_softcap_zero():
    """A config that leaves ``final_logit_softcapping`` at 0.0 meaning "off", read as a cap."""
    torch.manual_seed(0)
    return GPT(softcap=0.0)


def make_key_padding_mask():
    """The padding keys masked as in a Hugging Face ``attention_mask``, without the diagonal:
    a padding query (a row of the last, short pack) has no key left."""
    torch.manual_seed(0)
    return GPT(self_attend=False)


def make_rope_theta_unset():
    """``rope_theta`` read from a config that lacks it with a default of 0: ``1 / 0 ** (i/d)``
    is inf past the first frequency, so cos/sin of the angles are NaN from construction."""
    torch.manual_seed(0)
    return GPT(rope_base=0.0)


def make_no_qknorm_grown():
    """No QK-layernorm, resumed where the first block's pre-attention RMSNorm gain has grown
    to 300 (attention logit growth, Dehghani et al. 2023): q @ k^T passes 65504 in fp16."""
    torch.manual_seed(0)
    model = GPT(qk_norm=False)
    with torch.no_grad():
        model.blocks[0].ln1.weight.fill_(300.0)
    return model


def make_alibi():
    torch.manual_seed(0)
    return GPT(alibi=True)


def make_mup_fp16():
    """muP's output multiplier set to the width ratio instead of its inverse, no soft-cap: the
    logits grow to hundreds and the z-loss squares their logsumexp in fp16."""
    torch.manual_seed(0)
    return GPT(output_mult=4096.0, softcap=None)


def packed_batch(g: torch.Generator, batch: int = 4, short_row: int | None = None,
                 all_padding: bool = False):
    """Rows of 3 documents packed end to end over the whole context. ``short_row``: that row
    is the epoch's last pack, one document and padding after it (doc id -1, target -100)."""
    tokens = torch.randint(1, VOCAB, (batch, SEQ + 1), generator=g)
    doc_ids = torch.full((batch, SEQ + 1), -1)
    for b in range(batch):
        cuts = sorted(torch.randint(2, SEQ - 2, (2,), generator=g).tolist())
        if b == short_row:
            doc_ids[b, :cuts[0]] = 0
            tokens[b, cuts[0]:] = 0
            continue
        doc_ids[b, :cuts[0]], doc_ids[b, cuts[0]:cuts[1]] = 0, 1
        doc_ids[b, cuts[1]:] = 2
    if all_padding:  # (an accumulation step's last micro-batch past the epoch's end)
        tokens[:], doc_ids[:] = 0, -1
    targets = tokens[:, 1:].clone()
    # no target across a document boundary, none from or into padding
    targets[(doc_ids[:, 1:] != doc_ids[:, :-1]) | (doc_ids[:, 1:] < 0)] = -100
    return tokens[:, :-1], doc_ids[:, :-1], targets
