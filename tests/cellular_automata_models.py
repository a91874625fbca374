"""Neural cellular automata written as the Growing NCA (Mordvintsev et al., Distill 2020) and
the Self-Organising Textures notebooks write them, for ``test_cellular_automata``.

- ``GrowingCA``: per-cell perception by fixed identity/Sobel depthwise filters (a buffer),
  a 1x1-conv update rule whose last layer starts at zero, a stochastic update mask
  (``torch.rand(...) <= fire_rate`` per cell), alive masking by a 3x3 max-pool of the alpha
  channel, the number of CA steps given to ``forward``. Trained from a sample pool (the worst
  sample replaced by the seed, damage cut into the best ones) with the per-parameter gradient
  normalisation ``g / (g.norm() + 1e-8)`` before Adam.
- ``TextureCA``: the texture NCA (identity, Sobel and Laplacian filters, no alive mask) and
  ``GramLoss``: the style loss of Gram matrices of frozen VGG-like features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SOBEL = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]) / 8
IDENTITY = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
LAPLACIAN = torch.tensor([[1.0, 2.0, 1.0], [2.0, -12.0, 2.0], [1.0, 2.0, 1.0]]) / 16


class GrowingCA(nn.Module):
    """The Growing NCA: 16 channels (RGBA + 12 hidden), 3 filters, a 64-wide hidden layer."""

    def __init__(self, channels: int = 16, hidden: int = 64, fire_rate: float = 0.5,
                 zero_init: bool = True, alive_mask: bool = True,
                 filters: tuple[torch.Tensor, ...] = (IDENTITY, SOBEL, SOBEL.T),
                 mask_seed: int | None = None):
        super().__init__()
        # the update masks from a generator of the model's own (reproducible CA rollouts)
        self.gen = torch.Generator().manual_seed(mask_seed) if mask_seed is not None else None
        self.channels, self.fire_rate, self.alive_mask = channels, fire_rate, alive_mask
        kernels = torch.stack(filters)[:, None]  # (filters, 1, 3, 3)
        self.register_buffer("kernels", kernels.repeat(channels, 1, 1, 1))
        self.w1 = nn.Conv2d(channels * len(filters), hidden, 1)
        self.w2 = nn.Conv2d(hidden, channels, 1, bias=False)
        if zero_init:  # "do nothing" initial behaviour, as the paper's code
            nn.init.zeros_(self.w2.weight)

    def perceive(self, x):
        x = F.pad(x, (1, 1, 1, 1), mode="circular")
        return F.conv2d(x, self.kernels, groups=self.channels)

    def alive(self, x):
        return F.max_pool2d(x[:, 3:4], kernel_size=3, stride=1, padding=1) > 0.1

    def update(self, x):
        pre_life = self.alive(x)
        dx = self.w2(torch.relu(self.w1(self.perceive(x))))
        fire = torch.rand(x.shape[0], 1, *x.shape[2:], generator=self.gen) <= self.fire_rate
        x = x + dx * fire.to(x.dtype)
        if self.alive_mask:
            life = pre_life & self.alive(x)
            x = x * life.to(x.dtype)
        return x

    def forward(self, x, steps: int):
        for _ in range(steps):
            x = self.update(x)
        return x


def make_growing() -> GrowingCA:
    torch.manual_seed(0)
    return GrowingCA()


def make_growing_seeded() -> GrowingCA:
    torch.manual_seed(0)
    return GrowingCA(mask_seed=42)


def make_growing_unmasked() -> GrowingCA:
    """No alive masking and the default (not zero) init of the last layer: the state of every
    cell is updated from the first step on."""
    torch.manual_seed(0)
    return GrowingCA(zero_init=False, alive_mask=False, fire_rate=1.0)


def seed_state(n: int, size: int = 16, channels: int = 16) -> torch.Tensor:
    """One live cell in the centre: alpha and hidden channels 1, RGB 0."""
    x = torch.zeros(n, channels, size, size)
    x[:, 3:, size // 2, size // 2] = 1.0
    return x


def target_image(size: int = 16) -> torch.Tensor:
    """A premultiplied RGBA disc (the emoji of the paper, small)."""
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    r = ((yy - size / 2 + 0.5) ** 2 + (xx - size / 2 + 0.5) ** 2).sqrt()
    alpha = (r < size / 3).float()
    rgb = torch.stack([alpha * 0.9, alpha * 0.5 * (yy / size), alpha * 0.2])
    return torch.cat([rgb, alpha[None]])[None]


def per_sample_loss(x, target):
    return (x[:, :4] - target).pow(2).mean(dim=(1, 2, 3))


class PixelLoss(nn.Module):
    """The Growing NCA loss: MSE of the RGBA channels against the target."""

    def forward(self, x, target):
        return per_sample_loss(x, target).mean()


class AliveLoss(nn.Module):
    """MSE over the living cells only, each sample normalised by its own count of them."""

    def forward(self, x, target, alive):
        err = (x[:, :4] - target).pow(2).sum(1, keepdim=True) * alive
        per_sample = err.sum(dim=(1, 2, 3)) / alive.sum(dim=(1, 2, 3))  # the bug: 0 cells alive
        return per_sample.mean()


def damage_mask(n: int, size: int, g: torch.Generator, central: bool = False) -> torch.Tensor:
    """Circles of radius 0.1-0.4 of the grid cut out of each sample (the paper's damage);
    ``central``: centred on the seed's cell, where a young pattern lives."""
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size),
                            indexing="ij")
    centre = torch.rand(n, 2, 1, 1, generator=g) - 0.5
    if central:
        centre = torch.full((n, 2, 1, 1), 1 / (size - 1))
    r = torch.rand(n, 1, 1, generator=g) * 0.3 + 0.1
    inside = (xx - centre[:, 0]) ** 2 + (yy - centre[:, 1]) ** 2 < r ** 2
    return (~inside).float()[:, None]


# ---------------------------------------------------------------------------------------------
# texture NCA and the Gram loss


class TextureCA(GrowingCA):
    """Self-Organising Textures: 12 channels, identity/Sobel/Laplacian filters, no alive mask."""

    def __init__(self, channels: int = 12, hidden: int = 48):
        super().__init__(channels, hidden, fire_rate=0.5, alive_mask=False,
                         filters=(IDENTITY, SOBEL, SOBEL.T, LAPLACIAN))

    def forward(self, x, steps: int):
        x = super().forward(x, steps)
        return x[:, :3] + 0.5  # RGB in [0, 1] around 0.5


def make_texture() -> TextureCA:
    torch.manual_seed(0)
    return TextureCA()


class VGGish(nn.Module):
    """A frozen VGG-like feature stack (two conv-ReLU blocks with a pool between)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1)
        for conv in (self.conv1, self.conv2):
            conv.weight.data = torch.randn(conv.weight.shape, generator=g) * 0.3
            conv.bias.data = torch.randn(conv.bias.shape, generator=g) * 0.1 - 0.2
        self.requires_grad_(False)

    def forward(self, x):
        f1 = torch.relu(self.conv1(x))
        f2 = torch.relu(self.conv2(F.avg_pool2d(f1, 2)))
        return [f1, f2]


CAFFE_MEAN = torch.tensor([103.939, 116.779, 123.68])[None, :, None, None]


def gram(f, normalise: bool):
    b, c, h, w = f.shape
    f = f.reshape(b, c, h * w)
    g = torch.einsum("bci,bdi->bcd", f, f) / (h * w)
    if normalise:  # scale-invariant style: the Gram over its trace
        g = g / g.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None]  # the bug: a dead map
    return g


class GramLoss(nn.Module):
    """The style loss of Gatys et al. against the target texture's Gram matrices."""

    def __init__(self, target: torch.Tensor, normalise: bool = False, caffe: bool = False):
        super().__init__()
        self.vgg, self.normalise, self.caffe = VGGish(), normalise, caffe
        with torch.no_grad():
            grams = [gram(f, normalise) for f in self.vgg(self.preprocess(target))]
        for i, g in enumerate(grams):
            self.register_buffer(f"target{i}", g)

    def preprocess(self, rgb):
        if self.caffe:  # Caffe's VGG weights (Gatys et al.'s code): 0-255, mean subtracted
            return rgb * 255 - CAFFE_MEAN.to(rgb.device)
        return rgb

    def forward(self, rgb):
        feats = self.vgg(self.preprocess(rgb))
        loss = 0.0
        for i, f in enumerate(feats):
            loss = loss + (gram(f, self.normalise) - getattr(self, f"target{i}")).pow(2).sum()
        return loss / rgb.shape[0]


def stripes(size: int = 16) -> torch.Tensor:
    """The target texture: diagonal colour stripes."""
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    s = torch.sin((xx + yy).float() * 0.8)
    return torch.stack([0.5 + 0.4 * s, 0.5 - 0.3 * s, 0.5 + 0.1 * s])[None]
