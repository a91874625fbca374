"""Learned point cloud registration written the way Deep Closest Point / RPM-Net code writes it
(WangYueFt/dcp's ``SVDHead``, yewzijian/RPMNet's ``sinkhorn`` and ``compute_affinity``): the
factories, losses and data of ``test_point_cloud_registration.py``.

- ``clouds``: ModelNet-like pairs: a source cloud (a noisy shape), a random rigid transform
  (axis-angle rotation up to 45 degrees, a translation), the target the transformed source
  with a partial overlap (a cropped share of points replaced by duplicates of kept ones).
- ``PointNet``: shared per-point 1x1 convolutions (B, N, 3) -> (B, N, F).
- ``SoftMatch``: soft correspondences, a softmax over the scaled feature dot products
  (``kind="features"``, DCP's pointer) or over the negative squared Euclidean distances
  in feature space (``kind="euclidean"``, RPM's affinity), with a temperature ``tau`` the loop anneals;
  ``stable=False`` is the hand-written ``exp(s) / exp(s).sum()``.
- ``Sinkhorn``: RPM-Net's normalisation in log space with a slack row and column for outliers.
- ``SVDHead``: weighted Procrustes: centroids, the cross-covariance ``H``, ``torch.linalg.svd``
  and the determinant sign fix ``diag(1, 1, det(V U^T))``.
- ``RegistrationLoss``: the geodesic angle ``acos((trace(R^T R_gt) - 1) / 2)`` (its cosine
  clamped to ``[-1 + clamp_eps, 1 - clamp_eps]``) plus the translation error, optionally a
  Chamfer term with ``sqrt``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

N_POINTS, FEAT = 32, 16


def axis_angle(v: torch.Tensor) -> torch.Tensor:
    """Rodrigues: rotation matrices (B, 3, 3) of axis-angle vectors (B, 3)."""
    theta = v.norm(dim=1, keepdim=True).clamp_min(1e-12)
    k = v / theta
    kx = torch.zeros(len(v), 3, 3)
    kx[:, 0, 1], kx[:, 0, 2], kx[:, 1, 2] = -k[:, 2], k[:, 1], -k[:, 0]
    kx = kx - kx.transpose(1, 2)
    s, c = torch.sin(theta)[..., None], torch.cos(theta)[..., None]
    return torch.eye(3) + s * kx + (1 - c) * kx @ kx


def clouds(n: int = 64, seed: int = 0, overlap: float = 0.75, scale: float = 1.0,
           max_angle: float = math.pi / 4, noise: float = 0.01, shift: float = 1.0):
    """``(src, tgt, R_gt, t_gt)``: ``tgt = src @ R_gt^T + t_gt`` on the overlap, duplicates
    of kept target points where the crop removed some."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(n, N_POINTS, 3, generator=g) * torch.tensor([1.0, 0.6, 0.3])
    src = src * scale
    axis = F.normalize(torch.randn(n, 3, generator=g), dim=1)
    angle = (torch.rand(n, 1, generator=g) * max_angle)
    r_gt = axis_angle(axis * angle)
    t_gt = (torch.rand(n, 3, generator=g) - 0.5) * shift
    tgt = src @ r_gt.transpose(1, 2) + t_gt[:, None]
    tgt = tgt + noise * torch.randn(tgt.shape, generator=g)
    kept = int(N_POINTS * overlap)
    dup = torch.randint(0, kept, (n, N_POINTS - kept), generator=g)
    tgt[:, kept:] = torch.gather(tgt[:, :kept], 1, dup[..., None].expand(-1, -1, 3))
    return src, tgt, r_gt, t_gt


def planar_square(n_side: int = 4) -> torch.Tensor:
    """A flat square grid centred at 0: its cross-covariance has two equal singular values."""
    a = torch.linspace(-1, 1, n_side)
    grid = torch.stack(torch.meshgrid(a, a, indexing="ij"), -1).reshape(-1, 2)
    pts = torch.cat([grid, torch.zeros(len(grid), 1)], 1)
    return pts.repeat(N_POINTS // len(pts) + 1, 1)[:N_POINTS]


class PointNet(nn.Module):
    def __init__(self, feat: int = FEAT):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(3, 32, 1), nn.ReLU(), nn.Conv1d(32, feat, 1))

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class SoftMatch(nn.Module):
    """Soft correspondences of every source point among the target points."""

    def __init__(self, kind: str = "features", tau: float = 1.0, stable: bool = True):
        super().__init__()
        self.kind, self.tau, self.stable = kind, tau, stable

    def forward(self, f_src, f_tgt, src, tgt):
        if self.kind == "features":
            scores = f_src @ f_tgt.transpose(1, 2) / math.sqrt(f_src.shape[-1])
        else:  # RPM-Net's affinity: negative squared distances in feature space
            scores = -((f_src[:, :, None] - f_tgt[:, None]) ** 2).sum(-1)
        if self.stable:
            return torch.softmax(scores / self.tau, -1)
        e = torch.exp(scores / self.tau)
        return e / e.sum(-1, keepdim=True)


class Sinkhorn(nn.Module):
    """RPM-Net's log-domain Sinkhorn with a slack row and column (outliers), ``iters`` rounds."""

    def __init__(self, iters: int = 5):
        super().__init__()
        self.iters = iters

    def forward(self, log_alpha):
        b, n, m = log_alpha.shape
        padded = F.pad(log_alpha, (0, 1, 0, 1), value=0.0)
        for _ in range(self.iters):
            rows = padded[:, :-1].logsumexp(2, keepdim=True)
            padded = torch.cat([padded[:, :-1] - rows, padded[:, -1:]], 1)
            cols = padded[:, :, :-1].logsumexp(1, keepdim=True)
            padded = torch.cat([padded[:, :, :-1] - cols, padded[:, :, -1:]], 2)
        return padded[:, :-1, :-1].exp()


class SVDHead(nn.Module):
    """Weighted Procrustes: ``R = V diag(1, 1, det(V U^T)) U^T``, ``t = c_t - R c_s``."""

    def forward(self, src, corr, weights):
        w = weights[..., None]
        total = w.sum(1, keepdim=True)
        c_s, c_t = (w * src).sum(1, keepdim=True) / total, (w * corr).sum(1, keepdim=True) / total
        h = ((src - c_s) * w).transpose(1, 2) @ (corr - c_t)
        u, s, vh = torch.linalg.svd(h)
        v = vh.transpose(1, 2)
        d = torch.det(v @ u.transpose(1, 2))
        fix = torch.diag_embed(torch.stack([torch.ones_like(d), torch.ones_like(d), d], 1))
        r = v @ fix @ u.transpose(1, 2)
        t = c_t[:, 0] - (r @ c_s.transpose(1, 2))[..., 0]
        return r, t


class DCP(nn.Module):
    """Deep Closest Point: features, soft matches (or Sinkhorn), weighted SVD.

    ``forward(src, tgt, valid)``: ``valid`` (B, N) weights the source points (0 where the
    crop left them without a partner)."""

    def __init__(self, kind: str = "features", tau: float = 1.0, stable: bool = True,
                 sinkhorn: int = 0):
        super().__init__()
        self.emb = PointNet()
        self.match = SoftMatch(kind, tau, stable)
        self.sinkhorn = Sinkhorn(sinkhorn) if sinkhorn else None
        self.head = SVDHead()

    def forward(self, src, tgt, valid):
        f_src, f_tgt = self.emb(src), self.emb(tgt)
        p = self.match(f_src, f_tgt, src, tgt)
        if self.sinkhorn is not None:
            p = self.sinkhorn(torch.log(p + 1e-12))
        corr = p @ tgt
        return self.head(src, corr, valid)


def make_dcp() -> DCP:
    torch.manual_seed(0)
    return DCP()


def make_rpm() -> DCP:
    torch.manual_seed(0)
    return DCP(kind="euclidean", tau=1.0, stable=False)


def make_rpm_stable() -> DCP:
    torch.manual_seed(0)
    return DCP(kind="euclidean", tau=1.0)


def make_rpm_net() -> DCP:
    torch.manual_seed(0)
    return DCP(kind="euclidean", sinkhorn=3)


def make_dcp_unstable() -> DCP:
    torch.manual_seed(0)
    return DCP(stable=False)


def geodesic(r: torch.Tensor, r_gt: torch.Tensor, clamp: bool = True,
             eps: float = 1e-6) -> torch.Tensor:
    cos = (torch.diagonal(r.transpose(1, 2) @ r_gt, dim1=1, dim2=2).sum(-1) - 1) / 2
    if clamp:
        cos = cos.clamp(-1 + eps, 1 - eps)
    return torch.acos(cos)


def chamfer(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    d = ((a[:, :, None] - b[:, None]) ** 2).sum(-1)
    return (torch.sqrt(d.min(2).values + eps).mean(1) + torch.sqrt(d.min(1).values + eps).mean(1))


class RegistrationLoss(nn.Module):
    """Geodesic rotation error + translation error (+ ``chamfer`` * Chamfer of the moved
    source to the target)."""

    def __init__(self, clamp: bool = True, chamfer: float = 0.0, eps: float = 1e-8,
                 clamp_eps: float = 1e-6):
        super().__init__()
        self.clamp, self.chamfer, self.eps, self.clamp_eps = clamp, chamfer, eps, clamp_eps

    def forward(self, r, t, r_gt, t_gt, src=None, tgt=None):
        loss = geodesic(r, r_gt, self.clamp, self.clamp_eps).mean()
        loss = loss + ((t - t_gt) ** 2).sum(1).mean()
        if self.chamfer:
            moved = src @ r.transpose(1, 2) + t[:, None]
            loss = loss + self.chamfer * chamfer(moved, tgt, self.eps).mean()
        return loss
