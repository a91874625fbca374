"""Models of the infinity-policy and weight-writer tests, with the factories their bundles name
(``infinity_models:make_...``; replayed from this directory, as ``replay_models``)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, D, CTX, BATCH = 16, 16, 8, 4
D_IN, HIDDEN, N_CLASSES = 8, 16, 4


def token_batch(step: int, n: int = BATCH, ctx: int = CTX):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (n, ctx + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def batch(step: int, n: int = 16):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(n, D_IN, generator=g), torch.randint(0, N_CLASSES, (n,), generator=g)


# ---------------------------------------------------------------------------------------------
# PyTorch's nn.Transformer tutorial: a float -inf causal mask passed into forward


class TutorialLM(nn.Module):
    """``nn.TransformerEncoder`` language model as in PyTorch's tutorial: ``forward(src,
    src_mask)`` with ``src_mask = nn.Transformer.generate_square_subsequent_mask(T)`` (-inf
    above the diagonal), and a ``key_padding_mask`` for padded rows."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=32, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, src, src_mask=None, src_key_padding_mask=None):
        h = self.encoder(self.emb(src), mask=src_mask,
                         src_key_padding_mask=src_key_padding_mask)
        return self.head(h)


def make_tutorial_lm() -> nn.Module:
    return TutorialLM()


# ---------------------------------------------------------------------------------------------
# an intended -inf mask made inside the model, then an unrelated NaN


class MaskFill(nn.Module):
    """Additive mask made in the model: -inf on the last two features (masked_fill)."""

    def forward(self, h):
        cut = torch.arange(h.shape[-1], device=h.device) >= h.shape[-1] - 2
        return h.masked_fill(cut, float("-inf"))


class LogFeature(nn.Module):
    def forward(self, x):
        return torch.log(x)  # BUG: no clamp; a negative input is NaN


class MaskThenLog(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.mask = MaskFill()
        self.attn = nn.Softmax(dim=-1)
        self.feat = LogFeature()
        self.head = nn.Linear(HIDDEN + D_IN, N_CLASSES)

    def forward(self, x):
        p = self.attn(self.mask(self.lin(x)))  # finite: the masked features get weight 0
        return self.head(torch.cat([p, self.feat(1 + x)], dim=-1))  # x in [0, 1) when sane


def make_mask_then_log() -> nn.Module:
    return MaskThenLog()


# ---------------------------------------------------------------------------------------------
# a float16 overflow that a later layer turns into NaN


class HalfThenNorm(nn.Module):
    """The first layer runs in float16: past 65504 it makes +-inf, which LayerNorm then turns
    into NaN (inf - inf)."""

    def __init__(self):
        super().__init__()
        self.half_lin = nn.Linear(D_IN, HIDDEN)
        nn.init.normal_(self.half_lin.weight)
        self.half_lin.half()
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        h = self.half_lin(x.half())  # float16: overflows when the batch holds large values
        return self.head(self.norm(h.float()))


def make_half_then_norm() -> nn.Module:
    return HalfThenNorm()


class ExpHead(nn.Module):
    """The logits are ``exp`` of a linear layer: past ~88 they overflow float32 to +inf, which
    reaches the root output (and the loss) with no NaN in between."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, N_CLASSES)

    def forward(self, x):
        return torch.exp(self.lin(x))  # BUG: unbounded


class ExpOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, D_IN), nn.Tanh())
        self.out = ExpHead()

    def forward(self, x):
        return self.out(self.body(x) * x.abs().amax(dim=1, keepdim=True))


def make_exp_out() -> nn.Module:
    return ExpOut()


# ---------------------------------------------------------------------------------------------
# who wrote the non-finite weights


def make_linear() -> nn.Module:
    """Logistic regression: one Linear layer (parameters ``weight`` and ``bias``)."""
    return nn.Linear(D_IN, N_CLASSES)


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, N_CLASSES))


class TokenClassifier(nn.Module):
    """Mean of token embeddings, then a linear head: an embedding row gets a gradient only at
    steps whose batch holds its token."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, N_CLASSES)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(dim=1))


def make_token_classifier() -> nn.Module:
    return TokenClassifier()


class MaskInputThenLog(MaskThenLog):
    """MaskThenLog with its additive mask passed into forward (a root input) instead."""

    def forward(self, x, mask):
        p = self.attn(self.lin(x) + mask)
        return self.head(torch.cat([p, self.feat(1 + x)], dim=-1))


def make_mask_input_then_log() -> nn.Module:
    return MaskInputThenLog()


# ---------------------------------------------------------------------------------------------
# an additive -inf padding mask passed into forward, as Hugging Face models take a 4-D one


class AdditiveAttention(nn.Module):
    """Self-attention whose additive mask (B, 1, T: 0 or -inf per key) is added to the scores."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D_IN, 3 * HIDDEN)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / HIDDEN ** 0.5 + mask
        return torch.softmax(scores, dim=-1) @ v  # BUG: a row whose every key is masked


class MaskedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = AdditiveAttention()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x, mask):
        return self.head(self.attn(x, mask).mean(dim=1))


def make_masked_encoder() -> nn.Module:
    torch.manual_seed(0)
    return MaskedEncoder()


# ---------------------------------------------------------------------------------------------
# a hand-written GPT whose causal mask is a -inf buffer, added by a module of its own


class CausalMask(nn.Module):
    """Adds its ``bias`` buffer (-inf above the diagonal) to attention scores."""

    def __init__(self, ctx: int = CTX):
        super().__init__()
        self.register_buffer("bias", torch.full((ctx, ctx), float("-inf")).triu(1))

    def forward(self, att):
        t = att.size(-1)
        return att + self.bias[:t, :t]


class MaskedSelfAttention(nn.Module):
    def __init__(self, d: int = D, heads: int = 2):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.heads, self.mask = heads, CausalMask()

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = self.mask(q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5)
        return self.c_proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))


class MaskBufferGPT(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(CTX, D)
        self.ln = nn.ModuleList(nn.LayerNorm(D) for _ in range(layers))
        self.attn = nn.ModuleList(MaskedSelfAttention() for _ in range(layers))
        self.lm_head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for ln, attn in zip(self.ln, self.attn):
            x = x + attn(ln(x))
        return self.lm_head(x)


def make_mask_buffer_gpt() -> nn.Module:
    torch.manual_seed(0)
    return MaskBufferGPT()


# ---------------------------------------------------------------------------------------------
# a 0/1 attention mask made additive by multiplying by -inf


class ArithMaskEncoder(nn.Module):
    """Takes a 0/1 attention mask (1: a real token) and makes it additive by arithmetic."""

    def __init__(self):
        super().__init__()
        self.attn = AdditiveAttention()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x, attention_mask):
        mask = (1.0 - attention_mask[:, None, :]) * float("-inf")  # BUG: 0 * -inf is NaN
        return self.head(self.attn(x, mask).mean(dim=1))


def make_arith_mask_encoder() -> nn.Module:
    torch.manual_seed(0)
    return ArithMaskEncoder()


# ---------------------------------------------------------------------------------------------
# nn.TransformerEncoder with a bool padding mask, which it passes to each attention as -inf


class PaddedEncoderClassifier(nn.Module):
    """Mean pooling over the real tokens."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D, padding_idx=0)
        layer = nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=32, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(D, N_CLASSES)

    def forward(self, ids):
        pad = ids == 0
        h = self.encoder(self.emb(ids), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))


def make_padded_encoder_classifier() -> nn.Module:
    torch.manual_seed(0)
    return PaddedEncoderClassifier()


# ---------------------------------------------------------------------------------------------
# a pre-LN LM whose causal mask is a -inf buffer passed to nn.MultiheadAttention, and whose
# output layer shares the embedding's weight


class TiedBlock(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TiedMaskLM(nn.Module):
    """``sliced``: the mask passed is the buffer sliced to the sequence (a view), as GPT-2-style
    code keeps a mask for the longest context and cuts it per batch."""

    def __init__(self, layers: int = 2, sliced: bool = False):
        super().__init__()
        self.sliced = sliced
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.zeros(CTX, D))
        self.blocks = nn.ModuleList(TiedBlock() for _ in range(layers))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.tok.weight  # weight tying
        self.register_buffer("causal", torch.full((CTX, CTX), float("-inf")).triu(1),
                             persistent=False)

    def forward(self, idx):
        t = idx.size(1)
        x = self.tok(idx) * D ** 0.5 + self.pos[:t]
        mask = self.causal[:t, :t] if self.sliced else self.causal
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def make_tied_mask_lm(sliced: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return TiedMaskLM(sliced=sliced)


# ---------------------------------------------------------------------------------------------
# a hand-written GPT whose causal mask its forward builds and hands each attention by position


class PositionalMaskAttention(nn.Module):
    """``forward(x, mask)``: scores ``q @ k.T / sqrt(d)`` plus the additive mask, softmax."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = q @ k.transpose(-2, -1) / D ** 0.5 + mask
        return self.proj(att.softmax(dim=-1) @ v)


class PositionalMaskBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = PositionalMaskAttention()

    def forward(self, x, mask):
        return x + self.attn(self.ln(x), mask)


class PositionalMaskGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([PositionalMaskBlock() for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        T = idx.shape[1]
        mask = torch.full((T, T), float("-inf"), device=idx.device).triu(1)
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def make_positional_mask_gpt() -> nn.Module:
    torch.manual_seed(0)
    return PositionalMaskGPT()
