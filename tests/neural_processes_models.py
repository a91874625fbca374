"""Neural processes written by hand, as the DeepMind NP notebooks, Le et al.'s ANP and the
``neural-process-family`` code write them, for ``test_neural_processes``.

- ``CNP``: a conditional NP; an MLP encoder of each (x, y) context pair, the masked mean over
  the context points (``sum / count``, the context set padded in the batch with a 0/1 mask),
  a decoder of (r, x_target) giving a Gaussian with ``sigma = 0.1 + 0.9 * softplus(.)``.
- ``LatentNP``: the latent NP; a deterministic path and a latent path whose posterior
  q(z | C, T) and prior q(z | C) are diagonal Gaussians, z drawn by reparameterisation, the
  ELBO's KL between them in closed form (``log(s_p / s_q)`` of the two scales).
- ``AttentiveNP``: the ANP's deterministic path, multi-head cross-attention from the targets
  to the contexts with the padded context points masked out (``key_padding_mask``).
- ``GPTasks``: a meta-training ``Dataset`` of functions drawn from a GP with an RBF kernel
  (Cholesky of ``K + jitter I``), each task split into a context and a target set of its own
  size, padded by ``collate``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def masked_mean(h, mask):
    """The mean over the context points each task really has (mask 1) of ``h (B, N, D)``."""
    return (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # the bug: 0/0, no context


def masked_mean_clamped(h, mask):
    return (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp_min(1.0)


class Decoder(nn.Module):
    """(r, x_target) -> Gaussian mean and scale with the usual floor."""

    def __init__(self, r_dim: int, hidden: int = 32, floor: bool = True):
        super().__init__()
        self.net = mlp([r_dim + 1, hidden, hidden, 2])
        self.floor = floor

    def forward(self, r, x_t):
        out = self.net(torch.cat([r, x_t], -1))
        mu, raw = out.chunk(2, -1)
        if self.floor:
            return mu, 0.1 + 0.9 * F.softplus(raw)
        return mu, F.softplus(raw)  # the bug: no floor, softplus underflows to 0 for raw << 0


class CNP(nn.Module):
    def __init__(self, hidden: int = 32, clamp: bool = False, floor: bool = True):
        super().__init__()
        self.encoder = mlp([2, hidden, hidden, hidden])
        self.decoder = Decoder(hidden, hidden, floor)
        self.clamp = clamp

    def forward(self, x_c, y_c, mask_c, x_t):
        h = self.encoder(torch.cat([x_c, y_c], -1))
        r = (masked_mean_clamped if self.clamp else masked_mean)(h, mask_c)
        return self.decoder(r[:, None].expand(-1, x_t.shape[1], -1), x_t)


def gaussian_nll(mu, sigma, y_t, mask_t):
    """The negative log-likelihood of the targets, averaged over each task's real targets."""
    ll = torch.distributions.Normal(mu, sigma, validate_args=False).log_prob(y_t).squeeze(-1)
    return -((ll * mask_t).sum(1) / mask_t.sum(1)).mean()


class LatentEncoder(nn.Module):
    """Mean-aggregated (x, y) pairs -> the diagonal Gaussian of z (mean, scale)."""

    def __init__(self, hidden: int = 32, z_dim: int = 8, floor: float = 0.1):
        super().__init__()
        self.net = mlp([2, hidden, hidden])
        self.head = nn.Linear(hidden, 2 * z_dim)
        self.floor = floor

    def forward(self, x, y, mask):
        s = masked_mean_clamped(self.net(torch.cat([x, y], -1)), mask)
        mu, raw = self.head(s).chunk(2, -1)
        return mu, self.floor + (1 - self.floor) * torch.sigmoid(raw)


class LatentNP(nn.Module):
    """Returns (mu, sigma) of the targets and the KL(q(z|C,T) || q(z|C)) of each task."""

    def __init__(self, hidden: int = 32, z_dim: int = 8, floor: float = 0.1):
        super().__init__()
        self.det = mlp([2, hidden, hidden])
        self.latent = LatentEncoder(hidden, z_dim, floor)
        self.decoder = Decoder(hidden + z_dim, hidden)

    def forward(self, x_c, y_c, mask_c, x_t, y_t, mask_t):
        r = masked_mean_clamped(self.det(torch.cat([x_c, y_c], -1)), mask_c)
        prior = self.latent(x_c, y_c, mask_c)
        # the posterior sees the context and the targets (targets include the context)
        post = self.latent(torch.cat([x_c, x_t], 1), torch.cat([y_c, y_t], 1),
                           torch.cat([mask_c, mask_t], 1))
        z = post[0] + post[1] * torch.randn_like(post[1])
        n = x_t.shape[1]
        mu, sigma = self.decoder(torch.cat([r, z], -1)[:, None].expand(-1, n, -1), x_t)
        return mu, sigma, gauss_kl(post, prior)


class LatentNPDist(LatentNP):
    """The latent NP with its distributions as ``torch.distributions.Normal`` objects (argument
    validation on, the default) and the KL from ``kl_divergence``."""

    def forward(self, x_c, y_c, mask_c, x_t, y_t, mask_t):
        r = masked_mean_clamped(self.det(torch.cat([x_c, y_c], -1)), mask_c)
        prior = torch.distributions.Normal(*self.latent(x_c, y_c, mask_c))
        post = torch.distributions.Normal(*self.latent(
            torch.cat([x_c, x_t], 1), torch.cat([y_c, y_t], 1), torch.cat([mask_c, mask_t], 1)))
        z = post.rsample()
        n = x_t.shape[1]
        mu, sigma = self.decoder(torch.cat([r, z], -1)[:, None].expand(-1, n, -1), x_t)
        return mu, sigma, torch.distributions.kl_divergence(post, prior).sum(-1)


class LogVarEncoder(LatentEncoder):
    """The latent encoder parameterised by log-variance, as the NP notebooks write it."""

    def forward(self, x, y, mask):
        s = masked_mean_clamped(self.net(torch.cat([x, y], -1)), mask)
        return self.head(s).chunk(2, -1)  # (mean, log-variance)


class LatentNPLogVar(LatentNP):
    """The latent NP with z's Gaussians as (mean, log-variance) and the KL written in them."""

    def __init__(self):
        super().__init__()
        self.latent = LogVarEncoder()

    def forward(self, x_c, y_c, mask_c, x_t, y_t, mask_t):
        r = masked_mean_clamped(self.det(torch.cat([x_c, y_c], -1)), mask_c)
        prior = self.latent(x_c, y_c, mask_c)
        post = self.latent(torch.cat([x_c, x_t], 1), torch.cat([y_c, y_t], 1),
                           torch.cat([mask_c, mask_t], 1))
        z = post[0] + (0.5 * post[1]).exp() * torch.randn_like(post[1])
        n = x_t.shape[1]
        mu, sigma = self.decoder(torch.cat([r, z], -1)[:, None].expand(-1, n, -1), x_t)
        return mu, sigma, logvar_kl(post, prior)


def logvar_kl(q, p):
    """KL(q || p) of diagonal Gaussians given as (mean, log-variance)."""
    (mq, lq), (mp, lp) = q, p
    return 0.5 * (lp - lq + (lq.exp() + (mq - mp) ** 2) / lp.exp() - 1).sum(-1)


def gauss_kl(q, p):
    """KL(N(mq, sq) || N(mp, sp)) summed over z, in closed form (the ELBO's regulariser)."""
    (mq, sq), (mp, sp) = q, p
    return (torch.log(sp / sq) + (sq ** 2 + (mq - mp) ** 2) / (2 * sp ** 2) - 0.5).sum(-1)


def elbo_loss(mu, sigma, kl, y_t, mask_t):
    return gaussian_nll(mu, sigma, y_t, mask_t) + (kl / mask_t.sum(1)).mean()


class AttentiveNP(nn.Module):
    """The ANP's deterministic path: self-attended context pairs, cross-attention from the
    targets' x to the contexts' x, padded context points masked out."""

    def __init__(self, hidden: int = 32, heads: int = 4, where: bool = False):
        super().__init__()
        self.where = where
        self.encoder = mlp([2, hidden, hidden])
        self.q_proj, self.k_proj = nn.Linear(1, hidden), nn.Linear(1, hidden)
        self.cross = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.decoder = Decoder(hidden, hidden)

    def forward(self, x_c, y_c, mask_c, x_t):
        v = self.encoder(torch.cat([x_c, y_c], -1))
        r, _ = self.cross(self.q_proj(x_t), self.k_proj(x_c), v,
                          key_padding_mask=mask_c == 0)  # a task with no context: all masked
        if self.where:  # the attempted fix: zero r of context-less tasks after the attention
            r = torch.where(mask_c.any(1)[:, None, None], r, torch.zeros_like(r))
        return self.decoder(r, x_t)


class SetConv(nn.Module):
    """ConvCNP's SetConv: the context points onto a uniform grid by an RBF of a learned
    lengthscale, a density channel and the signal normalised by it."""

    def __init__(self, grid: int = 64, lo: float = -3.0, hi: float = 3.0, scale: float = 0.15,
                 eps: float = 0.0):
        super().__init__()
        self.register_buffer("grid", torch.linspace(lo, hi, grid))
        self.log_scale = nn.Parameter(torch.tensor(scale).log())
        self.eps = eps

    def forward(self, x_c, y_c, mask_c):
        d2 = (self.grid[None, :, None] - x_c.transpose(1, 2)) ** 2  # (B, G, N)
        w = torch.exp(-0.5 * d2 / self.log_scale.exp() ** 2) * mask_c[:, None]
        density = w.sum(-1)
        signal = (w * y_c.transpose(1, 2)).sum(-1)
        # the bug with eps = 0: density underflows to 0 at grid points far from every context
        return torch.stack([density, signal / (density + self.eps)], 1)  # (B, 2, G)


class ConvCNP(nn.Module):
    """Off-the-grid ConvCNP: SetConv, a 1-D CNN on the grid, an RBF read-out at the targets."""

    def __init__(self, channels: int = 16, eps: float = 0.0):
        super().__init__()
        self.encoder = SetConv(eps=eps)
        self.cnn = nn.Sequential(nn.Conv1d(2, channels, 5, padding=2), nn.ReLU(),
                                 nn.Conv1d(channels, channels, 5, padding=2), nn.ReLU(),
                                 nn.Conv1d(channels, 2, 5, padding=2))
        self.out_log_scale = nn.Parameter(torch.tensor(0.15).log())

    def forward(self, x_c, y_c, mask_c, x_t):
        h = self.cnn(self.encoder(x_c, y_c, mask_c))  # (B, 2, G)
        d2 = (x_t - self.encoder.grid[None, None]) ** 2  # (B, T, G)
        w = F.softmax(-0.5 * d2 / self.out_log_scale.exp() ** 2, -1)
        mu, raw = (w @ h.transpose(1, 2)).chunk(2, -1)
        return mu, 0.1 + 0.9 * F.softplus(raw)


def make_convcnp() -> ConvCNP:
    torch.manual_seed(0)
    return ConvCNP()


def make_convcnp_eps() -> ConvCNP:
    torch.manual_seed(0)
    return ConvCNP(eps=1e-8)


class GNP(nn.Module):
    """A Gaussian NP (Bruinsma et al.): the CNP's mean and a low-rank-plus-noise covariance of
    the targets from per-target features, ``f f^T / k + noise I``; padded targets get 1s on the
    diagonal and 0s elsewhere so they add nothing to the log-likelihood."""

    def __init__(self, hidden: int = 32, k: int = 8, noise: float = 1e-3):
        super().__init__()
        self.encoder = mlp([2, hidden, hidden, hidden])
        self.decoder = mlp([hidden + 1, hidden, hidden, 1 + k])
        self.k, self.noise = k, noise

    def forward(self, x_c, y_c, mask_c, x_t, mask_t):
        r = masked_mean_clamped(self.encoder(torch.cat([x_c, y_c], -1)), mask_c)
        out = self.decoder(torch.cat([r[:, None].expand(-1, x_t.shape[1], -1), x_t], -1))
        mu, f = out[..., 0], out[..., 1:] * mask_t[..., None]
        eye = torch.eye(x_t.shape[1])
        cov = f @ f.transpose(1, 2) / self.k + torch.diag_embed(1 - mask_t)
        return mu, cov + self.noise * eye  # the bug with noise 0: rank k < the targets


def gnp_loss(mu, cov, y_t, mask_t):
    """The joint Gaussian NLL of each task's targets, per target."""
    chol = torch.linalg.cholesky(cov)
    mvn = torch.distributions.MultivariateNormal(mu, scale_tril=chol, validate_args=False)
    return -(mvn.log_prob(y_t.squeeze(-1) * mask_t) / mask_t.sum(1)).mean()


def make_gnp() -> GNP:
    torch.manual_seed(0)
    return GNP(noise=0.0)


def make_cnp() -> CNP:
    torch.manual_seed(0)
    return CNP()


def make_cnp_clamped() -> CNP:
    torch.manual_seed(0)
    return CNP(clamp=True)


def make_cnp_no_floor() -> CNP:
    torch.manual_seed(0)
    return CNP(clamp=True, floor=False)


def make_latent() -> LatentNP:
    torch.manual_seed(0)
    return LatentNP()


def make_latent_no_floor() -> LatentNP:
    torch.manual_seed(0)
    return LatentNP(floor=0.0)


def make_latent_dist_no_floor() -> LatentNPDist:
    torch.manual_seed(0)
    return LatentNPDist(floor=0.0)


def make_latent_logvar() -> LatentNPLogVar:
    torch.manual_seed(0)
    return LatentNPLogVar()


def make_anp() -> AttentiveNP:
    torch.manual_seed(0)
    return AttentiveNP()


def make_anp_where() -> AttentiveNP:
    torch.manual_seed(0)
    return AttentiveNP(where=True)


# ---------------------------------------------------------------------------------------------
# meta-training data: functions drawn from a GP


def rbf(x1, x2, scale: float = 0.4, var: float = 1.0):
    return var * torch.exp(-0.5 * (x1[:, None] - x2[None, :]) ** 2 / scale ** 2)


class GPTasks(torch.utils.data.Dataset):
    """Task i: a function drawn from GP(0, RBF) at sorted random x in [-2, 2], split into
    a context set of 3..10 points (``empty``: task index whose context is empty) and the rest
    as targets; ``big``: a task index whose x are in milliseconds (x 1000: a unit error);
    ``full``: a task index whose every point went to the context (no target)."""

    def __init__(self, n: int, seed: int, jitter: float = 1e-4, empty: int | None = None,
                 big: int | None = None, max_points: int = 24, big_scale: float = 1e3,
                 full: int | None = None):
        self.big_scale, self.full = big_scale, full
        self.n, self.seed, self.jitter, self.max_points = n, seed, jitter, max_points
        self.empty, self.big = empty, big

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1000 + i)
        m = int(torch.randint(12, self.max_points + 1, (1,), generator=g))
        x = torch.rand(m, generator=g).mul(4).sub(2).sort().values
        chol = torch.linalg.cholesky(rbf(x, x) + self.jitter * torch.eye(m))
        y = chol @ torch.randn(m, generator=g)
        n_c = 0 if i == self.empty else int(torch.randint(3, 11, (1,), generator=g))
        n_c = m if i == self.full else n_c  # every point a context point: no target left
        if i == self.big:
            x = x * self.big_scale
        perm = torch.randperm(m, generator=g)
        return x[perm[:n_c]], y[perm[:n_c]], x[perm[n_c:]], y[perm[n_c:]]


def pad(seqs, size: int):
    out, mask = torch.zeros(len(seqs), size, 1), torch.zeros(len(seqs), size)
    for i, s in enumerate(seqs):
        out[i, :len(s), 0], mask[i, :len(s)] = s, 1.0
    return out, mask


def collate(tasks):
    """Pads the context and target sets of the batch's tasks to their largest sizes."""
    xc, yc, xt, yt = zip(*tasks)
    n_c, n_t = max(1, max(len(s) for s in xc)), max(len(s) for s in xt)
    (x_c, mask_c), (y_c, _) = pad(xc, n_c), pad(yc, n_c)
    (x_t, mask_t), (y_t, _) = pad(xt, n_t), pad(yt, n_t)
    return x_c, y_c, mask_c, x_t, y_t, mask_t
