"""Image restoration and anomaly detection models of ``tests/test_image_restoration.py``, written
as those repos write them: a denoiser with NAFNet's zero-initialised residual scales (``beta``,
``gamma``: every block, and so the net, is the identity at initialisation) and a global skip;
an SR net with EDSR's residual scaling and a conv + ``PixelShuffle`` upsampler; BasicSR's
``CharbonnierLoss`` and ``PSNRLoss``; pytorch-msssim's ``ssim`` (a separable Gaussian window,
``C1 = (K1 L)^2``, ``C2 = (K2 L)^2``); a gradient-magnitude (Sobel) edge loss; Deep SVDD (Ruff
et al.'s ``deep-SVDD-pytorch``: a bias-free LeNet-type encoder, a fixed centre ``c`` set from
an initial forward pass, the one-class and soft-boundary objectives) and FCDD's hypersphere
classifier loss (liznerski/fcdd) on the pseudo-Huber distance. The factories live at module
level so that ``nanreplay`` rebuilds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# restoration networks


class SimpleGate(nn.Module):
    def forward(self, x):
        x1, x2 = x.chunk(2, dim=1)
        return x1 * x2


class NAFBlock(nn.Module):
    """NAFNet's block (megvii-research/NAFNet): conv - SimpleGate - simplified channel attention,
    then a feed-forward SimpleGate; both residuals scaled by ``beta`` / ``gamma``, zeros at
    initialisation, so that the block starts as the identity."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, 2 * c, 1)
        self.conv2 = nn.Conv2d(2 * c, 2 * c, 3, 1, 1, groups=2 * c)
        self.sg = SimpleGate()
        self.sca = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c, 1))
        self.conv3 = nn.Conv2d(c, c, 1)
        self.conv4 = nn.Conv2d(c, 2 * c, 1)
        self.conv5 = nn.Conv2d(c, c, 1)
        self.beta = nn.Parameter(torch.zeros((1, c, 1, 1)))
        self.gamma = nn.Parameter(torch.zeros((1, c, 1, 1)))

    def forward(self, inp):
        x = self.sg(self.conv2(self.conv1(inp)))
        x = self.conv3(x * self.sca(x))
        y = inp + x * self.beta
        x = self.conv5(self.sg(self.conv4(y)))
        return y + x * self.gamma


class TinyNAFNet(nn.Module):
    """NAFNet's plain (no U-Net) variant: intro conv, blocks, ending conv, global skip
    ``x + inp``; the ending conv zero-initialised (as restoration repos do to start from the
    identity), so an untrained net returns its input exactly."""

    def __init__(self, c: int = 8, blocks: int = 2):
        super().__init__()
        self.intro = nn.Conv2d(3, c, 3, 1, 1)
        self.body = nn.Sequential(*[NAFBlock(c) for _ in range(blocks)])
        self.ending = nn.Conv2d(c, 3, 3, 1, 1)
        nn.init.zeros_(self.ending.weight)
        nn.init.zeros_(self.ending.bias)

    def forward(self, inp):
        return self.ending(self.body(self.intro(inp))) + inp


def make_nafnet() -> nn.Module:
    torch.manual_seed(0)
    return TinyNAFNet()


class ResBlock(nn.Module):
    """EDSR's residual block: conv - ReLU - conv, scaled by ``res_scale``."""

    def __init__(self, c: int, res_scale: float = 0.1):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1), nn.ReLU(True), nn.Conv2d(c, c, 3, 1, 1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class SRNet(nn.Module):
    """EDSR-like: head conv, scaled residual blocks, a global skip, a conv + ``PixelShuffle``
    upsampler; the output clamped to the image range ``[0, rgb_range]`` (as RCAN-style ports
    do in ``forward``)."""

    def __init__(self, c: int = 8, blocks: int = 2, scale: int = 2, rgb_range: float = 1.0):
        super().__init__()
        self.rgb_range = rgb_range  # (EDSR's --rgb_range: 255 for 8-bit values as they are)
        self.head = nn.Conv2d(3, c, 3, 1, 1)
        self.body = nn.Sequential(*[ResBlock(c) for _ in range(blocks)])
        self.up = nn.Sequential(nn.Conv2d(c, 3 * scale * scale, 3, 1, 1), nn.PixelShuffle(scale))
        self.scale = scale

    def forward(self, lr):
        x = self.head(lr)
        x = x + self.body(x)
        base = F.interpolate(lr, scale_factor=self.scale, mode="nearest")
        return (self.up(x) + base).clamp(0, self.rgb_range)


def make_srnet(rgb_range: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    return SRNet(rgb_range=rgb_range)


# ---------------------------------------------------------------------------------------------
# restoration losses


class CharbonnierLoss(nn.Module):
    """BasicSR's ``CharbonnierLoss`` (``basicsr/losses/basic_loss.py``): ``sqrt(d^2 + eps)``
    averaged, ``eps`` from the option file."""

    def __init__(self, loss_weight: float = 1.0, eps: float = 1e-12):
        super().__init__()
        self.loss_weight, self.eps = loss_weight, eps

    def forward(self, pred, target):
        return self.loss_weight * torch.sqrt((pred - target) ** 2 + self.eps).mean()


class PSNRLoss(nn.Module):
    """BasicSR / NAFNet's ``PSNRLoss``: ``scale * log(mse + 1e-8)``, ``scale = 10 / ln 10``;
    ``eps`` is the ``1e-8`` (here an argument: a port that writes ``-10 * log10(mse)``)."""

    def __init__(self, loss_weight: float = 1.0, eps: float = 1e-8):
        super().__init__()
        self.loss_weight, self.eps = loss_weight, eps
        self.scale = 10 / torch.log(torch.tensor(10.0)).item()

    def forward(self, pred, target):
        mse = ((pred - target) ** 2).mean(dim=(1, 2, 3))
        return self.loss_weight * self.scale * torch.log(mse + self.eps).mean()


def _fspecial_gauss_1d(size: int, sigma: float) -> torch.Tensor:
    """pytorch-msssim's 1-D Gaussian window."""
    coords = torch.arange(size, dtype=torch.float) - size // 2
    g = torch.exp(-(coords ** 2) / (2 * sigma ** 2))
    return (g / g.sum()).view(1, 1, 1, -1)


def _gaussian_filter(x: torch.Tensor, win: torch.Tensor) -> torch.Tensor:
    """pytorch-msssim's ``gaussian_filter``: the 1-D window along H then W, per channel,
    valid padding."""
    c = x.shape[1]
    out = F.conv2d(x, win.transpose(2, 3).repeat(c, 1, 1, 1), groups=c)
    return F.conv2d(out, win.repeat(c, 1, 1, 1), groups=c)


def ssim(x, y, data_range: float = 1.0, win_size: int = 5, sigma: float = 1.5,
         k=(0.01, 0.03)):
    """pytorch-msssim's ``_ssim`` averaged per image: ``C1 = (K1 L)^2``, ``C2 = (K2 L)^2``."""
    win = _fspecial_gauss_1d(win_size, sigma).to(x)
    c1, c2 = (k[0] * data_range) ** 2, (k[1] * data_range) ** 2
    mu1, mu2 = _gaussian_filter(x, win), _gaussian_filter(y, win)
    mu1_sq, mu2_sq, mu1_mu2 = mu1.pow(2), mu2.pow(2), mu1 * mu2
    sigma1_sq = _gaussian_filter(x * x, win) - mu1_sq
    sigma2_sq = _gaussian_filter(y * y, win) - mu2_sq
    sigma12 = _gaussian_filter(x * y, win) - mu1_mu2
    cs_map = (2 * sigma12 + c2) / (sigma1_sq + sigma2_sq + c2)
    ssim_map = ((2 * mu1_mu2 + c1) / (mu1_sq + mu2_sq + c1)) * cs_map
    return ssim_map.flatten(1).mean(-1)


def _ssim_cs(x, y, win, c1: float, c2: float):
    """pytorch-msssim's ``_ssim``: the per-channel SSIM and contrast-structure means."""
    mu1, mu2 = _gaussian_filter(x, win), _gaussian_filter(y, win)
    mu1_sq, mu2_sq, mu1_mu2 = mu1.pow(2), mu2.pow(2), mu1 * mu2
    sigma1_sq = _gaussian_filter(x * x, win) - mu1_sq
    sigma2_sq = _gaussian_filter(y * y, win) - mu2_sq
    sigma12 = _gaussian_filter(x * y, win) - mu1_mu2
    cs_map = (2 * sigma12 + c2) / (sigma1_sq + sigma2_sq + c2)
    ssim_map = ((2 * mu1_mu2 + c1) / (mu1_sq + mu2_sq + c1)) * cs_map
    return ssim_map.flatten(2).mean(-1), cs_map.flatten(2).mean(-1)


def ms_ssim(x, y, data_range: float = 1.0, weights=(0.0448, 0.2856, 0.3001), win_size: int = 5,
            k=(0.01, 0.03)):
    """pytorch-msssim's ``ms_ssim`` before 0.2.1's ``relu``: the contrast-structure terms of
    the finer scales and the coarsest SSIM, per channel, raised to the scales' weights."""
    win = _fspecial_gauss_1d(win_size, 1.5).to(x)
    c1, c2 = (k[0] * data_range) ** 2, (k[1] * data_range) ** 2
    w = torch.tensor(weights, dtype=x.dtype, device=x.device)
    mcs = []
    for i in range(len(weights)):
        ssim_per_channel, cs = _ssim_cs(x, y, win, c1, c2)
        if i < len(weights) - 1:
            mcs.append(cs)
            x, y = F.avg_pool2d(x, 2), F.avg_pool2d(y, 2)
    vals = torch.stack(mcs + [ssim_per_channel], dim=0)  # (levels, B, C)
    return torch.prod(vals ** w.view(-1, 1, 1), dim=0).mean(1)


class MSSSIMLoss(nn.Module):
    """``1 - MS-SSIM`` plus ``alpha`` L1 (Zhao et al.'s mix), ``data_range`` as given."""

    def __init__(self, alpha: float = 0.16, data_range: float = 1.0):
        super().__init__()
        self.alpha, self.data_range = alpha, data_range

    def forward(self, pred, target):
        s = ms_ssim(pred, target, data_range=self.data_range)
        return (1 - s).mean() + self.alpha * F.l1_loss(pred, target)


class SSIMLoss(nn.Module):
    """``1 - SSIM`` plus ``alpha`` L1 (the mix of Zhao et al., "Loss Functions for Image
    Restoration"); ``k`` are SSIM's ``(K1, K2)``."""

    def __init__(self, alpha: float = 0.16, data_range: float = 1.0, k=(0.01, 0.03)):
        super().__init__()
        self.alpha, self.data_range, self.k = alpha, data_range, tuple(k)

    def forward(self, pred, target):
        s = ssim(pred, target, data_range=self.data_range, k=self.k)
        return (1 - s).mean() + self.alpha * F.l1_loss(pred, target)


class EdgeLoss(nn.Module):
    """L1 plus the L1 of the gradient magnitudes ``sqrt(gx^2 + gy^2)`` (Sobel) of prediction and
    target, as the gradient-profile losses of SR repos write it."""

    def __init__(self, weight: float = 0.1, eps: float = 0.0):
        super().__init__()
        self.weight, self.eps = weight, eps
        kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
        self.register_buffer("kernel", torch.stack([kx, kx.T])[:, None])

    def magnitude(self, img):
        g = F.conv2d(img.mean(1, keepdim=True), self.kernel, padding=1)
        return torch.sqrt(g[:, 0] ** 2 + g[:, 1] ** 2 + self.eps)

    def forward(self, pred, target):
        edge = F.l1_loss(self.magnitude(pred), self.magnitude(target))
        return F.l1_loss(pred, target) + self.weight * edge


# ---------------------------------------------------------------------------------------------
# anomaly detection


class LeNetEncoder(nn.Module):
    """deep-SVDD-pytorch's ``MNIST_LeNet``: bias-free convs and linear layer (the bias terms
    let the network map everything to ``c``), BatchNorm without affine parameters."""

    def __init__(self, rep_dim: int = 8):
        super().__init__()
        self.rep_dim = rep_dim
        self.conv1 = nn.Conv2d(1, 4, 5, bias=False, padding=2)
        self.bn1 = nn.BatchNorm2d(4, eps=1e-04, affine=False)
        self.conv2 = nn.Conv2d(4, 8, 5, bias=False, padding=2)
        self.bn2 = nn.BatchNorm2d(8, eps=1e-04, affine=False)
        self.fc1 = nn.Linear(8 * 4 * 4, rep_dim, bias=False)

    def forward(self, x):
        x = F.max_pool2d(F.leaky_relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.leaky_relu(self.bn2(self.conv2(x))), 2)
        return self.fc1(x.flatten(1))


def make_lenet() -> nn.Module:
    torch.manual_seed(0)
    return LeNetEncoder()


class FCDDNet(nn.Module):
    """FCDD's fully convolutional net (``FCDD_CNN28`` without its BatchNorms): bias-free convs
    and LeakyReLU, a 1x1 bias-free head; its output ``A`` is the per-pixel difference to the
    centre, which the head's weights absorb (``c = 0``)."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, 1, 1, bias=False), nn.LeakyReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.LeakyReLU())
        self.conv_final = nn.Conv2d(c, 1, 1, bias=False)

    def forward(self, x):
        return self.conv_final(self.features(x))


def make_fcdd() -> nn.Module:
    torch.manual_seed(0)
    return FCDDNet()


class PatchStandardize(nn.Module):
    """Per-patch contrast normalisation (zero mean, unit variance over each patch's pixels),
    as patch-based anomaly detectors standardise their crops; written without an eps."""

    def forward(self, p):
        mean = p.mean(dim=(1, 2, 3), keepdim=True)
        std = p.std(dim=(1, 2, 3), keepdim=True)
        return (p - mean) / std


class PatchSVDD(nn.Module):
    """Patch SVDD-like (Yi & Yoon, ACCV 2020): the image cut into non-overlapping ``p x p``
    patches (``unfold``), every patch through a bias-free encoder, the features returned per
    image and patch, ``(B, patches, rep_dim)``, for a Deep SVDD loss on every patch."""

    def __init__(self, p: int = 8, rep_dim: int = 8):
        super().__init__()
        self.p = p
        self.norm = PatchStandardize()
        self.enc = nn.Sequential(nn.Conv2d(1, 4, 3, 1, 1, bias=False), nn.LeakyReLU(),
                                 nn.MaxPool2d(2), nn.Flatten(),
                                 nn.Linear(4 * (p // 2) ** 2, rep_dim, bias=False))

    def forward(self, x):
        b, c, p = x.shape[0], x.shape[1], self.p
        patches = x.unfold(2, p, p).unfold(3, p, p)  # (B, C, nh, nw, p, p)
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, c, p, p)
        z = self.enc(self.norm(patches))
        return z.view(b, -1, z.shape[-1])


def make_patch_svdd() -> nn.Module:
    torch.manual_seed(0)
    return PatchSVDD()


class SVDDNet(nn.Module):
    """A Deep SVDD port that keeps the centre in the network (a buffer ``c``, set by the loop
    from an initial pass) and returns each sample's squared distance to it."""

    def __init__(self, rep_dim: int = 8):
        super().__init__()
        self.encoder = LeNetEncoder(rep_dim)
        self.register_buffer("c", torch.zeros(rep_dim))

    def forward(self, x):
        return torch.sum((self.encoder(x) - self.c) ** 2, dim=1)


def make_svdd_net() -> nn.Module:
    torch.manual_seed(0)
    return SVDDNet()


def init_center_c(net: nn.Module, batches, eps: float = 0.1) -> torch.Tensor:
    """deep-SVDD-pytorch's ``init_center_c``: the mean of the initial outputs, its entries too
    close to 0 pushed to ``+-eps`` (a unit at exactly 0 maps trivially to it)."""
    n, c = 0, torch.zeros(net.rep_dim)
    with torch.no_grad():
        for x in batches:
            z = net(x)
            n += z.shape[0]
            c += z.sum(0)
    c /= n
    c[(abs(c) < eps) & (c < 0)] = -eps
    c[(abs(c) < eps) & (c > 0)] = eps
    return c


class DeepSVDDLoss(nn.Module):
    """Deep SVDD's objectives on ``dist = ||z - c||^2``: one-class (the mean distance) or
    soft-boundary (``R^2 + 1/nu * mean(max(0, dist - R^2))``, ``R`` updated by the loop from
    the ``1 - nu`` quantile of the distances). ``c`` and ``R`` are buffers of the loss."""

    def __init__(self, c: torch.Tensor, nu: float = 0.1, objective: str = "one-class"):
        super().__init__()
        self.register_buffer("c", c.clone())
        self.register_buffer("R", torch.tensor(0.0))
        self.nu, self.objective = nu, objective

    def forward(self, z):
        dist = torch.sum((z - self.c) ** 2, dim=-1)
        if self.objective == "soft-boundary":
            scores = dist - self.R ** 2
            return self.R ** 2 + (1 / self.nu) * torch.mean(torch.clamp(scores, min=0))
        return torch.mean(dist)


class FCDDHSCLoss(nn.Module):
    """FCDD's own ``hsc`` loss (``fcdd/models/bases.py``): the pseudo-Huber map averaged per
    image, then the normal images' scores and the anomalies' ``-log(1 - exp(-score) + eps)``
    written back by boolean index into the per-image loss; ``eps`` is FCDD's ``1e-31``."""

    def __init__(self, eps: float = 1e-31):
        super().__init__()
        self.eps = eps

    def forward(self, a, labels):
        loss = (a ** 2 + 1).sqrt() - 1
        loss = loss.reshape(len(loss), -1).mean(-1)
        norm = loss[labels == 0]
        anom = -(((1 - (-loss[labels == 1]).exp()) + self.eps).log())
        loss = loss.clone()
        loss[labels == 0] = norm
        loss[labels == 1] = anom
        return loss.mean()


# ---------------------------------------------------------------------------------------------
# data


def clean_patches(n: int = 8, size: int = 16, seed: int = 0) -> torch.Tensor:
    """Smooth RGB patches in ``[0.1, 0.9]`` (a low-frequency field plus texture)."""
    g = torch.Generator().manual_seed(seed)
    low = F.interpolate(torch.rand(n, 3, 4, 4, generator=g), size=size, mode="bilinear",
                        align_corners=False)
    tex = 0.1 * torch.rand(n, 3, size, size, generator=g)
    return 0.1 + 0.7 * low + tex


def noisy_pairs(n: int = 8, size: int = 16, seed: int = 0, sigmas=None):
    """Blind Gaussian denoising pairs (DnCNN-B / FFDNet): each patch's noise level drawn from
    ``sigmas`` (in 8-bit levels), the noisy patch kept in ``[0, 1]``."""
    g = torch.Generator().manual_seed(seed + 1)
    clean = clean_patches(n, size, seed)
    if sigmas is None:
        sigmas = torch.randint(5, 50, (n,), generator=g).tolist()
    sig = torch.tensor(sigmas, dtype=torch.float).view(-1, 1, 1, 1) / 255
    noisy = (clean + sig * torch.randn(clean.shape, generator=g)).clamp(0, 1)
    return noisy, clean


class PatchPairs(torch.utils.data.Dataset):
    """A paired patch dataset as BasicSR's ``PairedImageDataset`` serves it (after cropping)."""

    def __init__(self, lq: torch.Tensor, gt: torch.Tensor):
        self.lq, self.gt = lq, gt

    def __len__(self):
        return len(self.lq)

    def __getitem__(self, i):
        return {"lq": self.lq[i], "gt": self.gt[i]}


def digits(n: int = 16, seed: int = 0) -> torch.Tensor:
    """MNIST-like 16x16 strokes of one class (the normal class)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, 1, 16, 16)
    for i in range(n):
        r = int(torch.randint(3, 12, (1,), generator=g))
        x[i, 0, r:r + 2, 3:13] = 1.0
        x[i, 0, 3:13, r:r + 2] = 1.0
    return x + 0.05 * torch.rand(x.shape, generator=g)
