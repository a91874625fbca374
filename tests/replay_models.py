"""Models with planted bugs for the end-to-end replay tests (``tests/test_replay_e2e.py``).

Unlike ``models.py`` (recorder tests), nothing here is switched on by a flag that the training
loop flips: a replay rebuilds the model from its factory, so every bug must come back from what
a bundle holds, the weights, the batch and the RNG states. Each bug therefore fires on data the
loop feeds at a known step (a scaled batch, a zero row, a padded sequence), on the dropout
draw, or on a hyper-parameter; only ``CountedNet`` depends on hidden process state, on purpose,
to make an event the replay cannot reproduce.

Every factory is named ``make_*`` and returns a fresh model; the tests pass
``factory="replay_models:make_*"`` to the recorder and replay from this directory.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

D_IN, HIDDEN, N_CLASSES, BATCH = 4, 8, 3, 8


def batch(step: int, n: int = BATCH, d_in: int = D_IN, n_classes: int = N_CLASSES):
    """The (x, y) of a step: deterministic, independent of the global RNG."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randint(0, n_classes, (n,), generator=g)
    return x, y


# ---------------------------------------------------------------------------------------------
# (a) a custom op: log of a value that goes negative when the batch is scaled up


class ShiftedLog(nn.Module):
    """log(x + 3): finite for the small activations of normal batches, NaN below -3."""

    def forward(self, x):
        return torch.log(x + 3.0)  # BUG: no clamp, x < -3 gives NaN


class LogNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.act = ShiftedLog()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(self.act(self.lin(x)))


def make_log_net() -> nn.Module:
    return LogNet()


def make_compiled_log_net() -> nn.Module:
    """``LogNet`` as most training scripts now build it: ``torch.compile`` (inductor)."""
    return torch.compile(LogNet())


# ---------------------------------------------------------------------------------------------
# (b) plain MLP (bad data) and (i) structured batches


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, N_CLASSES))


class DictNet(nn.Module):
    """Takes ``{"image": ..., "extra": ...}``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, HIDDEN)
        self.b = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, batch):
        return self.head(torch.relu(self.a(batch["image"]) + self.b(batch["extra"])))


def make_dict_net() -> nn.Module:
    return DictNet()


class TupleNet(nn.Module):
    """Takes ``(x, extra)`` as one positional argument."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, HIDDEN)
        self.b = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, pair):
        x, extra = pair
        return self.head(torch.relu(self.a(x) + self.b(extra)))


def make_tuple_net() -> nn.Module:
    return TupleNet()


class KwargNet(nn.Module):
    """``model(x, scale=s)``: log of the scaled hidden features, NaN where they pass -3."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.act = ShiftedLog()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x, *, scale=None):
        h = self.lin(x)
        if scale is not None:
            h = h * scale
        return self.head(self.act(h))


def make_kwarg_net() -> nn.Module:
    return KwargNet()


class NaiveNLL(nn.Module):
    """Cross entropy written as -log(softmax(x)[target]): a target probability that underflows
    to 0 gives log(0) = -inf (``log_softmax`` would not). ``reduction`` as torch losses have it."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, target):
        p = logits.softmax(dim=-1).gather(1, target[:, None]).squeeze(1)
        per_row = -torch.log(p)  # BUG: log of a probability that can be exactly 0
        return per_row.mean() if self.reduction == "mean" else per_row


def make_mlp_naive_nll() -> dict:
    return {"model": make_mlp(), "loss_fn": NaiveNLL()}


# ---------------------------------------------------------------------------------------------
# (c) backward only: the length of a feature vector, sqrt at 0 for an all-zero row


class WithLength(nn.Module):
    """Appends each row's Euclidean length. Forward finite for every input; the derivative of
    sqrt at 0 is +inf, so an all-zero row gives inf (SqrtBackward0), then 0 * inf = NaN."""

    def forward(self, h):
        length = torch.sqrt((h * h).sum(dim=-1, keepdim=True))  # BUG: no eps under the sqrt
        return torch.cat([h, length], dim=-1)


class LengthNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN, bias=False)  # a zero input row stays zero
        self.feat = WithLength()
        self.head = nn.Linear(HIDDEN + 1, N_CLASSES)

    def forward(self, x):
        return self.head(self.feat(self.lin(x)))


def make_length_net() -> nn.Module:
    return LengthNet()


# ---------------------------------------------------------------------------------------------
# (d) a tiny custom optimizer


class NormalizedSGD(torch.optim.Optimizer):
    """Steps by the gradient's direction: p -= lr * g / |g|, 0/0 = NaN for a zero gradient."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                direction = p.grad / p.grad.norm()  # BUG: no eps
                p.sub_(direction, alpha=group["lr"])


class DeadUnitNet(nn.Module):
    """A bias that receives no gradient once its unit is cut off: ``gate`` is 0 for it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.side = nn.Linear(D_IN, 1)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x, gate):
        return self.head(torch.relu(self.lin(x))) + self.side(x) * gate


def make_dead_unit_net() -> dict:
    return {"model": DeadUnitNet(), "optimizer": lambda groups: NormalizedSGD(groups)}


# ---------------------------------------------------------------------------------------------
# (e) float16 overflow in one layer; (l) the same model under an LR spike


class Fp16Net(nn.Module):
    """The first layer runs in float16 (``.half()``): past 65504 its output is +-inf."""

    def __init__(self):
        super().__init__()
        self.half_lin = nn.Linear(D_IN, HIDDEN)
        nn.init.normal_(self.half_lin.weight)  # unit variance: a gain above 1 for big inputs
        self.half_lin.half()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        h = self.half_lin(x.half())  # float16: overflows when the batch holds large values
        return self.head(torch.relu(h).float())


def make_fp16_net() -> nn.Module:
    return Fp16Net()


class AmpNet(nn.Module):
    """Trained under ``torch.autocast(dtype=float16)``: the first layer's matmul runs in
    float16 and overflows for large inputs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        nn.init.normal_(self.lin.weight)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(torch.relu(self.lin(x)))


def make_amp_net() -> nn.Module:
    return AmpNet()


# ---------------------------------------------------------------------------------------------
# (f) a NaN that depends on the dropout draw


class XLogX(nn.Module):
    """x * log(x) for positive x: 0 * -inf = NaN where dropout zeroed an element."""

    def forward(self, x):
        return x * torch.log(x)  # BUG: 0 * log(0)


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.pos = nn.Softplus()
        self.drop = nn.Dropout(0.05)
        self.ent = XLogX()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(self.ent(self.drop(self.pos(self.lin(x)))))


def make_dropout_net() -> nn.Module:
    return DropoutNet()


# ---------------------------------------------------------------------------------------------
# (g) one module called three times per forward


class SharedNet(nn.Module):
    """``act`` (log(x + 3)) runs three times; only its third call (index 2) sees a signed
    input, the first two see ReLU outputs."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D_IN, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, HIDDEN)
        self.l3 = nn.Linear(D_IN, HIDDEN)
        self.act = ShiftedLog()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        h = self.act(torch.relu(self.l1(x)))
        h = self.act(torch.relu(self.l2(h)))
        h = self.act(self.l3(x) + h)
        return self.head(h)


def make_shared_net() -> nn.Module:
    return SharedNet()


# ---------------------------------------------------------------------------------------------
# (h) functional code in a parent's own forward (a submodule, and the root)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h = torch.log(self.inner(x) + 3.0)  # BUG: the block's own code, no child made it
        return self.out(h)


class ParentNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.block = Block()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(self.block(self.lin(x)))


def make_parent_net() -> nn.Module:
    return ParentNet()


class RootNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        h = torch.log(self.lin(x) + 3.0)  # BUG: in the root's own forward
        return self.head(h)


def make_root_net() -> nn.Module:
    return RootNet()


class RootLogFeatures(nn.Module):
    """Log-magnitude features taken in the root's own forward: a feature of exactly 0 is
    ``log(0) = -inf``, which ``lin`` spreads as +-inf and ``head`` sums to NaN (inf - inf). The
    NaN is made inside a submodule, from an infinity no submodule made."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        feats = torch.log(x.abs())  # BUG: no floor, a zero feature is -inf
        return self.head(self.lin(feats))


def make_root_log_features() -> nn.Module:
    return RootLogFeatures()


class LogFeaturesNet(nn.Module):
    """``RootLogFeatures`` as a submodule's code: ``feat``'s own forward takes the log and its
    children spread it and sum it to NaN."""

    def __init__(self):
        super().__init__()
        self.feat = RootLogFeatures()
        self.head = nn.Linear(N_CLASSES, N_CLASSES)

    def forward(self, x):
        return self.head(self.feat(x))


def make_log_features_net() -> nn.Module:
    return LogFeaturesNet()


SEQ_T, SEQ_D = 11, 16


class RangeScaledAttention(nn.Module):
    """Sequence-first self-attention over sensor readings ``(T, B, F)`` with a key padding
    mask: each series' channels are scaled by their range over time in the root's own forward,
    and a stuck sensor (a constant channel) is ``x / 0 = +inf`` there, which attention turns
    into NaN while its masked_fill of the padded keys makes an intended -inf."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, SEQ_D)
        self.attn = nn.MultiheadAttention(SEQ_D, 2)  # batch_first=False: (T, B, E)
        self.head = nn.Linear(SEQ_D, N_CLASSES)

    def forward(self, x, pad):  # x: (T, B, F), pad: (B, T), True at padding
        x = x / (x.amax(0, keepdim=True) - x.amin(0, keepdim=True))  # BUG: no eps
        h = self.inp(x)  # (T, B, E)
        a, _ = self.attn(h, h, h, key_padding_mask=pad)
        return self.head(a.mean(0))  # (B, C)


def make_range_scaled_attention() -> nn.Module:
    return RangeScaledAttention()


def sensor_batch(step: int, stuck: int | None = None, at: int = 3, n: int = BATCH):
    """(x, pad, y): ``n`` series of ``SEQ_T`` readings, sequence first, padded at the end;
    series ``stuck`` reads a constant 0.7 on channel 1 at step ``at``."""
    g = torch.Generator().manual_seed(4000 + step)
    x = torch.randn(SEQ_T, n, D_IN, generator=g)
    lengths = torch.randint(6, SEQ_T + 1, (n,), generator=g)
    pad = torch.arange(SEQ_T)[None] >= lengths[:, None]  # (B, T)
    if stuck is not None and step == at:
        x[:, stuck, 1] = 0.7
    return x, pad, torch.randint(0, N_CLASSES, (n,), generator=g)


class RelativeErrorNet(nn.Module):
    """A regression that returns its own loss, the mean squared relative error (a 0-d tensor,
    so the model's output has no samples): a target of 0 divides by 0."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x, target):
        pred = self.head(torch.relu(self.lin(x))).squeeze(-1)  # (B,)
        rel = (pred - target) / target.abs()  # BUG: a target of 0
        return rel.pow(2).mean()


def make_relative_error_net() -> nn.Module:
    return RelativeErrorNet()


# ---------------------------------------------------------------------------------------------
# (k) a causal transformer whose -inf mask leaves a fully masked row


class MaskScores(nn.Module):
    """Scores of hidden keys set to -inf; recorded with ``allow_inf=["*.mask"]``."""

    def forward(self, scores, hidden):
        return scores.masked_fill(hidden, float("-inf"))


class Attention(nn.Module):
    def __init__(self, dim: int, ctx: int, modules: bool = False):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("future", torch.ones(ctx, ctx, dtype=torch.bool).triu(1))
        self.mask = MaskScores() if modules else None
        self.softmax = nn.Softmax(dim=-1) if modules else None

    def forward(self, x, pad):
        t = x.shape[1]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        hidden = self.future[:t, :t] | pad[:, None, :]  # (B, T, T): future or padding keys
        if self.mask is not None:  # the same, through modules
            attn = self.softmax(self.mask(scores, hidden))  # BUG: as below
            return self.proj(attn @ v)
        scores = scores.masked_fill(hidden, float("-inf"))  # intentional -inf
        attn = torch.softmax(scores, dim=-1)  # BUG: a row with every key hidden is NaN
        return self.proj(attn @ v)


class TinyBlock(nn.Module):
    def __init__(self, dim: int, ctx: int, modules: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, ctx, modules)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, pad):
        x = x + self.attn(self.ln1(x), pad)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token ids and a key-padding mask (True = padding) in, next-token logits out."""

    def __init__(self, vocab: int = 11, dim: int = 16, ctx: int = 8, layers: int = 2,
                 modules: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(ctx, dim) * 0.02)
        self.blocks = nn.ModuleList(TinyBlock(dim, ctx, modules) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx, pad):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x, pad)
        return self.head(self.ln(x))


def make_tiny_gpt() -> nn.Module:
    return TinyGPT()


def make_tiny_gpt_modules() -> nn.Module:
    """Masking and softmax done by modules: ``blocks.<i>.attn.mask``, ``...attn.softmax``."""
    return TinyGPT(modules=True)


def token_batch(step: int, n: int = 4, ctx: int = 8, vocab: int = 11):
    """(ids, pad mask, targets); no padding."""
    g = torch.Generator().manual_seed(2000 + step)
    seq = torch.randint(0, vocab, (n, ctx + 1), generator=g)
    pad = torch.zeros(n, ctx, dtype=torch.bool)
    return seq[:, :-1], pad, seq[:, 1:]


# ---------------------------------------------------------------------------------------------
# (m) exp overflow, then inf - inf


class ExpCentered(nn.Module):
    """exp(x) minus its row mean: exp overflows float32 past 88.7, then inf - inf = NaN."""

    def forward(self, x):
        e = torch.exp(x)  # BUG: no max subtraction
        return e - e.mean(dim=-1, keepdim=True)


class ExpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.expc = ExpCentered()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(self.expc(self.lin(x)))


def make_exp_net() -> nn.Module:
    return ExpNet()


# ---------------------------------------------------------------------------------------------
# (o) activation checkpointing: blocks whose forward runs again during backward


class CheckpointedNet(nn.Module):
    """``LengthNet``'s features, then dropout and ``ShiftedLog``, in two blocks run under
    ``torch.utils.checkpoint`` (as ``gradient_checkpointing_enable()`` does in Hugging Face
    models): each block's modules are called again inside backward to remake the activations,
    with the dropout draw of the forward. ``inp`` runs outside, so the blocks' input requires
    grad, which the reentrant variant needs."""

    def __init__(self, reentrant: bool = False):
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(D_IN, HIDDEN, bias=False)  # a zero input row stays zero
        self.feat = nn.Sequential(nn.Linear(HIDDEN, HIDDEN, bias=False), WithLength())
        self.mix = nn.Sequential(nn.Linear(HIDDEN + 1, HIDDEN), nn.Dropout(0.2), ShiftedLog())
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for block in (self.feat, self.mix):
            x = checkpoint(block, x, use_reentrant=self.reentrant) if self.training else block(x)
        return self.head(x)


def make_checkpointed_net() -> nn.Module:
    return CheckpointedNet()


def make_reentrant_checkpointed_net() -> nn.Module:
    return CheckpointedNet(reentrant=True)


# ---------------------------------------------------------------------------------------------
# (p) a model whose own code raises on the NaN (an op refusing it)


class SamplingNet(LogNet):
    """``LogNet`` that also samples a class from its own prediction (a policy's action, a
    sampled token): ``torch.multinomial`` raises on NaN probabilities, so the step that makes a
    NaN in ``act`` ends in a RuntimeError inside the forward, in training and in the replay."""

    def forward(self, x):
        out = super().forward(x)
        self.sampled = torch.multinomial(torch.softmax(out.detach(), -1), 1)
        return out


def make_sampling_net() -> nn.Module:
    return SamplingNet()


# ---------------------------------------------------------------------------------------------
# (n) a NaN that depends on hidden process state: not reproducible from a bundle

CALLS = {"n": 0, "fire_at": -1, "every": 0}


class Flaky(nn.Module):
    """NaN on the forward whose number (a process-wide counter) is ``fire_at`` and, with
    ``every`` set, on every ``every``-th forward after it: a stand-in for a transient fault or
    a race, which a replay does not see again (or sees on one re-run and not the next)."""

    def forward(self, x):
        CALLS["n"] += 1
        since = CALLS["n"] - CALLS["fire_at"]
        if since == 0 or (CALLS["every"] and since > 0 and since % CALLS["every"] == 0):
            return x * float("nan")
        return x


class CountedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_IN, HIDDEN)
        self.flaky = Flaky()
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(self.flaky(self.lin(x)))


def make_counted_net() -> nn.Module:
    return CountedNet()


# ---------------------------------------------------------------------------------------------
# a convolutional net in channels-last memory format (its activations are not contiguous)


class ImageStandardize(nn.Module):
    """Per-image standardisation of a feature map, written without an eps."""

    def forward(self, x):
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        std = x.std(dim=(1, 2, 3), keepdim=True)
        return (x - mean) / std  # BUG: no eps, a blank image's map is 0/0


class ChannelsLastConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.norm = ImageStandardize()
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, N_CLASSES)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.act(self.norm(self.conv(x)))), 1))


def make_channels_last_conv_net() -> nn.Module:
    return ChannelsLastConvNet().to(memory_format=torch.channels_last)


def image_batch(step: int, blank: int | None = None, at: int = 3):
    """(images, labels) of a step, 8 RGB 16x16 images in channels-last memory format; image
    ``blank`` is all zeros at step ``at``."""
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(BATCH, 3, 16, 16, generator=g)
    y = torch.randint(0, N_CLASSES, (BATCH,), generator=g)
    if blank is not None and step == at:
        x[blank] = 0.0
    return x.contiguous(memory_format=torch.channels_last), y


# ---------------------------------------------------------------------------------------------
# a batch-first forecaster passed a square causal mask


class Forecaster(nn.Module):
    """``nn.Transformer(batch_first=True)`` over a multivariate series; the loop passes the
    ``(T, T)`` causal mask into ``forward``."""

    def __init__(self, n_vars: int = 3, d: int = 16):
        super().__init__()
        self.enc_in = nn.Linear(n_vars, d)
        self.dec_in = nn.Linear(n_vars, d)
        self.transformer = nn.Transformer(d, 2, num_encoder_layers=1, num_decoder_layers=1,
                                          dim_feedforward=32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, n_vars)

    def forward(self, past, future_in, tgt_mask):
        return self.out(self.transformer(self.enc_in(past), self.dec_in(future_in),
                                         tgt_mask=tgt_mask))


def make_forecaster() -> nn.Module:
    return Forecaster()


def series_batch(step: int, bad: int | None = None, at: int = 3, n: int = BATCH, t: int = 12):
    """(past, decoder input, future) of 8 series of 12 steps; series ``bad`` has a missing
    reading (NaN) at step ``at``."""
    g = torch.Generator().manual_seed(3000 + step)
    series = torch.cumsum(torch.randn(n, 2 * t + 1, 3, generator=g) * 0.1, 1)
    if bad is not None and step == at:
        series[bad, 4, 1] = float("nan")
    past, future = series[:, :t], series[:, t:]
    return past, future[:, :-1], future[:, 1:]


# ---------------------------------------------------------------------------------------------
# variable-length sequences fed as a PackedSequence (pack_padded_sequence, unsorted)

SEQ_LENGTHS = (5, 9, 3, 12, 7, 4, 10, 6)  # sample 3 is the longest: sorted position 0


def packed_batch(step: int, bad: int | None = None, value: float = float("nan"), at: int = 3):
    """(PackedSequence, y) of 8 positive feature sequences of ``SEQ_LENGTHS``, packed with
    ``enforce_sorted=False``; sequence ``bad`` holds ``value`` from its time step 2 on at
    step ``at``."""
    g = torch.Generator().manual_seed(4000 + step)
    x = torch.rand(BATCH, max(SEQ_LENGTHS), D_IN, generator=g) + 0.05  # (B, T, F)
    y = torch.randint(0, N_CLASSES, (BATCH,), generator=g)
    if bad is not None and step == at:
        x[bad, 2:SEQ_LENGTHS[bad]] = value
    packed = pack_padded_sequence(x, torch.tensor(SEQ_LENGTHS), batch_first=True,
                                  enforce_sorted=False)
    return packed, y


class PackedLSTMClassifier(nn.Module):
    """Classifies each sequence by the LSTM's last hidden state."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(D_IN, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, packed):
        _, (h, _) = self.rnn(packed)  # h: (layers, B, H), in the batch's own order
        return self.head(h[-1])


def make_packed_lstm() -> nn.Module:
    return PackedLSTMClassifier()


class PackedLog(nn.Module):
    """Log features of a PackedSequence, kept packed."""

    def forward(self, packed):
        feats = torch.log(packed.data)  # BUG: no floor, NaN for a negative value
        return PackedSequence(feats, packed.batch_sizes, packed.sorted_indices,
                              packed.unsorted_indices)


class PackedLogGRU(nn.Module):
    """Log features, then a sequence-first GRU (its default) over the packed sequences."""

    def __init__(self):
        super().__init__()
        self.feats = PackedLog()
        self.rnn = nn.GRU(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, packed):
        _, h = self.rnn(self.feats(packed))
        return self.head(h[-1])


def make_packed_log_gru() -> nn.Module:
    return PackedLogGRU()


# ---------------------------------------------------------------------------------------------
# an embedding first: its output's absmax is its weights', whatever the token ids

VOCAB = 50


class TokenLM(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.mlp(h))


def make_token_lm() -> nn.Module:
    return TokenLM()


class Float32RMSNorm(nn.Module):
    """LLaMA's RMSNorm, computed in float32 whatever autocast does, here without its eps."""

    def __init__(self, d: int, eps: float = 0.0):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class RMSNormLM(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = Float32RMSNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def make_rms_norm_lm() -> nn.Module:
    return RMSNormLM()


class SoftmaxFocalLoss(nn.Module):
    """Focal loss as often written: the probability from softmax, then its log."""

    def __init__(self, gamma: float = 2.0):
        super().__init__()
        self.gamma = gamma

    def forward(self, logits, labels):
        p = torch.softmax(logits, -1).gather(1, labels[:, None]).squeeze(1)
        return (-(1 - p) ** self.gamma * torch.log(p)).mean()


class ClassScaleNet(nn.Module):
    """Logits times a learned per-class temperature ``exp(log_scale)``: with as many classes as
    the batch has samples, the temperature's rows look like the batch's."""

    def __init__(self, n_classes: int = BATCH):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU())
        self.head = nn.Linear(HIDDEN, n_classes)
        self.log_scale = nn.Parameter(torch.zeros(n_classes))

    def forward(self, x):
        return self.head(self.body(x)) * self.log_scale.exp()


def make_class_scale_net() -> nn.Module:
    torch.manual_seed(0)
    return ClassScaleNet()
