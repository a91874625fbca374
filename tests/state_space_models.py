"""State-space models and linear recurrences as pure-PyTorch repositories write them, for
``test_state_space``: a Mamba-2 style block whose selective scan is the chunk's quadratic form
(``segsum`` of ``dt * A`` with ``A = -exp(A_log)``, softplus ``dt``), an S4D layer whose complex
diagonal kernel is a Vandermonde product convolved by ``rfft``/``irfft``, an RWKV-4 time-mixing
block with its WKV recurrence, minGRU's log-space parallel scan (``logcumsumexp``), and causal
linear attention with an ``elu + 1`` feature map. Blocks may run under
``torch.utils.checkpoint``, as the long-sequence recipes run them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

D, N_STATE, VOCAB = 16, 8, 32


def segsum(x, masked_fill: bool = True):
    """``out[..., i, j] = x[..., j+1] + ... + x[..., i]`` for ``j <= i`` (mamba2's ssd_minimal),
    as the difference of two cumsums. ``masked_fill=False`` is the naive version: exp of the
    upper triangle (a positive sum of ``-dt * A``) is taken and zeroed by the mask after."""
    t = x.size(-1)
    cs = torch.cumsum(x, dim=-1)
    diff = cs[..., :, None] - cs[..., None, :]
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
    if masked_fill:
        return torch.exp(diff.masked_fill(~causal, -torch.inf))
    return torch.exp(diff).masked_fill(~causal, 0.0)  # the bug: exp before the mask


class Mamba2Mixer(nn.Module):
    """in_proj to (x, z, B, C, dt), a causal depthwise conv, the SSD scan, a gated out_proj."""

    def __init__(self, d: int = D, n: int = N_STATE, heads: int = 4, naive: bool = False):
        super().__init__()
        self.heads, self.n, self.naive = heads, n, naive
        self.inner = 2 * d
        self.in_proj = nn.Linear(d, 2 * self.inner + 2 * n + heads)
        self.conv1d = nn.Conv1d(self.inner, self.inner, 4, groups=self.inner, padding=3)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1, 16, heads)))
        dt = torch.exp(torch.rand(heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.D = nn.Parameter(torch.ones(heads))
        self.out_proj = nn.Linear(self.inner, d)

    def forward(self, u, mask):
        b, t, _ = u.shape
        x, z, B, C, dt = torch.split(self.in_proj(u), [self.inner, self.inner, self.n, self.n,
                                                       self.heads], dim=-1)
        x = F.silu(self.conv1d(x.transpose(1, 2))[..., :t].transpose(1, 2))
        dt = F.softplus(dt + self.dt_bias) * mask[..., None]     # (b, t, h): pads hold the state
        A = -torch.exp(self.A_log.float())                       # (h,)
        xh = x.view(b, t, self.heads, -1)                        # (b, t, h, p)
        L = segsum((dt * A).transpose(1, 2), masked_fill=not self.naive)  # (b, h, t, t)
        scores = torch.einsum("bln,bsn->bls", C, B)              # (b, t, t)
        y = torch.einsum("bls,bhls,bsh,bshp->blhp", scores, L, dt, xh)
        y = y + xh * self.D[:, None]
        return self.out_proj((y.reshape(b, t, -1)) * F.silu(z))


class RMSNorm(nn.Module):
    def __init__(self, d: int = D, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.norm = RMSNorm()
        self.mixer = mixer

    def forward(self, x, mask):
        return x + self.mixer(self.norm(x), mask)


class SeqLM(nn.Module):
    """Token embedding, residual blocks (checkpointed when ``ckpt``), a tied LM head."""

    def __init__(self, mixers, ckpt: bool | str = False):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D, padding_idx=0)
        self.layers = nn.ModuleList(Block(m) for m in mixers)
        self.norm_f = RMSNorm()
        self.ckpt = ckpt

    def forward(self, ids):
        mask = (ids != 0).to(self.embedding.weight.dtype)      # right padding, token 0
        h = self.embedding(ids)
        for layer in self.layers:
            h = checkpoint(layer, h, mask, use_reentrant=self.ckpt == "reentrant") \
                if self.ckpt else layer(h, mask)
        return self.norm_f(h) @ self.embedding.weight.T


def make_mamba(naive: bool = False, ckpt: bool | str = False):
    torch.manual_seed(0)
    return SeqLM([Mamba2Mixer(naive=naive) for _ in range(2)], ckpt=ckpt)


def make_naive_mamba():
    return make_mamba(naive=True)


def make_naive_mamba_ckpt():
    return make_mamba(naive=True, ckpt=True)


def make_naive_mamba_reentrant():
    return make_mamba(naive=True, ckpt="reentrant")


def log_g(x):
    """minGRU's log of its positive activation g (x + 0.5 for x >= 0, sigmoid below)."""
    return torch.where(x >= 0, (F.relu(x) + 0.5).log(), -F.softplus(-x))


class MinGRU(nn.Module):
    """minGRU ("Were RNNs All We Needed?") in log space: ``h_t = (1 - z_t) h_{t-1} + z_t h~_t``
    by Heinsen's parallel scan, ``log h = a* + logcumsumexp(log b - a*)`` with
    ``a* = cumsum(log(1 - z))``; a padded step adds nothing (its log value -inf)."""

    def __init__(self, d: int = D):
        super().__init__()
        self.to_hidden_and_gate = nn.Linear(d, 2 * d, bias=False)
        self.to_out = nn.Linear(d, d)

    def forward(self, x, mask):
        hidden, gate = self.to_hidden_and_gate(x).chunk(2, dim=-1)
        log_coeffs = -F.softplus(gate)                          # log(1 - z)
        log_values = -F.softplus(-gate) + log_g(hidden)         # log(z * h~)
        log_values = log_values.masked_fill(mask[..., None] == 0, -torch.inf)
        a_star = log_coeffs.cumsum(dim=1)
        log_h = a_star + torch.logcumsumexp(log_values - a_star, dim=1)
        return self.to_out(log_h.exp())


def make_mingru():
    torch.manual_seed(0)
    return SeqLM([MinGRU() for _ in range(2)])


class S4DKernel(nn.Module):
    """S4D's diagonal kernel: ``K[h, l] = 2 Re(sum_n C (exp(dt A) - 1) / A * exp(dt A l))``
    (zero-order hold), ``A = -softplus/relu/exp(A_real) + i A_imag`` (S4D-Lin init)."""

    def __init__(self, h: int = D, n: int = N_STATE, real: str = "exp"):
        super().__init__()
        self.real = real
        log_dt = torch.rand(h) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
        self.log_dt = nn.Parameter(log_dt)
        self.C = nn.Parameter(torch.randn(h, n // 2, dtype=torch.cfloat) * 0.5 ** 0.5)
        if real == "exp":
            self.A_real = nn.Parameter(torch.log(0.5 * torch.ones(h, n // 2)))
        else:  # the bug: a random init that relu maps to 0 where negative
            self.A_real = nn.Parameter(0.5 * torch.randn(h, n // 2))
        self.A_imag = nn.Parameter(math.pi * torch.arange(n // 2).repeat(h, 1).float())

    def forward(self, length: int):
        dt = torch.exp(self.log_dt)
        real = torch.exp(self.A_real) if self.real == "exp" else F.relu(self.A_real)
        A = -real + 1j * self.A_imag
        dtA = A * dt[:, None]
        C = self.C * (torch.exp(dtA) - 1.0) / A
        vander = torch.exp(dtA.unsqueeze(-1) * torch.arange(length, device=A.device))
        return 2 * torch.einsum("hn,hnl->hl", C, vander).real


class S4D(nn.Module):
    def __init__(self, h: int = D, real: str = "exp"):
        super().__init__()
        self.kernel = S4DKernel(h, real=real)
        self.D = nn.Parameter(torch.randn(h))
        self.output_linear = nn.Linear(h, 2 * h)

    def forward(self, u, mask):                                 # (b, l, h)
        t = u.size(1)
        k = self.kernel(t)
        u = u * mask[..., None]
        u_f = torch.fft.rfft(u.transpose(1, 2), n=2 * t)
        k_f = torch.fft.rfft(k, n=2 * t)
        y = torch.fft.irfft(u_f * k_f, n=2 * t)[..., :t].transpose(1, 2)
        y = F.gelu(y + u * self.D)
        return F.glu(self.output_linear(y), dim=-1)


def make_s4d(real: str = "exp"):
    torch.manual_seed(0)
    return SeqLM([S4D(real=real) for _ in range(2)])


def make_s4d_relu():
    return make_s4d(real="relu")


class RWKVTimeMix(nn.Module):
    """RWKV-4 time mixing, the WKV recurrence written out in PyTorch (the CPU reference of the
    CUDA kernel). ``stable``: the max-subtraction trick; otherwise ``exp(k)`` raw."""

    def __init__(self, d: int = D, stable: bool = True):
        super().__init__()
        self.stable = stable
        self.time_decay = nn.Parameter(torch.linspace(-5, 1, d))
        self.time_first = nn.Parameter(torch.full((d,), math.log(0.3)))
        self.time_mix_k = nn.Parameter(torch.full((d,), 0.5))
        self.time_mix_v = nn.Parameter(torch.full((d,), 0.5))
        self.time_mix_r = nn.Parameter(torch.full((d,), 0.5))
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)
        self.output = nn.Linear(d, d, bias=False)

    def forward(self, x, mask):
        xx = F.pad(x, (0, 0, 1, -1))                            # token shift
        k = self.key(x * self.time_mix_k + xx * (1 - self.time_mix_k))
        v = self.value(x * self.time_mix_v + xx * (1 - self.time_mix_v))
        r = torch.sigmoid(self.receptance(x * self.time_mix_r + xx * (1 - self.time_mix_r)))
        wkv = self.wkv(-torch.exp(self.time_decay), self.time_first, k, v)
        return self.output(r * wkv)

    def wkv(self, w, u, k, v):
        b, t, d = k.shape
        aa = torch.zeros(b, d, device=k.device)
        bb = torch.zeros(b, d, device=k.device)
        pp = torch.full((b, d), -1e38, device=k.device)
        out = []
        for i in range(t):
            kk, vv = k[:, i], v[:, i]
            if self.stable:
                ww = u + kk
                p = torch.maximum(pp, ww)
                e1, e2 = torch.exp(pp - p), torch.exp(ww - p)
                out.append((e1 * aa + e2 * vv) / (e1 * bb + e2))
                ww = pp + w
                p = torch.maximum(ww, kk)
                e1, e2 = torch.exp(ww - p), torch.exp(kk - p)
                aa, bb, pp = e1 * aa + e2 * vv, e1 * bb + e2, p
            else:
                ek = torch.exp(kk)
                out.append((aa + torch.exp(u) * ek * vv) / (bb + torch.exp(u) * ek))
                aa = torch.exp(w) * aa + ek * vv
                bb = torch.exp(w) * bb + ek
        return torch.stack(out, dim=1)


class RWKVRegressor(nn.Module):
    """A time-series regressor: input projection, RWKV blocks, a linear head (one value per step)."""

    def __init__(self, stable: bool = True, features: int = 4):
        super().__init__()
        self.inp = nn.Linear(features, D)
        self.layers = nn.ModuleList(Block(RWKVTimeMix(stable=stable)) for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        mask = torch.ones_like(x[..., 0])
        for layer in self.layers:
            h = layer(h, mask)
        return self.head(h).squeeze(-1)


def make_rwkv(stable: bool = True):
    torch.manual_seed(0)
    return RWKVRegressor(stable=stable)


def make_naive_rwkv():
    return make_rwkv(stable=False)


class LinearAttention(nn.Module):
    """Causal linear attention (Katharopoulos et al.): ``phi(x) = elu(x) + 1``, the running sums
    ``S = cumsum(phi(k) v^T)``, ``z = cumsum(phi(k))``, ``out = phi(q) S / phi(q) . z``; keys of
    padded tokens zeroed by the mask (the normaliser's ``eps`` left out)."""

    def __init__(self, d: int = D, heads: int = 2, eps: float = 0.0):
        super().__init__()
        self.heads, self.eps = heads, eps
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).unbind(2)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        k = k * mask[:, :, None, None]
        kv = torch.cumsum(torch.einsum("bthd,bthe->bthde", k, v), dim=1)
        z = torch.cumsum(k, dim=1)
        num = torch.einsum("bthd,bthde->bthe", q, kv)
        den = torch.einsum("bthd,bthd->bth", q, z)
        return self.out((num / (den[..., None] + self.eps)).reshape(b, t, d))


class LinearLM(nn.Module):
    def __init__(self, ckpt: bool = True, eps: float = 0.0):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D, padding_idx=0)
        self.attn = nn.ModuleList(LinearAttention(eps=eps) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.head = nn.Linear(D, VOCAB)
        self.ckpt = ckpt

    def forward(self, ids):
        mask = (ids != 0).float()
        h = self.embedding(ids)
        for norm, attn in zip(self.norms, self.attn):
            if self.ckpt:
                h = h + checkpoint(attn, norm(h), mask, use_reentrant=False)
            else:
                h = h + attn(norm(h), mask)
        return self.head(h)


def make_linear_lm():
    torch.manual_seed(0)
    return LinearLM()
