"""Deformable image registration of ``tests/test_image_registration.py``, written as
VoxelMorph's and TransMorph's code writes it: a small 3D U-Net over the moving and fixed
volumes (Conv3d + LeakyReLU(0.2), no norm), a flow head initialised near zero, a stationary
velocity field integrated by scaling and squaring, a spatial transformer over ``grid_sample``,
local NCC from box-filter convolutions, a diffusion regulariser on the field's gradients, the
Jacobian determinant by finite differences (a folding penalty or a log-Jacobian term), a
soft Dice of the warped atlas labels (semi-supervised VoxelMorph), Parzen-window mutual
information for multi-modal pairs, and an affine
pre-alignment whose regressed matrix is inverted for an inverse-consistent term. Pairs come
from a Dataset that min-max normalises each scan. Factories live at module level so
``nanreplay`` rebuilds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

SIZE = 16
N_LABELS = 3  # background and two structures


def conv(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(cin, cout, 3, stride, 1), nn.LeakyReLU(0.2))


class Unet(nn.Module):
    """VoxelMorph's U-Net: strided encoder, upsample-and-concatenate decoder."""

    def __init__(self, cin: int = 2, enc=(8, 16, 16), dec=(16, 16, 8)):
        super().__init__()
        self.enc = nn.ModuleList([conv(cin, enc[0]), conv(enc[0], enc[1], 2),
                                  conv(enc[1], enc[2], 2)])
        self.dec = nn.ModuleList([conv(enc[2], dec[0]), conv(dec[0] + enc[1], dec[1]),
                                  conv(dec[1] + enc[0], dec[2])])

    def forward(self, x):
        skips = []
        for layer in self.enc:
            x = layer(x)
            skips.append(x)
        x = self.dec[0](skips.pop())
        for layer in self.dec[1:]:
            x = F.interpolate(x, scale_factor=2, mode="nearest")
            x = layer(torch.cat([x, skips.pop()], 1))
        return x


class SpatialTransformer(nn.Module):
    """VoxelMorph's ``layers.SpatialTransformer``: warps ``src`` by a displacement in voxels."""

    def __init__(self, size=(SIZE,) * 3, mode: str = "bilinear"):
        super().__init__()
        self.mode = mode
        grid = torch.stack(torch.meshgrid(*[torch.arange(s) for s in size], indexing="ij"))
        self.register_buffer("grid", grid[None].float(), persistent=False)

    def forward(self, src, flow):
        new = self.grid + flow
        shape = flow.shape[2:]
        new = torch.stack([2 * (new[:, i] / (shape[i] - 1) - 0.5) for i in range(3)], 1)
        new = new.permute(0, 2, 3, 4, 1)[..., [2, 1, 0]]
        return F.grid_sample(src, new, align_corners=True, mode=self.mode)


class VecInt(nn.Module):
    """Scaling and squaring of a stationary velocity field (``layers.VecInt``)."""

    def __init__(self, steps: int = 7):
        super().__init__()
        self.steps, self.transformer = steps, SpatialTransformer()

    def forward(self, vec):
        vec = vec * 2 ** -self.steps
        for _ in range(self.steps):
            vec = vec + self.transformer(vec, vec)
        return vec


class VxmDense(nn.Module):
    """``VxmDense``: U-Net, 3-channel flow head (Normal(0, 1e-5) unless ``zero_init`` is
    False, when it keeps Conv3d's default init), optional diffeomorphic integration; the
    moving image warped by the field, and the moving segmentation too when it is given
    (the semi-supervised model's extra input, warped with nearest-free linear sampling of
    its one-hot channels)."""

    def __init__(self, int_steps: int = 0, small_init: bool = True):
        super().__init__()
        self.unet = Unet()
        self.flow = nn.Conv3d(8, 3, 3, padding=1)
        if small_init:
            nn.init.normal_(self.flow.weight, 0, 1e-5)
            nn.init.zeros_(self.flow.bias)
        self.integrate = VecInt(int_steps) if int_steps else None
        self.transformer = SpatialTransformer()

    def forward(self, moving, fixed, moving_seg=None):
        flow = self.flow(self.unet(torch.cat([moving, fixed], 1)))
        disp = self.integrate(flow) if self.integrate is not None else flow
        moved = self.transformer(moving, disp)
        if moving_seg is None:
            return moved, disp
        return moved, self.transformer(moving_seg, disp), disp


class VxmRaw(VxmDense):
    """A port that takes scans in scanner units and scales each one by its maximum inside
    ``forward`` (TransMorph-style ``x / x.max()`` per volume), the warped image too."""

    def forward(self, moving, fixed, moving_seg=None):
        moving = moving / moving.amax(dim=(1, 2, 3, 4), keepdim=True)
        fixed = fixed / fixed.amax(dim=(1, 2, 3, 4), keepdim=True)
        return super().forward(moving, fixed, moving_seg)


def make_vxm_raw() -> nn.Module:
    torch.manual_seed(0)
    return VxmRaw()


class AffineVxm(VxmDense):
    """Affine pre-alignment before the deformable step: a CNN regresses the 3x4 matrix
    (its head's bias the identity unless ``identity`` is False), the moving image is
    resampled by ``affine_grid``; the inverse matrix maps the fixed image back for the
    symmetric (inverse-consistent) term."""

    def __init__(self, identity: bool = True):
        super().__init__()
        self.features = nn.Sequential(conv(2, 8, 2), conv(8, 8, 2), nn.AdaptiveAvgPool3d(1),
                                      nn.Flatten())
        self.theta = nn.Linear(8, 12)
        nn.init.zeros_(self.theta.weight)
        with torch.no_grad():
            self.theta.bias.copy_(torch.eye(3, 4).flatten() if identity else torch.zeros(12))

    def forward(self, moving, fixed, moving_seg=None):
        a = self.theta(self.features(torch.cat([moving, fixed], 1))).view(-1, 3, 4)
        grid = F.affine_grid(a, list(moving.shape), align_corners=True)
        aligned = F.grid_sample(moving, grid, align_corners=True)
        inv = torch.linalg.inv(a[:, :, :3])
        back = torch.cat([inv, -inv @ a[:, :, 3:]], 2)
        fixed_back = F.grid_sample(fixed, F.affine_grid(back, list(fixed.shape),
                                                        align_corners=True), align_corners=True)
        seg = F.grid_sample(moving_seg, grid, align_corners=True)
        moved, moved_seg, disp = super().forward(aligned, fixed, seg)
        return moved, moved_seg, disp, fixed_back


def make_affine_vxm(identity: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return AffineVxm(identity)


def make_vxm() -> nn.Module:
    torch.manual_seed(0)
    return VxmDense()


def make_vxm_diff() -> nn.Module:
    torch.manual_seed(0)
    return VxmDense(int_steps=7)


def make_vxm_default_init() -> nn.Module:
    torch.manual_seed(0)
    return VxmDense(small_init=False)


class NCC(nn.Module):
    """Local NCC over ``win``^3 windows as TransMorph's ``NCC_vxm`` and many ports write it:
    cross / sqrt(I_var * J_var + eps), sums by box filters (``eps`` None: no guard;
    ``split``: cross / (sqrt(I_var) sqrt(J_var) + eps), the eps outside the roots)."""

    def __init__(self, win: int = 5, eps: float | None = 1e-5, split: bool = False):
        super().__init__()
        self.win, self.eps, self.split = win, eps, split

    def forward(self, y_true, y_pred, mask=None):
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
        if self.split:
            cc = cross / (torch.sqrt(i_var) * torch.sqrt(j_var) + self.eps)
        elif self.eps is None:
            cc = cross / torch.sqrt(i_var * j_var)
        else:
            cc = cross / torch.sqrt(i_var * j_var + self.eps)
        if mask is not None:  # windows centred in the brain only
            return -torch.where(mask, cc, 0).sum() / mask.sum()
        return -cc.mean()


def gradients(disp):
    """Forward differences of the displacement along z, y, x, cropped to a common shape."""
    dz = disp[:, :, 1:, :-1, :-1] - disp[:, :, :-1, :-1, :-1]
    dy = disp[:, :, :-1, 1:, :-1] - disp[:, :, :-1, :-1, :-1]
    dx = disp[:, :, :-1, :-1, 1:] - disp[:, :, :-1, :-1, :-1]
    return dz, dy, dx


def diffusion(disp):
    """VoxelMorph's ``Grad('l2')``: the mean squared gradient of the field."""
    return sum(d.pow(2).mean() for d in gradients(disp)) / 3


def jacobian_det(disp):
    """det(I + grad u) per voxel, (B, D-1, H-1, W-1): the field folds where it is <= 0."""
    j = torch.stack(gradients(disp), 2)  # (B, 3 components, 3 derivatives, ...)
    j = j + torch.eye(3).view(1, 3, 3, 1, 1, 1)
    return (j[:, 0, 0] * (j[:, 1, 1] * j[:, 2, 2] - j[:, 1, 2] * j[:, 2, 1])
            - j[:, 0, 1] * (j[:, 1, 0] * j[:, 2, 2] - j[:, 1, 2] * j[:, 2, 0])
            + j[:, 0, 2] * (j[:, 1, 0] * j[:, 2, 1] - j[:, 1, 1] * j[:, 2, 0]))


def dice_loss(pred, target, smooth: float = 1e-5):
    """Soft Dice per sample and structure over one-hot labels (background left out)."""
    dims = (2, 3, 4)
    inter = (pred * target)[:, 1:].sum(dims)
    total = pred[:, 1:].sum(dims) + target[:, 1:].sum(dims)
    return 1 - ((2 * inter + smooth) / (total + smooth)).mean()


class RegistrationLoss(nn.Module):
    """NCC + lam * diffusion, plus (semi-supervised) Dice of the warped labels and a Jacobian
    term: ``jac="fold"`` penalises relu(-det) (the folds only), ``jac="log"`` penalises
    log(det)^2 (a volume-change prior, which assumes the field never folds), ``"logdet"`` the
    same by ``torch.logdet`` of the Jacobian matrices."""

    def __init__(self, eps: float | None = 1e-5, lam: float = 0.02, dice_smooth: float = 1e-5,
                 jac: str = "fold", gamma: float = 0.1, split: bool = False,
                 masked: bool = False):
        super().__init__()
        self.masked = masked
        self.ncc, self.lam, self.jac, self.gamma = NCC(eps=eps, split=split), lam, jac, gamma
        self.dice_smooth = dice_smooth

    def forward(self, moved, moved_seg, disp, fixed, fixed_seg):
        mask = fixed_seg[:, 1:].sum(1, keepdim=True) > 0 if self.masked else None
        loss = self.ncc(fixed, moved, mask) + self.lam * diffusion(disp)
        loss = loss + dice_loss(moved_seg, fixed_seg, self.dice_smooth)
        if self.jac == "logdet":  # (torch's own log-determinant of the Jacobian field)
            j = torch.stack(gradients(disp), 2) + torch.eye(3).view(1, 3, 3, 1, 1, 1)
            return loss + self.gamma * torch.logdet(j.permute(0, 3, 4, 5, 1, 2)).pow(2).mean()
        det = jacobian_det(disp)
        if self.jac == "log":
            return loss + self.gamma * torch.log(det).pow(2).mean()
        return loss + self.gamma * F.relu(-det).mean()


def phantom(g: torch.Generator, shift: int):
    """A textured ellipsoid 'brain' with two structures, shifted by ``shift`` voxels, in
    scanner units (0..~900) over Rician-like background noise; its label map."""
    ax = torch.arange(SIZE, dtype=torch.float32) - SIZE / 2 + 0.5
    z, y, x = torch.meshgrid(ax, ax - shift, ax + shift / 2, indexing="ij")
    r = (z / 6) ** 2 + (y / 5) ** 2 + (x / 6) ** 2
    lab = torch.where(r < 1, 1, 0) + torch.where(r < 0.35, 1, 0)
    texture = 1 + 0.2 * torch.sin(x + z * 0.7) * torch.cos(y * 0.9)
    vol = lab.float() * 300 * texture + 30 * torch.rand(SIZE, SIZE, SIZE, generator=g)
    return vol[None], lab


class PairDataset(Dataset):
    """Moving/fixed pairs, each scan min-max normalised to [0, 1] in ``__getitem__`` (as
    the VoxelMorph and TransMorph data loaders do), with their one-hot label maps.
    ``blank`` indexes scans whose volume is stored all zero (an empty export);
    ``stripped`` scans are skull-stripped with exact zeros outside the brain (no noise);
    ``no_inner`` pairs lack the inner structure in both label maps."""

    def __init__(self, n: int, blank=(), stripped=(), no_inner=(), raw: bool = False,
                 blank_fixed=(), windowed=()):
        self.raw = raw
        g = torch.Generator().manual_seed(0)
        self.items = []
        for i in range(n):
            (mv, ml), (fv, fl) = phantom(g, i % 3 - 1), phantom(g, 1 - i % 3)
            if i in blank:
                mv = torch.zeros_like(mv)
            if i in blank_fixed:
                fv = torch.zeros_like(fv)
            if i in stripped:
                mv, fv = mv * (ml > 0), fv * (fl > 0)
            if i in windowed:  # a CT window: intensities clipped at the structure's level
                mv, fv = mv.clamp(max=250), fv.clamp(max=250)
            if i in no_inner:
                ml, fl = ml.clamp(max=1), fl.clamp(max=1)
            self.items.append((mv, fv, ml, fl))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        mv, fv, ml, fl = self.items[i]
        if self.raw:  # (the model scales them)
            onehot = [F.one_hot(s, N_LABELS).permute(3, 0, 1, 2).float() for s in (ml, fl)]
            return mv, fv, onehot[0], onehot[1]
        mv = (mv - mv.min()) / (mv.max() - mv.min())
        fv = (fv - fv.min()) / (fv.max() - fv.min())
        onehot = [F.one_hot(s, N_LABELS).permute(3, 0, 1, 2).float() for s in (ml, fl)]
        return mv, fv, onehot[0], onehot[1]


class MutualInformation(nn.Module):
    """Parzen-window mutual information (VoxelMorph's ``losses.MutualInformation`` without
    its eps): Gaussian soft bins over [0, 1], the joint histogram per pair."""

    def __init__(self, bins: int = 16, sigma_ratio: float = 0.5):
        super().__init__()
        centres = torch.linspace(0, 1, bins)
        self.register_buffer("centres", centres)
        self.preterm = 1 / (2 * (sigma_ratio * (centres[1] - centres[0])) ** 2)

    def forward(self, moved, moved_seg, disp, fixed, fixed_seg):
        a = fixed.flatten(1)[..., None].clamp(0, 1)
        b = moved.flatten(1)[..., None].clamp(0, 1)
        wa = torch.exp(-self.preterm * (a - self.centres) ** 2)
        wa = wa / wa.sum(-1, keepdim=True)
        wb = torch.exp(-self.preterm * (b - self.centres) ** 2)
        wb = wb / wb.sum(-1, keepdim=True)
        pab = wa.transpose(1, 2) @ wb / a.shape[1]
        pa, pb = wa.mean(1, keepdim=True), wb.mean(1, keepdim=True)
        papb = pa.transpose(1, 2) @ pb
        mi = (pab * torch.log(pab / papb)).sum((1, 2))
        return -mi.mean() + 0.02 * diffusion(disp)
