"""Imitation learning as imitation / stable-baselines3 / robomimic write it, for
``test_imitation_learning``.

- ``GaussianPolicy``: behaviour cloning's MLP actor with a state-independent ``log_std``
  parameter (SB3's ``DiagGaussianDistribution``) or a clamped per-state head (SAC's actor);
  ``squashed_nll`` is the tanh-squashed Gaussian's negative log-likelihood of the expert's
  actions: ``u = atanh(a)`` inverts the squash, minus ``log(1 - tanh(u)^2 + eps)``, the NLL
  summed over action dims and averaged over the valid (unpadded) steps of each demo.
- ``GMMPolicy``: robomimic's ``GMMActorNetwork``: per-mode means, ``softplus`` stds plus a
  ``min_std`` floor, mixture logits, the log-likelihood of a ``MixtureSameFamily`` written
  with ``logsumexp``.
- ``TransformerPolicy``: robomimic's BC-Transformer: the demo's frames embedded with a
  learned position, a causal ``nn.TransformerEncoder`` given the padding as
  ``src_key_padding_mask``, a Gaussian head at every step.
- ``NoisePredictor``: Diffusion Policy's noise-prediction head over (state, noisy action,
  timestep) with a DDPM schedule rescaled to zero terminal SNR (Lin et al.'s
  ``rescale_zero_terminal_snr``) and the min-SNR-gamma loss weight.
- ``Discriminator``: GAIL / AIRL's discriminator ``D(s, a)`` trained with BCE on expert
  against policy pairs, and the reward ``-log(1 - D)`` written with ``sigmoid``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

OBS, ACT, HIDDEN = 6, 2, 32


def mlp(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, o))


class GaussianPolicy(nn.Module):
    """BC actor: ``mu(s)`` and SB3's state-independent ``log_std`` (``clamp`` None: unclamped)."""

    def __init__(self, clamp: tuple[float, float] | None = (-20.0, 2.0)):
        super().__init__()
        self.mu = mlp(OBS, ACT)
        self.log_std = nn.Parameter(torch.zeros(ACT))
        self.clamp = clamp

    def forward(self, obs):
        log_std = self.log_std
        if self.clamp is not None:
            log_std = log_std.clamp(*self.clamp)
        return self.mu(obs), log_std.expand(*obs.shape[:-1], ACT)


def make_policy() -> GaussianPolicy:
    torch.manual_seed(0)
    return GaussianPolicy()


def make_policy_unclamped() -> GaussianPolicy:
    torch.manual_seed(0)
    return GaussianPolicy(clamp=None)


def gaussian_logp(mu, log_std, x):
    """The diagonal Gaussian's log-density, written out as SB3's ``sum_independent_dims``
    of ``Normal.log_prob``."""
    std = log_std.exp()
    return (-((x - mu) ** 2) / (2 * std ** 2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)


def squashed_nll(out, actions, mask=None, eps: float = 1e-6, clip: float | None = None):
    """Tanh-squashed Gaussian NLL of the expert's actions in ``[-1, 1]`` (SB3's
    ``SquashedDiagGaussianDistribution.log_prob``). ``clip`` keeps the inverse off the bound
    (``TanhBijector.inverse``'s ``clamp(-1 + eps, 1 - eps)``); None inverts as is. ``mask``
    ``(B, T)`` averages each demo over its valid steps."""
    mu, log_std = out
    if clip is not None:
        actions = actions.clamp(-1.0 + clip, 1.0 - clip)
    u = torch.atanh(actions)  # the bug without clip: atanh(+-1) = +-inf
    logp = gaussian_logp(mu, log_std, u) - torch.log(1 - torch.tanh(u) ** 2 + eps).sum(-1)
    nll = -logp
    if mask is None:
        return nll.mean()
    m = mask.float()
    return ((nll * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


class GMMPolicy(nn.Module):
    """robomimic's ``GMMActorNetwork``: ``num_modes`` Gaussians, ``softplus`` stds plus
    ``min_std`` (0: no floor), the means squashed by ``tanh``."""

    def __init__(self, modes: int = 5, min_std: float = 0.01):
        super().__init__()
        self.modes, self.min_std = modes, min_std
        self.trunk = nn.Sequential(nn.Linear(OBS, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                                   nn.ReLU())
        self.mean = nn.Linear(HIDDEN, modes * ACT)
        self.scale = nn.Linear(HIDDEN, modes * ACT)
        self.logits = nn.Linear(HIDDEN, modes)

    def forward(self, obs):
        h = self.trunk(obs)
        means = torch.tanh(self.mean(h)).view(-1, self.modes, ACT)
        scales = F.softplus(self.scale(h)).view(-1, self.modes, ACT) + self.min_std
        return means, scales, self.logits(h)


def make_gmm() -> GMMPolicy:
    torch.manual_seed(0)
    return GMMPolicy()


def make_gmm_no_floor() -> GMMPolicy:
    torch.manual_seed(0)
    return GMMPolicy(min_std=0.0)


def gmm_nll(out, actions):
    """``-MixtureSameFamily(Categorical(logits), Independent(Normal(means, scales), 1))
    .log_prob(actions)``, written as robomimic's distribution computes it."""
    means, scales, logits = out
    a = actions.unsqueeze(1)
    z = (a - means) / scales  # the bug without min_std: a scale underflowed to 0
    comp = (-0.5 * z ** 2 - scales.log() - 0.5 * math.log(2 * math.pi)).sum(-1)
    return -torch.logsumexp(comp + logits.log_softmax(-1), -1).mean()


class TransformerPolicy(nn.Module):
    """BC-Transformer over ``(B, T, OBS)`` frames; ``pad`` (B, T) True at padded steps."""

    def __init__(self, max_len: int = 8, d: int = 32):
        super().__init__()
        self.embed = nn.Linear(OBS, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.mu = nn.Linear(d, ACT)
        self.log_std = nn.Linear(d, ACT)

    def forward(self, obs, pad):
        t = obs.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)  # (True: not attended)
        h = self.encoder(self.embed(obs) + self.pos[:t], mask=causal, src_key_padding_mask=pad)
        return self.mu(h), self.log_std(h).clamp(-20.0, 2.0)


def make_transformer() -> TransformerPolicy:
    torch.manual_seed(0)
    return TransformerPolicy()


STEPS = 20  # diffusion timesteps


class NoisePredictor(nn.Module):
    """``eps(s, a_t, t)``: an MLP on the state, the noisy action and a sinusoidal embedding."""

    def __init__(self, emb: int = 8):
        super().__init__()
        self.emb = emb
        self.net = mlp(OBS + ACT + emb, ACT)

    def forward(self, obs, noisy, t):
        freqs = torch.exp(-math.log(1000.0) * torch.arange(self.emb // 2) / (self.emb // 2))
        ang = t[:, None].float() * freqs
        return self.net(torch.cat([obs, noisy, ang.sin(), ang.cos()], -1))


def make_noise_predictor() -> NoisePredictor:
    torch.manual_seed(0)
    return NoisePredictor()


def alphas_cumprod(zero_terminal_snr: bool) -> torch.Tensor:
    """The ``squaredcos_cap_v2`` schedule; rescaled (diffusers' ``rescale_zero_terminal_snr``)
    its last ``alpha_bar`` is exactly 0."""
    t = torch.arange(STEPS + 1, dtype=torch.float64) / STEPS
    f = torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
    sqrt_ab = torch.cumprod(1 - betas, 0).sqrt()
    if zero_terminal_snr:
        first, last = sqrt_ab[0].clone(), sqrt_ab[-1].clone()
        sqrt_ab = (sqrt_ab - last) * first / (first - last)
    return (sqrt_ab ** 2).float()


def min_snr_loss(pred, noise, t, alphas_cumprod, gamma: float = 5.0):
    """Epsilon-prediction MSE weighted by min-SNR-gamma: ``min(snr, gamma) / snr``."""
    ab = alphas_cumprod[t]
    snr = ab / (1 - ab)
    w = snr.clamp(max=gamma) / snr  # the bug at zero terminal SNR: 0 / 0 where t = T - 1
    return (w * ((pred - noise) ** 2).mean(-1)).mean()


class Discriminator(nn.Module):
    """GAIL's ``D(s, a)``: the logit of "expert" for a state-action pair."""

    def __init__(self):
        super().__init__()
        self.net = mlp(OBS + ACT, 1)

    def forward(self, obs, act):
        return self.net(torch.cat([obs, act], -1)).squeeze(-1)


def make_discriminator() -> Discriminator:
    torch.manual_seed(0)
    return Discriminator()


def gail_bce(logits, is_expert, naive: bool = False):
    """The discriminator's BCE; ``naive`` writes it as imitation's early ``-log D`` /
    ``-log(1 - D)`` with ``sigmoid`` (D saturates to exactly 1 in float32 past logit ~17)."""
    if not naive:
        return F.binary_cross_entropy_with_logits(logits, is_expert)
    d = torch.sigmoid(logits)
    return -(is_expert * torch.log(d) + (1 - is_expert) * torch.log(1 - d)).mean()  # the bug


def airl_reward(logits, naive: bool = False):
    """AIRL's reward ``log D - log(1 - D)``, the logit itself; ``naive`` writes it with
    ``sigmoid`` (D rounded to 1: ``-log(0)`` is +inf)."""
    if not naive:
        return logits
    d = torch.sigmoid(logits)
    return torch.log(d) - torch.log(1 - d)  # the bug: D saturates to 1 in float32


def pg_loss(out, actions, rewards):
    """The learner's policy-gradient step on the discriminator's rewards: advantages
    normalised over the batch, the squashed Gaussian's log-likelihood of its own actions."""
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
    logp = -squashed_nll_rows(out, actions)
    return -(adv * logp).mean()


def squashed_nll_rows(out, actions, eps: float = 1e-6):
    mu, log_std = out
    u = torch.atanh(actions.clamp(-1 + eps, 1 - eps))
    return -(gaussian_logp(mu, log_std, u) - torch.log(1 - torch.tanh(u) ** 2 + eps).sum(-1))
