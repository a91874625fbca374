"""Neural SDEs written by hand, as torchsde's examples, Li et al.'s latent SDE and Song et al.'s
score SDEs write them in plain torch, for ``test_neural_sdes``.

- ``LatentSDE``: a GRU encoder's context, posterior drift ``f(t, z, ctx)``, prior drift ``h``
  and a diagonal diffusion ``g(z)``; Euler-Maruyama over each batch's observation grid with
  ``dW = sqrt(dt) * randn``, the path KL ``0.5 * |(f - h) / g|^2 dt`` summed along the path, and
  a Gaussian emission's log-likelihood. ``diffusion="relu"`` is the bug: a ReLU diffusion is
  exactly 0 where its pre-activation is negative, and the KL divides by it.
- ``IrregularSDE``: a neural SDE fitted to irregularly sampled series by the normalised
  increments' likelihood ``(x_{k+1} - x_k - f dt) / (g sqrt(dt))``; a duplicated timestamp
  makes ``dt = 0`` for that record.
- ``ScoreNet``: a score-based model with a variance-exploding schedule
  ``sigma(t) = sigma_min (sigma_max / sigma_min) ** t`` and denoising score matching;
  ``sigma_min = 0`` makes ``sigma(t) = 0 * inf ** t``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# latent SDE (Li et al. 2020, torchsde's examples/latent_sde.py)


class LatentSDE(nn.Module):
    def __init__(self, obs: int = 2, latent: int = 4, ctx: int = 8, hidden: int = 16,
                 diffusion: str = "softplus"):
        super().__init__()
        self.encoder = nn.GRU(obs, ctx, batch_first=True)
        self.qz0 = nn.Linear(ctx, 2 * latent)
        self.f_net = nn.Sequential(nn.Linear(latent + ctx, hidden), nn.Softplus(),
                                   nn.Linear(hidden, latent))
        self.h_net = nn.Sequential(nn.Linear(latent, hidden), nn.Softplus(),
                                   nn.Linear(hidden, latent))
        self.g_net = nn.Linear(latent, latent)  # diagonal noise, one net for all dims
        self.decoder = nn.Linear(latent, obs)
        self.diffusion = diffusion
        self.pz0_mean = nn.Parameter(torch.zeros(1, latent))
        self.pz0_logstd = nn.Parameter(torch.zeros(1, latent))

    def g(self, z):
        u = self.g_net(z)
        if self.diffusion == "relu":
            return F.relu(u)  # the bug: exactly 0 wherever u < 0
        return F.softplus(u) + 1e-3

    def forward(self, xs, ts, noise):
        """xs (B, T, obs); ts (T,) the observation times; noise (T - 1, B, latent) standard
        normal draws from the loop's Generator. Returns (decoded path, KL)."""
        ctx = self.encoder(torch.flip(xs, dims=(1,)))[0][:, -1]
        mean, logstd = self.qz0(ctx).chunk(2, dim=1)
        z = mean + logstd.exp() * noise[0]
        kl0 = (self.pz0_logstd - logstd
               + (logstd.exp() ** 2 + (mean - self.pz0_mean) ** 2)
               / (2 * self.pz0_logstd.exp() ** 2) - 0.5).sum(1)
        zs, log_ratio = [z], torch.zeros_like(kl0)
        for k in range(len(ts) - 1):
            dt = ts[k + 1] - ts[k]
            f = self.f_net(torch.cat([z, ctx], 1))
            h, g = self.h_net(z), self.g(z)
            u = (f - h) / g  # the latent SDE's KL integrand
            log_ratio = log_ratio + 0.5 * (u ** 2).sum(1) * dt
            z = z + f * dt + g * math.sqrt(dt) * noise[k + 1]
            zs.append(z)
        return self.decoder(torch.stack(zs, 1)), kl0 + log_ratio


def make_latent() -> LatentSDE:
    torch.manual_seed(0)
    return LatentSDE()


def make_latent_relu() -> LatentSDE:
    torch.manual_seed(0)
    return LatentSDE(diffusion="relu")


def latent_loss(pred, kl, xs, noise_std: float = 0.1, kl_weight: float = 1.0):
    """The negative ELBO: a Gaussian emission's log-likelihood summed over the path, plus KL."""
    log_px = (-0.5 * ((xs - pred) / noise_std) ** 2 - math.log(noise_std)
              - 0.5 * math.log(2 * math.pi)).sum((1, 2))
    return (-log_px + kl_weight * kl).mean()


def sine_batch(g: torch.Generator, n: int = 16, steps: int = 10, latent: int = 4):
    """Noisy sines of random phase on a grid of ``steps`` times in [0, 1]; the path noise."""
    ts = torch.linspace(0, 1, steps)
    phase = torch.rand(n, 1, generator=g) * 6
    xs = torch.stack([torch.sin(ts * 4 + phase), torch.cos(ts * 4 + phase)], -1)
    xs = xs + 0.05 * torch.randn(xs.shape, generator=g)
    noise = torch.randn(steps, n, latent, generator=g)
    return xs, ts, noise


# ---------------------------------------------------------------------------------------------
# neural SDE fitted by the normalised increments of irregular series


class IrregularSDE(nn.Module):
    def __init__(self, dim: int = 2, hidden: int = 16):
        super().__init__()
        self.drift = nn.Sequential(nn.Linear(dim + 1, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.diffusion = nn.Sequential(nn.Linear(dim + 1, hidden), nn.Tanh(),
                                       nn.Linear(hidden, dim), nn.Sigmoid())

    def forward(self, xs, ts):
        """xs (B, T, dim), ts (B, T) each record's own observation times: the normalised
        increments of the Euler-Maruyama transition, and log g."""
        x, t = xs[:, :-1], ts[:, :-1, None]
        inp = torch.cat([x, t], -1)
        f, g = self.drift(inp), self.diffusion(inp) + 1e-2
        dt = (ts[:, 1:] - ts[:, :-1])[..., None]
        eps = (xs[:, 1:] - x - f * dt) / (g * dt.sqrt())  # the bug: dt = 0 at a duplicated time
        return eps, g.log()


def make_irregular() -> IrregularSDE:
    torch.manual_seed(0)
    return IrregularSDE()


def increment_nll(eps, log_g, mask):
    """-log N(increment; f dt, g^2 dt) up to the dt term, over the observed transitions."""
    nll = 0.5 * eps ** 2 + log_g
    return (nll.sum(-1) * mask).sum() / mask.sum()


def irregular_batch(g: torch.Generator, n: int = 16, steps: int = 12,
                    duplicate: int | None = None):
    """Ornstein-Uhlenbeck paths at sorted random times; ``duplicate``: that record's third
    timestamp logged twice (a sensor's repeated row), its value jittered."""
    ts = torch.sort(torch.rand(n, steps, generator=g), dim=1).values
    ts[:, 0] = 0.0
    xs = torch.zeros(n, steps, 2)
    xs[:, 0] = torch.randn(n, 2, generator=g)
    for k in range(1, steps):
        dt = (ts[:, k] - ts[:, k - 1])[:, None]
        xs[:, k] = xs[:, k - 1] - xs[:, k - 1] * dt \
            + 0.3 * dt.sqrt() * torch.randn(n, 2, generator=g)
    if duplicate is not None:
        ts[duplicate, 3] = ts[duplicate, 2]
        xs[duplicate, 3] = xs[duplicate, 2] + 0.01
    return xs, ts, torch.ones(n, steps - 1)


# ---------------------------------------------------------------------------------------------
# score-based model, variance-exploding SDE (Song et al. 2021)


class ScoreNet(nn.Module):
    def __init__(self, dim: int = 2, hidden: int = 32, sigma_min: float = 0.01,
                 sigma_max: float = 10.0):
        super().__init__()
        # the schedule's ends as a buffer, so they follow the model to its device and dtype
        self.register_buffer("sigma_range", torch.tensor([sigma_min, sigma_max]))
        self.embed = nn.Linear(1, hidden)
        self.net = nn.Sequential(nn.Linear(dim + hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, dim))

    def sigma(self, t):
        lo, hi = self.sigma_range
        return lo * (hi / lo) ** t  # the bug: sigma_min = 0 makes hi / lo infinite

    def forward(self, x, t, z):
        """Denoising score matching's perturbed input and the network's score at it, divided
        by sigma(t) as the NCSN++ output layer does."""
        std = self.sigma(t)[:, None]
        x_t = x + std * z
        emb = torch.sin(self.embed(std.log()))  # the noise-level embedding of log sigma
        score = self.net(torch.cat([x_t, emb], 1)) / std
        return score, std


def make_score() -> ScoreNet:
    torch.manual_seed(0)
    return ScoreNet()


def make_score_zero_min() -> ScoreNet:
    torch.manual_seed(0)
    return ScoreNet(sigma_min=0.0)


def dsm_loss(score, std, z):
    """Song et al.'s weighted loss lambda(t) = sigma^2: |sigma s + z|^2."""
    return ((score * std + z) ** 2).sum(1).mean()


def two_moons(g: torch.Generator, n: int = 32, eps: float = 1e-5):
    """Two moons, times in [eps, 1] (the VE SDE's sampling interval), the perturbation noise."""
    theta = torch.rand(n, generator=g) * math.pi
    side = (torch.rand(n, generator=g) > 0.5).float()
    x = torch.stack([torch.cos(theta) + side, torch.sin(theta) * (1 - 2 * side) + side * 0.5], 1)
    t = eps + (1 - eps) * torch.rand(n, generator=g)
    return x, t, torch.randn(n, 2, generator=g)


# ---------------------------------------------------------------------------------------------
# Euler-Maruyama over each record's own times, a double-well drift


class DoubleWellSDE(nn.Module):
    """dX = (net(X) + a X - b X^3) dt + sigma dW, rolled out by Euler-Maruyama from each
    record's first observation over its own observation times."""

    def __init__(self, dim: int = 2, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.a, self.b = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
        self.log_sigma = nn.Parameter(torch.full((dim,), -2.0))

    def forward(self, x0, ts, noise):
        """x0 (B, dim), ts (B, T), noise (B, T - 1, dim): the path at the times, (B, T, dim)."""
        x, xs = x0, [x0]
        for k in range(ts.shape[1] - 1):
            dt = (ts[:, k + 1] - ts[:, k])[:, None]
            drift = self.net(x) + self.a * x - self.b * x ** 3  # the cubic blows up for a big dt
            x = x + drift * dt + self.log_sigma.exp() * dt.sqrt() * noise[:, k]
            xs.append(x)
        return torch.stack(xs, 1)


def make_double_well() -> DoubleWellSDE:
    torch.manual_seed(0)
    return DoubleWellSDE()


def well_batch(g: torch.Generator, n: int = 16, steps: int = 8, minutes: int | None = None):
    """Paths observed at sorted times in hours over [0, 1]; ``minutes``: that record's times
    logged in minutes (60 times larger), its values the same."""
    ts = torch.sort(torch.rand(n, steps, generator=g), dim=1).values
    ts[:, 0] = 0.0
    x0 = torch.randn(n, 2, generator=g).sign()
    target = x0[:, None] + 0.1 * torch.randn(n, steps, 2, generator=g)
    noise = torch.randn(n, steps - 1, 2, generator=g)
    if minutes is not None:
        ts[minutes] = ts[minutes] * 60
    return (x0, ts, noise), target


def path_mse(path, target):
    return F.mse_loss(path, target)


# ---------------------------------------------------------------------------------------------
# score-based model, variance-preserving SDE on discrete times


class VPScoreNet(nn.Module):
    """Song et al.'s VP SDE (beta(t) linear in [0.1, 20]): the marginal std
    ``sqrt(1 - exp(-int beta))``, and the network's output over it as the score."""

    def __init__(self, dim: int = 2, hidden: int = 32, beta_min: float = 0.1,
                 beta_max: float = 20.0):
        super().__init__()
        self.beta_min, self.beta_max = beta_min, beta_max
        self.net = nn.Sequential(nn.Linear(dim + 1, hidden), nn.SiLU(),
                                 nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, dim))

    def forward(self, x, t, z):
        log_mean = -0.25 * t ** 2 * (self.beta_max - self.beta_min) - 0.5 * t * self.beta_min
        std = (1.0 - torch.exp(2.0 * log_mean)).sqrt()[:, None]  # 0 at t = 0
        x_t = torch.exp(log_mean)[:, None] * x + std * z
        score = self.net(torch.cat([x_t, t[:, None]], 1)) / std
        return score, std


def make_vp() -> VPScoreNet:
    torch.manual_seed(0)
    return VPScoreNet()


def discrete_moons(g: torch.Generator, n: int = 32, steps: int = 1000):
    """Two moons at DDPM-style discrete times ``randint(0, N) / N``: t = 0 can be drawn."""
    x, _, z = two_moons(g, n)
    t = torch.randint(0, steps, (n,), generator=g) / steps
    return x, t, z
