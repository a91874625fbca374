"""Protein language models written by hand, as ESM-2, ProtBERT and their fine-tuning scripts
write them in torch, for ``test_protein_language_models``.

- ``ESM``: an amino-acid vocabulary with ESM's special tokens (``<cls>`` 0, ``<pad>`` 1,
  ``<eos>`` 2, ``<unk>`` 3, ``<mask>`` 32), rotary position embeddings on q and k, pre-LN
  transformer layers with a key padding mask filled with ``-inf``, a tied LM head.
- ``mlm_mask``: BERT's 15 % masking (80 % ``<mask>``, 10 % random residue, 10 % kept) over
  real residues only; the others' targets are ``-100`` (cross-entropy's ``ignore_index``).
- ``ESMRegressor``: a sequence-level head on the masked mean pool over real residues (the
  special tokens and padding excluded), LoRA adapters on the frozen backbone's q and v.
- ``ContactHead``: ESM's contact prediction from the attention maps: symmetrised, then the
  average product correction ``a_ij - a_i. a_.j / a..``, then a logistic regression.
- ``ResidueHead``: a per-residue pLDDT-like regression head, its MSE over resolved residues.
- ``NormEmbedding``: an embedding whose rows are normalised to unit length (a cosine
  vocabulary), with the pad row zeroed as ``padding_idx`` does.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

AA = "LAGVSERTIDPKQNFYMHWCXBUZO"
CLS, PAD, EOS, UNK, MASK = 0, 1, 2, 3, 32
VOCAB = 33
TOK = {a: i + 4 for i, a in enumerate(AA)}


def tokenize(seqs: list[str], unknown: int = UNK) -> torch.Tensor:
    """``<cls> residues <eos>``, padded per batch with ``<pad>`` to the longest sequence;
    a letter not in the alphabet becomes ``unknown``."""
    n = max(len(s) for s in seqs) + 2
    out = torch.full((len(seqs), n), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids = [CLS] + [TOK.get(a, unknown) for a in s] + [EOS]
        out[i, :len(ids)] = torch.tensor(ids)
    return out


def random_seqs(g: torch.Generator, n: int = 8, lo: int = 12, hi: int = 30) -> list[str]:
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return ["".join(AA[int(i)] for i in torch.randint(0, 20, (k,), generator=g))
            for k in lengths]


def residue_mask(tokens: torch.Tensor) -> torch.Tensor:
    """The real residues: not ``<cls>``, ``<pad>``, ``<eos>``."""
    return (tokens != CLS) & (tokens != PAD) & (tokens != EOS)


def mlm_mask(tokens: torch.Tensor, g: torch.Generator, p: float = 0.15):
    """(inputs, targets): BERT's 80/10/10 corruption of a ``p`` share of the real residues."""
    real = residue_mask(tokens)
    pick = (torch.rand(tokens.shape, generator=g) < p) & real
    targets = torch.where(pick, tokens, torch.full_like(tokens, -100))
    r = torch.rand(tokens.shape, generator=g)
    inputs = torch.where(pick & (r < 0.8), torch.full_like(tokens, MASK), tokens)
    rand_aa = torch.randint(4, 24, tokens.shape, generator=g)
    inputs = torch.where(pick & (r >= 0.8) & (r < 0.9), rand_aa, inputs)
    return inputs, targets


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """ESM-2's rotary embedding: ``inv_freq = 1 / 10000^(2i/d)``, cos/sin per position."""

    def __init__(self, dim: int):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, q, k):
        t = torch.arange(q.shape[-2], dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LoRALinear(nn.Module):
    """A frozen linear plus ``(alpha / r) B A x`` (PEFT's LoRA; B starts at 0)."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, r, bias=False)
        self.lora_b = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.scaling = alpha / r

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scaling


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.rot = Rotary(self.hd)

    def forward(self, x, pad_mask):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.heads, self.hd).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rot(q * self.hd ** -0.5, k)
        scores = q @ k.transpose(-1, -2)
        scores = scores.masked_fill(pad_mask[:, None], float("-inf"))
        attn = scores.softmax(-1)
        out = (attn @ v).transpose(1, 2).reshape(b, n, -1)
        return self.out_proj(out), attn


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x, pad_mask):
        h, attn = self.attn(self.ln1(x), pad_mask)
        x = x + h
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)))), attn


class ESM(nn.Module):
    """A small ESM-2: token embedding (pad row 0), rotary layers, a tied LM head.
    ``pairwise_mask``: the padding mask as a pair mask (query or key padded), as code ported
    from a pair-representation model writes it: a padded query's row is all ``-inf``."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2,
                 pairwise_mask: bool = False):
        super().__init__()
        self.pairwise_mask = pairwise_mask
        self.embed_tokens = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.final_ln = nn.LayerNorm(dim)
        self.lm_bias = nn.Parameter(torch.zeros(VOCAB))

    def encode(self, tokens):
        pad_mask = tokens == PAD
        x = self.embed_tokens(tokens)
        x = x * (~pad_mask)[..., None]
        attns = []
        mask = pad_mask[:, None, :]
        if self.pairwise_mask:  # the bug: a padded query then has no key at all
            mask = mask | pad_mask[:, :, None]
        for layer in self.layers:
            x, a = layer(x, mask)
            attns.append(a)
        return self.final_ln(x), torch.stack(attns, 1)

    def forward(self, tokens):
        x, _ = self.encode(tokens)
        return F.linear(x, self.embed_tokens.weight) + self.lm_bias


def make_esm() -> ESM:
    torch.manual_seed(0)
    return ESM()


def make_esm_pairwise() -> ESM:
    torch.manual_seed(0)
    return ESM(pairwise_mask=True)


def mlm_loss(logits, targets):
    """Cross-entropy over the masked residues only (mean over them)."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)


class ESMRegressor(nn.Module):
    """A frozen ESM with LoRA on q and v, the masked mean pool, an MLP head (a stability or
    fluorescence regression, as FLIP's fine-tuning scripts do)."""

    def __init__(self, r: int = 4, alpha: float = 8.0):
        super().__init__()
        self.esm = ESM()
        for p in self.esm.parameters():
            p.requires_grad_(False)
        for layer in self.esm.layers:
            layer.attn.q_proj = LoRALinear(layer.attn.q_proj, r, alpha)
            layer.attn.v_proj = LoRALinear(layer.attn.v_proj, r, alpha)
        self.head = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, tokens):
        x, _ = self.esm.encode(tokens)
        real = residue_mask(tokens).unsqueeze(-1).to(x.dtype)
        pooled = (x * real).sum(1) / real.sum(1)  # the bug: no clamp for 0 residues
        return self.head(pooled).squeeze(-1)


def make_regressor() -> ESMRegressor:
    torch.manual_seed(0)
    return ESMRegressor()


class ESMRegressorSafe(ESMRegressor):
    def forward(self, tokens):
        x, _ = self.esm.encode(tokens)
        real = residue_mask(tokens).unsqueeze(-1).to(x.dtype)
        pooled = (x * real).sum(1) / real.sum(1).clamp(min=1)
        return self.head(pooled).squeeze(-1)


def make_regressor_safe() -> ESMRegressorSafe:
    torch.manual_seed(0)
    return ESMRegressorSafe()


def apc(x):
    """Average product correction (Dunn et al. 2008), as ESM's contact head writes it."""
    a1 = x.sum(-1, keepdims=True)
    a2 = x.sum(-2, keepdims=True)
    a12 = x.sum((-1, -2), keepdims=True)
    avg = a1 * a2
    avg.div_(a12)  # the bug: an all-zero map (every key masked) has a.. = 0
    return x - avg


class ContactHead(nn.Module):
    """ESM's ContactPredictionHead: attention maps of the real residues, symmetrised, APC,
    a logistic regression over (layers x heads) channels."""

    def __init__(self, channels: int):
        super().__init__()
        self.regression = nn.Linear(channels, 1)

    def forward(self, tokens, attentions):
        real = residue_mask(tokens).to(attentions.dtype)
        attentions = attentions * real[:, None, None, :, None] * real[:, None, None, None, :]
        b, layers, heads, n, _ = attentions.shape
        x = attentions.reshape(b, layers * heads, n, n)
        x = apc(x + x.transpose(-1, -2))
        return self.regression(x.permute(0, 2, 3, 1)).squeeze(-1)


class ESMContacts(nn.Module):
    def __init__(self):
        super().__init__()
        self.esm = ESM()
        self.contact_head = ContactHead(2 * 4)

    def forward(self, tokens):
        _, attns = self.esm.encode(tokens)
        return self.contact_head(tokens, attns)


def make_contacts() -> ESMContacts:
    torch.manual_seed(0)
    return ESMContacts()


def contact_loss(logits, contacts, valid):
    """BCE over residue pairs at sequence separation >= 6 of the real residues."""
    loss = F.binary_cross_entropy_with_logits(logits, contacts, reduction="none")
    return (loss * valid).sum() / valid.sum()


class NormEmbedding(nn.Module):
    """Unit-length token embeddings (a cosine vocabulary); the pad row is zeroed each call,
    as ``padding_idx`` intends."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, dim))

    def forward(self, tokens):
        w = self.weight * (torch.arange(VOCAB) != PAD)[:, None]
        e = F.embedding(tokens, w)
        return e / e.norm(dim=-1, keepdim=True)  # the bug: the zeroed pad row has norm 0


class CosineESM(ESM):
    """Trained on fixed-length crops (no padding), so the pad row is only ever looked up by a
    letter the tokenizer maps to ``<pad>``."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = NormEmbedding()

    def encode(self, tokens):
        pad_mask = tokens == PAD
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x, _ = layer(x, pad_mask)
        return self.final_ln(x), None


def make_cosine() -> CosineESM:
    torch.manual_seed(0)
    return CosineESM()


class ResidueHead(nn.Module):
    """A per-residue regression head (pLDDT-like: each residue's lDDT in [0, 1]) on a frozen
    ESM with LoRA."""

    def __init__(self):
        super().__init__()
        self.backbone = ESMRegressorSafe()
        self.plddt = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, tokens):
        x, _ = self.backbone.esm.encode(tokens)
        return torch.sigmoid(self.plddt(x)).squeeze(-1)


def make_residue_head() -> ResidueHead:
    torch.manual_seed(0)
    return ResidueHead()


def residue_loss(pred, target, resolved):
    """MSE over the residues resolved in the structure (the others' lDDT is missing)."""
    return ((pred - target) ** 2 * resolved).sum() / resolved.sum()


class ESMStandardAA(ESM):
    """Predictions restricted to the 20 standard amino acids: the other tokens' logits are
    filled with ``-inf`` before the loss (their probability is exactly 0)."""

    def forward(self, tokens):
        logits = super().forward(tokens)
        allowed = torch.zeros(VOCAB, dtype=torch.bool)
        allowed[4:24] = True
        return logits.masked_fill(~allowed, float("-inf"))


def make_esm_standard() -> ESMStandardAA:
    torch.manual_seed(0)
    return ESMStandardAA()


class RankedLoRALinear(LoRALinear):
    """AdaLoRA's layout without its eps: the rank kept as a buffer, the update scaled by
    ``alpha / ranknum`` in forward; a layer the rank pattern gave r = 0 has an empty A and B
    (their product is 0) and a scale of alpha / 0 = inf."""

    def __init__(self, base: nn.Linear, r: int, alpha: float = 8.0):
        super().__init__(base, r, alpha) if r else nn.Module.__init__(self)
        if not r:
            self.base = base
            with warnings.catch_warnings():  # ("Initializing zero-element tensors is a no-op")
                warnings.simplefilter("ignore")
                self.lora_a = nn.Linear(base.in_features, 0, bias=False)
                self.lora_b = nn.Linear(0, base.out_features, bias=False)
        self.alpha = alpha
        self.register_buffer("ranknum", torch.tensor(float(r)))

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.alpha / self.ranknum


def make_rank_pattern() -> ESMRegressorSafe:
    """LoRA on q and v with PEFT's ``rank_pattern``: the last layer's v projection r = 0."""
    torch.manual_seed(0)
    model = ESMRegressorSafe()
    for i, layer in enumerate(model.esm.layers):
        r = 0 if i == len(model.esm.layers) - 1 else 4
        layer.attn.v_proj = RankedLoRALinear(layer.attn.v_proj.base, r)
    return model
