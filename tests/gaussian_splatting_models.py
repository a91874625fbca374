"""3D Gaussian splatting in pure PyTorch, written as the public code writes it: the parameters
of gsplat's ``simple_trainer.py`` (an ``nn.ParameterDict`` of means, log-scales, quaternions,
opacity logits and colours), the covariance of the original 3DGS reference
(``utils/general_utils.py``: ``build_rotation`` dividing the quaternion by its norm,
``build_scaling_rotation``), gsplat's pure-torch projection (``gsplat/cuda/_torch_impl.py``:
``_persp_proj``'s Jacobian of the divide by z, the 2x2 covariance dilated by 0.3 and inverted
through ``1 / det``, the near-plane cull), its pure-torch rasteriser (alpha
``opacity * exp(-sigma)`` clamped at 0.999 and dropped below 1/255 as the CUDA kernel does,
transmittance an exclusive ``cumprod(1 - alpha)``, the expected depth ``sum(w z) / sum(w)``),
and 3DGS's SSIM + L1 loss (``utils/loss_utils.py``). Densification appends Gaussians between
steps as 3DGS's ``cat_tensors_to_optimizer`` does: new ``nn.Parameter``s swapped into the
Adam's groups with their state extended by zeros.

The scene: Gaussians seen by cameras on a circle looking at the origin, tiny images (8x8)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

H = W = 8
FOCAL = 8.0
N0 = 24  # Gaussians at initialisation


def build_rotation(r):
    """3DGS ``build_rotation``: the unit quaternion (w, x, y, z) as a rotation matrix."""
    norm = torch.sqrt(r[:, 0] * r[:, 0] + r[:, 1] * r[:, 1] + r[:, 2] * r[:, 2]
                      + r[:, 3] * r[:, 3])
    q = r / norm[:, None]
    w, x, y, z = q.unbind(-1)
    return torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
                       -1).view(-1, 3, 3)


def covariance(log_scales, quats):
    """3DGS ``build_covariance_from_scaling_rotation``: L = R S, Sigma = L L^T."""
    L = build_rotation(quats) * torch.exp(log_scales)[:, None, :]
    return L @ L.transpose(1, 2)


def persp_proj(means_c, covars_c, Ks, eps2d: float):
    """gsplat ``_persp_proj`` + ``_fully_fused_projection``: 2-D means, and the conic (the
    inverse of the dilated 2x2 covariance) through ``1 / det``."""
    tx, ty, tz = means_c.unbind(-1)  # (C, N)
    fx, fy = Ks[:, 0, 0, None], Ks[:, 1, 1, None]
    cx, cy = Ks[:, 0, 2, None], Ks[:, 1, 2, None]
    tz2 = tz * tz
    zero = torch.zeros_like(tz)
    J = torch.stack([fx / tz, zero, -fx * tx / tz2, zero, fy / tz, -fy * ty / tz2],
                    -1).view(*tz.shape, 2, 3)
    cov2d = J @ covars_c @ J.transpose(-1, -2)
    means2d = torch.stack([fx * tx / tz + cx, fy * ty / tz + cy], -1)
    cov2d = cov2d + eps2d * torch.eye(2)
    a, b, c = cov2d[..., 0, 0], cov2d[..., 0, 1], cov2d[..., 1, 1]
    det = a * c - b * b
    conics = torch.stack([c / det, -b / det, a / det], -1)
    return means2d, conics, tz


def rasterize(means2d, conics, depths, opacities, colors, depth_eps: float):
    """gsplat's pure-torch ``accumulate``: every pixel against every Gaussian, front to
    back. Returns the image (C, 3, H, W) and the expected depth (C, H, W)."""
    order = depths.argsort(-1)

    def take(t):  # (each Gaussian's values in the camera's depth order)
        return torch.gather(t, 1, order.view(*order.shape, *[1] * (t.dim() - 2)).expand_as(t))

    means2d, conics, depths = take(means2d), take(conics), take(depths)
    opac, cols = take(opacities), take(colors)  # (C, N), (C, N, 3)
    ys, xs = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
    pix = torch.stack([xs, ys], -1).view(1, -1, 1, 2)  # (1, P, 1, 2)
    d = pix - means2d[:, None]  # (C, P, N, 2)
    A, B, Cc = conics[:, None].unbind(-1)
    sigma = 0.5 * (A * d[..., 0] ** 2 + Cc * d[..., 1] ** 2) + B * d[..., 0] * d[..., 1]
    alpha = torch.clamp_max(opac[:, None] * torch.exp(-sigma), 0.999)
    alpha = torch.where((sigma < 0) | (alpha < 1.0 / 255.0), 0.0, alpha)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1 - alpha], -1),
                          -1)[..., :-1]
    w = alpha * trans  # (C, P, N)
    image = (w[..., None] * cols[:, None]).sum(-2)
    acc = w.sum(-1)
    depth = (w * depths[:, None]).sum(-1) / (acc + depth_eps)  # gsplat "ED": expected depth
    c = means2d.shape[0]
    return image.view(c, H, W, 3).permute(0, 3, 1, 2), depth.view(c, H, W)


class GaussianSplats(nn.Module):
    """The scene's Gaussians (gsplat ``simple_trainer``'s ``splats`` ParameterDict)."""

    def __init__(self, points, log_scales, eps2d: float = 0.3, depth_eps: float = 1e-10,
                 near: float = 0.01):
        super().__init__()
        n = points.shape[0]
        quats = torch.zeros(n, 4)
        quats[:, 0] = 1
        self.splats = nn.ParameterDict({
            "means": nn.Parameter(points.clone()),
            "scales": nn.Parameter(log_scales.clone()),
            "quats": nn.Parameter(quats),
            "opacities": nn.Parameter(torch.logit(torch.full((n,), 0.5))),
            "colors": nn.Parameter(torch.rand(n, 3)),
        })
        self.eps2d, self.depth_eps, self.near = eps2d, depth_eps, near

    def forward(self, viewmats, Ks):
        p = self.splats
        covars = covariance(p["scales"], p["quats"])
        R, t = viewmats[:, :3, :3], viewmats[:, :3, 3]
        means_c = torch.einsum("cij,nj->cni", R, p["means"]) + t[:, None]
        covars_c = torch.einsum("cij,njk,clk->cnil", R, covars, R)
        means2d, conics, depths = persp_proj(means_c, covars_c, Ks, self.eps2d)
        # the near-plane cull: a Gaussian behind the camera gets no opacity
        opac = torch.sigmoid(p["opacities"])[None].expand_as(depths)
        opac = torch.where(depths > self.near, opac, 0.0)
        colors = p["colors"].expand(depths.shape[0], -1, -1)
        return rasterize(means2d, conics, depths, opac, colors, self.depth_eps)


def knn_log_scales(points, floor: float = 1e-7):
    """3DGS's initial scales: the log of the root mean squared distance to the 3 nearest
    points (``distCUDA2``), floored at 1e-7 as ``torch.clamp_min(dist2, 0.0000001)``."""
    d2 = torch.cdist(points, points).pow(2)
    d2.fill_diagonal_(float("inf"))
    dist2 = d2.topk(3, largest=False).values.mean(-1).clamp_min(floor)
    return torch.log(torch.sqrt(dist2))[:, None].repeat(1, 3)


def init_points(seed: int = 0, duplicate: bool = False):
    """An SfM-like point cloud around the origin; ``duplicate``: COLMAP's triangulation wrote
    the same 3-D point twice, so a point and its copy are at distance 0."""
    g = torch.Generator().manual_seed(seed)
    pts = torch.randn(N0, 3, generator=g) * 0.4
    if duplicate:
        pts[1:4] = pts[0]
    return pts


def make_splats_far_outlier():
    """A cloud with one point COLMAP triangulated near infinity (a sky point at 3e19): its
    squared distance to the others, 9e38, is past float32's 3.4e38."""
    torch.manual_seed(0)
    pts = init_points()
    pts[7] = torch.tensor([3e19, 0.0, 0.0])
    return GaussianSplats(pts, knn_log_scales(pts))


def make_splats():
    torch.manual_seed(0)
    pts = init_points()
    return GaussianSplats(pts, knn_log_scales(pts))


def make_splats_duplicates_no_floor():
    """The port without 3DGS's ``clamp_min(dist2, 1e-7)`` on a cloud with duplicate points,
    and gsplat's 0.3 dilation off (``eps2d=0``, as its anti-aliased mode suggests)."""
    torch.manual_seed(0)
    pts = init_points(duplicate=True)
    return GaussianSplats(pts, knn_log_scales(pts, floor=0.0), eps2d=0.0)


def make_splats_collapsed_no_dilation():
    """gsplat's 0.3 dilation off (``eps2d=0``, as its anti-aliased mode is often ported) and a
    Gaussian collapsed to a needle-free point by a scale regulariser (log-scales -30)."""
    model = make_splats()
    model.eps2d = 0.0
    with torch.no_grad():
        model.splats["scales"][5] = -30.0
    return model


def make_splats_depth_no_eps():
    torch.manual_seed(0)
    pts = init_points()
    return GaussianSplats(pts, knn_log_scales(pts), depth_eps=0.0)


def look_at(eye):
    """World-to-camera 4x4 of a camera at ``eye`` looking at the origin (OpenCV axes)."""
    fwd = F.normalize(-eye, dim=0)
    right = F.normalize(torch.linalg.cross(fwd, torch.tensor([0.0, 0.0, 1.0])), dim=0)
    down = torch.linalg.cross(fwd, right)
    R = torch.stack([right, down, fwd])
    m = torch.eye(4)
    m[:3, :3], m[:3, 3] = R, -R @ eye
    return m


def cameras(n: int, radius: float = 4.0):
    """``n`` cameras on a circle around the origin, and their intrinsics."""
    eyes = [torch.tensor([radius * math.cos(a), radius * math.sin(a), 0.5])
            for a in torch.linspace(0, 2 * math.pi, n + 1)[:-1].tolist()]
    viewmats = torch.stack([look_at(e) for e in eyes])
    K = torch.tensor([[FOCAL, 0.0, W / 2], [0.0, FOCAL, H / 2], [0.0, 0.0, 1.0]])
    return viewmats, K.expand(n, 3, 3).clone()


def targets(viewmats, Ks, seed: int = 1):
    """The ground-truth images and depths: another set of Gaussians rendered healthily."""
    torch.manual_seed(seed)
    pts = init_points(seed)
    gt = GaussianSplats(pts, knn_log_scales(pts) + 0.3)
    with torch.no_grad():
        return gt(viewmats, Ks)


# --- loss (3DGS utils/loss_utils.py) -------------------------------------------------------

def gaussian_window(size: int, sigma: float = 1.5):
    g = torch.exp(-(torch.arange(size) - size // 2) ** 2 / (2 * sigma ** 2))
    g = (g / g.sum())[:, None]
    return (g @ g.T).expand(3, 1, size, size).contiguous()


def ssim(img1, img2, size: int = 5):
    w = gaussian_window(size)
    conv = lambda x: F.conv2d(x, w, padding=size // 2, groups=3)  # noqa: E731
    mu1, mu2 = conv(img1), conv(img2)
    s1 = conv(img1 * img1) - mu1 * mu1
    s2 = conv(img2 * img2) - mu2 * mu2
    s12 = conv(img1 * img2) - mu1 * mu2
    C1, C2 = 0.01 ** 2, 0.03 ** 2
    return (((2 * mu1 * mu2 + C1) * (2 * s12 + C2))
            / ((mu1 * mu1 + mu2 * mu2 + C1) * (s1 + s2 + C2))).mean()


def splat_loss(out, gt_image, gt_depth, lambda_dssim: float = 0.2, lambda_depth: float = 0.1):
    """3DGS: (1 - lambda) L1 + lambda (1 - SSIM), plus an L1 on the expected depth."""
    image, depth = out
    l1 = (image - gt_image).abs().mean()
    return ((1 - lambda_dssim) * l1 + lambda_dssim * (1 - ssim(image, gt_image))
            + lambda_depth * (depth - gt_depth).abs().mean())


# --- densification (3DGS gaussian_model.py) -------------------------------------------------

def cat_tensors_to_optimizer(model: GaussianSplats, optimizer, new: dict):
    """3DGS ``cat_tensors_to_optimizer``: each group's parameter grown by ``new[name]``, its
    Adam state by zeros, the new ``nn.Parameter`` swapped into the group and the module."""
    for group in optimizer.param_groups:
        name, old = group["name"], group["params"][0]
        ext = new[name]
        state = optimizer.state.get(old, None)
        param = nn.Parameter(torch.cat([old.detach(), ext], 0))
        if state is not None:
            state["exp_avg"] = torch.cat([state["exp_avg"], torch.zeros_like(ext)], 0)
            state["exp_avg_sq"] = torch.cat([state["exp_avg_sq"], torch.zeros_like(ext)], 0)
            del optimizer.state[old]
            optimizer.state[param] = state
        group["params"][0] = param
        model.splats[name] = param


def densify_clone(model: GaussianSplats, optimizer, idx, fresh_quats: bool = False):
    """3DGS ``densify_and_clone``: copies of the Gaussians ``idx``. ``fresh_quats``: the
    copies' rotations made new, as ``torch.zeros((N, 4))`` without the ``rots[:, 0] = 1``
    that 3DGS's ``create_from_pcd`` sets after it."""
    p = model.splats
    new = {k: p[k].detach()[idx].clone() for k in p}
    if fresh_quats:
        new["quats"] = torch.zeros(len(idx), 4)
    cat_tensors_to_optimizer(model, optimizer, new)


def prune_points(model: GaussianSplats, optimizer, idx):
    """3DGS ``prune_points`` / ``_prune_optimizer``: the Gaussians ``idx`` dropped from each
    group's parameter and Adam state, the shrunk ``nn.Parameter`` swapped in."""
    keep = torch.ones(model.splats["means"].shape[0], dtype=torch.bool)
    keep[idx] = False
    for group in optimizer.param_groups:
        name, old = group["name"], group["params"][0]
        state = optimizer.state.get(old, None)
        param = nn.Parameter(old.detach()[keep])
        if state is not None:
            state["exp_avg"] = state["exp_avg"][keep]
            state["exp_avg_sq"] = state["exp_avg_sq"][keep]
            del optimizer.state[old]
            optimizer.state[param] = state
        group["params"][0] = param
        model.splats[name] = param


def replace_tensor_to_optimizer(model: GaussianSplats, optimizer, tensor, name: str):
    """3DGS ``replace_tensor_to_optimizer``: ``tensor`` as the new parameter ``name``, its
    Adam moments reset to zeros."""
    for group in optimizer.param_groups:
        if group["name"] != name:
            continue
        old = group["params"][0]
        state = optimizer.state.get(old, None)
        param = nn.Parameter(tensor.detach().clone())
        if state is not None:
            state["exp_avg"] = torch.zeros_like(tensor)
            state["exp_avg_sq"] = torch.zeros_like(tensor)
            del optimizer.state[old]
            optimizer.state[param] = state
        group["params"][0] = param
        model.splats[name] = param


def relocate(model: GaussianSplats, optimizer, dead, alive, clamp: bool = True):
    """gsplat's MCMC ``relocate``: the dead Gaussians moved onto alive ones, the opacity of
    the pair split so the pixels keep theirs, ``1 - (1 - o) ** (1 / 2)``, clamped below 1 as
    gsplat does (``clamp``) before the logit."""
    p = model.splats
    opac = torch.sigmoid(p["opacities"].detach())
    new = 1 - (1 - opac[alive]) ** 0.5
    if clamp:
        new = new.clamp(min=0.005, max=1 - torch.finfo(new.dtype).eps)
    opacities = p["opacities"].detach().clone()
    opacities[alive] = torch.logit(new)
    opacities[dead] = torch.logit(new)
    means = p["means"].detach().clone()
    means[dead] = means[alive]
    replace_tensor_to_optimizer(model, optimizer, opacities, "opacities")
    replace_tensor_to_optimizer(model, optimizer, means, "means")


def make_splats_opaque():
    """Gaussians started from a checkpoint in which two are fully opaque (logit 20: sigmoid
    is 1.0 in float32)."""
    model = make_splats()
    with torch.no_grad():
        model.splats["opacities"][[3, 9]] = 20.0
    return model


def make_optimizer(model: GaussianSplats):
    """3DGS ``training_setup``: one Adam, a named group per attribute, eps 1e-15."""
    p = model.splats
    return torch.optim.Adam([
        {"params": [p["means"]], "lr": 1.6e-3, "name": "means"},
        {"params": [p["scales"]], "lr": 5e-3, "name": "scales"},
        {"params": [p["quats"]], "lr": 1e-3, "name": "quats"},
        {"params": [p["opacities"]], "lr": 5e-2, "name": "opacities"},
        {"params": [p["colors"]], "lr": 2.5e-3, "name": "colors"},
    ], lr=0.0, eps=1e-15)
