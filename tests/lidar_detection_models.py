"""LiDAR 3D object detection written as PointPillars, OpenPCDet and CenterPoint write it, for
``test_lidar_detection``.

- ``PillarFeatureNet``: a dense voxelisation ``(B, P, N, 4)`` (x, y, z, intensity), each
  pillar padded to ``N`` points and each scene to ``P`` pillars (``num_points`` 0 for a padded
  pillar); the intensity channel normalised by the scan's maximum, the offsets of each point
  to its pillar's mean (``points.sum / num_points``) and to the pillar's centre, a linear
  layer, BatchNorm and ReLU over the points the mask keeps, a max over the pillar's points.
- ``PointPillarsScatter``: the pillars' features written into a BEV canvas at their grid
  cells (``canvas[b, :, coords] = feats``).
- ``CenterPoint``: a small BEV backbone and CenterPoint's heads: a class heatmap and, at each
  object's cell, the box regression (dx, dy, z, log w/l/h of the anchor size, sin and cos of
  the yaw).
- ``CenterPointLoss``: the heatmap focal loss (CenterNet's ``_neg_loss``) normalised by the
  number of objects, ``max(num_pos, 1)`` or per scene; the L1 of the regression at the
  objects' cells (gathered by ``ind``, masked by ``reg_mask``), sizes encoded
  ``log(gt / anchor)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

GRID = 8                              # BEV cells per side
CELL = 0.5                            # metres per cell
PILLARS, POINTS, MAX_OBJECTS = 24, 6, 4
ANCHOR = torch.tensor([1.9, 4.5, 1.6])  # car w, l, h in metres (KITTI's mean size)


class PillarFeatureNet(nn.Module):
    """PointPillars' PFN layer: 4 point channels + 3 cluster offsets + 2 centre offsets."""

    def __init__(self, out: int = 16, masked_mean: bool = True, scan_max_eps: bool = True,
                 masked_max: bool = False):
        super().__init__()
        self.linear = nn.Linear(9, out, bias=False)
        self.norm = nn.BatchNorm1d(out, eps=1e-3, momentum=0.01)
        self.masked_mean, self.scan_max_eps = masked_mean, scan_max_eps
        self.masked_max = masked_max

    def forward(self, points, num_points, coords):
        mask = torch.arange(points.shape[2]) < num_points[..., None]  # (B, P, N)
        scan_max = points[..., 3].amax(dim=(1, 2))[:, None, None, None]
        if self.scan_max_eps:
            scan_max = scan_max.clamp_min(1e-6)
        intensity = points[..., 3:] / scan_max
        count = num_points[..., None, None].type_as(points)
        if self.masked_mean:
            count = count.clamp_min(1)
        mean = points[..., :3].sum(dim=2, keepdim=True) / count  # the bug: 0/0 for a padded pillar
        f_cluster = points[..., :3] - mean
        centre = torch.stack([coords % GRID, coords // GRID], -1).type_as(points) * CELL
        f_center = points[..., :2] - (centre[:, :, None] + CELL / 2)
        feats = torch.cat([points[..., :3], intensity, f_cluster, f_center], -1)
        feats = feats * mask[..., None].type_as(feats)
        x = self.linear(feats)
        b, p, n, c = x.shape
        x = F.relu(self.norm(x.reshape(-1, c)).reshape(b, p, n, c))
        if self.masked_max:  # (a padded pillar's max is -inf: the scatter drops it)
            x = x.masked_fill(~mask[..., None], float("-inf"))
        return x.max(dim=2).values  # (B, P, C)


class PointPillarsScatter(nn.Module):
    def forward(self, feats, coords, num_points):
        b, p, c = feats.shape
        canvas = feats.new_zeros(b, c, GRID * GRID)
        for i in range(b):
            keep = num_points[i] > 0
            canvas[i][:, coords[i][keep]] = feats[i][keep].t()
        return canvas.view(b, c, GRID, GRID)


def square_distance(src, dst):
    """PointNet++'s pairwise squared distances, |s|² + |d|² - 2 s·d (one matmul)."""
    dist = -2 * torch.matmul(src, dst.transpose(1, 2))  # the bug: s·d past 65504 in float16
    dist = dist + (src ** 2).sum(-1)[:, :, None]
    return dist + (dst ** 2).sum(-1)[:, None, :]


class PillarContext(nn.Module):
    """Each pillar gathers its k nearest pillars' features (by their centres of mass),
    weighted by a softmax of minus the squared distance, as PointNet++'s feature
    propagation and Point Transformer's local attention do."""

    def __init__(self, ch: int = 16, k: int = 4):
        super().__init__()
        self.k, self.proj = k, nn.Linear(ch, ch)

    def forward(self, feats, centres):
        d = square_distance(centres, centres)
        d_knn, idx = d.topk(self.k, dim=-1, largest=False)
        w = torch.softmax(-d_knn, dim=-1)
        b, p, c = feats.shape
        nb = feats.gather(1, idx.reshape(b, -1, 1).expand(b, p * self.k, c)).view(b, p, self.k, c)
        return feats + self.proj((w[..., None].type_as(nb) * nb).sum(2))


class CenterPoint(nn.Module):
    def __init__(self, ch: int = 16, classes: int = 1, context: bool = False, **pfn):
        super().__init__()
        self.pfn = PillarFeatureNet(ch, **pfn)
        self.context = PillarContext(ch) if context else None
        self.scatter = PointPillarsScatter()
        self.backbone = nn.Sequential(
            nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(),
            nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU())
        self.heatmap = nn.Conv2d(ch, classes, 3, padding=1)
        self.reg = nn.Conv2d(ch, 8, 3, padding=1)
        nn.init.constant_(self.heatmap.bias, -2.19)  # CenterPoint's prior of 0.1

    def forward(self, points, num_points, coords):
        feats = self.pfn(points, num_points, coords)
        if self.context is not None:
            count = num_points[..., None].clamp_min(1).type_as(points)
            feats = self.context(feats, points[..., :3].sum(2) / count)
        bev = self.backbone(self.scatter(feats, coords, num_points))
        return self.heatmap(bev), self.reg(bev)


def make_centerpoint() -> CenterPoint:
    torch.manual_seed(0)
    return CenterPoint()


def make_centerpoint_unmasked_mean() -> CenterPoint:
    torch.manual_seed(0)
    return CenterPoint(masked_mean=False)


def make_centerpoint_scan_max() -> CenterPoint:
    torch.manual_seed(0)
    return CenterPoint(scan_max_eps=False)


def make_centerpoint_masked_max() -> CenterPoint:
    torch.manual_seed(0)
    return CenterPoint(masked_max=True)


def make_centerpoint_context() -> CenterPoint:
    torch.manual_seed(0)
    return CenterPoint(context=True)


def focal_heatmap(pred, gt):
    """CenterNet's ``_neg_loss`` terms per cell (positives at gt == 1, the gaussian's
    penalty-reduced negatives elsewhere)."""
    pred = torch.sigmoid(pred).clamp(1e-4, 1 - 1e-4)
    pos = gt.eq(1).float()
    pos_loss = torch.log(pred) * (1 - pred) ** 2 * pos
    neg_loss = torch.log(1 - pred) * pred ** 2 * (1 - gt) ** 4 * (1 - pos)
    return -(pos_loss + neg_loss), pos


class CenterPointLoss(nn.Module):
    """Heatmap focal loss + 0.25 * L1 of the box regression at the objects' cells;
    ``per_scene``: the focal loss normalised by each scene's own number of objects."""

    def __init__(self, per_scene: str = "", reg_weight: float = 0.25):
        super().__init__()
        self.per_scene, self.reg_weight = per_scene, reg_weight

    def forward(self, hm, reg, hm_gt, boxes, ind, reg_mask):
        cells, pos = focal_heatmap(hm, hm_gt)
        if self.per_scene == "flat":  # (the same count, of the flattened heatmap)
            hm_loss = (cells.flatten(1).sum(1) / pos.flatten(1).sum(1)).mean()
        elif self.per_scene:  # the bug: a scene with no objects divides by 0
            hm_loss = (cells.sum((1, 2, 3)) / pos.sum((1, 2, 3))).mean()
        else:
            hm_loss = cells.sum() / pos.sum().clamp_min(1)
        b, c = reg.shape[:2]
        pred = reg.view(b, c, -1).gather(2, ind[:, None].expand(b, c, ind.shape[1])).transpose(1, 2)
        pred, boxes = pred[reg_mask], boxes[reg_mask]  # the objects' slots, not the padding
        target = torch.cat([boxes[:, :3], torch.log(boxes[:, 3:6] / ANCHOR),
                            torch.sin(boxes[:, 6:]), torch.cos(boxes[:, 6:])], -1)
        reg_loss = F.l1_loss(pred, target, reduction="sum") / max(len(boxes), 1)
        return hm_loss + self.reg_weight * reg_loss


def scene(g: torch.Generator, objects: int, pillars: int = PILLARS, intensity: bool = True):
    """One synthetic sweep: ``pillars`` occupied cells (more where the objects are), their
    points, and CenterPoint's targets (gaussian heatmap, boxes relative to their cell)."""
    cells = torch.randperm(GRID * GRID, generator=g)
    obj_cells = cells[:objects]
    coords = torch.zeros(PILLARS, dtype=torch.long)
    coords[:pillars] = cells[:pillars]
    num = torch.zeros(PILLARS, dtype=torch.long)
    num[:pillars] = torch.randint(1, POINTS + 1, (pillars,), generator=g)
    pts = torch.zeros(PILLARS, POINTS, 4)
    for j in range(pillars):
        cx, cy = (coords[j] % GRID + 0.5) * CELL, (coords[j] // GRID + 0.5) * CELL
        k = int(num[j])
        xy = torch.rand(k, 2, generator=g) * CELL - CELL / 2 + torch.tensor([cx, cy])
        z = torch.rand(k, 1, generator=g) * 1.5 - 1.6
        inten = torch.rand(k, 1, generator=g) * 255 if intensity else torch.zeros(k, 1)
        pts[j, :k] = torch.cat([xy, z, inten], 1)
    hm = torch.zeros(1, GRID, GRID)
    ys, xs = torch.meshgrid(torch.arange(GRID), torch.arange(GRID), indexing="ij")
    boxes, ind, reg_mask = torch.zeros(MAX_OBJECTS, 7), torch.zeros(MAX_OBJECTS, dtype=torch.long), \
        torch.zeros(MAX_OBJECTS, dtype=torch.bool)
    for k, cell in enumerate(obj_cells.tolist()):
        cx, cy = cell % GRID, cell // GRID
        hm[0] = torch.maximum(hm[0], torch.exp(-((xs - cx) ** 2 + (ys - cy) ** 2) / 2.0))
        size = ANCHOR * (0.8 + 0.4 * torch.rand(3, generator=g))
        yaw = (torch.rand(1, generator=g) * 2 - 1) * math.pi
        offset = torch.rand(2, generator=g)
        boxes[k] = torch.cat([offset, torch.tensor([-0.8]), size, yaw])
        ind[k], reg_mask[k] = cell, True
    return pts, num, coords, hm, boxes, ind, reg_mask


def batch(g: torch.Generator, size: int = 4, bad: int | None = None, plant: str = ""):
    """A batch of scenes; ``bad`` gets the planted condition: ``sparse`` (a rain-blinded sweep
    with 6 occupied pillars, the rest padding), ``dark`` (a sensor reporting no intensity),
    ``empty`` (a scene with no objects), ``flat`` (a label of width 0), ``far`` (a pillar of
    ghost returns 300 m out, the point cloud range filter missing)."""
    scenes = []
    for i in range(size):
        hit = i == bad
        scenes.append(scene(g, objects=0 if hit and plant == "empty" else 2,
                            pillars=6 if hit and plant == "sparse" else PILLARS,
                            intensity=not (hit and plant == "dark")))
    cols = [torch.stack(c) for c in zip(*scenes)]
    if bad is not None and plant == "far":
        cols[0][bad, 0, :cols[1][bad, 0]] += torch.tensor([300.0, 0.0, 0.0, 0.0])
    if bad is not None and plant == "flat":
        cols[4][bad, 0, 3] = 0.0  # an annotator's degenerate box: w = 0
    return cols
