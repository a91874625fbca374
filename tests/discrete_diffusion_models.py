"""Discrete diffusion written as MDLM, D3PM and SEDD code writes it, for
``test_discrete_diffusion``.

- ``MDLM``: masked diffusion over tokens with a log-linear schedule ``alpha_t = 1 - t`` (or
  the cosine one), a small transformer denoiser fed ``(x_t, sigma)`` with the [MASK] logit
  set to ``-inf`` (the SUBS parameterisation), and the continuous-time ELBO weight
  ``alpha_t' / (1 - alpha_t)`` over the masked, non-padded positions (``mdlm_loss``).
- ``D3PM``: a uniform/absorbing categorical process with transition matrices ``Q_t`` and
  their cumulative products ``Q_bar_t``; the loss is the KL between the true posterior
  ``q(x_{t-1} | x_t, x_0)`` (a normalised product of one-hot rows) and the model's.
- ``SEDD``: score entropy with the log-linear noise ``sigma(t) = -log(1 - (1 - eps) t)``; the
  absorbing transition's weight ``dsigma / expm1(sigma)``; ``score_entropy_logspace`` takes
  the ratio in log space with a ``log1mexp`` helper.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, MASK, PAD, LEN = 12, 11, 0, 10


class Denoiser(nn.Module):
    """A tiny DiT-style transformer: token + time embedding, one encoder layer, a head."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.time = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.block = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x_t, sigma, pad_mask):
        h = self.embed(x_t) + self.time(sigma[:, None])[:, None]
        h = self.block(h, src_key_padding_mask=pad_mask)
        return self.head(h)


def loglinear(t, eps: float = 1e-3):
    """MDLM's log-linear schedule: alpha_t = 1 - (1 - eps) t, its derivative, and sigma."""
    alpha = 1 - (1 - eps) * t
    return alpha, torch.full_like(t, -(1 - eps)), -torch.log(alpha)


def cosine(t):
    """alpha_t = cos(pi t / 2), as cosine masking schedules write it."""
    alpha = torch.cos(math.pi / 2 * t)
    return alpha, -math.pi / 2 * torch.sin(math.pi / 2 * t), -torch.log(alpha)


class MDLM(nn.Module):
    """Samples x_t from q(x_t | x_0) inside forward (per-sample t given by the loop), returns
    the SUBS log-probabilities and what the loss needs."""

    def __init__(self, schedule: str = "loglinear"):
        super().__init__()
        self.net = Denoiser()
        self.schedule = schedule

    def forward(self, x0, t, pad_mask):
        alpha, dalpha, sigma = (cosine if self.schedule == "cosine" else loglinear)(t)
        masked = (torch.rand(x0.shape) < (1 - alpha)[:, None]) & ~pad_mask
        x_t = torch.where(masked, torch.full_like(x0, MASK), x0)
        logits = self.net(x_t, sigma, pad_mask)
        logits[..., MASK] = float("-inf")  # SUBS: never predict [MASK]
        logp = logits.log_softmax(-1)
        return logp, masked, alpha, dalpha


def mdlm_loss(logp, masked, alpha, dalpha, x0):
    """The continuous-time NELBO: -alpha'/(1 - alpha) log p(x_0) over masked tokens."""
    weight = dalpha / (1 - alpha)
    nll = -logp.gather(-1, x0[..., None]).squeeze(-1)
    return (weight[:, None] * nll * masked).sum() / masked.sum().clamp_min(1)


def make_mdlm():
    torch.manual_seed(0)
    return MDLM()


def make_mdlm_cosine():
    torch.manual_seed(0)
    return MDLM("cosine")


def absorbing_q(beta):
    """Q_t = (1 - beta) I + beta 1 e_mask^T, one matrix per step."""
    eye = torch.eye(VOCAB)
    to_mask = torch.zeros(VOCAB, VOCAB)
    to_mask[:, MASK] = 1.0
    return (1 - beta)[:, None, None] * eye + beta[:, None, None] * to_mask


class D3PM(nn.Module):
    """Austin et al.'s D3PM with the absorbing kernel, T steps; the loop gives x_t and t."""

    def __init__(self, steps: int = 8):
        super().__init__()
        self.net = Denoiser()
        beta = 1.0 / (steps - torch.arange(steps, dtype=torch.float32))
        self.register_buffer("q", absorbing_q(beta))
        bars = [torch.eye(VOCAB)]
        for k in range(steps):
            bars.append(bars[-1] @ self.q[k])
        self.register_buffer("q_bar", torch.stack(bars))  # q_bar[k] = Q_1 ... Q_k

    def posterior(self, x_t, x0_probs, t):
        """q(x_{t-1} | x_t, x_0) ∝ Q_t[:, x_t] * (x_0 Q_bar_{t-1}), normalised."""
        fact1 = self.q[t - 1].transpose(1, 2)[torch.arange(len(t))[:, None], x_t]
        fact2 = x0_probs @ self.q_bar[t - 1]
        unnorm = fact1 * fact2
        return unnorm / unnorm.sum(-1, keepdim=True)

    def forward(self, x0, x_t, t, pad_mask):
        logits = self.net(x_t, t.float() / len(self.q), pad_mask)
        q_true = self.posterior(x_t, F.one_hot(x0, VOCAB).float(), t)
        p_model = self.posterior(x_t, logits.softmax(-1), t)
        return q_true, p_model


def d3pm_loss(q_true, p_model, pad_mask):
    kl = (q_true * (torch.log(q_true + 1e-20) - torch.log(p_model + 1e-20))).sum(-1)
    return (kl * ~pad_mask).sum() / (~pad_mask).sum()


def make_d3pm():
    torch.manual_seed(0)
    return D3PM()


def noise_absorbing(x0, t, steps, g):
    """x_t ~ q(x_t | x_0) of the absorbing kernel: masked with probability t / T."""
    masked = torch.rand(x0.shape, generator=g) < (t.float() / steps)[:, None]
    return torch.where(masked, torch.full_like(x0, MASK), x0)


class SEDD(nn.Module):
    """Lou et al.'s score entropy, absorbing graph: the model's log-scores at masked tokens."""

    def __init__(self, eps: float = 1e-3):
        super().__init__()
        self.net = Denoiser()
        self.eps = eps

    def forward(self, x0, t, pad_mask):
        sigma = -torch.log1p(-(1 - self.eps) * t)
        dsigma = (1 - self.eps) / (1 - (1 - self.eps) * t)
        move = 1 - torch.exp(-sigma)
        masked = (torch.rand(x0.shape) < move[:, None]) & ~pad_mask
        x_t = torch.where(masked, torch.full_like(x0, MASK), x0)
        log_score = self.net(x_t, sigma, pad_mask)
        # the absorbing graph's ratio p_t(y) / p_t(MASK) = 1 / expm1(sigma)
        esigm1 = torch.expm1(sigma)
        return log_score, masked, dsigma, esigm1


def score_entropy(log_score, masked, dsigma, esigm1, x0):
    """SEDD's DWDSE at masked positions: sum_y s_y - r log s_{x0} + K(r), r = 1/expm1."""
    ratio = 1 / esigm1[:, None]
    pos = log_score[..., :MASK].exp().sum(-1)
    neg = ratio * log_score.gather(-1, x0[..., None]).squeeze(-1)
    const = ratio * (ratio.log() - 1)
    loss = (pos - neg + const) * masked
    return (dsigma[:, None] * loss).sum() / masked.sum().clamp_min(1)


def log1mexp(x):
    """log(1 - exp(-x)), as log-space diffusion code writes it (no guard at x = 0)."""
    return torch.log(-torch.expm1(-x))


def score_entropy_logspace(log_score, masked, dsigma, esigm1, x0):
    """The same loss with the ratio exp(-sigma) / (1 - exp(-sigma)) taken in log space."""
    sigma = torch.log1p(esigm1)
    log_ratio = (-sigma - log1mexp(sigma))[:, None]
    ratio = log_ratio.exp()
    pos = log_score[..., :MASK].exp().sum(-1)
    neg = ratio * log_score.gather(-1, x0[..., None]).squeeze(-1)
    loss = (pos - neg + ratio * (log_ratio - 1)) * masked
    return (dsigma[:, None] * loss).sum() / masked.sum().clamp_min(1)


def make_sedd():
    torch.manual_seed(0)
    return SEDD()


def text_batch(g, n: int = 8):
    """Token ids 1..10 with right padding (PAD = 0), lengths 5..LEN, and the padding mask."""
    lengths = torch.randint(5, LEN + 1, (n,), generator=g)
    x0 = torch.randint(1, MASK, (n, LEN), generator=g)
    pad_mask = torch.arange(LEN)[None] >= lengths[:, None]
    return x0.masked_fill(pad_mask, PAD), pad_mask
