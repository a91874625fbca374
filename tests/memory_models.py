"""Models trained with memory- and weight-transforming techniques (activation checkpointing,
pruning, parametrizations), written as their users write them, for
``test_memory_techniques.py``."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, D, HEADS, CLASSES = 50, 32, 4, 3


class SelfAttention(nn.Module):
    def __init__(self, d: int = D, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, pad):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        att = att.masked_fill(pad[:, None, None, :], -1e4).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SelfAttention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(4 * d, d))

    def forward(self, x, pad):
        x = x + self.attn(self.ln1(x), pad)
        return x + self.mlp(self.ln2(x))


class CheckpointedEncoder(nn.Module):
    """A document classifier whose blocks run under ``torch.utils.checkpoint`` in training;
    the mean over the kept tokens has no guard: an empty document is 0/0 in the root's own
    code, the forward's last call."""

    def __init__(self, reentrant: bool = False, layers: int = 3):
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, tok, pad):
        x = self.emb(tok)
        for block in self.blocks:
            x = (checkpoint(block, x, pad, use_reentrant=self.reentrant) if self.training
                 else block(x, pad))
        keep = (~pad).float().unsqueeze(-1)
        pooled = (x * keep).sum(1) / keep.sum(1)  # the bug: no clamp_min(1)
        return self.head(pooled)


def make_checkpointed_encoder(reentrant: bool = False) -> nn.Module:
    return CheckpointedEncoder(reentrant)


def documents(step: int, empty_at: int | None = None, empty_row: int = 3, batch: int = 8,
              length: int = 10):
    """Token ids, a padding mask (True = pad) and labels; at step ``empty_at`` the document in
    ``empty_row`` is empty (every position padding, as a filter that removed all its tokens
    leaves it)."""
    g = torch.Generator().manual_seed(step)
    tok = torch.randint(0, VOCAB, (batch, length), generator=g)
    lens = torch.randint(3, length + 1, (batch,), generator=g)
    if step == empty_at:
        lens[empty_row] = 0
    pad = torch.arange(length)[None] >= lens[:, None]
    return tok, pad, torch.randint(0, CLASSES, (batch,), generator=g)


class CosineHead(nn.Module):
    """A cosine classifier: logits are scaled cosines between the features and each class's
    weight row, normalised by hand (``w / ||w||``, no eps)."""

    def __init__(self, d: int, classes: int, scale: float = 10.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, d) / d ** 0.5)
        self.scale = scale

    def forward(self, x):
        w = self.weight / self.weight.norm(dim=1, keepdim=True)  # 0/0 for a pruned row
        return self.scale * nn.functional.normalize(x, dim=1) @ w.t()


class PrunableNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32),
                                      nn.ReLU())
        self.head = CosineHead(32, 10)

    def forward(self, x):
        return self.head(self.features(x))


def make_prunable_net() -> nn.Module:
    return PrunableNet()


def features(step: int, batch: int = 16):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch, 20, generator=g), torch.randint(0, 10, (batch,), generator=g)


class CountsNet(nn.Module):
    """Dense features plus a square-root transform of event counts scaled by a learned
    per-feature rate: a count of 0 is sqrt(0) = 0 in the forward, whose derivative is +inf."""

    def __init__(self):
        super().__init__()
        self.rate = nn.Linear(6, 6)
        self.root = SqrtCounts()
        self.mlp = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 2))

    def forward(self, x, counts):
        return self.mlp(self.rate(x) + self.root(counts * self.rate.weight[:, 0].abs()))


class SqrtCounts(nn.Module):
    def forward(self, c):
        return torch.sqrt(c)  # variance-stabilising transform; no eps


def make_counts_net() -> nn.Module:
    return CountsNet()


def counts(step: int, zero_at: int | None = None, batch: int = 8):
    """Features, event counts (one sample's count 0 at step ``zero_at``) and labels."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, 6, generator=g)
    c = torch.randint(1, 50, (batch, 6), generator=g).float()
    if step == zero_at:
        c[4, 2] = 0
    return x, c, torch.randint(0, 2, (batch,), generator=g)


class SqrtPositive(nn.Module):
    """A parametrization keeping weights non-negative by training their squares: sqrt of the
    stored value, which an update can push below 0."""

    def forward(self, stored):
        return stored.sqrt()

    def right_inverse(self, w):
        return w.abs() ** 2


def make_small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 4))


def tabular(step: int, batch: int = 16):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch, 12, generator=g), torch.randint(0, 4, (batch,), generator=g)


def _save_matmuls(ctx, op, *args, **kwargs):
    """torchtitan's op-level selective checkpointing policy: keep the matmuls' outputs,
    recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveEncoder(CheckpointedEncoder):
    """``CheckpointedEncoder`` under selective activation checkpointing
    (``context_fn=create_selective_checkpoint_contexts``, ``use_reentrant=False``)."""

    def forward(self, tok, pad):
        from functools import partial

        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        x = self.emb(tok)
        for block in self.blocks:
            x = checkpoint(block, x, pad, use_reentrant=False, context_fn=partial(
                create_selective_checkpoint_contexts, _save_matmuls))
        keep = (~pad).float().unsqueeze(-1)
        return self.head((x * keep).sum(1) / keep.sum(1))  # the bug: no clamp_min(1)


def make_selective_encoder() -> nn.Module:
    return SelectiveEncoder()
