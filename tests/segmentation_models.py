"""2D semantic segmentation and depth models of ``tests/test_segmentation.py``, written as
that community writes them: a small U-Net (Conv - BatchNorm - ReLU, ConvTranspose2d and
``F.interpolate`` upsampling), a DeepLab-style head (ASPP branches, image pooling, bilinear
upsampling to the input size), partial convolutions over a per-pixel mask passed to the
forward (Liu et al.'s inpainting layer), and the losses the repos use: cross entropy with
``ignore_index=255`` and class weights, soft Dice, focal loss, Berman's Lovasz hinge,
scale-invariant log depth loss. The factories live at module level so that ``nanreplay``
rebuilds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_CLASSES = 3
IGNORE = 255


def cbr(cin: int, cout: int, k: int = 3, d: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=d * (k // 2), dilation=d, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """Two levels; the decoder upsamples with ConvTranspose2d, the head output is resized to
    the input with ``F.interpolate`` (bilinear, align_corners=False)."""

    def __init__(self, cin: int = 3, n_classes: int = N_CLASSES, base: int = 8):
        super().__init__()
        self.enc1 = nn.Sequential(cbr(cin, base), cbr(base, base))
        self.enc2 = nn.Sequential(cbr(base, 2 * base), cbr(2 * base, 2 * base))
        self.up = nn.ConvTranspose2d(2 * base, base, 2, stride=2)
        self.dec = nn.Sequential(cbr(2 * base, base), cbr(base, base))
        self.head = nn.Conv2d(base, n_classes, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        d = self.dec(torch.cat([self.up(e2), e1], 1))
        return F.interpolate(self.head(d), size=x.shape[-2:], mode="bilinear",
                             align_corners=False)


def make_unet(n_classes: int = N_CLASSES, cin: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return UNet(cin=cin, n_classes=n_classes)


class DepthNet(nn.Module):
    """A U-Net regressing depth; ``act`` makes it positive (ReLU as many monodepth repos do,
    or softplus)."""

    def __init__(self, act: str = "relu"):
        super().__init__()
        self.net = UNet(n_classes=1)
        self.act = nn.ReLU() if act == "relu" else nn.Softplus()

    def forward(self, x):
        return self.act(self.net(x))[:, 0]


def make_depth(act: str = "relu") -> nn.Module:
    torch.manual_seed(0)
    return DepthNet(act)


class PartialConv2d(nn.Module):
    """Liu et al.'s partial convolution (NVIDIA's ``PartialConv2d``): the convolution of the
    valid pixels, renormalised by the window size over the number of valid pixels under it;
    ``eps`` is the reference's 1e-8 guard on that count."""

    def __init__(self, cin: int, cout: int, k: int = 3, eps: float = 1e-8):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, padding=k // 2)
        self.register_buffer("ones", torch.ones(1, 1, k, k))
        self.window, self.eps = float(k * k), eps

    def forward(self, x, mask):
        with torch.no_grad():
            count = F.conv2d(mask, self.ones, padding=self.ones.shape[-1] // 2)
            new_mask = (count > 0).to(x.dtype)
            ratio = self.window / (count + self.eps) * new_mask
        raw = self.conv(x * mask)
        bias = self.conv.bias.view(1, -1, 1, 1)
        return (raw - bias) * ratio + bias * new_mask, new_mask


class InpaintNet(nn.Module):
    def __init__(self, eps: float = 1e-8):
        super().__init__()
        self.p1, self.p2 = PartialConv2d(3, 8, eps=eps), PartialConv2d(8, 8, eps=eps)
        self.bn = nn.BatchNorm2d(8)
        self.out = nn.Conv2d(8, 3, 1)

    def forward(self, x, mask):
        h, m = self.p1(x, mask)
        h, m = self.p2(F.relu(self.bn(h)), m)
        return self.out(F.relu(h))


def make_inpaint(eps: float = 1e-8) -> nn.Module:
    torch.manual_seed(0)
    return InpaintNet(eps)


# ---------------------------------------------------------------------------------------------
# losses


class SoftDiceLoss(nn.Module):
    """Per-image, per-class soft Dice over softmax probabilities (segmentation_models_pytorch's
    DiceLoss without its clamp): 1 - (2|P∩G| + smooth) / (|P| + |G| + smooth)."""

    def __init__(self, smooth: float = 0.0, from_logits: bool = True, eps: float = 0.0):
        super().__init__()
        self.smooth, self.from_logits, self.eps = smooth, from_logits, eps

    def forward(self, logits, labels):
        p = logits.softmax(1) if self.from_logits else logits
        g = F.one_hot(labels, p.shape[1]).permute(0, 3, 1, 2).to(p.dtype)
        inter, card = (p * g).sum((2, 3)), (p + g).sum((2, 3))
        return 1 - ((2 * inter + self.smooth) / (card + self.smooth + self.eps)).mean()


class FocalLoss(nn.Module):
    """Lin et al.'s focal loss per pixel, as most segmentation repos write it:
    -(1 - p_t)^gamma log p_t with p_t gathered from the softmax, pixels at ``ignore_index``
    left out."""

    def __init__(self, gamma: float = 2.0, ignore_index: int = IGNORE, pick: bool = False):
        super().__init__()
        self.gamma, self.ignore_index, self.pick = gamma, ignore_index, pick

    def forward(self, logits, labels):
        valid = labels != self.ignore_index
        if self.pick:  # (the valid pixels first, as rows: (N, C) logits, (N,) labels)
            logp = logits.permute(0, 2, 3, 1)[valid].log_softmax(1)
            logp = logp.gather(1, labels[valid][:, None])[:, 0]
        else:
            logp = logits.log_softmax(1).gather(1, (labels * valid)[:, None])[:, 0]
        pt = logp.exp()
        loss = -((1 - pt) ** self.gamma) * logp
        return loss.mean() if self.pick else loss[valid].mean()


def lovasz_grad(gt_sorted):
    """Berman et al.'s gradient of the Lovasz extension of the Jaccard loss."""
    gts = gt_sorted.sum()
    intersection = gts - gt_sorted.float().cumsum(0)
    union = gts + (1 - gt_sorted).float().cumsum(0)
    jaccard = 1.0 - intersection / union
    jaccard[1:] = jaccard[1:] - jaccard[:-1]
    return jaccard


class LovaszHinge(nn.Module):
    """Binary Lovasz hinge per image (``per_image=True``), pixels at ``ignore`` left out."""

    def __init__(self, ignore: int = IGNORE):
        super().__init__()
        self.ignore = ignore

    def forward(self, logits, labels):
        losses = []
        for lg, lab in zip(logits[:, 0], labels):
            keep = lab.view(-1) != self.ignore
            lg, lab = lg.view(-1)[keep], lab.view(-1)[keep].float()
            errors = 1.0 - lg * (2.0 * lab - 1.0)
            errors_sorted, perm = torch.sort(errors, descending=True)
            losses.append(torch.dot(F.relu(errors_sorted), lovasz_grad(lab[perm])))
        return torch.stack(losses).mean()


class SILogLoss(nn.Module):
    """Eigen et al.'s scale-invariant log loss (BTS / AdaBins): pixels with no ground truth
    (depth 0) are left out through ``gt > min_depth``."""

    def __init__(self, lambd: float = 0.85, min_depth: float = 1e-3, per_image: bool = False,
                 masked_select: bool = False):
        super().__init__()
        self.lambd, self.min_depth, self.per_image = lambd, min_depth, per_image
        self.masked_select = masked_select

    def forward(self, pred, gt):
        valid = gt > self.min_depth
        if self.per_image:  # (each image's own scale: a loop over the batch)
            return torch.stack([self.silog(p[v], g[v]) for p, g, v in zip(pred, gt, valid)]
                               ).mean()
        if self.masked_select:
            return self.silog(pred.masked_select(valid), gt.masked_select(valid))
        return self.silog(pred[valid], gt[valid])

    def silog(self, pred, gt):
        d = torch.log(pred) - torch.log(gt)
        return torch.sqrt((d ** 2).mean() - self.lambd * d.mean() ** 2) * 10.0


# ---------------------------------------------------------------------------------------------
# data


def scenes(n: int = 8, size: int = 16, seed: int = 0):
    """Images of a few flat-coloured rectangles and their labels (0 background, 1, 2), with a
    one-pixel ``IGNORE`` border around each object, as VOC's masks have."""
    g = torch.Generator().manual_seed(seed)
    imgs = 0.1 * torch.randn(n, 3, size, size, generator=g)
    labs = torch.zeros(n, size, size, dtype=torch.long)
    for i in range(n):
        for c in (1, 2):
            y0, x0 = torch.randint(0, size - 6, (2,), generator=g).tolist()
            h, w = torch.randint(3, 6, (2,), generator=g).tolist()
            labs[i, max(y0 - 1, 0):y0 + h + 1, max(x0 - 1, 0):x0 + w + 1] = IGNORE
            labs[i, y0:y0 + h, x0:x0 + w] = c
            imgs[i, c - 1, y0:y0 + h, x0:x0 + w] += 1.0
    return imgs, labs


def depth_scenes(n: int = 8, size: int = 16, seed: int = 0):
    """Images and depth maps in metres, with holes of depth 0 (no LiDAR return) as KITTI's."""
    g = torch.Generator().manual_seed(seed)
    imgs = torch.randn(n, 3, size, size, generator=g)
    depth = 1.0 + 9.0 * torch.rand(n, size, size, generator=g)
    depth[torch.rand(n, size, size, generator=g) < 0.3] = 0.0
    return imgs, depth


class ASPP(nn.Module):
    """DeepLabv3's atrous spatial pyramid pooling: a 1x1 branch, dilated 3x3 branches and an
    image-pooling branch upsampled back, concatenated and projected."""

    def __init__(self, cin: int, cout: int, rates=(2, 4)):
        super().__init__()
        self.branches = nn.ModuleList([cbr(cin, cout, 1)] + [cbr(cin, cout, 3, r) for r in rates])
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(cin, cout, 1, bias=False),
                                  nn.BatchNorm2d(cout), nn.ReLU())
        self.project = cbr((len(rates) + 2) * cout, cout, 1)

    def forward(self, x):
        pooled = F.interpolate(self.pool(x), size=x.shape[-2:], mode="bilinear",
                               align_corners=False)
        return self.project(torch.cat([b(x) for b in self.branches] + [pooled], 1))


class DeepLab(nn.Module):
    """torchvision's ``deeplabv3`` layout: a backbone at stride 4, the ASPP head and an
    auxiliary FCN head, each upsampled to the input; returns ``{"out": ..., "aux": ...}``."""

    def __init__(self, n_classes: int = N_CLASSES, base: int = 8):
        super().__init__()
        self.backbone = nn.Sequential(cbr(3, base), nn.MaxPool2d(2), cbr(base, 2 * base),
                                      nn.MaxPool2d(2), cbr(2 * base, 2 * base))
        self.head = nn.Sequential(ASPP(2 * base, base), nn.Conv2d(base, n_classes, 1))
        self.aux = nn.Sequential(cbr(2 * base, base), nn.Conv2d(base, n_classes, 1))

    def forward(self, x):
        f = self.backbone(x)
        size = x.shape[-2:]
        return {"out": F.interpolate(self.head(f), size=size, mode="bilinear",
                                     align_corners=False),
                "aux": F.interpolate(self.aux(f), size=size, mode="bilinear",
                                     align_corners=False)}


def make_deeplab() -> nn.Module:
    torch.manual_seed(0)
    return DeepLab()


def criterion(inputs, target):
    """torchvision's segmentation reference: cross entropy of each head, the aux one at 0.5."""
    losses = {name: F.cross_entropy(x, target, ignore_index=IGNORE) for name, x in inputs.items()}
    if len(losses) == 1:
        return losses["out"]
    return losses["out"] + 0.5 * losses["aux"]


def signed_distance(mask: torch.Tensor) -> torch.Tensor:
    """A signed distance map of a binary (H, W) mask, negative inside, in pixels, normalised
    to [-1, 1] per image as boundary-loss repos do (brute force over the boundary pixels)."""
    h, w = mask.shape
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    grid = torch.stack([yy, xx], -1).reshape(-1, 2).float()
    edge = mask ^ F.max_pool2d(mask[None, None].float(), 3, 1, 1)[0, 0].bool()
    pts = grid[edge.reshape(-1)]
    d = torch.cdist(grid, pts).amin(1).reshape(h, w) if len(pts) else torch.zeros(h, w)
    d = torch.where(mask, -d, d)
    return d / d.abs().max()


class BoundaryLoss(nn.Module):
    """Kervadec et al.'s boundary loss on the foreground probability, plus cross entropy."""

    def __init__(self, alpha: float = 0.01):
        super().__init__()
        self.alpha = alpha

    def forward(self, logits, labels, dist):
        probs = logits.softmax(1)[:, 1:].sum(1)
        ce = F.cross_entropy(logits, labels, ignore_index=IGNORE)
        return ce + self.alpha * (probs * dist).mean()


class PrototypeNet(nn.Module):
    """PANet-style few-shot segmentation: a shared encoder, class prototypes by masked
    average pooling of the support features under the support mask resized to the feature
    map, the query segmented by cosine similarity to the prototypes."""

    def __init__(self, base: int = 8, scale: float = 20.0):
        super().__init__()
        self.encoder = nn.Sequential(cbr(3, base), nn.MaxPool2d(2), cbr(base, base),
                                     nn.MaxPool2d(2), cbr(base, base))
        self.scale = scale

    def forward(self, query, support, support_mask):
        fq, fs = self.encoder(query), self.encoder(support)
        m = F.interpolate(support_mask[:, None].float(), size=fs.shape[-2:], mode="nearest")
        fg = (fs * m).sum((2, 3)) / m.sum((2, 3))
        bg = (fs * (1 - m)).sum((2, 3)) / (1 - m).sum((2, 3))
        protos = torch.stack([bg, fg], 1)  # (B, 2, C)
        sim = F.cosine_similarity(fq[:, None], protos[..., None, None], dim=2)
        return F.interpolate(self.scale * sim, size=query.shape[-2:], mode="bilinear",
                             align_corners=False)


def make_protonet() -> nn.Module:
    torch.manual_seed(0)
    return PrototypeNet()


class MaskedAttentionDecoder(nn.Module):
    """Mask2Former's masked attention, one layer: learned queries attend to the pixel
    features only inside the mask their previous prediction gives (sigmoid < 0.5 is masked
    out), through ``nn.MultiheadAttention`` with a (B * heads, Q, HW) boolean ``attn_mask``;
    each query's mask logits are the dot product of its embedding with the pixel features.
    ``guard``: Mask2Former's fix, a query whose mask is empty attends everywhere."""

    def __init__(self, n_queries: int = 4, dim: int = 8, heads: int = 2, guard: bool = False):
        super().__init__()
        self.pixel = nn.Sequential(cbr(3, dim), cbr(dim, dim))
        self.queries = nn.Parameter(torch.randn(n_queries, dim))
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.cls = nn.Linear(dim, N_CLASSES + 1)
        self.heads, self.guard = heads, guard

    def forward(self, x):
        f = self.pixel(x)  # (B, C, H, W)
        b = f.shape[0]
        q = self.queries.expand(b, -1, -1)
        masks = torch.einsum("bqc,bchw->bqhw", q, f)
        attn_mask = (masks.flatten(2).sigmoid() < 0.5).detach()
        if self.guard:
            attn_mask[attn_mask.all(-1)] = False
        attn_mask = attn_mask.repeat_interleave(self.heads, 0)
        q = self.norm(q + self.attn(q, f.flatten(2).transpose(1, 2), f.flatten(2).transpose(
            1, 2), attn_mask=attn_mask)[0])
        masks = torch.einsum("bqc,bchw->bqhw", q, f)
        # per-pixel class scores: the queries' class probabilities weighted by their masks
        return torch.einsum("bqk,bqhw->bkhw", self.cls(q).softmax(-1)[..., :-1],
                            masks.sigmoid())


def make_mask2former(guard: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return MaskedAttentionDecoder(guard=guard)


class InverseDepthL1(nn.Module):
    """L1 on inverse depth (disparity) over the pixels with ground truth, the mask applied
    by multiplication after the difference, as many monodepth repos write it."""

    def forward(self, pred, gt):
        valid = (gt > 0).float()
        return (torch.abs(1.0 / pred - 1.0 / gt) * valid).sum() / valid.sum()
