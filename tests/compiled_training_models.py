"""Training with ``torch.compile`` as its users write it on CPU, for ``test_compiled_training``
(at module level so that ``nanreplay`` rebuilds the model from the bundle,
``compiled_training_models:make_lm``): a small pre-norm transformer language model (token
embedding with a padding index, RMSNorm, ``F.scaled_dot_product_attention`` with a key padding
mask passed into ``forward``, a GELU MLP, a tied-free head) whose repeated blocks are compiled
one by one (regional compilation) or whose whole model is compiled; a sequence classifier
pooling the real tokens and projecting the pooled vector onto the unit sphere; a hand-written
cross-entropy compiled on its own (the logsumexp written out); batches of varying sequence
lengths padded to the batch's longest (``dynamic=True``) from a DataLoader with a collate
function; a learning rate held in a tensor (what the compiled-optimizer recipe says, so that a
schedule does not recompile ``opt.step``) set by a hand-written warm-up and cosine schedule."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB, D, HEADS, LAYERS, CLASSES = 32, 16, 2, 2, 3
PAD = 0
B = 8


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm; ``eps=0`` as a port from a reference that had none."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    """Pre-norm attention (SDPA with the key padding mask) and MLP."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.norm1 = RMSNorm(D, eps)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.norm2 = RMSNorm(D, eps)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x, keep):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :]  # (B, 1, 1, T): attend to the real tokens only
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    """Token embedding (``padding_idx``: a pad token's vector is 0), blocks, final norm, head."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.blocks = nn.ModuleList(Block(eps) for _ in range(LAYERS))
        self.norm = RMSNorm(D, eps)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids, keep):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, keep)
        return self.head(self.norm(x))


def make_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def make_lm_no_eps() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(eps=0.0)


def compile_blocks(model: TinyLM, **kw) -> TinyLM:
    """Regional compilation: each repeated block compiled in place (one graph serves them all)."""
    for block in model.blocks:
        block.compile(**kw)
    return model


class SphereClassifier(nn.Module):
    """Mean of the real tokens' embeddings through a block, projected onto the unit sphere (the
    pooled vector divided by its norm), a cosine classifier with a learned scale. It counts the
    real tokens it trained on for the logs (``.item()``: a graph break under dynamo)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.block = Block()
        self.pool = SpherePool()
        self.head = nn.Linear(D, CLASSES, bias=False)
        self.scale = nn.Parameter(torch.tensor(10.0))
        self.tokens_seen = 0

    def forward(self, ids, keep):
        self.tokens_seen += int(keep.sum().item())
        x = self.block(self.embed(ids), keep)
        z = self.pool(x, keep)
        return self.scale * self.head(z)


class SpherePool(nn.Module):
    """Masked mean pooling, then ``z / ||z||`` written with ``sqrt`` of the sum of squares
    (clamped after the root: the forward stays finite on a zero vector, its backward does not)."""

    def forward(self, x, keep):
        w = keep.unsqueeze(-1).to(x.dtype)
        z = (x * w).sum(1) / w.sum(1).clamp_min(1.0)
        norm = torch.sqrt((z * z).sum(-1, keepdim=True))
        return z / norm.clamp_min(1e-6)


def make_sphere() -> SphereClassifier:
    torch.manual_seed(0)
    return SphereClassifier()


class ShiftNorm(nn.Module):
    """LayerNorm written by hand with the one-pass variance ``E[x^2] - E[x]^2`` (a speed-minded
    rewrite for the compiler); under bfloat16 autocast it cancels to below 0 on rows with a
    large offset."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) * torch.rsqrt(var + 1e-6) * self.weight


class FeatureNet(nn.Module):
    """A regression MLP over a window of sensor readings, trained in bfloat16 (the whole model
    cast, the batch cast in ``forward``): each window standardised by the hand-written norm,
    a linear layer, a head."""

    def __init__(self, d_in: int = 8):
        super().__init__()
        self.norm = ShiftNorm(d_in)
        self.inp = nn.Linear(d_in, D)
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        x = x.to(self.inp.weight.dtype)
        return self.head(F.gelu(self.inp(self.norm(x)))).squeeze(-1)


def make_feature_net() -> FeatureNet:
    torch.manual_seed(0)
    return FeatureNet().to(torch.bfloat16)


def lm_cross_entropy(logits, targets, keep):
    """Next-token cross-entropy written out (the logsumexp without subtracting the max), masked
    to the real tokens; compiled on its own by the loop."""
    lse = torch.log(torch.exp(logits).sum(-1))
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    w = keep.to(logits.dtype)
    return ((lse - picked) * w).sum() / w.sum()


class MaskedLM(nn.Module):
    """A loss wrapper: ``loss(logits, ids, keep)`` shifting the ids into targets, the logits
    divided by a temperature (sharpened below 1)."""

    def __init__(self, temperature: float = 1.0):
        super().__init__()
        self.temperature = temperature

    def forward(self, logits, ids, keep):
        logits = logits / self.temperature
        return lm_cross_entropy(logits[:, :-1], ids[:, 1:], keep[:, 1:])


class LearnedTemperatureLM(nn.Module):
    """The loss with a learned temperature (a parameter the optimizer trains with the model),
    started at a value from the config."""

    def __init__(self, temperature: float = 1.0):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(float(temperature)))

    def forward(self, logits, ids, keep):
        scaled = logits / self.temperature
        return lm_cross_entropy(scaled[:, :-1], ids[:, 1:], keep[:, 1:])


class Sequences(Dataset):
    """Token sequences of lengths 3..12 (ids 1..VOCAB-1), with a class label."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(3, 13, (n,), generator=g).tolist()
        self.seqs = [torch.randint(1, VOCAB, (k,), generator=g) for k in self.lengths]
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], self.labels[i]


def collate(items):
    """Pad to the batch's longest sequence: ``ids`` (pad 0) and ``keep`` (True on real tokens)."""
    t = max(len(s) for s, _ in items)
    ids = torch.full((len(items), t), PAD, dtype=torch.long)
    for i, (s, _) in enumerate(items):
        ids[i, :len(s)] = s
    return ids, ids != PAD, torch.stack([y for _, y in items])


def loader(data: Dataset) -> DataLoader:
    return DataLoader(data, batch_size=B, shuffle=False, collate_fn=collate)


def features(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x[:, :3].sum(-1) + 0.1 * torch.randn(n, generator=g)


def warmup_cosine(step: int, base: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``base``, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / (total - warmup)
    return 0.5 * base * (1.0 + math.cos(math.pi * progress))


def warmup_lr(step: torch.Tensor, base: float, warmup: int) -> torch.Tensor:
    """Linear warm-up ``base * min(step / warmup, 1)`` computed on the step held as a tensor
    (no Python number reaches the compiled ``opt.step``: no recompile as it changes)."""
    return base * torch.clamp(step / warmup, max=1.0)


def shifted_cross_entropy(logits, ids, keep):
    """The loss as a function: next-token cross-entropy over the real tokens, z-loss added
    (PaLM's ``1e-4 * log(Z)^2``, keeping the softmax normaliser near 1)."""
    logits, targets, w = logits[:, :-1], ids[:, 1:], keep[:, 1:].to(logits.dtype)
    log_z = torch.logsumexp(logits, -1)
    nll = log_z - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return ((nll + 1e-4 * log_z ** 2) * w).sum() / w.sum()
