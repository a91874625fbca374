"""Human pose / keypoint estimation models of ``tests/test_pose_estimation.py``, written as the
pose repositories write them: a SimpleBaseline-style network (a strided conv backbone with
BatchNorm, a ConvTranspose2d head, a 1x1 conv to one heatmap per joint), HRNet's
``JointsMSELoss`` weighted by ``target_weight``, an integral-regression head (heatmaps
normalised by their sum, or a softmax with a learnable beta, then the expected coordinates,
as Sun et al.'s integral pose and DSNT do), Wing loss, an OKS loss over the person's area,
and a dataset rendering Gaussian target heatmaps per keypoint (HRNet's ``generate_target``)
read through a DataLoader whose ``collate_fn`` returns dicts. The factories live at module
level so that ``nanreplay`` rebuilds them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

N_JOINTS = 4
IMG = 32
HM = 16  # heatmap side: the image's / 2
SIGMA = 1.5
FLIP_PAIRS = ((0, 1), (2, 3))  # (left, right) joints swapped by a horizontal flip
# COCO's per-keypoint falloff constants, for the four joints here
KPT_SIGMAS = (0.026, 0.025, 0.079, 0.079)


def cbr(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class PoseResNet(nn.Module):
    """SimpleBaseline (Xiao et al.): backbone down to 1/4, one deconv layer up to 1/2,
    ``final_layer`` a 1x1 conv to ``n_joints`` heatmaps."""

    def __init__(self, n_joints: int = N_JOINTS, base: int = 8):
        super().__init__()
        self.backbone = nn.Sequential(cbr(3, base, 2), cbr(base, 2 * base, 2))
        self.deconv_layers = nn.Sequential(
            nn.ConvTranspose2d(2 * base, base, 4, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(base), nn.ReLU(inplace=True))
        self.final_layer = nn.Conv2d(base, n_joints, 1)

    def forward(self, x):
        return self.final_layer(self.deconv_layers(self.backbone(x)))


def make_pose_resnet() -> nn.Module:
    torch.manual_seed(0)
    return PoseResNet()


class IntegralHead(nn.Module):
    """Integral regression: heatmaps to a distribution per joint, then its expected (x, y) in
    heatmap pixels. ``norm="sum"`` makes the distribution as many integral-pose repos do,
    ``relu(h) / relu(h).sum()``; ``norm="softmax"`` with a learnable inverse temperature
    ``beta`` written out by hand, ``exp(beta * h) / sum(exp(beta * h))`` (DSNT's flat softmax)."""

    def __init__(self, norm: str = "sum", beta: float = 1.0):
        super().__init__()
        self.norm = norm
        self.beta = nn.Parameter(torch.tensor(float(beta)))
        self.register_buffer("grid", torch.arange(HM, dtype=torch.float32))

    def forward(self, hm, visible=None):
        b, k = hm.shape[:2]
        flat = hm.reshape(b, k, -1)
        if self.norm == "masked":  # invisible joints' heatmaps masked out of the softmax
            flat = flat.masked_fill(visible.reshape(b, k, 1) == 0, float("-inf"))
            prob = F.softmax(self.beta * flat, dim=-1)
        elif self.norm == "sum":
            flat = F.relu(flat)
            if visible is not None:  # the joints annotated invisible weigh nothing
                flat = flat * visible.reshape(b, k, 1)
            prob = flat / flat.sum(dim=2, keepdim=True)
        else:
            e = torch.exp(self.beta * flat)
            prob = e / e.sum(dim=2, keepdim=True)
        prob = prob.reshape(b, k, HM, HM)
        x = (prob.sum(dim=2) * self.grid).sum(dim=-1)
        y = (prob.sum(dim=3) * self.grid).sum(dim=-1)
        return torch.stack([x, y], dim=-1)


class IntegralPose(nn.Module):
    def __init__(self, norm: str = "sum", beta: float = 1.0):
        super().__init__()
        self.net = PoseResNet()
        self.integral = IntegralHead(norm, beta)

    def forward(self, x, visible=None):
        return self.integral(self.net(x), visible)


def make_integral(norm: str = "sum", beta: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    return IntegralPose(norm, beta)


def make_integral_softmax() -> nn.Module:
    return make_integral("softmax", 1.0)


class JointsMSELoss(nn.Module):
    """HRNet's ``JointsMSELoss`` (lib/core/loss.py), joint by joint."""

    def __init__(self, use_target_weight: bool = True):
        super().__init__()
        self.criterion = nn.MSELoss(reduction="mean")
        self.use_target_weight = use_target_weight

    def forward(self, output, target, target_weight):
        batch_size, num_joints = output.size(0), output.size(1)
        heatmaps_pred = output.reshape((batch_size, num_joints, -1)).split(1, 1)
        heatmaps_gt = target.reshape((batch_size, num_joints, -1)).split(1, 1)
        loss = 0
        for idx in range(num_joints):
            heatmap_pred = heatmaps_pred[idx].squeeze(1)
            heatmap_gt = heatmaps_gt[idx].squeeze(1)
            if self.use_target_weight:
                loss = loss + 0.5 * self.criterion(heatmap_pred.mul(target_weight[:, idx]),
                                                   heatmap_gt.mul(target_weight[:, idx]))
            else:
                loss = loss + 0.5 * self.criterion(heatmap_pred, heatmap_gt)
        return loss / num_joints


class HeatmapKLLoss(nn.Module):
    """A distribution loss on heatmaps (as DSNT's JS/KL regularisers): the target heatmap
    normalised by its sum into a distribution, the prediction by a log-softmax, their KL per
    joint weighted by visibility (``use_target_weight``, as HRNet's losses take it)."""

    def __init__(self, use_target_weight: bool = True):
        super().__init__()
        self.use_target_weight = use_target_weight

    def forward(self, output, target, target_weight):
        b, k = output.shape[:2]
        logp = F.log_softmax(output.reshape(b, k, -1), dim=-1)
        t = target.reshape(b, k, -1)
        q = t / t.sum(dim=-1, keepdim=True)  # the bug: 0/0 for an all-zero (invisible) target
        kl = (q * (torch.log(q + 1e-10) - logp)).sum(-1)
        if not self.use_target_weight:
            return kl.mean()
        return (kl * target_weight[..., 0]).sum() / target_weight.sum().clamp_min(1)


class WingLoss(nn.Module):
    """Feng et al.'s Wing loss on keypoint coordinates (pixels), visibility weighted."""

    def __init__(self, omega: float = 10.0, epsilon: float = 2.0):
        super().__init__()
        self.omega, self.epsilon = omega, epsilon

    def forward(self, pred, target, target_weight):
        delta = (target - pred).abs()
        c = self.omega - self.omega * math.log(1 + self.omega / self.epsilon)
        loss = torch.where(delta < self.omega,
                           self.omega * torch.log(1 + delta / self.epsilon), delta - c)
        return (loss * target_weight).sum() / target_weight.sum().clamp_min(1)


class OKSLoss(nn.Module):
    """1 - OKS per visible keypoint: ``exp(-d^2 / (2 s^2 k^2))`` with the person's area as
    ``s^2`` (COCO's ``computeOks``), in image pixels (heatmap coordinates times 2)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("sigmas", torch.tensor(KPT_SIGMAS))

    def forward(self, pred, target, target_weight, area):
        d2 = ((pred - target) * (IMG / HM)).pow(2).sum(-1)
        var = (2 * self.sigmas) ** 2
        e = d2 / var / area[:, None] / 2  # the bug: COCO adds np.spacing(1) to the area
        oks = torch.exp(-e)
        w = target_weight[..., 0]
        return ((1 - oks) * w).sum() / w.sum().clamp_min(1)


class IntegralLoss(nn.Module):
    """Integral regression's L1 on the expected coordinates, visibility weighted."""

    def forward(self, pred, target, target_weight):
        return ((pred - target).abs() * target_weight).sum() / target_weight.sum().clamp_min(1)


# ---------------------------------------------------------------------------------------------
# data


def render_heatmaps(joints, vis, sigma: float = SIGMA):
    """HRNet's ``generate_target``: a Gaussian per joint at its heatmap position; a joint that
    is not visible (or outside the heatmap) gets an all-zero heatmap and target weight 0."""
    k = joints.shape[0]
    yy, xx = torch.meshgrid(torch.arange(HM, dtype=torch.float32),
                            torch.arange(HM, dtype=torch.float32), indexing="ij")
    target = torch.zeros(k, HM, HM)
    weight = vis.float().clone()
    for j in range(k):
        mu = joints[j]
        if weight[j] == 0 or not (0 <= mu[0] < HM and 0 <= mu[1] < HM):
            weight[j] = 0
            continue
        target[j] = torch.exp(-((xx - mu[0]) ** 2 + (yy - mu[1]) ** 2) / (2 * sigma ** 2))
    return target, weight[:, None]


class KeypointDataset(Dataset):
    """Synthetic people: a bright blob per joint on a noisy image, joints in heatmap pixels.
    ``invisible`` maps an index to the joints annotated invisible (v=0); ``area`` overrides
    a person's annotated area (pixels^2)."""

    def __init__(self, n: int = 32, invisible=None, area=None, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.joints = torch.rand(n, N_JOINTS, 2, generator=g) * (HM - 4) + 2
        self.images = torch.randn(n, 3, IMG, IMG, generator=g) * 0.1
        yy, xx = torch.meshgrid(torch.arange(IMG, dtype=torch.float32),
                                torch.arange(IMG, dtype=torch.float32), indexing="ij")
        for i in range(n):
            for j in range(N_JOINTS):
                cx, cy = (self.joints[i, j] * IMG / HM).tolist()
                blob = torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / 4.0)
                self.images[i, j % 3] += blob
        self.vis = torch.ones(n, N_JOINTS, dtype=torch.long)
        for i, js in (invisible or {}).items():
            self.vis[i, list(js)] = 0
        self.area = torch.full((n,), float(IMG * IMG) / 2)
        for i, a in (area or {}).items():
            self.area[i] = a

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        target, weight = render_heatmaps(self.joints[i], self.vis[i])
        return {"image": self.images[i], "joints": self.joints[i], "target": target,
                "target_weight": weight, "area": self.area[i], "index": i}


def collate(items):
    """A dict of stacked fields, as mmpose's and many repos' collate functions return."""
    return {key: (torch.stack([it[key] for it in items]) if torch.is_tensor(items[0][key])
                  else torch.tensor([it[key] for it in items])) for key in items[0]}


def loader(ds, batch_size: int = 4, workers: int = 0) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, shuffle=False, collate_fn=collate,
                      num_workers=workers, persistent_workers=False)


def flip_batch(batch):
    """The horizontal flip augmentation on the loader's tensors (as on GPU, in the loop):
    image and target heatmaps mirrored, left/right joints swapped, x coordinates mirrored."""
    out = dict(batch)
    out["image"] = batch["image"].flip(-1)
    perm = list(range(N_JOINTS))
    for a, b in FLIP_PAIRS:
        perm[a], perm[b] = b, a
    out["target"] = batch["target"].flip(-1)[:, perm]
    out["target_weight"] = batch["target_weight"][:, perm]
    joints = batch["joints"][:, perm].clone()
    joints[..., 0] = HM - 1 - joints[..., 0]
    out["joints"] = joints
    return out


def flip_back(output, flip_pairs=FLIP_PAIRS):
    """HRNet's ``flip_back`` on a batch of heatmaps (on the device, not in NumPy): mirrored
    back, left and right joints swapped."""
    output = output.flip(3)
    perm = list(range(output.shape[1]))
    for a, b in flip_pairs:
        perm[a], perm[b] = b, a
    return output[:, perm]


def flip_coords(coords, flip_pairs=FLIP_PAIRS):
    """Coordinates predicted on the flipped image, back in the original: x mirrored, left
    and right joints swapped."""
    perm = list(range(coords.shape[1]))
    for a, b in flip_pairs:
        perm[a], perm[b] = b, a
    out = coords[:, perm].clone()
    out[..., 0] = HM - 1 - out[..., 0]
    return out


def make_integral_masked() -> nn.Module:
    return make_integral("masked", 1.0)


class BatchPose(nn.Module):
    """An mmpose-style estimator called with the whole batch dict, ``model(batch)``: it reads
    the image and the visibility it masks the integral head's heatmaps with."""

    def __init__(self):
        super().__init__()
        self.pose = IntegralPose("sum")

    def forward(self, batch):
        return self.pose(batch["image"], batch["target_weight"])


def make_batch_pose() -> nn.Module:
    torch.manual_seed(0)
    return BatchPose()


class AdaptiveWingLoss(nn.Module):
    """Wang et al.'s Adaptive Wing loss on heatmaps, as the authors' repository writes it
    (the pixels split by ``delta < theta`` with boolean masks, ``pow`` with the exponent
    ``alpha - y`` of the target), over the visible joints' heatmaps."""

    def __init__(self, omega: float = 14.0, theta: float = 0.5, epsilon: float = 1.0,
                 alpha: float = 2.1):
        super().__init__()
        self.omega, self.theta, self.epsilon, self.alpha = omega, theta, epsilon, alpha

    def forward(self, pred, target, target_weight):
        w = target_weight[..., None]
        y, y_hat = target * w, pred * w
        delta_y = (y - y_hat).abs()
        delta_y1 = delta_y[delta_y < self.theta]
        delta_y2 = delta_y[delta_y >= self.theta]
        y1 = y[delta_y < self.theta]
        y2 = y[delta_y >= self.theta]
        loss1 = self.omega * torch.log(1 + torch.pow(delta_y1 / self.epsilon, self.alpha - y1))
        A = self.omega * (1 / (1 + torch.pow(self.theta / self.epsilon, self.alpha - y2))) * (
            self.alpha - y2) * torch.pow(self.theta / self.epsilon, self.alpha - y2 - 1) * (
            1 / self.epsilon)
        C = self.theta * A - self.omega * torch.log(
            1 + torch.pow(self.theta / self.epsilon, self.alpha - y2))
        loss2 = A * delta_y2 - C
        return (loss1.sum() + loss2.sum()) / (len(loss1) + len(loss2))
