"""Small models and training loops shared by the recorder tests.

Every model here is tiny (a few hundred parameters) so a test runs a handful of real training
steps in milliseconds. Models that plant a bug take it as a switch (``armed``) that the loop
turns on at a known step, so a test knows exactly which step, module and phase must be blamed.
Batches come from a private ``torch.Generator``: drawing them never touches the global RNG.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

D_IN, HIDDEN, N_CLASSES, BATCH = 4, 8, 3, 8


def batch(step: int, n: int = BATCH, d_in: int = D_IN, n_classes: int = N_CLASSES):
    """The (x, y) of a step: deterministic, independent of the global RNG."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randint(0, n_classes, (n,), generator=g)
    return x, y


def mlp(d_in: int = D_IN, hidden: int = HIDDEN, d_out: int = N_CLASSES) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def train(model, optimizer, loss_fn, steps: int, *, at=None, make_batch=batch, rec=None):
    """The canonical loop of the spec. ``at(step)`` runs before each step (to arm a bug);
    ``rec`` given: the loss goes through ``rec.loss_fn`` (plain-function losses)."""
    call_loss = rec.loss_fn if rec is not None else loss_fn
    for step in range(steps):
        if at is not None:
            at(step)
        x, y = make_batch(step)
        optimizer.zero_grad()
        loss = call_loss(model(x), y)
        loss.backward()
        optimizer.step()


def arm_at(step_k: int, *modules):
    """An ``at`` callback that sets ``armed = True`` on each module from step ``step_k`` on."""

    def at(step):
        for m in modules:
            m.armed = step >= step_k

    return at


# ---------------------------------------------------------------------------------------------
# planted bugs


class LogOf(nn.Module):
    """A custom op: log(|x| + 1) is finite, but once armed it takes log(|x| + 1 - 100) < 0."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return torch.log(x.abs() + 1 - (100.0 if self.armed else 0.0))


class SqrtOf(nn.Module):
    """Forward finite, backward not: once armed, sqrt(relu(x) * 0) is 0 with an infinite
    derivative, so 0 * inf = NaN flows back into the layers below."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        if self.armed:
            return torch.sqrt(x * 0.0)
        return torch.sqrt(x * x + 1.0)


class HalfAmplify(nn.Module):
    """Computes in float16: |x| + 1 times a gain. Armed, the gain is 1e5 and every value exceeds
    float16's 65504, so the output is +inf."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        gain = 1e5 if self.armed else 1.0
        return ((x.abs() + 1).half() * gain).float()


class LogOfDropped(nn.Module):
    """Expects positive inputs. Armed, it computes x * log(x), which is NaN exactly where the
    dropout before it zeroed an element (0 * -inf), so the NaN's place depends on the draw."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        if self.armed:
            return x * torch.log(x)
        return torch.log(x + 1.0)


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.pos = nn.Softplus()
        self.drop = nn.Dropout(0.5)
        self.logd = LogOfDropped()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(self.logd(self.drop(self.pos(self.lin(x)))))


class SharedLog(nn.Module):
    def forward(self, x):
        return torch.log(x)


class SharedNet(nn.Module):
    """One ``SharedLog`` called three times per forward; once armed, its third call (index 2)
    gets a negative, finite input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.shared = SharedLog()
        self.head = nn.Linear(HIDDEN, N_CLASSES)
        self.armed = False

    def forward(self, x):
        h = self.shared(self.lin(x).abs() + 2)
        h = self.shared(h.abs() + 2)
        h = self.shared(h - (100.0 if self.armed else -2.0))
        return self.head(h)


class ParentOwnCode(nn.Module):
    """NaN made by the parent's own functional code (log of x - 10) before it calls a child."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(HIDDEN, HIDDEN)
        self.armed = False

    def forward(self, x):
        h = torch.log(x.abs() - 10.0) if self.armed else torch.log(x.abs() + 1.0)
        return self.child(h)


class ParentNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.parent = ParentOwnCode()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(self.parent(self.lin(x)))


class DictNet(nn.Module):
    """Takes a dict batch {"image": ..., "extra": ...}."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, HIDDEN)
        self.b = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, batch):
        return self.head(torch.relu(self.a(batch["image"]) + self.b(batch["extra"])))


class KwargNet(nn.Module):
    """``model(x, mask=m)``: the mask multiplies the hidden features."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x, mask=None):
        h = torch.relu(self.a(x))
        if mask is not None:
            h = h * mask
        return self.head(h)


class TwoBranchThreaded(nn.Module):
    """Runs two branches in a thread pool, so module hooks fire from worker threads."""

    def __init__(self):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(D_IN, HIDDEN), LogOf())
        self.right = nn.Sequential(nn.Linear(D_IN, HIDDEN), LogOf())
        self.head = nn.Linear(2 * HIDDEN, N_CLASSES)
        self.pool = ThreadPoolExecutor(max_workers=2)

    def forward(self, x):
        fl = self.pool.submit(self.left, x)
        fr = self.pool.submit(self.right, x)
        return self.head(torch.cat([fl.result(), fr.result()], dim=1))


# ---------------------------------------------------------------------------------------------
# a small causal transformer with a -inf mask buffer


class MaskAdd(nn.Module):
    """Adds the -inf causal mask (its buffer ``causal``) to attention scores: its output holds
    -inf by design."""

    def __init__(self, ctx: int):
        super().__init__()
        self.register_buffer("causal", torch.full((ctx, ctx), -math.inf).triu(1))

    def forward(self, scores):
        t = scores.shape[-1]
        return scores + self.causal[:t, :t]


class CausalSelfAttention(nn.Module):
    """``mask_module=False``: a ``mask`` buffer added inline (GPT-2 style); True: a ``mask``
    submodule (``MaskAdd``) whose output is the masked scores."""

    def __init__(self, dim: int, ctx: int, mask_module: bool):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        if mask_module:
            self.mask = MaskAdd(ctx)
        else:
            self.register_buffer("mask", torch.full((ctx, ctx), -math.inf).triu(1))

    def forward(self, x):
        t = x.shape[1]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if isinstance(self.mask, nn.Module):
            scores = self.mask(scores)
        else:
            scores = scores + self.mask[:t, :t]
        return self.proj(torch.softmax(scores, dim=-1) @ v)


class Block(nn.Module):
    def __init__(self, dim: int, ctx: int, mask_module: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, ctx, mask_module)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 16, ctx: int = 8, layers: int = 2,
                 mask_module: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(ctx, dim))
        self.blocks = nn.ModuleList(Block(dim, ctx, mask_module) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def token_batch(step: int, n: int = 4, ctx: int = 8, vocab: int = 11):
    g = torch.Generator().manual_seed(2000 + step)
    seq = torch.randint(0, vocab, (n, ctx + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


# ---------------------------------------------------------------------------------------------
# assertions


def bundles(d: Path) -> list[Path]:
    """Finished bundles in ``d`` (temporary files start with a dot and are not listed)."""
    return sorted(d.glob("*.nan")) if d.exists() else []


def all_files(d: Path) -> list[Path]:
    """Everything in ``d``, hidden files included."""
    return sorted(d.iterdir()) if d.exists() else []


def check_event(ev: dict, **expected) -> None:
    """Assert the given event fields, reporting the whole event on a mismatch."""
    got = {k: ev.get(k) for k in expected}
    assert got == expected, f"event {ev}"


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included): bitwise equality."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True

    def raw(t):  # a fresh row-major copy: contiguous() keeps odd strides of size-1 dims
        return torch.empty(t.shape, dtype=t.dtype).copy_(t.detach().cpu()).reshape(-1) \
            .view(torch.uint8)

    return torch.equal(raw(a), raw(b))


def bn_mlp(d_in: int = D_IN, hidden: int = HIDDEN, d_out: int = N_CLASSES) -> nn.Sequential:
    """An MLP with BatchNorm (buffers that every training forward changes) and dropout."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                         nn.Dropout(0.2), nn.Linear(hidden, d_out))


class PaddedEncoder(nn.Module):
    """``nn.TransformerEncoder`` over padded token sequences with a ``src_key_padding_mask``,
    mean-pooled over the real tokens. In eval mode with gradients off the encoder takes its
    fast path and hands its layers nested tensors. The pooling divides by the number of real
    tokens with no guard: 0/0 for a sequence that is all padding."""

    def __init__(self, vocab: int = 50, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(d, N_CLASSES)

    def forward(self, tokens, pad_mask):
        h = self.enc(self.emb(tokens), src_key_padding_mask=pad_mask)
        keep = (~pad_mask).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))  # BUG pooling: 0/0 when all padding


def make_padded_encoder() -> nn.Module:
    torch.manual_seed(0)
    return PaddedEncoder()


def padded_tokens(step: int, all_padding: int | None = None, n: int = 6, length: int = 9):
    """(tokens, padding mask, labels) of a step; ``all_padding``: a row made all padding."""
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(1, 50, (n, length), generator=g)
    pad = torch.arange(length)[None] >= torch.randint(3, length + 1, (n,), generator=g)[:, None]
    if all_padding is not None:
        pad[all_padding] = True
    return tokens.masked_fill(pad, 0), pad, torch.randint(0, N_CLASSES, (n,), generator=g)
