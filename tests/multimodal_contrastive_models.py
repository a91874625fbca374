"""Image-text contrastive models as OpenCLIP, SigLIP and ALIGN code writes them, for
``test_multimodal_contrastive``.

- ``CLIP``: a small ViT image tower (patch conv, class token, pre-norm residual attention
  blocks) or a bias-free CNN tower, and a text transformer whose eager attention combines the
  causal mask with the captions' padding mask (Hugging Face's ``CLIPTextModel`` layout) and
  pools at the EOS token found by ``argmax`` of the token ids (EOS is the largest id). The
  embeddings are L2-normalised by hand and the learned temperature ``logit_scale = exp(t)``
  comes out of ``forward`` as OpenCLIP's does; the training loop clamps ``t`` to log(100)
  after each update, or (the bug) does not.
- ``ClipLoss``: OpenCLIP's symmetric cross-entropy over the batch, optionally masking the
  captions duplicated in the batch out of the negatives with ``-inf`` (the positive stays).
- ``SigLipLoss``: SigLIP's pairwise sigmoid loss with a learned bias and labels
  ``2 * eye - 1``, written with ``log(sigmoid(.))`` by hand or with ``logsigmoid``.
- ``InfoNCE``: the same symmetric loss written out with ``exp`` and sums, run in fp16.
- ``NegClipLoss``: NegCLIP's, over 2B captions (the true ones, then ``hard_negatives``'
  word-swapped ones) beside B images.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

PAD, BOS, VOCAB, CTX = 0, 1, 64, 8
EOS = VOCAB - 1  # the largest id: CLIP pools at text.argmax(-1)
CLASSES = 8


class Attention(nn.Module):
    """Eager multi-head self-attention over an additive-free boolean ``allowed`` mask."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x, allowed=None):
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(w // self.heads)
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        attn = scores.softmax(dim=-1)
        return self.out((attn @ v).transpose(1, 2).reshape(b, n, w))


class Block(nn.Module):
    """OpenCLIP's ``ResidualAttentionBlock``: pre-norm attention and a GELU MLP."""

    def __init__(self, width: int, heads: int = 2):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x, allowed=None):
        x = x + self.attn(self.ln_1(x), allowed)
        return x + self.mlp(self.ln_2(x))


class TorchBlock(nn.Module):
    """OpenCLIP's block over ``nn.MultiheadAttention`` (``need_weights=False``: PyTorch's
    scaled-dot-product kernel), the padding passed as ``key_padding_mask``."""

    def __init__(self, width: int, heads: int = 2):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x, allowed):
        causal, keys = allowed  # (T, T) and (B, T), True where attended
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=~causal,
                          key_padding_mask=~keys)[0]
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    def __init__(self, width: int = 32, embed: int = 16, patch: int = 4, image: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, patch, stride=patch, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(width) * width ** -0.5)
        self.positional_embedding = nn.Parameter(
            torch.randn((image // patch) ** 2 + 1, width) * 0.01)
        self.ln_pre, self.ln_post = nn.LayerNorm(width), nn.LayerNorm(width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.proj = nn.Parameter(torch.randn(width, embed) * width ** -0.5)

    def forward(self, images):
        x = self.conv1(images).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = self.ln_pre(torch.cat([cls, x], dim=1) + self.positional_embedding)
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x[:, 0]) @ self.proj


class ConvTower(nn.Module):
    """A bias-free CNN (convs feeding BatchNorm-less ReLUs, a linear projection)."""

    def __init__(self, width: int = 16, embed: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, padding=1, bias=False), nn.ReLU())
        self.proj = nn.Linear(width, embed, bias=False)

    def forward(self, images):
        return self.proj(self.stem(images).mean(dim=(2, 3)))


class TextTransformer(nn.Module):
    def __init__(self, width: int = 32, embed: int = 16, torch_attention: bool = False):
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, width)
        self.positional_embedding = nn.Parameter(torch.randn(CTX, width) * 0.01)
        self.torch_attention = torch_attention
        self.blocks = nn.ModuleList([(TorchBlock if torch_attention else Block)(width)
                                     for _ in range(2)])
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.randn(width, embed) * width ** -0.5)
        self.register_buffer("causal", torch.ones(CTX, CTX, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, text):
        x = self.token_embedding(text) + self.positional_embedding
        # a query attends the earlier tokens that are not padding (CLIPTextModel's masks)
        allowed = self.causal & (text != PAD)[:, None, :]
        if self.torch_attention:
            allowed = (self.causal, text != PAD)
        for block in self.blocks:
            x = block(x, allowed)
        x = self.ln_final(x)
        pooled = x[torch.arange(x.shape[0]), text.argmax(dim=-1)]  # the EOS token
        return pooled @ self.text_projection


class CLIP(nn.Module):
    def __init__(self, visual: nn.Module, bias: bool = False, text: nn.Module | None = None):
        super().__init__()
        self.visual, self.transformer = visual, text or TextTransformer()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.logit_bias = nn.Parameter(torch.tensor(-10.0)) if bias else None

    def encode_image(self, images):
        x = self.visual(images)
        return x / x.norm(dim=-1, keepdim=True)

    def encode_text(self, text):
        x = self.transformer(text)
        return x / x.norm(dim=-1, keepdim=True)

    def forward(self, images, text):
        out = (self.encode_image(images), self.encode_text(text), self.logit_scale.exp())
        return out if self.logit_bias is None else (*out, self.logit_bias)


def make_clip() -> CLIP:
    torch.manual_seed(0)
    return CLIP(VisionTransformer())


def make_clip_mha() -> CLIP:
    torch.manual_seed(0)
    return CLIP(VisionTransformer(), text=TextTransformer(torch_attention=True))


def make_clip_cnn() -> CLIP:
    torch.manual_seed(0)
    return CLIP(ConvTower())


def make_clip_finetune() -> CLIP:
    """Fine-tuning from a checkpoint whose temperature reached OpenCLIP's clamp, 100."""
    model = make_clip()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100))
    return model


def make_siglip() -> CLIP:
    torch.manual_seed(0)
    return CLIP(VisionTransformer(), bias=True)


class ClipLoss(nn.Module):
    """OpenCLIP's loss; with ``mask_duplicates`` the other pairs of a caption repeated in the
    batch are not its negatives (their logits ``-inf``; the diagonal stays)."""

    def __init__(self, mask_duplicates: bool = False):
        super().__init__()
        self.mask_duplicates = mask_duplicates

    def forward(self, image_features, text_features, logit_scale, caption_ids):
        logits_per_image = logit_scale * image_features @ text_features.T
        if self.mask_duplicates:
            eye = torch.eye(len(caption_ids), dtype=torch.bool)
            dup = (caption_ids[:, None] == caption_ids[None, :]) & ~eye
            logits_per_image = logits_per_image.masked_fill(dup, float("-inf"))
        labels = torch.arange(len(caption_ids))
        return (F.cross_entropy(logits_per_image, labels)
                + F.cross_entropy(logits_per_image.T, labels)) / 2


class InfoNCE(nn.Module):
    """The symmetric InfoNCE written out by hand, ``exp(s_ii) / sum_j exp(s_ij)``; under fp16
    autocast its logits (a matmul's) are half, so exp overflows past 11.09; ``fp32`` computes
    the loss in float32 from the logits on (a half loss times the GradScaler's 65536
    overflows too)."""

    def __init__(self, fp32: bool = False):
        super().__init__()
        self.fp32 = fp32

    def forward(self, image_features, text_features, logit_scale, caption_ids):
        logits = logit_scale * image_features @ text_features.T
        if self.fp32:
            logits = logits.float()
        sim = torch.exp(logits)
        i2t = -torch.log(sim.diagonal() / sim.sum(dim=1))
        t2i = -torch.log(sim.diagonal() / sim.sum(dim=0))
        return (i2t.mean() + t2i.mean()) / 2


class NegClipLoss(nn.Module):
    """NegCLIP's loss: the text batch is the B captions then B hard-negative captions (the
    caption with its words swapped), so the image side scores ``(B, 2B)`` and the text side
    only the true captions' ``(B, B)``."""

    def forward(self, image_features, text_features, logit_scale, caption_ids):
        b = len(caption_ids)
        logits = logit_scale * image_features @ text_features.T  # (B, 2B)
        labels = torch.arange(b)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits[:, :b].T, labels)) / 2


def hard_negatives(text: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Each caption with two of its words swapped (NegCLIP's order perturbation)."""
    neg = text.clone()
    for row in neg:
        n = int((row != PAD).sum()) - 2  # the words between BOS and EOS
        if n >= 2:
            i, j = torch.randperm(n, generator=g)[:2] + 1
            row[i], row[j] = row[j].clone(), row[i].clone()
    return neg


class SigLipLoss(nn.Module):
    """SigLIP's pairwise sigmoid loss; ``stable=False`` writes ``log(sigmoid(.))`` by hand."""

    def __init__(self, stable: bool = True):
        super().__init__()
        self.stable = stable

    def forward(self, image_features, text_features, logit_scale, logit_bias, caption_ids):
        logits = logit_scale * image_features @ text_features.T + logit_bias
        labels = 2 * torch.eye(len(caption_ids)) - 1
        if self.stable:
            return -F.logsigmoid(labels * logits).sum() / len(caption_ids)
        return -torch.log(torch.sigmoid(labels * logits)).sum() / len(caption_ids)


# ---------------------------------------------------------------------------------------------
# data: each class one image pattern and one caption; pad right, BOS ... EOS


PATTERNS = torch.Generator().manual_seed(123)
IMAGE_PROTOS = torch.randn(CLASSES, 3, 8, 8, generator=PATTERNS)
WORDS = torch.randint(2, EOS, (CLASSES, CTX - 2), generator=PATTERNS)


def caption(c: int, length: int) -> torch.Tensor:
    ids = torch.full((CTX,), PAD)
    ids[0], ids[1:1 + length], ids[1 + length] = BOS, WORDS[c, :length], EOS
    return ids


def pairs(g: torch.Generator, n: int = 8, distinct: bool = True):
    """(images, captions, caption ids): ``distinct`` draws each class once per batch."""
    cls = torch.randperm(CLASSES, generator=g)[:n] if distinct else torch.randint(
        0, CLASSES, (n,), generator=g)
    images = IMAGE_PROTOS[cls] + 0.3 * torch.randn(n, 3, 8, 8, generator=g)
    lengths = torch.randint(1, CTX - 2, (n,), generator=g)
    text = torch.stack([caption(int(c), int(k)) for c, k in zip(cls, lengths)])
    return images, text, cls
