"""Models of tests/test_moe_probabilistic.py, written as research repos write them: a small
Mixtral-style decoder (RMSNorm, rotary embeddings, causal SDPA, a top-k mixture of SwiGLU
experts with token dropping and an aux loss, tied embeddings) and probabilistic forecasters
built on ``torch.distributions``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rope_cache(seq_len, dim, base, device):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device).float() / dim))
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, rope_base, ntk=1.0, max_pos=16):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_base = n_heads, dim // n_heads, rope_base
        self.ntk, self.max_pos = ntk, max_pos
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=-1))
        # dynamic NTK scaling of the base, meant for sequences beyond max_pos only: applied
        # to a shorter one it makes the base negative
        base = self.rope_base * (self.ntk * T / self.max_pos - (self.ntk - 1))
        cos, sin = rope_cache(T, self.head_dim, base, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Expert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routing, capacity-limited dispatch with ``index_add_``; the load-balancing loss
    kept in ``self.aux_loss``. With ``idle_mean`` its importance term averages each expert's
    router probability over the tokens sent to it: 0/0 for an expert that got none."""

    def __init__(self, dim, hidden, n_experts=4, top_k=2, capacity_factor=1.25,
                 idle_mean=False):
        super().__init__()
        self.idle_mean = idle_mean
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(n_experts))
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.aux_loss = None

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        logits = self.gate(flat)
        probs = logits.softmax(-1)
        topv, topi = probs.topk(self.top_k, dim=-1)
        topv = topv / topv.sum(-1, keepdim=True)
        capacity = int(self.capacity_factor * flat.shape[0] * self.top_k / self.n_experts)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = (topi == e).nonzero(as_tuple=True)
            tok, slot = tok[:capacity], slot[:capacity]
            if tok.numel():
                y = expert(flat[tok]) * topv[tok, slot].unsqueeze(-1)
                out.index_add_(0, tok, y.to(out.dtype))  # (bf16 experts under autocast)
        mask = F.one_hot(topi[:, 0], self.n_experts).float()
        if self.idle_mean:  # the bug: 0/0 for an idle expert
            importance = (probs * mask).sum(0) / mask.sum(0)
        else:
            importance = probs.mean(0)
        z_loss = torch.logsumexp(logits, -1).pow(2).mean()
        self.aux_loss = 0.01 * self.n_experts * (mask.mean(0) * importance).sum() + 1e-3 * z_loss
        return out.view(B, T, C)


class Block(nn.Module):
    def __init__(self, dim, n_heads, hidden, rope_base, n_experts, ntk, max_pos, idle_mean):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, n_heads, rope_base, ntk, max_pos)
        self.moe = MoE(dim, hidden, n_experts, idle_mean=idle_mean)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoELM(nn.Module):
    """Returns ``(logits, aux_loss)``: the aux losses of every layer, summed, for the loss;
    without ``aux_out`` the logits alone, and the loop adds ``model.aux_loss()`` itself."""

    def __init__(self, vocab=32, dim=16, n_layers=2, n_heads=2, hidden=24, rope_base=10000.0,
                 n_experts=4, ntk=1.0, max_pos=16, idle_mean=False, aux_out=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, hidden, rope_base, n_experts, ntk, max_pos,
                                          idle_mean)
                                    for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.aux_out = aux_out

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x))
        return (logits, self.aux_loss()) if self.aux_out else logits

    def aux_loss(self):
        return sum(b.moe.aux_loss for b in self.blocks)


def make_moe_lm(**kw):
    return MoELM(**kw)


def moe_lm_loss(out, targets):
    logits, aux = out
    return lm_loss(logits, targets) + aux


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class DeepAR(nn.Module):
    """A DeepAR-style forecaster: a GRU over the past values and a covariate, returning the
    next values' ``Normal(mu, softplus(s))``; the loss is its negative log-likelihood. With
    ``mean_scaling`` each series is divided by its mean absolute value, as DeepAR does, but
    without the paper's + 1: 0/0 for a series of zeros."""

    def __init__(self, hidden=16, validate=None, min_scale=0.0, mean_scaling=False):
        super().__init__()
        self.mean_scaling = mean_scaling
        self.rnn = nn.GRU(2, hidden, batch_first=True)
        self.mu = nn.Linear(hidden, 1)
        self.sigma = nn.Linear(hidden, 1)
        self.validate, self.min_scale = validate, min_scale

    def forward(self, past, covariate):
        v = past.abs().mean(-1, keepdim=True) if self.mean_scaling else 1.0
        h, _ = self.rnn(torch.stack([past / v, covariate], -1))
        scale = (F.softplus(self.sigma(h).squeeze(-1)) + self.min_scale) * v
        return torch.distributions.Normal(self.mu(h).squeeze(-1) * v, scale,
                                          validate_args=self.validate)


def make_deepar(**kw):
    return DeepAR(**kw)


def gaussian_nll(dist, y):
    return -dist.log_prob(y).mean()


def series(step, bad_at=None, B=8, T=12, zeros_at=None):
    """Noisy sines with a covariate; at step ``bad_at`` series 4's targets hold a 1e30 (a
    sensor's overflow value never filtered out), at step ``zeros_at`` series 5 is all zeros
    (a product with no sales yet)."""
    g = torch.Generator().manual_seed(step)
    t = torch.arange(T + 1).float()
    x = torch.sin(t / 3 + torch.rand(B, 1, generator=g) * 6) + 0.1 * torch.randn(B, T + 1,
                                                                                 generator=g)
    cov = torch.randn(B, T, generator=g)
    y = x[:, 1:].clone()
    if step == bad_at:
        y[4, 7] = 1e30
    if step == zeros_at:
        x[5], y[5] = 0.0, 0.0
    return (x[:, :-1], cov), y
