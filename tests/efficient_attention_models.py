"""Tiny decoder LMs with the efficient-attention variants public repositories write by hand,
each with the NaN/Inf bug that really happens in it. The factories of
``test_efficient_attention.py``.

- ``PerformerAttention``: FAVOR+ positive random features as lucidrains/performer-pytorch's
  ``softmax_kernel`` writes them (``data_normalizer = d ** -0.25``, ``ratio = m ** -0.5``,
  ``exp(w.x - |x|^2 / 2 - max) + eps``), or its ``generalized_kernel`` (``generalized_attention``:
  ``relu(w.x) + kernel_epsilon``); ``kernel_epsilon=0`` is the bug: a query whose ReLU features
  share no positive entry with the keys so far divides ``1 / (q . k_cumsum)`` by 0. Either
  kernel's normaliser left in float16 autocast (performer-pytorch turns autocast off around
  it) has a tiny ``D`` whose ``1 / D ** 2`` in the backward leaves float16's range.
- ``LinearAttention``: idiap/fast-transformers' ``CausalLinearAttention`` (``elu(x) + 1``
  feature map, keys zeroed at padding, ``Z = 1 / (einsum(Q, K.cumsum) + eps)``); ``eps=0`` is
  the bug: a query whose keys so far are all padding divides by 0; ``where_guard`` puts 0 there
  with ``torch.where`` instead, whose backward still takes ``1 / 0``.
- ``FlatHeadsLinearAttention``: the same over the heads folded into the batch, ``(b * h, t, d)``,
  as fairseq's ``MultiheadAttention`` lays them out.
- ``CosineAttention``: Swin Transformer V2's ``WindowAttention`` (microsoft/Swin-Transformer):
  ``normalize(q) @ normalize(k)^T * exp(logit_scale)`` with the learnable log scale
  clamped at ``log(1 / 0.01)``; under float16 autocast on the CPU, ``F.normalize``'s
  ``clamp_min(1e-12)`` of a pad token's zero query is 0.
- ``RotaryAttention``: HF transformers' ``LlamaRotaryEmbedding`` (``inv_freq @ position_ids``
  under ``torch.autocast(enabled=False)``, "force float32 since bfloat16 loses precision on
  long contexts"); ``float32_freqs=False`` leaves autocast on.
- ``AlibiAttention``: ALiBi slopes (ofirpress/attention_with_linear_biases, as BLOOM/MPT add
  them) with a Mistral-style sliding-window causal mask and the padding mask, ``-inf`` filled.
- ``OnlineSoftmaxAttention``: FlashAttention's online softmax written in PyTorch, block by
  block over the keys (the reference of Dao-AILab/flash-attention and of the Triton tutorial):
  a running max ``m`` that starts at ``-inf``, ``alpha = exp(m_old - m_new)``; ``guard=False``
  drops the ``m == -inf`` guard, so a block of keys that is all padding makes ``-inf - -inf``.

Every attention uses grouped-query K/V heads expanded with ``repeat_interleave`` (multi-query
when ``KV_HEADS == 1``), as Llama/Mistral's ``repeat_kv`` does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, KV_HEADS, LENGTH, BATCH = 32, 16, 4, 2, 8, 6
HD = WIDTH // HEADS


class GQAProjections(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, HEADS * HD, bias=False)
        self.k_proj = nn.Linear(WIDTH, KV_HEADS * HD, bias=False)
        self.v_proj = nn.Linear(WIDTH, KV_HEADS * HD, bias=False)
        self.o_proj = nn.Linear(HEADS * HD, WIDTH, bias=False)

    def qkv(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HEADS, HD).transpose(1, 2)
        k = self.k_proj(x).view(b, t, KV_HEADS, HD).transpose(1, 2)
        v = self.v_proj(x).view(b, t, KV_HEADS, HD).transpose(1, 2)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        return q, k, v

    def out(self, o):
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, HEADS * HD))


def gaussian_orthogonal_random_matrix(nb_rows, nb_columns):
    blocks = []
    for _ in range(math.ceil(nb_rows / nb_columns)):
        q, _ = torch.linalg.qr(torch.randn(nb_columns, nb_columns))
        blocks.append(q.T)
    mat = torch.cat(blocks)[:nb_rows]
    return torch.randn(nb_rows, nb_columns).norm(dim=1)[:, None] * mat


def softmax_kernel(data, projection_matrix, is_query, eps=1e-4):
    data_normalizer = data.shape[-1] ** -0.25
    ratio = projection_matrix.shape[0] ** -0.5
    data_dash = torch.einsum("...id,jd->...ij", data_normalizer * data, projection_matrix)
    diag_data = (data ** 2).sum(dim=-1) / 2.0 * data_normalizer ** 2
    diag_data = diag_data.unsqueeze(-1)
    if is_query:
        stab = torch.amax(data_dash, dim=-1, keepdim=True).detach()
    else:
        stab = torch.amax(data_dash, dim=(-1, -2), keepdim=True).detach()
    return ratio * (torch.exp(data_dash - diag_data - stab) + eps)


def generalized_kernel(data, projection_matrix, kernel_fn=F.relu, kernel_epsilon=0.001):
    data_normalizer = data.shape[-1] ** -0.25
    data_dash = torch.einsum("...id,jd->...ij", data_normalizer * data, projection_matrix)
    return kernel_fn(data_dash) + kernel_epsilon


class PerformerAttention(GQAProjections):
    """performer-pytorch's ``FastAttention`` (causal, ``causal_linear_attention_noncuda``);
    ``generalized_attention`` takes ``generalized_kernel`` (ReLU features + ``kernel_epsilon``)
    instead of the FAVOR+ softmax kernel."""

    def __init__(self, nb_features=16, generalized_attention=False, kernel_epsilon=0.001):
        super().__init__()
        self.register_buffer("projection_matrix", gaussian_orthogonal_random_matrix(nb_features, HD))
        self.generalized_attention = generalized_attention
        self.kernel_epsilon = kernel_epsilon

    def forward(self, x, key_padding_mask, position_ids):
        q, k, v = self.qkv(x)
        v = v.masked_fill(key_padding_mask[:, None, :, None] == 0, 0.0)
        if self.generalized_attention:
            q = generalized_kernel(q, self.projection_matrix, kernel_epsilon=self.kernel_epsilon)
            k = generalized_kernel(k, self.projection_matrix, kernel_epsilon=self.kernel_epsilon)
        else:
            q = softmax_kernel(q, self.projection_matrix, is_query=True)
            k = softmax_kernel(k, self.projection_matrix, is_query=False)
        k_cumsum = k.cumsum(dim=-2)
        D_inv = 1.0 / torch.einsum("...nd,...nd->...n", q, k_cumsum.type_as(q))
        context = torch.einsum("...nd,...ne->...nde", k, v).cumsum(dim=-3)
        out = torch.einsum("...nde,...nd,...n->...ne", context, q, D_inv)
        return self.out(out)


class LinearAttention(GQAProjections):
    def __init__(self, eps=1e-6, where_guard=False):
        super().__init__()
        self.eps, self.where_guard = eps, where_guard

    def feature_map(self, x):
        return F.elu(x) + 1

    def forward(self, x, key_padding_mask, position_ids):
        q, k, v = self.qkv(x)
        Q, K = self.feature_map(q), self.feature_map(k)
        K = K * key_padding_mask[:, None, :, None]
        if self.where_guard:  # 0 where no key was kept yet, instead of an eps
            den = torch.einsum("nhli,nhli->nhl", Q, K.cumsum(2))
            Z = torch.where(den > 0, 1 / den, torch.zeros_like(den))
        else:
            Z = 1 / (torch.einsum("nhli,nhli->nhl", Q, K.cumsum(2)) + self.eps)
        KV = torch.einsum("nhsd,nhsm->nhsdm", K, v).cumsum(2)
        V = torch.einsum("nhld,nhldm,nhl->nhlm", Q, KV, Z)
        return self.out(V)


class FlatHeadsLinearAttention(GQAProjections):
    """Linear attention over the heads folded into the batch, ``(b * h, t, d)``, as fairseq's
    ``MultiheadAttention`` and xformers' kernels lay them out."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x, key_padding_mask, position_ids):
        q, k, v = self.qkv(x)
        b, h, t, d = q.shape
        Q, K, V = (z.reshape(b * h, t, d) for z in (F.elu(q) + 1, F.elu(k) + 1, v))
        K = K * key_padding_mask.repeat_interleave(h, dim=0)[:, :, None]
        Z = 1 / (torch.einsum("nli,nli->nl", Q, K.cumsum(1)) + self.eps)
        KV = torch.einsum("nsd,nsm->nsdm", K, V).cumsum(1)
        out = torch.einsum("nld,nldm,nl->nlm", Q, KV, Z)
        return self.out(out.view(b, h, t, d))


class CosineAttention(GQAProjections):
    def __init__(self, init_scale=10.0):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.log(init_scale * torch.ones((HEADS, 1, 1))))

    def forward(self, x, key_padding_mask, position_ids):
        q, k, v = self.qkv(x)
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        logit_scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        attn = attn * logit_scale
        attn = attn + causal_padding_bias(key_padding_mask, attn.dtype)
        return self.out(attn.softmax(dim=-1) @ v)


class RotaryEmbedding(nn.Module):
    def __init__(self, base=10000.0, float32_freqs=True):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, HD, 2, dtype=torch.int64).float() / HD))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.float32_freqs = float32_freqs

    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        with torch.autocast(device_type=x.device.type, enabled=not self.float32_freqs):
            freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos()
            sin = emb.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryAttention(GQAProjections):
    def __init__(self, float32_freqs=True):
        super().__init__()
        self.rotary_emb = RotaryEmbedding(float32_freqs=float32_freqs)

    def forward(self, x, key_padding_mask, position_ids):
        q, k, v = self.qkv(x)
        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        s = q @ k.transpose(-1, -2) / HD ** 0.5
        s = s + causal_padding_bias(key_padding_mask, s.dtype)
        return self.out(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v)


def get_alibi_slopes(n):
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))
    return torch.tensor([start * start ** i for i in range(n)])


class AlibiAttention(GQAProjections):
    def __init__(self, window=3):
        super().__init__()
        self.register_buffer("slopes", get_alibi_slopes(HEADS), persistent=False)
        self.window = window

    def forward(self, x, key_padding_mask, position_ids):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        pos = torch.arange(t)
        rel = pos[None, :] - pos[:, None]
        bias = self.slopes[:, None, None] * rel[None]
        allowed = (rel <= 0) & (rel > -self.window)
        allowed = allowed[None, None] & key_padding_mask[:, None, None, :].bool()
        s = q @ k.transpose(-1, -2) / HD ** 0.5 + bias
        s = s.masked_fill(~allowed, float("-inf"))
        return self.out(s.softmax(dim=-1) @ v)


class OnlineSoftmaxAttention(GQAProjections):
    def __init__(self, block=2, guard=True):
        super().__init__()
        self.block, self.guard = block, guard

    def forward(self, x, key_padding_mask, position_ids):
        q, k, v = self.qkv(x)
        b, h, t, d = q.shape
        allowed = torch.tril(torch.ones(t, t, dtype=torch.bool))[None, None]
        allowed = allowed & key_padding_mask[:, None, None, :].bool()
        m = torch.full((b, h, t, 1), float("-inf"))
        l_i = torch.zeros(b, h, t, 1)
        acc = torch.zeros(b, h, t, d)
        for j in range(0, t, self.block):
            s = q @ k[:, :, j:j + self.block].transpose(-1, -2) * d ** -0.5
            s = s.masked_fill(~allowed[..., j:j + self.block], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            if self.guard:
                m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_safe = m_new
            p = torch.exp(s - m_safe)
            alpha = torch.exp(m - m_safe)
            l_i = l_i * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p @ v[:, :, j:j + self.block]
            m = m_new
        return self.out(acc / l_i.clamp_min(1e-20))


def causal_padding_bias(key_padding_mask, dtype):
    t = key_padding_mask.shape[-1]
    neg = torch.finfo(dtype).min
    causal = torch.triu(torch.full((t, t), neg, dtype=dtype), diagonal=1)
    return causal[None, None] + (1.0 - key_padding_mask[:, None, None, :].to(dtype)) * neg


class Block(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = attn
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x, key_padding_mask, position_ids):
        x = x + self.attn(self.ln1(x), key_padding_mask, position_ids)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.block = Block(attn)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, attention_mask, position_ids):
        h = self.block(self.embed(ids), attention_mask.float(), position_ids)
        return self.head(self.norm(h))


def lm_loss(logits, ids, attention_mask):
    """Next-token cross-entropy over the kept tokens (pads labelled -100)."""
    labels = ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), labels.reshape(-1),
                           ignore_index=-100)


class LeftPadded(torch.utils.data.Dataset):
    """Token rows, those of batch ``j`` left-padded by ``pads_at[j][i]`` (id 0), with HF's
    mask and position ids; the position ids start at ``offset`` (a chunk taken that far into a
    long document)."""

    def __init__(self, pads_at, offset=0, n_batches=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (BATCH * n_batches, LENGTH), generator=g)
        self.pads_at, self.offset = pads_at, offset

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i].clone()
        p = self.pads_at.get(i // BATCH, [0] * BATCH)[i % BATCH]
        am = torch.ones(LENGTH, dtype=torch.long)
        ids[:p], am[:p] = 0, 0
        pos = (am.cumsum(-1) - 1).clamp_min(0) + self.offset
        return ids, am, pos


def make(attn_factory):
    torch.manual_seed(0)
    return TinyLM(attn_factory())


def make_performer():
    return make(PerformerAttention)


def make_performer_relu():
    return make(lambda: PerformerAttention(generalized_attention=True))


def make_performer_relu_no_eps():
    return make(lambda: PerformerAttention(generalized_attention=True, kernel_epsilon=0.0))


def make_linear():
    return make(LinearAttention)


def make_linear_no_eps():
    return make(lambda: LinearAttention(eps=0.0))


def make_linear_where():
    return make(lambda: LinearAttention(eps=0.0, where_guard=True))


def make_flat_linear_no_eps():
    return make(lambda: FlatHeadsLinearAttention(eps=0.0))


def make_performer_relu_eps_1e8():
    return make(lambda: PerformerAttention(generalized_attention=True, kernel_epsilon=1e-8))


def make_cosine():
    return make(CosineAttention)


def make_rotary():
    return make(RotaryAttention)


def make_rotary_autocast():
    return make(lambda: RotaryAttention(float32_freqs=False))


def make_alibi():
    return make(AlibiAttention)


def make_online():
    return make(OnlineSoftmaxAttention)


def make_online_unguarded():
    return make(lambda: OnlineSoftmaxAttention(guard=False))
