"""Video understanding models as the well-known repositories write them, for ``test_video``:
a TSM ResNet (2D convs over ``(n t) c h w`` with the temporal shift's in-place slices), a
divided space-time attention transformer (TimeSformer: ``(b t) n d`` for space, ``(b n) t d``
for time, the frame mask as the temporal key padding mask), a SlowFast-style pair of 3D
pathways with an R(2+1)D block, BatchNorm3d and a time-strided lateral conv fusing fast into
slow. Clips of variable length are padded to ``T`` with a frame mask passed to ``forward``;
the features are pooled over time by that mask. Frames arrive as uint8 and are normalised by
mean/std in a ``Dataset`` read by ``DataLoader`` workers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

T, C, H, W, N_CLS = 4, 3, 8, 8, 5
MEAN = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
STD = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)


def temporal_shift(x, n_segment: int, fold_div: int = 4):
    """TSM's shift (mit-han-lab/temporal-shift-module): a quarter of the channels one frame
    back, a quarter one frame forward, written into slices of a zero tensor."""
    nt, c, h, w = x.shape
    x = x.view(nt // n_segment, n_segment, c, h, w)
    fold = c // fold_div
    out = torch.zeros_like(x)
    out[:, :-1, :fold] = x[:, 1:, :fold]
    out[:, 1:, fold:2 * fold] = x[:, :-1, fold:2 * fold]
    out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
    return out.view(nt, c, h, w)


class ShiftBlock(nn.Module):
    def __init__(self, c: int, n_segment: int = T):
        super().__init__()
        self.n_segment = n_segment
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn(self.conv(temporal_shift(x, self.n_segment))))


class MotionGate(nn.Module):
    """A TEA/TDN-style motion cue: the magnitude of the features' frame differences gates the
    channels. ``sqrt`` of a sum of squares is 0 where two frames are the same (two padded
    frames), and its derivative there is inf."""

    def __init__(self, c: int, n_segment: int = T):
        super().__init__()
        self.n_segment = n_segment
        self.conv = nn.Conv2d(1, c, 1)

    def forward(self, x):
        nt, c, h, w = x.shape
        v = x.view(nt // self.n_segment, self.n_segment, c, h, w)
        d = v[:, 1:] - v[:, :-1]
        d = torch.cat([d, d[:, -1:]], 1)                      # the last frame keeps its motion
        mag = (d ** 2).sum(2, keepdim=True).sqrt().view(nt, 1, h, w)
        return x * torch.sigmoid(self.conv(mag))


class MaskedTemporalPool(nn.Module):
    """Mean over the valid frames: ``(feat * mask).sum(1) / mask.sum(1)``. ``eps`` is what a
    careful recipe adds (``clamp(min=1)``); without it a clip with no valid frame is 0/0."""

    def __init__(self, eps: bool = True, nanmean: bool | str = False):
        super().__init__()
        self.eps, self.nanmean = eps, nanmean

    def forward(self, feat, mask):
        if self.nanmean == "mean":  # the bug: a NaN fill reduced by a plain mean
            return feat.masked_fill(~mask.unsqueeze(-1), float("nan")).mean(1)
        if self.nanmean:  # padded frames as NaN, skipped by nanmean
            return feat.masked_fill(~mask.unsqueeze(-1), float("nan")).nanmean(1)
        m = mask.unsqueeze(-1).to(feat.dtype)
        count = m.sum(1).clamp(min=1.0) if self.eps else m.sum(1)
        return (feat * m).sum(1) / count


class TSM(nn.Module):
    def __init__(self, width: int = 8, pool_eps: bool = True, nanmean: bool | str = False,
                 motion: bool = False):
        super().__init__()
        self.stem = nn.Conv2d(C, width, 3, padding=1)
        self.motion = MotionGate(width) if motion else nn.Identity()
        self.blocks = nn.Sequential(ShiftBlock(width), ShiftBlock(width))
        self.pool = MaskedTemporalPool(pool_eps, nanmean)
        self.fc = nn.Linear(width, N_CLS)

    def forward(self, clips, frame_mask):
        b, c, t, h, w = clips.shape
        x = clips.transpose(1, 2).reshape(b * t, c, h, w)
        x = self.blocks(self.motion(F.relu(self.stem(x))))
        feat = x.mean((2, 3)).view(b, t, -1)
        return self.fc(self.pool(feat, frame_mask))


def make_tsm() -> nn.Module:
    torch.manual_seed(0)
    return TSM()


def make_tsm_no_eps() -> nn.Module:
    torch.manual_seed(0)
    return TSM(pool_eps=False)


class Attention(nn.Module):
    """timm's ViT attention, with a key padding mask filled with -inf before the softmax."""

    def __init__(self, d: int, heads: int = 2):
        super().__init__()
        self.heads, self.scale = heads, (d // heads) ** -0.5
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, pad=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        if pad is not None:
            attn = attn.masked_fill(pad[:, None, None, :], float("-inf"))
        attn = attn.softmax(-1)
        x = (attn @ v).transpose(1, 2).reshape(b, n, d)
        return self.proj(x)


class DividedAttention(nn.Module):
    """One TimeSformer block: temporal attention over ``(b n) t d`` with the padded frames as
    keys masked out, then spatial attention over ``(b t) n d``."""

    def __init__(self, d: int, heads: int = 2):
        super().__init__()
        self.norm_t = nn.LayerNorm(d)
        self.attn_t = Attention(d, heads)
        self.norm_s = nn.LayerNorm(d)
        self.attn_s = Attention(d, heads)

    def forward(self, x, frame_mask):
        b, t, n, d = x.shape
        xt = x.permute(0, 2, 1, 3).reshape(b * n, t, d)          # (b n) t d
        pad = (~frame_mask).repeat_interleave(n, dim=0)           # (b n) t
        h = self.norm_t(xt)
        xt = xt + self.attn_t(h, pad)
        x = xt.view(b, n, t, d).permute(0, 2, 1, 3)
        xs = x.reshape(b * t, n, d)                               # (b t) n d
        h = self.norm_s(xs)
        xs = xs + self.attn_s(h)
        return xs.view(b, t, n, d)


class TimeSformer(nn.Module):
    def __init__(self, d: int = 16, patch: int = 4):
        super().__init__()
        self.patch = nn.Conv2d(C, d, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, 1, (H // patch) * (W // patch), d) * 0.02)
        self.time = nn.Parameter(torch.randn(1, T, 1, d) * 0.02)
        self.block = DividedAttention(d)
        self.pool = MaskedTemporalPool()
        self.head = nn.Linear(d, N_CLS)

    def forward(self, clips, frame_mask):
        b, c, t, h, w = clips.shape
        frames = clips.transpose(1, 2).reshape(b * t, c, h, w)
        x = self.patch(frames)                                         # (b t) d h' w'
        x = x.flatten(2).transpose(1, 2).reshape(b, t, -1, x.shape[1])
        x = self.block(x + self.pos + self.time, frame_mask)
        return self.head(self.pool(x.mean(2), frame_mask))


def make_timesformer() -> nn.Module:
    torch.manual_seed(0)
    return TimeSformer()


def make_tsm_motion() -> nn.Module:
    torch.manual_seed(0)
    return TSM(motion=True)


def make_tsm_nanmean() -> nn.Module:
    torch.manual_seed(0)
    return TSM(nanmean=True)


def make_tsm_nan_fill_mean() -> nn.Module:
    torch.manual_seed(0)
    return TSM(nanmean="mean")


class R2Plus1D(nn.Module):
    """R(2+1)D's factorised conv: a 1×k×k spatial conv, BN, ReLU, a k×1×1 temporal conv."""

    def __init__(self, cin: int, cout: int, mid: int | None = None):
        super().__init__()
        mid = mid or cout
        self.spatial = nn.Conv3d(cin, mid, (1, 3, 3), padding=(0, 1, 1), bias=False)
        self.bn = nn.BatchNorm3d(mid)
        self.temporal = nn.Conv3d(mid, cout, (3, 1, 1), padding=(1, 0, 0), bias=False)

    def forward(self, x):
        return self.temporal(F.relu(self.bn(self.spatial(x))))


class SlowFast(nn.Module):
    """Fast pathway on every frame with few channels, slow on every ``alpha``-th; the lateral
    connection is a time-strided Conv3d (kernel 5×1×1, stride ``alpha``) fused by concat."""

    def __init__(self, alpha: int = 2, slow: int = 8, fast: int = 4):
        super().__init__()
        self.alpha = alpha
        self.fast_stem = nn.Sequential(nn.Conv3d(C, fast, (3, 3, 3), padding=1, bias=False),
                                       nn.BatchNorm3d(fast), nn.ReLU())
        self.slow_stem = nn.Sequential(nn.Conv3d(C, slow, (1, 3, 3), padding=(0, 1, 1),
                                                 bias=False), nn.BatchNorm3d(slow), nn.ReLU())
        self.lateral = nn.Conv3d(fast, 2 * fast, (5, 1, 1), stride=(alpha, 1, 1),
                                 padding=(2, 0, 0), bias=False)
        self.slow_res = R2Plus1D(slow + 2 * fast, slow)
        self.pool = MaskedTemporalPool()
        self.head = nn.Linear(slow + fast, N_CLS)

    def forward(self, clips, frame_mask):
        fast = self.fast_stem(clips)
        slow = self.slow_stem(clips[:, :, ::self.alpha])
        slow = self.slow_res(torch.cat([slow, self.lateral(fast)], 1))
        fs = fast.mean((3, 4)).transpose(1, 2)                         # b t c
        ss = slow.mean((3, 4)).transpose(1, 2).repeat_interleave(self.alpha, 1)
        return self.head(self.pool(torch.cat([ss, fs], 2), frame_mask))


def make_slowfast() -> nn.Module:
    torch.manual_seed(0)
    return SlowFast()


class VideoDataset(torch.utils.data.Dataset):
    """Decoded uint8 clips ``(T, H, W, C)`` of variable length, padded to ``T``, normalised by
    mean/std. ``per_clip``: standardise each clip by its own statistics (a recipe's
    "instance norm" of the input), 0/0 for a blank (all black) clip."""

    def __init__(self, n: int, lengths=None, blank=(), per_clip: bool = False, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.frames = torch.randint(0, 256, (n, T, H, W, C), dtype=torch.uint8, generator=g)
        for i in blank:
            self.frames[i] = 0
        self.lengths = lengths if lengths is not None else [T] * n
        self.labels = torch.randint(0, N_CLS, (n,), generator=g)
        self.per_clip = per_clip

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.frames[i].permute(3, 0, 1, 2).float() / 255.0      # c t h w
        if self.per_clip:
            x = (x - x.mean()) / x.std()
        else:
            x = (x - MEAN) / STD
        mask = torch.arange(T) < self.lengths[i]
        x = x * mask.view(1, T, 1, 1)                                # padded frames are 0
        return x, mask, self.labels[i]


def mixup(x, y, lam: float, n_cls: int = N_CLS, smoothing: float = 0.1):
    """timm's Mixup with label smoothing: soft targets, the batch mixed with its flip."""
    off, on = smoothing / n_cls, 1.0 - smoothing + smoothing / n_cls
    y1 = torch.full((len(y), n_cls), off).scatter_(1, y[:, None], on)
    target = lam * y1 + (1 - lam) * y1.flip(0)
    return lam * x + (1 - lam) * x.flip(0), target


class SoftTargetCrossEntropy(nn.Module):
    """``log_softmax`` is timm's; ``log(softmax)`` the bug, -inf where a probability underflows."""

    def __init__(self, log_of_softmax: bool = False):
        super().__init__()
        self.log_of_softmax = log_of_softmax

    def forward(self, logits, target):
        logp = logits.softmax(-1).log() if self.log_of_softmax else logits.log_softmax(-1)
        return (-target * logp).sum(-1).mean()


class FrameTSM(TSM):
    """Per-frame logits ``(b, t, classes)`` for temporal action segmentation (MS-TCN)."""

    def forward(self, clips, frame_mask):
        b, c, t, h, w = clips.shape
        x = clips.transpose(1, 2).reshape(b * t, c, h, w)
        x = self.blocks(self.motion(F.relu(self.stem(x))))
        return self.fc(x.mean((2, 3)).view(b, t, -1)), frame_mask


def make_frame_tsm() -> nn.Module:
    torch.manual_seed(0)
    return FrameTSM()


class FrameCrossEntropy(nn.Module):
    """Per-frame cross entropy averaged over each clip's valid frames, then over clips.
    ``where``: clips without a valid frame left out by ``torch.where`` after the division
    (finite forward, but its backward still goes through the 0/0)."""

    def __init__(self, where: bool = False):
        super().__init__()
        self.where = where

    def forward(self, out, labels):
        logits, mask = out
        ce = F.cross_entropy(logits.transpose(1, 2), labels[:, None].expand(-1, T),
                             reduction="none")
        m = mask.to(ce.dtype)
        if self.where:
            n = m.sum(1)
            per_clip = torch.where(n > 0, (ce * m).sum(1) / n, torch.zeros_like(n))
            return per_clip.sum() / (n > 0).sum().clamp(min=1)
        return ((ce * m).sum(1) / m.sum(1)).mean()
