"""Directional statistics and rotations written as practitioners write them, for
``test_directional_statistics``.

- ``NormalNet``: surface-normal estimation from a point's k-neighbourhood with Vector Neurons
  (Deng et al. 2021): SO(3)-equivariant linear layers without bias over ``(B, C, 3, K)``
  features, the neighbourhood centred at its centroid, the predicted vector normalised by its
  norm by hand; a von Mises-Fisher NLL on S^2 with a concentration from softplus over the
  invariant features.
- ``WindNet``: wind-direction regression from station readings, a (sin, cos) head put on the
  unit circle and a von Mises NLL whose concentration is a softplus; ``log I0(kappa)`` by
  ``torch.special.i0`` (``make_wind``) or by the exponentially scaled ``i0e``
  (``make_wind_scaled``).
- ``RelPoseNet``: siamese relative camera-pose regression: each view's rotation from a 6D
  representation (Zhou et al. 2019: Gram-Schmidt of two predicted vectors), the relative
  rotation ``R1^T R2`` and the geodesic loss ``acos((trace(R_rel^T R_gt) - 1) / 2)``
  (``geodesic_loss``: unclamped; ``geodesic_loss_clamped``: the fix).
- ``HeadPoseNet``: head-pose regression to unit quaternions (``q / q.norm()``), the loss
  ``1 - <q, q_gt>^2`` on quaternions the dataset stores as given (``quat_loss`` normalises the
  target too).
- ``LookAtViews``/``AbsPoseNet``: drone views whose camera rotations a dataset builds with
  look-at (the world's up fixing the roll), regressed from the 6D representation.
- ``FaceNet``: spherical embeddings with insightface's ArcFace head over Partial FC (the
  classes outside the step's sample masked with -inf), its cosines in the autocast type or in
  float32 (``make_face_fp32_cos``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# Vector Neurons: normals of point neighbourhoods, vMF on S^2

K_NEIGH = 16


class VNLinear(nn.Module):
    """A linear map over channels of ``(B, C, 3, K)`` vector features: no bias (a bias is
    not rotation-equivariant)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.map = nn.Linear(c_in, c_out, bias=False)

    def forward(self, x):
        return self.map(x.transpose(1, -1)).transpose(1, -1)


class VNLeakyReLU(nn.Module):
    """VN's nonlinearity: the component along a learned direction ``d`` is cut where
    ``<x, d> < 0``."""

    def __init__(self, c: int, slope: float = 0.2):
        super().__init__()
        self.dir = VNLinear(c, c)
        self.slope = slope

    def forward(self, x):
        d = self.dir(x)
        dot = (x * d).sum(2, keepdim=True)
        d_sq = (d * d).sum(2, keepdim=True)
        cut = x - dot / (d_sq + 1e-6) * d
        return self.slope * x + (1 - self.slope) * torch.where(dot >= 0, x, cut)


class NormalNet(nn.Module):
    def __init__(self, c: int = 16):
        super().__init__()
        self.inp = VNLinear(1, c)
        self.act1 = VNLeakyReLU(c)
        self.mid = VNLinear(c, c)
        self.act2 = VNLeakyReLU(c)
        self.out = VNLinear(c, 1)
        self.kappa_head = nn.Sequential(nn.Linear(c, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, pts):
        x = pts - pts.mean(1, keepdim=True)  # (B, K, 3), centred at the centroid
        x = x.transpose(1, 2).unsqueeze(1)  # (B, 1, 3, K)
        h = self.act2(self.mid(self.act1(self.inp(x))))
        v = self.out(h).mean(-1)[:, 0]  # (B, 3)
        mu = v / v.norm(dim=-1, keepdim=True)
        inv = h.norm(dim=2).mean(-1)  # rotation-invariant features
        kappa = F.softplus(self.kappa_head(inv)).squeeze(-1) + 1e-3
        return mu, kappa


def make_normals():
    torch.manual_seed(0)
    return NormalNet()


def vmf_s2_nll(mu, kappa, target):
    """-log vMF(target; mu, kappa) on S^2: log C_3 = log kappa - log(2 pi) - kappa
    - log(1 - exp(-2 kappa)), written stably for large kappa. An unoriented normal's sign
    is taken from the prediction."""
    dot = (mu * target).sum(-1).abs()
    log_c = kappa.log() - math.log(2 * math.pi) - kappa - torch.log1p(-torch.exp(-2 * kappa))
    return -(log_c + kappa * dot).mean()


def vmf_s2_nll_sinh(mu, kappa, target):
    """The same NLL with C_3 as the textbook writes it, kappa / (4 pi sinh(kappa))."""
    dot = (mu * target).sum(-1).abs()
    log_c = kappa.log() - math.log(4 * math.pi) - torch.log(torch.sinh(kappa))
    return -(log_c + kappa * dot).mean()


def neighbourhoods(g: torch.Generator, n: int = 12, dup: int | None = None,
                   mm: int | None = None):
    """Patches of a noisy plane at a random orientation and their normals; ``dup``'s patch is
    a single scanned point repeated K times (a scanner's duplicated returns)."""
    normal = F.normalize(torch.randn(n, 3, generator=g), dim=-1)
    a = F.normalize(torch.linalg.cross(normal, torch.randn(n, 3, generator=g)), dim=-1)
    b = torch.linalg.cross(normal, a)
    uv = 1.5 * torch.randn(n, K_NEIGH, 2, generator=g)
    pts = uv[..., :1] * a[:, None] + uv[..., 1:] * b[:, None]
    pts = pts + 0.02 * torch.randn(n, K_NEIGH, 3, generator=g) + torch.randn(n, 1, 3, generator=g)
    pts = torch.round(pts * 1024) / 1024  # the scanner's fixed-point millimetre grid
    if dup is not None:
        pts[dup] = pts[dup, :1].expand(K_NEIGH, 3)
    if mm is not None:
        pts[mm] *= 1000  # a scan exported in millimetres among metres
    return pts, normal


# ---------------------------------------------------------------------------------------------
# von Mises on the circle: wind direction

N_FEAT = 6


class WindNet(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(N_FEAT, hidden), nn.GELU(),
                                  nn.Linear(hidden, hidden), nn.GELU())
        self.direction = nn.Linear(hidden, 2)
        self.concentration = nn.Linear(hidden, 1)

    def forward(self, x):
        h = self.body(x)
        sc = self.direction(h)
        sc = sc / sc.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # (sin, cos) on the circle
        mu = torch.atan2(sc[:, 0], sc[:, 1])
        kappa = F.softplus(self.concentration(h)).squeeze(-1)
        return mu, kappa


def make_wind():
    torch.manual_seed(0)
    return WindNet()


make_wind_scaled = make_wind


def von_mises_nll(mu, kappa, theta):
    """-log VM(theta; mu, kappa) = log(2 pi I0(kappa)) - kappa cos(theta - mu)."""
    return (math.log(2 * math.pi) + torch.log(torch.special.i0(kappa))
            - kappa * torch.cos(theta - mu)).mean()


def von_mises_nll_scaled(mu, kappa, theta):
    """The same with log I0(kappa) = log(i0e(kappa)) + kappa: finite for any kappa."""
    return (math.log(2 * math.pi) + torch.log(torch.special.i0e(kappa)) + kappa
            - kappa * torch.cos(theta - mu)).mean()


def station_batch(g: torch.Generator, n: int = 16, raw: int | None = None,
                  alpine: int | None = None):
    """Standardised readings (pressure, the station's altitude, humidity, u/v of a model
    forecast, hour) and the observed direction; ``raw``'s record kept its pressure in Pa
    (101325), ``alpine``'s its altitude in metres (2300, a station added later), the
    standardisation skipped."""
    x = torch.randn(n, N_FEAT, generator=g)
    theta = torch.atan2(x[:, 3], x[:, 4]) + 0.3 * torch.randn(n, generator=g)
    if raw is not None:
        x[raw, 0] = 101325.0
    if alpine is not None:
        x[alpine, 1] = 2300.0
    return x, theta


# ---------------------------------------------------------------------------------------------
# relative camera pose from the 6D representation


def rotation_6d(d6):
    """Zhou et al.'s Gram-Schmidt: two vectors to the columns of a rotation matrix."""
    a1, a2 = d6[..., :3], d6[..., 3:]
    b1 = F.normalize(a1, dim=-1)
    b2 = F.normalize(a2 - (b1 * a2).sum(-1, keepdim=True) * b1, dim=-1)
    b3 = torch.linalg.cross(b1, b2)
    return torch.stack((b1, b2, b3), dim=-1)


class RelPoseNet(nn.Module):
    def __init__(self, feat: int = 24, hidden: int = 64):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(feat, hidden), nn.LayerNorm(hidden), nn.ReLU(),
                                     nn.Linear(hidden, hidden), nn.ReLU())
        self.rot = nn.Linear(hidden, 6)

    def forward(self, view1, view2):
        r1 = rotation_6d(self.rot(self.encoder(view1)))
        r2 = rotation_6d(self.rot(self.encoder(view2)))
        return r1.transpose(-1, -2) @ r2


def make_relpose():
    torch.manual_seed(0)
    return RelPoseNet()


def geodesic_loss(r_pred, r_gt):
    cos = (torch.diagonal(r_pred.transpose(-1, -2) @ r_gt, dim1=-2, dim2=-1).sum(-1) - 1) / 2
    return torch.acos(cos).mean()


def geodesic_loss_clamped_to_one(r_pred, r_gt):
    """The clamp many repositories write: into acos's domain, onto its edge."""
    cos = (torch.diagonal(r_pred.transpose(-1, -2) @ r_gt, dim1=-2, dim2=-1).sum(-1) - 1) / 2
    return torch.acos(cos.clamp(-1, 1)).mean()


def geodesic_loss_clamped(r_pred, r_gt, eps: float = 1e-6):
    cos = (torch.diagonal(r_pred.transpose(-1, -2) @ r_gt, dim1=-2, dim2=-1).sum(-1) - 1) / 2
    return torch.acos(cos.clamp(-1 + eps, 1 - eps)).mean()


def random_rotations(g: torch.Generator, n: int):
    q = F.normalize(torch.randn(n, 4, generator=g), dim=-1)
    return quat_to_matrix(q)


def quat_to_matrix(q):
    w, x, y, z = q.unbind(-1)
    return torch.stack((1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
                        2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
                        2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)),
                       -1).reshape(*q.shape[:-1], 3, 3)


# ---------------------------------------------------------------------------------------------
# head pose as a unit quaternion


class HeadPoseNet(nn.Module):
    def __init__(self, n_landmarks: int = 20, hidden: int = 64):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * n_landmarks, hidden), nn.SiLU(),
                                 nn.Dropout(0.1), nn.Linear(hidden, hidden), nn.SiLU())
        self.quat = nn.Linear(hidden, 4)

    def forward(self, landmarks):
        q = self.quat(self.mlp(landmarks.flatten(1)))
        return q / q.norm(dim=-1, keepdim=True).clamp_min(1e-8)


def make_headpose():
    torch.manual_seed(0)
    return HeadPoseNet()


def quat_loss(q, q_gt):
    """1 - <q, q_gt>^2: q and -q are the same rotation. The annotation's quaternions are
    renormalised (a CSV's rounded digits)."""
    q_gt = q_gt / q_gt.norm(dim=-1, keepdim=True)
    return (1 - (q * q_gt).sum(-1).pow(2)).mean()


# ---------------------------------------------------------------------------------------------
# camera orientation from look-at targets (a dataset's __getitem__)


def look_at(eye, target, up=(0.0, 0.0, 1.0)):
    """The camera-to-world rotation of a camera at ``eye`` looking at ``target``, the world's
    ``up`` fixing the roll (OpenGL's gluLookAt, as NeRF and drone datasets build poses)."""
    fwd = target - eye
    fwd = fwd / fwd.norm()
    right = torch.linalg.cross(fwd, torch.tensor(up))
    right = right / right.norm()
    down = torch.linalg.cross(fwd, right)
    return torch.stack((right, down, fwd), dim=-1)


class LookAtViews(torch.utils.data.Dataset):
    """Image features and the camera's rotation of drone views around a site; ``nadir``'s
    view looks straight down, where ``fwd`` and the world's up are collinear."""

    def __init__(self, g: torch.Generator, n: int = 8, nadir: int | None = None):
        self.feats = torch.randn(n, 24, generator=g)
        self.eyes = torch.randn(n, 3, generator=g) * 5 + torch.tensor([0.0, 0.0, 20.0])
        if nadir is not None:
            self.eyes[nadir] = torch.tensor([0.0, 0.0, 30.0])

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        return self.feats[i], look_at(self.eyes[i], torch.zeros(3))


class AbsPoseNet(nn.Module):
    """A rotation regressor from the 6D representation (``rotation_6d``)."""

    def __init__(self, feat: int = 24, hidden: int = 64):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(feat, hidden), nn.ReLU(), nn.Linear(hidden, 6))

    def forward(self, x):
        return rotation_6d(self.encoder(x))


def make_abspose():
    torch.manual_seed(0)
    return AbsPoseNet()


# ---------------------------------------------------------------------------------------------
# spherical embeddings: ArcFace over a sampled subset of classes (Partial FC)

N_ID = 32


class PartialArcFace(nn.Module):
    """insightface's ArcFace head over Partial FC: the class centres and the embedding on the
    unit sphere, the additive angular margin on the target's cosine, and the classes outside
    this step's sample masked out with -inf before the softmax cross-entropy, which it
    returns per sample."""

    def __init__(self, dim: int = 16, s: float = 30.0, m: float = 0.5, fp32_cos: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(N_ID, dim) * 0.01)
        self.s, self.m, self.fp32_cos = s, m, fp32_cos

    def forward(self, emb, labels, sampled):
        with torch.autocast(emb.device.type, enabled=not self.fp32_cos):
            emb = emb.float() if self.fp32_cos else emb
            cos = F.linear(F.normalize(emb), F.normalize(self.weight))
        cos = cos.clamp(-1 + 1e-7, 1 - 1e-7)
        target = cos.gather(1, labels[:, None])
        with_margin = torch.cos(torch.acos(target) + self.m)
        logits = cos.scatter(1, labels[:, None], with_margin) * self.s
        logits = logits.masked_fill(~sampled, float("-inf"))
        return F.cross_entropy(logits, labels, reduction="none")


class FaceNet(nn.Module):
    def __init__(self, feat: int = 24, dim: int = 16, fp32_cos: bool = False):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(feat, 64), nn.BatchNorm1d(64), nn.PReLU(),
                                      nn.Linear(64, dim), nn.BatchNorm1d(dim))
        self.head = PartialArcFace(dim, fp32_cos=fp32_cos)

    def forward(self, x, labels, sampled):
        return self.head(self.backbone(x), labels, sampled)


def make_face():
    torch.manual_seed(0)
    return FaceNet()


def make_face_fp32_cos():
    """The head's cosines in float32 under autocast, where 1 - 1e-7 is below 1."""
    torch.manual_seed(0)
    return FaceNet(fp32_cos=True)
