"""Multi-object tracking as JDE/FairMOT/QDTrack-style trackers write it, small, for
``test_multi_object_tracking``: a re-identification head over detection crops (L2-normalised
embeddings), a track-query encoder, association of detections to tracks by Sinkhorn
iterations on a cost matrix (``1 - cos`` plus the L1 distance of the box centres), the
inactive tracks masked out by a track mask passed into ``forward``, a motion head regressing
each track's next box (cxcywh, ``w = w_prev * exp(dw)`` as in Faster R-CNN's deltas) with a
learned observation variance (a Kalman-like NLL), and a loss of focal loss on the association
scores, GIoU on the tracked boxes (written out over xyxy) and the Gaussian NLL.

One sample is one frame: ``N`` detections, ``M`` track slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

N = M = 4
FEAT = 8
EMB = 8


# ---------------------------------------------------------------------------------------------
# data


class Frames(Dataset):
    """Frames of a synthetic sequence: each detection is a noisy view of one track.

    ``blank``: frames whose detection crops are all 0 (a decoder returning black frames);
    ``idle``: frames with no active track (a scene cut: every slot inactive);
    ``clipped``: frames whose first track and its target are clipped to the image border (0
    width); ``nan_at``: frames with a NaN detection box (a corrupt annotation line)."""

    def __init__(self, n=32, blank=(), idle=(), clipped=(), nan_at=(), seed=0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            tracks = torch.randn(M, FEAT, generator=g)
            perm = torch.randperm(N, generator=g)
            dets = tracks[perm] + 0.1 * torch.randn(N, FEAT, generator=g)
            tbox = torch.cat([torch.rand(M, 2, generator=g) * 0.6 + 0.2,
                              torch.rand(M, 2, generator=g) * 0.2 + 0.05], 1)
            dbox = tbox[perm] + 0.01 * torch.randn(N, 4, generator=g)
            target = tbox + 0.01 * torch.randn(M, 4, generator=g)
            mask = torch.ones(M)
            match = torch.zeros(N, M)
            match[torch.arange(N), perm] = 1.0
            if i in blank:
                dets = torch.zeros(N, FEAT)
            if i in idle:
                mask = torch.zeros(M)
            if i in clipped:
                tbox[0, 2] = 0.0
                target[0, 2] = 0.0
                target[0, 0] = tbox[0, 0]
            if i in nan_at:
                dbox[1, 0] = float("nan")
            self.items.append((dets, tracks, dbox, tbox, mask, match, target))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


# ---------------------------------------------------------------------------------------------
# model


class ReIDHead(nn.Module):
    """JDE's embedding branch: two linear layers, then L2 normalisation."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.fc1 = nn.Linear(FEAT, 16, bias=False)
        self.fc2 = nn.Linear(16, EMB, bias=False)
        self.eps = eps

    def forward(self, x):
        e = self.fc2(torch.relu(self.fc1(x)))
        return e / (e.norm(dim=-1, keepdim=True) + self.eps)


class Sinkhorn(nn.Module):
    """Entropic assignment of detections to active tracks. ``log_domain``: SuperGlue's
    logsumexp iterations; else the plain ``exp(-C / eps)`` kernel normalised by its row and
    column sums."""

    def __init__(self, eps: float = 0.1, iters: int = 5, log_domain: bool = True):
        super().__init__()
        self.eps, self.iters, self.log_domain = eps, iters, log_domain

    def forward(self, cost, mask):
        if self.log_domain:
            z = (-cost / self.eps).masked_fill(mask[:, None, :] == 0, -1e4)
            for _ in range(self.iters):
                z = z - torch.logsumexp(z, 2, keepdim=True)
                z = z - torch.logsumexp(z, 1, keepdim=True)
            return z.exp()
        k = torch.exp(-cost / self.eps) * mask[:, None, :]
        for _ in range(self.iters):
            k = k / k.sum(2, keepdim=True)
            k = k / k.sum(1, keepdim=True)
        return k


class Tracker(nn.Module):
    def __init__(self, reid_eps=1e-6, sink_eps=0.1, log_domain=True, var0=0.05):
        super().__init__()
        self.reid = ReIDHead(reid_eps)
        self.track_enc = nn.Linear(FEAT, FEAT)
        self.sinkhorn = Sinkhorn(sink_eps, log_domain=log_domain)
        self.motion = nn.Sequential(nn.Linear(FEAT + 4, 16), nn.ReLU(), nn.Linear(16, 4))
        # the observation variance of the motion model, learned directly (no softplus)
        self.obs_var = nn.Parameter(torch.full((4,), var0))

    def forward(self, dets, tracks, dbox, tbox, mask):
        de = self.reid(dets)
        te = self.reid(self.track_enc(tracks))
        cost = (1 - de @ te.transpose(1, 2)) + torch.cdist(dbox[..., :2], tbox[..., :2], p=1)
        assign = self.sinkhorn(cost, mask)
        d = self.motion(torch.cat([tracks, tbox], -1)) * 0.1
        xy = tbox[..., :2] + d[..., :2] * tbox[..., 2:]
        wh = tbox[..., 2:] * torch.exp(d[..., 2:])
        return assign, torch.cat([xy, wh], -1), self.obs_var, torch.cat([de, te], 1)


def make_tracker():
    torch.manual_seed(0)
    return Tracker()


def make_tracker_no_eps():
    torch.manual_seed(0)
    return Tracker(reid_eps=0.0)


def make_tracker_plain_sinkhorn():
    torch.manual_seed(0)
    return Tracker(log_domain=False, sink_eps=0.1)


def make_tracker_sharp_sinkhorn():
    torch.manual_seed(0)
    return Tracker(log_domain=False, sink_eps=0.01)


# ---------------------------------------------------------------------------------------------
# losses


def cxcywh_to_xyxy(b):
    c, wh = b[..., :2], b[..., 2:]
    return torch.cat([c - wh / 2, c + wh / 2], -1)


def giou(a, b):
    """GIoU of boxes in xyxy, written out as in the GIoU paper (no eps)."""
    lt, rb = torch.max(a[..., :2], b[..., :2]), torch.min(a[..., 2:], b[..., 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a = (a[..., 2:] - a[..., :2]).prod(-1)
    area_b = (b[..., 2:] - b[..., :2]).prod(-1)
    union = area_a + area_b - inter
    iou = inter / union
    lt_c, rb_c = torch.min(a[..., :2], b[..., :2]), torch.max(a[..., 2:], b[..., 2:])
    hull = (rb_c - lt_c).prod(-1)
    return iou - (hull - union) / hull


def focal(p, t, alpha=0.25, gamma=2.0):
    p = p.clamp(1e-6, 1 - 1e-6)
    pt = torch.where(t > 0, p, 1 - p)
    a = torch.where(t > 0, alpha, 1 - alpha)
    return -(a * (1 - pt) ** gamma * torch.log(pt))


def batch_hard_triplet(emb, match, margin=0.3, clamp=True):
    """Batch-hard triplet loss within each frame over its detections' and tracks'
    embeddings (a detection's positive: the track it matches), distances from the pairwise
    squared differences."""
    ids = torch.cat([match.argmax(-1), torch.arange(M).expand(match.shape[0], M)], 1)
    d2 = ((emb[:, :, None] - emb[:, None]) ** 2).sum(-1)
    d = d2.clamp_min(1e-12).sqrt() if clamp else d2.sqrt()
    same = ids[:, :, None] == ids[:, None]
    pos = (d * same).max(-1).values
    neg = d.masked_fill(same, 1e4).min(-1).values
    return F.relu(pos - neg + margin).mean()


class TrackingLoss(nn.Module):
    """Focal loss on the assignment, GIoU on the active tracks' boxes, the motion NLL,
    (``triplet``) the re-id head's batch-hard triplet loss."""

    def __init__(self, w_giou=2.0, w_nll=0.1, triplet=False, clamp=True):
        super().__init__()
        self.w_giou, self.w_nll, self.triplet, self.clamp = w_giou, w_nll, triplet, clamp

    def forward(self, assign, boxes, var, emb, match, target, mask):
        l_assoc = focal(assign, match).sum() / match.sum().clamp(min=1)
        g = giou(cxcywh_to_xyxy(boxes), cxcywh_to_xyxy(target))
        l_giou = ((1 - g) * mask).sum() / mask.sum().clamp(min=1)
        r = (boxes - target) * 10
        nll = 0.5 * (r ** 2 / var + torch.log(var))
        l_nll = (nll.mean(-1) * mask).sum() / mask.sum().clamp(min=1)
        loss = l_assoc + self.w_giou * l_giou + self.w_nll * l_nll
        if self.triplet:
            loss = loss + batch_hard_triplet(emb, match, clamp=self.clamp)
        return loss


def make_tracker_small_var():
    torch.manual_seed(0)
    return Tracker(var0=0.02)
