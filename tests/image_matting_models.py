"""Image matting models of ``tests/test_image_matting.py``, written as matting repos write them
(Deep Image Matting, GCA-Matting, MatteFormer, FBA): an encoder-decoder fed the image and the
trimap as extra input channels (one-hot background / unknown / foreground), a small
self-attention over the decoder's bottleneck (GCA's guided contextual attention, simplified),
alpha from a sigmoid fused with the trimap (``alpha * unknown + foreground``: the known pixels
take the trimap's values exactly), an optional foreground head estimating ``F`` from the
compositing equation ``I = alpha F + (1 - alpha) B``; the losses averaged over the trimap's
unknown region only: Charbonnier alpha loss ``sqrt(d^2 + eps^2)``, composition loss
re-compositing ``fg * alpha + bg * (1 - alpha)``, a Sobel gradient loss and a Laplacian-pyramid
loss. Composited training crops (``fg``, ``bg``, ``alpha``) from a ``Dataset``. The factories
live at module level so that ``nanreplay`` rebuilds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# data


def trimap_onehot(trimap: torch.Tensor) -> torch.Tensor:
    """``(B, 1, H, W)`` trimap (0 background, 0.5 unknown, 1 foreground) as GCA's three
    one-hot channels ``(B, 3, H, W)``: background, unknown, foreground."""
    return torch.cat([(trimap == 0), (trimap == 0.5), (trimap == 1)], 1).to(trimap.dtype)


def composited_crops(n: int = 8, size: int = 8, seed: int = 0):
    """``n`` composited crops: a foreground and a background picture, a soft alpha (a blurred
    disc, hair-like values in ``(0, 1)`` everywhere: crops centred on the unknown band, as
    Deep Image Matting crops them), the composite ``I = alpha F + (1 - alpha) B`` and a trimap
    that is all unknown. Returns a dict of tensors."""
    g = torch.Generator().manual_seed(seed)
    fg = torch.rand(n, 3, size, size, generator=g)
    bg = torch.rand(n, 3, size, size, generator=g)
    alpha = 0.05 + 0.9 * torch.rand(n, 1, size, size, generator=g)
    alpha = F.avg_pool2d(F.pad(alpha, (1, 1, 1, 1), mode="replicate"), 3, 1)
    trimap = torch.full_like(alpha, 0.5)
    return {"fg": fg, "bg": bg, "alpha": alpha, "trimap": trimap}


def with_known_band(crops: dict, i: int, *, value: float, cols: int = 3) -> dict:
    """Crop ``i`` reaching past the unknown band: its first ``cols`` columns are known
    (``value`` 0: background, 1: foreground) in both the alpha and the trimap."""
    crops["alpha"][i, :, :, :cols] = value
    crops["trimap"][i, :, :, :cols] = value
    return crops


def composite(crops: dict) -> dict:
    """The image of each crop, composited from its ``fg``, ``bg`` and ``alpha``."""
    a = crops["alpha"]
    crops["image"] = crops["fg"] * a + crops["bg"] * (1 - a)
    return crops


class MattingCrops(torch.utils.data.Dataset):
    """The crops as a ``Dataset`` of dicts (image, trimap, alpha, fg, bg), as matting repos'
    ``DataGenerator`` returns them."""

    def __init__(self, crops: dict):
        self.crops = crops

    def __len__(self):
        return len(self.crops["image"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.crops.items()}


# ---------------------------------------------------------------------------------------------
# network


class ConvBNReLU(nn.Sequential):
    """conv - BatchNorm - ReLU (GCA's ResNet blocks); ``bn=False``: conv - ReLU (Deep Image
    Matting's VGG-16 encoder, which has no normalisation)."""

    def __init__(self, cin: int, cout: int, stride: int = 1, bn: bool = True):
        norm = [nn.BatchNorm2d(cout)] if bn else []
        super().__init__(nn.Conv2d(cin, cout, 3, stride, 1, bias=not bn), *norm,
                         nn.ReLU(inplace=True))


class ContextAttention(nn.Module):
    """Self-attention over the bottleneck's positions (GCA's contextual attention, without the
    guidance split): ``softmax(q k^T / sqrt(d)) v`` added back to the features."""

    def __init__(self, c: int):
        super().__init__()
        self.q, self.k, self.v = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)
        self.scale = c ** -0.5

    def forward(self, x):
        b, c, h, w = x.shape
        q = self.q(x).flatten(2).transpose(1, 2)
        k = self.k(x).flatten(2)
        v = self.v(x).flatten(2).transpose(1, 2)
        attn = torch.softmax(torch.bmm(q, k) * self.scale, dim=-1)
        return x + torch.bmm(attn, v).transpose(1, 2).reshape(b, c, h, w)


class ForegroundHead(nn.Module):
    """FBA-style foreground from the compositing equation: ``F = (I - (1 - alpha) B) / alpha``
    (the background known: a green-screen or a clean plate)."""

    def forward(self, image, bg, alpha):
        return (image - (1 - alpha) * bg) / alpha


class MattingNet(nn.Module):
    """Encoder-decoder over ``cat(image, trimap one-hot)`` (6 channels), a U-Net skip, the
    contextual attention at the bottleneck, a sigmoid alpha fused with the trimap; with
    ``bg`` given, also the foreground estimated from it."""

    def __init__(self, c: int = 8, fg_head: bool = False, bn: bool = True):
        super().__init__()
        self.enc1 = ConvBNReLU(6, c, bn=bn)
        self.enc2 = ConvBNReLU(c, 2 * c, stride=2, bn=bn)
        self.attn = ContextAttention(2 * c)
        self.dec2 = ConvBNReLU(2 * c, c, bn=bn)
        self.dec1 = nn.Conv2d(2 * c, 1, 3, 1, 1)
        self.fg_head = ForegroundHead() if fg_head else None

    def forward(self, image, trimap, bg=None):
        tri = trimap_onehot(trimap)
        x1 = self.enc1(torch.cat([image, tri], 1))
        x2 = self.attn(self.enc2(x1))
        up = F.interpolate(self.dec2(x2), size=x1.shape[-2:], mode="bilinear",
                           align_corners=False)
        alpha = torch.sigmoid(self.dec1(torch.cat([up, x1], 1)))
        alpha = alpha * tri[:, 1:2] + tri[:, 2:3]  # the known pixels take the trimap's values
        if self.fg_head is None:
            return alpha
        return alpha, self.fg_head(image, bg, alpha)


def make_matting_net() -> nn.Module:
    torch.manual_seed(0)
    return MattingNet()


def make_half_matting_net() -> nn.Module:
    """The net in float16 throughout (``model.half()``: pure half-precision training)."""
    return make_matting_net().half()


def make_dim_net() -> nn.Module:
    torch.manual_seed(0)
    return MattingNet(bn=False)


def make_matting_fg_net() -> nn.Module:
    torch.manual_seed(0)
    return MattingNet(fg_head=True)


# ---------------------------------------------------------------------------------------------
# losses


def unknown_mask(trimap):
    return (trimap == 0.5).float()


class CharbonnierAlphaLoss(nn.Module):
    """Deep Image Matting's alpha prediction loss ``sqrt(d^2 + eps^2)``, averaged over the
    unknown region (weighted by the mask's count over the batch)."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, alpha, gt, trimap):
        w = unknown_mask(trimap)
        loss = torch.sqrt((alpha - gt) ** 2 + self.eps ** 2)
        return (loss * w).sum() / (w.sum() + 1e-8)


class PerCropL1Loss(nn.Module):
    """GCA's ``regression_loss`` ported per crop: the L1 over each crop's unknown region
    divided by that crop's unknown count, then averaged over the batch."""

    def forward(self, alpha, gt, trimap):
        w = unknown_mask(trimap)
        l1 = ((alpha - gt).abs() * w).sum(dim=(1, 2, 3))
        return (l1 / w.sum(dim=(1, 2, 3))).mean()


def composition_loss(alpha, fg, bg, image, trimap, eps: float = 1e-6):
    """Deep Image Matting's compositional loss: re-composite ``fg alpha + bg (1 - alpha)`` and
    compare to the image (Charbonnier), over the unknown region."""
    w = unknown_mask(trimap)
    comp = fg * alpha + bg * (1 - alpha)
    loss = torch.sqrt((comp - image) ** 2 + eps ** 2)
    return (loss * w).sum() / (w.sum() * 3 + 1e-8)


_SOBEL = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])


def sobel_loss(alpha, gt, trimap):
    """The gradient loss (MatteFormer / MODNet's detail loss): L1 between the Sobel gradients
    of prediction and ground truth, over the unknown region."""
    k = torch.stack([_SOBEL, _SOBEL.t()]).unsqueeze(1)
    gp = F.conv2d(F.pad(alpha, (1, 1, 1, 1), mode="replicate"), k)
    gg = F.conv2d(F.pad(gt, (1, 1, 1, 1), mode="replicate"), k)
    w = unknown_mask(trimap)
    return ((gp - gg).abs() * w).sum() / (w.sum() * 2 + 1e-8)


def laplacian_loss(alpha, gt, levels: int = 2):
    """The Laplacian-pyramid loss (FBA, MatteFormer): L1 between the pyramids' band-pass levels,
    weighted ``2^i``."""
    k = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
    k = (torch.outer(k, k) / 256).view(1, 1, 5, 5)
    total = alpha.new_zeros(())
    a, b = alpha, gt
    for i in range(levels):
        da = F.conv2d(F.pad(a, (2, 2, 2, 2), mode="reflect"), k)
        db = F.conv2d(F.pad(b, (2, 2, 2, 2), mode="reflect"), k)
        total = total + (2 ** i) * ((a - da) - (b - db)).abs().mean()
        a, b = da[..., ::2, ::2], db[..., ::2, ::2]
    return total + (a - b).abs().mean()


class MattingLoss(nn.Module):
    """The sum a matting trainer optimises: alpha (Charbonnier), composition, gradient and
    Laplacian terms, each with its weight."""

    def __init__(self, eps: float = 1e-6, w_comp: float = 0.5, w_grad: float = 0.1,
                 w_lap: float = 0.5):
        super().__init__()
        self.alpha_loss = CharbonnierAlphaLoss(eps)
        self.eps, self.w_comp, self.w_grad, self.w_lap = eps, w_comp, w_grad, w_lap

    def forward(self, alpha, gt, trimap, fg, bg, image):
        loss = self.alpha_loss(alpha, gt, trimap)
        loss = loss + self.w_comp * composition_loss(alpha, fg, bg, image, trimap, self.eps)
        loss = loss + self.w_grad * sobel_loss(alpha, gt, trimap)
        return loss + self.w_lap * laplacian_loss(alpha, gt)


class AlphaBCELoss(nn.Module):
    """A binary cross-entropy on alpha written out (as MODNet-style ports write it, on the
    fused alpha), the unknown region weighted 1 and the known pixels ``known_weight``."""

    def __init__(self, known_weight: float = 0.1):
        super().__init__()
        self.known_weight = known_weight

    def forward(self, alpha, gt, trimap):
        w = unknown_mask(trimap) + self.known_weight * (1 - unknown_mask(trimap))
        bce = -(gt * torch.log(alpha) + (1 - gt) * torch.log(1 - alpha))
        return (bce * w).sum() / w.sum()


class RegressionL1Loss(nn.Module):
    """GCA's ``regression_loss``: the L1 over the unknown region divided by the batch's unknown
    count, ``(|a - gt| * w).sum() / w.sum()``."""

    def forward(self, alpha, gt, trimap):
        w = unknown_mask(trimap)
        return ((alpha - gt).abs() * w).sum() / w.sum()


class GradMagLoss(nn.Module):
    """The gradient loss on Sobel magnitudes, ``|sqrt(gx^2 + gy^2)|`` of prediction against
    ground truth, over the unknown region (the magnitude written without an eps)."""

    def forward(self, alpha, gt, trimap):
        k = torch.stack([_SOBEL, _SOBEL.t()]).unsqueeze(1).to(alpha.dtype)
        gp = F.conv2d(F.pad(alpha, (1, 1, 1, 1), mode="replicate"), k)
        gg = F.conv2d(F.pad(gt, (1, 1, 1, 1), mode="replicate"), k)
        mp, mg = torch.sqrt((gp ** 2).sum(1, keepdim=True)), torch.sqrt((gg ** 2).sum(1, keepdim=True))
        w = unknown_mask(trimap)
        return ((mp - mg).abs() * w).sum() / w.sum().clamp_min(1)
