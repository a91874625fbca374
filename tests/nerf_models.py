"""A small NeRF as nerf-pytorch and its descendants write it: positional encoding, a coarse and
a fine MLP, stratified samples drawn with ``torch.rand`` inside the forward, alpha compositing
with an exclusive ``cumprod`` of transmittance, and hierarchical sampling by inverse transform
(``sample_pdf``: the coarse weights normalised into a pdf, ``torch.searchsorted`` over its cdf).
The scene is a coloured sphere seen from cameras on a circle; rays that miss it see white."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

NEAR, FAR = 2.0, 6.0


class NeRF(nn.Module):
    def __init__(self, freqs: int = 6, width: int = 64, sigma_bias: float = 0.0):
        super().__init__()
        self.freqs = freqs
        d = 3 + 3 * 2 * freqs
        self.trunk = nn.Sequential(nn.Linear(d, width), nn.ReLU(), nn.Linear(width, width),
                                   nn.ReLU())
        self.sigma = nn.Linear(width, 1)
        nn.init.constant_(self.sigma.bias, sigma_bias)
        self.rgb = nn.Sequential(nn.Linear(width, 3), nn.Sigmoid())

    def encode(self, x):
        bands = (2.0 ** torch.arange(self.freqs, device=x.device)) * math.pi
        xb = x[..., None] * bands
        return torch.cat([x, torch.sin(xb).flatten(-2), torch.cos(xb).flatten(-2)], -1)

    def forward(self, pts):
        h = self.trunk(self.encode(pts))
        return F.relu(self.sigma(h)).squeeze(-1), self.rgb(h)


def composite(sigma, rgb, t, rays_d, white_bkgd=True):
    """raw2outputs: alpha = 1 - exp(-sigma * delta), weights = alpha * exclusive cumprod."""
    delta = t[..., 1:] - t[..., :-1]
    delta = torch.cat([delta, torch.full_like(delta[..., :1], 1e10)], -1)
    delta = delta * rays_d.norm(dim=-1, keepdim=True)
    alpha = 1.0 - torch.exp(-sigma * delta)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]),
                                     1.0 - alpha + 1e-10], -1), -1)[..., :-1]
    weights = alpha * trans
    color = (weights[..., None] * rgb).sum(-2)
    acc = weights.sum(-1)
    if white_bkgd:
        color = color + (1.0 - acc[..., None])
    return weights, color


def sample_pdf(bins, weights, n: int, det: bool, eps: float):
    """Inverse transform sampling of ``n`` depths from the piecewise-constant pdf ``weights``
    over ``bins`` (nerf-pytorch's ``sample_pdf``)."""
    weights = weights + eps  # nerf-pytorch: 1e-5, "prevent nans"
    pdf = weights / torch.sum(weights, -1, keepdim=True)
    cdf = torch.cumsum(pdf, -1)
    cdf = torch.cat([torch.zeros_like(cdf[..., :1]), cdf], -1)
    if det:
        u = torch.linspace(0.0, 1.0, n).expand(cdf.shape[0], n).contiguous()
    else:
        u = torch.rand(cdf.shape[0], n)
    inds = torch.searchsorted(cdf, u, right=True)
    below = (inds - 1).clamp_min(0)
    above = inds.clamp_max(cdf.shape[-1] - 1)
    g = torch.stack([below, above], -1)
    cdf_g = torch.gather(cdf[:, None].expand(-1, n, -1), 2, g)
    bins_g = torch.gather(bins[:, None].expand(-1, n, -1), 2, g)
    denom = cdf_g[..., 1] - cdf_g[..., 0]
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    s = (u - cdf_g[..., 0]) / denom
    return bins_g[..., 0] + s * (bins_g[..., 1] - bins_g[..., 0])


class Renderer(nn.Module):
    """Coarse and fine networks; returns (coarse colour, fine colour) per ray."""

    def __init__(self, n_coarse: int = 32, n_fine: int = 32, pdf_eps: float = 1e-5,
                 sigma_bias: float = 0.0):
        super().__init__()
        self.n_coarse, self.n_fine, self.pdf_eps = n_coarse, n_fine, pdf_eps
        self.coarse = NeRF(sigma_bias=sigma_bias)
        self.fine = NeRF(sigma_bias=sigma_bias)

    def forward(self, rays_o, rays_d):
        b = rays_o.shape[0]
        t = torch.linspace(NEAR, FAR, self.n_coarse).expand(b, self.n_coarse)
        if self.training:  # stratified sampling in each bin
            mids = 0.5 * (t[..., 1:] + t[..., :-1])
            upper = torch.cat([mids, t[..., -1:]], -1)
            lower = torch.cat([t[..., :1], mids], -1)
            t = lower + (upper - lower) * torch.rand(b, self.n_coarse)
        pts = rays_o[:, None] + rays_d[:, None] * t[..., None]
        sigma, rgb = self.coarse(pts)
        weights, color_c = composite(sigma, rgb, t, rays_d)
        mids = 0.5 * (t[..., 1:] + t[..., :-1])
        t_fine = sample_pdf(mids, weights[..., 1:-1].detach(), self.n_fine,
                            det=not self.training, eps=self.pdf_eps)
        t_all, _ = torch.sort(torch.cat([t, t_fine.detach()], -1), -1)
        pts = rays_o[:, None] + rays_d[:, None] * t_all[..., None]
        sigma, rgb = self.fine(pts)
        _, color_f = composite(sigma, rgb, t_all, rays_d)
        return color_c, color_f


class PhotometricLoss(nn.Module):
    """MSE of both renderings against the pixels (nerf-pytorch's img2mse of coarse + fine)."""

    def forward(self, out, target):
        color_c, color_f = out
        return F.mse_loss(color_c, target) + F.mse_loss(color_f, target)


def make_renderer() -> Renderer:
    return Renderer()


def make_renderer_no_eps() -> Renderer:
    """The planted bug: the pdf without its eps, and a density bias started below 0."""
    return Renderer(pdf_eps=0.0, sigma_bias=-0.1)


def rays(n: int, seed: int):
    """``n`` rays from cameras on a circle of radius 4 around a sphere of radius 1 at the
    origin; target colour: the sphere's (by its normal) where a ray hits it, else white."""
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(n, generator=g) * 2 * math.pi
    o = torch.stack([4 * torch.cos(ang), 4 * torch.sin(ang), torch.zeros(n)], -1)
    aim = torch.randn(n, 3, generator=g) * 0.6  # a point near the origin
    d = F.normalize(aim - o, dim=-1)
    # ray-sphere hit: |o + t d|^2 = 1
    b = (o * d).sum(-1)
    c = (o * o).sum(-1) - 1.0
    disc = b * b - c
    hit = disc > 0
    th = -b - torch.sqrt(disc.clamp_min(0))
    normal = F.normalize(o + th[:, None] * d, dim=-1)
    color = torch.where(hit[:, None], 0.5 * (normal + 1), torch.ones(n, 3))
    return o, d, color


def so3_exp(w):
    """Rodrigues' formula, with the small-angle series where theta is near 0 (BARF's
    ``so3_to_SO3``, written as many repos write it: the guard is a ``torch.where``)."""
    theta = w.norm(dim=-1)[..., None, None]
    wx = torch.zeros(*w.shape[:-1], 3, 3)
    wx[..., 0, 1], wx[..., 0, 2], wx[..., 1, 2] = -w[..., 2], w[..., 1], -w[..., 0]
    wx = wx - wx.transpose(-1, -2)
    a = torch.where(theta < 1e-6, 1 - theta ** 2 / 6, torch.sin(theta) / theta)
    b = torch.where(theta < 1e-6, 0.5 - theta ** 2 / 24, (1 - torch.cos(theta)) / theta ** 2)
    return torch.eye(3) + a * wx + b * wx @ wx


class PoseRefiner(nn.Module):
    """Per-camera rotation corrections learnt with the scene (BARF, NeRF--): an embedding of
    axis-angle vectors, started at zero, applied to each ray's direction."""

    def __init__(self, n_cameras: int = 8):
        super().__init__()
        self.poses = nn.Embedding(n_cameras, 3)
        nn.init.zeros_(self.poses.weight)
        self.scene = Renderer(n_coarse=16, n_fine=16)

    def forward(self, rays_o, rays_d, cam):
        rot = so3_exp(self.poses(cam))
        rays_d = (rot @ rays_d[..., None]).squeeze(-1)
        return self.scene(rays_o, rays_d)


def make_pose_refiner() -> PoseRefiner:
    return PoseRefiner()
