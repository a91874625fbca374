"""Models whose forward puts new tensors in their buffers' places (not in-place writes), with
the factories their bundles name (``buffer_models:make_...``; replayed from this directory)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, D, SHORT, LONG, BATCH = 40, 16, 6, 12, 4


class Rotary(nn.Module):
    """A Hugging Face-style rotary table: non-persistent buffers, made again (larger) when a
    longer sequence than the cached one comes."""

    def __init__(self, dim: int = D, max_len: int = SHORT):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim),
                             persistent=False)
        self._set_cache(max_len)

    def _set_cache(self, n: int) -> None:
        self.max_len = n
        f = torch.outer(torch.arange(n, dtype=self.inv_freq.dtype), self.inv_freq)
        emb = torch.cat((f, f), -1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x):
        n = x.shape[1]
        if n > self.max_len:
            self._set_cache(n)
        return self.cos_cached[:n], self.sin_cached[:n]


def _rotate(x, cos, sin):
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat((-b, a), -1) * sin


class RMSNorm(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x / x.pow(2).mean(-1, keepdim=True).sqrt()  # the bug: no eps


class RotaryLM(nn.Module):
    """One attention layer with rotary positions; a row of padding (token 0, a zero embedding)
    gives the value-projection's bias-free output a zero row, which RMSNorm divides 0 by 0."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D, padding_idx=0)
        self.rot = Rotary()
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)
        self.v = nn.Linear(D, D, bias=False)
        self.norm = RMSNorm()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        cos, sin = self.rot(x)
        q, k = _rotate(self.q(x), cos, sin), _rotate(self.k(x), cos, sin)
        att = (q @ k.transpose(1, 2) / D ** 0.5).softmax(-1)
        return self.head(self.norm(att @ self.v(x)))


def make_rotary_lm() -> nn.Module:
    torch.manual_seed(0)
    return RotaryLM()


class RunningScaler(nn.Module):
    """An observation normaliser (as RL code keeps one): running mean and variance buffers,
    updated in training by assignment (``self.mean = ...``: new tensors, not in-place)."""

    def __init__(self, d: int, momentum: float = 0.1):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("var", torch.ones(d))

    def forward(self, x):
        if self.training:
            m = self.momentum
            self.mean = (1 - m) * self.mean + m * x.mean(0).detach()
            self.var = (1 - m) * self.var + m * x.var(0).detach()
        return (x - self.mean) / self.var.sqrt()


class ScaledPolicy(nn.Module):
    def __init__(self, d_in: int = 6, hidden: int = 32, n_actions: int = 4):
        super().__init__()
        self.scaler = RunningScaler(d_in)
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, n_actions))

    def forward(self, obs):
        return self.body(self.scaler(obs))


def make_scaled_policy() -> nn.Module:
    torch.manual_seed(0)
    return ScaledPolicy()
