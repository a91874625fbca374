"""Crowd counting as CSRNet, MCNN's geometry-adaptive kernels, Bayesian Loss (Ma et al. 2019)
and DM-Count (Wang et al. 2020) write it, small enough for CPU tests, for
``test_crowd_counting``.

- ``CSRNet``: a VGG-16-like front end (two pools: a density map at 1/4 of the image), a dilated
  conv back end and a 1x1 output layer behind a ReLU (DM-Count's density head).
- ``CrowdScenes``: a ``Dataset`` of images with head annotations (points in pixels), each
  randomly cropped; the collate stacks the crops and keeps each crop's points in a list, with
  DM-Count's discrete map (the count of heads in each density-map cell).
- ``DMCountLoss``: DM-Count's counting loss ``|sum(pred) - count|``, its optimal transport loss
  (Sinkhorn between the normalised density ``pred / pred.sum()`` and the head points) and its
  total variation loss between the normalised density and the normalised discrete map.
- ``BayesianLoss``: Bayesian Loss's per-point posteriors, a softmax over the points of
  ``-dist^2 / (2 sigma^2)`` at each pixel, and each point's expected count ``sum(prob * pred)``.
- ``AdaptiveDensityMSE``: MCNN's geometry-adaptive ground truth rendered on the fly, each head
  a Gaussian of ``sigma = beta * mean distance to its k nearest heads``, then CSRNet's MSE.
- ``RelativeCountLoss``: the relative count error ``|sum(pred) - count| / count``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IMAGE, CROP, STRIDE = 40, 32, 4
SIDE = CROP // STRIDE  # density-map side


class CSRNet(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        w = width
        self.frontend = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(w, w, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.backend = nn.Sequential(
            nn.Conv2d(2 * w, 2 * w, 3, padding=2, dilation=2), nn.ReLU(inplace=True),
            nn.Conv2d(2 * w, w, 3, padding=2, dilation=2), nn.ReLU(inplace=True))
        self.output_layer = nn.Conv2d(w, 1, 1)

    def forward(self, x):
        return torch.relu(self.output_layer(self.backend(self.frontend(x))))


def make_csrnet():
    torch.manual_seed(0)
    return CSRNet()


def make_csrnet_dead_head():
    """CSRNet whose density head was re-initialised with a negative bias (a 'start from an
    empty map' trick): a dark image's features are too weak to lift it above 0."""
    model = make_csrnet()
    with torch.no_grad():
        model.output_layer.bias.fill_(-0.3)
    return model


# ---------------------------------------------------------------------------------------------
# data


def scene(g: torch.Generator, n: int):
    """An image with ``n`` heads: a dark background with a bright blob at each head."""
    points = torch.rand(n, 2, generator=g) * (IMAGE - 4) + 2
    ys, xs = torch.meshgrid(torch.arange(IMAGE), torch.arange(IMAGE), indexing="ij")
    grid = torch.stack([xs, ys], -1).float()
    img = 0.1 * torch.rand(3, IMAGE, IMAGE, generator=g)
    for p in points:
        img += torch.exp(-((grid - p) ** 2).sum(-1) / 4.0)
    return img, points


class CrowdScenes(torch.utils.data.Dataset):
    """Images with head points, randomly cropped (a crop keeps the points inside it)."""

    def __init__(self, seed: int, size: int, empty=(), duplicated=(), dark=()):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(size):
            img, pts = scene(g, 0 if i in empty else int(torch.randint(3, 9, (1,), generator=g)))
            if i in duplicated:  # the same head clicked twice, and the crop holds only it
                pts = pts[:1].repeat(2, 1).clamp(6, IMAGE - 6)
            if i in dark:  # a night frame: the sensor's black level
                img = torch.zeros_like(img)
            self.items.append((img, pts, i in duplicated))
        self.g = torch.Generator().manual_seed(seed + 1)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img, pts, centred = self.items[i]
        if centred:  # keep a crop around the duplicated head
            x0 = min(max(int(pts[0, 0]) - CROP // 2, 0), IMAGE - CROP)
            y0 = min(max(int(pts[0, 1]) - CROP // 2, 0), IMAGE - CROP)
        else:
            x0, y0 = (int(v) for v in torch.randint(0, IMAGE - CROP + 1, (2,), generator=self.g))
        crop = img[:, y0:y0 + CROP, x0:x0 + CROP]
        pts = pts - torch.tensor([x0, y0], dtype=torch.float32)
        inside = ((pts >= 0) & (pts < CROP)).all(1)
        return crop, pts[inside]


def discrete_map(points: torch.Tensor) -> torch.Tensor:
    """DM-Count's ``gt_discrete``: the number of heads in each density-map cell."""
    cells = (points // STRIDE).long().clamp(0, SIDE - 1)
    out = torch.zeros(SIDE * SIDE)
    out.index_add_(0, cells[:, 1] * SIDE + cells[:, 0], torch.ones(len(points)))
    return out.view(1, SIDE, SIDE)


def collate(batch):
    images = torch.stack([b[0] for b in batch])
    points = [b[1] for b in batch]
    return images, points, torch.stack([discrete_map(p) for p in points])


def loader(seed: int, size: int = 16, batch_size: int = 4, **planted):
    return torch.utils.data.DataLoader(CrowdScenes(seed, size, **planted),
                                       batch_size=batch_size, collate_fn=collate)


def cell_centres() -> torch.Tensor:
    c = torch.arange(SIDE, dtype=torch.float32) * STRIDE + STRIDE / 2
    ys, xs = torch.meshgrid(c, c, indexing="ij")
    return torch.stack([xs.flatten(), ys.flatten()], -1)  # (SIDE*SIDE, 2)


# ---------------------------------------------------------------------------------------------
# DM-Count


def sinkhorn(a, b, C, eps: float, iters: int = 50):
    """Entropic OT between a density ``a`` over cells and a uniform ``b`` over points."""
    K = torch.exp(-C / eps)
    v = torch.ones_like(b)
    for _ in range(iters):
        u = a / (K @ v)
        v = b / (K.t() @ u)
    return u, v, K


class DMCountLoss(nn.Module):
    def __init__(self, eps: float = 10.0, wot: float = 0.1, wtv: float = 0.01,
                 guarded: bool = True, half_ot: bool = False):
        super().__init__()
        self.eps, self.wot, self.wtv = eps, wot, wtv
        self.guarded, self.half_ot = guarded, half_ot
        self.register_buffer("cells", cell_centres())

    def ot_loss(self, pred, points):
        B = pred.shape[0]
        mu = pred.view(B, -1)
        mu_normed = mu / (mu.sum(1, keepdim=True) + 1e-6)
        loss = pred.new_zeros(())
        for i, pts in enumerate(points):
            if len(pts) == 0:  # DM-Count skips empty crops in the OT term
                continue
            C = torch.cdist(self.cells, pts) ** 2 / CROP ** 2 * 100  # (cells, points)
            a, b = mu_normed[i], torch.full((len(pts),), 1.0 / len(pts))
            if self.half_ot:  # the transport plan in fp16, as an AMP run's matmuls give it
                a, b, C = a.half(), b.half(), C.half()
            with torch.no_grad():  # the dual potential on the cells is the OT gradient
                u, _, _ = sinkhorn(a.detach(), b, C, self.eps)
                potential = self.eps * torch.log(u.float() + 1e-8)
            loss = loss + (mu_normed[i] * (potential - potential.mean())).sum()
        return loss / B

    def forward(self, pred, points, gt_discrete):
        B = pred.shape[0]
        count = torch.tensor([float(len(p)) for p in points])
        count_loss = (pred.sum((1, 2, 3)) - count).abs().mean()
        pred_normed = pred / (pred.sum((1, 2, 3), keepdim=True) + 1e-6)
        if self.guarded:
            gt_normed = gt_discrete / (count.view(B, 1, 1, 1) + 1e-6)
        else:
            gt_normed = gt_discrete / count.view(B, 1, 1, 1)  # the bug: an empty crop is 0/0
        tv = ((pred_normed - gt_normed).abs().sum((1, 2, 3)) * count).mean()
        return count_loss + self.wot * self.ot_loss(pred, points) + self.wtv * tv


class NormalisedDensityLoss(nn.Module):
    """DM-Count's TV term as first written: the density normalised by its own sum, no eps."""

    def forward(self, pred, points, gt_discrete):
        B = pred.shape[0]
        count = torch.tensor([float(len(p)) for p in points])
        pred_normed = pred / pred.sum((1, 2, 3), keepdim=True)  # all-zero density: 0/0
        gt_normed = gt_discrete / count.clamp_min(1).view(B, 1, 1, 1)
        tv = ((pred_normed - gt_normed).abs().sum((1, 2, 3)) * count).mean()
        return (pred.sum((1, 2, 3)) - count).abs().mean() + 0.01 * tv


# ---------------------------------------------------------------------------------------------
# Bayesian Loss


class BayesianLoss(nn.Module):
    def __init__(self, sigma: float = 8.0, guarded: bool = True):
        super().__init__()
        self.sigma, self.guarded = sigma, guarded
        self.register_buffer("cells", cell_centres())

    def posteriors(self, points):
        """Each point's posterior at each cell: a softmax over the points."""
        probs = []
        for pts in points:
            dist = torch.cdist(pts, self.cells) ** 2  # (points, cells)
            probs.append(torch.softmax(-dist / (2 * self.sigma ** 2), dim=0))
        return probs

    def forward(self, pred, points, gt_discrete):
        B = pred.shape[0]
        loss = pred.new_zeros(())
        for i, prob in enumerate(self.posteriors(points)):
            density = pred[i].view(1, -1)
            if self.guarded and len(prob) == 0:  # Bayesian Loss's branch for empty images
                loss = loss + density.sum().abs()
                continue
            pre_count = (density * prob).sum(1)  # each point's expected count
            target = torch.ones_like(pre_count)
            loss = loss + (target - pre_count).abs().mean()  # the bug: mean of no points
        return loss / B


# ---------------------------------------------------------------------------------------------
# geometry-adaptive kernels


class AdaptiveDensityMSE(nn.Module):
    """MCNN's ground truth, rendered per crop: sigma_i = beta * mean distance to its k nearest
    heads (a fixed sigma for a lone head), each Gaussian normalised to sum to 1."""

    def __init__(self, k: int = 3, beta: float = 0.3, min_sigma: float = 0.0):
        super().__init__()
        self.k, self.beta, self.min_sigma = k, beta, min_sigma
        self.register_buffer("cells", cell_centres())

    def density(self, pts):
        if len(pts) == 0:
            return self.cells.new_zeros(SIDE * SIDE)
        if len(pts) == 1:
            sigma = torch.full((1,), 4.0)
        else:
            k = min(self.k, len(pts) - 1)
            d = torch.cdist(pts, pts)
            knn = d.topk(k + 1, largest=False).values[:, 1:]  # without the point itself
            sigma = (self.beta * knn.mean(1)).clamp_min(self.min_sigma)
        d2 = torch.cdist(pts, self.cells) ** 2  # (points, cells)
        kernel = torch.exp(-d2 / (2 * sigma[:, None] ** 2))  # sigma 0: 0/0 at the head
        kernel = kernel / kernel.sum(1, keepdim=True)
        return kernel.sum(0)

    def forward(self, pred, points, gt_discrete):
        gt = torch.stack([self.density(p) for p in points]).view_as(pred)
        return F.mse_loss(pred, gt, reduction="sum") / (2 * len(points))


class RelativeCountLoss(nn.Module):
    """The count's relative error as a loss (a metric of the benchmark trained on directly)."""

    def forward(self, pred, points, gt_discrete):
        count = torch.tensor([float(len(p)) for p in points])
        est = pred.sum((1, 2, 3))
        return ((est - count).abs() / count).mean()  # the bug: a crop with no one in it


LOSSES = {"dm": DMCountLoss, "bayes": BayesianLoss, "adaptive": AdaptiveDensityMSE,
          "normalised": NormalisedDensityLoss, "relative": RelativeCountLoss}
