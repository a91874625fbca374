"""Camera-only bird's-eye-view segmentation written as Lift-Splat-Shoot and BEVDet write it,
for ``test_bev_perception``.

- ``LiftSplat``: each camera's image through a small CNN, a depth head (a softmax over depth
  bins, written out by hand or ``torch.softmax``) times the context features (the lift); the
  frustum's points ``(u d, v d, d)`` taken to the ego frame through ``rots @ inverse(K)`` and
  ``trans`` (the geometry); the points binned into BEV voxels and pooled with LSS's cumsum
  trick (sort by voxel rank, cumsum, differences at the rank boundaries) (the splat); a BEV
  encoder and a segmentation head.  Options plant the domain's bugs: the pooled depth mass
  kept as a ``log`` feature (BEVDet's occupancy prior), camera features L2-normalised with the
  eps outside the root, BEVFormer's learned per-camera embedding.
- ``BEVSegLoss``: a class-imbalanced BCE (``pos_weight``) or a sigmoid focal loss under a
  visibility mask, normalised over the visible cells of the batch or of each sample.
- ``BEVDataset``: synthetic nuScenes-like samples (images, rotations, translations,
  intrinsics, BEV targets, visibility), camera dropout as augmentation (a dropped camera's
  image is 0, its frustum's cells invisible).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

CAMS, IMG_H, IMG_W = 3, 8, 16                 # cameras per sample, image size
DBOUND = (1.0, 9.0, 1.0)                      # depth bins: 1 m to 9 m, 1 m apart
XBOUND, YBOUND, ZBOUND = (-8.0, 8.0, 1.0), (-8.0, 8.0, 1.0), (-5.0, 5.0, 10.0)
BEV = 16                                      # BEV cells per side
CH = 8                                        # context channels


def gen_dx_bx(xbound, ybound, zbound):
    dx = torch.tensor([row[2] for row in (xbound, ybound, zbound)])
    bx = torch.tensor([row[0] + row[2] / 2.0 for row in (xbound, ybound, zbound)])
    nx = torch.tensor([int((row[1] - row[0]) / row[2]) for row in (xbound, ybound, zbound)])
    return dx, bx, nx


def create_frustum():
    ds = torch.arange(*DBOUND).view(-1, 1, 1).expand(-1, IMG_H, IMG_W)
    d = ds.shape[0]
    xs = torch.linspace(0, IMG_W - 1, IMG_W).view(1, 1, IMG_W).expand(d, IMG_H, IMG_W)
    ys = torch.linspace(0, IMG_H - 1, IMG_H).view(1, IMG_H, 1).expand(d, IMG_H, IMG_W)
    return torch.stack((xs, ys, ds), -1)  # (D, H, W, 3)


def cumsum_trick(x, geom_feats, ranks):
    """LSS's QuickCumsum: the points sorted by voxel rank, one cumsum, differences at the
    rank boundaries (the sum of each voxel's points)."""
    x = x.cumsum(0)
    kept = torch.ones(x.shape[0], device=x.device, dtype=torch.bool)
    kept[:-1] = ranks[1:] != ranks[:-1]
    x, geom_feats = x[kept], geom_feats[kept]
    x = torch.cat((x[:1], x[1:] - x[:-1]))
    return x, geom_feats


class CamEncode(nn.Module):
    """The image encoder: a CNN, then per pixel D depth logits and C context channels."""

    def __init__(self, d: int, c: int = CH, manual_softmax: bool = False,
                 norm_feats: str = ""):
        super().__init__()
        self.d, self.c = d, c
        self.trunk = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.depthnet = nn.Conv2d(16, d + c, 1)
        self.manual_softmax, self.norm_feats = manual_softmax, norm_feats

    def get_depth_dist(self, x):
        if self.manual_softmax:  # the bug: no max subtracted, exp overflows past 88
            e = torch.exp(x)
            return e / e.sum(dim=1, keepdim=True)
        return x.softmax(dim=1)

    def forward(self, x, cam_keep):
        x = self.depthnet(self.trunk(x))
        depth = self.get_depth_dist(x[:, :self.d])
        feats = x[:, self.d:] * cam_keep[:, None, None, None]  # camera dropout: features 0
        if self.norm_feats == "outside":  # the bug: eps outside the root, sqrt'(0) in backward
            feats = feats / (feats.pow(2).sum(1, keepdim=True).sqrt() + 1e-6)
        elif self.norm_feats:
            feats = F.normalize(feats, dim=1, eps=1e-6)
        return depth, depth.unsqueeze(1) * feats.unsqueeze(2)  # (BN, C, D, H, W)


class LiftSplat(nn.Module):
    def __init__(self, classes: int = 1, log_mass: bool = False, mass_floor: float = 1e-6,
                 cam_embed: bool = False, **cam):
        super().__init__()
        dx, bx, nx = gen_dx_bx(XBOUND, YBOUND, ZBOUND)
        self.register_buffer("dx", dx, persistent=False)
        self.register_buffer("bx", bx, persistent=False)
        self.nx = [int(v) for v in nx]
        self.register_buffer("frustum", create_frustum(), persistent=False)
        self.D = self.frustum.shape[0]
        self.camencode = CamEncode(self.D, **cam)
        self.log_mass, self.mass_floor = log_mass, mass_floor
        self.cams_embeds = nn.Parameter(torch.zeros(CAMS, CH)) if cam_embed else None
        cin = CH + (1 if log_mass else 0)
        self.bevencode = nn.Sequential(
            nn.Conv2d(cin, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, classes, 1))

    def get_geometry(self, rots, trans, intrins):
        b, n = trans.shape[:2]
        points = self.frustum.view(1, 1, *self.frustum.shape, 1)  # (1, 1, D, H, W, 3, 1)
        points = torch.cat((points[..., :2, :] * points[..., 2:3, :], points[..., 2:3, :]), -2)
        combine = rots.matmul(torch.inverse(intrins))
        points = combine.view(b, n, 1, 1, 1, 3, 3).matmul(points).squeeze(-1)
        return points + trans.view(b, n, 1, 1, 1, 3)  # (B, N, D, H, W, 3) in the ego frame

    def voxel_pooling(self, geom, x):
        b, n, d, h, w, c = x.shape
        nprime = b * n * d * h * w
        x = x.reshape(nprime, c)
        geom = ((geom - (self.bx - self.dx / 2.0)) / self.dx).long().view(nprime, 3)
        batch_ix = torch.cat([torch.full([nprime // b, 1], ix, dtype=torch.long)
                              for ix in range(b)])
        geom = torch.cat((geom, batch_ix), 1)
        kept = ((geom[:, 0] >= 0) & (geom[:, 0] < self.nx[0]) & (geom[:, 1] >= 0)
                & (geom[:, 1] < self.nx[1]) & (geom[:, 2] >= 0) & (geom[:, 2] < self.nx[2]))
        x, geom = x[kept], geom[kept]
        ranks = (geom[:, 0] * (self.nx[1] * self.nx[2] * b) + geom[:, 1] * (self.nx[2] * b)
                 + geom[:, 2] * b + geom[:, 3])
        order = ranks.argsort()
        x, geom, ranks = x[order], geom[order], ranks[order]
        x, geom = cumsum_trick(x, geom, ranks)
        if self.log_mass:  # each occupied voxel's depth mass (> 0: a sum of softmax values)
            mass = x[:, -1:]
            if self.mass_floor:
                mass = mass.clamp_min(self.mass_floor)
            x = torch.cat((x[:, :-1], torch.log(mass)), 1)  # the bug: the cumsum's rounding
        final = x.new_zeros((b, c, self.nx[2], self.nx[0], self.nx[1]))
        final[geom[:, 3], :, geom[:, 2], geom[:, 0], geom[:, 1]] = x
        return torch.cat(final.unbind(dim=2), 1)  # (B, C, X, Y)

    def forward(self, imgs, rots, trans, intrins, cam_keep):
        b, n = imgs.shape[:2]
        geom = self.get_geometry(rots, trans, intrins)
        depth, x = self.camencode(imgs.flatten(0, 1), cam_keep.flatten())
        x = x.view(b, n, CH, self.D, IMG_H, IMG_W).permute(0, 1, 3, 4, 5, 2)
        if self.cams_embeds is not None:  # BEVFormer's learned camera embedding
            x = (x + self.cams_embeds.view(1, n, 1, 1, 1, CH)) \
                * cam_keep.view(b, n, 1, 1, 1, 1)
        if self.log_mass:  # the pooled depth mass, a log-occupancy channel
            x = torch.cat((x, depth.view(b, n, self.D, IMG_H, IMG_W, 1)), -1)
        return self.bevencode(self.voxel_pooling(geom, x))


def make_lss() -> LiftSplat:
    torch.manual_seed(0)
    return LiftSplat()


def make_lss_manual_softmax() -> LiftSplat:
    torch.manual_seed(0)
    return LiftSplat(manual_softmax=True)


def make_lss_log_mass() -> LiftSplat:
    torch.manual_seed(0)
    return LiftSplat(log_mass=True, mass_floor=0.0)


def make_lss_norm_outside() -> LiftSplat:
    torch.manual_seed(0)
    return LiftSplat(norm_feats="outside")


def make_lss_cam_embed() -> LiftSplat:
    torch.manual_seed(0)
    return LiftSplat(cam_embed=True)


def sigmoid_focal(logits, target, alpha: float = 0.25, gamma: float = 2.0):
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    p_t = p * target + (1 - p) * (1 - target)
    a_t = alpha * target + (1 - alpha) * (1 - target)
    return a_t * ce * (1 - p_t) ** gamma


class BEVSegLoss(nn.Module):
    """LSS's SimpleLoss (BCE with pos_weight 2.13) or a sigmoid focal loss, under the
    visibility mask; ``per_sample``: each sample's mean over its own visible cells."""

    def __init__(self, pos_weight: float = 2.13, focal: bool = False, per_sample: bool = False):
        super().__init__()
        self.register_buffer("pos_weight", torch.tensor([pos_weight]))
        self.focal, self.per_sample = focal, per_sample

    def forward(self, logits, target, visibility):
        if self.focal:
            cells = sigmoid_focal(logits, target)
        else:
            cells = F.binary_cross_entropy_with_logits(logits, target, reduction="none",
                                                       pos_weight=self.pos_weight)
        cells = cells * visibility
        if self.per_sample:  # the bug: a sample with no visible cell divides 0 by 0
            return (cells.flatten(1).sum(1) / visibility.flatten(1).sum(1)).mean()
        return cells.sum() / visibility.sum().clamp_min(1)


def camera_rig():
    """Three cameras facing front, left and right (yaw 0, 90, -90 degrees), 1.5 m up."""
    rots, trans = [], []
    for yaw in (0.0, math.pi / 2, -math.pi / 2):
        c, s = math.cos(yaw), math.sin(yaw)
        # camera axes (x right, y down, z forward) to ego axes (x forward, y left, z up)
        base = torch.tensor([[0.0, 0.0, 1.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]])
        yaw_m = torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
        rots.append(yaw_m @ base)
        trans.append(torch.tensor([0.0, 0.0, 1.5]))
    return torch.stack(rots), torch.stack(trans)


class BEVDataset(torch.utils.data.Dataset):
    """``plant`` at sample ``bad`` (in the batches where ``bad_from <= index``):
    ``nan_calib`` (a camera's intrinsics NaN: a calibration record missing), ``all_dropped``
    (camera dropout drops every camera: nothing visible), ``raw`` (one camera's image in 0-255,
    never normalised), ``raw12`` (one camera's 12-bit HDR frame read unscaled, 0-4095), ``dropped`` (camera 1 dropped in every sample)."""

    def __init__(self, size: int, bad: int | None = None, plant: str = "", bad_from: int = 0,
                 seed: int = 0, dropout: float = 0.0):
        self.size, self.bad, self.plant, self.bad_from = size, bad, plant, bad_from
        self.seed, self.dropout = seed, dropout

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1000 + i)
        imgs = torch.randn(CAMS, 3, IMG_H, IMG_W, generator=g)
        rots, trans = camera_rig()
        intrins = torch.tensor([[8.0, 0.0, IMG_W / 2], [0.0, 8.0, IMG_H / 2], [0.0, 0.0, 1.0]])
        intrins = intrins.repeat(CAMS, 1, 1)
        target = (torch.rand(1, BEV, BEV, generator=g) < 0.1).float()
        visibility = (torch.rand(1, BEV, BEV, generator=g) < 0.9).float()
        keep = (torch.rand(CAMS, generator=g) >= self.dropout).float()
        hit = self.bad is not None and i >= self.bad_from and i % 4 == self.bad
        if self.plant == "dropped":
            keep[1] = 0.0
        if hit and self.plant == "nan_calib":
            intrins[2] = float("nan")
        if hit and self.plant == "all_dropped":
            keep[:] = 0.0
        if hit and self.plant == "raw":  # an 8-bit frame, not scaled nor normalised
            imgs[0] = (imgs[0] * 60 + 128).clamp(0, 255).round()
        if hit and self.plant == "raw12":  # a 12-bit HDR camera's frame, read unscaled
            imgs[0] = (imgs[0] * 1000 + 2048).clamp(0, 4095).round()
        if not keep.all():  # a dropped camera: its image blank, nothing visible without it
            imgs = imgs * keep[:, None, None, None]
            if not keep.any():
                visibility.zero_()
        return imgs, rots, trans, intrins, keep, target, visibility


def make_lss_full() -> LiftSplat:
    """Every guarded option: the depth mass's log floored, features normalised by
    ``F.normalize``, the learned camera embedding."""
    torch.manual_seed(0)
    return LiftSplat(log_mass=True, norm_feats="inside", cam_embed=True)
