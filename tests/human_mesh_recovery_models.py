"""Human mesh recovery written as HMR, SPIN, CLIFF and PARE's repositories write it, for
``test_human_mesh_recovery``: a small conv backbone, HMR's iterative error feedback regressor
(``fc1`` over ``[features, pose, shape, cam]``, ``decpose``/``decshape``/``deccam`` deltas added
to SPIN's mean parameters, three iterations), the 6D rotation head turned into matrices by
Gram-Schmidt (Zhou et al., SPIN's ``rot6d_to_rotmat``), an SMPL-like body model (template,
shape blend shapes, a joint regressor, forward kinematics down a kinematic tree, linear blend
skinning) with SPIN's ``batch_rodrigues`` for axis-angle poses, a weak-perspective camera
``[s, tx, ty]`` or CLIFF's full-image camera (its translation ``tz = 2 f / (s * bbox_size)``,
the box given to ``forward``), and SPIN's losses: the confidence-weighted 2D keypoint loss,
the pelvis-aligned 3D joint loss and the vertex loss over the samples with 3D/SMPL labels of a
mixed batch, a shape prior on betas, and a Procrustes-aligned joint error (SVD of the joint
covariance) as a training term, PARE-style attention pooling over the person's segmentation
(background logits filled with -inf). The factories live at module level so that ``nanreplay``
rebuilds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

N_J = 6  # joints: pelvis, spine, head, left/right hip, left/right shoulder (a tiny SMPL)
PARENTS = (-1, 0, 1, 0, 0, 1)
N_V = 24  # vertices
N_BETAS = 10
IMG = 32
FOCAL = 50.0


def batch_rodrigues(aa, eps: float = 1e-8):
    """Axis-angle (N, 3) to rotation matrices (N, 3, 3), as SPIN's ``batch_rodrigues``;
    ``eps=0``: the angle's norm without SPIN's ``+ 1e-8`` (0/0 at a zero rotation)."""
    angle = torch.norm(aa + eps, dim=1, keepdim=True)
    axis = aa / angle  # the bug with eps=0: 0/0 for a joint with no rotation
    cos, sin = torch.cos(angle)[:, :, None], torch.sin(angle)[:, :, None]
    rx, ry, rz = axis.unbind(1)
    zeros = torch.zeros_like(rx)
    k = torch.stack([zeros, -rz, ry, rz, zeros, -rx, -ry, rx, zeros], 1).view(-1, 3, 3)
    eye = torch.eye(3, dtype=aa.dtype, device=aa.device)[None]
    return eye + sin * k + (1 - cos) * torch.bmm(k, k)


def rot6d_to_rotmat(x, eps: float = 1e-12):
    """Zhou et al.'s 6D representation (N, 6) to rotation matrices by Gram-Schmidt; ``eps=0``:
    written out by hand without ``F.normalize``'s floor."""
    x = x.view(-1, 3, 2)
    a1, a2 = x[:, :, 0], x[:, :, 1]
    b1 = a1 / a1.norm(dim=1, keepdim=True).clamp_min(eps)
    b2 = a2 - (b1 * a2).sum(1, keepdim=True) * b1
    b2 = b2 / b2.norm(dim=1, keepdim=True).clamp_min(eps)  # the bug with eps=0: a2 || a1
    b3 = torch.cross(b1, b2, dim=1)
    return torch.stack([b1, b2, b3], dim=-1)


class BodyModel(nn.Module):
    """SMPL in miniature: ``v_template + shapedirs @ betas``, joints by ``J_regressor``, forward
    kinematics down ``PARENTS``, linear blend skinning with ``lbs_weights``."""

    def __init__(self, rodrigues_eps: float = 1e-8):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.register_buffer("v_template", torch.randn(N_V, 3, generator=g) * 0.3)
        self.register_buffer("shapedirs", torch.randn(N_V, 3, N_BETAS, generator=g) * 0.01)
        jreg = torch.rand(N_J, N_V, generator=g)
        self.register_buffer("J_regressor", jreg / jreg.sum(1, keepdim=True))
        w = torch.rand(N_V, N_J, generator=g) ** 4
        self.register_buffer("lbs_weights", w / w.sum(1, keepdim=True))
        self.rodrigues_eps = rodrigues_eps

    def forward(self, betas, rotmat=None, pose=None):
        """``rotmat`` (B, J, 3, 3), or ``pose`` (B, J * 3) axis-angle (the datasets' SMPL fits)."""
        b = betas.shape[0]
        if rotmat is None:
            rotmat = batch_rodrigues(pose.reshape(-1, 3), self.rodrigues_eps).view(b, N_J, 3, 3)
        v = self.v_template + torch.einsum("vck,bk->bvc", self.shapedirs, betas)
        joints = torch.einsum("jv,bvc->bjc", self.J_regressor, v)
        glob_r, glob_t = [rotmat[:, 0]], [joints[:, 0]]
        for j in range(1, N_J):
            p = PARENTS[j]
            glob_r.append(glob_r[p] @ rotmat[:, j])
            rel = (joints[:, j] - joints[:, p])[..., None]
            glob_t.append(glob_t[p] + (glob_r[p] @ rel)[..., 0])
        r, t = torch.stack(glob_r, 1), torch.stack(glob_t, 1)
        t = t - (r @ joints[..., None])[..., 0]  # transforms relative to the rest pose
        a = torch.einsum("vj,bjcd->bvcd", self.lbs_weights, r)
        verts = (a @ v[..., None])[..., 0] + torch.einsum("vj,bjc->bvc", self.lbs_weights, t)
        posed = torch.einsum("jv,bvc->bjc", self.J_regressor, verts)
        return verts, posed


class HMR(nn.Module):
    """HMR/SPIN's regressor. ``camera="weak"``: keypoints ``s * X[:, :2] + [tx, ty]`` in the
    crop's normalised coordinates; ``camera="cliff"``: CLIFF's full-image camera, whose depth is
    ``2 f / (s * bbox_size)`` (``bbox``: (B, 3) centre and size in pixels, given to forward)
    and whose projection divides by it. ``tz_eps``: the floor on that product (SPIN's 1e-9)."""

    def __init__(self, camera: str = "weak", rot_eps: float = 1e-12, tz_eps: float = 1e-9,
                 feat: int = 32, hidden: int = 64, identity6d=(1.0, 0.0, 0.0, 1.0, 0.0, 0.0),
                 zero_init: bool = False, pool: str = "avg"):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, feat))
        npose = N_J * 6
        self.fc1 = nn.Linear(feat + npose + N_BETAS + 3, hidden)
        self.drop1 = nn.Dropout(0.1)
        self.decpose = nn.Linear(hidden, npose)
        self.decshape = nn.Linear(hidden, N_BETAS)
        self.deccam = nn.Linear(hidden, 3)
        for m in (self.decpose, self.decshape, self.deccam):  # SPIN's xavier_uniform_(gain=0.01)
            nn.init.xavier_uniform_(m.weight, gain=0.01)
            if zero_init:  # the first prediction exactly the mean parameters
                nn.init.zeros_(m.weight)
                nn.init.zeros_(m.bias)
        # the identity's 6D, laid out as rot6d_to_rotmat's view(-1, 3, 2) reads it
        self.register_buffer("init_pose", torch.tensor(identity6d).repeat(N_J)[None])
        self.register_buffer("init_shape", torch.zeros(1, N_BETAS))
        self.register_buffer("init_cam", torch.tensor([[0.9, 0.0, 0.0]]))
        self.smpl = BodyModel()
        self.camera, self.rot_eps, self.tz_eps, self.pool = camera, rot_eps, tz_eps, pool
        if pool == "attention":  # PARE-style attention over the person's feature locations
            self.attention = nn.Conv2d(16, 1, 1)

    def features(self, img, fg):
        if self.pool == "avg":
            return self.backbone(img)
        f = self.backbone[:6](img)
        logits = self.attention(f).flatten(1).masked_fill(~fg.flatten(1), float("-inf"))
        att = torch.softmax(logits, dim=1)  # the bug: no foreground location left, 0/0
        return self.backbone[8]((f.flatten(2) * att[:, None]).sum(-1))

    def project(self, joints, cam, bbox):
        if self.camera == "weak":
            return cam[:, None, 0:1] * joints[..., :2] + cam[:, None, 1:]
        s, tx, ty = cam.unbind(1)
        cx, cy, size = bbox.unbind(1)
        bs = s * size + self.tz_eps  # the bug with tz_eps=0: a box of size 0
        tz = 2 * FOCAL / bs
        tx = tx + 2 * (cx - IMG / 2) / bs
        ty = ty + 2 * (cy - IMG / 2) / bs
        p = joints + torch.stack([tx, ty, tz], 1)[:, None]
        return FOCAL * p[..., :2] / p[..., 2:] / (IMG / 2)

    def forward(self, img, bbox=None, fg=None, n_iter: int = 3):
        """``fg``: (B, 8, 8) the person's segmentation at the feature map's size."""
        b = img.shape[0]
        xf = self.features(img, fg)
        pose, shape, cam = (t.expand(b, -1) for t in (self.init_pose, self.init_shape,
                                                      self.init_cam))
        for _ in range(n_iter):  # iterative error feedback
            xc = self.drop1(F.relu(self.fc1(torch.cat([xf, pose, shape, cam], 1))))
            pose = self.decpose(xc) + pose
            shape = self.decshape(xc) + shape
            cam = self.deccam(xc) + cam
        rotmat = rot6d_to_rotmat(pose, self.rot_eps).view(b, N_J, 3, 3)
        verts, joints = self.smpl(shape, rotmat=rotmat)
        return verts, joints, self.project(joints, cam, bbox), shape, rotmat


def make_hmr() -> HMR:
    torch.manual_seed(0)
    return HMR()


def make_hmr_6d_columns() -> HMR:
    """The identity's 6D written as its two columns one after the other, ``[1, 0, 0, 0, 1, 0]``,
    which ``view(-1, 3, 2)`` reads as the columns (1, 0, 1) and (0, 0, 0); a zero-initialised
    head predicts exactly that, and the hand-written Gram-Schmidt has no eps."""
    torch.manual_seed(0)
    return HMR(rot_eps=0.0, identity6d=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0), zero_init=True)


def make_hmr_attention() -> HMR:
    torch.manual_seed(0)
    return HMR(pool="attention")


def make_cliff() -> HMR:
    torch.manual_seed(0)
    return HMR(camera="cliff")


def make_cliff_no_eps() -> HMR:
    torch.manual_seed(0)
    return HMR(camera="cliff", tz_eps=0.0)


def make_hmr_gt_rodrigues_no_eps() -> HMR:
    """Its body model's Rodrigues without the eps; the loop runs it on the SMPL fits."""
    torch.manual_seed(0)
    model = HMR()
    model.smpl.rodrigues_eps = 0.0
    return model


def pelvis_align(j):
    return j - j[:, :1]


def procrustes_align(pred, gt):
    """Pred's similarity transform onto gt (Umeyama): the SVD of the centred joint covariance,
    in float32 under autocast (svd and det have no bf16 kernels)."""
    with torch.autocast(pred.device.type, enabled=False):
        pred, gt = pred.float(), gt.float()
        mu_p, mu_g = pred.mean(1, keepdim=True), gt.mean(1, keepdim=True)
        x, y = pred - mu_p, gt - mu_g
        u, s, vh = torch.linalg.svd(x.transpose(1, 2) @ y)
        d = torch.sign(torch.det(u @ vh))
        fix = torch.ones_like(s)
        fix[:, -1] = d
        r = (u * fix[:, None]) @ vh
        scale = (s * fix).sum(1) / x.pow(2).sum((1, 2))
        return scale[:, None, None] * x @ r + mu_g


class HMRLoss(nn.Module):
    """SPIN's losses. ``kp_norm="conf"``: each image's 2D term divided by the sum of its joints'
    confidences (per image, as several PARE/CLIFF forks write it); ``"mean"``: SPIN's mean of
    ``conf * err``. ``masked="ratio"``: the 3D terms summed over the labelled samples and divided
    by their count (0/0 in a batch without one); ``"clamped"``: the count floored at 1."""

    def __init__(self, kp_norm: str = "mean", masked: str = "clamped", w_pa: float = 0.0,
                 pa_rows: str = "all", w_beta: float = 1e-3, w_pose: float = 0.0,
                 rodrigues_eps: float = 1e-8):
        super().__init__()
        self.w_pose, self.rodrigues_eps = w_pose, rodrigues_eps
        self.kp_norm, self.masked, self.w_pa, self.w_beta = kp_norm, masked, w_pa, w_beta
        self.pa_rows = pa_rows

    def keypoints(self, kp2d, gt_kp2d):
        conf = gt_kp2d[..., 2]
        err = (kp2d - gt_kp2d[..., :2]).pow(2).sum(-1)
        if self.kp_norm == "conf":
            return ((conf * err).sum(1) / conf.sum(1)).mean()  # 0/0: no visible joint
        return (conf * err).mean()

    def labelled(self, per_sample, has):
        n = has.sum()
        if self.masked == "clamped":
            n = n.clamp_min(1)
        return (per_sample * has).sum() / n  # the bug with "ratio": 0/0 with no 3D sample

    def forward(self, verts, joints, kp2d, betas, rotmat, gt_kp2d, gt_joints, has_3d,
                gt_verts, has_smpl, gt_pose):
        loss = 5.0 * self.keypoints(kp2d, gt_kp2d)
        j3d = (pelvis_align(joints) - pelvis_align(gt_joints)).pow(2).sum(-1).mean(1)
        loss = loss + 5.0 * self.labelled(j3d, has_3d)
        v = (verts - gt_verts).abs().sum(-1).mean(1)
        loss = loss + self.labelled(v, has_smpl)
        if self.w_pa and self.pa_rows == "labelled":  # SPIN's way: only the 3D samples
            keep = has_3d.bool()
            pj, gj = joints[keep], gt_joints[keep]
            pa = (procrustes_align(pj, gj) - gj).norm(dim=-1).mean(1)
            loss = loss + self.w_pa * pa.sum() / keep.sum().clamp_min(1)
        elif self.w_pa:  # the bug: the SVD runs on the 2D-only samples' zero joints too
            pa = (procrustes_align(joints, gt_joints) - gt_joints).norm(dim=-1).mean(1)
            loss = loss + self.w_pa * self.labelled(pa, has_3d)
        if self.w_pose:  # SPIN's smpl_losses: rotation matrices against the fits'
            gt_rotmat = batch_rodrigues(gt_pose.reshape(-1, 3), self.rodrigues_eps)
            err = (rotmat - gt_rotmat.view_as(rotmat)).pow(2).mean((1, 2, 3))
            loss = loss + self.w_pose * self.labelled(err, has_smpl)
        return loss + self.w_beta * betas.pow(2).mean()


# ---------------------------------------------------------------------------------------------
# a mixed dataset: 3D-labelled samples (Human3.6M-like) beside 2D-only ones (COCO-like)


class MixedDataset(Dataset):
    """Images, 2D keypoints with confidences, 3D joints and SMPL fits, ``has_3d``/``has_smpl``
    flags, the person's box; the SMPL fits' axis-angle poses go to the loop, which runs the body
    model on them (SPIN's ``gt_out = smpl(...)``). 2D-only samples carry zero poses and joints."""

    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        body = BodyModel()
        self.img = torch.randn(n, 3, IMG, IMG, generator=g)
        self.pose = torch.randn(n, N_J * 3, generator=g) * 0.3
        self.betas = torch.randn(n, N_BETAS, generator=g)
        self.has_3d = (torch.arange(n) % 2 == 0).float()
        self.has_smpl = self.has_3d.clone()
        with torch.no_grad():
            verts, joints = body(self.betas, pose=self.pose)
        self.joints = joints * self.has_3d[:, None, None]
        kp = 0.9 * joints[..., :2] + 0.05 * torch.randn(n, N_J, 2, generator=g)
        conf = (torch.rand(n, N_J, generator=g) > 0.2).float()
        self.kp2d = torch.cat([kp, conf[..., None]], -1)
        self.bbox = torch.cat([16 + 4 * torch.rand(n, 2, generator=g),
                               20 + 8 * torch.rand(n, 1, generator=g)], 1)
        self.pose = self.pose * self.has_smpl[:, None]  # no fit: SPIN's zero pose
        self.fg = torch.rand(n, IMG // 4, IMG // 4, generator=g) > 0.3  # the person's mask

    def __len__(self):
        return self.img.shape[0]

    def __getitem__(self, i):
        return {k: getattr(self, k)[i] for k in
                ("img", "kp2d", "joints", "has_3d", "pose", "betas", "has_smpl", "bbox",
                 "fg")}


def loader(n: int = 64, batch_size: int = 8) -> DataLoader:
    return DataLoader(MixedDataset(n), batch_size=batch_size, shuffle=False)
