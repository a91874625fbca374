"""Vector-quantised models as their communities write them, for ``test_vector_quantization``.

- ``DiscreteVAE``: DALL-E's dVAE as lucidrains' DALLE-pytorch writes it: a conv encoder's
  logits over the codebook, ``F.gumbel_softmax(logits, tau=self.temperature, dim=1)`` mixing
  the codebook's embeddings, the KL of the codes' posterior to the uniform prior (a vocabulary
  padded with -inf-masked codes: ``make_dvae_padded``), ``vae(img, return_loss=True, temp=t)``
  as DALLE-pytorch calls it; or the loop anneals ``model.temperature`` (``linear_temperature``: linear to 0 without a floor, the bug;
  ``exp_temperature``: DALLE-pytorch's exponential decay floored at ``temp_min``).
- ``SpeechTokenizer``: a factorised, l2-normalised (cosine-similarity) codebook as ViT-VQGAN and
  the speech tokenizers write it, over padded feature sequences: the encoder's frames are
  zeroed past each utterance's length, then normalised by hand, ``z / z.norm()`` (the bug: 0/0
  at a padded frame; ``F.normalize``'s eps in the healthy version), the commitment and
  codebook losses averaged over the valid frames.
- ``EntropyVQGAN``: a VQGAN quantiser with the expanded distance
  ``||z||^2 - 2 z.e + ||e||^2`` under float16 autocast and MaskGIT/LFQ's codebook-usage entropy
  over ``softmax(-d / T)``; its codebook initialised from data vectors (k-means init); the
  squared norms are float16 too (CPU autocast keeps ``pow`` and ``sum`` in the input's type):
  they overflow for a raw 12-bit frame among images in [-1, 1] (``fp32_distance``: the
  cast to float32 the fix adds).
- ``FSQAutoencoder``: finite scalar quantisation (Mentzer et al.): ``tanh`` bounding with the
  half-level offset, ``round`` with the straight-through estimator, and the EMA VQ with
  Laplace-smoothed cluster sizes and dead-code restarts from the batch's vectors (healthy).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def encoder(out: int, c: int = 32) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, c, 4, 2, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(c, out, 1))


def decoder(dim: int, c: int = 32) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(dim, c, 3, padding=1), nn.ReLU(),
                         nn.ConvTranspose2d(c, 3, 4, 2, 1))


def images(g: torch.Generator, n: int = 8, size: int = 8) -> torch.Tensor:
    """Smooth random images in [0, 1] (pixels / 255, as torchvision's ToTensor gives them)."""
    low = torch.rand(n, 3, size // 2, size // 2, generator=g)
    return F.interpolate(low, size=size, mode="bilinear", align_corners=False)


# ---------------------------------------------------------------------------------------------
# DALL-E's dVAE: Gumbel-softmax relaxation with an annealed temperature


class DiscreteVAE(nn.Module):
    def __init__(self, num_tokens: int = 32, dim: int = 16, kl_weight: float = 0.1,
                 used_tokens: int | None = None, kl_over_used: bool = False):
        super().__init__()
        self.num_tokens, self.kl_weight, self.kl_over_used = num_tokens, kl_weight, kl_over_used
        self.encoder = encoder(num_tokens)
        self.codebook = nn.Embedding(num_tokens, dim)
        self.decoder = decoder(dim)
        self.temperature = 0.9
        # a vocabulary padded to a multiple of 8 for the tensor cores: the padding codes
        # are masked out of the logits with -inf
        used = torch.arange(num_tokens) < (used_tokens or num_tokens)
        self.register_buffer("used", used, persistent=False)

    def forward(self, img, return_loss: bool = False, temp: float | None = None):
        """DALLE-pytorch's signature: ``vae(images, return_loss=True, temp=temp)`` is the loss."""
        temp = self.temperature if temp is None else temp
        logits = self.encoder(img).masked_fill(~self.used[:, None, None], float("-inf"))
        soft_one_hot = F.gumbel_softmax(logits, tau=temp, dim=1, hard=False)
        sampled = torch.einsum("bnhw,nd->bdhw", soft_one_hot, self.codebook.weight)
        out = self.decoder(sampled)
        logits = logits.flatten(2).transpose(1, 2)
        if self.kl_over_used:
            logits = logits[..., self.used]
        qy = F.log_softmax(logits, dim=-1)
        log_uniform = torch.full_like(qy, -math.log(qy.shape[-1]))
        # with padding codes: exp(-inf) * (-inf - log_uniform) is 0 * -inf in kl_div
        kl = F.kl_div(log_uniform, qy, reduction="batchmean", log_target=True)
        if return_loss:
            return F.mse_loss(out, img) + self.kl_weight * kl
        return out, self.kl_weight * kl


def dvae_loss(out, kl, img):
    return F.mse_loss(out, img) + kl


def linear_temperature(step: int, total: int, start: float = 0.9) -> float:
    return start * (1 - step / (total - 1))  # the bug: reaches 0 at the last step, no floor


def exp_temperature(step: int, total: int, start: float = 0.9, temp_min: float = 0.5) -> float:
    return max(start * math.exp(-1e-1 * step), temp_min)


def make_dvae() -> DiscreteVAE:
    torch.manual_seed(0)
    return DiscreteVAE()


def make_dvae_padded() -> DiscreteVAE:
    torch.manual_seed(0)
    return DiscreteVAE(used_tokens=27)


def make_dvae_padded_fixed() -> DiscreteVAE:
    torch.manual_seed(0)
    return DiscreteVAE(used_tokens=27, kl_over_used=True)


# ---------------------------------------------------------------------------------------------
# cosine-similarity codebook over padded feature sequences


class CosineVQ(nn.Module):
    """ViT-VQGAN's factorised codes: project to a low dimension, l2-normalise, nearest code by
    cosine similarity, straight-through, losses over the valid frames only."""

    def __init__(self, dim: int, codebook_dim: int = 8, n_codes: int = 64, beta: float = 0.25,
                 safe: bool = False):
        super().__init__()
        self.proj_in = nn.Linear(dim, codebook_dim)
        self.embed = nn.Embedding(n_codes, codebook_dim)
        self.proj_out = nn.Linear(codebook_dim, dim)
        self.beta, self.safe = beta, safe

    def forward(self, x, mask):
        z = self.proj_in(x) * mask[..., None]  # padded frames quantise to nothing
        if self.safe:
            z = F.normalize(z, dim=-1)
        else:
            z = z / z.norm(dim=-1, keepdim=True)  # the bug: 0/0 at a padded (zeroed) frame
        codes = F.normalize(self.embed.weight, dim=-1)
        ind = (z @ codes.t()).argmax(-1)
        zq = codes[ind]
        per_frame = self.beta * (zq.detach() - z).pow(2).sum(-1) + (zq - z.detach()).pow(2).sum(-1)
        vq_loss = (per_frame * mask).sum() / mask.sum()
        zq = z + (zq - z).detach()
        return self.proj_out(zq), vq_loss


class RestartCosineVQ(nn.Module):
    """The cosine codebook learned by its codebook loss, each code's usage an EMA; a code
    unused for a few steps restarts from a random frame of the batch (Jukebox, SoundStream).
    ``valid_restarts=False`` draws from every frame, the padded (zeroed) ones too, and the
    codes are l2-normalised by hand: a restarted zero code is 0/0 at the next step."""

    def __init__(self, dim: int, codebook_dim: int = 8, n_codes: int = 32, beta: float = 0.25,
                 decay: float = 0.3, threshold: float = 0.1, valid_restarts: bool = False):
        super().__init__()
        self.proj_in = nn.Linear(dim, codebook_dim)
        self.embed = nn.Embedding(n_codes, codebook_dim)
        self.proj_out = nn.Linear(codebook_dim, dim)
        self.register_buffer("usage", torch.ones(n_codes))
        self.beta, self.decay, self.threshold = beta, decay, threshold
        self.valid_restarts = valid_restarts

    def forward(self, x, mask):
        z = F.normalize(self.proj_in(x) * mask[..., None], dim=-1)
        w = self.embed.weight
        codes = w / w.norm(dim=-1, keepdim=True)  # a zero code is 0/0
        ind = (z @ codes.t()).argmax(-1)
        zq = codes[ind]
        per_frame = self.beta * (zq.detach() - z).pow(2).sum(-1) + (zq - z.detach()).pow(2).sum(-1)
        vq_loss = (per_frame * mask).sum() / mask.sum()
        if self.training:
            self.restart_dead(z, ind, mask)
        zq = z + (zq - z).detach()
        return self.proj_out(zq), vq_loss

    @torch.no_grad()
    def restart_dead(self, z, ind, mask):
        used = F.one_hot(ind[mask.bool()], self.usage.shape[0]).sum(0).float()
        self.usage.mul_(self.decay).add_(used, alpha=1 - self.decay)
        dead = self.usage < self.threshold
        if bool(dead.any()):
            frames = z[mask.bool()] if self.valid_restarts else z.reshape(-1, z.shape[-1])
            pick = torch.randint(0, frames.shape[0], (int(dead.sum()),))
            self.embed.weight.data[dead] = frames[pick]  # the bug: a padded frame is a zero vector
            self.usage[dead] = 1.0


class SoftKMeansVQ(nn.Module):
    """Differentiable k-means (DKM) as a soft VQ: assignments ``softmax(-d / T)`` over the
    euclidean distances to the codes, the soft code their weighted mean; the codebook is
    initialised on the first training batch from its own frames (lucidrains' ``init_embed_``).
    ``squared=False`` writes the distance with a ``sqrt``: a frame that became a code is at
    distance exactly 0, where the sqrt's derivative is infinite."""

    def __init__(self, dim: int, n_codes: int = 8, temperature: float = 0.5,
                 squared: bool = False):
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(n_codes, dim))
        self.register_buffer("initted", torch.tensor(False))
        self.temperature, self.squared = temperature, squared

    def forward(self, x, mask):
        flat = x.reshape(-1, x.shape[-1])
        if self.training and not bool(self.initted):
            with torch.no_grad():
                pick = torch.randperm(flat.shape[0])[:self.embed.shape[0]]
                self.embed.copy_(flat[pick])
                self.initted.fill_(True)
        sq = (flat[:, None] - self.embed[None]).pow(2).sum(-1)
        dist = sq if self.squared else sq.sqrt()  # the bug: sqrt's gradient at a distance of 0
        assign = (-dist / self.temperature).softmax(-1)
        soft = assign @ self.embed
        return soft.view_as(x), dist.new_zeros(())


class SpeechTokenizer(nn.Module):
    def __init__(self, feats: int = 16, hidden: int = 32, quantizer: nn.Module | None = None):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv1d(feats, hidden, 3, padding=1), nn.GELU(),
                                     nn.Conv1d(hidden, hidden, 3, padding=1))
        self.quantizer = quantizer or CosineVQ(hidden)
        self.decoder = nn.Sequential(nn.Conv1d(hidden, hidden, 3, padding=1), nn.GELU(),
                                     nn.Conv1d(hidden, feats, 3, padding=1))

    def forward(self, feats, lengths):  # feats (B, T, F), lengths (B,)
        mask = (torch.arange(feats.shape[1]) < lengths[:, None]).float()
        h = self.encoder(feats.transpose(1, 2)).transpose(1, 2)
        q, vq_loss = self.quantizer(h, mask)
        return self.decoder(q.transpose(1, 2)).transpose(1, 2), vq_loss, mask


def tokenizer_loss(recon, vq_loss, mask, feats):
    err = (recon - feats).pow(2).mean(-1)
    return (err * mask).sum() / mask.sum() + vq_loss


def make_tokenizer() -> SpeechTokenizer:
    torch.manual_seed(0)
    return SpeechTokenizer()


def make_tokenizer_safe() -> SpeechTokenizer:
    torch.manual_seed(0)
    return SpeechTokenizer(quantizer=CosineVQ(32, safe=True))


def make_tokenizer_dkm() -> SpeechTokenizer:
    torch.manual_seed(0)
    return SpeechTokenizer(quantizer=SoftKMeansVQ(32))


def make_tokenizer_dkm_squared() -> SpeechTokenizer:
    torch.manual_seed(0)
    return SpeechTokenizer(quantizer=SoftKMeansVQ(32, squared=True))


def make_tokenizer_restarts() -> SpeechTokenizer:
    torch.manual_seed(0)
    return SpeechTokenizer(quantizer=RestartCosineVQ(32))


def make_tokenizer_valid_restarts() -> SpeechTokenizer:
    torch.manual_seed(0)
    return SpeechTokenizer(quantizer=RestartCosineVQ(32, valid_restarts=True))


def padded_features(g: torch.Generator, lengths: list[int], steps: int = 12, feats: int = 16):
    """Log-mel-like frames zero-padded past each utterance's length (a collate's pad)."""
    x = torch.randn(len(lengths), steps, feats, generator=g)
    lens = torch.tensor(lengths)
    x = x * (torch.arange(steps) < lens[:, None])[..., None]
    return x, lens


# ---------------------------------------------------------------------------------------------
# VQGAN quantiser with an entropy (codebook usage) loss under float16 autocast


class EntropyQuantizer(nn.Module):
    def __init__(self, dim: int = 64, n_codes: int = 64, beta: float = 0.25,
                 inv_temperature: float = 0.01, entropy_weight: float = 0.1,
                 fp32_distance: bool = False):
        super().__init__()
        self.embed = nn.Embedding(n_codes, dim)
        self.beta, self.inv_t, self.entropy_weight = beta, inv_temperature, entropy_weight
        self.fp32_distance = fp32_distance

    def forward(self, z):  # (B, D, H, W)
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        e = self.embed.weight
        if self.fp32_distance:
            flat, e = flat.float(), e.float()
        dist = (flat.pow(2).sum(1, keepdim=True) - 2 * flat @ e.t()  # fp16 under autocast
                + e.pow(2).sum(1))
        ind = dist.argmin(1)
        zq = self.embed(ind)
        prob = (-dist * self.inv_t).softmax(-1)
        per_sample = -(prob * torch.log(prob.clamp_min(1e-5))).sum(-1).mean()
        avg = prob.mean(0)
        codebook_entropy = -(avg * torch.log(avg.clamp_min(1e-5))).sum()
        loss = (F.mse_loss(zq, flat.detach()) + self.beta * F.mse_loss(flat, zq.detach())
                + self.entropy_weight * (per_sample - codebook_entropy))
        zq = flat + (zq - flat).detach()
        return zq.view(b, h, w, d).permute(0, 3, 1, 2), loss


class EntropyVQGAN(nn.Module):
    def __init__(self, dim: int = 64, fp32_distance: bool = False):
        super().__init__()
        self.encoder = encoder(dim)
        self.quantize = EntropyQuantizer(dim, fp32_distance=fp32_distance)
        self.decoder = decoder(dim)

    def forward(self, img):
        q, vq_loss = self.quantize(self.encoder(img))
        return self.decoder(q), vq_loss


def vqgan_loss(out, vq_loss, img):
    return F.l1_loss(out.float(), img) + vq_loss.float()


def data_init(model: nn.Module, img: torch.Tensor) -> None:
    """k-means-style init: the codebook from random encoder vectors of a batch."""
    with torch.no_grad():
        z = model.encoder(img).permute(0, 2, 3, 1).reshape(-1, model.quantize.embed.weight.shape[1])
        pick = torch.randperm(z.shape[0], generator=torch.Generator().manual_seed(0))
        model.quantize.embed.weight.copy_(z[pick[:model.quantize.embed.weight.shape[0]]])


def _vqgan(fp32_distance: bool) -> EntropyVQGAN:
    torch.manual_seed(0)
    model = EntropyVQGAN(fp32_distance=fp32_distance)
    data_init(model, images(torch.Generator().manual_seed(5), n=16) * 2 - 1)
    return model


def make_vqgan() -> EntropyVQGAN:
    return _vqgan(False)


def make_vqgan_fp32() -> EntropyVQGAN:
    return _vqgan(True)


# ---------------------------------------------------------------------------------------------
# residual VQ with SoundStream's quantizer dropout


class ResidualVQ(nn.Module):
    """Stages of nearest-code VQ on the residual of the previous ones; in training each sample
    keeps only its first ``n_q`` stages (quantizer dropout, per sample), its commitment loss
    the mean over the stages it kept. ``min_stages=0`` is the off-by-one
    ``torch.randint(0, Q + 1)`` for ``randint(1, Q + 1)``: a sample keeping no stage is 0/0."""

    def __init__(self, dim: int, stages: int = 4, n_codes: int = 16, min_stages: int = 1):
        super().__init__()
        self.codebooks = nn.ModuleList(nn.Embedding(n_codes, dim) for _ in range(stages))
        self.min_stages = min_stages

    def forward(self, z):  # (B, N, D)
        b, stages = z.shape[0], len(self.codebooks)
        n_q = torch.full((b,), stages)
        if self.training:
            n_q = torch.randint(self.min_stages, stages + 1, (b,))
        residual, out, losses = z, torch.zeros_like(z), []
        for i, codebook in enumerate(self.codebooks):
            keep = (i < n_q).to(z.dtype)[:, None, None]
            ind = torch.cdist(residual, codebook.weight[None].expand(b, -1, -1)).argmin(-1)
            q = codebook(ind)
            losses.append(((q - residual.detach()).pow(2) + 0.25 * (q.detach() - residual)
                           .pow(2)).mean((1, 2)))
            q = residual + (q - residual).detach()
            out = out + q * keep
            residual = residual - q.detach() * keep
        active = (torch.arange(stages)[None] < n_q[:, None]).to(z.dtype)
        per_sample = (torch.stack(losses, 1) * active).sum(1) / active.sum(1)
        return out, per_sample.mean()


class RVQCodec(nn.Module):
    def __init__(self, dim: int = 16, min_stages: int = 1):
        super().__init__()
        self.encoder = encoder(dim)
        self.rvq = ResidualVQ(dim, min_stages=min_stages)
        self.decoder = decoder(dim)

    def forward(self, img):
        z = self.encoder(img)
        b, d, h, w = z.shape
        q, commit = self.rvq(z.flatten(2).transpose(1, 2))
        return self.decoder(q.transpose(1, 2).reshape(b, d, h, w)), commit


def make_rvq() -> RVQCodec:
    torch.manual_seed(0)
    return RVQCodec(min_stages=0)


def make_rvq_fixed() -> RVQCodec:
    torch.manual_seed(0)
    return RVQCodec()


# ---------------------------------------------------------------------------------------------
# finite scalar quantisation, and an EMA codebook with smoothing and dead-code restarts


class FSQ(nn.Module):
    def __init__(self, levels=(8, 5, 5, 5), eps: float = 1e-3):
        super().__init__()
        self.register_buffer("levels", torch.tensor(levels), persistent=False)
        self.eps = eps

    def forward(self, z):  # (..., len(levels))
        half_l = (self.levels - 1) * (1 + self.eps) / 2
        offset = torch.where(self.levels % 2 == 0, 0.5, 0.0)
        shift = torch.atanh(offset / half_l)
        bounded = torch.tanh(z + shift) * half_l - offset
        quantized = bounded + (bounded.round() - bounded).detach()
        return quantized / (self.levels // 2)


class EMACodebook(nn.Module):
    """VQ-VAE-2's EMA codebook with Laplace smoothing; codes unused for a while restart from
    random vectors of the batch (Jukebox)."""

    def __init__(self, dim: int, n_codes: int = 32, decay: float = 0.5, eps: float = 1e-5,
                 threshold: float = 0.1):
        super().__init__()
        self.decay, self.eps, self.threshold = decay, eps, threshold
        self.restarts = 0  # codes restarted so far (logged)
        self.register_buffer("embed", torch.randn(n_codes, dim))
        self.register_buffer("cluster_size", torch.ones(n_codes))
        self.register_buffer("embed_sum", self.embed.clone())

    def forward(self, z):
        flat = z.reshape(-1, z.shape[-1])
        ind = torch.cdist(flat, self.embed).argmin(1)
        zq = self.embed[ind].view_as(z)
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(ind, self.embed.shape[0]).type(flat.dtype)
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_sum.mul_(self.decay).add_(onehot.t() @ flat, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                size = (self.cluster_size + self.eps) / (n + self.embed.shape[0] * self.eps) * n
                self.embed.copy_(self.embed_sum / size[:, None])
                dead = self.cluster_size < self.threshold
                if bool(dead.any()):
                    pick = torch.randint(0, flat.shape[0], (int(dead.sum()),))
                    self.restarts += int(dead.sum())
                    self.embed[dead] = flat[pick]
                    self.embed_sum[dead] = flat[pick]
                    self.cluster_size[dead] = 1.0
        probs = F.one_hot(ind, self.embed.shape[0]).float().mean(0)
        perplexity = torch.exp(-(probs * torch.log(probs + 1e-10)).sum())
        commit = F.mse_loss(z, zq.detach())
        return z + (zq - z).detach(), commit, perplexity


class FSQAutoencoder(nn.Module):
    def __init__(self, levels=(8, 5, 5, 5)):
        super().__init__()
        self.encoder = encoder(len(levels))
        self.fsq = FSQ(levels)
        self.vq = EMACodebook(len(levels))
        self.decoder = decoder(len(levels))

    def forward(self, img):
        z = self.encoder(img).permute(0, 2, 3, 1)
        q, commit, perplexity = self.vq(self.fsq(z))
        return self.decoder(q.permute(0, 3, 1, 2)), commit, perplexity


def fsq_loss(out, commit, perplexity, img):
    return F.mse_loss(out, img) + 0.25 * commit


def make_fsq() -> FSQAutoencoder:
    torch.manual_seed(0)
    return FSQAutoencoder()
