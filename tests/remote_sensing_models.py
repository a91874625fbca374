"""Remote sensing models of ``tests/test_remote_sensing.py``, written as Earth observation code
writes them: Sentinel-2 tiles read as uint16 digital numbers (DN) and scaled by 1e-4 to
reflectance inside the model, spectral indices (NDVI, NDWI) concatenated to the bands, per-band
normalisation by the dataset's mean/std, a small U-Net for land cover, a cloud-masked
per-pixel cross entropy (a mean over each tile's valid pixels), class weights from inverse
pixel frequency, Sentinel-1 backscatter converted to decibels and standardised per tile, and a
Siamese change-detection network (shared encoder, absolute difference of the two dates'
features). Tiles are cropped and flipped at random with torch's RNG. The factories live at
module level so that ``nanreplay`` rebuilds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_CLASSES = 4  # water, vegetation, bare soil, built-up
NODATA = 0     # the L2A products' nodata DN outside the swath
# Band order of the tiles: B2 (blue), B3 (green), B4 (red), B8 (nir).
S2_MEAN = torch.tensor([0.08, 0.10, 0.12, 0.25, 0.3, -0.2])  # 4 bands + NDVI + NDWI
S2_STD = torch.tensor([0.03, 0.04, 0.05, 0.08, 0.3, 0.3])


class SpectralIndices(nn.Module):
    """NDVI = (nir - red) / (nir + red) and NDWI = (green - nir) / (green + nir) on
    reflectances, written from the formulas."""

    def forward(self, refl):
        green, red, nir = refl[:, 1:2], refl[:, 2:3], refl[:, 3:4]
        ndvi = (nir - red) / (nir + red)
        ndwi = (green - nir) / (green + nir)
        return torch.cat([refl, ndvi, ndwi], 1)


class SafeSpectralIndices(SpectralIndices):
    """The same with the denominators floored (0 for nodata pixels, where nir = red = 0)."""

    def forward(self, refl):
        green, red, nir = refl[:, 1:2], refl[:, 2:3], refl[:, 3:4]
        ndvi = (nir - red) / (nir + red).clamp_min(1e-6)
        ndwi = (green - nir) / (green + nir).clamp_min(1e-6)
        return torch.cat([refl, ndvi, ndwi], 1)


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, padding=1),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """Two-level U-Net (conv-BN-ReLU twice, max-pool, transposed-conv up, skip concat)."""

    def __init__(self, cin: int, n_classes: int = N_CLASSES, base: int = 8):
        super().__init__()
        self.enc1, self.enc2 = block(cin, base), block(base, 2 * base)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(2 * base, base, 2, stride=2)
        self.dec1 = block(2 * base, base)
        self.head = nn.Conv2d(base, n_classes, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        return self.head(self.dec1(torch.cat([self.up(e2), e1], 1)))


class LandCoverNet(nn.Module):
    """DN tile (B, 4, H, W) -> land-cover logits (B, N_CLASSES, H, W)."""

    def __init__(self, safe: bool = False, scale: float = 1e-4):
        super().__init__()
        self.scale = scale
        self.indices = SafeSpectralIndices() if safe else SpectralIndices()
        self.register_buffer("mean", S2_MEAN.view(1, -1, 1, 1))
        self.register_buffer("std", S2_STD.view(1, -1, 1, 1))
        self.unet = UNet(6)

    def forward(self, dn):
        refl = dn.float() * self.scale  # L2A BOA_QUANTIFICATION_VALUE (1 when the data is)
        x = (self.indices(refl) - self.mean) / self.std
        return self.unet(x)


def make_landcover() -> nn.Module:
    torch.manual_seed(0)
    return LandCoverNet()


def make_landcover_guarded() -> nn.Module:
    torch.manual_seed(0)
    return LandCoverNet(safe=True)


def make_landcover_reflectance() -> nn.Module:
    """The same network for a dataset that scales DN to reflectance itself."""
    torch.manual_seed(0)
    return LandCoverNet(safe=True, scale=1.0)


class SARNet(nn.Module):
    """Sentinel-1 GRD VV/VH linear backscatter -> dB -> per-tile standardisation -> U-Net
    (flood mapping). ``floor`` is the guarded version's clamp before the log."""

    def __init__(self, floor: float = 0.0):
        super().__init__()
        self.floor = floor
        self.unet = UNet(2, n_classes=2)

    def forward(self, sigma0):
        if self.floor:
            sigma0 = sigma0.clamp_min(self.floor)
        db = 10 * torch.log10(sigma0)
        db = (db - db.mean((2, 3), keepdim=True)) / (db.std((2, 3), keepdim=True) + 1e-6)
        return self.unet(db)


def make_sar() -> nn.Module:
    torch.manual_seed(0)
    return SARNet()


def make_sar_guarded() -> nn.Module:
    torch.manual_seed(0)
    return SARNet(floor=1e-5)  # about -50 dB, below the sensor's noise floor


class LeeFilter(nn.Module):
    """Enhanced Lee speckle filter on linear backscatter (3x3 windows): local mean and
    variance by box filters, the coefficient of variation ``ci = std / mean``, and a weight
    that keeps edges (ci above the speckle's ``cu``) and smooths homogeneous areas."""

    def __init__(self, looks: float = 4.0, floor: bool = False):
        super().__init__()
        self.cu = looks ** -0.5
        self.floor = floor

    def forward(self, x):
        mean = F.avg_pool2d(x, 3, 1, 1, count_include_pad=False)
        var = F.avg_pool2d(x * x, 3, 1, 1, count_include_pad=False) - mean ** 2
        if self.floor:
            var = var.clamp_min(0)
        ci = var.sqrt() / mean
        w = 1 - (self.cu / ci.clamp_min(self.cu)) ** 2
        return mean + w * (x - mean)


class FilteredSARNet(SARNet):
    """The flood mapper with the speckle filter before the dB conversion."""

    def __init__(self, floor: bool = False):
        super().__init__(floor=1e-5)
        self.lee = LeeFilter(floor=floor)

    def forward(self, sigma0):
        return super().forward(self.lee(sigma0))


def make_lee() -> nn.Module:
    torch.manual_seed(0)
    return FilteredSARNet()


def make_lee_guarded() -> nn.Module:
    torch.manual_seed(0)
    return FilteredSARNet(floor=True)


class LogRatioChange(nn.Module):
    """SAR change detection on the log-ratio image log(sigma0_t2 / sigma0_t1), the standard
    change indicator of two co-registered acquisitions (speckle is multiplicative)."""

    def __init__(self, base: int = 8):
        super().__init__()
        self.unet = UNet(2, n_classes=2, base=base)

    def forward(self, s1_t1, s1_t2):
        return self.unet(torch.log(s1_t2 / s1_t1))


def make_log_ratio() -> nn.Module:
    torch.manual_seed(0)
    return LogRatioChange()


class SiameseChange(nn.Module):
    """FC-Siam-diff: one encoder for both dates, |f1 - f2| decoded to change logits."""

    def __init__(self, base: int = 8):
        super().__init__()
        self.register_buffer("mean", S2_MEAN[:4].view(1, -1, 1, 1))
        self.register_buffer("std", S2_STD[:4].view(1, -1, 1, 1))
        self.encoder = block(4, base)
        self.decoder = nn.Sequential(block(base, base), nn.Conv2d(base, 2, 1))

    def forward(self, dn1, dn2):
        f1 = self.encoder((dn1 * 1e-4 - self.mean) / self.std)
        f2 = self.encoder((dn2 * 1e-4 - self.mean) / self.std)
        return self.decoder(torch.abs(f1 - f2))


def make_change() -> nn.Module:
    torch.manual_seed(0)
    return SiameseChange()


class CloudAwareScene(nn.Module):
    """Scene classification with attention pooling over the clear pixels only: scores of
    cloudy pixels are -inf before the spatial softmax (attention-MIL over pixels). A
    ``floor`` of clear pixels (the guarded version) keeps one score finite per tile."""

    def __init__(self, n_classes: int = N_CLASSES, base: int = 8, guarded: bool = False):
        super().__init__()
        self.guarded = guarded
        self.register_buffer("mean", S2_MEAN[:4].view(1, -1, 1, 1))
        self.register_buffer("std", S2_STD[:4].view(1, -1, 1, 1))
        self.encoder = block(4, base)
        self.score = nn.Conv2d(base, 1, 1)
        self.head = nn.Linear(base, n_classes)

    def forward(self, dn, clear):
        f = self.encoder((dn * 1e-4 - self.mean) / self.std)
        s = self.score(f).flatten(1).masked_fill(clear.flatten(1) == 0, float("-inf"))
        if self.guarded:  # a fully clouded tile attends uniformly instead
            s = torch.where(torch.isinf(s).all(1, keepdim=True), torch.zeros_like(s), s)
        a = s.softmax(1)
        return self.head(torch.einsum("bn,bcn->bc", a, f.flatten(2)))


def make_scene() -> nn.Module:
    torch.manual_seed(0)
    return CloudAwareScene()


def make_scene_guarded() -> nn.Module:
    torch.manual_seed(0)
    return CloudAwareScene(guarded=True)


class BandStatsNet(LandCoverNet):
    """The U-Net normalised by per-band statistics computed from the dataset's tiles."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor):
        super().__init__(safe=True)
        self.indices = nn.Identity()
        self.mean, self.std = mean.view(1, -1, 1, 1), std.view(1, -1, 1, 1)
        self.unet = UNet(mean.numel())


def band_stats(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-band mean and std of reflectance over a sample of the training tiles."""
    refl = tiles * 1e-4
    return refl.mean((0, 2, 3)), refl.std((0, 2, 3))


def with_cirrus(dn: torch.Tensor) -> torch.Tensor:
    """The 5-band layout of the model trained on L1C: B10 (cirrus) appended. L2A products
    drop B10, so the reader pads it with zeros."""
    return torch.cat([dn, torch.zeros_like(dn[:, :1])], 1)


def make_band_stats() -> nn.Module:
    torch.manual_seed(0)
    tiles = with_cirrus(s2_tile(torch.Generator().manual_seed(7), 16)[0])
    return BandStatsNet(*band_stats(tiles))


class CloudRemoval(nn.Module):
    """SEN12MS-CR style: a cloudy Sentinel-2 tile (DN) and its Sentinel-1 pair (linear)
    -> the cloud-free reflectances, through a sigmoid (reflectance in [0, 1])."""

    def __init__(self, base: int = 8):
        super().__init__()
        self.unet = UNet(6, n_classes=4, base=base)

    def forward(self, dn, sigma0):
        db = 10 * torch.log10(sigma0.clamp_min(1e-5))
        x = torch.cat([dn * 1e-4, (db + 15) / 5], 1)
        return torch.sigmoid(self.unet(x))


def make_cloud_removal() -> nn.Module:
    torch.manual_seed(0)
    return CloudRemoval()


def ndvi(refl):
    red, nir = refl[:, 2], refl[:, 3]
    return (nir - red) / (nir + red)


def cloud_removal_loss(pred, target_dn):
    """L1 on reflectance plus an NDVI consistency term (vegetation indices preserved)."""
    target = target_dn * 1e-4
    return F.l1_loss(pred, target) + 0.1 * F.l1_loss(ndvi(pred), ndvi(target))


# --- losses -------------------------------------------------------------------------------

def masked_ce(logits, target, valid):
    """Per-pixel cross entropy averaged over each tile's clear pixels (QA60 cloud bits 0),
    then over tiles: a tile fully clouded (or outside the swath) has 0 valid pixels."""
    ce = F.cross_entropy(logits, target, reduction="none")
    per_tile = (ce * valid).sum((1, 2)) / valid.sum((1, 2))
    return per_tile.mean()


def masked_ce_guarded(logits, target, valid):
    ce = F.cross_entropy(logits, target, reduction="none")
    per_tile = (ce * valid).sum((1, 2)) / valid.sum((1, 2)).clamp_min(1)
    return per_tile.mean()


class CloudMaskedCE(nn.Module):
    """Class-weighted cross entropy whose cloudy pixels are set to the ignore index."""

    def __init__(self, weight: torch.Tensor | None = None, ignore_index: int = 255):
        super().__init__()
        self.ce = nn.CrossEntropyLoss(weight=weight, ignore_index=ignore_index)

    def forward(self, logits, target, clear):
        return self.ce(logits, target.masked_fill(clear == 0, self.ce.ignore_index))


def batch_balanced_ce(logits, target, clear):
    """Cross entropy over the clear pixels, weighted by the inverse class frequency of the
    batch's own clear pixels (normalised to sum to 1): a class absent from the batch counts
    0."""
    counts = torch.bincount(target[clear > 0], minlength=logits.shape[1]).float()
    w = 1.0 / counts
    return F.cross_entropy(logits, target.masked_fill(clear == 0, -100), weight=w / w.sum())


def inverse_frequency_weights(label_maps: torch.Tensor, n_classes: int = N_CLASSES):
    """Class weights from the training set's pixel counts, normalised to sum to n_classes (as
    the land-cover repos do): a class absent from the whole set has frequency 0."""
    counts = torch.bincount(label_maps.flatten(), minlength=n_classes).float()
    w = 1.0 / (counts / counts.sum())
    return w / w.sum() * n_classes


# --- data ---------------------------------------------------------------------------------

def s2_tile(g: torch.Generator, n: int, size: int = 16):
    """``n`` DN tiles (uint16 range, as read from the GeoTIFFs), their labels (classes 0-2:
    built-up is absent from this small AOI) and their QA cloud masks (1 = clear)."""
    dn = (torch.rand(n, 4, size, size, generator=g) * 3000 + 200).round()
    dn[:, 3] += 1500  # vegetated: nir above red
    labels = torch.randint(0, N_CLASSES - 1, (n, size, size), generator=g)
    clear = (torch.rand(n, size, size, generator=g) > 0.2).float()
    return dn, labels, clear


def outside_swath(dn: torch.Tensor, clear: torch.Tensor, i: int):
    """Tile ``i`` crosses the swath edge: its left half is nodata (DN 0) and masked out."""
    dn[i, :, :, : dn.shape[-1] // 2] = NODATA
    clear[i, :, : dn.shape[-1] // 2] = 0


def s1_tile(g: torch.Generator, n: int, size: int = 16):
    """Linear sigma0 (VV, VH) from a gamma speckle model, and water/no-water labels."""
    sigma0 = torch.distributions.Gamma(4.0, 40.0).sample((n, 2, size, size)).contiguous()
    sigma0 = sigma0 * (1 + torch.rand(n, 1, 1, 1, generator=g))
    return sigma0, (sigma0[:, 0] < 0.05).long()


def random_flip_crop(g: torch.Generator, *tensors, size: int = 12):
    """The same random crop and flips for images and their masks (kornia-style, on device)."""
    h = tensors[0].shape[-1]
    i, j = (int(v) for v in torch.randint(0, h - size + 1, (2,), generator=g))
    flip = bool(torch.rand(1, generator=g) < 0.5)
    out = []
    for t in tensors:
        t = t[..., i:i + size, j:j + size]
        out.append(t.flip(-1) if flip else t)
    return out
