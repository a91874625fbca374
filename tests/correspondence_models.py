"""Dense correspondence models of ``tests/test_correspondence.py``, written as those repos
write them: RAFT (all-pairs correlation by matmul / sqrt(dim), a pyramid by avg_pool, lookups
by ``grid_sample`` on coordinates normalised to [-1, 1], a GRU refining the flow, the sequence
loss weighted by gamma), unsupervised flow (warping, forward-backward occlusion masks, SSIM,
edge-aware smoothness) and pose (heatmaps, soft-argmax, visibility masks passed into forward,
OKS, dsntnn's Gaussian targets). The factories live at module level so that ``nanreplay``
rebuilds them."""

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
    return F.grid_sample(img, torch.cat([xgrid, ygrid], dim=-1), align_corners=True)


class CorrBlock:
    """All-pairs correlation ``fmap1^T fmap2 / sqrt(dim)``, pooled into a pyramid; a lookup
    samples a (2r+1)^2 window around each pixel's current match at every level."""

    def __init__(self, fmap1, fmap2, num_levels: int = 2, radius: int = 1):
        b, d, h, w = fmap1.shape
        corr = torch.matmul(fmap1.view(b, d, h * w).transpose(1, 2), fmap2.view(b, d, h * w))
        corr = (corr / torch.sqrt(torch.tensor(d).float())).reshape(b * h * w, 1, h, w)
        self.radius, self.pyramid = radius, [corr]
        for _ in range(num_levels - 1):
            corr = F.avg_pool2d(corr, 2, stride=2)
            self.pyramid.append(corr)

    def __call__(self, coords):
        r = self.radius
        coords = coords.permute(0, 2, 3, 1)
        b, h, w, _ = coords.shape
        out = []
        for i, corr in enumerate(self.pyramid):
            d = torch.linspace(-r, r, 2 * r + 1, device=coords.device, dtype=coords.dtype)
            delta = torch.stack(torch.meshgrid(d, d, indexing="ij"), -1).view(1, 2 * r + 1,
                                                                              2 * r + 1, 2)
            centroid = coords.reshape(b * h * w, 1, 1, 2) / 2 ** i
            sampled = bilinear_sampler(corr, centroid + delta)
            out.append(sampled.view(b, h, w, -1))
        return torch.cat(out, -1).permute(0, 3, 1, 2).contiguous()


class ConvGRU(nn.Module):
    def __init__(self, hidden: int, inp: int):
        super().__init__()
        self.convz = nn.Conv2d(hidden + inp, hidden, 3, padding=1)
        self.convr = nn.Conv2d(hidden + inp, hidden, 3, padding=1)
        self.convq = nn.Conv2d(hidden + inp, hidden, 3, padding=1)

    def forward(self, h, x):
        hx = torch.cat([h, x], 1)
        z, r = torch.sigmoid(self.convz(hx)), torch.sigmoid(self.convr(hx))
        q = torch.tanh(self.convq(torch.cat([r * h, x], 1)))
        return (1 - z) * h + z * q


class UpdateBlock(nn.Module):
    def __init__(self, corr_ch: int, hidden: int = 16):
        super().__init__()
        self.encoder = nn.Conv2d(corr_ch + 2, 16, 3, padding=1)
        self.gru = ConvGRU(hidden, 16 + hidden)
        self.flow_head = nn.Conv2d(hidden, 2, 3, padding=1)

    def forward(self, net, inp, corr, flow):
        motion = F.relu(self.encoder(torch.cat([corr, flow], 1)))
        net = self.gru(net, torch.cat([inp, motion], 1))
        return net, self.flow_head(net)


class RAFT(nn.Module):
    """A small RAFT: a stride-2 feature encoder shared by both frames, a context encoder, the
    correlation pyramid, ``iters`` GRU updates; in training the flow after every update (at
    the feature resolution, upsampled by 2 as RAFT's ``upflow8``)."""

    def __init__(self, dim: int = 16, hidden: int = 16, iters: int = 4, levels: int = 2,
                 radius: int = 1):
        super().__init__()
        self.fnet = nn.Sequential(nn.Conv2d(3, dim, 3, 2, 1), nn.ReLU(), nn.Conv2d(dim, dim, 1))
        self.cnet = nn.Sequential(nn.Conv2d(3, 2 * hidden, 3, 2, 1), nn.ReLU(),
                                  nn.Conv2d(2 * hidden, 2 * hidden, 1))
        self.update_block = UpdateBlock(levels * (2 * radius + 1) ** 2, hidden)
        self.hidden, self.iters, self.levels, self.radius = hidden, iters, levels, radius

    def forward(self, image1, image2):
        image1, image2 = 2 * (image1 / 255.0) - 1, 2 * (image2 / 255.0) - 1
        fmap1, fmap2 = self.fnet(image1), self.fnet(image2)
        corr_fn = CorrBlock(fmap1, fmap2, self.levels, self.radius)
        net, inp = self.cnet(image1).split([self.hidden, self.hidden], 1)
        net, inp = torch.tanh(net), torch.relu(inp)
        b, _, h, w = fmap1.shape
        coords0 = coords_grid(b, h, w).to(image1)
        coords1 = coords0.clone()
        preds = []
        for _ in range(self.iters):
            coords1 = coords1.detach()
            corr = corr_fn(coords1)
            net, delta = self.update_block(net, inp, corr, coords1 - coords0)
            coords1 = coords1 + delta
            preds.append(2 * F.interpolate(coords1 - coords0, scale_factor=2, mode="bilinear",
                                           align_corners=True))
        return preds


def make_raft() -> nn.Module:
    torch.manual_seed(0)
    return RAFT()


def stacked_sequence_loss(flow_preds, flow_gt, valid, gamma: float = 0.8):
    """RAFT's sequence loss (L1 weighted by gamma^(N-i-1)) vectorised over the iterations, as
    its descendants write it: the predictions stacked ``(iters, B, 2, H, W)``, each image's
    L1 averaged over its valid pixels."""
    preds = torch.stack(flow_preds)
    n = len(flow_preds)
    err = (valid[None, :, None] * (preds - flow_gt[None]).abs()).sum((2, 3, 4))
    per_image = err / (2 * valid.sum((1, 2)))[None]
    w = gamma ** torch.arange(n - 1, -1, -1, dtype=preds.dtype)
    return (w[:, None] * per_image).sum(0).mean()


def flow_scenes(n: int = 8, h: int = 16, w: int = 16, seed: int = 0):
    """Frame pairs in [0, 255], dense ground-truth flow and its valid map."""
    g = torch.Generator().manual_seed(seed)
    img1 = 255 * torch.rand(n, 3, h, w, generator=g)
    img2 = 255 * torch.rand(n, 3, h, w, generator=g)
    flow = 2 * torch.randn(n, 2, h, w, generator=g)
    valid = torch.ones(n, h, w)
    return img1, img2, flow, valid


# ---------------------------------------------------------------------------------------------
# unsupervised flow: warping, occlusion, (MS-)SSIM, smoothness


def flow_warp(x, flow):
    """ARFlow's ``flow_warp``: sample ``x`` at ``grid + flow``, the grid normalised to
    [-1, 1] by ``W - 1`` and ``H - 1``."""
    b, _, h, w = x.shape
    grid = coords_grid(b, h, w).to(x) + flow
    gx = 2.0 * grid[:, 0] / (w - 1) - 1.0
    gy = 2.0 * grid[:, 1] / (h - 1) - 1.0
    return F.grid_sample(x, torch.stack([gx, gy], -1), align_corners=True,
                         padding_mode="zeros")


class TinyFlowNet(nn.Module):
    """Both frames stacked on channels to a full-resolution flow; ``forward`` returns the
    forward and the backward flow, as unsupervised flow nets run the pair both ways."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(6, c, 3, 1, 1), nn.LeakyReLU(0.1),
                                  nn.Conv2d(c, c, 3, 1, 1), nn.LeakyReLU(0.1))
        self.head = nn.Conv2d(c, 2, 3, 1, 1)

    def forward(self, img1, img2):
        fw = self.head(self.body(torch.cat([img1, img2], 1)))
        bw = self.head(self.body(torch.cat([img2, img1], 1)))
        return fw, bw


def make_tiny_flow() -> nn.Module:
    torch.manual_seed(0)
    return TinyFlowNet()


def _ssim_cs(x, y, c1=0.01 ** 2, c2=0.03 ** 2):
    """pytorch-msssim's ``_ssim`` with a 3x3 box window: the SSIM and contrast-structure maps,
    the variances written as E[x^2] - mu^2, averaged per image and channel."""
    mu_x, mu_y = F.avg_pool2d(x, 3, 1, 1), F.avg_pool2d(y, 3, 1, 1)
    sigma_x = F.avg_pool2d(x * x, 3, 1, 1) - mu_x ** 2
    sigma_y = F.avg_pool2d(y * y, 3, 1, 1) - mu_y ** 2
    sigma_xy = F.avg_pool2d(x * y, 3, 1, 1) - mu_x * mu_y
    cs_map = (2 * sigma_xy + c2) / (sigma_x + sigma_y + c2)
    ssim_map = (2 * mu_x * mu_y + c1) / (mu_x ** 2 + mu_y ** 2 + c1) * cs_map
    return ssim_map.flatten(2).mean(-1), cs_map.flatten(2).mean(-1)


def ms_ssim(x, y, weights=(0.4, 0.6)):
    """pytorch-msssim's ``ms_ssim`` before its fix: the contrast-structure terms raised to
    their weights as they are (no ``relu``), so a negative one is a NaN."""
    mcs = []
    for i in range(len(weights)):
        ssim, cs = _ssim_cs(x, y)
        if i < len(weights) - 1:
            mcs.append(cs)
            x, y = F.avg_pool2d(x, 2), F.avg_pool2d(y, 2)
    vals = torch.stack(mcs + [torch.relu(ssim)], 0)
    w = torch.tensor(weights, dtype=x.dtype, device=x.device).view(-1, 1, 1)
    return torch.prod(vals ** w, dim=0).mean(1)


def fb_occlusion(fw, bw, a1=0.01, a2=0.5):
    """UnFlow's forward-backward check: 1 where the pixel is seen in both frames."""
    bw_warped = flow_warp(bw, fw)
    mag = (fw ** 2).sum(1, keepdim=True) + (bw_warped ** 2).sum(1, keepdim=True)
    diff = ((fw + bw_warped) ** 2).sum(1, keepdim=True)
    return (diff < a1 * mag + a2).float()


def edge_aware_smoothness(flow, img, edge=10.0):
    """First-order smoothness weighted by ``exp(-edge * |dI|)``."""
    dx_i = (img[..., :, 1:] - img[..., :, :-1]).abs().mean(1, keepdim=True)
    dy_i = (img[..., 1:, :] - img[..., :-1, :]).abs().mean(1, keepdim=True)
    dx_f = (flow[..., :, 1:] - flow[..., :, :-1]).abs()
    dy_f = (flow[..., 1:, :] - flow[..., :-1, :]).abs()
    return (torch.exp(-edge * dx_i) * dx_f).mean() + (torch.exp(-edge * dy_i) * dy_f).mean()


class UnsupFlowLoss(nn.Module):
    """ARFlow-style photometric loss: ``alpha`` (1 - MS-SSIM) / 2 + (1 - alpha) L1 of the
    second frame warped back, over the non-occluded pixels of each pair, plus smoothness."""

    def __init__(self, alpha: float = 0.85, w_smooth: float = 0.1):
        super().__init__()
        self.alpha, self.w_smooth = alpha, w_smooth

    def forward(self, flows, img1, img2):
        fw, bw = flows
        occ = fb_occlusion(fw, bw)
        warped = flow_warp(img2, fw)
        l1 = ((warped - img1).abs().mean(1, keepdim=True) * occ).flatten(1).sum(1)
        dssim = (1 - ms_ssim(warped, img1)) / 2
        photo = self.alpha * dssim + (1 - self.alpha) * l1
        return photo.mean() + self.w_smooth * edge_aware_smoothness(fw, img1)


def video_pairs(n: int = 8, size: int = 16, seed: int = 0, fence: int | None = None):
    """Smooth frames in [0, 1] and the next frame, the camera panned by a pixel; ``fence``:
    the pair filming a picket fence (stripes two pixels apart), whose pan by one pixel turns
    every stripe into its neighbour's gap."""
    g = torch.Generator().manual_seed(seed)
    img1 = F.avg_pool2d(torch.rand(n, 3, size + 2, size + 2, generator=g), 3, 1)
    if fence is not None:
        stripes = (torch.arange(size) % 2).float().expand(3, size, size)
        img1[fence] = 0.2 + 0.6 * stripes + 0.05 * torch.rand(3, size, size, generator=g)
    return img1, torch.roll(img1, 1, -1)


# ---------------------------------------------------------------------------------------------
# pose: heatmaps, soft-argmax, visibility, OKS


class TinyPose(nn.Module):
    """A SimpleBaseline-like heatmap head; integral regression (soft-argmax over each
    joint's heatmap, ``beta`` sharpening it) gives the joints' (x, y) in pixels; the
    visibility mask is passed into ``forward`` to average the joints' confidence."""

    def __init__(self, joints: int = 4, c: int = 8, beta: float = 1.0):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, c, 3, 1, 1), nn.ReLU(), nn.Conv2d(c, joints, 1))
        self.beta = beta

    def forward(self, img, vis):
        heat = self.body(img)
        b, k, h, w = heat.shape
        prob = F.softmax(self.beta * heat.flatten(2), -1).view(b, k, h, w)
        xs = torch.arange(w, dtype=prob.dtype, device=prob.device)
        ys = torch.arange(h, dtype=prob.dtype, device=prob.device)
        x = (prob.sum(2) * xs).sum(-1)
        y = (prob.sum(3) * ys).sum(-1)
        conf = heat.flatten(2).amax(-1)
        # mean confidence over each image's visible joints
        mean_conf = (conf * vis).sum(1) / vis.sum(1)
        return torch.stack([x, y], -1), mean_conf, prob


def make_pose() -> nn.Module:
    torch.manual_seed(0)
    return TinyPose()


# COCO's per-keypoint sigmas (the first four)
SIGMAS = (0.026, 0.025, 0.025, 0.035)


def oks_loss(outs, gt, vis, area):
    """1 - OKS: ``exp(-d^2 / (2 s^2 k^2))`` with ``s^2`` the instance's area, averaged over
    its visible joints."""
    pred = outs[0]
    k = 2 * torch.tensor(SIGMAS, dtype=pred.dtype)
    d2 = ((pred - gt) ** 2).sum(-1)
    e = d2 / (2 * area[:, None] * k ** 2)
    oks = (torch.exp(-e) * vis).sum(1) / vis.sum(1).clamp_min(1)
    return (1 - oks).mean()


def pose_data(n: int = 8, size: int = 16, seed: int = 0):
    """Crops, their joints in heatmap pixels, visibility, and each instance's area (COCO's,
    in the pixels of the image the crop was taken from)."""
    g = torch.Generator().manual_seed(seed)
    img = torch.rand(n, 3, size, size, generator=g)
    gt = size * torch.rand(n, 4, 2, generator=g)
    vis = (torch.rand(n, 4, generator=g) > 0.3).float()
    area = 25 * size * size * (0.5 + torch.rand(n, generator=g))
    return img, gt, vis, area


def make_gauss(means, size: int, sigma):
    """dsntnn's ``make_gauss``: unit-mass Gaussians ``(N, H, W)`` at ``means`` ``(N, 2)`` (in
    pixels), one standard deviation each."""
    r = torch.arange(size, dtype=means.dtype)
    d2 = (r[None, None, :] - means[:, None, None, 0]) ** 2 \
        + (r[None, :, None] - means[:, None, None, 1]) ** 2
    g = torch.exp(-d2 / (2 * sigma[:, None, None] ** 2))
    return g / g.sum((1, 2), keepdim=True)


def js_heatmap_loss(outs, gt, vis, area):
    """dsntnn's Jensen-Shannon regulariser: each visible joint's heatmap against a Gaussian
    at its ground truth whose width scales with the instance (COCO's ``k * sqrt(area)``),
    the joints flattened with the batch, plus the coordinates' L1."""
    pred, _, prob = outs
    b, k, h, w = prob.shape
    sigma = (torch.tensor(SIGMAS, dtype=pred.dtype)[None] * area[:, None].sqrt()).reshape(-1)
    target = make_gauss(gt.reshape(-1, 2), h, sigma)
    p, q = prob.reshape(-1, h, w), target
    m = 0.5 * (p + q)
    js = 0.5 * (p * (p / m).log()).sum((1, 2)) + 0.5 * (q * (q / m).clamp_min(1e-12).log()).sum((1, 2))
    reg = (js.view(b, k) * vis).sum(1) / vis.sum(1).clamp_min(1)
    return (reg + ((pred - gt).abs().sum(-1) * vis).mean(1)).mean()
