"""Differentiable mesh and point-cloud geometry as its well-known repositories write it, for
``test_mesh_geometry.py``:

- point completion (PCN / SnowflakeNet / PoinTr): a PointNet encoder, a folding-free coarse
  decoder, the partial input merged into the output (``torch.cat([partial, coarse], 1)``), and
  the L1 chamfer distance of ChamferDistancePytorch's pure-python fallback
  (``chamfer_python.distChamfer``: ``rx + ry - 2 zz``), square-rooted as PCN's ``CD_L1``;
- mesh deformation (Pixel2Mesh; pytorch3d's "deform a source mesh" tutorial): per-vertex offsets
  of a template predicted by an MLP, regularised by the edge length loss, normal consistency
  and Laplacian smoothing: the cotangent Laplacian as ``pytorch3d.ops.cot_laplacian`` writes
  it (Heron's area, ``cot = (b² + c² − a²) / area / 4``), optionally without its
  ``area.clamp_(min=1e-12)``, and face normals by a cross product, optionally normalised
  without an eps (batched meshes with faces padded by vertex 0);
- an SDF network (IGR / SIREN / NeuS) behind the bounding-box clamp of grid encodings, trained
  with the eikonal term ``(‖∇f‖ − 1)²`` by ``autograd.grad(create_graph=True)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------- point completion (PCN)


class CompletionNet(nn.Module):
    """PCN's encoder (shared MLP, max-pool, second shared MLP with the global feature tiled,
    max-pool) and a fully connected coarse decoder; the partial input is concatenated to the
    coarse output, as SnowflakeNet and PoinTr merge it."""

    def __init__(self, coarse: int = 16, width: int = 32):
        super().__init__()
        self.first = nn.Sequential(nn.Conv1d(3, width, 1), nn.ReLU(), nn.Conv1d(width, width, 1))
        self.second = nn.Sequential(nn.Conv1d(2 * width, width, 1), nn.ReLU(),
                                    nn.Conv1d(width, width, 1))
        self.decoder = nn.Sequential(nn.Linear(width, width), nn.ReLU(),
                                     nn.Linear(width, 3 * coarse))
        self.coarse = coarse

    def forward(self, partial):
        b, n, _ = partial.shape
        f = self.first(partial.transpose(2, 1))
        g = f.max(dim=2, keepdim=True)[0]
        f = self.second(torch.cat([g.expand(-1, -1, n), f], dim=1))
        g = f.max(dim=2)[0]
        coarse = self.decoder(g).view(b, self.coarse, 3)
        return torch.cat([partial, coarse], dim=1)


def make_completion() -> CompletionNet:
    torch.manual_seed(0)
    return CompletionNet()


def dist_chamfer(a, b):
    """ChamferDistancePytorch's ``chamfer_python.distChamfer``: squared distances to the
    nearest neighbour both ways, from ``|x|² + |y|² − 2 x·y``."""
    zz = torch.bmm(a, b.transpose(2, 1))
    rx = a.pow(2).sum(dim=2).unsqueeze(2).expand_as(zz)
    ry = b.pow(2).sum(dim=2).unsqueeze(1).expand_as(zz)
    p = rx + ry - 2 * zz
    return torch.min(p, 2)[0], torch.min(p, 1)[0]


def chamfer_l1(pred, gt):
    """PCN's ``CD_L1``: the mean of the square-rooted distances, both ways."""
    d1, d2 = dist_chamfer(pred, gt)
    return (torch.sqrt(d1).mean(1) + torch.sqrt(d2).mean(1)).mean() / 2


def chamfer_l1_clamped(pred, gt):
    """The same with the squared distances clamped at a small positive floor first."""
    d1, d2 = dist_chamfer(pred, gt)
    d1, d2 = d1.clamp_min(1e-9), d2.clamp_min(1e-9)
    return (torch.sqrt(d1).mean(1) + torch.sqrt(d2).mean(1)).mean() / 2


def chamfer_l1_clamped0(pred, gt):
    """The same clamped at the domain's edge 0: finite, but sqrt's gradient there is not."""
    d1, d2 = dist_chamfer(pred, gt)
    d1, d2 = d1.clamp_min(0), d2.clamp_min(0)
    return (d1.sqrt().mean(1) + d2.sqrt().mean(1)).mean() / 2


def deform_chamfer_l1(verts, faces, target):
    """PCN's CD_L1 clamped at 0 between a deformed mesh's vertices and target points."""
    return chamfer_l1_clamped0(verts[None], target[None])


def completion_batch(g: torch.Generator, b: int = 4, n: int = 48, keep: int = 24):
    """Complete clouds on a noisy sphere; the partial scan is a subset of the complete one."""
    gt = F.normalize(torch.randn(b, n, 3, generator=g), dim=-1)
    gt = gt * (1 + 0.05 * torch.randn(b, n, 1, generator=g))
    partial = gt[:, :keep].clone()
    return partial, gt


# ------------------------------------------------------------ mesh deformation (Pixel2Mesh)


def face_normals(verts, faces):
    """Unit normals of ``faces`` (B, F, 3) into ``verts`` (B, V, 3) by the cross product,
    normalised without an eps."""
    idx = faces.unsqueeze(-1).expand(-1, -1, -1, 3)
    tri = torch.gather(verts.unsqueeze(2).expand(-1, -1, 3, -1), 1, idx)
    v0, v1, v2 = tri.unbind(2)
    n = torch.cross(v1 - v0, v2 - v0, dim=-1)
    return n / n.norm(dim=-1, keepdim=True)


def cot_laplacian(verts, faces, clamp: bool = True):
    """``pytorch3d.ops.cot_laplacian`` for one mesh, dense: the cotangent weights of the
    angles opposite each edge, summed into a (V, V) matrix, and the inverse vertex areas."""
    v = verts[faces]
    v0, v1, v2 = v[:, 0], v[:, 1], v[:, 2]
    A = (v1 - v2).norm(dim=1)
    B = (v0 - v2).norm(dim=1)
    C = (v0 - v1).norm(dim=1)
    s = 0.5 * (A + B + C)
    heron = s * (s - A) * (s - B) * (s - C)
    area = heron.clamp_(min=1e-12).sqrt() if clamp else heron.sqrt()
    A2, B2, C2 = A * A, B * B, C * C
    cota = (B2 + C2 - A2) / area
    cotb = (A2 + C2 - B2) / area
    cotc = (A2 + B2 - C2) / area
    cot = torch.stack([cota, cotb, cotc], dim=1) / 4.0
    ii = faces[:, [1, 2, 0]].reshape(-1)
    jj = faces[:, [2, 0, 1]].reshape(-1)
    n = verts.shape[0]
    L = torch.zeros(n * n, dtype=verts.dtype).index_add(0, ii * n + jj, cot.reshape(-1))
    L = L.view(n, n)
    return L + L.t()


def laplacian_smoothing(verts, faces, clamp: bool = True):
    """pytorch3d's ``mesh_laplacian_smoothing(method="cot")``: ``L v / rowsum(L) − v``."""
    L = cot_laplacian(verts, faces, clamp)
    norm_w = L.sum(dim=1, keepdim=True)
    norm_w = torch.where(norm_w > 0, 1.0 / norm_w, norm_w)
    return ((L @ verts) * norm_w - verts).norm(dim=1).mean()


def edge_loss(verts, faces):
    """pytorch3d's ``mesh_edge_loss`` with target length 0."""
    e = torch.cat([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]])
    return ((verts[e[:, 0]] - verts[e[:, 1]]) ** 2).sum(1).mean()


class Deformer(nn.Module):
    """Pixel2Mesh's graph-free variant: an MLP of each template vertex and the shape code
    predicts its offset (zero-initialised last layer, so training starts at the template)."""

    def __init__(self, code: int = 8, width: int = 32):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3 + code, width), nn.ReLU(), nn.Linear(width, 3))
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, verts, code):
        c = code.expand(verts.shape[0], -1)
        return verts + self.mlp(torch.cat([verts, c], dim=1))


def make_deformer() -> Deformer:
    torch.manual_seed(0)
    return Deformer()


def deform_loss(verts, faces, target, clamp: bool = True):
    """The tutorial's weighted sum: chamfer to the target points, edge length, Laplacian."""
    d1, d2 = dist_chamfer(verts[None], target[None])
    return (d1.mean() + d2.mean() + 0.1 * edge_loss(verts, faces)
            + 0.1 * laplacian_smoothing(verts, faces, clamp))


def deform_loss_unclamped(verts, faces, target):
    return deform_loss(verts, faces, target, clamp=False)


def grid_mesh(k: int = 4):
    """A (k × k)-vertex grid of triangles on the unit square."""
    ys, xs = torch.meshgrid(torch.linspace(0, 1, k), torch.linspace(0, 1, k), indexing="ij")
    verts = torch.stack([xs, ys, torch.zeros_like(xs)], -1).reshape(-1, 3)
    faces = []
    for r in range(k - 1):
        for c in range(k - 1):
            a, b, d, e = r * k + c, r * k + c + 1, (r + 1) * k + c, (r + 1) * k + c + 1
            faces += [[a, b, e], [a, e, d]]
    return verts, torch.tensor(faces)


def sliver(verts, faces):
    """The template with its vertex 5 moved onto the edge between 0 and 1: face (0, 1, 5)
    has no area (a scanned mesh's collapsed triangle)."""
    verts = verts.clone()
    verts[5] = 0.5 * (verts[0] + verts[1])
    return verts, faces


# ---------------------------------------------------- batched normals (padded faces)


class NormalNet(nn.Module):
    """An offset MLP over padded vertex batches (B, V, 3), as batched Pixel2Mesh heads run."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 3))

    def forward(self, verts):
        return verts + 0.1 * self.mlp(verts)


def make_normal_net() -> NormalNet:
    torch.manual_seed(0)
    return NormalNet()


def normal_loss(verts, faces, face_mask, gt_normals):
    """1 − cos between predicted and ground-truth face normals, averaged over real faces."""
    n = face_normals(verts, faces)
    cos = (n * gt_normals).sum(-1)
    return ((1 - cos) * face_mask).sum() / face_mask.sum()


# ------------------------------------------------------------------------ SDF (eikonal)


class SDFNet(nn.Module):
    """An SDF MLP behind Fourier features of the point clamped to the scene's bounding box
    (grid and hash encodings clamp their input so; NeuS, instant-nsr)."""

    def __init__(self, width: int = 32, freqs: int = 3):
        super().__init__()
        self.register_buffer("bands", 2.0 ** torch.arange(freqs) * torch.pi)
        self.net = nn.Sequential(nn.Linear(6 * freqs + 3, width), nn.Softplus(beta=100),
                                 nn.Linear(width, width), nn.Softplus(beta=100),
                                 nn.Linear(width, 1))

    def forward(self, x):
        x = x.clamp(-1.0, 1.0)
        xb = (x[..., None] * self.bands).flatten(-2)
        return self.net(torch.cat([x, xb.sin(), xb.cos()], dim=-1)).squeeze(-1)


def make_sdf() -> SDFNet:
    torch.manual_seed(0)
    return SDFNet()


def _eikonal(sdf, x, grad_norm):
    g = torch.autograd.grad(sdf, x, torch.ones_like(sdf), create_graph=True)[0]
    return ((grad_norm(g) - 1) ** 2).mean()


def sdf_loss(sdf, x, gt, on_surface):
    """IGR's loss: |f| on the surface points, plus 0.1 × the eikonal term everywhere, with
    ``‖∇f‖`` written as the square root of the summed squares."""
    fit = (sdf - gt).abs()[on_surface].mean()
    return fit + 0.1 * _eikonal(sdf, x, lambda g: g.pow(2).sum(-1).sqrt())


def sdf_loss_norm(sdf, x, gt, on_surface):
    """The same with ``g.norm(2, dim=-1)`` (IGR's own spelling)."""
    fit = (sdf - gt).abs()[on_surface].mean()
    return fit + 0.1 * _eikonal(sdf, x, lambda g: g.norm(2, dim=-1))


def sdf_batch(g: torch.Generator, n: int = 64, box: float = 1.0):
    """Surface points on the unit-radius-0.5 sphere (SDF 0) and free points uniform in
    ``[-box, box]³`` with their true SDF."""
    surf = 0.5 * F.normalize(torch.randn(n, 3, generator=g), dim=-1)
    free = (torch.rand(n, 3, generator=g) * 2 - 1) * box
    x = torch.cat([surf, free])
    gt = x.norm(dim=-1) - 0.5
    on = torch.arange(2 * n) < n
    return x, gt, on


def adjacent_faces(faces):
    """Pairs of faces sharing an edge (pytorch3d's normal consistency walks the same pairs)."""
    edges = {}
    for i, f in enumerate(faces.tolist()):
        for a, b in ((f[0], f[1]), (f[1], f[2]), (f[2], f[0])):
            edges.setdefault((min(a, b), max(a, b)), []).append(i)
    return torch.tensor([p for p in edges.values() if len(p) == 2])


def dihedral_loss(verts, faces, target):
    """Chamfer to the target plus the mean dihedral angle between adjacent faces' normals,
    ``acos`` of their cosine (the angle form of normal consistency)."""
    d1, d2 = dist_chamfer(verts[None], target[None])
    n = F.normalize(torch.cross(verts[faces[:, 1]] - verts[faces[:, 0]],
                                verts[faces[:, 2]] - verts[faces[:, 0]], dim=-1), dim=-1)
    pairs = adjacent_faces(faces)
    cos = (n[pairs[:, 0]] * n[pairs[:, 1]]).sum(-1)
    return d1.mean() + d2.mean() + 0.01 * torch.acos(cos).mean()


def uniform_laplacian_loss(verts, edges, target):
    """Chamfer to the targets plus the uniform Laplacian of padded meshes (B, V, 3) with
    edges (B, E, 2): each vertex against the mean of its neighbours, the degree counted from
    the edges (``mesh_laplacian_smoothing(method="uniform")`` batched by hand)."""
    b, v, _ = verts.shape
    adj = torch.zeros(b, v, v)
    bi = torch.arange(b)[:, None].expand_as(edges[..., 0])
    adj[bi, edges[..., 0], edges[..., 1]] = 1.0
    adj[bi, edges[..., 1], edges[..., 0]] = 1.0
    deg = adj.sum(-1, keepdim=True)
    lap = adj @ verts / deg - verts
    d1, d2 = dist_chamfer(verts, target)
    return d1.mean() + d2.mean() + lap.norm(dim=-1).mean()


class NormalizedDeformer(nn.Module):
    """Offsets predicted along each vertex's direction from the centroid, normalised without
    an eps (a template vertex at the centroid is 0/0)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, verts):
        d = verts - verts.mean(dim=-2, keepdim=True)
        return verts + 0.1 * self.mlp(verts) * d / d.norm(dim=-1, keepdim=True)


def make_normalized_deformer() -> NormalizedDeformer:
    torch.manual_seed(0)
    return NormalizedDeformer()


def sampled_chamfer(verts, faces, target, n: int = 64):
    """pytorch3d's ``sample_points_from_meshes`` then chamfer: faces drawn by area with
    ``multinomial``, a point in each by uniform barycentric coordinates."""
    v = verts[:, faces]
    area = torch.cross(v[:, :, 1] - v[:, :, 0], v[:, :, 2] - v[:, :, 0], dim=-1).norm(dim=-1)
    idx = area.multinomial(n, replacement=True)
    u, w = torch.rand(2, *idx.shape, 1).unbind(0)
    us = u.sqrt()
    tri = torch.gather(v, 1, idx[..., None, None].expand(-1, -1, 3, 3))
    pts = (1 - us) * tri[:, :, 0] + us * (1 - w) * tri[:, :, 1] + us * w * tri[:, :, 2]
    d1, d2 = dist_chamfer(pts, target)
    return d1.mean() + d2.mean()
