"""A tiny Llama-style decoder fine-tuned with LoRA in plain PyTorch, written as torchtune's and
lit-gpt's recipes write it, for ``test_llm_finetune_plain``.

- ``Llama``: token embedding (pad id 0 with ``padding_idx``: its row stays zero), RMSNorm
  pre-norm blocks, RoPE from a cached cos/sin table indexed by per-document position ids,
  grouped-query attention through ``F.scaled_dot_product_attention`` (``is_causal`` or a
  block-causal document mask for packed samples), a SwiGLU MLP, tied or untied output, each
  layer under ``torch.utils.checkpoint`` (``use_reentrant=False``).
- ``LoRALinear``: the frozen base ``nn.Linear`` plus ``B(A(dropout(x))) * alpha / r``, B zero
  at init, on q and v.
- ``packed_batch``: documents packed into rows, position ids restarting per document, labels
  ``-100`` on each document's last token and on padding.
- ``chunked_ce``: cross-entropy summed over vocabulary chunks of tokens, ``ignore_index=-100``;
  the loop normalises by the unmasked tokens.
- ``dpo_loss``: DPO over a frozen reference model, ``-logsigmoid(beta * (pi_ratio - ref_ratio))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, SEQ, BATCH = 48, 32, 4, 2, 2, 16, 4


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, style: str = "rsqrt"):
        super().__init__()
        self.eps, self.style = eps, style
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        if self.style == "sqrt":  # lit-gpt's older form: eps outside the root
            normed = x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)
        else:
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.scale).type_as(x)


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in), requires_grad=False)
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        self.lora_a = nn.Linear(d_in, r, bias=False)
        self.lora_b = nn.Linear(r, d_out, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        out = F.linear(x, self.weight)
        return out + self.lora_b(self.lora_a(self.dropout(x))) * self.scaling


def rope_cache(head_dim: int, max_seq: int, base: float = 10000.0):
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq).float(), theta)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)  # (max_seq, head_dim/2, 2)


def apply_rope(x, cache, pos):
    """torchtune's RotaryPositionalEmbeddings: x (B, H, T, D), pos (B, T)."""
    rope = cache[pos][:, None]  # (B, 1, T, D/2, 2)
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    out = torch.stack((xs[..., 0] * rope[..., 0] - xs[..., 1] * rope[..., 1],
                       xs[..., 1] * rope[..., 0] + xs[..., 0] * rope[..., 1]), dim=-1)
    return out.flatten(-2).type_as(x)


def doc_mask(doc_ids):
    """(B, 1, T, T) block-causal: query t sees key s of its own document with s <= t."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.hd = DIM // HEADS
        r, alpha = cfg["r"], cfg["alpha"]
        self.q_proj = LoRALinear(DIM, DIM, r, alpha, cfg["lora_dropout"])
        self.k_proj = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.v_proj = LoRALinear(DIM, KV_HEADS * self.hd, r, alpha, cfg["lora_dropout"])
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.register_buffer("rope", rope_cache(self.hd, SEQ, cfg["rope_base"]), persistent=False)

    def forward(self, x, pos, mask):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, HEADS, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, KV_HEADS, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, KV_HEADS, self.hd).transpose(1, 2)
        q, k = apply_rope(q, self.rope, pos), apply_rope(k, self.rope, pos)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, DIM))


class SwiGLU(nn.Module):
    def __init__(self, cfg: dict, hidden: int = 64):
        super().__init__()
        if cfg["lora_mlp"]:  # torchtune's apply_lora_to_mlp
            self.w1 = LoRALinear(DIM, hidden, cfg["r"], cfg["alpha"], cfg["lora_dropout"])
            self.w3 = LoRALinear(DIM, hidden, cfg["r"], cfg["alpha"], cfg["lora_dropout"])
        else:
            self.w1 = nn.Linear(DIM, hidden, bias=False)
            self.w3 = nn.Linear(DIM, hidden, bias=False)
        self.w2 = nn.Linear(hidden, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.attn_norm = RMSNorm(DIM, cfg["norm_eps"], cfg["norm_style"])
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(DIM, cfg["norm_eps"], cfg["norm_style"])
        self.mlp = SwiGLU(cfg)

    def forward(self, x, pos, mask):
        h = x + self.attn(self.attn_norm(x), pos, mask)
        return h + self.mlp(self.mlp_norm(h))


class Llama(nn.Module):
    def __init__(self, **overrides):
        super().__init__()
        cfg = dict(r=4, alpha=8.0, lora_dropout=0.0, norm_eps=1e-6, norm_style="rsqrt",
                   rope_base=10000.0, tied=True, packed=True, ckpt=True, lora_mlp=False,
                   final_norm_style=None)
        cfg.update(overrides)
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(LAYERS))
        self.norm = RMSNorm(DIM, cfg["norm_eps"], cfg["final_norm_style"] or cfg["norm_style"])
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if cfg["tied"]:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens, pos, doc_ids):
        mask = doc_mask(doc_ids) if self.cfg["packed"] else None
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.cfg["ckpt"] and self.training:
                h = checkpoint(layer, h, pos, mask, use_reentrant=False)
            else:
                h = layer(h, pos, mask)
        return self.output(self.norm(h))


def lora_only(model: nn.Module) -> nn.Module:
    """Freeze everything but the adapters (torchtune's set_trainable_params)."""
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def make_llama():
    torch.manual_seed(0)
    return lora_only(Llama())


def make_untied_causal():
    torch.manual_seed(0)
    return lora_only(Llama(tied=False, packed=False))


def make_dropout():
    """LoRA dropout 0.1 on the adapters' input (torchtune's lora_dropout)."""
    torch.manual_seed(0)
    return lora_only(Llama(lora_dropout=0.1))


def make_eps_zero():
    """``norm_eps=0.0`` read from a config that meant "library default"."""
    torch.manual_seed(0)
    return lora_only(Llama(norm_eps=0.0))


def make_sqrt_norm():
    """RMSNorm written as ``x / (sqrt(mean(x^2)) + eps)``: the root's slope at 0 is infinite."""
    torch.manual_seed(0)
    return lora_only(Llama(norm_style="sqrt"))


def make_rope_base_zero():
    """``rope_base`` left 0 by a config that meant "the checkpoint's": the cached table's
    angles are 0 * inf at position 0."""
    torch.manual_seed(0)
    return lora_only(Llama(rope_base=0.0))


def make_sqrt_norm_in_layers():
    """The sqrt RMSNorm in the (checkpointed) layers only, the final norm torchtune's."""
    torch.manual_seed(0)
    return lora_only(Llama(norm_style="sqrt", final_norm_style="rsqrt"))


def make_bf16():
    """The model in bfloat16 (torchtune's ``dtype: bf16``), the adapters' states in float32,
    loaded from a checkpoint whose final norm's gain is large (logits in the hundreds)."""
    torch.manual_seed(0)
    model = lora_only(Llama())
    with torch.no_grad():
        model.norm.scale.fill_(40.0)
    return model.to(torch.bfloat16)


def packed_batch(g: torch.Generator, pad_rows=(), all_ignored: bool = False):
    """(tokens, pos, doc_ids, labels): 2 or 3 documents per row, position ids restarting at each
    document, labels shifted within documents, -100 on each document's last token. Rows in
    ``pad_rows`` end in padding (token 0, its own document, label -100)."""
    tokens = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.zeros(BATCH, SEQ, dtype=torch.long)
    doc_ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    labels = torch.full((BATCH, SEQ), -100)
    for b in range(BATCH):
        cut = sorted(torch.randperm(SEQ - 4, generator=g)[:2].add(2).tolist())
        bounds = [0, *cut, SEQ]
        for d, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            pos[b, s:e] = torch.arange(e - s)
            doc_ids[b, s:e] = d
            labels[b, s:e - 1] = tokens[b, s + 1:e]
        if b in pad_rows:
            tokens[b, SEQ - 5:] = 0
            labels[b, SEQ - 6:] = -100
            doc_ids[b, SEQ - 5:] = 9
            pos[b, SEQ - 5:] = torch.arange(5)
    if all_ignored:
        labels.fill_(-100)
    return tokens, pos, doc_ids, labels


def chunked_ce(logits, labels, chunks: int = 4):
    """torchtune's CEWithChunkedOutputLoss: the sum of each token chunk's cross-entropy in
    float32; the recipe divides by the number of unmasked tokens."""
    total = logits.new_zeros((), dtype=torch.float32)
    for lg, lb in zip(logits.float().chunk(chunks, dim=1), labels.chunk(chunks, dim=1)):
        total = total + F.cross_entropy(lg.reshape(-1, VOCAB), lb.reshape(-1),
                                        ignore_index=-100, reduction="sum")
    return total


def token_loss(logits, labels, num_tokens):
    return chunked_ce(logits, labels) / num_tokens


def softmax_ce(logits, labels):
    """A hand-written softmax cross-entropy in the logits' dtype (no max subtraction)."""
    e = logits.exp()
    p = e / e.sum(-1, keepdim=True)
    keep = labels != -100
    picked = p.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return -(picked.log() * keep).sum() / keep.sum()


def stable_softmax_ce(logits, labels):
    """The same with the row max subtracted (no overflow), then log of the probability rather
    than log_softmax."""
    e = (logits - logits.amax(-1, keepdim=True)).exp()
    p = e / e.sum(-1, keepdim=True)
    keep = labels != -100
    logp = p.gather(-1, labels.clamp_min(0)[..., None])[..., 0].log()
    return -(logp * keep).sum() / keep.sum()


def sequence_logps(logits, labels, average: bool = False):
    """TRL's get_batch_logps: each sequence's log-probability of its labels (``-100`` left
    out), summed, or averaged over its response tokens (``average_log_prob``, IPO's)."""
    keep = labels != -100
    lp = logits.float().log_softmax(-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    if average:
        return (lp * keep).sum(-1) / keep.sum(-1)
    return (lp * keep).sum(-1)


def dpo_loss(policy_logits, ref_logits, labels, beta: float = 0.1, ipo: bool = False):
    """Rows 0::2 chosen, 1::2 rejected; the reference's logits come from the frozen copy.
    DPO: ``-logsigmoid(beta * margin)``; IPO: ``(margin - 1 / (2 beta))^2`` over averaged
    log-probabilities."""
    pi = sequence_logps(policy_logits, labels, ipo)
    ref = sequence_logps(ref_logits, labels, ipo)
    margin = (pi[0::2] - pi[1::2]) - (ref[0::2] - ref[1::2])
    if ipo:
        return (margin - 1 / (2 * beta)).pow(2).mean()
    return -F.logsigmoid(beta * margin).mean()


def ipo_loss(policy_logits, ref_logits, labels):
    return dpo_loss(policy_logits, ref_logits, labels, ipo=True)


def preference_batch(g: torch.Generator, pairs: int = 2, identical=None):
    """(tokens, pos, doc_ids, labels), chosen and rejected interleaved: each pair shares a
    prompt; the prompt is found as the pair's common prefix and masked -100 (the response
    starts where they differ). Pair ``identical`` has its rejected equal to its chosen."""
    tokens = torch.randint(1, VOCAB, (2 * pairs, SEQ), generator=g)
    for i in range(pairs):
        tokens[2 * i + 1, :6] = tokens[2 * i, :6]
    if identical is not None:
        tokens[2 * identical + 1] = tokens[2 * identical]
    labels = torch.full_like(tokens, -100)
    for i in range(pairs):
        c, r = tokens[2 * i], tokens[2 * i + 1]
        differ = (c != r).nonzero()
        start = int(differ[0]) if len(differ) else SEQ
        labels[2 * i, start - 1:-1] = c[start:]
        labels[2 * i + 1, start - 1:-1] = r[start:]
    pos = torch.arange(SEQ).expand(2 * pairs, SEQ).clone()
    return tokens, pos, torch.zeros_like(tokens), labels
