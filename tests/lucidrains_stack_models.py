"""Research models on lucidrains' libraries, as their users write them, for
``test_lucidrains_stack``.

- ``make_lm``: a tiny decoder-only language model, x-transformers' ``TransformerWrapper`` over
  a ``Decoder`` (rotary positions, GLU feed-forward, RMSNorm, the einsum attention:
  ``attn_flash=False``) inside an ``AutoregressiveWrapper``, which computes its own
  cross-entropy: ``loss = model(seq)``. ``make_grown_lm`` loads it as a checkpoint whose query
  and key projections grew during pre-training (attention-logit growth, Dehghani et al. 2023):
  fine-tuned under float16 autocast the attention logits ``q . k`` overflow float16;
  ``make_grown_lm_qk_norm`` turns on x-transformers' fix, ``attn_qk_norm``.
  ``make_lm_padded``: the wrapper told the padding id (``ignore_index=PAD``), whose loss is
  ``loss.sum() / valid.sum()``: 0/0 on a micro-batch of padding only. ``make_lm_z_loss``:
  PaLM's z-loss on the attention logits (``add_attn_z_loss=True``) with the padding mask
  passed as ``mask=``: a left-padded sequence's first queries see no valid key, their scores
  are all the fill ``-finfo(float32).max``, and the z-loss adds the layers' logsumexp of it.
- ``TextClassifier``: an ``Encoder`` over padded token ids with its padding mask passed as
  ``mask=``, the embeddings mean-pooled over the valid tokens by a hand-written
  ``masked_mean`` as lucidrains' repositories write it, then a linear head. ``masked_mean``
  divides by the number of valid tokens: 0/0 for an empty text (a fully masked row);
  ``make_classifier_clamped`` clamps the count to 1.
- ``VQVAE``: a conv encoder, ``VectorQuantize`` over the image's feature map
  (``accept_image_fmap=True``) with k-means initialised EMA codebooks updated in place in its
  forward, and a conv decoder; the commitment loss comes back beside the output and is added
  to the reconstruction loss by ``vqvae_loss``. ``make_vqvae_no_eps`` sets the codebook's
  ``eps=0`` (no Laplace smoothing): a k-means cluster left empty has cluster size 0, and the
  in-place codebook update divides its zero sum by it, 0/0, in the forward, outside
  ``optimizer.step()``. ``VQVAEDistance`` adds the user's own codebook-distance term,
  ``(z - codes).pow(2).sum(-1).sqrt()`` (a Euclidean, not squared, distance): a vector the
  k-means init made a code of has distance 0, and the sqrt's derivative is inf there: NaN in
  backward only.
- ``VQVAESpherical``: a cosine-similarity codebook (``use_cosine_sim=True``) and the user's
  spherical distance ``sqrt(2 - 2 cos)`` of each vector to its code: under bfloat16 autocast
  the cosine of a vector with the code k-means made of it rounds above 1.
- ``LFQAutoencoder``: lookup-free quantisation (``LFQ``) with the user's own codebook-usage
  entropy over ``softmax(x . c * inv_temperature)`` as MAGVIT-2 writes it, ``-(p * p.log())``:
  without a floor, the probabilities underflow to 0 for the far codes and ``0 * log(0)`` is NaN
  (``entropy_floored``: the clamp LFQ's own entropy uses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from torch import nn
from torch.utils.data import Dataset
from vector_quantize_pytorch import LFQ, VectorQuantize
from x_transformers import AutoregressiveWrapper, Decoder, Encoder, TransformerWrapper

VOCAB, SEQ, PAD = 64, 16, 0


# ---------------------------------------------------------------------------------------------
# language model: TransformerWrapper + Decoder inside AutoregressiveWrapper


def make_lm(qk_norm: bool = False) -> AutoregressiveWrapper:
    torch.manual_seed(0)
    net = TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=SEQ,
        attn_layers=Decoder(dim=32, depth=2, heads=2, attn_dim_head=16, rotary_pos_emb=True,
                            attn_flash=False, ff_glu=True, use_rmsnorm=True,
                            attn_qk_norm=qk_norm))
    return AutoregressiveWrapper(net)


def make_lm_padded() -> AutoregressiveWrapper:
    """The wrapper told the padding id: its cross-entropy leaves padded targets out."""
    return AutoregressiveWrapper(make_lm().net, ignore_index=PAD, pad_value=PAD)


def make_lm_z_loss() -> AutoregressiveWrapper:
    """PaLM's z-loss on the attention logits too (``add_attn_z_loss=True``), the padding
    mask passed as ``mask=``."""
    return AutoregressiveWrapper(make_lm().net, ignore_index=PAD, pad_value=PAD,
                                 add_attn_z_loss=True)


def grow_qk(model: nn.Module, factor: float = 125.0) -> nn.Module:
    """The query and key projections of a checkpoint whose attention logits grew."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("to_q.weight", "to_k.weight")):
                p.mul_(factor)
    return model


def make_grown_lm() -> AutoregressiveWrapper:
    return grow_qk(make_lm())


def make_grown_lm_qk_norm() -> AutoregressiveWrapper:
    return grow_qk(make_lm(qk_norm=True))


def token_batch(g: torch.Generator, n: int = 8, lengths=None) -> torch.Tensor:
    """Sequences of SEQ + 1 tokens (the wrapper shifts them into input and target); with
    ``lengths``, each right-padded with PAD after its length."""
    seq = torch.randint(1, VOCAB, (n, SEQ + 1), generator=g)
    if lengths is not None:
        seq = seq.masked_fill(torch.arange(SEQ + 1) >= torch.as_tensor(lengths)[:, None], PAD)
    return seq


# ---------------------------------------------------------------------------------------------
# text classifier: Encoder with a padding mask, masked mean pooling


def masked_mean(t, mask, dim=1):
    t = t.masked_fill(~mask[..., None], 0.)
    return t.sum(dim=dim) / mask.sum(dim=dim)[..., None]


def masked_mean_clamped(t, mask, dim=1):
    t = t.masked_fill(~mask[..., None], 0.)
    return t.sum(dim=dim) / mask.sum(dim=dim).clamp(min=1)[..., None]


class TextClassifier(nn.Module):
    def __init__(self, classes: int = 4, pool=masked_mean):
        super().__init__()
        self.encoder = TransformerWrapper(
            num_tokens=VOCAB, max_seq_len=SEQ, return_only_embed=True,
            attn_layers=Encoder(dim=32, depth=2, heads=2, attn_dim_head=16,
                                rotary_pos_emb=True, attn_flash=False, use_rmsnorm=True))
        self.pool = pool
        self.head = nn.Linear(32, classes)

    def forward(self, ids, mask):
        emb = self.encoder(ids, mask=mask, return_embeddings=True)
        return self.head(self.pool(emb, mask))


def make_classifier() -> TextClassifier:
    torch.manual_seed(0)
    return TextClassifier()


def make_classifier_clamped() -> TextClassifier:
    torch.manual_seed(0)
    return TextClassifier(pool=masked_mean_clamped)


class Documents(Dataset):
    """Tokenised documents of 4 to SEQ token ids (from 1; PAD is 0) and a label each; the
    documents ``empty`` hold no token (one the tokenizer's cleaning left empty)."""

    def __init__(self, n: int, seed: int = 0, empty=()):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, SEQ + 1, (n,), generator=g)
        self.docs = [torch.randint(1, VOCAB, (0 if i in empty else int(k),), generator=g)
                     for i, k in enumerate(lengths)]
        self.labels = torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i], self.labels[i]


def pad_collate(items):
    """Token ids right-padded with PAD to SEQ, the padding mask, the labels."""
    ids = torch.stack([F.pad(doc, (0, SEQ - len(doc)), value=PAD) for doc, _ in items])
    return ids, ids != PAD, torch.stack([y for _, y in items])


# ---------------------------------------------------------------------------------------------
# VQ-VAE on VectorQuantize


class VQVAE(nn.Module):
    def __init__(self, eps: float = 1e-5, codebook_size: int = 256, dim: int = 16):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 32, 4, 2, 1), nn.ReLU(),
                                     nn.Conv2d(32, dim, 3, padding=1))
        self.vq = VectorQuantize(dim=dim, codebook_size=codebook_size, decay=0.8, eps=eps,
                                 kmeans_init=True, kmeans_iters=4, commitment_weight=0.25,
                                 accept_image_fmap=True)
        self.decoder = nn.Sequential(nn.Conv2d(dim, 32, 3, padding=1), nn.ReLU(),
                                     nn.ConvTranspose2d(32, 3, 4, 2, 1))

    def forward(self, img):
        z = self.encoder(img)
        quantized, indices, commit_loss = self.vq(z)
        return self.decoder(quantized), commit_loss


class VQVAEDistance(VQVAE):
    """Adds the user's spread term: the images' pooled latents pushed apart by their mean
    pairwise Euclidean distance (the diagonal's distance is 0: NaN in backward)."""

    def forward(self, img):
        z = self.encoder(img)
        quantized, indices, commit_loss = self.vq(z)
        pooled = reduce(z, "b d h w -> b d", "mean")
        dist = (pooled[:, None] - pooled[None]).pow(2).sum(-1).sqrt()
        return self.decoder(quantized), commit_loss - 0.01 * dist.mean()


class VQVAESpherical(VQVAE):
    """A cosine-similarity codebook (ViT-VQGAN's l2-normalised codes) and the user's
    spherical distance of each vector to its code, ``sqrt(2 - 2 cos)``, as a commitment term:
    0 for a vector k-means made a code of, and under bfloat16 autocast the cosine of the
    bfloat16 vector normalised in bfloat16 rounds above 1 there."""

    def __init__(self):
        super().__init__()
        self.vq = VectorQuantize(dim=16, codebook_size=256, use_cosine_sim=True,
                                 kmeans_init=True, kmeans_iters=4, accept_image_fmap=True)

    def forward(self, img):
        z = self.encoder(img)
        quantized, indices, commit_loss = self.vq(z)
        codes = self.vq.get_codes_from_indices(indices).detach()
        cos = (F.normalize(z, dim=1) * F.normalize(codes, dim=1)).sum(1)
        dist = (2 - 2 * cos).sqrt()
        return self.decoder(quantized), commit_loss + 0.1 * dist.mean()


def make_vqvae_spherical() -> VQVAESpherical:
    torch.manual_seed(0)
    return VQVAESpherical()


def make_vqvae() -> VQVAE:
    torch.manual_seed(0)
    return VQVAE()


def make_vqvae_no_eps() -> VQVAE:
    torch.manual_seed(0)
    return VQVAE(eps=0.0)


def make_vqvae_distance() -> VQVAEDistance:
    torch.manual_seed(0)
    return VQVAEDistance()


def vqvae_loss(recon, commit_loss, img):
    return F.mse_loss(recon, img) + commit_loss


def images(g: torch.Generator, n: int = 8, size: int = 8) -> torch.Tensor:
    """Smooth random images in [0, 1]."""
    low = torch.rand(n, 3, size // 2, size // 2, generator=g)
    return F.interpolate(low, size=size, mode="bilinear", align_corners=False)


# ---------------------------------------------------------------------------------------------
# LFQ autoencoder with the user's codebook-usage entropy


def entropy(p):
    return -(p * p.log()).sum(-1)


def entropy_floored(p, eps: float = 1e-5):
    return -(p * p.clamp(min=eps).log()).sum(-1)


class LFQAutoencoder(nn.Module):
    def __init__(self, bits: int = 6, inv_temperature: float = 100.0, ent=entropy):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 32, 4, 2, 1), nn.ReLU(),
                                     nn.Conv2d(32, bits, 3, padding=1))
        self.lfq = LFQ(dim=bits, entropy_loss_weight=0.0, commitment_loss_weight=0.25)
        self.decoder = nn.Sequential(nn.Conv2d(bits, 32, 3, padding=1), nn.ReLU(),
                                     nn.ConvTranspose2d(32, 3, 4, 2, 1))
        self.inv_temperature, self.ent = inv_temperature, ent

    def usage_entropy(self, z):
        """MAGVIT-2's entropy penalty: confident per-vector codes, all codes used per batch."""
        flat = rearrange(z, "b d h w -> (b h w) d")
        prob = (flat @ self.lfq.codebook.t() * 2 * self.inv_temperature).softmax(-1)
        return self.ent(prob).mean() - self.ent(prob.mean(0))

    def forward(self, img):
        z = self.encoder(img)
        quantized, indices, aux_loss = self.lfq(z)
        return self.decoder(quantized), aux_loss + 0.1 * self.usage_entropy(z)


def make_lfq() -> LFQAutoencoder:
    torch.manual_seed(0)
    return LFQAutoencoder()


def make_lfq_floored() -> LFQAutoencoder:
    torch.manual_seed(0)
    return LFQAutoencoder(ent=entropy_floored)
