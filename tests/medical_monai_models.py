"""Medical image segmentation with MONAI as its users write it, for ``test_medical_monai``: MONAI's
tiny 3-D ``UNet`` on 16^3 CT-like volumes (and MR-like ones in raw scanner units), dict samples
``{"image", "label"}`` through MONAI's transforms, ``CacheDataset`` and ``DataLoader``, MONAI's
losses (``DiceCELoss``, ``GeneralizedDiceLoss``), and a compound loss of the user's around
MONAI's ``DiceLoss`` and softmax ``FocalLoss`` (the unified focal recipe, gamma = 0.5)."""

from __future__ import annotations

import torch
from monai.data import CacheDataset
from monai.losses import DiceCELoss, DiceLoss, FocalLoss, GeneralizedDiceLoss
from monai.networks import one_hot
from monai.networks.nets import UNet
from monai.transforms import Compose, EnsureTyped, ScaleIntensityRanged
from torch import nn
from torch.nn import functional as F

S = 16            # volume side (16^3 voxels)
CLASSES = 3       # background, organ, lesion
# the line of MONAI 1.6.1's GeneralizedDiceLoss.forward that divides numer by denom
GDL_DIVISION_LINE = 472
HU_MIN, HU_MAX = -175.0, 250.0   # the abdominal soft-tissue window, mapped to [0, 1]


def make_unet():
    torch.manual_seed(0)
    return UNet(spatial_dims=3, in_channels=1, out_channels=CLASSES, channels=(4, 8, 16),
                strides=(2, 2), num_res_units=1)


def ct_volume(g, lesion=True):
    """One CT-like case in Hounsfield units: air at -1000 around a soft-tissue body (~40 HU)
    holding an organ (~80 HU) and, when ``lesion``, a hyperdense lesion (~200 HU); the label map
    (0 background, 1 organ, 2 lesion) matches."""
    img = torch.full((1, S, S, S), -1000.0)
    lab = torch.zeros((1, S, S, S))
    c = torch.randint(6, 10, (3,), generator=g)
    img[:, 3:13, 3:13, 3:13] = 40.0
    x0, y0, z0 = (int(v) for v in c)
    img[:, x0 - 3:x0 + 3, y0 - 3:y0 + 3, z0 - 3:z0 + 3] = 80.0
    lab[:, x0 - 3:x0 + 3, y0 - 3:y0 + 3, z0 - 3:z0 + 3] = 1.0
    if lesion:
        img[:, x0 - 1:x0 + 1, y0 - 1:y0 + 1, z0 - 1:z0 + 1] = 200.0
        lab[:, x0 - 1:x0 + 1, y0 - 1:y0 + 1, z0 - 1:z0 + 1] = 2.0
    img += 10.0 * torch.randn(img.shape, generator=g)
    return img, lab


def cases(n, nan_at=(), empty_at=(), no_lesion_at=(), seed=1):
    """``n`` dict samples: cases ``nan_at`` hold a NaN voxel (outside the scanner's field of view
    after resampling), cases ``empty_at`` a label map of background only (a scan with nothing
    annotated: no organ, no lesion)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        img, lab = ct_volume(g, lesion=i not in no_lesion_at)
        if i in nan_at:
            img[0, 0, 0, :4] = float("nan")
        if i in empty_at:
            lab.zero_()
        out.append({"image": img, "label": lab})
    return out


def transforms(normalise=True, track_meta=False):
    """The intensity window (HU -> [0, 1], clipped) that every CT pipeline starts with; with
    ``track_meta`` the samples are MONAI's ``MetaTensor`` (its default), else plain tensors."""
    ts = [EnsureTyped(keys=["image", "label"], track_meta=track_meta)]
    if normalise:
        ts.insert(0, ScaleIntensityRanged(keys="image", a_min=HU_MIN, a_max=HU_MAX, b_min=0.0,
                                          b_max=1.0, clip=True))
    return Compose(ts)


def dataset(data, normalise=True, track_meta=False):
    return CacheDataset(data, transform=transforms(normalise, track_meta), cache_rate=1.0, num_workers=0,
                        progress=False)


def dice_ce():
    return DiceCELoss(to_onehot_y=True, softmax=True)


def gdl_no_smoothing():
    """Generalized Dice over the foreground classes, smoothing off ("exact" Dice)."""
    return GeneralizedDiceLoss(include_background=False, to_onehot_y=True, softmax=True,
                               smooth_nr=0.0, smooth_dr=0.0)


class DiceFocal(nn.Module):
    """The unified focal recipe: Dice plus MONAI's softmax focal loss with the focusing parameter
    gamma = 0.5 that the unified focal loss paper recommends (``(1 - p_t) ** 0.5``: its
    derivative is infinite where a voxel's p_t rounds to 1)."""

    def __init__(self, gamma=0.5, lambda_focal=1.0):
        super().__init__()
        self.dice = DiceLoss(to_onehot_y=True, softmax=True)
        self.focal = FocalLoss(to_onehot_y=True, use_softmax=True, gamma=gamma)
        self.lambda_focal = lambda_focal

    def forward(self, logits, label):
        return self.dice(logits, label) + self.lambda_focal * self.focal(logits, label)


def mr_cases(n, other_site_at=(), site_scale=40.0, seed=2):
    """``n`` MR-like cases in the scanner's raw units (a few hundred): the cases
    ``other_site_at`` come from a site whose scanner writes ``site_scale`` times larger values
    (up to ~3e4), the multi-site spread a ``NormalizeIntensityd`` would remove."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        img, lab = ct_volume(g)
        img = (img + 1000.0) * 0.6
        if i in other_site_at:
            img = img * site_scale
        out.append({"image": img, "label": lab})
    return out


class BatchWeightedCE(nn.Module):
    """Cross entropy weighted by the inverse volume of each class in the batch, normalised to
    sum to 1 (dynamic class balancing for small lesions)."""

    def forward(self, logits, label):
        onehot = one_hot(label, CLASSES)
        volume = onehot.sum(dim=(0, 2, 3, 4))
        w = 1.0 / volume
        w = w / w.sum()  # inf / inf where a class is absent from the whole batch
        return F.cross_entropy(logits, label[:, 0].long(), weight=w)
