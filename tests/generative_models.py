"""Generative models as their communities write them, for ``test_generative_models``: a
VQ-VAE whose EMA codebook is updated in the forward through ``.data`` (as vq-vae-2 code does),
by default without the Laplace smoothing of the cluster sizes, so a code no vector picked
divides 0 by 0 (or, with ``embed_avg`` started from the codebook, x by 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class EMAQuantize(nn.Module):
    def __init__(self, dim: int = 8, n_embed: int = 32, decay: float = 0.99,
                 smooth: bool = False, avg_from_embed: bool = False):
        super().__init__()
        self.dim, self.n_embed, self.decay, self.smooth = dim, n_embed, decay, smooth
        self.register_buffer("embed", torch.randn(dim, n_embed))
        self.register_buffer("cluster_size", torch.zeros(n_embed))
        self.register_buffer("embed_avg", self.embed.clone() if avg_from_embed
                             else torch.zeros(dim, n_embed))

    def forward(self, x):
        flat = x.reshape(-1, self.dim)
        dist = (flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.embed
                + self.embed.pow(2).sum(0, keepdim=True))
        ind = dist.argmin(1)
        onehot = F.one_hot(ind, self.n_embed).type(flat.dtype)
        quantize = F.embedding(ind.view(*x.shape[:-1]), self.embed.t())
        if self.training:
            with torch.no_grad():
                self.cluster_size.data.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_avg.data.mul_(self.decay).add_(flat.t() @ onehot,
                                                          alpha=1 - self.decay)
                size = self.cluster_size  # the bug: no Laplace smoothing, a dead code is 0/0
                if self.smooth:
                    n = size.sum()
                    size = (size + 1e-5) / (n + self.n_embed * 1e-5) * n
                self.embed.data.copy_(self.embed_avg / size.unsqueeze(0))
        commit = (quantize.detach() - x).pow(2).mean()
        return x + (quantize - x).detach(), commit  # straight-through


class TinyVQVAE(nn.Module):
    def __init__(self, c: int = 16, dim: int = 8, **quantize):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, c, 4, 2, 1), nn.ReLU(), nn.Conv2d(c, dim, 1))
        self.quantize = EMAQuantize(dim, **quantize)
        self.dec = nn.Sequential(nn.Conv2d(dim, c, 3, padding=1), nn.ReLU(),
                                 nn.ConvTranspose2d(c, 3, 4, 2, 1))

    def forward(self, x):
        q, commit = self.quantize(self.enc(x).permute(0, 2, 3, 1))
        return self.dec(q.permute(0, 3, 1, 2)), commit


def make_tiny_vqvae(**quantize) -> nn.Module:
    return TinyVQVAE(**quantize)
