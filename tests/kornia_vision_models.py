"""Computer vision trained with kornia 0.9.0, written the way its users write it, for
``test_kornia_vision.py``:

- ``HomographyNet``: a small homography regressor (DeTone et al.'s HomographyNet, unsupervised
  as Nguyen et al. train it): it predicts the four corners' offsets of a patch, the loss solves
  the homography with ``kornia.geometry.transform.get_perspective_transform`` and warps the
  patch with ``warp_perspective``, a photometric loss (``ssim_loss`` + L1) against the second
  view;
- ``Denoiser``: a DnCNN-style residual denoiser (last conv zero-initialised, as residual
  restoration nets start from the identity), trained with ``ssim_loss`` and ``psnr_loss``, and
  an edge-aware loss of the user's own (``kornia.filters.spatial_gradient`` magnitudes);
- ``Segmenter``: a small FCN whose first module is a ``K.AugmentationSequential``
  (``RandomAffine``, ``ColorJitter``, ``RandomPerspective``, ``data_keys=['input', 'mask']``,
  run in training only), trained with ``kornia.losses.focal_loss`` + ``dice_loss`` and
  inverse-frequency class weights computed per batch.
"""

from __future__ import annotations

import kornia
import kornia.augmentation as K
import torch
from kornia.geometry.homography import find_homography_dlt
from kornia.geometry.linalg import transform_points
from kornia.geometry.transform import get_perspective_transform, warp_perspective
from torch import nn
from torch.utils.data import Dataset

SIZE, N_CLS = 16, 3


def scene(n: int, g: torch.Generator) -> torch.Tensor:
    """Images in [0, 1] with structure a warp can be regressed from: blobs on a ramp."""
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, SIZE), torch.linspace(-1, 1, SIZE),
                            indexing="ij")
    c = torch.rand(n, 3, 2, generator=g) * 1.4 - 0.7
    col = torch.rand(n, 3, 1, 1, generator=g)
    blobs = torch.exp(-((xx - c[..., :1, None]) ** 2 + (yy - c[..., 1:, None]) ** 2) * 6)
    return (0.15 + 0.7 * col * blobs + 0.1 * (xx + 1) / 2).clamp(0, 1)


# --------------------------------------------------------------------------------------------
# homography regression


class WarpPairs(Dataset):
    """(patch, warped patch, corners): the second view is the first warped by a random
    perturbation of its corners (HomographyNet's generator, ``rho`` pixels at most);
    ``collinear`` samples' corners were annotated on one line (a labelling tool's drag)."""

    def __init__(self, n: int = 32, rho: float = 2.0, collinear=()):
        g = torch.Generator().manual_seed(1)
        self.a = scene(n, g)
        s = float(SIZE - 1)
        base = torch.tensor([[0.0, 0.0], [s, 0.0], [s, s], [0.0, s]])
        self.corners = base.expand(n, 4, 2).clone()
        for i in collinear:
            self.corners[i] = torch.tensor([[0.0, 0.0], [5.0, 5.0], [10.0, 10.0], [s, s]])
        self.offsets = (torch.rand(n, 4, 2, generator=g) * 2 - 1) * rho
        with torch.no_grad():
            h = get_perspective_transform(base.expand(n, 4, 2), base + self.offsets)
            self.b = warp_perspective(self.a, h, (SIZE, SIZE), align_corners=True)

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, i: int):
        return self.a[i], self.b[i], self.corners[i]


class HomographyNet(nn.Module):
    def __init__(self, rho: float = 2.0):
        super().__init__()
        self.rho = rho
        self.features = nn.Sequential(
            nn.Conv2d(6, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(16 * (SIZE // 4) ** 2, 8)

    def forward(self, a, b):
        f = self.features(torch.cat([a, b], 1)).flatten(1)
        return self.rho * torch.tanh(self.head(f)).view(-1, 4, 2)


class PhotometricLoss(nn.Module):
    """Warp the first view by the predicted corners' homography, compare with the second."""

    def forward(self, offsets, a, b, corners):
        h = get_perspective_transform(corners, corners + offsets)
        warped = warp_perspective(a, h, (SIZE, SIZE), align_corners=True)
        return kornia.losses.ssim_loss(warped, b, window_size=5) + (warped - b).abs().mean()


def make_homography() -> HomographyNet:
    torch.manual_seed(0)
    return HomographyNet()


class Matches(Dataset):
    """Keypoint matches of an image pair related by a translation, with descriptors;
    ``repeated`` samples' keypoints are all one point (a detector's fallback on a textureless
    image, repeated to fill the fixed count)."""

    def __init__(self, n: int = 32, k: int = 8, repeated=()):
        g = torch.Generator().manual_seed(4)
        self.p1 = torch.rand(n, k, 2, generator=g) * (SIZE - 1)
        for i in repeated:
            self.p1[i] = self.p1[i, :1]
        self.h = torch.eye(3).repeat(n, 1, 1)
        self.h[:, :2, 2] = torch.rand(n, 2, generator=g)
        self.p2 = transform_points(self.h, self.p1) + 0.05 * torch.randn(n, k, 2, generator=g)
        self.desc = torch.randn(n, k, 16, generator=g)

    def __len__(self) -> int:
        return len(self.p1)

    def __getitem__(self, i: int):
        return self.desc[i], self.p1[i], self.p2[i], self.h[i]


class MatchWeighter(nn.Module):
    """Each match's confidence from its descriptor (a learned outlier rejection, as in
    "Learning to Find Good Correspondences"), the weights of kornia's weighted DLT."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, desc):
        return torch.sigmoid(self.mlp(desc)).squeeze(-1)


class CornerLoss(nn.Module):
    """The mean corner error of the weighted DLT's homography against the true one."""

    def forward(self, weights, p1, p2, h_true):
        h = find_homography_dlt(p1, p2, weights)
        s = float(SIZE - 1)
        grid = p1.new_tensor([[0.0, 0.0], [s, 0.0], [s, s], [0.0, s]]).expand(len(p1), 4, 2)
        return (transform_points(h, grid) - transform_points(h_true, grid)).norm(dim=-1).mean()


def make_weighter() -> MatchWeighter:
    torch.manual_seed(0)
    return MatchWeighter()


# --------------------------------------------------------------------------------------------
# denoising


class NoisyImages(Dataset):
    """(noisy, clean) pairs; ``sigmas`` is the noise level of each sample (a curriculum's
    clean pairs have 0), ``scale`` the images' range (255: uint8 frames left unnormalised)."""

    def __init__(self, n: int = 32, sigmas=None, scale: float = 1.0, blank=()):
        g = torch.Generator().manual_seed(2)
        self.clean = scene(n, g)
        for i in blank:
            self.clean[i] = 0.0
        sig = torch.full((n,), 0.1) if sigmas is None else torch.as_tensor(sigmas).float()
        noise = torch.randn(n, 3, SIZE, SIZE, generator=g) * sig.view(-1, 1, 1, 1)
        self.noisy = (self.clean + noise) * scale
        self.clean = self.clean * scale

    def __len__(self) -> int:
        return len(self.clean)

    def __getitem__(self, i: int):
        return self.noisy[i], self.clean[i]


class Denoiser(nn.Module):
    """DnCNN: conv-BN-ReLU blocks predicting the noise; the last conv starts at zero."""

    def __init__(self, width: int = 16, clamp: float | None = None):
        super().__init__()
        self.clamp = clamp
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 3, 3, padding=1))
        nn.init.zeros_(self.body[-1].weight)
        nn.init.zeros_(self.body[-1].bias)

    def forward(self, x):
        out = x - self.body(x)
        return out.clamp(0, self.clamp) if self.clamp is not None else out


class RestorationLoss(nn.Module):
    """SSIM + PSNR, as kornia's restoration examples combine them."""

    def __init__(self, max_val: float = 1.0):
        super().__init__()
        self.max_val = max_val

    def forward(self, pred, target):
        return (kornia.losses.ssim_loss(pred, target, 5, max_val=self.max_val)
                + 0.01 * kornia.losses.psnr_loss(pred, target, self.max_val))


class EdgeAwareLoss(nn.Module):
    """L1 + the difference of the gradient magnitudes (an edge-preserving term)."""

    def __init__(self, weight: float = 0.5, eps: float = 0.0):
        super().__init__()
        self.weight, self.eps = weight, eps

    def magnitude(self, img):
        g = kornia.filters.spatial_gradient(img, normalized=False)
        return torch.sqrt(g[:, :, 0] ** 2 + g[:, :, 1] ** 2 + self.eps)

    def forward(self, pred, target):
        edges = (self.magnitude(pred) - self.magnitude(target)).abs().mean()
        return (pred - target).abs().mean() + self.weight * edges


def make_denoiser() -> Denoiser:
    torch.manual_seed(0)
    return Denoiser()


def make_clamped_denoiser() -> Denoiser:
    torch.manual_seed(0)
    return Denoiser(clamp=1.0)


# --------------------------------------------------------------------------------------------
# segmentation


class Shapes(Dataset):
    """Images and masks: class 1 a disc, class 2 a square, 0 background; ``no_square`` samples
    hold no square; ``flat_channel``: that channel reads one value in every image (a band the
    sensor did not record, filled with a constant)."""

    def __init__(self, n: int = 32, no_square=None, flat_channel: int | None = None):
        g = torch.Generator().manual_seed(3)
        yy, xx = torch.meshgrid(torch.arange(SIZE), torch.arange(SIZE), indexing="ij")
        self.x = 0.1 + 0.1 * torch.rand(n, 3, SIZE, SIZE, generator=g)
        self.m = torch.zeros(n, SIZE, SIZE, dtype=torch.long)
        no_square = range(n) if no_square == "all" else (no_square or ())
        for i in range(n):
            cx, cy = torch.randint(4, SIZE - 4, (2,), generator=g).tolist()
            disc = (xx - cx) ** 2 + (yy - cy) ** 2 <= 9
            self.m[i][disc] = 1
            if i not in no_square:
                sq = ((xx - (SIZE - 1 - cx)).abs() <= 2) & ((yy - (SIZE - 1 - cy)).abs() <= 2)
                self.m[i][sq & ~disc] = 2
            self.x[i, :, self.m[i] == 1] += torch.tensor([0.7, 0.2, 0.1]).view(3, 1)
            self.x[i, :, self.m[i] == 2] += torch.tensor([0.1, 0.3, 0.7]).view(3, 1)
        if flat_channel is not None:
            self.x[:, flat_channel] = 0.5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.m[i]


def loop_augmentation(data: Shapes) -> K.AugmentationSequential:
    """The Kornia tutorial's pattern: augment image and mask in the loop, then standardise
    with the training set's per-channel statistics."""
    mean, std = data.x.mean((0, 2, 3)), data.x.std((0, 2, 3))
    return K.AugmentationSequential(K.RandomAffine(15.0, p=1.0), K.Normalize(mean, std),
                                    data_keys=["input", "mask"])


class Segmenter(nn.Module):
    def __init__(self, augment: bool = True):
        super().__init__()
        self.aug = K.AugmentationSequential(
            K.RandomAffine(degrees=15.0, translate=(0.1, 0.1), scale=(0.9, 1.1), p=0.8),
            K.ColorJitter(0.2, 0.2, 0.2, 0.05, p=0.5),
            K.RandomPerspective(0.3, p=0.5),
            data_keys=["input", "mask"])
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, N_CLS, 1))

        self.augment = augment

    def forward(self, x, mask):
        if self.training and self.augment:
            x, m = self.aug(x, mask[:, None].float())
            mask = m[:, 0].round().long()
        return self.net(x), mask


def class_weights(mask: torch.Tensor) -> torch.Tensor:
    """Inverse-frequency class weights of the batch, normalised to sum to the class count."""
    counts = torch.bincount(mask.flatten(), minlength=N_CLS).float()
    w = counts.sum() / counts
    return w * N_CLS / w.sum()


class SegLoss(nn.Module):
    """kornia's focal loss with the batch's class weights, plus its dice loss."""

    def forward(self, logits, mask, weight):
        focal = kornia.losses.focal_loss(logits, mask, alpha=None, gamma=2.0,
                                         reduction="mean", weight=weight)
        return focal + kornia.losses.dice_loss(logits, mask)


def make_segmenter() -> Segmenter:
    torch.manual_seed(0)
    return Segmenter()


def make_plain_segmenter() -> Segmenter:
    torch.manual_seed(0)
    return Segmenter(augment=False)
