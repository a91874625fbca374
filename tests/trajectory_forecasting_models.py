"""Trajectory forecasting models written the way Social-LSTM, Trajectron++, MultiPath and
VectorNet code writes them, for ``test_trajectory_forecasting``.

- ``SocialGaussian``: scenes of up to ``A`` agents padded per scene, a ``valid`` mask given to
  ``forward``; an LSTM encoder over each agent's observed displacements (agents flattened into
  the batch), social attention over the other agents of the scene with ``-inf`` for absent
  ones, an LSTM decoder fed the ground-truth future (teacher forcing), and a bivariate
  Gaussian head ``(mu_x, mu_y, log sigma_x, log sigma_y, rho = tanh(.))`` trained by its NLL,
  averaged over each scene's valid agents. ``self_attend``: the agent attends to itself too.
- ``MultiModal``: a GMM head of ``K`` modes with log-softmax mode weights, trained by
  winner-takes-all (minADE over the modes, masked over the future steps an agent is seen)
  plus the NLL of the best mode's weight.
- ``VectorNet``: polylines of map points padded to ``N`` points, each point encoded by an MLP
  and max-pooled over its valid points (``-inf`` for padding), then global attention between
  the polylines and the agent, and a regression head of the agent's future.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

T_OBS, T_PRED, A = 6, 4, 4


# ---------------------------------------------------------------------------------------------
# Social attention + bivariate Gaussian head


class SocialAttention(nn.Module):
    """Each agent attends to the scene's other agents; absent agents get -inf."""

    def __init__(self, hidden: int, self_attend: bool, sdpa: bool = False):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.self_attend, self.sdpa = self_attend, sdpa

    def forward(self, h, valid):
        b, a, d = h.shape
        scores = self.q(h) @ self.k(h).transpose(1, 2) / math.sqrt(d)
        eye = torch.eye(a, dtype=torch.bool, device=h.device)
        if self.self_attend:
            keep = valid[:, None, :] | eye
        else:  # neighbours only, as Social-LSTM's pooling: a lone agent has none
            keep = valid[:, None, :] & ~eye
        if self.sdpa:  # torch's attention returns 0 for a row with no key (a lone agent)
            out = F.scaled_dot_product_attention(self.q(h)[:, None], self.k(h)[:, None],
                                                 self.v(h)[:, None], attn_mask=keep[:, None])
            return h + out[:, 0]
        scores = scores.masked_fill(~keep, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        return h + attn @ self.v(h)


class SocialGaussian(nn.Module):
    def __init__(self, hidden: int = 16, self_attend: bool = True, skip: bool = False,
                 impute_future: bool = False, sdpa: bool = False):
        super().__init__()
        self.impute_future = impute_future
        self.skip = skip  # the head also sees the last displacement (a residual input)
        self.embed = nn.Linear(2, hidden)
        self.encoder = nn.LSTM(hidden, hidden, batch_first=True)
        self.social = SocialAttention(hidden, self_attend, sdpa)
        self.decoder = nn.LSTMCell(hidden, hidden)
        self.head = nn.Linear(hidden + 2 * skip, 5)

    def forward(self, obs, valid, fut):
        """obs (B, A, T_OBS, 2) displacements, valid (B, A) bool, fut (B, A, T_PRED, 2): the
        ground-truth future fed back at each step (teacher forcing)."""
        b, a = valid.shape
        obs = torch.nan_to_num(obs)  # absent agents' positions are NaN (trajdata's padding)
        if self.impute_future:  # (the bug without it: teacher forcing feeds their NaN future)
            fut = torch.nan_to_num(fut)
        x = F.relu(self.embed(obs.flatten(0, 1)))
        _, (h, c) = self.encoder(x)
        h = self.social(h[0].view(b, a, -1), valid).flatten(0, 1)
        c, prev, outs = c[0], obs[:, :, -1].flatten(0, 1), []
        for t in range(fut.shape[2]):
            h, c = self.decoder(F.relu(self.embed(prev)), (h, c))
            outs.append(self.head(torch.cat([h, prev], -1) if self.skip else h))
            prev = fut[:, :, t].flatten(0, 1)
        out = torch.stack(outs, 1).view(b, a, fut.shape[2], 5)
        mu, log_sigma = out[..., :2], out[..., 2:4]
        rho = torch.tanh(out[..., 4])
        return mu, log_sigma, rho


def bivariate_nll(mu, log_sigma, rho, target, scale=torch.exp):
    """Social-LSTM's bivariate Gaussian NLL per agent and step; ``scale`` maps the head's
    output to sigma (exp; softplus as MultiPath writes it, whose log it then takes)."""
    sx, sy = scale(log_sigma[..., 0]), scale(log_sigma[..., 1])
    if scale is not torch.exp:
        log_sigma = torch.stack([sx, sy], -1).log()
    dx = (target[..., 0] - mu[..., 0]) / sx
    dy = (target[..., 1] - mu[..., 1]) / sy
    one_minus = 1 - rho ** 2
    z = dx ** 2 + dy ** 2 - 2 * rho * dx * dy
    return (z / (2 * one_minus) + log_sigma.sum(-1) + 0.5 * torch.log(one_minus)
            + math.log(2 * math.pi))


def scene_nll(mu, log_sigma, rho, target, valid, scale=torch.exp):
    """The NLL averaged over each scene's valid agents, then over the scenes."""
    target = torch.nan_to_num(target)  # (absent agents' NaN: where's backward would be NaN)
    nll = bivariate_nll(mu, log_sigma, rho, target, scale).mean(-1)  # (B, A)
    nll = torch.where(valid, nll, 0.0)
    m = valid.float()
    per_scene = (nll * m).sum(1) / m.sum(1)  # the bug: 0/0 for a scene with no valid agent
    return per_scene.mean()


def scene_nll_softplus(mu, raw_sigma, rho, target, valid):
    return scene_nll(mu, raw_sigma, rho, target, valid, scale=F.softplus)


def make_social() -> SocialGaussian:
    torch.manual_seed(0)
    return SocialGaussian()


def make_social_skip() -> SocialGaussian:
    torch.manual_seed(0)
    return SocialGaussian(skip=True)


def make_social_imputed() -> SocialGaussian:
    torch.manual_seed(0)
    return SocialGaussian(impute_future=True)


def make_social_neighbours_sdpa() -> SocialGaussian:
    torch.manual_seed(0)
    return SocialGaussian(self_attend=False, sdpa=True)


def make_social_neighbours() -> SocialGaussian:
    torch.manual_seed(0)
    return SocialGaussian(self_attend=False)


def scenes(g: torch.Generator, n: int = 8, lone: int | None = None, empty: int | None = None,
           pixels: int | None = None, scale: float = 40.0, pad=0.0):
    """``n`` scenes of 2..A agents walking with small displacements (already relative to the
    last observed position, in metres). ``lone``: that scene has one agent; ``empty``: no valid
    agent (every track in it was filtered out as too short); ``pixels``: that scene's
    displacements are in another unit (image pixels: ETH/UCY's homography to metres was not
    applied to it; millimetres), ``scale`` times too large. ``pad``: what absent agents hold (NaN: trajdata's padding)."""
    counts = torch.randint(2, A + 1, (n,), generator=g)
    if lone is not None:
        counts[lone] = 1
    if empty is not None:
        counts[empty] = 0
    valid = torch.arange(A)[None, :] < counts[:, None]
    vel = 0.3 * torch.randn(n, A, 1, 2, generator=g)
    obs = vel + 0.05 * torch.randn(n, A, T_OBS, 2, generator=g)
    fut = vel + 0.05 * torch.randn(n, A, T_PRED, 2, generator=g)
    if pixels is not None:
        obs[pixels] *= scale
        fut[pixels] *= scale
    absent = ~valid[..., None, None]
    return obs.masked_fill(absent, pad), valid, fut.masked_fill(absent, pad)


# ---------------------------------------------------------------------------------------------
# multimodal head, winner-takes-all


class MultiModal(nn.Module):
    def __init__(self, hidden: int = 16, modes: int = 3, horizon: int = T_PRED):
        super().__init__()
        self.encoder = nn.GRU(2, hidden, batch_first=True)
        self.traj = nn.Linear(hidden, modes * horizon * 2)
        self.logit = nn.Linear(hidden, modes)
        self.modes, self.horizon = modes, horizon

    def forward(self, obs):
        _, h = self.encoder(obs)
        h = h[0]
        traj = self.traj(h).view(-1, self.modes, self.horizon, 2).cumsum(2)
        return traj, F.log_softmax(self.logit(h), dim=-1)


def wta_loss(traj, log_pi, fut, fut_mask, eps: float = 0.0):
    """minADE over the modes (displacement error over the steps each agent is seen) plus
    the NLL of the best mode's weight. ``eps`` inside the sqrt keeps its gradient finite."""
    m = fut_mask[:, None, :, None].float()
    d = ((traj * m - fut[:, None] * m) ** 2).sum(-1)  # padded steps: both zeroed, d = 0
    dist = (d + eps).sqrt()  # the bug (eps 0): sqrt'(0) = inf at every padded step
    ade = dist.sum(-1) / fut_mask.sum(-1, keepdim=True)
    best = ade.argmin(-1)
    reg = ade.gather(1, best[:, None]).squeeze(1)
    cls = -log_pi.gather(1, best[:, None]).squeeze(1)
    return (reg + cls).mean()


def make_multimodal() -> MultiModal:
    torch.manual_seed(0)
    return MultiModal()


def tracks(g: torch.Generator, n: int = 16, leaving: int | None = None):
    """Agents' observed displacements and their future positions; ``leaving``: that agent
    leaves the field of view after 2 future steps (its last steps padded, mask 0)."""
    vel = 0.3 * torch.randn(n, 1, 2, generator=g)
    obs = vel + 0.05 * torch.randn(n, T_OBS, 2, generator=g)
    fut = (vel + 0.05 * torch.randn(n, T_PRED, 2, generator=g)).cumsum(1)
    mask = torch.ones(n, T_PRED, dtype=torch.bool)
    if leaving is not None:
        mask[leaving, 2:] = False
        fut[leaving, 2:] = 0.0
    return obs, fut, mask


# ---------------------------------------------------------------------------------------------
# VectorNet: polyline subgraphs, max-pooled over padded points


class Subgraph(nn.Module):
    def __init__(self, in_dim: int = 4, hidden: int = 16):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.LayerNorm(hidden), nn.ReLU())

    def forward(self, points, point_mask):
        """points (B, P, N, F), point_mask (B, P, N) -> (B, P, hidden)."""
        h = self.mlp(points)
        h = h.masked_fill(~point_mask[..., None], float("-inf"))
        return h.max(dim=2).values  # the bug: -inf for a polyline with no valid point


class VectorNet(nn.Module):
    def __init__(self, hidden: int = 16, horizon: int = T_PRED):
        super().__init__()
        self.subgraph = Subgraph(hidden=hidden)
        self.agent = nn.GRU(2, hidden, batch_first=True)
        self.glob = nn.MultiheadAttention(hidden, 2, batch_first=True)
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(),
                                  nn.Linear(hidden, horizon * 2))
        self.horizon = horizon

    def forward(self, obs, points, point_mask, poly_mask):
        lanes = self.subgraph(points, point_mask)
        _, h = self.agent(obs)
        q = h[0][:, None]
        ctx, _ = self.glob(q, lanes, lanes, key_padding_mask=~poly_mask)
        return self.head(torch.cat([h[0], ctx[:, 0]], -1)).view(-1, self.horizon, 2)


def make_vectornet() -> VectorNet:
    torch.manual_seed(0)
    return VectorNet()


def lane_scenes(g: torch.Generator, n: int = 8, cropped: int | None = None, p: int = 5,
                pts: int = 6, no_lanes: int | None = None):
    """Lane polylines as (start xy, end xy) vectors, padded to ``pts`` points. ``cropped``: in
    that scene polyline 3 was cropped to the region of interest and lost every point, yet its
    slot stays marked as a valid polyline (the point mask was updated, the polyline mask not).
    ``no_lanes``: that scene (a parking lot) has no lane within the radius: every polyline slot
    is padding, holding one zero point (as padded slots are filled) and masked out."""
    obs, fut, _ = tracks(g, n)
    points = torch.randn(n, p, pts, 4, generator=g)
    counts = torch.randint(2, pts + 1, (n, p), generator=g)
    point_mask = torch.arange(pts)[None, None, :] < counts[..., None]
    poly_mask = torch.ones(n, p, dtype=torch.bool)
    poly_mask[:, -1] = False  # the last slot is padding in every scene
    if cropped is not None:
        point_mask[cropped, 3] = False
    if no_lanes is not None:
        poly_mask[no_lanes] = False
        point_mask[no_lanes] = torch.arange(pts) == 0
    return obs, points * point_mask[..., None], point_mask, poly_mask, fut


def wta_loss_eps(traj, log_pi, fut, fut_mask):
    """The same loss with the usual eps under the sqrt (its gradient finite at padded steps)."""
    return wta_loss(traj, log_pi, fut, fut_mask, eps=1e-6)


def mvn_scene_nll(mu, log_sigma, rho, target, valid):
    """The NLL through torch.distributions, as Trajectron++'s GMM2D builds each component:
    the Cholesky factor of the covariance from sigma and rho (its diagonal's second entry
    sigma_y sqrt(1 - rho²), 0 once rho is 1.0)."""
    sx, sy = log_sigma[..., 0].exp(), log_sigma[..., 1].exp()
    zero = torch.zeros_like(sx)
    tril = torch.stack([torch.stack([sx, zero], -1),
                        torch.stack([rho * sy, sy * (1 - rho ** 2).sqrt()], -1)], -2)
    dist = torch.distributions.MultivariateNormal(mu, scale_tril=tril)
    nll = -dist.log_prob(torch.nan_to_num(target)).mean(-1)
    m = valid.float()
    return ((nll * m).sum(1) / m.sum(1).clamp_min(1)).mean()
