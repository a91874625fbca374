"""Event-camera vision as EV-FlowNet / E-RAFT code writes it, for ``test_event_vision``.

A window of events ``(x, y, t, polarity)`` is binned in the Dataset into a voxel grid
``(BINS, H, W)`` (signed polarity, nearest temporal bin, ``index_put_`` with accumulate), a
per-pixel map of the latest timestamp, the 0/1 mask of pixels with events and the window's end
time. ``FlowNet`` normalises each voxel grid by the mean/std of its nonzero entries (the
E-RAFT / EV-FlowNet preprocessing), builds an exponential time surface
``exp(-(t_end - t_last) / tau)`` on the pixels with events, and runs a small U-Net that predicts
dense optical flow. The loss is the masked endpoint error averaged per window over its pixels
with events, plus a Charbonnier smoothness of the flow. Every flag below plants one bug users
meet: an empty window, a tau of 0, timestamps left in microseconds, a hot pixel under float16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

H = W = 12
BINS = 3
EVENTS = 80
WINDOW = 0.05  # seconds


def window(i: int, empty: bool = False, raw_us: bool = False, nan_t: bool = False,
           hot: bool = False):
    """The events of window ``i``: ``(x, y, t, p)``, a random flow-like motion, and its flow."""
    g = torch.Generator().manual_seed(1000 + i)
    n = 0 if empty else EVENTS
    x = torch.randint(0, W, (n,), generator=g)
    y = torch.randint(0, H, (n,), generator=g)
    t = torch.sort(torch.rand(n, generator=g, dtype=torch.float64) * WINDOW).values
    t = t + i * WINDOW  # absolute time of the recording
    p = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    flow = torch.randn(2, generator=g)[:, None, None] * torch.ones(2, H, W)
    if nan_t:
        t[n // 2] = float("nan")  # a corrupt packet in the recording file
    if raw_us:
        t = t * 1e6  # the camera's microseconds, never rescaled to seconds
    if hot:
        x = torch.cat([x, torch.full((70000,), 3)])  # a hot pixel firing through the window
        y = torch.cat([y, torch.full((70000,), 4)])
        t = torch.cat([t, torch.full((70000,), float(t[-1]))])
        p = torch.cat([p, torch.ones(70000, dtype=p.dtype)])
    t_end = (i + 1) * WINDOW * (1e6 if raw_us else 1.0)
    return x, y, t, p, flow, t_end


class EventWindows(torch.utils.data.Dataset):
    """32 windows binned into voxel grids, latest-timestamp maps and event masks."""

    def __init__(self, n: int = 32, empty: int | None = None, raw_us: int | None = None,
                 nan_t: int | None = None, hot: int | None = None):
        self.n, self.plant = n, dict(empty=empty, raw_us=raw_us, nan_t=nan_t, hot=hot)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        flags = {k: v == i for k, v in self.plant.items()}
        x, y, t, p, flow, t_end = window(i, **flags)
        voxel = torch.zeros(BINS, H, W)
        t_last = torch.zeros(H, W)
        has_event = torch.zeros(H, W)
        if len(t):
            t0 = t_end - WINDOW * (1e6 if flags["raw_us"] else 1.0)
            b = ((t - t0) / (t_end - t0) * (BINS - 1)).round().clamp(0, BINS - 1)
            b = torch.nan_to_num(b).long()
            voxel.index_put_((b, y, x), p.float(), accumulate=True)
            t_last[y, x] = (t - t0).float()  # relative to the window's start
            has_event[y, x] = 1.0
        t_end_rel = torch.tensor(WINDOW * (1e6 if flags["raw_us"] else 1.0))
        return voxel, t_last, has_event, t_end_rel, flow


def windows(**plant):
    return EventWindows(**plant)


class NonzeroNorm(nn.Module):
    """E-RAFT's voxel normalisation: mean and std over the grid's nonzero entries."""

    def __init__(self, safe: bool = True):
        super().__init__()
        self.safe = safe

    def forward(self, v):
        nz = (v != 0).float()
        n = nz.sum((1, 2, 3), keepdim=True)
        if self.safe:
            n = n.clamp_min(1)
        mean = v.sum((1, 2, 3), keepdim=True) / n
        var = (((v - mean) * nz) ** 2).sum((1, 2, 3), keepdim=True) / n
        return (v - mean) / (var.sqrt() + 1e-6) * nz


class TimeSurface(nn.Module):
    """Exponential time surface ``exp(-(t_end - t_last) / tau)`` on the pixels with events."""

    def __init__(self, tau: float = 0.03, by_max: bool = False, from_last: bool = False,
                 ratio: bool = False):
        super().__init__()
        self.tau, self.by_max, self.from_last, self.ratio = tau, by_max, from_last, ratio

    def forward(self, t_last, has_event, t_end):
        # decay from the window's end, or from its latest event (HOTS / HATS style)
        t_ref = t_last.amax((1, 2), keepdim=True) if self.from_last else t_end[:, None, None]
        if self.ratio:  # the same decay written as a ratio of two growths
            ts = torch.exp(t_last / self.tau) / torch.exp(t_ref / self.tau) * has_event
        else:
            ts = torch.exp(-(t_ref - t_last) / self.tau) * has_event
        if self.by_max:  # scaled to [0, 1] by the window's freshest pixel
            ts = ts / ts.amax((1, 2), keepdim=True)
        return ts[:, None]


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU())


class FlowNet(nn.Module):
    """A two-level EV-FlowNet-style U-Net on the voxel grid and the time surface."""

    def __init__(self, safe: bool = True, tau: float = 0.03, by_max: bool = False,
                 raw_counts: bool = False, from_last: bool = False, ratio: bool = False,
                 ch: int = 8):
        super().__init__()
        self.norm = NonzeroNorm(safe)
        self.surface = TimeSurface(tau, by_max, from_last, ratio)
        self.raw_counts = raw_counts
        self.enc1 = block(BINS + 1, ch)
        self.enc2 = block(ch, 2 * ch)
        self.dec = block(3 * ch, ch)
        self.head = nn.Conv2d(ch, 2, 1)

    def forward(self, voxel, t_last, has_event, t_end):
        v = voxel.abs() if self.raw_counts else self.norm(voxel)
        x = torch.cat([v, self.surface(t_last, has_event, t_end)], 1)
        e1 = self.enc1(x)
        e2 = self.enc2(F.avg_pool2d(e1, 2))
        up = F.interpolate(e2, scale_factor=2, mode="nearest")
        return self.head(self.dec(torch.cat([e1, up], 1)))


class FlowLoss(nn.Module):
    """Masked endpoint error per window over its pixels with events, plus a Charbonnier
    smoothness of the flow kept at the pixels with events (sparse flow)."""

    def __init__(self, smooth: float = 0.1, eps: float = 1e-3, count_eps: float = 1.0):
        super().__init__()
        self.smooth, self.eps, self.count_eps = smooth, eps, count_eps

    def forward(self, flow, gt, mask):
        epe = ((flow - gt) ** 2).sum(1)
        per = (epe * mask).sum((1, 2)) / (mask.sum((1, 2)) + self.count_eps)
        f = flow * mask[:, None]
        dx, dy = f[..., :, 1:] - f[..., :, :-1], f[..., 1:, :] - f[..., :-1, :]
        tv = torch.sqrt(dx ** 2 + self.eps ** 2).mean() + torch.sqrt(dy ** 2 + self.eps ** 2).mean()
        return per.mean() + self.smooth * tv


def make_flownet():
    torch.manual_seed(0)
    return FlowNet()


def make_flownet_no_clamp():
    torch.manual_seed(0)
    return FlowNet(safe=False)


def make_flownet_tau0():
    torch.manual_seed(0)
    return FlowNet(tau=0.0, from_last=True)


def make_flownet_by_max():
    torch.manual_seed(0)
    return FlowNet(by_max=True)


def make_flownet_counts():
    torch.manual_seed(0)
    return FlowNet(raw_counts=True)


def make_flownet_ratio():
    torch.manual_seed(0)
    return FlowNet(ratio=True)
