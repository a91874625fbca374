"""Protein structure models written the way the public repositories write them, for
``test_protein_structure.py``.

- ``StructureModule``: OpenFold's (``openfold/model/structure_module.py``) and FrameDiff's
  structure module, small: backbone frames from the N, CA, C atoms by Gram-Schmidt
  (``Rigid.from_3_points``, AF2 supplement Alg. 21), an invariant point attention whose query
  and key points are moved through the frames (``InvariantPointAttention``), a backbone update
  of a quaternion ``(1, b, c, d)`` normalised by its norm and a translation
  (``BackboneUpdate``), torsion angles predicted as unnormalised 2D vectors and divided by
  their norm (``AngleResnet``), a distogram head, and recycling of the detached single
  representation (``RecyclingEmbedder``).
- ``AlphaFoldLoss``: FAPE (``openfold/utils/loss.py:compute_fape``: ``sqrt(d^2 + eps)``,
  clamped at 10 A) and the distogram cross-entropy averaged per chain over its residues,
  optionally a pLDDT cross-entropy per chain (unresolved residues ``ignore_index``) and a
  geodesic rotation loss ``acos((tr(R_pred^T R_true) - 1) / 2)``; chains filtered by their
  resolution as OpenFold's losses filter them.
- ``EGNN``: Satorras et al.'s ``egnn_clean.py`` (``E_GCL`` with ``normalize=True``: the
  coordinate update ``(x_i - x_j) * phi(m_ij) / (|x_i - x_j| + epsilon)``), over edge lists
  of the residues' CA atoms, chains flattened into one graph as the QM9 example does.

Chains are padded to the batch's longest by ``collate`` (a DataLoader's ``collate_fn``): zero
coordinates and a 0 in ``mask`` where a residue is padding or unresolved."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

C_S, HEADS, POINTS, BINS, ANGLES = 16, 2, 2, 8, 3
LENGTH, BATCH = 8, 4


def rigid_from_3_points(n, ca, c, eps: float):
    """Frames from three atoms, as ``Rigid.from_3_points``: rotation columns e1, e2, e3."""
    v1, v2 = c - ca, n - ca
    e1 = v1 / torch.sqrt((v1 ** 2).sum(-1, keepdim=True) + eps)
    u2 = v2 - e1 * (e1 * v2).sum(-1, keepdim=True)
    e2 = u2 / torch.sqrt((u2 ** 2).sum(-1, keepdim=True) + eps)
    e3 = torch.cross(e1, e2, dim=-1)
    return torch.stack([e1, e2, e3], dim=-1), ca


def quat_to_rot(q):
    a, b, c, d = q.unbind(-1)
    return torch.stack([
        a * a + b * b - c * c - d * d, 2 * (b * c - a * d), 2 * (b * d + a * c),
        2 * (b * c + a * d), a * a - b * b + c * c - d * d, 2 * (c * d - a * b),
        2 * (b * d - a * c), 2 * (c * d + a * b), a * a - b * b - c * c + d * d,
    ], dim=-1).view(*q.shape[:-1], 3, 3)


def apply(rot, trans, x):
    """Points ``x`` (..., L, P, 3) moved through the frames (..., L, 3, 3), (..., L, 3)."""
    return torch.einsum("...ij,...pj->...pi", rot, x) + trans[..., None, :]


def invert_apply(rot, trans, x):
    return torch.einsum("...ji,...pj->...pi", rot, x - trans[..., None, :])


class InvariantPointAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(C_S, HEADS * C_S) for _ in range(3))
        self.q_pts = nn.Linear(C_S, HEADS * POINTS * 3)
        self.k_pts = nn.Linear(C_S, HEADS * POINTS * 3)
        self.head_weights = nn.Parameter(torch.zeros(HEADS))
        self.out = nn.Linear(HEADS * C_S, C_S)

    def forward(self, s, rot, trans, mask):
        b, n, _ = s.shape
        q = self.q(s).view(b, n, HEADS, C_S)
        k = self.k(s).view(b, n, HEADS, C_S)
        v = self.v(s).view(b, n, HEADS, C_S)
        qp = apply(rot, trans, self.q_pts(s).view(b, n, HEADS * POINTS, 3))
        kp = apply(rot, trans, self.k_pts(s).view(b, n, HEADS * POINTS, 3))
        d2 = ((qp[:, :, None] - kp[:, None]) ** 2).sum(-1).view(b, n, n, HEADS, POINTS).sum(-1)
        w = F.softplus(self.head_weights) * math.sqrt(2.0 / (9.0 * POINTS))
        a = torch.einsum("bihc,bjhc->bijh", q, k) / math.sqrt(C_S) - 0.5 * w * d2
        a = a + 1e5 * (mask[:, None, :, None] * mask[:, :, None, None] - 1)
        a = torch.softmax(a, dim=2)
        return self.out(torch.einsum("bijh,bjhc->bihc", a, v).reshape(b, n, -1))


class BackboneUpdate(nn.Module):
    """OpenFold's: ``(1, b, c, d)`` normalised; ``full_quaternion``: all four predicted."""

    def __init__(self, full_quaternion: bool):
        super().__init__()
        self.full = full_quaternion
        self.linear = nn.Linear(C_S, 7 if full_quaternion else 6)
        nn.init.zeros_(self.linear.weight)  # AF2's init="final"
        nn.init.zeros_(self.linear.bias)

    def forward(self, s):
        u = self.linear(s)
        if self.full:
            q, t = u[..., :4], u[..., 4:]
        else:
            q = torch.cat([torch.ones_like(u[..., :1]), u[..., :3]], dim=-1)
            t = u[..., 3:]
        q = q / q.norm(dim=-1, keepdim=True)
        return quat_to_rot(q), t


class AngleResnet(nn.Module):
    def __init__(self, eps: float):
        super().__init__()
        self.linear_in = nn.Linear(C_S, C_S)
        self.linear_out = nn.Linear(C_S, ANGLES * 2)
        self.eps = eps

    def forward(self, s, mask):
        a = self.linear_in(F.relu(s))
        unnorm = self.linear_out(F.relu(a)).view(*s.shape[:-1], ANGLES, 2)
        unnorm = unnorm * mask[..., None, None]  # padding predicts no angle
        norm = torch.sqrt(torch.clamp((unnorm ** 2).sum(-1, keepdim=True), min=self.eps))
        return unnorm / norm, unnorm


class StructureModule(nn.Module):
    def __init__(self, frame_eps=1e-8, angle_eps=1e-12, full_quaternion=False, blocks=2):
        super().__init__()
        self.embed = nn.Embedding(21, C_S, padding_idx=0)
        self.recycle = nn.LayerNorm(C_S)
        self.ipa = InvariantPointAttention()
        self.norm = nn.LayerNorm(C_S)
        self.transition = nn.Sequential(nn.Linear(C_S, C_S), nn.ReLU(), nn.Linear(C_S, C_S))
        self.bb_update = BackboneUpdate(full_quaternion)
        self.angles = AngleResnet(angle_eps)
        self.distogram = nn.Linear(C_S, BINS)
        self.frame_eps, self.blocks = frame_eps, blocks
        self.plddt = nn.Linear(C_S, 4)  # pLDDT bins

    def forward(self, aatype, coords, mask, recycles: int = 1):
        n, ca, c = coords.unbind(-2)
        rot0, trans0 = rigid_from_3_points(n, ca, c, self.frame_eps)  # FrameDiff's noisy input
        prev = torch.zeros(*aatype.shape, C_S)
        for _ in range(recycles + 1):
            s = self.embed(aatype) + self.recycle(prev.detach())
            rot, trans = rot0, trans0
            for _ in range(self.blocks):
                s = self.norm(s + self.ipa(s, rot, trans, mask))
                s = s + self.transition(s)
                r, t = self.bb_update(s)
                trans = trans + torch.einsum("...ij,...j->...i", rot, t)
                rot = rot @ r
            prev = s
        angles, unnorm = self.angles(s, mask)
        pair = self.distogram(s[:, :, None] + s[:, None])
        return {"rot": rot, "trans": trans, "angles": angles, "unnorm": unnorm, "distogram": pair,
                "plddt": self.plddt(s)}


def make_structure(**kw) -> StructureModule:
    torch.manual_seed(0)
    return StructureModule(**kw)


class AlphaFoldLoss(nn.Module):
    """FAPE over CA positions plus the distogram cross-entropy, each averaged per chain."""

    def __init__(self, fape_eps: float = 1e-4, clamp: float = 10.0, per_chain_eps: float = 1e-6,
                 frame_eps: float = 1e-8, rotation_weight: float = 0.0, plddt_weight: float = 0.0):
        super().__init__()
        self.fape_eps, self.clamp, self.per_chain_eps = fape_eps, clamp, per_chain_eps
        self.frame_eps, self.rotation_weight = frame_eps, rotation_weight
        self.plddt_weight = plddt_weight

    def forward(self, out, coords, mask, resolution):
        n, ca, c = coords.unbind(-2)
        rot_t, trans_t = rigid_from_3_points(n, ca, c, self.frame_eps)
        x_p = invert_apply(out["rot"], out["trans"], out["trans"][:, None].expand(-1, ca.shape[1], -1, -1))
        x_t = invert_apply(rot_t, trans_t, ca[:, None].expand(-1, ca.shape[1], -1, -1))
        d = torch.sqrt(((x_p - x_t) ** 2).sum(-1) + self.fape_eps)
        pair = mask[:, :, None] * mask[:, None, :]
        fape = (d.clamp(max=self.clamp) * pair).sum((1, 2)) / (pair.sum((1, 2)) + 1e-8) / self.clamp
        dist = torch.cdist(ca, ca)
        bins = torch.bucketize(dist, torch.linspace(2.0, 22.0, BINS - 1))
        ce = F.cross_entropy(out["distogram"].permute(0, 3, 1, 2), bins, reduction="none")
        ce = (ce * pair).sum((1, 2)) / (pair.sum((1, 2)) + self.per_chain_eps)
        loss = fape + 0.3 * ce
        if self.rotation_weight:  # the geodesic distance of the predicted rotations to the true
            cos = ((out["rot"].transpose(-1, -2) @ rot_t).diagonal(dim1=-2, dim2=-1).sum(-1) - 1) / 2
            angle = torch.acos(cos.clamp(-1.0, 1.0))
            loss = loss + self.rotation_weight * (angle * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        if self.plddt_weight:  # each chain's pLDDT cross-entropy over its resolved residues
            err = ((out["trans"] - ca) ** 2).sum(-1).detach().sqrt()
            bins = torch.bucketize(err, torch.tensor([0.5, 1.0, 2.0])).masked_fill(mask == 0, -100)
            per_chain = [F.cross_entropy(out["plddt"][b], bins[b]) for b in range(len(bins))]
            loss = loss + self.plddt_weight * torch.stack(per_chain)
        # OpenFold's filter of the chains by the resolution of their experiment
        return (loss * ((resolution >= 0.1) & (resolution <= 3.0))).mean()


class E_GCL(nn.Module):
    """Satorras et al.'s equivariant graph convolutional layer (``egnn_clean.py``)."""

    def __init__(self, hidden: int, epsilon: float):
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(2 * hidden + 1, hidden), nn.SiLU(),
                                      nn.Linear(hidden, hidden), nn.SiLU())
        self.node_mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(),
                                      nn.Linear(hidden, hidden))
        layer = nn.Linear(hidden, 1, bias=False)
        nn.init.xavier_uniform_(layer.weight, gain=0.001)
        self.coord_mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), layer)
        self.epsilon = epsilon

    def forward(self, h, x, row, col):
        coord_diff = x[row] - x[col]
        radial = (coord_diff ** 2).sum(1, keepdim=True)
        norm = torch.sqrt(radial).detach() + self.epsilon
        coord_diff = coord_diff / norm
        m = self.edge_mlp(torch.cat([h[row], h[col], radial], dim=1))
        trans = coord_diff * self.coord_mlp(m)
        x = x + torch.zeros_like(x).index_add_(0, row, trans)
        agg = torch.zeros_like(h).index_add_(0, row, m)
        return h + self.node_mlp(torch.cat([h, agg], dim=1)), x


class EGNN(nn.Module):
    def __init__(self, hidden: int = 16, layers: int = 2, epsilon: float = 1e-8):
        super().__init__()
        self.embedding_in = nn.Embedding(21, hidden)
        self.layers = nn.ModuleList(E_GCL(hidden, epsilon) for _ in range(layers))

    def forward(self, aatype, x, edges):
        b, n, _ = x.shape
        h, x = self.embedding_in(aatype).view(b * n, -1), x.reshape(b * n, 3)
        row, col = edges
        for layer in self.layers:
            h, x = layer(h, x, row, col)
        return x.view(b, n, 3)


def make_egnn(**kw) -> EGNN:
    torch.manual_seed(0)
    return EGNN(**kw)


def egnn_loss(x, target, mask):
    err = ((x - target) ** 2).sum(-1) * mask
    return (err.sum(-1) / mask.sum(-1).clamp_min(1.0)).mean()


def fully_connected_edges(lengths: list[int], n: int):
    """Edges between the residues of each chain (not its padding), as the QM9 example's
    ``get_edges_batch`` gives them: node ``i`` of chain ``b`` is ``b * n + i``."""
    rows, cols = [], []
    for b, m in enumerate(lengths):
        for i in range(m):
            for j in range(m):
                if i != j:
                    rows.append(b * n + i)
                    cols.append(b * n + j)
    return torch.tensor([rows, cols])


def chain(g: torch.Generator, m: int) -> dict:
    """A chain of ``m`` residues: CA a random walk of 3.8 A steps, N and C off each CA."""
    step = F.normalize(torch.randn(m, 3, generator=g), dim=-1) * 3.8
    ca = step.cumsum(0)
    n = ca + torch.tensor([-1.2, 0.7, 0.1]) + 0.1 * torch.randn(m, 3, generator=g)
    c = ca + torch.tensor([1.3, 0.6, -0.2]) + 0.1 * torch.randn(m, 3, generator=g)
    return {"aatype": torch.randint(1, 21, (m,), generator=g),
            "coords": torch.stack([n, ca, c], dim=1), "mask": torch.ones(m),
            "resolution": 1.5 + float(torch.rand(1, generator=g))}


def collate(chains: list[dict]) -> dict:
    """Pads to the longest chain: zero coordinates, residue type 0, mask 0."""
    n = max(len(c["aatype"]) for c in chains)
    out = {"aatype": torch.zeros(len(chains), n, dtype=torch.long),
           "coords": torch.zeros(len(chains), n, 3, 3), "mask": torch.zeros(len(chains), n)}
    for b, c in enumerate(chains):
        m = len(c["aatype"])
        for key in out:
            out[key][b, :m] = c[key]
    out["lengths"] = [len(c["aatype"]) for c in chains]
    out["resolution"] = torch.tensor([c["resolution"] for c in chains])
    return out


def dataset(plant: str, step_at: int, chain_at: int, steps: int) -> list[dict]:
    """``steps * BATCH`` chains of LENGTH residues; at step ``step_at`` chain ``chain_at`` is
    ``"short"`` (padded), ``"unresolved"`` (residues 2 and 5 unresolved: zeros, mask 0),
    ``"empty"`` (no residue resolved: the mask all 0)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        for b in range(BATCH):
            here = step == step_at and b == chain_at
            c = chain(g, LENGTH - 3 if here and plant == "short" else LENGTH)
            if here and plant in ("unresolved", "empty"):
                gone = [2, 5] if plant == "unresolved" else list(range(LENGTH))
                c["coords"][gone] = 0.0
                c["mask"][gone] = 0.0
            out.append(c)
    return out
