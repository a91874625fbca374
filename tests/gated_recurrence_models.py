"""Gated recurrent and linear-attention sequence models written after their papers' reference
code: xLSTM's sLSTM (exponential gates, the log-space stabilizer ``m_t``) and mLSTM (matrix
memory, the normalizer ``max(|n^T q|, exp(-m))``), RetNet's retention with its decay mask, and
gated linear attention in its chunkwise form. Each has a planted variant of a bug practitioners
hit: the stabilizer or the normalizer dropped, a chunk's ``exp(-cumsum)`` of log gates taken
without subtracting the chunk's end."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS = 32, 32, 2


class SLSTMCell(nn.Module):
    """xLSTM's sLSTM (Beck et al. 2024, eq. 8-17) with exponential input and forget gates:
    ``c_t = f_t c_{t-1} + i_t z_t``, ``n_t = f_t n_{t-1} + i_t``, ``h_t = o_t c_t / n_t``.
    Stabilized: ``m_t = max(f~_t + m_{t-1}, i~_t)`` and both gates divided by ``exp(m_t)``
    (the ratio ``c / n`` is unchanged, and ``m`` carries the scale in log space)."""

    def __init__(self, dim: int, stabilized: bool = True):
        super().__init__()
        self.dim, self.stabilized = dim, stabilized
        self.w = nn.Linear(dim, 4 * dim)
        self.r = nn.Linear(dim, 4 * dim, bias=False)
        with torch.no_grad():  # forget gates slightly above 1: long memory
            self.w.bias[dim:2 * dim].copy_(torch.linspace(0.0, 0.5, dim))
            self.r.weight.mul_(0.1)

    def forward(self, x, state):
        c, n, m, h = state
        hs = []
        for t in range(x.shape[1]):
            zt, ft, it, ot = (self.w(x[:, t]) + self.r(h)).chunk(4, -1)
            if self.stabilized:
                m_new = torch.maximum(ft + m, it)
                i = torch.exp(it - m_new)
                f = torch.exp(ft + m - m_new)
                m = m_new
            else:  # the stabilizer dropped: exp(f~) > 1 compounds over the sequence
                i = torch.exp(it)
                f = torch.exp(ft)
            c = f * c + i * torch.tanh(zt)
            n = f * n + i
            h = torch.sigmoid(ot) * (c / n)
            hs.append(h)
        return torch.stack(hs, 1), (c, n, m, h)


class SLSTMLM(nn.Module):
    """A one-block sLSTM language model, its state carried between truncated-BPTT segments:
    ``logits, state = model(ids, state)``."""

    def __init__(self, stabilized: bool = True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.cell = SLSTMCell(DIM, stabilized)
        self.head = nn.Linear(DIM, VOCAB)

    def init_state(self, batch: int):
        z = torch.zeros(batch, DIM)
        return (z, z.clone(), z.clone(), z.clone())

    def forward(self, ids, state):
        y, state = self.cell(self.norm(self.emb(ids)), state)
        return self.head(y), state


class MLSTMLayer(nn.Module):
    """xLSTM's mLSTM in its recurrent form (the reference's ``mlstm_recurrent_step``):
    ``C_t = f C_{t-1} + i v k^T``, ``n_t = f n_{t-1} + i k``, ``h = C q / max(|n^T q|, exp(-m))``.
    ``normalized=False`` is the normalizer dropped: ``h = C q / (n^T q)``."""

    def __init__(self, dim: int, heads: int, normalized: bool = True):
        super().__init__()
        self.heads, self.dh, self.normalized = heads, dim // heads, normalized
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # xLSTM's projections have no bias
        self.igate = nn.Linear(3 * dim, heads)
        self.fgate = nn.Linear(3 * dim, heads)
        self.out = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            self.fgate.bias.copy_(torch.linspace(3.0, 6.0, heads))
            self.igate.bias.normal_(0.0, 0.1)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x)
        q, k, v = (z.view(b, t, self.heads, self.dh) for z in qkv.chunk(3, -1))
        k = k / math.sqrt(self.dh)
        ig, fg = self.igate(qkv), self.fgate(qkv)  # (b, t, heads)
        c = x.new_zeros(b, self.heads, self.dh, self.dh)
        n = x.new_zeros(b, self.heads, self.dh)
        m = x.new_zeros(b, self.heads)
        hs = []
        for s in range(t):
            log_f = F.logsigmoid(fg[:, s])
            m_new = torch.maximum(log_f + m, ig[:, s])
            f = torch.exp(log_f + m - m_new)[..., None]
            i = torch.exp(ig[:, s] - m_new)[..., None]
            c = f[..., None] * c + i[..., None] * (v[:, s, :, :, None] * k[:, s, :, None, :])
            n = f * n + i * k[:, s]
            num = (c @ q[:, s, :, :, None]).squeeze(-1)
            qn = (n * q[:, s]).sum(-1, keepdim=True)
            if self.normalized:
                den = torch.maximum(qn.abs(), torch.exp(-m_new)[..., None]) + 1e-6
            else:
                den = qn  # the normalizer dropped: 0 / 0 where q is 0
            hs.append(num / den)
            m = m_new
        return self.out(torch.stack(hs, 1).reshape(b, t, -1))


class RetNetRetention(nn.Module):
    """RetNet's parallel retention (torchscale's ``RetNetRelPos`` + ``MultiScaleRetention``):
    the decay mask ``exp((i - j) log gamma)`` with +inf above the diagonal (exp of -inf is 0;
    ``nan_to_num`` for a head whose decay is 0), divided by the square root of its row sums."""

    def __init__(self, dim: int, heads: int, first: int = 5, masked_after: bool = False):
        super().__init__()
        self.heads, self.dh, self.masked_after = heads, dim // heads, masked_after
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.g = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.norm = nn.GroupNorm(heads, dim, affine=False)
        decay = torch.log(1 - 2 ** (-first - torch.arange(heads, dtype=torch.float)))
        self.register_buffer("decay", decay)

    def decay_mask(self, t: int):
        index = torch.arange(t).to(self.decay)
        if self.masked_after:  # the causal mask multiplied in after the exp: exp(-(i - j) *
            # log gamma) above the diagonal grows with the length (inf * 0 once it overflows)
            mask = torch.exp((index[:, None] - index[None, :]) * self.decay[:, None, None])
            mask = mask * torch.tril(torch.ones(t, t)).to(mask)
            return mask / mask.sum(dim=-1, keepdim=True).sqrt()
        mask = torch.tril(torch.ones(t, t, device=self.decay.device)).bool()
        mask = torch.masked_fill(index[:, None] - index[None, :], ~mask, float("inf"))
        mask = torch.exp(mask * self.decay[:, None, None])
        mask = torch.nan_to_num(mask)
        return mask / mask.sum(dim=-1, keepdim=True).sqrt()

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, self.dh).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, -1))
        qk = (q @ (k * self.dh ** -0.5).transpose(-1, -2)) * self.decay_mask(t)
        qk = qk / qk.detach().abs().sum(-1, keepdim=True).clamp(min=1)
        o = (qk @ v).transpose(1, 2).reshape(b * t, d)
        o = self.norm(o).view(b, t, d)
        return self.out(F.silu(self.g(x)) * o)


class ChunkGLA(nn.Module):
    """Gated linear attention (Yang et al. 2024) in the chunkwise form of flash-linear-attention's
    ``naive_chunk_gla``: per chunk the log gates' cumsum ``b``, queries times ``exp(b)``, keys
    times ``exp(b_last - b)``, the state carried from chunk to chunk. ``stable=False`` scales
    the keys by ``exp(-b)``, which overflows once a chunk's log gates sum below -88."""

    def __init__(self, dim: int, heads: int, chunk: int = 16, stable: bool = True,
                 normalizer: float = 16.0):
        super().__init__()
        self.heads, self.dh, self.chunk, self.stable = heads, dim // heads, chunk, stable
        self.normalizer = normalizer
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.gk = nn.Sequential(nn.Linear(dim, 16, bias=False), nn.Linear(16, dim))
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        hd, c = self.heads, self.chunk
        q, k, v = (z.view(b, t // c, c, hd, self.dh).transpose(2, 3)
                   for z in self.qkv(x).chunk(3, -1))
        g = F.logsigmoid(self.gk(x)) / self.normalizer  # GLA's gate_logit_normalizer
        g = g.view(b, t // c, c, hd, self.dh).transpose(2, 3).cumsum(-2)
        causal = torch.tril(torch.ones(c, c, dtype=torch.bool, device=x.device))
        state = x.new_zeros(b, hd, self.dh, self.dh)
        outs = []
        for i in range(t // c):
            bi = g[:, i]  # (b, h, c, dh), the chunk's cumulative log decay
            qi = q[:, i] * self.dh ** -0.5 * bi.exp()
            if self.stable:  # pairwise decays exp(b_i - b_j), -inf above the diagonal
                diff = (bi[..., :, None, :] - bi[..., None, :, :]).masked_fill(
                    ~causal[..., None], float("-inf"))
                inner = (q[:, i, ..., :, None, :] * k[:, i, ..., None, :, :]
                         * diff.exp()).sum(-1) * self.dh ** -0.5
                ki = k[:, i] * (bi[..., -1:, :] - bi).exp()
            else:
                ki = k[:, i] * torch.exp(-bi)  # overflows once a chunk's -b passes 88
                inner = (qi @ ki.transpose(-1, -2)).masked_fill(~causal, 0)
                ki = ki * bi[..., -1:, :].exp()
            o = qi @ state + inner @ v[:, i]
            state = state * bi[..., -1, :, None].exp() + ki.transpose(-1, -2) @ v[:, i]
            outs.append(o)
        o = torch.stack(outs, 1).transpose(2, 3).reshape(b, t, d)
        return self.out(o)


class RWKVTimeMix(nn.Module):
    """RWKV-4's time mixing with the WKV recurrence written out as its reference CUDA kernel's
    running max (``p = max(pp, u + k)``, ``e1 = exp(pp - p)``, ``e2 = exp(u + k - p)``), the
    state started at ``pp = -1e38``. Padded positions get a key of ``-inf`` (no weight in the
    average). ``start`` is the initial ``pp``: ``-inf`` makes ``pp - p`` a ``-inf - -inf`` at a
    left-padded row's first positions."""

    def __init__(self, dim: int, start: float = -1e38):
        super().__init__()
        self.start = start
        self.time_decay = nn.Parameter(torch.linspace(-5.0, 1.0, dim))
        self.time_first = nn.Parameter(torch.full((dim,), math.log(0.3)))
        self.time_mix = nn.Parameter(torch.full((3, dim), 0.5))
        self.key = nn.Linear(dim, dim, bias=False)
        self.value = nn.Linear(dim, dim, bias=False)
        self.receptance = nn.Linear(dim, dim, bias=False)
        self.output = nn.Linear(dim, dim, bias=False)

    def forward(self, x, pad):
        xx = F.pad(x, (0, 0, 1, -1))  # token shift
        xk, xv, xr = (x * m + xx * (1 - m) for m in self.time_mix)
        k = self.key(xk).masked_fill(pad[..., None], float("-inf"))
        v, r = self.value(xv), torch.sigmoid(self.receptance(xr))
        w, u = -torch.exp(self.time_decay), self.time_first
        aa = torch.zeros_like(x[:, 0])
        bb = torch.zeros_like(x[:, 0])
        pp = torch.full_like(x[:, 0], self.start)
        out = []
        for t in range(x.shape[1]):
            kt, vt = k[:, t], v[:, t]
            ww = u + kt
            p = torch.maximum(pp, ww)
            e1, e2 = torch.exp(pp - p), torch.exp(ww - p)
            out.append((e1 * aa + e2 * vt) / (e1 * bb + e2))
            ww = pp + w
            p = torch.maximum(ww, kt)
            e1, e2 = torch.exp(ww - p), torch.exp(kt - p)
            aa, bb, pp = e1 * aa + e2 * vt, e1 * bb + e2, p
        return self.output(r * torch.stack(out, 1))


class RWKVLM(nn.Module):
    """Left-padded sequences (token 0), RWKV time-mixing blocks with LayerNorm pre-norms."""

    def __init__(self, start: float = -1e38):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2))
        self.mixers = nn.ModuleList(RWKVTimeMix(DIM, start) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x, pad = self.emb(ids), ids == 0
        for norm, mix in zip(self.norms, self.mixers):
            x = x + mix(norm(x), pad)
        return self.head(x)


class Block(nn.Module):
    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(DIM, bias=False)  # xLSTM's pre-norm has no bias
        self.mixer = mixer
        self.ffn = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(),
                                 nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        x = x + self.mixer(self.norm(x))
        return x + self.ffn(x)


class SeqLM(nn.Module):
    """Embedding (token 0 is padding, its row 0), blocks, a tied-free head."""

    def __init__(self, mixers: list[nn.Module]):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.blocks = nn.ModuleList(Block(m) for m in mixers)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(logits, ids):
    """Next-token cross entropy over the real tokens (padding is token 0)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1),
                           ignore_index=0)


def segment_loss(out, y):
    """The loss of one truncated-BPTT segment: ``out`` is ``(logits, state)``."""
    return F.cross_entropy(out[0].reshape(-1, VOCAB).float(), y.reshape(-1))


def make_slstm():
    torch.manual_seed(0)
    return SLSTMLM(stabilized=True)


def make_slstm_unstabilized():
    torch.manual_seed(0)
    return SLSTMLM(stabilized=False)


def make_hybrid():
    """mLSTM, RetNet and chunkwise GLA blocks in one stack (the healthy run)."""
    torch.manual_seed(0)
    return SeqLM([MLSTMLayer(DIM, HEADS), RetNetRetention(DIM, HEADS), ChunkGLA(DIM, HEADS)])


def make_mlstm_unnormalized():
    torch.manual_seed(0)
    return SeqLM([MLSTMLayer(DIM, HEADS, normalized=False), MLSTMLayer(DIM, HEADS)])


def make_gla_unstable():
    torch.manual_seed(0)
    return SeqLM([ChunkGLA(DIM, HEADS, chunk=64, stable=False, normalizer=1.0)])


def make_rwkv():
    torch.manual_seed(0)
    return RWKVLM()


def make_rwkv_inf_start():
    torch.manual_seed(0)
    return RWKVLM(start=float("-inf"))


def make_retnet_masked_after():
    """RetNet with faster-decaying heads (gamma = 1 - 2^-2, 1 - 2^-3) and the causal mask
    multiplied in after the exp."""
    torch.manual_seed(0)
    return SeqLM([RetNetRetention(DIM, HEADS, first=2, masked_after=True)])
