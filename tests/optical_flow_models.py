"""Optical flow trained as RAFT, PWC-Net/ARFlow and UnFlow write it, for ``test_optical_flow``.

- ``RAFT``: a feature and a context encoder, the all-pairs correlation volume
  ``fmap1^T fmap2 / sqrt(D)`` (a plain class, not a module, as RAFT's ``CorrBlock``) with a
  pyramid by ``avg_pool2d``, lookups by ``grid_sample`` at ``coords + flow`` normalised by
  ``(W - 1)``, a ConvGRU, convex upsampling (a softmax over the 9 neighbours times the
  unfolded flow). ``corr_fp32=False`` builds the volume under the caller's autocast, as the
  ports that drop RAFT's ``fmap1.float()`` do.
- ``sequence_loss``: RAFT's own, word for word: ``gamma^(N-i-1)`` weights, the valid map
  from the ground truth's validity channel and a magnitude filter, ``(valid * |err|).mean()``.
- ``multiscale_epe``: PWC-Net's multi-scale end-point error (a hand-written ``sqrt`` of the
  squared residual), the sparse ground truth downsampled by ``avg_pool(flow * v) / avg_pool(v)``.
- ``kitti_batch``: KITTI-like sparse ground truth (a validity channel); ``invalid`` says how
  the reader stores flow where there is none: 0, Middlebury's ``1e9`` or NaN. ``warm_start``:
  a video's previous flow as ``flow_init``, NaN where nothing was splatted.
- ``GlobalMatch``: GMFlow's softmax matching over the correlation, windowed by a ``-inf`` fill.
- ``UnsupFlow``: a two-level flow net run both ways (forward and backward flow), trained by
  UnFlow's photometric loss: the census transform, forward-backward occlusion masks, the
  generalised Charbonnier ``(x^2 + eps^2)^alpha`` normalised by the non-occluded pixels
  (``make_unsup_half``: the net in float16 throughout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# RAFT


def coords_grid(b: int, h: int, w: int) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([xs, ys], 0).float()[None].repeat(b, 1, 1, 1)


def bilinear_sampler(img, coords):
    """RAFT's ``bilinear_sampler``: pixel coordinates to [-1, 1], then ``grid_sample``."""
    h, w = img.shape[-2:]
    xgrid, ygrid = coords.split([1, 1], dim=-1)
    xgrid = 2 * xgrid / (w - 1) - 1
    ygrid = 2 * ygrid / (h - 1) - 1
    grid = torch.cat([xgrid, ygrid], dim=-1)
    return F.grid_sample(img, grid, align_corners=True)


class CorrBlock:
    def __init__(self, fmap1, fmap2, num_levels: int = 2, radius: int = 1):
        self.num_levels, self.radius = num_levels, radius
        corr = CorrBlock.corr(fmap1, fmap2)
        b, h1, w1, dim, h2, w2 = corr.shape
        corr = corr.reshape(b * h1 * w1, dim, h2, w2)
        self.corr_pyramid = [corr]
        for _ in range(self.num_levels - 1):
            corr = F.avg_pool2d(corr, 2, stride=2)
            self.corr_pyramid.append(corr)

    def __call__(self, coords):
        r = self.radius
        coords = coords.permute(0, 2, 3, 1)
        b, h1, w1, _ = coords.shape
        out_pyramid = []
        for i in range(self.num_levels):
            corr = self.corr_pyramid[i]
            dx = torch.linspace(-r, r, 2 * r + 1, device=coords.device)
            dy = torch.linspace(-r, r, 2 * r + 1, device=coords.device)
            delta = torch.stack(torch.meshgrid(dy, dx, indexing="ij"), dim=-1)
            centroid_lvl = coords.reshape(b * h1 * w1, 1, 1, 2) / 2 ** i
            coords_lvl = centroid_lvl + delta.view(1, 2 * r + 1, 2 * r + 1, 2)
            corr = bilinear_sampler(corr, coords_lvl)
            out_pyramid.append(corr.view(b, h1, w1, -1))
        return torch.cat(out_pyramid, dim=-1).permute(0, 3, 1, 2).contiguous().float()

    @staticmethod
    def corr(fmap1, fmap2):
        batch, dim, ht, wd = fmap1.shape
        fmap1 = fmap1.view(batch, dim, ht * wd)
        fmap2 = fmap2.view(batch, dim, ht * wd)
        corr = torch.matmul(fmap1.transpose(1, 2), fmap2)
        corr = corr.view(batch, ht, wd, 1, ht, wd)
        return corr / torch.sqrt(torch.tensor(dim).float())


class ConvGRU(nn.Module):
    def __init__(self, hidden: int, inp: int):
        super().__init__()
        self.convz = nn.Conv2d(hidden + inp, hidden, 3, padding=1)
        self.convr = nn.Conv2d(hidden + inp, hidden, 3, padding=1)
        self.convq = nn.Conv2d(hidden + inp, hidden, 3, padding=1)

    def forward(self, h, x):
        hx = torch.cat([h, x], dim=1)
        z = torch.sigmoid(self.convz(hx))
        r = torch.sigmoid(self.convr(hx))
        q = torch.tanh(self.convq(torch.cat([r * h, x], dim=1)))
        return (1 - z) * h + z * q


class UpdateBlock(nn.Module):
    """Motion encoder, ConvGRU, flow head and the convex-upsampling mask head."""

    def __init__(self, corr_ch: int, hidden: int, factor: int):
        super().__init__()
        self.encoder = nn.Conv2d(corr_ch + 2, 14, 3, padding=1)
        self.gru = ConvGRU(hidden, hidden + 16)
        self.flow_head = nn.Sequential(nn.Conv2d(hidden, 16, 3, padding=1), nn.ReLU(),
                                       nn.Conv2d(16, 2, 3, padding=1))
        self.mask = nn.Sequential(nn.Conv2d(hidden, 16, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(16, factor * factor * 9, 1))

    def forward(self, net, inp, corr, flow):
        motion = torch.cat([F.relu(self.encoder(torch.cat([corr, flow], dim=1))), flow], dim=1)
        net = self.gru(net, torch.cat([inp, motion], dim=1))
        mask = 0.25 * self.mask(net)  # RAFT scales the mask to balance its gradients
        return net, mask, self.flow_head(net)


def encoder(dim: int, norm: bool) -> nn.Module:
    layers = [nn.Conv2d(3, dim, 3, 2, 1)]
    layers += [nn.InstanceNorm2d(dim)] if norm else []
    return nn.Sequential(*layers, nn.ReLU(), nn.Conv2d(dim, dim, 3, 2, 1))


class RAFT(nn.Module):
    """A small RAFT at 1/4 resolution. ``forward(image1, image2, iters, flow_init)`` as RAFT's
    own; training returns every iteration's upsampled flow."""

    def __init__(self, dim: int = 16, hidden: int = 16, levels: int = 2, radius: int = 1,
                 norm: bool = True, corr_fp32: bool = True):
        super().__init__()
        self.fnet, self.cnet = encoder(dim, norm), encoder(2 * hidden, norm)
        self.update_block = UpdateBlock(levels * (2 * radius + 1) ** 2, hidden, 4)
        self.hidden, self.levels, self.radius, self.corr_fp32 = hidden, levels, radius, corr_fp32

    def upsample_flow(self, flow, mask):
        """RAFT's convex combination of each coarse pixel's 3x3 neighbours."""
        n, _, h, w = flow.shape
        mask = torch.softmax(mask.view(n, 1, 9, 4, 4, h, w), dim=2)
        up_flow = F.unfold(4 * flow, [3, 3], padding=1).view(n, 2, 9, 1, 1, h, w)
        up_flow = torch.sum(mask * up_flow, dim=2).permute(0, 1, 4, 2, 5, 3)
        return up_flow.reshape(n, 2, 4 * h, 4 * w)

    def forward(self, image1, image2, iters: int = 3, flow_init=None):
        image1 = 2 * (image1 / 255.0) - 1.0
        image2 = 2 * (image2 / 255.0) - 1.0
        fmap1, fmap2 = self.fnet(image1), self.fnet(image2)
        if self.corr_fp32:  # RAFT's own: the volume in float32 whatever autocast is on
            with torch.autocast(image1.device.type, enabled=False):
                corr_fn = CorrBlock(fmap1.float(), fmap2.float(), self.levels, self.radius)
        else:  # a port's: under the loop's autocast, in half precision
            corr_fn = CorrBlock(fmap1, fmap2, self.levels, self.radius)
        net, inp = torch.split(self.cnet(image1), [self.hidden, self.hidden], dim=1)
        net, inp = torch.tanh(net), torch.relu(inp)
        b, _, h, w = fmap1.shape
        coords0 = coords_grid(b, h, w).to(image1)
        coords1 = coords0.clone() if flow_init is None else coords0 + flow_init
        flow_predictions = []
        for _ in range(iters):
            coords1 = coords1.detach()
            corr = corr_fn(coords1)
            flow = coords1 - coords0
            net, up_mask, delta_flow = self.update_block(net, inp, corr, flow)
            coords1 = coords1 + delta_flow.float()
            flow_predictions.append(self.upsample_flow(coords1 - coords0, up_mask.float()))
        return flow_predictions


def make_raft() -> nn.Module:
    torch.manual_seed(0)
    return RAFT()


def make_raft_zero_head() -> nn.Module:
    """RAFT whose flow head's last conv starts at 0 (the first updates leave the flow at its
    initialisation, as flow refiners that zero-init their residual heads do)."""
    torch.manual_seed(0)
    model = RAFT()
    nn.init.zeros_(model.update_block.flow_head[-1].weight)
    nn.init.zeros_(model.update_block.flow_head[-1].bias)
    return model


def make_raft_half_corr() -> nn.Module:
    """RAFT without the encoders' instance norm, its correlation volume built under the
    training loop's float16 autocast."""
    torch.manual_seed(0)
    return RAFT(norm=False, corr_fp32=False)


def make_raft_wide_pyramid() -> nn.Module:
    """Four pyramid levels on a 1/4-resolution feature map: the coarsest is 1 pixel wide."""
    torch.manual_seed(0)
    return RAFT(levels=4)


MAX_FLOW = 400


def sequence_loss(flow_preds, flow_gt, valid, gamma=0.8, max_flow=MAX_FLOW):
    """RAFT's ``sequence_loss``."""
    n_predictions = len(flow_preds)
    flow_loss = 0.0
    # exclude invalid pixels and extremely large displacements
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    for i in range(n_predictions):
        i_weight = gamma ** (n_predictions - i - 1)
        i_loss = (flow_preds[i] - flow_gt).abs()
        flow_loss += i_weight * (valid[:, None] * i_loss).mean()
    return flow_loss


def kitti_batch(g: torch.Generator, n: int = 4, h: int = 32, w: int = 32,
                invalid: str = "zero", bad: int | None = None, density: float = 0.35):
    """Frame pairs in [0, 255], sparse flow and its validity channel (about a third of the
    pixels had a LiDAR return). ``invalid``: what the reader writes where ``valid`` is 0 in
    sample ``bad`` (all samples when ``bad`` is None): 0, ``1e9`` (Middlebury's unknown flow)
    or NaN (a reader that marks missing flow as NaN)."""
    img1 = 255 * torch.rand(n, 3, h, w, generator=g)
    img2 = torch.roll(img1, shifts=(1, 2), dims=(2, 3)) + 5 * torch.randn(n, 3, h, w, generator=g)
    flow = torch.empty(n, 2, h, w)
    flow[:, 0], flow[:, 1] = 2.0, 1.0
    flow += 0.5 * torch.randn(n, 2, h, w, generator=g)
    valid = (torch.rand(n, h, w, generator=g) < density).float()
    fill = {"zero": 0.0, "huge": 1e9, "nan": float("nan")}[invalid]
    rows = range(n) if bad is None else [bad]
    for r in rows:
        flow[r][:, valid[r] == 0] = fill
    return img1.clamp(0, 255), img2.clamp(0, 255), flow, valid


def downsample_sparse(flow, valid, factor: int):
    """Sparse ground truth to a coarser level, as multi-scale KITTI fine-tuning code does:
    each cell's mean flow over its valid pixels, and the cells that had one."""
    v = valid[:, None]
    flow_down = F.avg_pool2d(flow * v, factor) / F.avg_pool2d(v, factor)
    return flow_down, F.max_pool2d(v, factor)[:, 0]


def multiscale_epe(flow_preds, flow_gt, valid, factors=(1, 4, 8), weights=(1.0, 0.5, 0.25)):
    """PWC-Net's multi-scale end-point error on the final prediction: at each level, the
    prediction pooled and the sparse ground truth downsampled, EPE over the valid cells."""
    pred, loss = flow_preds[-1], 0.0
    for factor, w in zip(factors, weights):
        gt, v = (flow_gt, valid) if factor == 1 else downsample_sparse(flow_gt, valid, factor)
        p = pred if factor == 1 else F.avg_pool2d(pred, factor) / factor
        gt = gt / factor
        epe = torch.sum((p - gt) ** 2, dim=1).sqrt()
        loss = loss + w * (epe * v).sum() / v.sum().clamp_min(1.0)
    return loss


def warm_start(prev_flow, hole: int | None = None):
    """RAFT's warm start for video: the previous pair's flow forward-splatted to this frame
    (``forward_interpolate``); the pixels no flow landed on are NaN, as ``griddata`` with
    ``method="linear"`` leaves them outside the convex hull, in sample ``hole``."""
    init = 0.5 * prev_flow.clone()
    if hole is not None:
        init[hole, :, :2, :] = float("nan")
    return init


class GlobalMatch(nn.Module):
    """GMFlow's matching: a softmax over the all-pairs correlation, restricted to the
    displacements within ``max_disp`` by a ``-inf`` fill, its expected coordinates minus the
    grid as the flow, upsampled to full resolution."""

    def __init__(self, dim: int = 16, max_disp: float = 3.0):
        super().__init__()
        self.fnet, self.max_disp = encoder(dim, True), max_disp

    def forward(self, image1, image2):
        f1 = self.fnet(2 * (image1 / 255.0) - 1)
        f2 = self.fnet(2 * (image2 / 255.0) - 1)
        b, d, h, w = f1.shape
        corr = torch.matmul(f1.flatten(2).transpose(1, 2), f2.flatten(2)) / d ** 0.5
        grid = coords_grid(1, h, w).to(f1).flatten(2)[0].t()  # (h * w, 2)
        far = torch.cdist(grid, grid) > self.max_disp
        prob = torch.softmax(corr.masked_fill(far, float("-inf")), dim=-1)
        flow = (prob @ grid - grid).transpose(1, 2).reshape(b, 2, h, w)
        return [4 * F.interpolate(flow, scale_factor=4, mode="bilinear", align_corners=True)]


def make_global_match() -> nn.Module:
    torch.manual_seed(0)
    return GlobalMatch()


# ---------------------------------------------------------------------------------------------
# unsupervised flow: census, forward-backward occlusion, generalised Charbonnier


def flow_warp(x, flow):
    """ARFlow's ``flow_warp``: ``x`` sampled at ``grid + flow`` (zeros outside the frame)."""
    b, _, h, w = x.shape
    grid = coords_grid(b, h, w).to(x) + flow
    gx = 2 * grid[:, 0] / (w - 1) - 1
    gy = 2 * grid[:, 1] / (h - 1) - 1
    return F.grid_sample(x, torch.stack([gx, gy], -1), align_corners=True, padding_mode="zeros")


def census_transform(img, patch: int = 3):
    """UnFlow's soft census: each pixel's differences to its neighbours, squashed."""
    gray = img.mean(1, keepdim=True)
    w = torch.eye(patch * patch).view(patch * patch, 1, patch, patch).to(img)
    neigh = F.conv2d(gray, w, padding=patch // 2)
    diff = neigh - gray
    return diff / torch.sqrt(0.81 + diff ** 2)


def ternary_distance(t1, t2):
    d = (t1 - t2) ** 2
    return (d / (0.1 + d)).sum(1, keepdim=True)


def occlusion_mask(flow_fw, flow_bw, a1: float = 0.01, a2: float = 0.5):
    """UnFlow's forward-backward check: occluded where ``|f + warp(b)|^2`` is large."""
    bw_warped = flow_warp(flow_bw, flow_fw)
    mag = (flow_fw ** 2).sum(1, keepdim=True) + (bw_warped ** 2).sum(1, keepdim=True)
    diff = ((flow_fw + bw_warped) ** 2).sum(1, keepdim=True)
    return (diff < a1 * mag + a2).float()


def charbonnier(x, alpha: float, eps: float):
    """The generalised Charbonnier penalty ``(x^2 + eps^2)^alpha``."""
    return (x ** 2 + eps ** 2) ** alpha


class UnFlowLoss(nn.Module):
    """UnFlow's photometric loss, both directions: the census distance under the generalised
    Charbonnier, counted where the forward-backward check says visible, normalised by the
    number of visible pixels; a first-order smoothness term."""

    def __init__(self, alpha: float = 0.45, eps: float = 0.01, smooth: float = 0.1):
        super().__init__()
        self.alpha, self.eps, self.smooth = alpha, eps, smooth

    def direction(self, img1, img2, flow, mask):
        warped = flow_warp(img2, flow)
        dist = ternary_distance(census_transform(img1), census_transform(warped))
        photo = charbonnier(dist, self.alpha, self.eps)
        return (photo * mask).sum() / mask.sum().clamp_min(1.0)

    def forward(self, flows, img1, img2):
        flow_fw, flow_bw = flows
        img1, img2 = img1 / 255.0, img2 / 255.0
        occ_fw = occlusion_mask(flow_fw.detach(), flow_bw.detach())
        occ_bw = occlusion_mask(flow_bw.detach(), flow_fw.detach())
        loss = self.direction(img1, img2, flow_fw, occ_fw)
        loss = loss + self.direction(img2, img1, flow_bw, occ_bw)
        grad = lambda f: (f[..., 1:] - f[..., :-1]).abs().mean() + (  # noqa: E731
            f[..., 1:, :] - f[..., :-1, :]).abs().mean()
        return loss + self.smooth * (grad(flow_fw) + grad(flow_bw))


class UnsupFlow(nn.Module):
    """Both frames stacked on channels to a full-resolution flow; ``forward`` returns the
    forward and the backward flow, as unsupervised flow nets run the pair both ways."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(6, c, 3, padding=1), nn.LeakyReLU(0.1),
                                  nn.Conv2d(c, c, 3, padding=1), nn.LeakyReLU(0.1),
                                  nn.Conv2d(c, 2, 3, padding=1))

    def forward(self, img1, img2):
        a, b = img1 / 255.0, img2 / 255.0
        return self.body(torch.cat([a, b], 1)), self.body(torch.cat([b, a], 1))


def make_unsup() -> nn.Module:
    torch.manual_seed(0)
    return UnsupFlow()


def make_unsup_half() -> nn.Module:
    """The same net in float16 throughout (``model.half()``), as pure half-precision training
    runs it."""
    return make_unsup().half()
