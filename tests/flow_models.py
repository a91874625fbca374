"""Normalizing flows and VAEs as their repositories write them, for ``test_flows``: RealNVP's
logit preprocessing of dequantized pixels and its affine couplings, Glow's invertible 1x1
convolution with its ``slogdet`` and sigmoid-scaled couplings, a VAE's reparameterisation with
a hand-written Bernoulli likelihood and KL, IWAE's ``logsumexp`` over importance weights, and
a VAE whose forward returns ``torch.distributions`` objects."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import distributions as D
from torch import nn

D_X, D_Z, HIDDEN = 16, 4, 32


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_X, HIDDEN), nn.ReLU())
        self.mu, self.logvar = nn.Linear(HIDDEN, D_Z), nn.Linear(HIDDEN, D_Z)

    def forward(self, x):
        h = self.body(x)
        return self.mu(h), self.logvar(h)


class VAE(nn.Module):
    """Kingma & Welling's VAE (the pytorch/examples one): ``forward`` returns the decoder's
    logits, ``mu`` and ``logvar``."""

    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = nn.Sequential(nn.Linear(D_Z, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D_X))

    def forward(self, x):
        mu, logvar = self.encoder(x)
        std = torch.exp(0.5 * logvar)
        z = mu + std * torch.randn_like(std)
        return self.decoder(z), mu, logvar


def make_vae() -> nn.Module:
    torch.manual_seed(0)
    return VAE()


def handwritten_bce_vae_loss(out, x):
    """The Bernoulli log-likelihood written out by hand on the sigmoid's probabilities."""
    logits, mu, logvar = out
    p = torch.sigmoid(logits)
    rec = -(x * torch.log(p) + (1 - x) * torch.log(1 - p)).sum(1)
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), 1)
    return (rec + kld).mean()


def distributions_vae_loss(out, x):
    """The same ELBO through torch.distributions (validate_args at its default)."""
    logits, mu, logvar = out
    q = D.Independent(D.Normal(mu, torch.exp(0.5 * logvar)), 1)
    p = D.Independent(D.Normal(torch.zeros_like(mu), torch.ones_like(mu)), 1)
    rec = D.Independent(D.Bernoulli(logits=logits), 1).log_prob(x)
    return (D.kl_divergence(q, p) - rec).mean()


class IWAE(nn.Module):
    """Burda et al.'s importance-weighted bound: K posterior samples per input; ``forward``
    returns the (K, B) log importance weights, the Bernoulli likelihood written on the
    decoder's probabilities."""

    def __init__(self, k: int = 5):
        super().__init__()
        self.vae, self.k = VAE(), k

    def forward(self, x):
        mu, logvar = self.vae.encoder(x)
        std = torch.exp(0.5 * logvar)
        z = mu + std * torch.randn(self.k, *mu.shape)
        p = torch.sigmoid(self.vae.decoder(z))
        log_px = (x * torch.log(p) + (1 - x) * torch.log1p(-p)).sum(-1)
        log_pz = (-0.5 * z ** 2 - 0.5 * math.log(2 * math.pi)).sum(-1)
        log_qz = D.Normal(mu, std).log_prob(z).sum(-1)
        return log_px + log_pz - log_qz


def make_iwae(**kw) -> nn.Module:
    torch.manual_seed(0)
    return IWAE(**kw)


def iwae_loss(log_w):
    k = log_w.shape[0]
    return -(torch.logsumexp(log_w, 0) - math.log(k)).mean()


# ---------------------------------------------------------------------------------------------
# flows


class Coupling(nn.Module):
    """RealNVP's affine coupling with a tanh-bounded log-scale."""

    def __init__(self, d: int = D_X, flip: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d // 2, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, d))
        self.scale = nn.Parameter(torch.ones(1))
        self.flip = flip

    def forward(self, x):
        a, b = x.chunk(2, 1)
        if self.flip:
            a, b = b, a
        s, t = self.net(a).chunk(2, 1)
        s = self.scale * torch.tanh(s)
        b = b * torch.exp(s) + t
        return (torch.cat([b, a], 1) if self.flip else torch.cat([a, b], 1)), s.sum(1)


class RealNVP(nn.Module):
    """Pixels in [0, 1] through RealNVP's logit preprocessing, then couplings; ``forward``
    returns z and the log-determinant (the preprocessing's included)."""

    def __init__(self, alpha: float = 0.05, n: int = 4, torch_logit: bool = False):
        super().__init__()
        self.alpha, self.torch_logit = alpha, torch_logit
        self.layers = nn.ModuleList(Coupling(flip=i % 2 == 1) for i in range(n))

    def forward(self, x):
        y = self.alpha + (1 - 2 * self.alpha) * x
        z = torch.logit(y) if self.torch_logit else torch.log(y) - torch.log1p(-y)
        logdet = (-torch.log(y) - torch.log1p(-y) + math.log(1 - 2 * self.alpha)).sum(1)
        for layer in self.layers:
            z, ld = layer(z)
            logdet = logdet + ld
        return z, logdet


def make_realnvp(**kw) -> nn.Module:
    torch.manual_seed(0)
    return RealNVP(**kw)


def flow_nll(z, logdet):
    """The negative log-likelihood under a standard normal base, in nats per dimension."""
    log_pz = D.Normal(0.0, 1.0).log_prob(z).sum(1)
    return -(log_pz + logdet).mean() / z.shape[1]


class InvConv1x1(nn.Module):
    """Glow's invertible 1x1 convolution (the non-LU version): a random rotation, its
    log-determinant by ``slogdet`` times the number of pixels."""

    def __init__(self, c: int):
        super().__init__()
        w = torch.linalg.qr(torch.randn(c, c))[0]
        self.weight = nn.Parameter(w.unsqueeze(2).unsqueeze(3))

    def forward(self, x):
        _, _, h, w = x.shape
        logdet = h * w * torch.slogdet(self.weight.squeeze().double())[1].float()
        return F.conv2d(x, self.weight), logdet.expand(x.shape[0])


class GlowStep(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = InvConv1x1(c)
        self.net = nn.Sequential(nn.Conv2d(c // 2, 16, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(16, c, 3, padding=1))

    def forward(self, x):
        x, logdet = self.conv(x)
        a, b = x.chunk(2, 1)
        log_s, t = self.net(a).chunk(2, 1)
        s = torch.sigmoid(log_s + 2)  # Glow's affine coupling
        b = (b + t) * s
        return torch.cat([a, b], 1), logdet + torch.log(s).flatten(1).sum(1)


class Glow(nn.Module):
    def __init__(self, c: int = 4, n: int = 2):
        super().__init__()
        self.steps = nn.ModuleList(GlowStep(c) for _ in range(n))

    def forward(self, x):
        logdet = torch.zeros(x.shape[0])
        for step in self.steps:
            x, ld = step(x)
            logdet = logdet + ld
        return x.flatten(1), logdet


def make_glow(**kw) -> nn.Module:
    torch.manual_seed(0)
    return Glow(**kw)


class DistVAE(nn.Module):
    """A VAE whose forward returns distributions (scvi-tools, Pyro-style code): the
    likelihood p(x|z) and the posterior q(z|x), both ``torch.distributions`` objects."""

    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = nn.Sequential(nn.Linear(D_Z, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D_X))
        self.tau = 1.0  # the decoder's temperature, which the loop anneals

    def forward(self, x):
        mu, logvar = self.encoder(x)
        qz = D.Independent(D.Normal(mu, torch.exp(0.5 * logvar)), 1)
        z = qz.rsample()
        return D.Independent(D.Bernoulli(logits=self.decoder(z) / self.tau), 1), qz


def make_dist_vae() -> nn.Module:
    torch.manual_seed(0)
    return DistVAE()


def elbo_loss(px, qz, x):
    prior = D.Independent(D.Normal(torch.zeros_like(qz.mean), torch.ones_like(qz.mean)), 1)
    return (D.kl_divergence(qz, prior) - px.log_prob(x)).mean()
