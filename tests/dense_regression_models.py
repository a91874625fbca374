"""Dense regression and image restoration models of ``tests/test_dense_regression.py``, written
as those repos write them: monocular depth (a small encoder-decoder, softplus depth, berHu and
per-image scale-invariant log losses over the pixels with ground truth), optical flow (a
FlowNetS-like pyramid of flow predictions, a multi-scale end-point-error loss with sparse
KITTI-style ground truth and a valid map), super-resolution (EDSR-style residual blocks and
pixel-shuffle, Charbonnier and a perceptual loss through a frozen feature extractor in eval
mode), and pose estimation (heatmaps, integral regression / soft-argmax). The factories live
at module level so that ``nanreplay`` rebuilds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def conv(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.LeakyReLU(0.1, inplace=True))


# ---------------------------------------------------------------------------------------------
# optical flow


class FlowNetS(nn.Module):
    """Two frames stacked on channels; an encoder of stride-2 convs and a decoder predicting
    flow at 1/4 and 1/2 of the input (``predict_flow`` heads), upsampled and refined, as
    FlowNetS / PWC-Net return their pyramid in training."""

    def __init__(self, base: int = 8):
        super().__init__()
        self.conv1 = conv(6, base, 2)
        self.conv2 = conv(base, 2 * base, 2)
        self.predict_flow2 = nn.Conv2d(2 * base, 2, 3, 1, 1)
        self.deconv1 = nn.ConvTranspose2d(2 * base + 2, base, 4, 2, 1)
        self.predict_flow1 = nn.Conv2d(2 * base, 2, 3, 1, 1)

    def forward(self, frames):
        c1 = self.conv1(frames)
        c2 = self.conv2(c1)
        flow2 = self.predict_flow2(c2)
        up = F.leaky_relu(self.deconv1(torch.cat([c2, flow2], 1)), 0.1)
        flow1 = self.predict_flow1(torch.cat([c1, up], 1))
        return [flow1, flow2] if self.training else flow1


def make_flownet() -> nn.Module:
    torch.manual_seed(0)
    return FlowNetS()


class MultiScaleEPE(nn.Module):
    """FlowNet's multi-scale loss for sparse ground truth: at each scale the ground truth and
    its valid map are brought to the prediction's size (``sparse_max_pool`` / area
    downsampling of ``flow * valid`` renormalised by the valid fraction), the end-point error
    ``sqrt(du^2 + dv^2)`` is averaged over the valid pixels, scales weighted."""

    def __init__(self, weights=(0.32, 0.08)):
        super().__init__()
        self.weights = list(weights)

    def forward(self, flows, gt, valid):
        total = 0.0
        for w, flow in zip(self.weights, flows):
            h, wd = flow.shape[-2:]
            v = F.adaptive_avg_pool2d(valid.unsqueeze(1).float(), (h, wd))
            target = F.adaptive_avg_pool2d(gt * valid.unsqueeze(1), (h, wd)) / v
            target = target * (h / gt.shape[-2])  # flow in pixels of this scale
            epe = ((flow - target) ** 2).sum(1).sqrt()
            total = total + w * epe.mean()
        return total


class UpsampledEPE(nn.Module):
    """The finest prediction upsampled to the ground truth (``F.interpolate`` times the
    scale), the end-point error of the pixels with ground truth written with the valid map
    multiplied in before the square root, averaged over the valid pixels."""

    def forward(self, flows, gt, valid):
        flow = flows[0]
        s = gt.shape[-1] / flow.shape[-1]
        up = s * F.interpolate(flow, size=gt.shape[-2:], mode="bilinear", align_corners=False)
        v = valid.unsqueeze(1).float()
        epe = (((up - gt) * v) ** 2).sum(1).sqrt()
        return epe.sum() / v.sum()


def flow_pairs(n: int = 8, size: int = 16, seed: int = 0, holes: float = 0.5):
    """Frame pairs and KITTI-like sparse flow: ``valid`` is 0 where the LiDAR had no return."""
    g = torch.Generator().manual_seed(seed)
    frames = torch.randn(n, 6, size, size, generator=g)
    gt = 2.0 * torch.randn(n, 2, size, size, generator=g)
    valid = torch.rand(n, size, size, generator=g) > holes
    return frames, gt, valid


# ---------------------------------------------------------------------------------------------
# super-resolution


class ResBlock(nn.Module):
    def __init__(self, c: int, res_scale: float = 0.1):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1), nn.ReLU(True), nn.Conv2d(c, c, 3, 1, 1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class EDSR(nn.Module):
    """EDSR without BatchNorm: head conv, residual blocks scaled by ``res_scale``, a global
    skip, and an upsampler of conv + ``PixelShuffle``; the mean is subtracted and added back."""

    def __init__(self, c: int = 8, blocks: int = 2, scale: int = 2):
        super().__init__()
        self.register_buffer("rgb_mean", torch.tensor([0.45, 0.44, 0.40]).view(1, 3, 1, 1))
        self.head = nn.Conv2d(3, c, 3, 1, 1)
        self.body = nn.Sequential(*[ResBlock(c) for _ in range(blocks)])
        self.tail = nn.Sequential(nn.Conv2d(c, 3 * scale * scale, 3, 1, 1),
                                  nn.PixelShuffle(scale))

    def forward(self, lr):
        x = self.head(lr - self.rgb_mean)
        x = x + self.body(x)
        return self.tail(x) + self.rgb_mean


def make_edsr() -> nn.Module:
    torch.manual_seed(0)
    return EDSR()


class FeatureExtractor(nn.Module):
    """A frozen VGG-like extractor (Conv - BatchNorm - ReLU), kept in eval mode."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)  # ("pretrained")
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, 1, 1), nn.ReLU())
        with torch.no_grad():
            self.features[1].running_mean.uniform_(-0.2, 0.2)
            self.features[1].running_var.uniform_(0.5, 2.0)
            self.features[3].bias.fill_(-0.05)
        self.requires_grad_(False)
        self.eval()

    def forward(self, x):
        return self.features(x)


class CharbonnierPerceptual(nn.Module):
    """Charbonnier ``sqrt(d^2 + eps^2)`` plus a perceptual term on unit-normalised features
    (LPIPS's ``normalize_tensor``: ``f / sqrt(sum f^2)``; here without LPIPS's eps)."""

    def __init__(self, eps: float = 1e-3, weight: float = 0.1):
        super().__init__()
        self.eps, self.weight = eps, weight
        self.vgg = FeatureExtractor()

    def train(self, mode: bool = True):  # the extractor stays in eval mode (as ESRGAN's)
        super().train(mode)
        self.vgg.eval()
        return self

    def forward(self, sr, hr):
        pix = torch.sqrt((sr - hr) ** 2 + self.eps ** 2).mean()
        fs, fh = self.vgg(sr), self.vgg(hr)
        fs = fs / torch.sqrt((fs ** 2).sum(1, keepdim=True))
        fh = fh / torch.sqrt((fh ** 2).sum(1, keepdim=True))
        return pix + self.weight * ((fs - fh) ** 2).sum(1).mean()


def sr_pairs(n: int = 8, size: int = 8, seed: int = 0, scale: int = 2):
    """HR crops in [0, 1] and their LR (area downsampling)."""
    g = torch.Generator().manual_seed(seed)
    hr = torch.rand(n, 3, size * scale, size * scale, generator=g)
    return F.avg_pool2d(hr, scale), hr


# ---------------------------------------------------------------------------------------------
# pose


class IntegralPose(nn.Module):
    """Sun et al.'s integral regression: per-joint heatmaps made non-negative by a ReLU and
    normalised to sum 1 (``hm / hm.sum()``), the joint the expectation of the coordinates;
    ``softmax=True`` normalises by a soft-argmax with temperature ``beta`` instead."""

    def __init__(self, joints: int = 4, c: int = 8, softmax: bool = False, beta: float = 1.0):
        super().__init__()
        self.backbone = nn.Sequential(conv(3, c), conv(c, c))
        self.head = nn.Conv2d(c, joints, 1)
        self.softmax, self.beta = softmax, beta

    def forward(self, img):
        hm = self.head(self.backbone(img))
        b, j, h, w = hm.shape
        flat = hm.flatten(2)
        if self.softmax:
            prob = F.softmax(flat * self.beta, dim=2)
        else:
            flat = F.relu(flat)
            prob = flat / flat.sum(2, keepdim=True)
        prob = prob.view(b, j, h, w)
        xs = torch.arange(w, dtype=hm.dtype, device=hm.device)
        ys = torch.arange(h, dtype=hm.dtype, device=hm.device)
        x = (prob.sum(2) * xs).sum(2)
        y = (prob.sum(3) * ys).sum(2)
        return torch.stack([x, y], 2)


def make_pose(**kw) -> nn.Module:
    torch.manual_seed(0)
    return IntegralPose(**kw)


# ---------------------------------------------------------------------------------------------
# depth


class DepthNet(nn.Module):
    """An encoder-decoder with a softplus depth head, bilinear upsampling to the input."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.enc = nn.Sequential(conv(3, c, 2), conv(c, c))
        self.head = nn.Conv2d(c, 1, 3, 1, 1)

    def forward(self, img):
        d = F.interpolate(self.head(self.enc(img)), size=img.shape[-2:], mode="bilinear",
                          align_corners=False)
        return F.softplus(d)[:, 0] + 1e-3


def make_depth() -> nn.Module:
    torch.manual_seed(0)
    return DepthNet()


class BerHu(nn.Module):
    """The reverse Huber loss of Laina et al. (FCRN): ``c = 0.2 * max |err|`` over the valid
    pixels of the batch, L1 below ``c`` and ``(err^2 + c^2) / (2c)`` above."""

    def forward(self, pred, gt):
        valid = (gt > 0).float()
        err = (pred - gt) * valid
        adiff = err.abs()
        c = 0.2 * adiff.max().detach()
        l2 = (adiff ** 2 + c ** 2) / (2 * c)
        return torch.where(adiff <= c, adiff, l2).sum() / valid.sum().clamp_min(1)


class PerImageSILog(nn.Module):
    """The scale-invariant log loss computed per image over its own valid pixels
    (``gt > 0``), as sums normalised by each image's valid count, then averaged."""

    def __init__(self, lambd: float = 0.85):
        super().__init__()
        self.lambd = lambd

    def forward(self, pred, gt):
        valid = (gt > 0).float()
        d = (torch.log(pred) - torch.log(gt.clamp_min(1e-3))) * valid
        n = valid.sum((1, 2))
        mean_sq = (d ** 2).sum((1, 2)) / n
        sq_mean = (d.sum((1, 2)) / n) ** 2
        return torch.sqrt(mean_sq - self.lambd * sq_mean).mean() * 10.0


def depth_scenes(n: int = 8, size: int = 16, seed: int = 0):
    """Images and depth maps in metres, with holes of depth 0 (no LiDAR return) as KITTI's."""
    g = torch.Generator().manual_seed(seed)
    imgs = torch.randn(n, 3, size, size, generator=g)
    depth = 1.0 + 9.0 * torch.rand(n, size, size, generator=g)
    depth[torch.rand(n, size, size, generator=g) < 0.3] = 0.0
    return imgs, depth


class ScaleShiftInvariant(nn.Module):
    """MiDaS's scale-and-shift-invariant loss: per image, the least-squares scale and shift of
    the prediction to the ground truth over the valid pixels (the 2x2 normal equations solved
    by hand), then the masked MSE of the aligned prediction, plus the multi-scale gradient
    matching term; ``sum / sum(mask)`` over the batch."""

    def __init__(self, alpha: float = 0.5, scales: int = 2):
        super().__init__()
        self.alpha, self.scales = alpha, scales

    def forward(self, pred, gt):
        mask = (gt > 0).float()
        a00 = (mask * pred * pred).sum((1, 2))
        a01 = (mask * pred).sum((1, 2))
        a11 = mask.sum((1, 2))
        b0 = (mask * pred * gt).sum((1, 2))
        b1 = (mask * gt).sum((1, 2))
        det = a00 * a11 - a01 * a01
        scale = (a11 * b0 - a01 * b1) / det
        shift = (-a01 * b0 + a00 * b1) / det
        aligned = scale.view(-1, 1, 1) * pred + shift.view(-1, 1, 1)
        loss = (mask * (aligned - gt) ** 2).sum() / mask.sum().clamp_min(1)
        for s in range(self.scales):
            step = 2 ** s
            d = (mask * (aligned - gt))[:, ::step, ::step]
            m = mask[:, ::step, ::step]
            gx = (d[:, :, 1:] - d[:, :, :-1]).abs() * m[:, :, 1:] * m[:, :, :-1]
            gy = (d[:, 1:] - d[:, :-1]).abs() * m[:, 1:] * m[:, :-1]
            loss = loss + self.alpha * (gx.sum() + gy.sum()) / m.sum().clamp_min(1)
        return loss


class PSNRLoss(nn.Module):
    """The negative PSNR of each image, ``-10 log10(1 / mse)``, of the output clamped to the
    image range as the evaluation clamps it; averaged over the batch."""

    def forward(self, sr, hr):
        mse = ((sr.clamp(0, 1) - hr) ** 2).mean((1, 2, 3))
        return (-10.0 * torch.log10(1.0 / mse)).mean()


class SoftArgmaxPose(nn.Module):
    """Heatmaps and a soft-argmax written out: ``exp(beta * h)`` normalised by its sum (no
    max subtracted), the coordinates its expectation."""

    def __init__(self, joints: int = 4, c: int = 8, beta: float = 20.0):
        super().__init__()
        self.backbone = nn.Sequential(conv(3, c), conv(c, c))
        self.head = nn.Conv2d(c, joints, 1)
        self.beta = beta

    def forward(self, img):
        hm = self.head(self.backbone(img))
        b, j, h, w = hm.shape
        e = torch.exp(self.beta * hm.flatten(2))
        prob = (e / e.sum(2, keepdim=True)).view(b, j, h, w)
        xs = torch.arange(w, dtype=hm.dtype, device=hm.device)
        ys = torch.arange(h, dtype=hm.dtype, device=hm.device)
        return torch.stack([(prob.sum(2) * xs).sum(2), (prob.sum(3) * ys).sum(2)], 2)


def make_softargmax(**kw) -> nn.Module:
    torch.manual_seed(0)
    return SoftArgmaxPose(**kw)


class MonoDepthDecoder(nn.Module):
    """monodepth2's habit: the inputs a dict keyed by tuples (``inputs[("color", 0, 0)]``:
    frame 0 at scale 0), the disparity at each scale returned in another,
    ``outputs[("disp", s)]``, a sigmoid of the head."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.enc = nn.Sequential(conv(3, c, 2), conv(c, c))
        self.heads = nn.ModuleList([nn.Conv2d(c, 1, 3, 1, 1) for _ in range(2)])

    def forward(self, inputs):
        f = self.enc(inputs[("color", 0, 0)])
        out = {}
        for s, head in enumerate(self.heads):
            out[("disp", s)] = torch.sigmoid(head(F.avg_pool2d(f, 2 ** s)))
        return out


def make_monodepth() -> nn.Module:
    torch.manual_seed(0)
    return MonoDepthDecoder()


class DispToDepthL1(nn.Module):
    """The disparity at each scale upsampled to the ground truth, depth ``1 / disp``, L1 of
    log depth over the valid pixels, each scale weighted by ``1 / 2^s``."""

    def forward(self, outputs, gt):
        valid = (gt > 0).float()
        total = 0.0
        for (_, s), disp in outputs.items():
            disp = F.interpolate(disp, size=gt.shape[-2:], mode="bilinear", align_corners=False)
            depth = 1 / disp[:, 0]
            d = (torch.log(depth) - torch.log(gt.clamp_min(1e-3))).abs() * valid
            total = total + d.sum() / valid.sum().clamp_min(1) / 2 ** s
        return total


class BTSLike(nn.Module):
    """A "pretrained" encoder with BatchNorm that the loop freezes (``freeze_bn``: RAFT and
    BTS put every BatchNorm in eval mode after ``model.train()``), a ReLU depth head."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, c, 3, 1, 1), nn.BatchNorm2d(c), nn.ReLU(),
                                 nn.Conv2d(c, c, 3, 1, 1), nn.BatchNorm2d(c), nn.ReLU())
        self.head = nn.Conv2d(c, 1, 3, 1, 1)
        with torch.no_grad():
            for bn in (self.enc[1], self.enc[4]):
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.2, 3.0)
            self.head.bias.fill_(2.0)

    def forward(self, img):
        return F.relu(self.head(self.enc(img)))[:, 0]

    def freeze_bn(self):
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()


def make_bts() -> nn.Module:
    torch.manual_seed(0)
    return BTSLike()


class ValidL1(nn.Module):
    """RAFT-style: the per-pixel error of the pixels with ground truth picked by a boolean
    mask, ``loss[valid].mean()``."""

    def forward(self, pred, gt):
        valid = gt > 0
        return (torch.log(pred) - torch.log(gt.clamp_min(1e-3))).abs()[valid].mean()


class CharbonnierLoss(nn.Module):
    """BasicSR's ``CharbonnierLoss``: ``sqrt((pred - target)^2 + eps)``, eps 1e-12."""

    def __init__(self, eps: float = 1e-12):
        super().__init__()
        self.eps = eps

    def forward(self, pred, target):
        return torch.sqrt((pred - target) ** 2 + self.eps).mean()


# ---------------------------------------------------------------------------------------------
# video super-resolution


class FrameNorm(nn.Module):
    """Each frame standardised by its own statistics (no eps)."""

    def forward(self, x):
        mean = x.mean((1, 2, 3), keepdim=True)
        std = x.std((1, 2, 3), keepdim=True)
        return (x - mean) / std


class VideoSR(nn.Module):
    """BasicVSR's layout: clips ``(n, t, c, h, w)``; the per-frame feature extractor runs on
    the frames folded into the batch (``lrs.view(-1, c, h, w)``), then a recurrent pass over
    time and a pixel-shuffle upsampler per frame."""

    def __init__(self, c: int = 8, scale: int = 2):
        super().__init__()
        self.norm = FrameNorm()
        self.extract = nn.Sequential(nn.Conv2d(3, c, 3, 1, 1), nn.LeakyReLU(0.1))
        self.fuse = nn.Conv2d(2 * c, c, 3, 1, 1)
        self.up = nn.Sequential(nn.Conv2d(c, 3 * scale * scale, 3, 1, 1), nn.PixelShuffle(scale))

    def forward(self, lrs):
        n, t, c, h, w = lrs.shape
        feats = self.extract(self.norm(lrs.view(-1, c, h, w))).view(n, t, -1, h, w)
        state = torch.zeros_like(feats[:, 0])
        outs = []
        for i in range(t):
            state = F.leaky_relu(self.fuse(torch.cat([feats[:, i], state], 1)), 0.1)
            outs.append(self.up(state))
        return torch.stack(outs, 1)


def make_video_sr() -> nn.Module:
    torch.manual_seed(0)
    return VideoSR()


def clips(n: int = 8, t: int = 3, size: int = 8, seed: int = 0, scale: int = 2):
    """HR clips in [0, 1] and their LR (area downsampling), ``(n, t, 3, h, w)``."""
    g = torch.Generator().manual_seed(seed)
    hr = torch.rand(n, t, 3, size * scale, size * scale, generator=g)
    lr = F.avg_pool2d(hr.flatten(0, 1), scale).view(n, t, 3, size, size)
    return lr, hr


class ChannelNorm(nn.Module):
    """LPIPS's ``normalize_tensor`` as a layer: each pixel's feature vector to unit length."""

    def forward(self, f):
        return f / torch.sqrt((f ** 2).sum(1, keepdim=True))


class SRWithLossNet(nn.Module):
    """An EDSR that carries its perceptual network as a submodule (``self.vgg``, frozen, kept
    in eval mode) for the loss to use: its forward never calls it."""

    def __init__(self):
        super().__init__()
        self.net = EDSR()
        self.vgg = FeatureExtractor()
        self.vgg.features.append(ChannelNorm())

    def train(self, mode: bool = True):
        super().train(mode)
        self.vgg.eval()
        return self

    def forward(self, lr):
        return self.net(lr)


def make_sr_with_loss_net() -> nn.Module:
    torch.manual_seed(0)
    return SRWithLossNet()


class PerceptualThrough(nn.Module):
    """L1 plus the distance of the features a given network (the model's own ``vgg``) makes."""

    def __init__(self, net: nn.Module, weight: float = 0.1):
        super().__init__()
        self.net, self.weight = net, weight

    def forward(self, sr, hr):
        return F.l1_loss(sr, hr) + self.weight * F.mse_loss(self.net(sr), self.net(hr))


# ---------------------------------------------------------------------------------------------
# RAFT


class UpdateBlock(nn.Module):
    """A convolutional GRU over the context features and the current flow, and a flow head
    predicting the update (RAFT's ``BasicUpdateBlock``, small)."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.convz = nn.Conv2d(2 * c + 2, c, 3, 1, 1)
        self.convr = nn.Conv2d(2 * c + 2, c, 3, 1, 1)
        self.convq = nn.Conv2d(2 * c + 2, c, 3, 1, 1)
        self.flow_head = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1), nn.ReLU(), nn.Conv2d(c, 2, 3, 1, 1))

    def forward(self, net, inp, flow):
        hx = torch.cat([net, inp, flow], 1)
        z, r = torch.sigmoid(self.convz(hx)), torch.sigmoid(self.convr(hx))
        q = torch.tanh(self.convq(torch.cat([r * net, inp, flow], 1)))
        net = (1 - z) * net + z * q
        return net, self.flow_head(net)


class RAFTLike(nn.Module):
    """Two frames through a shared encoder at 1/2 resolution, a context encoder, ``iters``
    GRU updates of the flow, each upsampled (bilinear, times 2) into the returned sequence."""

    def __init__(self, c: int = 8, iters: int = 4):
        super().__init__()
        self.fnet = nn.Sequential(conv(3, c, 2), conv(c, c))
        self.cnet = nn.Sequential(conv(3, 2 * c, 2), conv(2 * c, 2 * c))
        self.update = UpdateBlock(c)
        self.iters, self.c = iters, c

    def forward(self, image1, image2):
        f1, f2 = self.fnet(image1), self.fnet(image2)
        net, inp = torch.split(self.cnet(image1), [self.c, self.c], 1)
        net, inp = torch.tanh(net), torch.relu(inp + (f1 * f2))
        flow = torch.zeros_like(net[:, :2])
        preds = []
        for _ in range(self.iters):
            net, delta = self.update(net, inp, flow)
            flow = flow + delta
            preds.append(2 * F.interpolate(flow, scale_factor=2, mode="bilinear",
                                           align_corners=True))
        return preds


def make_raft() -> nn.Module:
    torch.manual_seed(0)
    return RAFTLike()


def sequence_loss(flow_preds, flow_gt, valid, gamma: float = 0.8, max_flow: float = 400.0):
    """RAFT's ``sequence_loss``: L1 of every prediction, weighted ``gamma ** (n - i - 1)``,
    over the pixels that are valid and whose ground truth is under ``max_flow``."""
    n = len(flow_preds)
    mag = torch.sum(flow_gt ** 2, dim=1).sqrt()
    valid = (valid >= 0.5) & (mag < max_flow)
    loss = 0.0
    for i, pred in enumerate(flow_preds):
        i_loss = (pred - flow_gt).abs()
        loss = loss + gamma ** (n - i - 1) * (valid[:, None] * i_loss).mean()
    return loss


class BerHuMasked(nn.Module):
    """berHu written with float masks instead of ``torch.where`` (as several FCRN ports do):
    ``l1 * (1 - m) + l2 * m`` with ``m = (|err| > c)``, ``c = 0.2 * max |err|`` over the
    valid pixels."""

    def forward(self, pred, gt):
        valid = (gt > 0).float()
        adiff = ((pred - gt) * valid).abs()
        c = 0.2 * adiff.max()
        m = (adiff > c).float()
        l2 = (adiff ** 2 + c ** 2) / (2 * c)
        return (adiff * (1 - m) + l2 * m).sum() / valid.sum().clamp_min(1)


class CorrFlow(nn.Module):
    """RAFT's all-pairs correlation, ``f1^T f2 / sqrt(C)`` of the two frames' features,
    without RAFT's ``fmap.float()`` casts: under float16 autocast the matmul runs in
    float16; a soft-argmax over the second frame's positions makes the flow."""

    def __init__(self, c: int = 64):
        super().__init__()
        self.fnet = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1), nn.ReLU())
        self.head = nn.Conv2d(2, 2, 1)

    def forward(self, image1, image2):
        f1, f2 = self.fnet(image1), self.fnet(image2)
        b, c, h, w = f1.shape
        corr = torch.matmul(f1.flatten(2).transpose(1, 2), f2.flatten(2)) / c ** 0.5
        prob = torch.softmax(corr, dim=-1)  # (b, h*w, h*w)
        ys, xs = torch.meshgrid(torch.arange(h, dtype=prob.dtype), torch.arange(w, dtype=prob.dtype),
                                indexing="ij")
        grid = torch.stack([xs, ys]).flatten(1)  # (2, h*w)
        target = prob @ grid.T.to(prob.device)  # expected position in frame 2
        flow = (target - grid.T.to(prob.device)).transpose(1, 2).reshape(b, 2, h, w)
        return F.interpolate(self.head(flow), scale_factor=2, mode="bilinear",
                             align_corners=False) * 2


def make_corrflow() -> nn.Module:
    torch.manual_seed(0)
    return CorrFlow()


class DictEPE(nn.Module):
    """mmflow's habit: the loss returns a dict of named terms (one per scale), which the loop
    sums; the EPE of each scale written with the valid map multiplied in before the root."""

    def forward(self, flows, gt, valid):
        out = {}
        for s, flow in enumerate(flows):
            size = flow.shape[-2:]
            target = F.interpolate(gt, size=size, mode="nearest") * (size[0] / gt.shape[-2])
            v = F.interpolate(valid[:, None].float(), size=size, mode="nearest")
            epe = (((flow - target) * v) ** 2).sum(1).sqrt()
            out[f"loss_flow_{s}"] = 0.5 ** s * epe.sum() / v.sum().clamp_min(1)
        return out


class PlainPerceptual(nn.Module):
    """Charbonnier plus the perceptual term of :class:`CharbonnierPerceptual`, the extractor
    put in eval mode once, in ``__init__`` (no ``train()`` override: the loop never calls the
    loss's ``train()``)."""

    def __init__(self, eps: float = 1e-3, weight: float = 0.1):
        super().__init__()
        self.eps, self.weight = eps, weight
        self.vgg = FeatureExtractor()  # (eval mode, frozen)

    def forward(self, sr, hr):
        pix = torch.sqrt((sr - hr) ** 2 + self.eps ** 2).mean()
        fs, fh = self.vgg(sr), self.vgg(hr)
        fs = fs / torch.sqrt((fs ** 2).sum(1, keepdim=True))
        fh = fh / torch.sqrt((fh ** 2).sum(1, keepdim=True))
        return pix + self.weight * ((fs - fh) ** 2).sum(1).mean()


class StrideWeightedEPE(nn.Module):
    """:class:`MultiScaleEPE` with its scale weights keyed by each prediction's stride, as
    some ports keep them (``{2: 0.32, 4: 0.08}``)."""

    def __init__(self, weights: dict | None = None):
        super().__init__()
        self.weights = weights if weights is not None else {2: 0.32, 4: 0.08}

    def forward(self, flows, gt, valid):
        return sum(MultiScaleEPE([self.weights[gt.shape[-1] // f.shape[-1]]])([f], gt, valid)
                   for f in flows)


class LogGradientMatching(nn.Module):
    """MegaDepth's gradient-matching term on log depth (Sobel gradients of the log-depth
    error over the valid pixels) plus L1 of log depth; the Sobel kernels made on
    ``self.device``, an attribute the constructor takes, as many ports keep it."""

    def __init__(self, device: torch.device | None = None, alpha: float = 0.5):
        super().__init__()
        self.device, self.alpha = device or torch.device("cpu"), alpha

    def forward(self, pred, gt):
        valid = (gt > 0).float()[:, None]
        d = (torch.log(pred) - torch.log(gt.clamp_min(1e-3)))[:, None] * valid
        kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]],
                          device=self.device)
        k = torch.stack([kx, kx.T])[:, None]
        grad = F.conv2d(d, k, padding=1).abs() * valid
        n = valid.sum().clamp_min(1)
        return d.abs().sum() / n + self.alpha * grad.sum() / n
