"""A set VAE whose posterior is a ``torch.distributions.Normal`` built in the model's own
``forward`` (the reparameterisation trick of pytorch/examples' VAE, over sets as DeepSets-style
encoders write it): per-element heads (``nn.Linear``), pooled over the set's valid elements by
the mask passed into ``forward``, on the root's own lines, which no module output shows. For
``test_distribution_refusals.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical, Normal, kl_divergence

BATCH, ELEMENTS, FEATURES, LATENT = 8, 5, 6, 4


class SetVAE(nn.Module):
    def __init__(self, scale: str = "softplus"):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU())
        self.mu = nn.Linear(32, LATENT)
        self.s = nn.Linear(32, LATENT)
        self.dec = nn.Linear(LATENT, FEATURES)
        self.scale = scale

    def forward(self, x, m):
        h = self.enc(x)  # (B, N, 32)
        w = m.unsqueeze(-1)
        mu = (self.mu(h) * w).sum(1) / w.sum(1)  # mean over the valid elements
        s = (self.s(h) * w).sum(1) / w.sum(1)
        scale = F.softplus(s) if self.scale == "softplus" else s
        q = Normal(mu, scale)
        z = q.rsample()
        kl = kl_divergence(q, Normal(torch.zeros_like(mu), torch.ones_like(mu))).sum(-1)
        return self.dec(z), kl


def make_set_vae(scale: str = "softplus") -> SetVAE:
    torch.manual_seed(0)
    return SetVAE(scale)


def set_vae_loss(out, target):
    recon, kl = out
    return F.mse_loss(recon, target) + kl.mean()


def batch(g: torch.Generator, empty: int | None = None, scale_of: dict | None = None):
    """A batch of sets, ``m`` marking each one's valid elements (at least two), the target
    each set's mean; ``empty``: a set with no valid element; ``scale_of``: {row: factor}."""
    x = torch.randn(BATCH, ELEMENTS, FEATURES, generator=g)
    for row, k in (scale_of or {}).items():
        x[row] *= k
    m = (torch.rand(BATCH, ELEMENTS, generator=g) < 0.7).float()
    m[:, :2] = 1.0
    if empty is not None:
        m[empty] = 0.0
    target = (x * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp_min(1.0)
    return x, m, target


class MaskedPolicy(nn.Module):
    """An RL policy over discrete actions, illegal ones masked to -inf (MAPPO's ACTLayer);
    its rollouts run it under ``torch.no_grad()``."""

    def __init__(self, obs: int = 6, actions: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs, 16), nn.Tanh(), nn.Linear(16, actions))

    def forward(self, obs, avail):
        logits = self.net(obs).masked_fill(avail == 0, float("-inf"))
        return Categorical(logits=logits)


def make_policy() -> MaskedPolicy:
    torch.manual_seed(0)
    return MaskedPolicy()
