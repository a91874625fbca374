"""A tiny Llama-style decoder built the way torchtitan builds its models: on the meta device,
then ``to_empty`` and the model's own ``init_weights``, which also computes the RoPE table
``freqs_cis`` and the causal mask, non-persistent buffers (not in the state_dict) left empty by
``to_empty`` until ``init_weights`` fills them (see ``test_meta_init``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, SEQ = 32, 16, 2, 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, device=freqs.device).float()
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary(x, freqs_cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis[: x.shape[1], None, :]).flatten(3)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, freqs_cis, mask):
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, HEADS, DIM // HEADS).unbind(2)
        q, k = apply_rotary(q, freqs_cis), apply_rotary(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (DIM // HEADS) ** 0.5
        att = att + mask[:s, :s]
        y = att.softmax(-1) @ v
        return self.wo(y.transpose(1, 2).reshape(b, s, DIM))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x, freqs_cis, mask):
        x = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return x + self.w2(F.silu(self.w1(self.ffn_norm(x))))


class Transformer(nn.Module):
    def __init__(self, n_layers: int = 2, rope_theta: float = 10000.0,
                 fill_mask: bool = True):
        super().__init__()
        self.rope_theta, self.fill_mask = rope_theta, fill_mask
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        # torchtitan: computed in init_weights, which runs after to_empty on the real device
        self.register_buffer("freqs_cis", self._freqs(), persistent=False)
        self.register_buffer("mask", torch.empty(SEQ, SEQ), persistent=False)

    def _freqs(self):
        return precompute_freqs_cis(DIM // HEADS, SEQ, self.rope_theta)

    def init_weights(self, buffer_device=None):
        with torch.device(buffer_device or self.freqs_cis.device):
            self.freqs_cis = self._freqs()
            if self.fill_mask:  # (the bug when False: the mask keeps to_empty's memory)
                self.mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.reset_parameters()
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(m.weight, std=0.02 if m is not self.output else 0.1)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis, self.mask)
        return self.output(self.norm(h))


def make_model(**kwargs) -> Transformer:
    """torchtitan's build: meta, then ``to_empty`` on the CPU and ``init_weights``."""
    with torch.device("meta"):
        model = Transformer(**kwargs)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def make_bad_rope():
    return make_model(rope_theta=0.0)


def make_unfilled_mask():
    return make_model(fill_mask=False)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Regressor(nn.Module):
    """An RMS-normalised MLP on raw sensor features, no eps (the bug under bfloat16: a row of
    readings in the wrong unit, ~1e-21, squares to 1e-42, 0 in bfloat16 and not in float32)."""

    def __init__(self, features: int = 6):
        super().__init__()
        self.norm = RMSNorm(features, eps=0.0)
        self.head = nn.Linear(features, 1)
        self.norm.reset_parameters()

    def forward(self, x):
        return self.head(self.norm(x))


def make_bf16_regressor():
    """Built under ``torch.set_default_dtype(torch.bfloat16)`` (an LLM fine-tuning script's
    habit), the default restored after: the weights are bfloat16, as training runs."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return Regressor()
    finally:
        torch.set_default_dtype(saved)
