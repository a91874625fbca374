"""Slot Attention autoencoders written as the object-centric papers' reference code writes them
(Locatello et al.'s Slot Attention, SAVi, DINOSAUR), small enough for a CPU test, for
``test_object_centric``.

- ``SlotAttention``: learned slot init ``mu + exp(log_sigma) * noise``, iterative attention with
  the softmax over slots (competition), the attention-weighted mean normalised by the attention
  sum (``attn + eps`` then divided by its sum over the inputs), a GRU update and a residual MLP;
  an optional token mask for padded inputs (DINOSAUR's variable-size feature maps) zeroes the
  padding's attention; ``implicit=True`` detaches the slots before the last iteration (Chang et
  al.'s implicit differentiation).
- ``SlotAutoencoder``: a CNN encoder with a soft position embedding, slot attention, and a
  spatial broadcast decoder whose per-slot alpha masks are softmaxed over slots; ``slot_mask``
  (a variable number of objects per scene) fills the alpha logits of inactive slots with -inf.
- ``Dinosaur``: DINOSAUR's feature reconstruction: an MLP decoder broadcast over the patch
  positions of frozen ViT features, masked by the padded patches, optionally under fp16
  autocast.
- ``SAVi``: slots carried over from frame to frame of a video, a transformer-like predictor
  between frames.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SQRT_2PI = math.sqrt(2 * math.pi)


class SlotAttention(nn.Module):
    def __init__(self, num_slots: int = 4, dim: int = 32, iters: int = 3, eps: float = 1e-8,
                 hidden: int = 64, implicit: bool = False, scale: float | None = None):
        super().__init__()
        self.num_slots, self.iters, self.eps, self.implicit = num_slots, iters, eps, implicit
        self.scale = dim ** -0.5 if scale is None else scale
        self.slots_mu = nn.Parameter(torch.randn(1, 1, dim))
        self.slots_log_sigma = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.xavier_uniform_(self.slots_log_sigma)
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.gru = nn.GRUCell(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.norm_input, self.norm_slots, self.norm_pre_ff = (
            nn.LayerNorm(dim) for _ in range(3))

    def init_slots(self, b: int, like: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(b, self.num_slots, like.shape[-1], dtype=like.dtype)
        return self.slots_mu + self.slots_log_sigma.exp() * noise

    def step(self, slots, k, v, mask):
        b, n, d = k.shape
        prev = slots
        q = self.to_q(self.norm_slots(slots))
        dots = torch.einsum("bid,bjd->bij", q, k) * self.scale
        attn = dots.softmax(dim=1)  # over slots: the slots compete for each input
        if mask is not None:
            attn = attn * mask[:, None, :].to(attn.dtype)  # padded tokens feed no slot
        if self.eps:
            attn = attn + self.eps
            attn = attn / attn.sum(dim=-1, keepdim=True)
        else:
            attn = attn / attn.sum(dim=-1, keepdim=True)  # the weighted mean, eps removed
        updates = torch.einsum("bjd,bij->bid", v, attn)
        slots = self.gru(updates.reshape(-1, d), prev.reshape(-1, d)).reshape(b, -1, d)
        return slots + self.mlp(self.norm_pre_ff(slots)), attn

    def forward(self, inputs, mask=None, slots=None):
        b = inputs.shape[0]
        inputs = self.norm_input(inputs)
        k, v = self.to_k(inputs), self.to_v(inputs)
        if slots is None:
            slots = self.init_slots(b, inputs)
        for i in range(self.iters):
            if self.implicit and i == self.iters - 1:
                slots = slots.detach()  # implicit differentiation: only the last step's graph
            slots, attn = self.step(slots, k, v, mask)
        return slots, attn


def build_grid(h: int, w: int) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    grid = torch.stack([ys, xs], dim=-1)
    return torch.cat([grid, 1 - grid], dim=-1)[None]  # (1, h, w, 4)


class SoftPositionEmbed(nn.Module):
    def __init__(self, dim: int, h: int, w: int):
        super().__init__()
        self.dense = nn.Linear(4, dim)
        self.register_buffer("grid", build_grid(h, w), persistent=False)

    def forward(self, x):  # (B, H, W, C)
        return x + self.dense(self.grid)


class SlotAutoencoder(nn.Module):
    """Locatello et al.'s object discovery model on 8x8 scenes."""

    def __init__(self, res: int = 8, dim: int = 32, num_slots: int = 4, eps: float = 1e-8,
                 log_masks: bool = False, implicit: bool = False):
        super().__init__()
        self.res, self.dim, self.log_masks = res, dim, log_masks
        self.encoder = nn.Sequential(nn.Conv2d(3, dim, 5, padding=2), nn.ReLU(),
                                     nn.Conv2d(dim, dim, 5, padding=2), nn.ReLU())
        self.enc_pos = SoftPositionEmbed(dim, res, res)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.slot_attention = SlotAttention(num_slots, dim, eps=eps, implicit=implicit)
        self.dec_pos = SoftPositionEmbed(dim, res, res)
        self.decoder = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(dim, 4, 3, padding=1))

    def forward(self, image, slot_mask=None):
        b = image.shape[0]
        x = self.encoder(image).permute(0, 2, 3, 1)
        x = self.enc_pos(x).flatten(1, 2)
        x = self.mlp(nn.functional.layer_norm(x, x.shape[-1:]))
        slots, _ = self.slot_attention(x)
        k = slots.shape[1]
        # spatial broadcast: every slot decoded on its own copy of the grid
        z = slots.reshape(b * k, 1, 1, self.dim).expand(-1, self.res, self.res, -1)
        z = self.dec_pos(z).permute(0, 3, 1, 2)
        out = self.decoder(z).reshape(b, k, 4, self.res, self.res)
        rgb, alpha_logits = out[:, :, :3], out[:, :, 3:]
        if slot_mask is not None:  # inactive slots own no pixel
            fill = torch.full_like(alpha_logits, float("-inf"))
            alpha_logits = torch.where(slot_mask[:, :, None, None, None], alpha_logits, fill)
        if self.log_masks:  # for a mixture likelihood in log space: -inf for inactive slots
            return rgb, alpha_logits.log_softmax(dim=1)
        masks = alpha_logits.softmax(dim=1)
        recon = (rgb * masks).sum(dim=1)
        return recon, masks, rgb


def make_autoencoder() -> SlotAutoencoder:
    torch.manual_seed(0)
    return SlotAutoencoder()


def scenes(g: torch.Generator, empty: int | None = None, background: bool = True, n: int = 8,
           res: int = 8):
    """Scenes of 1-3 coloured squares on black (the record ``empty`` a blank frame), and each
    scene's active slots: one per object, plus the background's slot when ``background``."""
    img = torch.zeros(n, 3, res, res)
    count = torch.randint(1, 4, (n,), generator=g)
    if empty is not None:
        count[empty] = 0
    for i in range(n):
        for _ in range(int(count[i])):
            y, x = torch.randint(0, res - 3, (2,), generator=g).tolist()
            img[i, :, y:y + 3, x:x + 3] = torch.rand(3, 1, 1, generator=g)
    slot_mask = torch.arange(4)[None] < (count + int(background))[:, None]
    return img, slot_mask


def mixture_nll(recon, masks, rgb, image, sigma: float = 0.3):
    """MONet/IODINE's pixel likelihood: a mixture over slots of Gaussians at each slot's
    colour, weighted by its alpha mask, the densities exponentiated and summed by hand."""
    log_lik = -((image[:, None] - rgb) ** 2) / (2 * sigma ** 2) - math.log(sigma * SQRT_2PI)
    lik = (masks * log_lik.sum(2, keepdim=True).exp()).sum(dim=1)
    return -torch.log(lik).mean()


def mixture_nll_log_space(rgb, log_masks, image, sigma: float = 0.3):
    """The same likelihood in log space (Genesis's, IODINE's): logsumexp over slots of the log
    masks plus each slot's log-density; an inactive slot's log mask is -inf."""
    log_lik = -((image[:, None] - rgb) ** 2) / (2 * sigma ** 2) - math.log(sigma * SQRT_2PI)
    return -torch.logsumexp(log_masks + log_lik.sum(2, keepdim=True), dim=1).mean()


def make_autoencoder_implicit() -> SlotAutoencoder:
    torch.manual_seed(0)
    return SlotAutoencoder(implicit=True)


def make_autoencoder_log_masks() -> SlotAutoencoder:
    torch.manual_seed(0)
    return SlotAutoencoder(log_masks=True)


class Dinosaur(nn.Module):
    """DINOSAUR: slots over frozen ViT patch features, an MLP decoder broadcast to every patch,
    the features reconstructed as the alpha-weighted sum over slots."""

    def __init__(self, feat: int = 48, dim: int = 32, patches: int = 16, num_slots: int = 4,
                 eps: float = 1e-8, amp: torch.dtype | None = None,
                 scale: float | None = None):
        super().__init__()
        self.amp = amp
        self.proj = nn.Sequential(nn.LayerNorm(feat), nn.Linear(feat, dim), nn.ReLU(),
                                  nn.Linear(dim, dim))
        self.slot_attention = SlotAttention(num_slots, dim, eps=eps, scale=scale)
        self.pos = nn.Parameter(torch.randn(1, 1, patches, dim) * 0.02)
        self.decoder = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, feat + 1))

    def forward(self, features, token_mask):
        amp = self.amp is not None
        with torch.autocast("cpu", dtype=self.amp or torch.bfloat16, enabled=amp):
            slots, attn = self.slot_attention(self.proj(features), token_mask)
            out = self.decoder(slots[:, :, None, :] + self.pos)  # (B, K, N, feat + 1)
            recon, alpha = out[..., :-1], out[..., -1:].softmax(dim=1)
            return (recon * alpha).sum(dim=1).float(), attn


def make_dinosaur() -> Dinosaur:
    torch.manual_seed(0)
    return Dinosaur()


def make_dinosaur_no_eps() -> Dinosaur:
    torch.manual_seed(0)
    return Dinosaur(eps=0.0)


def make_dinosaur_fp16() -> Dinosaur:
    """fp16 autocast, the logits sharpened by an inverse temperature of 10 (in place of
    1/sqrt(d)), the reference code's eps of 1e-8."""
    torch.manual_seed(0)
    return Dinosaur(amp=torch.float16, scale=10.0)


def make_dinosaur_bf16() -> Dinosaur:
    """The same under bf16 autocast, whose range keeps 1e-8."""
    torch.manual_seed(0)
    return Dinosaur(amp=torch.bfloat16, scale=10.0)


def vit_features(g: torch.Generator, empty: int | None = None, n: int = 8, patches: int = 16,
                 feat: int = 48):
    """Patch features of images of different sizes padded to ``patches`` tokens; the record
    ``empty`` is an image the resize left with no valid patch (a 0-pixel crop)."""
    x = torch.randn(n, patches, feat, generator=g)
    valid = torch.randint(8, patches + 1, (n,), generator=g)
    if empty is not None:
        valid[empty] = 0
    mask = torch.arange(patches)[None] < valid[:, None]
    return x * mask[..., None], mask


class SAVi(Dinosaur):
    """SAVi / VideoSAUR over per-frame patch features: the first frame's slots from the learned
    init, each later frame's from the previous frame's slots through a transformer predictor
    (slot carry-over); the features of every frame reconstructed by the broadcast decoder."""

    def __init__(self, eps: float = 1e-8, dim: int = 32):
        super().__init__(eps=eps, dim=dim)
        self.predictor = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, video, token_mask):  # (B, T, N, F), (B, T, N)
        slots, recons, attns = None, [], []
        for t in range(video.shape[1]):
            if slots is not None:
                slots = self.predictor(slots)
            slots, attn = self.slot_attention(self.proj(video[:, t]), token_mask[:, t], slots)
            out = self.decoder(slots[:, :, None, :] + self.pos)
            alpha = out[..., -1:].softmax(dim=1)
            recons.append((out[..., :-1] * alpha).sum(dim=1))
            attns.append(attn)
        return torch.stack(recons, 1), torch.stack(attns, 1)


def make_savi() -> SAVi:
    torch.manual_seed(0)
    return SAVi()


def make_savi_no_eps() -> SAVi:
    torch.manual_seed(0)
    return SAVi(eps=0.0)


def video_features(g: torch.Generator, lost: int | None = None, frames: int = 4, n: int = 4):
    """Clips of ``frames`` frames' patch features; in the clip ``lost``, frame 2 failed to
    decode and came out with no valid patch."""
    clips = [vit_features(g, n=n) for _ in range(frames)]
    x, mask = torch.stack([c[0] for c in clips], 1), torch.stack([c[1] for c in clips], 1)
    if lost is not None:
        x[lost, 2], mask[lost, 2] = 0.0, False
    return x, mask


def masked_feature_loss(recon, attn, target, mask):
    """DINOSAUR's MSE over the valid patches (the attention is logged, not trained)."""
    err = ((recon - target) ** 2).mean(-1)
    return (err * mask).sum() / mask.sum().clamp_min(1)


def feature_loss_with_entropy(recon, attn, target, mask, weight: float = 0.01):
    """DINOSAUR's loss plus an entropy penalty that sharpens each slot's attention over the
    patches (its row of the normalised weighted-mean attention)."""
    entropy = -(attn * attn.log()).sum(-1).mean()
    return masked_feature_loss(recon, attn, target, mask) + weight * entropy


def colour_consistency_loss(recon, masks, rgb, image, weight: float = 0.1):
    """The reconstruction MSE plus a term pulling each slot's decoded colour to the mean
    colour of the pixels its alpha mask owns (the mask-weighted mean by hand)."""
    area = masks.sum(dim=(-2, -1))  # (B, K, 1)
    owned = (masks * image[:, None]).sum(dim=(-2, -1)) / area  # (B, K, 3)
    consistency = ((rgb.mean(dim=(-2, -1)) - owned) ** 2).mean()
    return ((recon - image) ** 2).mean() + weight * consistency
