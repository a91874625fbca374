"""Dense regression and image restoration models of ``tests/test_dense_regression.py``, written
as those repos write them: optical flow (a FlowNetS-like pyramid of flow predictions,
multi-scale end-point-error losses over KITTI-style sparse ground truth and its valid map, one
returning mmflow's dict of terms), super-resolution (EDSR's residual blocks and pixel-shuffle,
BasicSR's Charbonnier, perceptual losses through a frozen feature extractor in eval mode: held
by the loss, or by the model and given to the loss), monocular depth (monodepth2's dicts keyed
by tuples and ``1 / disp``, a BTS-like encoder with frozen BatchNorms, MegaDepth's gradient
matching on log depth). The factories live at module level so that ``nanreplay`` rebuilds
them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from segmentation_models import depth_scenes  # noqa: F401  (KITTI-like scenes, shared)
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


class StrideWeightedEPE(nn.Module):
    """:class:`MultiScaleEPE` with its scale weights keyed by each prediction's stride, as
    some ports keep them (``{2: 0.32, 4: 0.08}``)."""

    def __init__(self, weights: dict | None = None):
        super().__init__()
        self.weights = weights if weights is not None else {2: 0.32, 4: 0.08}

    def forward(self, flows, gt, valid):
        return sum(MultiScaleEPE([self.weights[gt.shape[-1] // f.shape[-1]]])([f], gt, valid)
                   for f in flows)


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


class PlainPerceptual(nn.Module):
    """Charbonnier ``sqrt(d^2 + eps^2)`` plus a perceptual term on unit-normalised features
    (LPIPS's ``normalize_tensor``: ``f / sqrt(sum f^2)``; here without LPIPS's eps), the
    extractor put in eval mode once, in ``__init__`` (no ``train()`` override: the loop never
    calls the loss's ``train()``)."""

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


class CharbonnierPerceptual(PlainPerceptual):
    """:class:`PlainPerceptual` whose ``train()`` keeps the extractor in eval mode (as
    ESRGAN's does)."""

    def train(self, mode: bool = True):
        super().train(mode)
        self.vgg.eval()
        return self


class CharbonnierLoss(nn.Module):
    """BasicSR's ``CharbonnierLoss``: ``sqrt((pred - target)^2 + eps)``, eps 1e-12."""

    def __init__(self, eps: float = 1e-12):
        super().__init__()
        self.eps = eps

    def forward(self, pred, target):
        return torch.sqrt((pred - target) ** 2 + self.eps).mean()


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


class HookPerceptual(nn.Module):
    """A perceptual loss that taps its extractor's layers with forward hooks registered in
    ``__init__`` (the features land in ``self.feats``), unit-normalised as LPIPS does but
    without its eps; L1 beside it."""

    def __init__(self, layers=(2, 5)):
        super().__init__()
        self.vgg = FeatureExtractor()
        self.vgg.features.append(ChannelNorm())
        self.layers = list(layers)
        self.feats = {}
        for i in self.layers:
            self.vgg.features[i].register_forward_hook(self._save(i))

    def _save(self, i):
        def hook(module, args, out):
            self.feats[i] = out
        return hook

    def forward(self, sr, hr):
        self.vgg(hr)
        fh = dict(self.feats)
        self.vgg(sr)
        fs = dict(self.feats)
        return F.l1_loss(sr, hr) + sum(F.mse_loss(fs[i], fh[i]) for i in self.layers)


class TappedPerceptual(HookPerceptual):
    """:class:`HookPerceptual` whose layers must be given (as BasicSR's ``PerceptualLoss``
    requires its ``layer_weights``)."""

    def __init__(self, layers):
        super().__init__(layers)


def sr_pairs(n: int = 8, size: int = 8, seed: int = 0, scale: int = 2):
    """HR crops in [0, 1] and their LR (area downsampling)."""
    g = torch.Generator().manual_seed(seed)
    hr = torch.rand(n, 3, size * scale, size * scale, generator=g)
    return F.avg_pool2d(hr, scale), hr


# ---------------------------------------------------------------------------------------------
# depth


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
