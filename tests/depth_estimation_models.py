"""Monocular depth estimation as BTS, AdaBins and MiDaS write it, for
``test_depth_estimation``.

- ``DepthNet``: a small U-Net (Conv-BN-ReLU encoder, bilinear upsampling with skip
  connections) whose head gives depth as ``max_depth * sigmoid`` (BTS / AdaBins) or a
  softplus disparity (MiDaS's inverse depth, monodepth2's ``disp``), with the camera's focal
  length an extra ``forward`` argument (depth scales with it, as in Metric3D's canonical camera).
- ``AdaBins``: the same U-Net with AdaBins' adaptive bins (widths per image from the pooled
  bottleneck, depth the expectation of the bin centres), ``forward`` returning
  ``(bin_edges, depth)``.
- Losses over sparse LiDAR ground truth (0 where no point hit): SILog with its variance focus
  (the log of the whole ground truth taken before the mask picks the valid pixels), Eigen's
  per-image SILog written with masked sums, berHu with its threshold per image, MiDaS's
  scale-and-shift-invariant loss (a per-image least-squares alignment solved in closed form)
  with its multi-scale gradient matching, and AdaBins' bins chamfer loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# the network


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class Up(nn.Module):
    """Bilinear upsampling, the skip concatenated, two convolutions (BTS's upconv)."""

    def __init__(self, cin: int, cskip: int, cout: int):
        super().__init__()
        self.conv = nn.Sequential(conv_bn(cin + cskip, cout), conv_bn(cout, cout))

    def forward(self, x, skip):
        x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
        return self.conv(torch.cat([x, skip], 1))


class DepthNet(nn.Module):
    """``forward(img, focal)``: ``head="sigmoid"`` gives metric depth up to ``max_depth``
    scaled by ``focal / 100`` (the canonical camera); ``head="disparity"`` gives MiDaS's
    relative inverse depth through a softplus."""

    def __init__(self, head: str = "sigmoid", max_depth: float = 80.0, width: int = 8):
        super().__init__()
        w = width
        self.head_kind, self.max_depth = head, max_depth
        self.enc1 = nn.Sequential(conv_bn(3, w), conv_bn(w, w))
        self.enc2 = nn.Sequential(nn.MaxPool2d(2), conv_bn(w, 2 * w), conv_bn(2 * w, 2 * w))
        self.enc3 = nn.Sequential(nn.MaxPool2d(2), conv_bn(2 * w, 4 * w))
        self.up2 = Up(4 * w, 2 * w, 2 * w)
        self.up1 = Up(2 * w, w, w)
        self.head = nn.Conv2d(w, 1, 3, padding=1)

    def forward(self, img, focal=None):
        s1 = self.enc1(img)
        s2 = self.enc2(s1)
        x = self.up1(self.up2(self.enc3(s2), s2), s1)
        out = self.head(x)
        if self.head_kind == "disparity":
            return F.softplus(out)
        depth = self.max_depth * torch.sigmoid(out)
        if focal is not None:
            depth = depth * (focal / 100.0).view(-1, 1, 1, 1)
        return depth


class AdaBins(DepthNet):
    """AdaBins' head on the U-Net: ``n_bins`` bin widths per image from the pooled features
    (softmax, then ``min_depth`` + cumsum), per-pixel probabilities over the bins, depth the
    expectation of the bin centres; ``forward`` returns ``(bin_edges, depth)``."""

    def __init__(self, n_bins: int = 16, min_depth: float = 1e-3, max_depth: float = 20.0,
                 width: int = 8):
        super().__init__(width=width, max_depth=max_depth)
        self.min_depth, self.head = min_depth, nn.Conv2d(width, n_bins, 1)
        self.regressor = nn.Sequential(nn.Linear(4 * width, 32), nn.LeakyReLU(),
                                       nn.Linear(32, n_bins))

    def forward(self, img, focal=None):
        s1 = self.enc1(img)
        s2 = self.enc2(s1)
        bottleneck = self.enc3(s2)
        x = self.up1(self.up2(bottleneck, s2), s1)
        widths = torch.softmax(self.regressor(bottleneck.mean((2, 3))), 1)
        widths = F.pad((self.max_depth - self.min_depth) * widths, (1, 0), value=self.min_depth)
        edges = torch.cumsum(widths, 1)
        centers = 0.5 * (edges[:, :-1] + edges[:, 1:])
        p = torch.softmax(self.head(x), 1)
        return edges, (p * centers[:, :, None, None]).sum(1, keepdim=True)


def make_adabins():
    torch.manual_seed(0)
    return AdaBins()


def make_depthnet():
    torch.manual_seed(0)
    return DepthNet()


def make_midas():
    torch.manual_seed(0)
    return DepthNet(head="disparity")


# ---------------------------------------------------------------------------------------------
# losses


class SILogLoss(nn.Module):
    """AdaBins' SILog: ``10 * sqrt(var(g) + (1 - lambd) mean(g)^2)`` of the log error over
    the valid pixels. The log of the ground truth is taken over the whole map (its holes give
    -inf) and the valid pixels picked after (``g[valid]``), as many repos write it."""

    def __init__(self, lambd: float = 0.85, min_depth: float = 1e-3):
        super().__init__()
        self.lambd, self.min_depth = lambd, min_depth

    def forward(self, pred, gt):
        valid = gt > self.min_depth
        g = torch.log(pred) - torch.log(gt)
        g = g[valid]
        dg = torch.var(g) + (1 - self.lambd) * torch.pow(torch.mean(g), 2)
        return 10 * torch.sqrt(dg)


class PerImageSILog(nn.Module):
    """SILog with each image's own mean over its valid pixels (Eigen's per-image
    formulation), written with sums over the masked log error, ``mask.sum`` per image."""

    def __init__(self, lambd: float = 0.85):
        super().__init__()
        self.lambd = lambd

    def forward(self, pred, gt):
        mask = (gt > 0).to(pred.dtype)
        d = (torch.log(pred) - torch.log(gt.clamp(min=1e-3))) * mask
        n = mask.sum((1, 2, 3))
        d2 = (d ** 2).sum((1, 2, 3))  # squared log errors summed per image
        return (d2 / n - self.lambd * (d.sum((1, 2, 3)) / n) ** 2).mean()


class BerHuLoss(nn.Module):
    """The reverse Huber (Laina et al.): L1 below ``c = 0.2 max|d|`` of each image, the scaled
    L2 ``(d^2 + c^2) / 2c`` above it; the pixels without ground truth give ``d = 0``."""

    def forward(self, pred, gt):
        mask = gt > 0
        diff = (pred - gt).abs() * mask
        c = 0.2 * diff.flatten(1).amax(1).view(-1, 1, 1, 1)
        l2 = (diff ** 2 + c ** 2) / (2 * c)
        loss = torch.where(diff <= c, diff, l2)
        return loss.sum() / mask.sum()


def bins_chamfer(bin_edges, gt):
    """AdaBins' chamfer loss between each image's bin centres and its valid depths, written
    by hand (pytorch3d's ``chamfer_distance`` with ``y_lengths``)."""
    centers = 0.5 * (bin_edges[:, 1:] + bin_edges[:, :-1])
    pts = gt.flatten(1)
    valid = pts >= 1e-3
    d2 = (centers[:, :, None] - pts[:, None, :]) ** 2
    to_gt = d2.masked_fill(~valid[:, None, :], float("inf")).amin(2)  # each centre's nearest
    to_bins = d2.amin(1)  # each point's nearest centre
    return (to_gt.mean(1) + (to_bins * valid).sum(1) / valid.sum(1)).mean()


class AdaBinsLoss(nn.Module):
    """AdaBins' objective on ``(bin_edges, depth)``: SILog plus ``w_chamfer`` times the
    bins' chamfer loss."""

    def __init__(self, w_chamfer: float = 0.1):
        super().__init__()
        self.silog, self.w_chamfer = SILogLoss(), w_chamfer

    def forward(self, out, gt):
        bin_edges, pred = out
        return self.silog(pred, gt) + self.w_chamfer * bins_chamfer(bin_edges, gt)


def compute_scale_and_shift(prediction, target, mask, guard: bool = True):
    """MiDaS's closed-form least squares ``min_{s,t} sum mask (s p + t - d)^2`` per image."""
    a_00 = torch.sum(mask * prediction * prediction, (1, 2))
    a_01 = torch.sum(mask * prediction, (1, 2))
    a_11 = torch.sum(mask, (1, 2))
    b_0 = torch.sum(mask * prediction * target, (1, 2))
    b_1 = torch.sum(mask * target, (1, 2))
    det = a_00 * a_11 - a_01 * a_01
    if guard:  # MiDaS's own code solves only where det != 0
        x_0, x_1 = torch.zeros_like(b_0), torch.zeros_like(b_1)
        valid = det.nonzero()
        x_0[valid] = (a_11[valid] * b_0[valid] - a_01[valid] * b_1[valid]) / det[valid]
        x_1[valid] = (-a_01[valid] * b_0[valid] + a_00[valid] * b_1[valid]) / det[valid]
        return x_0, x_1
    x_0 = (a_11 * b_0 - a_01 * b_1) / det
    x_1 = (-a_01 * b_0 + a_00 * b_1) / det
    return x_0, x_1


class ScaleAndShiftInvariantLoss(nn.Module):
    """MiDaS: the predicted disparity aligned to the ground truth's (``1 / depth``) by each
    image's own scale and shift, then the masked MSE (``reduction_based_on_image``)."""

    def __init__(self, guard: bool = True):
        super().__init__()
        self.guard = guard

    def forward(self, prediction, depth):
        prediction, depth = prediction[:, 0], depth[:, 0]
        mask = (depth > 0).to(prediction.dtype)
        target = torch.where(depth > 0, 1.0 / depth.clamp(min=1e-3), torch.zeros_like(depth))
        scale, shift = compute_scale_and_shift(prediction, target, mask, self.guard)
        aligned = scale.view(-1, 1, 1) * prediction + shift.view(-1, 1, 1)
        res = (aligned - target) ** 2 * mask
        image_loss = res.sum((1, 2)) / mask.sum((1, 2)).clamp(min=1)
        return image_loss.mean()


def gradient_loss(prediction, target, mask):
    """MiDaS's gradient matching term of one scale, reduced per image by its valid pixels
    (``reduction_image_based``, written here without MiDaS's ``M.nonzero()`` guard)."""
    m = torch.sum(mask, (1, 2))
    diff = mask * (prediction - target)
    grad_x = torch.abs(diff[:, :, 1:] - diff[:, :, :-1]) * (mask[:, :, 1:] * mask[:, :, :-1])
    grad_y = torch.abs(diff[:, 1:, :] - diff[:, :-1, :]) * (mask[:, 1:, :] * mask[:, :-1, :])
    image_loss = torch.sum(grad_x, (1, 2)) + torch.sum(grad_y, (1, 2))
    return image_loss / m


class SSIGradientLoss(ScaleAndShiftInvariantLoss):
    """MiDaS's full objective: the aligned MSE plus ``alpha`` times gradient matching of the
    aligned prediction at ``scales`` scales, each taking every ``2**k``-th pixel."""

    def __init__(self, alpha: float = 0.5, scales: int = 4):
        super().__init__(guard=True)
        self.alpha, self.scales = alpha, scales

    def forward(self, prediction, depth):
        data = super().forward(prediction, depth)
        prediction, depth = prediction[:, 0], depth[:, 0]
        mask = (depth > 0).to(prediction.dtype)
        target = torch.where(depth > 0, 1.0 / depth.clamp(min=1e-3), torch.zeros_like(depth))
        scale, shift = compute_scale_and_shift(prediction, target, mask)
        aligned = scale.view(-1, 1, 1) * prediction + shift.view(-1, 1, 1)
        reg = 0.0
        for k in range(self.scales):
            s = 2 ** k
            reg = reg + gradient_loss(aligned[:, ::s, ::s], target[:, ::s, ::s],
                                      mask[:, ::s, ::s]).mean()
        return data + self.alpha * reg


# ---------------------------------------------------------------------------------------------
# data


def scenes(n: int, size: int = 16, seed: int = 0, density: float = 0.3):
    """``(img, depth, focal)``: a ground plane receding to the horizon with a box in front,
    the image a shaded copy of the depth plus noise; the depth sparse as projected LiDAR is
    (0 where no point hit, ``density`` of the pixels hit)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.linspace(0.2, 1.0, size).view(size, 1).expand(size, size)
    depth = (4.0 / rows).expand(n, 1, size, size).clone()
    for i in range(n):
        r, c = torch.randint(2, size - 6, (2,), generator=g).tolist()
        depth[i, 0, r:r + 4, c:c + 4] = 2.0 + 3.0 * torch.rand((), generator=g)
    img = torch.cat([1.0 / depth, depth / 20.0, torch.ones_like(depth)], 1)
    img = img + 0.05 * torch.randn(img.shape, generator=g)
    hit = torch.rand(depth.shape, generator=g) < density
    focal = 90.0 + 20.0 * torch.rand(n, generator=g)
    return img, depth * hit, focal
