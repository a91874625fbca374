"""Sequence blocks whose numbers come from running sums and exponentials, as pure-PyTorch
repositories write them, for ``test_cumulative_scans``: a Mamba-2 style SSD block (``segsum``
of ``A * dt``, ``A = -exp(A_log)``, softplus ``dt`` zeroed at padding, masked with -inf above
the diagonal before its exp), causal linear attention normalised by the queries' dot product
with ``cumsum(phi(k))`` (``relu`` or ``elu + 1`` feature maps, bias-free projections), and a
causal depthwise conv1d with a gated MLP and an additive -inf mask passed into ``forward``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D, VOCAB, FEATURES = 8, 16, 4


def segsum(x):
    """Mamba-2's minimal SSD: ``segsum[i, j] = sum(x[j+1..i])``, -inf above the diagonal."""
    t = x.size(-1)
    x_cumsum = torch.cumsum(x, -1)
    segsum = x_cumsum[..., :, None] - x_cumsum[..., None, :]
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), 0)
    return segsum.masked_fill(~mask, -torch.inf)


class SSD(nn.Module):
    def __init__(self, d: int = D, n: int = 4, heads: int = 2):
        super().__init__()
        self.heads, self.n = heads, n
        self.in_proj = nn.Linear(d, d + 2 * n)
        self.dt_proj = nn.Linear(d, heads)
        self.dt_bias = nn.Parameter(torch.zeros(heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, heads + 1).float()))
        self.out_proj = nn.Linear(d, d)

    def forward(self, u, mask):
        b, t, d = u.shape
        x, B, C = self.in_proj(u).split([d, self.n, self.n], -1)
        x = x.view(b, t, self.heads, -1)
        A = -torch.exp(self.A_log)
        dt = F.softplus(self.dt_proj(u) + self.dt_bias) * mask[..., None]
        L = torch.exp(segsum((A * dt).transpose(1, 2)))             # (b, h, t, t)
        y = torch.einsum("bln,bsn,bhls,bshp->blhp", C, B, L, x * dt[..., None])
        return self.out_proj(y.reshape(b, t, d))


class ConvGLU(nn.Module):
    """A causal depthwise conv, a SwiGLU MLP, then attention under the caller's additive
    mask (0 or -inf)."""

    def __init__(self, d: int = D, k: int = 3):
        super().__init__()
        self.conv = nn.Conv1d(d, d, k, groups=d, padding=k - 1)
        self.up, self.down, self.q = nn.Linear(d, 2 * d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, mask):
        t = x.size(1)
        h = self.conv(x.transpose(1, 2))[..., :t].transpose(1, 2)
        a, gate = self.up(F.silu(h)).chunk(2, -1)
        h = self.down(a * F.silu(gate))
        scores = self.q(h) @ h.transpose(1, 2) / D ** 0.5 + mask
        return h + torch.softmax(scores, -1) @ h


class Regressor(nn.Module):
    """Sensor windows ``(B, T, FEATURES)`` in, one value per step out."""

    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.inp, self.mixer, self.head = nn.Linear(FEATURES, D), mixer, nn.Linear(D, 1)

    def forward(self, x, mask):
        h = self.inp(x)
        return self.head(h + self.mixer(h, mask)).squeeze(-1)


class LinearAttention(nn.Module):
    """``out_t = phi(q_t) * cumsum(phi(k) * v)_t / phi(q_t) . cumsum(phi(k))_t``, no eps."""

    def __init__(self, d: int = D, feature_map: str = "relu"):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o, self.feature_map = nn.Linear(d, d), feature_map

    def phi(self, x):
        return F.elu(x) + 1 if self.feature_map == "elu" else F.relu(x)

    def forward(self, x):
        q, k, v = self.phi(self.q(x)), self.phi(self.k(x)), self.v(x)
        num = q * torch.cumsum(k * v, 1)
        den = (q * torch.cumsum(k, 1)).sum(-1, keepdim=True)
        return self.o(num / den)


class LinearLM(nn.Module):
    def __init__(self, feature_map: str = "relu"):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D, padding_idx=0)
        self.attn, self.head = LinearAttention(feature_map=feature_map), nn.Linear(D, VOCAB)

    def forward(self, ids):
        return self.head(self.attn(self.emb(ids)))


def make_ssd():
    torch.manual_seed(0)
    return Regressor(SSD())


def make_conv_glu():
    torch.manual_seed(0)
    return Regressor(ConvGLU())


def make_relu_linear():
    torch.manual_seed(0)
    return LinearLM()


def make_elu_linear():
    torch.manual_seed(0)
    return LinearLM("elu")
