"""3D medical imaging models of ``tests/test_medical_imaging.py``, written as that community
writes them: a small 3D U-Net (Conv3d, InstanceNorm3d / GroupNorm, LeakyReLU, ConvTranspose3d
upsampling, deep-supervision heads), soft Dice / generalized Dice / Tversky losses over one-hot
labels, and a VoxelMorph-style registration network (a spatial transformer over a displacement
field with ``F.grid_sample``, local normalized cross-correlation from box-filter convolutions,
a smoothness loss on the field's gradients). Patches are cropped at random inside a Dataset
from torch's RNG. The factories live at module level so that ``nanreplay`` rebuilds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

N_CLASSES = 3


def norm3d(kind: str, c: int) -> nn.Module:
    return nn.InstanceNorm3d(c, affine=True) if kind == "instance" else nn.GroupNorm(2, c)


class ConvBlock(nn.Module):
    """nnU-Net's conv - norm - LeakyReLU, twice."""

    def __init__(self, cin: int, cout: int, norm: str):
        super().__init__()
        self.conv1, self.norm1 = nn.Conv3d(cin, cout, 3, padding=1), norm3d(norm, cout)
        self.conv2, self.norm2 = nn.Conv3d(cout, cout, 3, padding=1), norm3d(norm, cout)
        self.act = nn.LeakyReLU(0.01)

    def forward(self, x):
        x = self.act(self.norm1(self.conv1(x)))
        return self.act(self.norm2(self.conv2(x)))


class UNet3D(nn.Module):
    """Two resolution levels; with ``deep_supervision`` the forward returns the logits of
    every decoder level, full resolution first (nnU-Net's convention)."""

    def __init__(self, cin: int = 1, n_classes: int = N_CLASSES, base: int = 4,
                 norm: str = "instance", deep_supervision: bool = False):
        super().__init__()
        self.enc1, self.enc2 = ConvBlock(cin, base, norm), ConvBlock(base, 2 * base, norm)
        self.down = nn.Conv3d(2 * base, 2 * base, 3, stride=2, padding=1)
        self.bottleneck = ConvBlock(2 * base, 4 * base, norm)
        self.up2 = nn.ConvTranspose3d(4 * base, 2 * base, 2, stride=2)
        self.dec2 = ConvBlock(4 * base, 2 * base, norm)
        self.pool = nn.MaxPool3d(2)
        self.up1 = nn.ConvTranspose3d(2 * base, base, 2, stride=2)
        self.dec1 = ConvBlock(2 * base, base, norm)
        self.head = nn.Conv3d(base, n_classes, 1)
        self.aux = nn.Conv3d(2 * base, n_classes, 1) if deep_supervision else None

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        b = self.bottleneck(self.down(e2))
        d2 = self.dec2(torch.cat([self.up2(b), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        if self.aux is None:
            return self.head(d1)
        return [self.head(d1), self.aux(d2)]


def make_unet(n_classes: int = N_CLASSES, norm: str = "instance") -> nn.Module:
    torch.manual_seed(0)
    return UNet3D(n_classes=n_classes, norm=norm)


def make_unet_groupnorm() -> nn.Module:
    torch.manual_seed(0)
    return UNet3D(norm="group")


def make_unet_deep_supervision(n_classes: int = N_CLASSES) -> nn.Module:
    torch.manual_seed(0)
    return UNet3D(n_classes=n_classes, deep_supervision=True)


def one_hot(labels, n_classes: int = N_CLASSES):
    """(B, D, H, W) integer labels as (B, C, D, H, W) floats."""
    return F.one_hot(labels.long(), n_classes).permute(0, 4, 1, 2, 3).float()


class SoftDiceLoss(nn.Module):
    """Soft Dice over the batch and spatial axes, per class, as MONAI's DiceLoss."""

    def __init__(self, smooth: float = 1e-5):
        super().__init__()
        self.smooth = smooth

    def forward(self, logits, labels):
        p, t = logits.softmax(1), one_hot(labels, logits.shape[1])
        dims = (0, 2, 3, 4)
        inter = (p * t).sum(dims)
        denom = p.sum(dims) + t.sum(dims)
        return 1 - ((2 * inter + self.smooth) / (denom + self.smooth)).mean()


class GeneralizedDiceLoss(nn.Module):
    """Sudre et al.'s generalized Dice: each class weighted by 1 / (its label volume)^2, per
    sample or over the batch (``batch``, MONAI's option), as the paper writes it (MONAI
    replaces the infinite weights of absent classes; this one does not)."""

    def __init__(self, batch: bool = False):
        super().__init__()
        self.batch = batch

    def forward(self, logits, labels):
        p, t = logits.softmax(1), one_hot(labels, logits.shape[1])
        dims = (0, 2, 3, 4) if self.batch else (2, 3, 4)
        w = 1.0 / t.sum(dims) ** 2
        inter = (w * (p * t).sum(dims)).sum(-1)
        denom = (w * (p + t).sum(dims)).sum(-1)
        return (1 - 2 * inter / denom).mean()


class TverskyLoss(nn.Module):
    """Tversky index per sample and class, or per class over the batch (``batch``); alpha
    penalises false positives."""

    def __init__(self, alpha: float = 0.3, beta: float = 0.7, batch: bool = False):
        super().__init__()
        self.alpha, self.beta, self.batch = alpha, beta, batch

    def index(self, logits, labels):
        p, t = logits.softmax(1), one_hot(labels, logits.shape[1])
        dims = (0, 2, 3, 4) if self.batch else (2, 3, 4)
        tp = (p * t).sum(dims)
        fp = (p * (1 - t)).sum(dims)
        fn = ((1 - p) * t).sum(dims)
        return tp / (tp + self.alpha * fp + self.beta * fn)

    def forward(self, logits, labels):
        return (1 - self.index(logits, labels)).mean()


class DeepSupervisionLoss(nn.Module):
    """nnU-Net's deep supervision: the loss of every decoder level against labels pooled to
    its size, weighted 1, 1/2, ... and normalised."""

    def __init__(self, loss: nn.Module):
        super().__init__()
        self.loss = loss

    def forward(self, outputs, labels):
        weights = torch.tensor([1 / 2 ** i for i in range(len(outputs))])
        weights = weights / weights.sum()
        total = 0
        for w, out in zip(weights, outputs):
            lab = labels
            if out.shape[2:] != labels.shape[1:]:
                lab = F.interpolate(labels[:, None].float(), size=out.shape[2:],
                                    mode="nearest")[:, 0].long()
            total = total + w * self.loss(out, lab)
        return total


def phantom(n: int = 8, size: int = 24, seed: int = 0):
    """Volumes with a sphere (class 1) and a shell around it (class 2) in noise."""
    g = torch.Generator().manual_seed(seed)
    ax = torch.arange(size, dtype=torch.float32)
    z, y, x = torch.meshgrid(ax, ax, ax, indexing="ij")
    vols, labs = [], []
    for _ in range(n):
        c = size / 2 + (torch.rand(3, generator=g) - 0.5) * size / 4
        r = ((z - c[0]) ** 2 + (y - c[1]) ** 2 + (x - c[2]) ** 2).sqrt()
        lab = torch.zeros(size, size, size, dtype=torch.long)
        lab[r < 6] = 2
        lab[r < 4] = 1
        vol = lab.float() * 0.5 + 0.1 * torch.randn(size, size, size, generator=g)
        vols.append(vol[None])
        labs.append(lab)
    return torch.stack(vols), torch.stack(labs)


class RandomPatches(Dataset):
    """Random ``patch``^3 crops of the volumes, drawn from torch's RNG in ``__getitem__`` (as
    MONAI's RandSpatialCrop and nnU-Net's loaders do), z-score normalised per patch."""

    def __init__(self, vols, labs, patch: int = 16, normalise: bool = True):
        self.vols, self.labs, self.patch, self.normalise = vols, labs, patch, normalise

    def __len__(self):
        return len(self.vols)

    def __getitem__(self, i):
        s = self.vols.shape[-1] - self.patch
        z, y, x = torch.randint(0, s + 1, (3,)).tolist()
        p = self.patch
        vol = self.vols[i, :, z:z + p, y:y + p, x:x + p]
        lab = self.labs[i, z:z + p, y:y + p, x:x + p]
        if self.normalise:
            vol = (vol - vol.mean()) / vol.std()
        return vol, lab


class SpatialTransformer(nn.Module):
    """VoxelMorph's spatial transformer: warps ``src`` by a displacement field in voxels."""

    def __init__(self, size):
        super().__init__()
        grid = torch.stack(torch.meshgrid(*[torch.arange(s) for s in size], indexing="ij"))
        self.register_buffer("grid", grid[None].float(), persistent=False)

    def forward(self, src, flow):
        new = self.grid + flow
        shape = flow.shape[2:]
        new = torch.stack([2 * (new[:, i] / (shape[i] - 1) - 0.5) for i in range(3)], 1)
        new = new.permute(0, 2, 3, 4, 1)[..., [2, 1, 0]]  # grid_sample wants x, y, z
        return F.grid_sample(src, new, align_corners=True, mode="bilinear")


class VxmNet(nn.Module):
    """VoxelMorph: a U-Net over the moving and fixed images, a 3-channel flow head
    initialised near zero, the moving image warped by the flow."""

    def __init__(self, size=(16, 16, 16), base: int = 4):
        super().__init__()
        self.unet = UNet3D(cin=2, n_classes=base, base=base, norm="instance")
        self.flow = nn.Conv3d(base, 3, 3, padding=1)
        nn.init.normal_(self.flow.weight, 0, 1e-5)
        nn.init.zeros_(self.flow.bias)
        self.transformer = SpatialTransformer(size)

    def forward(self, moving, fixed):
        flow = self.flow(self.unet(torch.cat([moving, fixed], 1)))
        return self.transformer(moving, flow), flow


def make_vxm() -> nn.Module:
    torch.manual_seed(0)
    return VxmNet()


class NCC(nn.Module):
    """VoxelMorph's local normalized cross-correlation over ``win``^3 windows, sums by a
    box-filter convolution; local variances as E[x^2] - E[x]^2 (``sqrt_eps`` None: the
    squared form cross^2 / (var_I var_J + 1e-5), VoxelMorph's own; else the correlation
    cross / (sqrt(var_I) sqrt(var_J) + sqrt_eps) as many ports write it)."""

    def __init__(self, win: int = 5, sqrt_eps: float | None = None):
        super().__init__()
        self.win, self.sqrt_eps = win, sqrt_eps

    def forward(self, y_true, y_pred):
        filt = torch.ones(1, 1, self.win, self.win, self.win, device=y_true.device)
        pad, n = self.win // 2, float(self.win ** 3)

        def box(x):
            return F.conv3d(x, filt, padding=pad)

        i_sum, j_sum = box(y_true), box(y_pred)
        i2_sum, j2_sum, ij_sum = box(y_true * y_true), box(y_pred * y_pred), box(y_true * y_pred)
        u_i, u_j = i_sum / n, j_sum / n
        cross = ij_sum - u_j * i_sum - u_i * j_sum + u_i * u_j * n
        i_var = i2_sum - 2 * u_i * i_sum + u_i * u_i * n
        j_var = j2_sum - 2 * u_j * j_sum + u_j * u_j * n
        if self.sqrt_eps is None:
            cc = cross * cross / (i_var * j_var + 1e-5)
        else:
            cc = cross / (i_var.sqrt() * j_var.sqrt() + self.sqrt_eps)
        return -cc.mean()


class PlainNCC:
    """VoxelMorph's own way with losses: ``losses.NCC(win=...).loss``, a method of a plain class
    (no nn.Module), is the loss function; here the correlation form of :class:`NCC`."""

    def __init__(self, win=None, eps: float = 1e-5):
        self.win, self.eps = win, eps

    def loss(self, y_true, y_pred):
        win = self.win or [9] * 3
        return NCC(win[0], sqrt_eps=self.eps)(y_true, y_pred)


class Grad3d(nn.Module):
    """VoxelMorph's smoothness penalty: the mean squared finite differences of the flow."""

    def forward(self, flow):
        dz = flow[:, :, 1:] - flow[:, :, :-1]
        dy = flow[:, :, :, 1:] - flow[:, :, :, :-1]
        dx = flow[..., 1:] - flow[..., :-1]
        return (dz.pow(2).mean() + dy.pow(2).mean() + dx.pow(2).mean()) / 3


class RegistrationLoss(nn.Module):
    """Similarity of the warped image to the fixed one plus ``lam`` times the flow's
    smoothness: VoxelMorph's training objective."""

    def __init__(self, sim: nn.Module, lam: float = 0.01):
        super().__init__()
        self.sim, self.smooth, self.lam = sim, Grad3d(), lam

    def forward(self, outputs, fixed):
        moved, flow = outputs
        return self.sim(fixed, moved) + self.lam * self.smooth(flow)


def brain_pairs(n: int = 8, size: int = 16, seed: int = 0, stripped: bool = False):
    """Moving and fixed volumes: blobs at jittered places over a noisy background, or over
    exact zeros (``stripped``: skull-stripped scans, the background masked out)."""
    g = torch.Generator().manual_seed(seed)
    ax = torch.arange(size, dtype=torch.float32)
    z, y, x = torch.meshgrid(ax, ax, ax, indexing="ij")

    def blob():
        c = size / 2 + (torch.rand(3, generator=g) - 0.5) * 4
        r2 = (z - c[0]) ** 2 + (y - c[1]) ** 2 + (x - c[2]) ** 2
        v = torch.exp(-r2 / 18) + 0.02 * torch.rand(size, size, size, generator=g)
        return (v * (r2 < 30) if stripped else v)[None]

    moving = torch.stack([blob() for _ in range(n)])
    fixed = torch.stack([blob() for _ in range(n)])
    return moving, fixed


class FocalTverskyLoss(TverskyLoss):
    """Abraham & Khan's focal Tversky loss: (1 - TI)^gamma, gamma < 1 focusing on the hard
    classes."""

    def __init__(self, alpha: float = 0.3, beta: float = 0.7, gamma: float = 0.75,
                 batch: bool = False):
        super().__init__(alpha, beta, batch)
        self.gamma = gamma

    def forward(self, logits, labels):
        return ((1 - self.index(logits, labels)) ** self.gamma).mean()
