"""Speaker verification and diarization as SpeechBrain / WeSpeaker / EEND repositories write it,
for ``test_speaker_verification``: a log-mel filterbank front end (power spectrum, mel matrix,
``log(mel + eps)``, per-utterance mean/variance normalisation over the valid frames), an
ECAPA-style TDNN with attentive statistics pooling under a frame mask, a cosine classifier
trained with AAM-softmax (ArcFace), the GE2E loss over centroids, an end-to-end diarization
model trained with permutation invariant BCE over speaker activities; variable-length
utterances zero-padded by a ``collate_fn``.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

SR, N_FFT, HOP, N_MELS = 8000, 128, 64, 24
N_SPK, EMB = 6, 16


def mel_matrix(n_fft: int = N_FFT, n_mels: int = N_MELS, sr: int = SR) -> torch.Tensor:
    """Triangular mel filters ``(n_fft // 2 + 1, n_mels)``, as torchaudio's ``melscale_fbanks``."""
    def mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)

    pts = torch.linspace(mel(0.0), mel(sr / 2), n_mels + 2)
    hz = 700.0 * (10 ** (pts / 2595.0) - 1.0)
    freqs = torch.linspace(0, sr / 2, n_fft // 2 + 1).unsqueeze(1)
    lo, mid, hi = hz[:-2], hz[1:-1], hz[2:]
    up = (freqs - lo) / (mid - lo)
    down = (hi - freqs) / (hi - mid)
    return torch.clamp(torch.minimum(up, down), min=0.0)


class Fbank(nn.Module):
    """Log-mel filterbank with per-utterance CMVN over the valid frames (``mask``: (B, T))."""

    def __init__(self, log_eps: float = 1e-6, norm_eps: float = 1e-5):
        super().__init__()
        self.log_eps, self.norm_eps = log_eps, norm_eps
        self.register_buffer("window", torch.hann_window(N_FFT))
        self.register_buffer("mel", mel_matrix())

    def forward(self, wav, mask):
        spec = torch.stft(wav, N_FFT, HOP, window=self.window, center=False, return_complex=True)
        power = spec.abs() ** 2                                     # (B, F, T)
        mel = torch.matmul(power.transpose(1, 2), self.mel)         # (B, T, M)
        logmel = torch.log(mel + self.log_eps).transpose(1, 2)      # (B, M, T)
        m = mask.unsqueeze(1).to(logmel.dtype)
        n = m.sum(-1, keepdim=True)
        mean = (logmel * m).sum(-1, keepdim=True) / n
        var = (((logmel - mean) * m) ** 2).sum(-1, keepdim=True) / n
        std = var.sqrt() + self.norm_eps
        return (logmel - mean) / std * m


def frame_mask(lengths: torch.Tensor, n_samples: int) -> torch.Tensor:
    """The frames (``center=False``) each utterance's ``lengths`` samples fill."""
    n_frames = (n_samples - N_FFT) // HOP + 1
    valid = torch.div(lengths - N_FFT, HOP, rounding_mode="floor") + 1
    return torch.arange(n_frames).unsqueeze(0) < valid.clamp_min(1).unsqueeze(1)


class AttentiveStatsPool(nn.Module):
    """ECAPA's attentive statistics pooling: attention over the valid frames, the weighted mean
    and std. ``std``: ``"centred"`` (SpeechBrain: sqrt of the weighted squared deviations,
    clamped at ``eps``), ``"moments"`` (sqrt(E[x²] - mu²), clamped) or their unclamped forms."""

    def __init__(self, ch: int, hid: int = 16, std: str = "centred", eps: float = 1e-6):
        super().__init__()
        self.std, self.eps = std, eps
        self.attn = nn.Sequential(nn.Conv1d(ch, hid, 1), nn.Tanh(), nn.Conv1d(hid, ch, 1))

    def forward(self, x, mask):
        e = self.attn(x).masked_fill(~mask.unsqueeze(1), float("-inf"))
        w = torch.softmax(e, dim=-1)
        mu = (w * x).sum(-1)
        if self.std.startswith("moments"):
            var = (w * x * x).sum(-1) - mu * mu
        else:
            var = (w * (x - mu.unsqueeze(-1)) ** 2).sum(-1)
        if not self.std.endswith("_raw"):
            var = var.clamp(min=self.eps)
        return torch.cat([mu, torch.sqrt(var)], dim=1)


class SEBlock(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(ch, ch // 2), nn.ReLU(), nn.Linear(ch // 2, ch))

    def forward(self, x, mask):
        m = mask.unsqueeze(1).to(x.dtype)
        s = (x * m).sum(-1) / m.sum(-1)
        return x * torch.sigmoid(self.fc(s)).unsqueeze(-1)


class TDNNBlock(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, d: int):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, dilation=d, padding=d * (k - 1) // 2)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x):
        return self.bn(torch.relu(self.conv(x)))


class ECAPA(nn.Module):
    """A small ECAPA-TDNN: fbank, TDNN blocks with SE, attentive statistics pooling, embedding,
    and a cosine classifier over the training speakers (its cosines go to AAM-softmax)."""

    def __init__(self, ch: int = 32, pool_std: str = "centred", log_eps: float = 1e-6,
                 norm_eps: float = 1e-5):
        super().__init__()
        self.fbank = Fbank(log_eps, norm_eps)
        self.block1 = TDNNBlock(N_MELS, ch, 5, 1)
        self.block2 = TDNNBlock(ch, ch, 3, 2)
        self.se = SEBlock(ch)
        self.pool = AttentiveStatsPool(ch, std=pool_std)
        self.embed = nn.Linear(2 * ch, EMB)
        self.classifier = nn.Parameter(torch.randn(N_SPK, EMB) * 0.1)

    def forward(self, wav, lengths):
        mask = frame_mask(lengths, wav.shape[-1])
        x = self.fbank(wav, mask)
        x = self.block2(self.block1(x))
        x = self.se(x, mask)
        emb = self.embed(self.pool(x, mask))
        return F.linear(F.normalize(emb), F.normalize(self.classifier))  # (B, N_SPK) cosines


def make_ecapa() -> nn.Module:
    torch.manual_seed(0)
    return ECAPA()


def make_ecapa_moments() -> nn.Module:
    torch.manual_seed(0)
    return ECAPA(pool_std="moments_raw")


def make_ecapa_unclamped() -> nn.Module:
    torch.manual_seed(0)
    return ECAPA(pool_std="centred_raw")


def make_ecapa_no_norm_eps() -> nn.Module:
    torch.manual_seed(0)
    return ECAPA(norm_eps=0.0)


def make_ecapa_fp16_eps() -> nn.Module:
    torch.manual_seed(0)
    return ECAPA(log_eps=1e-10)


class AAMSoftmax(nn.Module):
    """Additive angular margin softmax (ArcFace) over cosines: ``s * cos(theta + m)`` at the
    target. ``mode="acos"``: theta = acos(cos.clamp(-1, 1)); ``mode="expansion"``:
    cos(theta + m) = cos cos m - sin sin m with sin = sqrt(1 - cos²) (WeSpeaker, VoxCeleb
    trainers), easy margin off."""

    def __init__(self, margin: float = 0.2, scale: float = 30.0, mode: str = "expansion"):
        super().__init__()
        self.margin, self.scale, self.mode = margin, scale, mode
        self.ce = nn.CrossEntropyLoss()

    def forward(self, cosine, label):
        if self.mode == "acos":
            theta = torch.acos(cosine.clamp(-1.0, 1.0))
            target = torch.cos(theta + self.margin)
        else:
            sine = torch.sqrt(1.0 - cosine * cosine)
            target = cosine * math.cos(self.margin) - sine * math.sin(self.margin)
            th, mm = math.cos(math.pi - self.margin), math.sin(math.pi - self.margin) * self.margin
            target = torch.where(cosine > th, target, cosine - mm)
        one_hot = F.one_hot(label, cosine.shape[1]).to(cosine.dtype)
        logits = self.scale * (one_hot * target + (1.0 - one_hot) * cosine)
        return self.ce(logits, label)


class GE2ELoss(nn.Module):
    """Generalised end-to-end loss (Wan et al.) over embeddings ``(N, M, D)``: N speakers, M
    utterances each; the centroid of a speaker's own utterance leaves that utterance out."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(10.0))
        self.b = nn.Parameter(torch.tensor(-5.0))

    def forward(self, emb, n_utt):
        n = emb.shape[0] // n_utt
        e = emb.view(n, n_utt, -1)
        total = e.sum(1, keepdim=True)
        centroids = total / n_utt                                  # (N, 1, D)
        excl = (total - e) / (n_utt - 1)                           # (N, M, D)
        en = F.normalize(e, dim=-1)
        sim = torch.einsum("nmd,kd->nmk", en, F.normalize(centroids.squeeze(1), dim=-1))
        self_sim = (en * excl).sum(-1) / (e.norm(dim=-1) * excl.norm(dim=-1))
        idx = torch.arange(n)
        sim[idx, :, idx] = self_sim
        sim = self.w.clamp(min=1e-6) * sim + self.b
        target = idx.repeat_interleave(n_utt)
        return F.cross_entropy(sim.reshape(n * n_utt, n), target)


class SpeakerEncoder(nn.Module):
    """GE2E's embedding network: fbank, LSTM over frames, the last valid frame's projection."""

    def __init__(self, hid: int = 24):
        super().__init__()
        self.fbank = Fbank()
        self.lstm = nn.LSTM(N_MELS, hid, batch_first=True)
        self.proj = nn.Linear(hid, EMB)

    def forward(self, wav, lengths):
        mask = frame_mask(lengths, wav.shape[-1])
        h, _ = self.lstm(self.fbank(wav, mask).transpose(1, 2))
        last = mask.sum(1) - 1
        return torch.relu(self.proj(h[torch.arange(h.shape[0]), last]))


def make_speaker_encoder() -> nn.Module:
    torch.manual_seed(0)
    return SpeakerEncoder()


# ---------------------------------------------------------------------------------------------
# data


def utterance(spk: int, idx: int, n: int, gain: float = 0.5) -> torch.Tensor:
    """A voiced utterance of speaker ``spk``: a pitch and formants of its own, noise."""
    g = torch.Generator().manual_seed(1000 * spk + idx)
    t = torch.arange(n) / SR
    f0 = 100 + 30 * spk
    x = sum(torch.sin(2 * math.pi * k * f0 * t) / k for k in range(1, 6))
    return gain * (x / 3.0 + 0.05 * torch.randn(n, generator=g))


class Utterances(Dataset):
    """Variable-length labelled utterances; ``silent``: indices that are digital silence (a
    failed VAD cut, a dropped channel), ``short``: indices one frame long, ``gain``: a scale
    per index (a quiet or a clipped recording)."""

    def __init__(self, n: int, silent=(), short=(), gain=None):
        self.n, self.silent, self.short, self.gain = n, set(silent), set(short), gain or {}

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        spk = i % N_SPK
        n = N_FFT if i in self.short else 600 + 97 * (i % 5)
        wav = utterance(spk, i, n, self.gain.get(i, 0.5))
        if i in self.silent:
            wav = torch.zeros(n)
        return wav, spk


def collate_padded(batch):
    """Zero-pad to the longest utterance: ``(wav (B, T), lengths (B,), labels (B,))``."""
    wavs, labels = zip(*batch)
    lengths = torch.tensor([w.shape[0] for w in wavs])
    out = torch.zeros(len(wavs), int(lengths.max()))
    for i, w in enumerate(wavs):
        out[i, : w.shape[0]] = w
    return out, lengths, torch.tensor(labels)


def ge2e_batch(step: int, n_spk: int = 4, n_utt: int = 3, n: int = 700):
    """N speakers x M utterances, speaker-major: ``(wav (N*M, n), lengths)``."""
    wav = torch.stack([utterance(s, 50 * step + u, n) for s in range(n_spk) for u in range(n_utt)])
    return wav, torch.full((n_spk * n_utt,), n)


# ---------------------------------------------------------------------------------------------
# end-to-end neural diarization


class EEND(nn.Module):
    """EEND: fbank frames, a transformer encoder over them (padding masked), a linear head of
    per-frame speaker activities (logits)."""

    def __init__(self, n_spk: int = 2, d: int = 32):
        super().__init__()
        self.fbank = Fbank()
        self.inp = nn.Linear(N_MELS, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_spk)

    def forward(self, wav, lengths):
        mask = frame_mask(lengths, wav.shape[-1])
        x = self.inp(self.fbank(wav, mask).transpose(1, 2))
        return self.head(self.enc(x, src_key_padding_mask=~mask)), mask


def make_eend() -> nn.Module:
    torch.manual_seed(0)
    return EEND()


class PITBCE(nn.Module):
    """Permutation invariant BCE over speaker activities, padded frames masked out; ``hand``: the
    BCE written out as ``-(y log p + (1 - y) log(1 - p))`` over ``sigmoid``; ``balance``: each
    speaker's active frames weighted by its silent frames over its active ones (``pos_weight``
    per recording and speaker, against the overlap-sparse activity labels)."""

    def __init__(self, hand: bool = False, balance: bool = False):
        super().__init__()
        self.hand, self.balance = hand, balance

    def bce(self, logits, y, m):
        if self.balance:
            pos = (y * m).sum(1, keepdim=True)
            pos_weight = ((1 - y) * m).sum(1, keepdim=True) / pos   # (B, 1, S)
            return F.binary_cross_entropy_with_logits(logits, y, reduction="none",
                                                      pos_weight=pos_weight)
        if not self.hand:
            return F.binary_cross_entropy_with_logits(logits, y, reduction="none")
        p = torch.sigmoid(logits)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p))

    def forward(self, out, labels):
        logits, mask = out
        m = mask.unsqueeze(-1).to(logits.dtype)
        losses = []
        for perm in itertools.permutations(range(labels.shape[-1])):
            per = (self.bce(logits, labels[..., list(perm)], m) * m).sum((1, 2))
            losses.append(per / m.sum((1, 2)))
        return torch.stack(losses, 1).min(1).values.mean()


def diarization_batch(step: int, size: int = 3, n: int = 1400, absent: tuple = ()):
    """Two-speaker recordings with activities per frame: ``(wav, lengths, labels (B, T, 2))``;
    ``absent``: (row, speaker) pairs where that speaker says nothing in the chunk."""
    g = torch.Generator().manual_seed(step)
    n_frames = (n - N_FFT) // HOP + 1
    wav, labels = torch.zeros(size, n), torch.zeros(size, n_frames, 2)
    for b in range(size):
        for s in range(2):
            start = int(torch.randint(0, n // 2, (1,), generator=g))
            if (b, s) in absent:
                continue
            seg = utterance(s + 2 * b, step, n // 2)
            wav[b, start:start + n // 2] += seg
            f0, f1 = start // HOP, min(n_frames, (start + n // 2) // HOP)
            labels[b, f0:f1, s] = 1.0
    return wav, torch.full((size,), n), labels


def enrol_head(model: ECAPA, wav, lengths, labels) -> None:
    """Start the cosine classifier's rows at the embeddings of the speakers' enrolment
    utterances (a head warm-started from the data, as fine-tuning recipes do)."""
    with torch.no_grad():
        mask = frame_mask(lengths, wav.shape[-1])
        x = model.se(model.block2(model.block1(model.fbank(wav, mask))), mask)
        model.classifier[labels] = model.embed(model.pool(x, mask))
