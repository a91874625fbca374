"""A streaming-ASR transducer written the way ESPnet, icefall and NeMo write theirs, for
``test_speech_transducers``: SpecAugment's time and frequency masks and a per-utterance mean/var
normalisation (utterance CMVN over each clip's own frames) in the front end, ESPnet's
``Conv2dSubsampling`` (two stride-2 convs: ``((L - 1) // 2 - 1) // 2`` frames), conformer
blocks (macaron feed-forwards, self-attention with a key padding mask, the depthwise conv
module), an embedding+LSTM prediction network over the blank-prefixed labels, the additive
joiner ``tanh(enc[:, :, None] + pred[:, None])`` -> ``(B, T, U+1, V)``, and a CTC head beside
it (icefall's hybrid ``rnnt + 0.3 * ctc``). The RNN-T loss is torchaudio's python reference
recursion over the (T, U) lattice in log space, with the log-add as ``torch.logaddexp`` or
written out as ``log(exp(a) + exp(b))``; the monotonic (one symbol per frame) RNN-T of k2's
``rnnt_type="modified"`` with the max-trick log-add. Variants: WeNet's ``GlobalCMVN`` from a
stats file, ESPnet's older hand-written attention (-inf fill, weights refilled with 0) and
WeNet's streaming chunk mask with limited left context, and Lhotse's loader-side input
transforms (``AugmentingCollate``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, MELS, D, BLANK, PAD = 12, 16, 32, 0, -1


class SpecAugment(nn.Module):
    """Park et al.'s masks (no time warp): ``n_freq`` bands of up to ``F`` bins and ``n_time``
    spans of up to ``T`` frames per utterance, filled with 0, only in training."""

    def __init__(self, freq_width: int = 4, time_width: int = 20, n_freq: int = 1,
                 n_time: int = 2):
        super().__init__()
        self.freq_width, self.time_width = freq_width, time_width
        self.n_freq, self.n_time = n_freq, n_time

    def forward(self, x, lens):
        if not self.training:
            return x
        b, t, f = x.shape
        keep = torch.ones_like(x, dtype=torch.bool)
        frames, bins = torch.arange(t), torch.arange(f)
        for _ in range(self.n_freq):
            w = torch.randint(0, self.freq_width + 1, (b, 1))
            f0 = (torch.rand(b, 1) * (f - w)).long()
            keep &= ~((bins >= f0) & (bins < f0 + w))[:, None, :]
        for _ in range(self.n_time):
            w = torch.randint(0, self.time_width + 1, (b, 1))
            t0 = (torch.rand(b, 1) * (lens[:, None] - w).clamp_min(0)).long()
            keep &= ~((frames >= t0) & (frames < t0 + w))[:, :, None]
        return x.masked_fill(~keep, 0.0)


class UtteranceCMVN(nn.Module):
    """Mean and variance normalisation over each utterance's own valid frames."""

    def forward(self, x, lens):
        mask = (torch.arange(x.shape[1])[None] < lens[:, None])[..., None]
        n = lens[:, None, None].to(x.dtype)
        mean = (x * mask).sum(1, keepdim=True) / n
        var = (((x - mean) * mask) ** 2).sum(1, keepdim=True) / n
        return (x - mean) / var.sqrt() * mask  # the bug: no eps, 0/0 on a constant utterance


class GlobalCMVN(nn.Module):
    """WeNet's ``GlobalCMVN``: the training set's per-bin mean and std, loaded from a stats
    file into buffers, normalise every frame."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x, lens):
        mask = (torch.arange(x.shape[1])[None] < lens[:, None])[..., None]
        return (x - self.mean) / self.std * mask  # the bug: no floor on the stats file's std


def global_stats(items, floor: float = 0.0):
    """The stats file: per-bin mean and std over every frame of ``items`` (WeNet's
    ``compute_cmvn_stats``), the std floored at ``floor``."""
    frames = torch.cat([f for f, _ in items])
    return frames.mean(0), frames.std(0).clamp_min(floor)


class Conv2dSubsampling(nn.Module):
    """ESPnet's 4x subsampling: two 3x3 stride-2 convs, then a projection of channels x bins."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, channels, 3, 2), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 3, 2), nn.ReLU())
        self.out = nn.Linear(channels * (((MELS - 1) // 2 - 1) // 2), D)

    def forward(self, x, lens):
        x = self.conv(x[:, None])
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        return x, ((lens - 1) // 2 - 1) // 2


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.SiLU(),
                                 nn.Linear(4 * D, D))

    def forward(self, x):
        return self.net(x)


class ConvModule(nn.Module):
    """The conformer conv module: pointwise + GLU, depthwise, batch norm, SiLU, pointwise."""

    def __init__(self, kernel: int = 7):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.pw1 = nn.Conv1d(D, 2 * D, 1)
        self.dw = nn.Conv1d(D, D, kernel, padding=kernel // 2, groups=D)
        self.bn = nn.BatchNorm1d(D)
        self.pw2 = nn.Conv1d(D, D, 1)

    def forward(self, x, pad):
        y = self.norm(x).masked_fill(pad[..., None], 0.0).transpose(1, 2)
        y = F.glu(self.pw1(y), dim=1)
        y = self.pw2(F.silu(self.bn(self.dw(y))))
        return y.transpose(1, 2)


def outside_chunks(t: int, chunk: int, left_chunks: int) -> torch.Tensor:
    """WeNet's ``subsequent_chunk_mask`` with limited left context, True where a query frame
    (row) may not see a key frame (column)."""
    c = torch.arange(t) // chunk
    return (c[None, :] > c[:, None]) | (c[None, :] < c[:, None] - left_chunks)


class MultiHeadedAttention(nn.Module):
    """ESPnet's ``MultiHeadedAttention`` as it was written before ``finfo.min``: the padded keys
    filled with -inf, the softmax's weights at them set back to 0."""

    def __init__(self, heads: int = 4, chunk: int = 0, left_chunks: int = 0,
                 refill: bool = True):
        super().__init__()
        self.h, self.d_k = heads, D // heads
        self.chunk, self.left_chunks, self.refill = chunk, left_chunks, refill
        self.linear_q, self.linear_k = nn.Linear(D, D), nn.Linear(D, D)
        self.linear_v, self.linear_out = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, query, key, value, key_padding_mask, need_weights=False):
        b, t, _ = query.shape
        q, k, v = (lin(x).view(b, -1, self.h, self.d_k).transpose(1, 2) for lin, x in
                   ((self.linear_q, query), (self.linear_k, key), (self.linear_v, value)))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        mask = key_padding_mask[:, None, None, :]
        if self.chunk:  # WeNet's streaming mask: own chunk and left_chunks before it
            mask = mask | outside_chunks(t, self.chunk, self.left_chunks)
        scores = scores.masked_fill(mask, float("-inf"))
        attn = torch.softmax(scores, dim=-1)  # (a row of no key: NaN)
        if self.refill:
            attn = attn.masked_fill(mask, 0.0)
        return self.linear_out((attn @ v).transpose(1, 2).reshape(b, t, D)), None


class ConformerBlock(nn.Module):
    def __init__(self, heads: int = 4, espnet_attention: bool = False, **streaming):
        super().__init__()
        self.ff1, self.ff2 = FeedForward(), FeedForward()
        self.attn_norm = nn.LayerNorm(D)
        self.attn = MultiHeadedAttention(heads, **streaming) if espnet_attention else \
            nn.MultiheadAttention(D, heads, batch_first=True)
        self.conv = ConvModule()
        self.final = nn.LayerNorm(D)

    def forward(self, x, pad):
        x = x + 0.5 * self.ff1(x)
        h = self.attn_norm(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        x = x + self.conv(x, pad)
        return self.final(x + 0.5 * self.ff2(x))


class Predictor(nn.Module):
    """The prediction network over the labels with the blank as start symbol."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.lstm = nn.LSTM(D, D, batch_first=True)

    def forward(self, ys):
        sos = torch.cat([ys.new_full((ys.shape[0], 1), BLANK), ys.clamp_min(0)], 1)
        return self.lstm(self.embed(sos))[0]


class Joiner(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc_proj, self.pred_proj = nn.Linear(D, D), nn.Linear(D, D)
        self.out = nn.Linear(D, VOCAB)

    def forward(self, enc, pred):
        joint = torch.tanh(self.enc_proj(enc)[:, :, None] + self.pred_proj(pred)[:, None])
        return self.out(joint)


class ConformerTransducer(nn.Module):
    """Returns the joint's logits (B, T', U+1, V), the encoder lengths T' and the CTC head's
    log-probabilities (B, T', V)."""

    def __init__(self, specaug_first: bool = False, blocks: int = 2, n_freq: int = 1,
                 espnet_attention: bool = False, frontend: bool = True, **streaming):
        super().__init__()
        self.frontend = frontend
        self.specaug, self.cmvn = SpecAugment(n_freq=n_freq), UtteranceCMVN()
        self.specaug_first = specaug_first
        self.subsample = Conv2dSubsampling()
        self.blocks = nn.ModuleList(ConformerBlock(espnet_attention=espnet_attention,
                                                   **streaming) for _ in range(blocks))
        self.predictor, self.joiner = Predictor(), Joiner()
        self.ctc_head = nn.Linear(D, VOCAB)

    def forward(self, feats, feat_lens, ys):
        if not self.frontend:
            x = feats
        elif self.specaug_first:  # the bug: masks a whole short clip before its CMVN
            x = self.cmvn(self.specaug(feats, feat_lens), feat_lens)
        else:
            x = self.specaug(self.cmvn(feats, feat_lens), feat_lens)
        x, lens = self.subsample(x, feat_lens)
        pad = torch.arange(x.shape[1])[None] >= lens[:, None]
        for block in self.blocks:
            x = block(x, pad)
        logits = self.joiner(x, self.predictor(ys))
        return logits, lens, self.ctc_head(x).log_softmax(-1)


def make_transducer() -> ConformerTransducer:
    torch.manual_seed(0)
    return ConformerTransducer()


def make_transducer_specaug_first() -> ConformerTransducer:
    torch.manual_seed(0)
    return ConformerTransducer(specaug_first=True)


def narrowband(items, top: int = 4):
    """8 kHz recordings resampled to 16 kHz: the mel bins above 4 kHz hold the log floor."""
    for f, _ in items:
        f[:, -top:] = -23.0259  # log(1e-10)
    return items


def make_transducer_global_cmvn() -> ConformerTransducer:
    """Normalised with stats computed over a narrowband corpus."""
    torch.manual_seed(0)
    model = ConformerTransducer()
    model.cmvn = GlobalCMVN(*global_stats(narrowband(corpus(16, seed=1))))
    return model


def make_transducer_espnet_attention() -> ConformerTransducer:
    torch.manual_seed(0)
    return ConformerTransducer(espnet_attention=True)


def make_streaming_transducer() -> ConformerTransducer:
    """Chunks of 4 encoder frames seeing 1 chunk to their left, the softmax's weights at masked
    keys not set back to 0 (the bug: a padded frame past its utterance by more than the left
    context sees no key)."""
    torch.manual_seed(0)
    return ConformerTransducer(espnet_attention=True, chunk=4, left_chunks=1, refill=False)


def make_streaming_transducer_refilled() -> ConformerTransducer:
    """WeNet's own code: the weights at masked keys set back to 0 after the softmax."""
    torch.manual_seed(0)
    return ConformerTransducer(espnet_attention=True, chunk=4, left_chunks=1)


def make_transducer_time_masks_first() -> ConformerTransducer:
    """Time masks only (no frequency masks), still before the CMVN."""
    torch.manual_seed(0)
    return ConformerTransducer(specaug_first=True, n_freq=0)


def log_add_by_hand(a, b):
    return torch.log(torch.exp(a) + torch.exp(b))  # the bug: both exp underflow past -104


def log_add_max_trick(a, b):
    """The "stable" log-add: factor out the larger argument."""
    m = torch.maximum(a, b)
    return m + torch.log(torch.exp(a - m) + torch.exp(b - m))  # the bug: -inf - -inf is NaN


def log_add_guarded(a, b):
    """The max trick with k2's guard: where both are -inf, the sum is -inf."""
    m = torch.maximum(a, b)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return torch.where(torch.isinf(m), m, safe + torch.log(torch.exp(a - safe)
                                                           + torch.exp(b - safe)))


def log_add_safe(a, b):
    """The guarded max trick with a safe input under the log too (the double where)."""
    m = torch.maximum(a, b)
    both = torch.isinf(m)
    safe = torch.where(both, torch.zeros_like(m), m)
    s = torch.where(both, torch.ones_like(m), torch.exp(a - safe) + torch.exp(b - safe))
    return torch.where(both, m, safe + torch.log(s))


def monotonic_rnnt_nll(logits, ys, t_lens, y_lens, log_add=log_add_max_trick):
    """The monotonic (one symbol per frame) RNN-T of k2's ``rnnt_type="modified"``: a label
    consumes its frame, so alpha[t, u] = logadd(alpha[t-1, u] + blank[t-1, u],
    alpha[t-1, u-1] + emit[t-1, u-1]) from alpha[0] = (0, -inf, ...); a cell u > t has no path.
    Returns each utterance's negative log-likelihood alpha[T, U]."""
    logp = logits.log_softmax(-1)
    b, t_max, u1, _ = logp.shape
    blank = logp[..., BLANK]
    emit = logp[:, :, :-1].gather(3, ys.clamp_min(0)[:, None, :, None].expand(
        b, t_max, u1 - 1, 1)).squeeze(3)
    alpha = torch.cat([logp.new_zeros(b, 1), logp.new_full((b, u1 - 1), float("-inf"))], 1)
    rows = [alpha]
    for t in range(t_max):
        moved = torch.cat([alpha.new_full((b, 1), float("-inf")), alpha[:, :-1] + emit[:, t]], 1)
        alpha = log_add(alpha + blank[:, t], moved)
        rows.append(alpha)
    return -torch.stack(rows, 1)[torch.arange(b), t_lens, y_lens]


def monotonic_loss(out, ys, y_lens):
    logits, t_lens, _ = out
    return monotonic_rnnt_nll(logits, ys, t_lens, y_lens).sum() / y_lens.sum()


def monotonic_loss_guarded(out, ys, y_lens):
    logits, t_lens, _ = out
    return monotonic_rnnt_nll(logits, ys, t_lens, y_lens, log_add_guarded).sum() / y_lens.sum()


def monotonic_loss_safe(out, ys, y_lens):
    logits, t_lens, _ = out
    return monotonic_rnnt_nll(logits, ys, t_lens, y_lens, log_add_safe).sum() / y_lens.sum()


def rnnt_nll(logits, ys, t_lens, y_lens, log_add=torch.logaddexp):
    """torchaudio's python reference ``compute_alpha``: alpha[t, u] = logadd(alpha[t-1, u] +
    blank[t-1, u], alpha[t, u-1] + emit[t, u-1]); the utterance's log-likelihood is
    alpha[T-1, U] + blank[T-1, U]. Returns each utterance's negative log-likelihood."""
    logp = logits.log_softmax(-1)
    b, t_max, u1, _ = logp.shape
    blank = logp[..., BLANK]
    emit = logp[:, :, :-1].gather(3, ys.clamp_min(0)[:, None, :, None].expand(
        b, t_max, u1 - 1, 1)).squeeze(3)
    rows, alpha = [], None
    for t in range(t_max):
        if t == 0:
            col = [logp.new_zeros(b)]
        else:
            col = [alpha[:, 0] + blank[:, t - 1, 0]]
        for u in range(1, u1):
            diag = col[u - 1] + emit[:, t, u - 1]
            col.append(diag if t == 0 else log_add(alpha[:, u] + blank[:, t - 1, u], diag))
        alpha = torch.stack(col, 1)
        rows.append(alpha)
    alphas = torch.stack(rows, 1)
    last = (t_lens - 1).clamp_min(0)
    idx = torch.arange(b)
    return -(alphas[idx, last, y_lens] + blank[idx, last, y_lens])


def hybrid_loss(out, ys, y_lens, ctc_weight=0.3, zero_infinity=False):
    """icefall's ``rnnt + ctc_weight * ctc``, each summed over the utterances and divided by the
    number of label tokens of the batch."""
    logits, t_lens, ctc_lp = out
    rnnt = rnnt_nll(logits, ys, t_lens, y_lens).sum()
    ctc = F.ctc_loss(ctc_lp.transpose(0, 1), ys.clamp_min(0), t_lens, y_lens, blank=BLANK,
                     reduction="sum", zero_infinity=zero_infinity)
    return (rnnt + ctc_weight * ctc) / y_lens.sum()


def hybrid_loss_safe(out, ys, y_lens):
    return hybrid_loss(out, ys, y_lens, zero_infinity=True)


def rnnt_loss_log_add_by_hand(out, ys, y_lens):
    logits, t_lens, _ = out
    return rnnt_nll(logits, ys, t_lens, y_lens, log_add=log_add_by_hand).sum() / y_lens.sum()


def rnnt_loss_per_token(out, ys, y_lens):
    """Each utterance's RNN-T loss per label token (ESPnet's ``normalize_length``), averaged."""
    logits, t_lens, _ = out
    return (rnnt_nll(logits, ys, t_lens, y_lens) / y_lens).mean()  # the bug: an empty transcript


def utterance(g: torch.Generator, frames: int, labels: int):
    """Log-mel-like features (an offset per band, speech-like variance) and labels 1..V-1."""
    feats = torch.randn(frames, MELS, generator=g) * 2 + torch.linspace(-4, 2, MELS)
    return feats, torch.randint(1, VOCAB, (labels,), generator=g)


def collate(items):
    """Pad frames with 0 and labels with PAD, lengths from the items (an ASR collate_fn)."""
    feats = nn.utils.rnn.pad_sequence([f for f, _ in items], batch_first=True)
    ys = nn.utils.rnn.pad_sequence([y for _, y in items], batch_first=True, padding_value=PAD)
    return (feats, torch.tensor([len(f) for f, _ in items]), ys,
            torch.tensor([len(y) for _, y in items]))


class AugmentingCollate:
    """Lhotse's ``K2SpeechRecognitionDataset`` order: pad, then the input transforms
    (SpecAugment, then utterance CMVN: the bug) on the loader's side; the model gets
    ``specaug=None`` features it does not normalise again."""

    def __init__(self):
        self.specaug, self.cmvn = SpecAugment(n_freq=0), UtteranceCMVN()

    def __call__(self, items):
        feats, feat_lens, ys, y_lens = collate(items)
        return self.cmvn(self.specaug(feats, feat_lens), feat_lens), feat_lens, ys, y_lens


def make_transducer_normalised_input() -> ConformerTransducer:
    """Takes features the loader already augmented and normalised."""
    torch.manual_seed(0)
    return ConformerTransducer(frontend=False)


def corpus(n: int, special: dict[int, tuple[int, int]] | None = None, seed: int = 0):
    """``n`` utterances of 40-64 frames and 3-6 labels; ``special``: index -> (frames, labels)."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        frames = int(torch.randint(40, 65, (1,), generator=g))
        labels = int(torch.randint(3, 7, (1,), generator=g))
        frames, labels = (special or {}).get(i, (frames, labels))
        items.append(utterance(g, frames, labels))
    return items
