"""On-device data augmentation written the way the public repositories write it, for
``test_gpu_augmentation.py``:

- ``rgb_to_hsv`` / ``hsv_to_rgb`` and ``ColorJitter``: kornia/color/hsv.py and
  kornia.augmentation.ColorJitter (per-sample factors drawn on the device, saturation as
  ``(max - min) / (max + eps)``, hue guarded by ``torch.where(delta == 0, 1, delta)``);
- ``RandomAffine``: kornia.augmentation.RandomAffine's rotation/scale/translation matrix,
  warped with ``F.affine_grid`` + ``F.grid_sample`` (zero padding, the black corners);
- ``RandomResizedCrop``: kornia's crop by ``get_perspective_transform`` (an 8x8
  ``torch.linalg.solve`` from the crop box's corners to the output's);
- ``per_image_standardization``: tf.image.per_image_standardization, hand-written;
- ``RandomGamma``: torchvision.transforms.v2.functional.adjust_gamma (``image ** gamma``);
- ``ApplyWithProbability``: kornia's AugmentationBase2D applying a transform to the samples
  its probability drew, ``out[to_apply] = transform(x[to_apply])``;
- ``RandAugment``: torchvision.transforms.RandAugment's policy (ops drawn with ``random``),
  its autocontrast, solarize, posterize and sharpness written on batched tensors;
- ``DataAugmentation``: the Kornia tutorial "Data augmentation on the GPU" module
  (``@torch.no_grad`` forward, called in the training step before the network);
- ``crop_and_resize``: kornia.geometry.transform.crop_and_resize of each image's box;
- ``LearnedBrightness`` / ``LearnedSaturation``: differentiable colour ops with learned
  magnitudes, as Faster AutoAugment / DADA (moskomule/dda) train them with the network.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

SIZE, N_CLS = 16, 4


# --------------------------------------------------------------------------------------------
# data: images in [0, 1], some planted ones blank (a dropped frame decoded as zeros)


class Images(Dataset):
    """``n`` images with labels, and each image's box (its object's four corners, clockwise
    from the top-left, in pixels); ``thin`` images' boxes have no width (an annotation whose
    two x coordinates are the same, kept by the dataset's filter)."""

    def __init__(self, n: int = 32, blank=(), gray=(), thin=(), dtype=torch.float32):
        g = torch.Generator().manual_seed(0)
        base = torch.rand(n, 3, 1, 1, generator=g)
        ramp = torch.linspace(0, 1, SIZE).view(1, 1, 1, SIZE)
        self.x = (0.2 + 0.6 * base * (0.5 + 0.5 * ramp)).expand(n, 3, SIZE, SIZE).clone()
        self.x += 0.05 * torch.rand(n, 3, SIZE, SIZE, generator=g)
        self.y = torch.randint(0, N_CLS, (n,), generator=g)
        for i in blank:
            self.x[i] = 0.0
        for i in gray:  # a grayscale scan stored as RGB: r == g == b everywhere
            self.x[i] = self.x[i].mean(0, keepdim=True)
        self.x = self.x.to(dtype)
        x0 = torch.randint(0, SIZE // 2, (n, 2), generator=g).float()
        wh = torch.randint(4, SIZE // 2, (n, 2), generator=g).float()
        for i in thin:
            wh[i, 0] = 1.0  # x1 == x0: the box's left and right edges are one column
        x1 = x0 + wh - 1
        self.boxes = torch.stack([x0, torch.stack([x1[:, 0], x0[:, 1]], -1), x1,
                                  torch.stack([x0[:, 0], x1[:, 1]], -1)], 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], self.boxes[i]


# --------------------------------------------------------------------------------------------
# colour (kornia/color/hsv.py)


def rgb_to_hsv(image: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    max_rgb, argmax_rgb = image.max(-3)
    min_rgb, _ = image.min(-3)
    deltac = max_rgb - min_rgb
    v = max_rgb
    s = deltac / (max_rgb + eps)
    deltac = torch.where(deltac == 0, torch.ones_like(deltac), deltac)
    rc, gc, bc = torch.unbind((max_rgb.unsqueeze(-3) - image), dim=-3)
    h1 = bc - gc
    h2 = (rc - bc) + 2.0 * deltac
    h3 = (gc - rc) + 4.0 * deltac
    h = torch.stack((h1, h2, h3), dim=-3) / deltac.unsqueeze(-3)
    h = torch.gather(h, dim=-3, index=argmax_rgb.unsqueeze(-3)).squeeze(-3)
    h = (h / 6.0) % 1.0
    return torch.stack((2.0 * math.pi * h, s, v), dim=-3)


def hsv_to_rgb(image: torch.Tensor) -> torch.Tensor:
    h = image[..., 0, :, :] / (2 * math.pi)
    s, v = image[..., 1, :, :], image[..., 2, :, :]
    hi = torch.floor(h * 6) % 6
    f = ((h * 6) % 6) - hi
    p = v * (1 - s)
    q = v * (1 - f * s)
    t = v * (1 - (1 - f) * s)
    hi = hi.long()
    indices = torch.stack([hi, hi + 6, hi + 12], dim=-3)
    out = torch.stack((v, q, p, p, t, v, t, v, v, q, p, p, p, p, t, v, v, q), dim=-3)
    return torch.gather(out, -3, indices)


class ColorJitter(nn.Module):
    """kornia.augmentation.ColorJitter: brightness, contrast, saturation, hue, per sample."""

    def __init__(self, brightness=0.2, contrast=0.2, saturation=0.3, hue=0.1, eps=1e-8):
        super().__init__()
        self.b, self.c, self.s, self.h, self.eps = brightness, contrast, saturation, hue, eps

    def factor(self, x, spread, center=1.0):
        u = torch.rand(x.shape[0], 1, 1, 1, device=x.device, dtype=x.dtype)
        return center + spread * (2 * u - 1)

    def forward(self, x):
        x = (x + self.factor(x, self.b, 0.0)).clamp(0, 1)
        x = (x * self.factor(x, self.c)).clamp(0, 1)
        hsv = rgb_to_hsv(x, self.eps)
        h, s, v = hsv.unbind(-3)
        s = (s * self.factor(x, self.s).squeeze(1)).clamp(0, 1)
        h = (h + 2 * math.pi * self.factor(x, self.h, 0.0).squeeze(1)) % (2 * math.pi)
        return hsv_to_rgb(torch.stack((h, s, v), dim=-3)).clamp(0, 1)


# --------------------------------------------------------------------------------------------
# geometry (kornia.augmentation.RandomAffine, kornia.geometry.transform)


class RandomAffine(nn.Module):
    def __init__(self, degrees=30.0, translate=0.1, scale=(0.8, 1.2)):
        super().__init__()
        self.degrees, self.translate, self.scale = degrees, translate, scale

    def forward(self, x):
        b = x.shape[0]
        angle = torch.deg2rad((2 * torch.rand(b, device=x.device) - 1) * self.degrees)
        sc = self.scale[0] + (self.scale[1] - self.scale[0]) * torch.rand(b, device=x.device)
        t = (2 * torch.rand(b, 2, device=x.device) - 1) * self.translate
        cos, sin = torch.cos(angle) / sc, torch.sin(angle) / sc
        theta = torch.stack([torch.stack([cos, -sin, t[:, 0]], -1),
                             torch.stack([sin, cos, t[:, 1]], -1)], 1).to(x.dtype)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return F.grid_sample(x, grid, padding_mode="zeros", align_corners=False)


def get_perspective_transform(points_src, points_dst):
    """kornia.geometry.transform.get_perspective_transform: the 8x8 system of the four point
    pairs, solved with ``torch.linalg.solve``."""
    rows = []
    for i in range(4):
        x, y = points_src[:, i, 0], points_src[:, i, 1]
        u, v = points_dst[:, i, 0], points_dst[:, i, 1]
        one, zero = torch.ones_like(x), torch.zeros_like(x)
        rows.append(torch.stack([x, y, one, zero, zero, zero, -x * u, -y * u], -1))
        rows.append(torch.stack([zero, zero, zero, x, y, one, -x * v, -y * v], -1))
    a = torch.stack(rows, 1)
    b = points_dst.reshape(-1, 8, 1)
    h = torch.linalg.solve(a, b)
    return torch.cat([h.squeeze(-1), torch.ones_like(h[:, :1, 0])], -1).view(-1, 3, 3)


class RandomResizedCrop(nn.Module):
    """kornia.augmentation.RandomResizedCrop: a box of ``scale`` of the area, ``ratio`` of
    aspect, whose integer size is rounded, cropped and resized by a perspective warp."""

    def __init__(self, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        super().__init__()
        self.scale, self.ratio = scale, ratio

    def forward(self, x):
        b, _, hgt, wid = x.shape
        area = hgt * wid * (self.scale[0] + (self.scale[1] - self.scale[0])
                            * torch.rand(b, device=x.device))
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        ratio = torch.exp(lo + (hi - lo) * torch.rand(b, device=x.device))
        w = torch.sqrt(area * ratio).round().clamp(max=wid)
        h = torch.sqrt(area / ratio).round().clamp(max=hgt)
        x0 = ((wid - w) * torch.rand(b, device=x.device)).floor()
        y0 = ((hgt - h) * torch.rand(b, device=x.device)).floor()
        src = torch.stack([torch.stack([x0, y0], -1), torch.stack([x0 + w - 1, y0], -1),
                           torch.stack([x0 + w - 1, y0 + h - 1], -1),
                           torch.stack([x0, y0 + h - 1], -1)], 1)
        return crop_and_resize(x, src)


# --------------------------------------------------------------------------------------------
# intensity


def per_image_standardization(x):
    """tf.image.per_image_standardization without its ``max(std, 1 / sqrt(N))`` floor."""
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    std = x.std(dim=(1, 2, 3), keepdim=True)
    return (x - mean) / std


class Standardize(nn.Module):
    def forward(self, x):
        return per_image_standardization(x)


class RandomGamma(nn.Module):
    """torchvision's adjust_gamma, ``image ** gamma`` with a gamma drawn per sample."""

    def __init__(self, gamma=(0.7, 1.5)):
        super().__init__()
        self.gamma = gamma

    def forward(self, x):
        lo, hi = self.gamma
        g = lo + (hi - lo) * torch.rand(x.shape[0], 1, 1, 1, device=x.device)
        return x ** g


def autocontrast(x):
    """torchvision's autocontrast, its guard of a constant channel left out: each channel
    stretched to [0, 1] by its own min and max."""
    lo = x.amin(dim=(-2, -1), keepdim=True)
    hi = x.amax(dim=(-2, -1), keepdim=True)
    return ((x - lo) / (hi - lo)).clamp(0, 1)


def solarize(x, magnitude):
    return torch.where(x >= 1.0 - magnitude, 1.0 - x, x)


def posterize(x, magnitude):
    levels = 2 ** (8 - int(4 * magnitude))
    return torch.floor(x * levels) / levels


def sharpness(x, magnitude):
    k = torch.tensor([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]], device=x.device) / 13
    blurred = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"),
                       k.expand(x.shape[1], 1, 3, 3), groups=x.shape[1])
    return (x + magnitude * (x - blurred)).clamp(0, 1)


class RandAugment(nn.Module):
    """torchvision.transforms.RandAugment's policy on a batch: ``num_ops`` ops drawn with
    Python's ``random`` each step, at one magnitude out of ``num_magnitude_bins``."""

    def __init__(self, num_ops=2, magnitude=9, num_magnitude_bins=31):
        super().__init__()
        self.num_ops, self.m = num_ops, magnitude / (num_magnitude_bins - 1)
        self.ops = ["identity", "autocontrast", "solarize", "posterize", "sharpness"]

    def forward(self, x):
        for op in random.choices(self.ops, k=self.num_ops):
            if op == "autocontrast":
                x = autocontrast(x)
            elif op != "identity":
                x = globals()[op](x, self.m)
        return x


class DataAugmentation(nn.Module):
    """The Kornia tutorial's module: no gradient, called on the batch in the training step."""

    def __init__(self, eps=1e-8, crop_scale=(0.08, 1.0)):
        super().__init__()
        self.geometric = nn.Sequential(RandomResizedCrop(crop_scale), RandomAffine())
        self.jitter = ColorJitter(eps=eps)

    @torch.no_grad()
    def forward(self, x):
        return self.jitter(self.geometric(x))


# --------------------------------------------------------------------------------------------
# networks


class SmallResNet(nn.Module):
    """A torchvision-style ResNet stem and one basic block, with an optional augmentation
    pipeline run in ``forward`` while training (as timm's ``--gpu-aug`` forks and
    DiffAugment-style models do)."""

    def __init__(self, aug: nn.Module | None = None, standardize: bool = False):
        super().__init__()
        self.aug = aug
        self.standardize = standardize
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True))
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, N_CLS)

    def forward(self, x, boxes=None):
        if boxes is not None:  # an object-centric crop of each image's box
            x = crop_and_resize(x, boxes)
        if self.training and self.aug is not None:
            x = self.aug(x)
        if self.standardize:
            x = per_image_standardization(x)
        x = self.stem(x)
        out = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(out)) + x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class LearnedBrightness(nn.Module):
    """Faster AutoAugment's differentiable brightness (PIL's ``ImageEnhance.Brightness``, a
    blend with black): a magnitude trained with the network."""

    def __init__(self):
        super().__init__()
        self.magnitude = nn.Parameter(torch.tensor(0.1))

    def forward(self, x):
        return (x * (1 + self.magnitude)).clamp(0, 1)


class LearnedSaturation(nn.Module):
    """A differentiable saturation through HSV's ``s``, the division by ``max`` guarded by
    ``torch.where`` (black pixels get ``s = 0``)."""

    def __init__(self):
        super().__init__()
        self.magnitude = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        v = x.amax(-3, keepdim=True)
        s = torch.where(v > 0, (v - x.amin(-3, keepdim=True)) / v, torch.zeros_like(v))
        gray = v * (1 - s)  # the least channel
        return (gray + (x - gray) * (1 + self.magnitude)).clamp(0, 1)


def crop_and_resize(x, boxes):
    """kornia.geometry.transform.crop_and_resize: each image's box ``(B, 4, 2)`` (corners
    clockwise from top-left, in pixels) warped onto the whole output."""
    b, _, hgt, wid = x.shape
    dst = torch.tensor([[0.0, 0.0], [wid - 1, 0.0], [wid - 1, hgt - 1], [0.0, hgt - 1]],
                       device=x.device).expand(b, 4, 2)
    m = get_perspective_transform(dst, boxes)
    ys, xs = torch.meshgrid(torch.arange(hgt, device=x.device, dtype=x.dtype),
                            torch.arange(wid, device=x.device, dtype=x.dtype), indexing="ij")
    pts = torch.stack([xs, ys, torch.ones_like(xs)], -1).view(1, -1, 3) @ m.transpose(1, 2)
    xy = pts[..., :2] / pts[..., 2:]
    grid = torch.stack([2 * xy[..., 0] / (wid - 1) - 1, 2 * xy[..., 1] / (hgt - 1) - 1], -1)
    return F.grid_sample(x, grid.view(b, hgt, wid, 2), align_corners=True)


def make_resnet():
    torch.manual_seed(0)
    return SmallResNet()


def make_standardized():
    torch.manual_seed(0)
    return SmallResNet(standardize=True)


def make_jitter_no_eps():
    torch.manual_seed(0)
    return SmallResNet(aug=ColorJitter(eps=0.0))


def make_jitter():
    torch.manual_seed(0)
    return SmallResNet(aug=ColorJitter())


def make_gamma_after_standardize():
    torch.manual_seed(0)
    return SmallResNet(aug=nn.Sequential(Standardize(), RandomGamma()))


def make_learned():
    torch.manual_seed(0)
    return SmallResNet(aug=nn.Sequential(LearnedBrightness(), LearnedSaturation(),
                                         RandomAffine()))


class HalfJitter(nn.Module):
    """The colour jitter run on the float16 batch the loader delivers (FFCV's
    ``Convert(torch.float16)``), the network in float32 after it."""

    def __init__(self):
        super().__init__()
        self.jitter = ColorJitter(brightness=0.0)  # (kornia's default eps, 1e-8)

    def forward(self, x):
        return self.jitter(x).float()


def make_jitter_half():
    torch.manual_seed(0)
    return SmallResNet(aug=HalfJitter())


def make_randaugment():
    torch.manual_seed(0)
    return SmallResNet(aug=RandAugment())


def make_pipeline_no_eps():
    torch.manual_seed(0)
    return SmallResNet(aug=DataAugmentation(eps=0.0))


class ApplyWithProbability(nn.Module):
    """kornia's AugmentationBase2D: each sample drawn with probability ``p``, the transform
    applied to the drawn ones only, ``out[to_apply] = transform(x[to_apply])``."""

    def __init__(self, transform: nn.Module, p: float = 0.5):
        super().__init__()
        self.transform, self.p = transform, p

    def forward(self, x):
        to_apply = torch.rand(x.shape[0], device=x.device) < self.p
        self.batch_prob = to_apply  # (kornia keeps it in self._params["batch_prob"])
        out = x.clone()
        if to_apply.any():
            out[to_apply] = self.transform(x[to_apply])
        return out


def make_jitter_p_no_eps():
    torch.manual_seed(0)
    return SmallResNet(aug=ApplyWithProbability(ColorJitter(eps=0.0)))


def make_learned_p():
    torch.manual_seed(0)
    return SmallResNet(aug=nn.Sequential(LearnedBrightness(),
                                         ApplyWithProbability(LearnedSaturation()),
                                         RandomAffine()))


# a generator of the augmentation code's own, at module level (seeded once, as a reproducible
# pipeline seeds its augmentations apart from the model's initialisation)
AUG_GEN = torch.Generator().manual_seed(1234)


class SeededJitter(ColorJitter):
    def factor(self, x, spread, center=1.0):
        u = torch.rand(x.shape[0], 1, 1, 1, generator=AUG_GEN, dtype=x.dtype)
        return center + spread * (2 * u - 1)


def make_seeded_jitter_no_eps():
    torch.manual_seed(0)
    AUG_GEN.manual_seed(1234)
    return SmallResNet(aug=SeededJitter(eps=0.0))
