"""Diffusion models as their community writes them, for ``test_diffusion``: a small UNet
(GroupNorm, SiLU, self-attention, a sinusoidal timestep embedding) inside a lucidrains-style
``GaussianDiffusion`` whose forward draws the timesteps and the noise and returns the loss.
Its cosine schedule is rescaled to zero terminal SNR (Lin et al. 2023), so ``alpha_bar`` is
exactly 0 at the last timestep, and its min-SNR weight ``min(snr, 5) / snr`` is 0/0 there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

T = 40  # timesteps: a batch of 16 meets the last one within a few steps


def zero_snr_cosine_alphas_cumprod(steps: int, s: float = 0.008) -> torch.Tensor:
    x = torch.arange(steps + 1, dtype=torch.float64) / steps
    f = torch.cos((x + s) / (1 + s) * math.pi / 2) ** 2
    betas = (1 - f[1:] / f[:-1]).clamp(0, 0.999)
    root = torch.cumprod(1 - betas, 0).sqrt()
    root = (root - root[-1]) * root[0] / (root[0] - root[-1])  # the last one exactly 0
    return (root ** 2).float()


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, c: int, tdim: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.temb = nn.Linear(tdim, c)
        self.norm2, self.conv2 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x))) + self.temb(F.silu(temb))[:, :, None, None]
        return x + self.conv2(F.silu(self.norm2(h)))


class Attention(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm, self.qkv, self.proj = nn.GroupNorm(4, c), nn.Conv2d(c, 3 * c, 1), \
            nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).unbind(1)
        a = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), -1)
        return x + self.proj((v @ a.transpose(1, 2)).reshape(b, c, h, w))


class TinyUNet(nn.Module):
    def __init__(self, c: int = 8, tdim: int = 16):
        super().__init__()
        self.tdim = tdim
        self.time_mlp = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inc = nn.Conv2d(1, c, 3, padding=1)
        self.down, self.pool = ResBlock(c, tdim), nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.mid, self.attn = ResBlock(c, tdim), Attention(c)
        self.up, self.dec = nn.ConvTranspose2d(c, c, 2, stride=2), ResBlock(c, tdim)
        self.out = nn.Sequential(nn.GroupNorm(4, c), nn.SiLU(), nn.Conv2d(c, 1, 3, padding=1))

    def forward(self, x, t):
        temb = self.time_mlp(timestep_embedding(t, self.tdim))
        h = self.down(self.inc(x), temb)
        mid = self.attn(self.mid(self.pool(h), temb))
        return self.out(self.dec(self.up(mid) + h, temb))


class GaussianDiffusion(nn.Module):
    """``forward(x0)`` draws ``t`` and the noise (from ``self.gen`` when ``seed`` is given,
    as code that wants the same noise in every run does) and returns the min-SNR weighted
    epsilon loss."""

    def __init__(self, seed: int | None = None, gamma: float = 5.0):
        super().__init__()
        self.unet = TinyUNet()
        self.gamma = gamma
        self.gen = None if seed is None else torch.Generator().manual_seed(seed)
        ab = zero_snr_cosine_alphas_cumprod(T)
        self.register_buffer("alphas_cumprod", ab)
        self.register_buffer("sqrt_alphas_cumprod", ab.sqrt())
        self.register_buffer("sqrt_one_minus_alphas_cumprod", (1 - ab).sqrt())

    def forward(self, x0):
        t = torch.randint(0, T, (x0.shape[0],), generator=self.gen)
        noise = torch.randn(x0.shape, generator=self.gen)
        x_t = self.sqrt_alphas_cumprod[t].view(-1, 1, 1, 1) * x0 \
            + self.sqrt_one_minus_alphas_cumprod[t].view(-1, 1, 1, 1) * noise
        loss = F.mse_loss(self.unet(x_t, t), noise, reduction="none").mean(dim=(1, 2, 3))
        snr = self.alphas_cumprod[t] / (1 - self.alphas_cumprod[t])
        return (loss * snr.clamp(max=self.gamma) / snr).mean()  # 0/0 where alpha_bar is 0


def make_diffusion(**kw) -> nn.Module:
    return GaussianDiffusion(**kw)


def make_unet(**kw) -> nn.Module:
    return TinyUNet(**kw)


class ActNorm(nn.Module):
    """Glow's ActNorm: its scale and shift set from the first batch it sees, in the forward."""

    def __init__(self, c: int):
        super().__init__()
        self.loc, self.logs = nn.Parameter(torch.zeros(1, c)), nn.Parameter(torch.zeros(1, c))
        self.initialized = False

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0, keepdim=True))
                self.logs.data.copy_(-torch.log(x.std(0, keepdim=True) + 1e-6))
            self.initialized = True
        return (x + self.loc) * torch.exp(self.logs), self.logs.sum().expand(x.shape[0])


class AffineCoupling(nn.Module):
    """RealNVP's affine coupling, its log-scale unbounded (no tanh)."""

    def __init__(self, c: int, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(c // 2, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, c))

    def forward(self, x):
        xa, xb = x.chunk(2, 1)
        s, t = self.net(xa).chunk(2, 1)
        return torch.cat([xa, xb * torch.exp(s) + t], 1), s.sum(1)


class Flow(nn.Module):
    def __init__(self, c: int = 8, n: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(m for _ in range(n) for m in (ActNorm(c), AffineCoupling(c)))

    def forward(self, x):
        logdet = torch.zeros(x.shape[0])
        for layer in self.layers:
            x, ld = layer(x)
            logdet = logdet + ld
        return x, logdet


def make_flow(**kw) -> nn.Module:
    return Flow(**kw)


def flow_nll(z, logdet):
    return -(-0.5 * (z ** 2 + math.log(2 * math.pi)).sum(1) + logdet).mean()


K = 20  # flow matching's time grid: t in {0, 1/K, ..., 1}


class XPredictionFlow(nn.Module):
    """Rectified flow with the clean sample predicted: ``forward(x1)`` draws the noise and a
    time on the grid, and returns the velocity ``(x1_hat - x_t) / (1 - t)`` (x/0 at t = 1)
    beside its target ``x1 - x0``."""

    def __init__(self):
        super().__init__()
        self.unet = TinyUNet()

    def forward(self, x1):
        x0 = torch.randn_like(x1)
        t = torch.randint(0, K + 1, (x1.shape[0],)).float() / K
        tt = t.view(-1, 1, 1, 1)
        xt = (1 - tt) * x0 + tt * x1
        return (self.unet(xt, t * 1000) - xt) / (1 - tt), x1 - x0


def make_x_prediction_flow() -> nn.Module:
    return XPredictionFlow()
