"""Skeleton-based action recognition and motion prediction written as ST-GCN, MS-G3D, CTR-GCN
and 2s-AGCN's repositories write them, for ``test_skeleton_action``.

Input layout is ST-GCN's ``(N, C, T, V, M)``: coordinates, frames, joints, persons (the second
person zero-filled when only one is in the clip), with the pose estimator's confidence
``(N, T, V, M)`` (0 for a joint it missed, whose coordinates it zero-fills).

- ``STGCN``: data batch-norm over ``V * C`` channels, persons folded into the batch
  (``N * M``), spatial graph convolutions with 2s-AGCN's learned adjacency offset and
  confidence-masked edges, the graph normalised ``D^-1/2 A D^-1/2`` per sample, temporal
  convolutions, a residual, global pooling and the mean over persons.
- ``BoneStream``: 2s-AGCN's bone stream (child minus parent), normalised to unit length, and
  joint angles by ``acos`` of the normalised bones' dot products (a kinematic feature).
- ``MultiScaleGraphConv``: MS-G3D's disentangled k-hop graphs, normalised once when built.
- ``PersonNorm``: each person centred on the hip and scaled by their own body size.
- ``SkeletonClips``: a Dataset normalising each person by their torso length when read.
- ``MotionPredictor``: a GRU over poses, predicting the next frames as residuals, with a
  relative velocity loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# An 8-joint upper-body skeleton: hip, spine, neck, head, shoulders, hands.
PARENTS = [0, 0, 1, 2, 2, 4, 2, 6]
BONES = [(j, p) for j, p in enumerate(PARENTS) if j != p]
V = len(PARENTS)


def adjacency(self_loops: bool = True) -> torch.Tensor:
    a = torch.zeros(V, V)
    for j, p in BONES:
        a[j, p] = a[p, j] = 1.0
    return a + torch.eye(V) if self_loops else a


def normalize_sym(a: torch.Tensor, guard: str = "") -> torch.Tensor:
    """D^-1/2 A D^-1/2 over the last two dims (GCN's symmetric normalisation). ``guard``: an
    isolated joint's row and column left at 0, after the pow (``"fill"``: PyG's
    ``deg_inv_sqrt.masked_fill_(deg_inv_sqrt == inf, 0)``, whose backward through a learned
    degree is still inf * 0) or with the pow given a safe base (``"safe"``)."""
    deg = a.sum(-1)
    if guard == "safe":
        deg = torch.where(deg > 0, deg, torch.ones_like(deg))
    d = deg.pow(-0.5)  # the bug: a joint without edges has degree 0
    if guard:
        d = d.masked_fill(a.sum(-1) == 0, 0.0)
    return d[..., :, None] * a * d[..., None, :]


class GraphConv(nn.Module):
    """ST-GCN's spatial unit with 2s-AGCN's learned offset ``B`` added to the fixed graph; the
    edges of joints the estimator missed are cut per sample (``conf`` as an extra argument)."""

    def __init__(self, cin: int, cout: int, self_loops: bool = True, guard: str = ""):
        super().__init__()
        self.register_buffer("A", adjacency(self_loops))
        self.guard = guard
        self.B = nn.Parameter(torch.zeros(V, V))
        self.conv = nn.Conv2d(cin, cout, 1)

    def forward(self, x, conf):  # x (N, C, T, V), conf (N, T, V)
        seen = (conf > 0.1).float().amax(1)  # (N, V): a joint seen in some frame
        a = (self.A + self.B.abs()) * seen[:, :, None] * seen[:, None, :]
        a = normalize_sym(a, self.guard)
        return torch.einsum("nctv,nvw->nctw", self.conv(x), a)


class STGCNBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1, self_loops: bool = True,
                 guard: str = ""):
        super().__init__()
        self.gcn = GraphConv(cin, cout, self_loops, guard)
        self.tcn = nn.Sequential(nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, (3, 1), (stride, 1), (1, 0)),
                                 nn.BatchNorm2d(cout), nn.Dropout(0.0))
        self.residual = (nn.Identity() if cin == cout and stride == 1
                         else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)),
                                            nn.BatchNorm2d(cout)))

    def forward(self, x, conf):
        return F.relu(self.tcn(self.gcn(x, conf)) + self.residual(x))


class STGCN(nn.Module):
    def __init__(self, in_channels: int = 3, classes: int = 5, persons: int = 2,
                 self_loops: bool = True, stream: nn.Module | None = None, guard: str = "",
                 attention: bool = False, valid_mean: bool = False):
        super().__init__()
        self.stream = stream if stream is not None else nn.Identity()
        self.data_bn = nn.BatchNorm1d(persons * V * in_channels)
        self.blocks = nn.ModuleList([STGCNBlock(in_channels, 16, 1, self_loops, guard),
                                     STGCNBlock(16, 32, 2, self_loops, guard)])
        self.pool = JointAttentionPool(32) if attention else None
        self.fc = nn.Linear(32, classes)
        self.valid_mean = valid_mean  # the mean over the persons seen, not over M

    def forward(self, x, conf):  # x (N, C, T, V, M), conf (N, T, V, M)
        x = self.stream(x)
        n, c, t, v, m = x.shape
        x = x.permute(0, 4, 3, 1, 2).reshape(n, m * v * c, t)
        x = self.data_bn(x).view(n, m, v, c, t).permute(0, 1, 3, 4, 2).reshape(n * m, c, t, v)
        conf = conf.permute(0, 3, 1, 2).reshape(n * m, t, v)
        for block in self.blocks:
            x = block(x, conf)
        x = x.mean(2) if self.pool is None else self.pool(x.mean(2), conf)
        x = x.mean(-1).view(n, m, -1)
        if self.valid_mean:
            present = (conf.view(n, m, -1).amax(-1) > 0.1).float()  # (N, M)
            # the bug: a clip where the estimator found nobody has no person to average
            x = (x * present[..., None]).sum(1) / present.sum(1, keepdim=True)
        else:
            x = x.mean(1)
        return self.fc(x)


class JointAttentionPool(nn.Module):
    """Attention over the joints, the missing ones masked with -inf (where a person has any
    joint seen: the padded person, none seen, is left unmasked, its features all 0)."""

    def __init__(self, channels: int):
        super().__init__()
        self.score = nn.Linear(channels, 1)

    def forward(self, x, conf):  # x (N*M, C, V), conf (N*M, T, V)
        seen = conf.amax(1) > 0.1
        logits = self.score(x.transpose(1, 2)).squeeze(-1)  # (N*M, V)
        hide = ~seen & seen.any(-1, keepdim=True)
        w = logits.masked_fill(hide, float("-inf")).softmax(-1)
        return x * w[:, None] * V


def make_stgcn() -> STGCN:
    torch.manual_seed(0)
    return STGCN()


def make_stgcn_filled() -> STGCN:
    """Isolated joints' inverse degrees filled with 0 after the pow, attention pooling over
    the seen joints."""
    torch.manual_seed(0)
    return STGCN(guard="fill", attention=True)


def make_stgcn_guarded() -> STGCN:
    """Isolated joints' degrees made safe before the pow, attention pooling as above."""
    torch.manual_seed(0)
    return STGCN(guard="safe", attention=True)


def make_stgcn_person_mean() -> STGCN:
    """The guarded graph, persons averaged over those present in the clip."""
    torch.manual_seed(0)
    return STGCN(guard="safe", valid_mean=True)


def k_adjacency(k: int) -> torch.Tensor:
    """MS-G3D's disentangled k-hop adjacency: joints exactly k hops apart (k = 0: self)."""
    if k == 0:
        return torch.eye(V)
    hop = adjacency(True)
    reach = [torch.linalg.matrix_power(hop, i).clamp(max=1) for i in (k - 1, k)]
    return reach[1] - reach[0]


class MultiScaleGraphConv(nn.Module):
    """MS-G3D's MS-GCN: one 1x1 conv per scale, over that scale's normalised graph; the
    graphs built once (the bug: more scales than the skeleton's diameter leave a graph with
    no edge, whose D^-1/2 is inf everywhere and makes the buffer NaN)."""

    def __init__(self, cin: int, cout: int, scales: int):
        super().__init__()
        self.register_buffer("A", torch.stack([normalize_sym(k_adjacency(k))
                                               for k in range(scales)]))
        self.conv = nn.Conv2d(cin, cout * scales, 1)
        self.scales = scales

    def forward(self, x, conf):
        n, _, t, v = x.shape
        y = self.conv(x).view(n, self.scales, -1, t, v)
        return torch.einsum("nkctv,kvw->nctw", y, self.A)


def make_msg3d(scales: int = 6) -> STGCN:
    """ST-GCN with MS-G3D's multi-scale graph convolution in each block; 6 scales on a
    skeleton 4 hops across."""
    torch.manual_seed(0)
    model = STGCN()
    for b in model.blocks:
        conv = b.gcn.conv
        b.gcn = MultiScaleGraphConv(conv.in_channels, conv.out_channels, scales)
    return model


# ---------------------------------------------------------------------------------------------
# bone stream and joint angles


class BoneStream(nn.Module):
    """2s-AGCN's bone input: each bone the child joint minus its parent, as a unit direction
    times its length's log (scale-invariant directions, as several skeleton papers use)."""

    def forward(self, x):  # (N, 3, T, V, M)
        bones = x[:, :, :, 1:] - x[:, :, :, PARENTS[1:]]  # (the root has no bone)
        length = bones.norm(dim=1, keepdim=True)
        unit = bones / length  # the bug: a zero-filled frame has bones of length 0
        return torch.cat([torch.zeros_like(x[:, :, :, :1]), unit], 3)


class AngleStream(nn.Module):
    """Each joint's bending angle: acos of the dot product of its bone and its parent's bone,
    both normalised (F.normalize's eps keeps zero bones finite); 3 channels: angle, its cos,
    and the bone length."""

    def forward(self, x):  # (N, 3, T, V, M)
        bones = torch.zeros_like(x)
        for j, p in BONES:
            bones[:, :, :, j] = x[:, :, :, j] - x[:, :, :, p]
        u = F.normalize(bones, dim=1)
        parent = u[:, :, :, PARENTS]
        cos = (u * parent).sum(1, keepdim=True)
        angle = torch.acos(cos)  # the bug: no clamp, acos'(±1) is infinite
        return torch.cat([angle, cos, bones.norm(dim=1, keepdim=True)], 1)


class RandomRotation(nn.Module):
    """ST-GCN's random_rot as a layer, in training mode only, drawing from its own generator
    (as GPU augmentation pipelines keep one, seeded once)."""

    def __init__(self, degrees: float = 15.0, seed: int = 3):
        super().__init__()
        self.degrees, self.gen = degrees, torch.Generator().manual_seed(seed)

    def forward(self, x):
        return random_rotation(x, self.gen, self.degrees) if self.training else x


def make_angle_augmented() -> STGCN:
    """The angle stream after a rotation layer with its own generator."""
    torch.manual_seed(0)
    return STGCN(stream=nn.Sequential(RandomRotation(), AngleStream()))


def make_bone() -> STGCN:
    torch.manual_seed(0)
    return STGCN(stream=BoneStream())


def make_angle() -> STGCN:
    torch.manual_seed(0)
    return STGCN(stream=AngleStream())


# ---------------------------------------------------------------------------------------------
# per-person normalisation


class PersonNorm(nn.Module):
    """Centre each person on their hip (joint 0 of the first frame) and divide by their size,
    the largest joint distance from it over the clip."""

    def forward(self, x):  # (N, 3, T, V, M)
        centred = x - x[:, :, :1, :1]
        scale = centred.norm(dim=1, keepdim=True).amax((2, 3), keepdim=True)
        return centred / scale  # the bug: the padded second person has size 0


def make_person_norm() -> STGCN:
    torch.manual_seed(0)
    return STGCN(stream=PersonNorm())


# ---------------------------------------------------------------------------------------------
# data


def skeleton_batch(g: torch.Generator, n: int = 10, t: int = 6, classes: int = 5):
    """Noisy upper-body poses in metres, both persons present, every joint seen."""
    rest = torch.tensor([[0, 0, 0], [0, .3, 0], [0, .6, 0], [0, .8, 0], [-.2, .6, 0],
                         [-.5, .5, 0], [.2, .6, 0], [.5, .5, 0]]).T  # (3, V)
    x = rest[None, :, None, :, None] + 0.05 * torch.randn(n, 3, t, V, 2, generator=g)
    x[..., 1] += 1.0  # the second person stands a metre to the side
    conf = 0.5 + 0.5 * torch.rand(n, t, V, 2, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, conf, y


class SkeletonClips(torch.utils.data.Dataset):
    """Clips normalised as NTU loaders do when they are read: centred on the first frame's
    hip, divided by that frame's torso length (hip to neck), so every subject has one size."""

    def __init__(self, x, conf, y):
        self.x, self.conf, self.y = x, conf, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i] - self.x[i, :, :1, :1]
        torso = (x[:, 0, 2] - x[:, 0, 0]).norm(dim=0)  # (M,): each person's
        return x / torso, self.conf[i], self.y[i]  # the bug: a padded person's torso is 0


def balanced_class_weights(labels: torch.Tensor, classes: int) -> torch.Tensor:
    """sklearn's 'balanced' weights, n / (classes * count): the rare actions weigh more."""
    counts = torch.bincount(labels, minlength=classes).float()
    return counts.sum() / (classes * counts)  # the bug: an action absent from the split


def random_rotation(x: torch.Tensor, g: torch.Generator, degrees: float = 15.0):
    """ST-GCN's random_rot augmentation: a rotation about the vertical axis per sample."""
    theta = (torch.rand(x.shape[0], generator=g) * 2 - 1) * degrees * torch.pi / 180
    c, s, z, o = theta.cos(), theta.sin(), torch.zeros_like(theta), torch.ones_like(theta)
    rot = torch.stack([torch.stack([c, z, s], -1), torch.stack([z, o, z], -1),
                       torch.stack([-s, z, c], -1)], -2)  # (N, 3, 3)
    return torch.einsum("nij,njtvm->nitvm", rot, x)


def missing_joints(x, conf, row: int, joints=(5, 7)):
    """The estimator lost ``joints`` of sample ``row`` in every frame: conf 0, coordinates 0."""
    x[row, :, :, list(joints)] = 0.0
    conf[row, :, list(joints)] = 0.0


def lost_frame(x, conf, row: int, frame: int):
    """The estimator lost the person in one frame of ``row``: every joint zero-filled."""
    x[row, :, frame, :, 0] = 0.0
    conf[row, frame, :, 0] = 0.0


def single_person(x, conf, row: int):
    """Only one person in the clip: the second is padded with zeros."""
    x[row, ..., 1] = 0.0
    conf[row, ..., 1] = 0.0


def empty_clip(x, conf, row: int):
    """The estimator found nobody in clip ``row``: both persons zero-filled."""
    x[row] = 0.0
    conf[row] = 0.0


def straight_arm(x, row: int):
    """Sample ``row`` holds its left arm straight out: neck, shoulder and hand collinear."""
    x[row, :, :, 2, 0] = torch.tensor([0.0, 0.5, 0.0])[:, None]
    x[row, :, :, 4, 0] = torch.tensor([-0.25, 0.5, 0.0])[:, None]
    x[row, :, :, 5, 0] = torch.tensor([-0.5, 0.5, 0.0])[:, None]


# ---------------------------------------------------------------------------------------------
# motion prediction


class MotionPredictor(nn.Module):
    """A seq2seq GRU over flattened poses (Martinez et al. 2017): the decoder predicts each next
    pose as a residual of the last one."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.encoder = nn.GRU(3 * V, hidden, batch_first=True)
        self.cell = nn.GRUCell(3 * V, hidden)
        self.out = nn.Linear(hidden, 3 * V)

    def forward(self, past, horizon: int):  # past (N, T, V, 3)
        n, t = past.shape[:2]
        _, h = self.encoder(past.reshape(n, t, -1))
        h, pose, preds = h[0], past[:, -1].reshape(n, -1), []
        for _ in range(horizon):
            h = self.cell(pose, h)
            pose = pose + self.out(h)
            preds.append(pose)
        return torch.stack(preds, 1).view(n, horizon, V, 3)


def make_motion() -> MotionPredictor:
    torch.manual_seed(0)
    return MotionPredictor()


def make_motion_zero_velocity() -> MotionPredictor:
    """The residual head zero-initialised: training starts from the zero-velocity baseline
    (the last pose repeated), a strong start for motion prediction."""
    model = make_motion()
    nn.init.zeros_(model.out.weight)
    nn.init.zeros_(model.out.bias)
    return model


class RelativeVelocityLoss(nn.Module):
    """MPJPE plus the velocity error relative to each joint's true speed and an acceleration
    term; ``eps`` (0: the bug) keeps a joint at rest, speed 0, out of the division."""

    def __init__(self, eps: float = 0.0):
        super().__init__()
        self.eps = eps

    def forward(self, pred, future, last):
        pos = (pred - future).norm(dim=-1).mean()
        vp = torch.diff(torch.cat([last[:, None], pred], 1), dim=1)
        vt = torch.diff(torch.cat([last[:, None], future], 1), dim=1)
        rel = (vp - vt).norm(dim=-1) / (vt.norm(dim=-1) + self.eps)
        acc = (torch.diff(vp, dim=1) - torch.diff(vt, dim=1)).abs().mean()
        return pos + 0.1 * rel.mean() + 0.1 * acc


def mpjpe_loss(pred, future, last):
    """Mean per-joint position error, the distance written out, plus the velocity error."""
    pos = ((pred - future) ** 2).sum(-1).sqrt().mean()  # the bug: sqrt'(0) is infinite
    vp = torch.diff(torch.cat([last[:, None], pred], 1), dim=1)
    vt = torch.diff(torch.cat([last[:, None], future], 1), dim=1)
    return pos + 0.1 * (vp - vt).abs().mean()


def motion_batch(g: torch.Generator, n: int = 8, t: int = 6, horizon: int = 4,
                 frozen: int | None = None):
    """Poses drifting with a random velocity; ``frozen``: a sample whose capture froze (the
    same pose repeated, every joint's speed exactly 0)."""
    base = torch.randn(n, 1, V, 3, generator=g) * 0.3
    vel = torch.randn(n, 1, V, 3, generator=g) * 0.02
    steps = torch.arange(t + horizon, dtype=torch.float32)[None, :, None, None]
    seq = base + vel * steps + 0.005 * torch.randn(n, t + horizon, V, 3, generator=g)
    if frozen is not None:
        seq[frozen] = seq[frozen, :1]
    return seq[:, :t], seq[:, t:]
