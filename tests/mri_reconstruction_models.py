"""Accelerated MRI reconstruction as fastMRI / VarNet code writes it, for ``test_mri_reconstruction``.

Multi-coil k-space is stored as real/imag channels ``(B, coils, H, W, 2)``; the undersampling
mask ``(B, 1, 1, W, 1)`` (equispaced columns, a fully sampled centre) and the body outline
``(B, H, W)`` are passed into ``forward``. ``VarNet``: the masked k-space is normalised by its
max, sensitivity maps are estimated from the auto-calibration lines and normalised by their
root-sum-of-squares over coils, then unrolled cascades each take a data-consistency gradient
step with a learned step size (``x - eta * A^H(A x - k)``, FFT/iFFT with ``norm="ortho"``) and a
small CNN refiner; the magnitude image ``sqrt(re^2 + im^2)`` is cut to the body outline. The
loss is SSIM written out (local means/variances by ``avg_pool2d``, ``C1``/``C2`` from the data
range) plus L1. ``MoDL``: a CNN denoiser alternating with closed-form data consistency per
coil, ``(mask * k + lam * F(S z)) / (mask + lam)``, with a learned weight ``lam``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

H = W = 16
COILS = 4
ACS = 4  # fully sampled centre columns


def fft2c(x):
    """Centred orthonormal 2-D FFT of ``(..., H, W, 2)`` real/imag tensors."""
    z = torch.view_as_complex(x.contiguous())
    z = torch.fft.fftshift(torch.fft.fft2(torch.fft.ifftshift(z, dim=(-2, -1)), norm="ortho"),
                           dim=(-2, -1))
    return torch.view_as_real(z)


def ifft2c(k):
    z = torch.view_as_complex(k.contiguous())
    z = torch.fft.fftshift(torch.fft.ifft2(torch.fft.ifftshift(z, dim=(-2, -1)), norm="ortho"),
                           dim=(-2, -1))
    return torch.view_as_real(z)


def complex_mul(a, b):
    re = a[..., 0] * b[..., 0] - a[..., 1] * b[..., 1]
    im = a[..., 0] * b[..., 1] + a[..., 1] * b[..., 0]
    return torch.stack([re, im], -1)


def complex_conj(a):
    return torch.stack([a[..., 0], -a[..., 1]], -1)


def rss(x, dim: int = 1):
    """Root-sum-of-squares over coils of a real/imag tensor."""
    return torch.sqrt((x ** 2).sum(-1).sum(dim))


class SensitivityModel(nn.Module):
    """Coil maps from the ACS lines, refined by a conv, normalised by their RSS over coils."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, k):
        centre = torch.zeros_like(k)
        c = W // 2
        centre[..., c - ACS // 2:c + ACS // 2, :] = k[..., c - ACS // 2:c + ACS // 2, :]
        imgs = ifft2c(centre)  # (B, C, H, W, 2)
        b, n = imgs.shape[:2]
        x = imgs.reshape(b * n, H, W, 2).permute(0, 3, 1, 2)
        x = x + self.conv(x)
        maps = x.permute(0, 2, 3, 1).reshape(b, n, H, W, 2)
        return maps / (rss(maps)[:, None, :, :, None] + 1e-12)


class Refiner(nn.Module):
    """The cascade's CNN regulariser on the coil-combined image (2 channels: re, im)."""

    def __init__(self, ch: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(2, ch, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(ch, 2, 3, padding=1))

    def forward(self, x):
        return self.net(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


class Cascade(nn.Module):
    def __init__(self):
        super().__init__()
        self.eta = nn.Parameter(torch.tensor(0.5))  # the learned data-consistency step size
        self.refiner = Refiner()

    def forward(self, x, k, mask, maps):
        # A x = mask * F(S x); A^H r = sum_c conj(S_c) F^H(r_c)
        residual = mask * fft2c(complex_mul(maps, x[:, None])) - k
        grad = complex_mul(complex_conj(maps), ifft2c(mask * residual)).sum(1)
        return x - self.eta * grad + self.refiner(x)


class VarNet(nn.Module):
    def __init__(self, cascades: int = 2, eps: float = 1e-8, mag_eps: float = 1e-12,
                 normalise: bool = True):
        super().__init__()
        self.sens = SensitivityModel()
        self.cascades = nn.ModuleList(Cascade() for _ in range(cascades))
        self.eps, self.mag_eps, self.normalise = eps, mag_eps, normalise

    def forward(self, kspace, mask, body):
        k = kspace * mask
        if self.normalise:
            scale = k.abs().amax(dim=(1, 2, 3, 4), keepdim=True)
            k = k / (scale + self.eps)  # the bug at eps=0: a padding slice is 0/0
        maps = self.sens(k)
        x = complex_mul(complex_conj(maps), ifft2c(k)).sum(1)  # zero-filled, coil-combined
        for cascade in self.cascades:
            x = cascade(x, k, mask, maps)
        mag = torch.sqrt(x[..., 0] ** 2 + x[..., 1] ** 2 + self.mag_eps)  # bug at 0: sqrt'(0)
        return mag * body


def make_varnet():
    torch.manual_seed(0)
    return VarNet()


def make_varnet_no_eps():
    torch.manual_seed(0)
    return VarNet(eps=0.0)


def make_varnet_raw_mag():
    """The magnitude written as ``sqrt(re^2 + im^2)`` (no eps), the image masked before it."""
    torch.manual_seed(0)
    return MaskedFirst(mag_eps=0.0)


def make_varnet_unnormalised():
    """Relies on the data set having normalised each volume's k-space."""
    torch.manual_seed(0)
    return VarNet(normalise=False)


class MaskedFirst(VarNet):
    """The complex image is cut to the body outline first, then its magnitude is taken."""

    def forward(self, kspace, mask, body):
        k = kspace * mask
        scale = k.abs().amax(dim=(1, 2, 3, 4), keepdim=True)
        k = k / (scale + self.eps)
        maps = self.sens(k)
        x = complex_mul(complex_conj(maps), ifft2c(k)).sum(1)
        for cascade in self.cascades:
            x = cascade(x, k, mask, maps)
        x = x * body[..., None]
        return torch.sqrt(x[..., 0] ** 2 + x[..., 1] ** 2 + self.mag_eps)


def ssim(x, y, data_range, win: int = 7, k1: float = 0.01, k2: float = 0.03,
         three_term: bool = False):
    """SSIM of ``(B, H, W)`` images, written out as fastMRI's ``SSIMLoss``: per-sample range."""
    x, y = x[:, None], y[:, None]
    c1 = (k1 * data_range) ** 2
    c2 = (k2 * data_range) ** 2
    ux, uy = F.avg_pool2d(x, win, 1), F.avg_pool2d(y, win, 1)
    uxx, uyy, uxy = F.avg_pool2d(x * x, win, 1), F.avg_pool2d(y * y, win, 1), F.avg_pool2d(x * y, win, 1)
    n = win * win
    vx, vy, vxy = n / (n - 1) * (uxx - ux * ux), n / (n - 1) * (uyy - uy * uy), n / (n - 1) * (uxy - ux * uy)
    if three_term:  # luminance * contrast * structure, with the standard deviations
        sx, sy = torch.sqrt(vx), torch.sqrt(vy)  # the bug: a flat patch's variance rounds < 0
        c3 = c2 / 2
        s = ((2 * ux * uy + c1) / (ux ** 2 + uy ** 2 + c1) * (2 * sx * sy + c2)
             / (vx + vy + c2) * (vxy + c3) / (sx * sy + c3))
    else:
        s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux ** 2 + uy ** 2 + c1) * (vx + vy + c2))
    return s.mean(dim=(1, 2, 3))


class SSIMLoss(nn.Module):
    """``1 - SSIM`` plus an L1 term; the data range is each target's max (``per_slice``) or 1."""

    def __init__(self, per_slice: bool = False, l1: float = 0.1, three_term: bool = False):
        super().__init__()
        self.per_slice, self.l1, self.three_term = per_slice, l1, three_term

    def forward(self, pred, target):
        if self.per_slice:
            dr = target.amax(dim=(1, 2))[:, None, None, None]  # the bug: 0 on a padding slice
        else:
            dr = torch.ones((), dtype=pred.dtype)
        return (1 - ssim(pred, target, dr, three_term=self.three_term)).mean() + self.l1 * F.l1_loss(pred, target)


def phantom(g, n: int = 32, flat: int | None = None):
    """Ellipse phantoms with coil sensitivities: (image target, body outline, coil images)."""
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, H), torch.linspace(-1, 1, W), indexing="ij")
    a = 0.6 + 0.3 * torch.rand(n, 1, 1, generator=g)
    b = 0.6 + 0.3 * torch.rand(n, 1, 1, generator=g)
    body = ((xx / a) ** 2 + (yy / b) ** 2 <= 1).float()
    img = body * (0.5 + 0.5 * torch.rand(n, H, W, generator=g))
    if flat is not None:
        body[flat], img[flat] = 1, 0.7
    centres = torch.tensor([[-1.0, -1.0], [-1.0, 1.0], [1.0, -1.0], [1.0, 1.0]])
    sens = torch.stack([torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / 2) for cx, cy in centres])
    phase = torch.stack([torch.cos(xx + yy), torch.sin(xx + yy)], -1)[None]  # (1, H, W, 2)
    coil = (img[:, None] * sens[None])[..., None] * phase[:, None]  # (n, C, H, W, 2)
    return img, body, coil


def slices(n: int = 32, padding: int | None = None, nan_at: int | None = None,
           raw: int | None = None, flat: int | None = None):
    """A fastMRI-style multi-coil data set: (k-space, mask, body) and the RSS target.

    ``padding``: that slice is a padding slice (all-zero k-space, zero target and outline);
    ``nan_at``: one k-space sample of that slice is NaN (a corrupt line of the HDF5 file);
    ``raw``: that slice is in the scanner's raw units (1e6), the per-volume std left out;
    ``flat``: that slice is a uniform QA phantom (a water bottle filling the field of view)."""
    g = torch.Generator().manual_seed(3)
    img, body, coil = phantom(g, n, flat)
    kspace = fft2c(coil)
    mask = torch.zeros(n, 1, 1, W, 1)
    mask[..., ::3, :] = 1
    mask[..., W // 2 - ACS // 2:W // 2 + ACS // 2, :] = 1
    target = img.clone()
    if padding is not None:
        kspace[padding], target[padding], body[padding] = 0, 0, 0
    if nan_at is not None:
        kspace[nan_at, 1, 3, 4, 0] = float("nan")
    if raw is not None:
        kspace[raw] *= 1e6
    return torch.utils.data.TensorDataset(kspace, mask, body, target)


class MoDL(nn.Module):
    """MoDL-style unrolling: a CNN denoiser, then data consistency in closed form per coil,
    ``k_dc = (mask * k + lam * F(S z)) / (mask + lam)`` with a learned weight ``lam``."""

    def __init__(self, iters: int = 2, lam: float = 0.05):
        super().__init__()
        self.sens = SensitivityModel()
        self.denoiser = Refiner()
        self.lam = nn.Parameter(torch.tensor(lam))  # the bug at 0 ("hard" DC): 0/0 off the mask
        self.iters = iters

    def forward(self, kspace, mask, body):
        k = kspace * mask
        k = k / (k.abs().amax(dim=(1, 2, 3, 4), keepdim=True) + 1e-8)
        maps = self.sens(k)
        x = complex_mul(complex_conj(maps), ifft2c(k)).sum(1)
        for _ in range(self.iters):
            z = x + self.denoiser(x)
            k_dc = (mask * k + self.lam * fft2c(complex_mul(maps, z[:, None]))) / (mask + self.lam)
            x = complex_mul(complex_conj(maps), ifft2c(k_dc)).sum(1)
        return torch.sqrt(x[..., 0] ** 2 + x[..., 1] ** 2 + 1e-12) * body


def make_modl():
    torch.manual_seed(0)
    return MoDL()


def make_modl_hard_dc():
    torch.manual_seed(0)
    return MoDL(lam=0.0)
