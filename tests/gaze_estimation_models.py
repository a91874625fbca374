"""Gaze and head-pose estimation written as practitioners write it, for
``test_gaze_estimation``.

- ``GazeNet``: a ResNet-style CNN over face crops regressing (pitch, yaw) plus a per-person
  calibration offset (``nn.Embedding`` by subject id, zero at start, as in few-shot gaze
  personalisation), or a 3D gaze vector L2-normalised (``head="vector"``); an eye-landmark
  branch of heatmaps decoded by soft-argmax (``SoftArgmax2d``: a softmax with an inverse
  temperature, or ``exp`` normalised by hand as several eye-tracking repos write it); the
  validity mask of the labels passed into ``forward`` (rows without a label give no
  calibration update).
- ``HeadPoseNet``: head pose from the 6D representation (Gram-Schmidt to a rotation matrix).
- Losses: the angular error ``acos(cos_sim(pred, target))`` in degrees over the valid rows;
  pitch/yaw L1 after converting the dataset's gaze vectors; the Euclidean pitch/yaw error;
  landmark heatmaps against Gaussians rendered at the labelled eye landmarks; the geodesic
  loss on SO(3).
- ``gaze_batches``: a DataLoader of (face crop, subject id, gaze vector, eye landmarks,
  head rotation, valid) with the planted records.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CROP = 16  # face crop side (pixels)
HM = 8  # landmark heatmap side
N_LM = 4  # eye landmarks: two corners per eye
N_PEOPLE = 6
DEG = 180.0 / math.pi


class BasicBlock(nn.Module):
    def __init__(self, c: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.down = None if stride == 1 else nn.Sequential(
            nn.Conv2d(c, c, 1, stride, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + idt)


class SoftArgmax2d(nn.Module):
    """Heatmaps ``(B, L, H, W)`` to expected (x, y) in [0, 1]; ``stable=False`` is the
    hand-written ``exp(beta * h) / sum`` of several eye-landmark repos."""

    def __init__(self, beta: float = 50.0, stable: bool = True):
        super().__init__()
        self.beta = beta
        self.stable = stable

    def forward(self, hm):
        b, n, h, w = hm.shape
        flat = hm.reshape(b, n, h * w)
        if self.stable:
            p = torch.softmax(self.beta * flat, dim=-1)
        else:
            e = torch.exp(self.beta * flat)
            p = e / e.sum(-1, keepdim=True)
        p = p.reshape(b, n, h, w)
        xs = torch.linspace(0, 1, w, device=hm.device)
        ys = torch.linspace(0, 1, h, device=hm.device)
        return torch.stack(((p.sum(2) * xs).sum(-1), (p.sum(3) * ys).sum(-1)), dim=-1)


class GazeNet(nn.Module):
    def __init__(self, c: int = 8, head: str = "pitchyaw", stable: bool = True):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c),
                                  nn.ReLU())
        self.layer1 = BasicBlock(c)
        self.layer2 = BasicBlock(c, stride=2)
        self.head = head
        self.gaze = nn.Linear(c, 2 if head == "pitchyaw" else 3)
        self.calib = nn.Embedding(N_PEOPLE, 2)
        nn.init.zeros_(self.calib.weight)
        self.heatmap = nn.Conv2d(c, N_LM, 1)
        self.softargmax = SoftArgmax2d(stable=stable)

    def forward(self, face, person, valid):
        h = self.layer2(self.layer1(self.stem(face)))
        feat = h.mean((2, 3))
        g = self.gaze(feat)
        if self.head == "pitchyaw":
            g = g + self.calib(person) * valid[:, None]
        else:
            g = F.normalize(g, dim=-1)
        hm = self.heatmap(h)
        return g, self.softargmax(hm), hm


def make_gaze():
    torch.manual_seed(0)
    return GazeNet()


def make_gaze_vector():
    torch.manual_seed(0)
    return GazeNet(head="vector")


def make_gaze_exp():
    torch.manual_seed(0)
    return GazeNet(stable=False)


class HeadPoseNet(nn.Module):
    """Head pose from the face crop: 6D representation, Gram-Schmidt to R."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, c, 3, 2, 1), nn.ReLU(), BasicBlock(c))
        self.fc = nn.Linear(c, 6)

    def forward(self, face):
        return rotation_6d(self.fc(self.body(face).mean((2, 3))))


def make_headpose():
    torch.manual_seed(0)
    return HeadPoseNet()


# ---------------------------------------------------------------------------------------------
# geometry


def pitchyaw_to_vector(py):
    """(pitch, yaw) to the unit gaze vector, the ETH-XGaze/MPIIGaze convention."""
    pitch, yaw = py[:, 0], py[:, 1]
    return torch.stack((-torch.cos(pitch) * torch.sin(yaw), -torch.sin(pitch),
                        -torch.cos(pitch) * torch.cos(yaw)), dim=-1)


def vector_to_pitchyaw(v):
    """The inverse for unit vectors (the datasets' ``vector_to_pitchyaw``)."""
    return torch.stack((torch.asin(-v[:, 1]), torch.atan2(-v[:, 0], -v[:, 2])), dim=-1)


def rotation_6d(d6):
    """Zhou et al.'s Gram-Schmidt: two vectors to the columns of a rotation matrix."""
    a1, a2 = d6[..., :3], d6[..., 3:]
    b1 = F.normalize(a1, dim=-1)
    b2 = F.normalize(a2 - (b1 * a2).sum(-1, keepdim=True) * b1, dim=-1)
    return torch.stack((b1, b2, torch.linalg.cross(b1, b2)), dim=-1)


def render_heatmaps(lm, sigma: float = 1.0):
    """Gaussians at the landmarks ``(B, L, 2)`` (pixels of the HM x HM map), each normalised
    to sum 1."""
    ax = torch.arange(HM, dtype=lm.dtype)
    d2 = (ax[None, None, None, :] - lm[..., 0, None, None]) ** 2 \
        + (ax[None, None, :, None] - lm[..., 1, None, None]) ** 2
    g = torch.exp(-d2 / (2 * sigma ** 2))
    return g / g.sum((-2, -1), keepdim=True)


# ---------------------------------------------------------------------------------------------
# losses: (gaze, landmarks, heatmaps, <targets...>, valid)


def masked_mean(err, valid):
    return (err * valid).sum() / valid.sum().clamp_min(1)


def angular_loss(g, lm, hm, gaze, lm_gt, valid):
    """Angular error in degrees over the valid rows, plus the landmark term."""
    pred = pitchyaw_to_vector(g) if g.shape[-1] == 2 else g
    cos = F.cosine_similarity(pred, gaze, dim=-1)
    ang = torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6)) * DEG
    return masked_mean(ang, valid) + F.l1_loss(lm, lm_gt / (HM - 1))


def angular_loss_unclamped(g, lm, hm, gaze, lm_gt, valid):
    """The same, the unit 3D prediction dotted with the unit target, no clamp."""
    ang = torch.acos((g * gaze).sum(-1)) * DEG
    return masked_mean(ang, valid) + F.l1_loss(lm, lm_gt / (HM - 1))


def pitchyaw_l1(g, lm, hm, gaze, lm_gt, valid):
    """L1 in (pitch, yaw) with the dataset's gaze vectors converted on the fly."""
    err = (g - vector_to_pitchyaw(gaze)).abs().sum(-1)
    return masked_mean(err, valid) + F.l1_loss(lm, lm_gt / (HM - 1))


def pitchyaw_euclid(g, lm, hm, gaze, lm_gt, valid):
    """Euclidean (pitch, yaw) error; invalid rows zeroed before the norm, as masks go."""
    diff = (g - vector_to_pitchyaw(gaze)) * valid[:, None]
    err = torch.sqrt((diff ** 2).sum(-1))
    return err.sum() / valid.sum().clamp_min(1) + F.l1_loss(lm, lm_gt / (HM - 1))


def heatmap_loss(g, lm, hm, gaze, lm_gt, valid):
    """Angular error plus cross-entropy of the landmark heatmaps against rendered Gaussians."""
    target = render_heatmaps(lm_gt)
    logp = torch.log_softmax(hm.flatten(2), -1).reshape(hm.shape)
    ce = -(target * logp).sum((-2, -1)).mean()
    cos = F.cosine_similarity(pitchyaw_to_vector(g), gaze, dim=-1)
    return masked_mean(torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6)) * DEG, valid) + ce


def geodesic_loss(r_pred, r_gt):
    """The geodesic distance on SO(3), acos((trace(R1^T R2) - 1) / 2), clamped."""
    cos = (torch.diagonal(r_pred.transpose(-1, -2) @ r_gt, dim1=-2, dim2=-1).sum(-1) - 1) / 2
    return torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6)).mean()


def geodesic_loss_textbook(r_pred, r_gt):
    """The same as the formula is written, no clamp."""
    tr = torch.diagonal(r_pred.transpose(-1, -2) @ r_gt, dim1=-2, dim2=-1).sum(-1)
    return torch.acos((tr - 1) / 2).mean()


# ---------------------------------------------------------------------------------------------
# data


def gaze_data(g: torch.Generator, n: int, *, mm: int | None = None, bright: int | None = None,
              off_crop: int | None = None, invalid=(), missing=(), scaled: int | None = None):
    """Face crops and labels: a gaze direction within +-40 degrees, eye landmarks in heatmap
    pixels, a head rotation; ``mm``'s gaze label is the target point minus the eye centre in
    millimetres (never normalised), ``bright``'s crop kept its 0-255 pixels, ``off_crop``'s
    landmarks are in the full frame's pixels, ``invalid`` rows have no gaze label (zeros,
    ``valid`` 0), ``missing`` rows store NaN for the label the annotator skipped (``valid``
    0: the way the dataset's HDF5 marks it), ``scaled``'s head rotation is a 3DMM fit's
    ``s * R`` with the face's scale left in."""
    face = torch.randn(n, 3, CROP, CROP, generator=g)
    py = (torch.rand(n, 2, generator=g) - 0.5) * 1.4
    gaze = pitchyaw_to_vector(py)
    lm = 1 + torch.rand(n, N_LM, 2, generator=g) * (HM - 3)
    person = torch.randint(0, N_PEOPLE, (n,), generator=g)
    valid = torch.ones(n)
    r = rotation_6d(torch.randn(n, 6, generator=g))
    if mm is not None:
        gaze[mm] = gaze[mm] * 600.0  # a screen target 600 mm away, the eye at the origin
    if bright is not None:
        face[bright] = face[bright].abs() * 255.0
    if off_crop is not None:
        lm[off_crop] += torch.tensor([412.0, 230.0])  # the detector's frame coordinates
    for i in invalid:
        gaze[i] = 0.0
        valid[i] = 0.0
    if scaled is not None:
        r[scaled] = r[scaled] * 180.0
    for i in missing:
        gaze[i] = float("nan")
        valid[i] = 0.0
    return face, person, gaze, lm, r, valid


def gaze_batches(steps: int, bs: int = 8, seed: int = 0, **planted):
    """A DataLoader over ``steps`` batches in order; the planted records in the last one
    (row indices within it)."""
    g = torch.Generator().manual_seed(seed)
    parts = [gaze_data(g, bs, **(planted if s == steps - 1 else {})) for s in range(steps)]
    tensors = [torch.cat(t) for t in zip(*parts)]
    return DataLoader(TensorDataset(*tensors), batch_size=bs, shuffle=False)
