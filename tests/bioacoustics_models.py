"""Bird and whale call detectors as BirdNET, PANNs and the DCASE baselines write them, for
``test_bioacoustics``.

- ``LogMel``: an STFT power spectrogram, a triangular mel filterbank (a buffer), then
  ``log(mel + offset)``; ``offset=None`` is the classic ``torch.log(mel)`` with no offset.
- ``PCEN``: per-channel energy normalisation (Wang et al., Lostanlen's bioacoustics
  recipe), ``(E / (eps + M)^alpha + delta)^r - delta^r`` with the smoother ``M`` from a
  first-order IIR filter run frame by frame, ``s``, ``alpha``, ``delta`` and ``r`` learned
  through ``exp`` (``raw_delta=True``: delta learned as is, from a bad init below 0).
- ``Detector``: a frontend, optional per-recording standardisation, SpecAugment (time and
  frequency masks drawn from torch's RNG in train mode), a PANNs-style CNN over the
  log-mel image, frame-level sigmoid probabilities, energy-based voice activity gating of the
  frames, and clip-level pooling: linear-softmax ``sum(y^2) / sum(y)`` over frames or
  attention pooling whose scores are ``-inf`` at gated frames.
- ``make_linear_softmax_prior``: the frame head initialised by RetinaNet's prior rule with a
  prior so small that every frame probability underflows to 0.
- ``focal_loss`` on clip labels; ``WeightedBCE`` with per-class positive weights from the
  training set's label frequencies.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SR, N_FFT, HOP, N_MELS, N_CLASSES, SAMPLES = 8000, 256, 128, 16, 3, 4096


def mel_filterbank(n_freqs: int, n_mels: int, sr: int) -> torch.Tensor:
    """HTK mel scale, triangular filters, (n_mels, n_freqs) as torchaudio builds them."""
    def hz_to_mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)
    mels = torch.linspace(hz_to_mel(50.0), hz_to_mel(sr / 2), n_mels + 2)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    freqs = torch.linspace(0, sr / 2, n_freqs)
    lo, mid, hi = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    up = (freqs[None] - lo) / (mid - lo)
    down = (hi - freqs[None]) / (hi - mid)
    return torch.clamp(torch.minimum(up, down), min=0.0)


class LogMel(nn.Module):
    def __init__(self, offset: float | None = 1e-6, log: bool = True):
        super().__init__()
        self.offset, self.log = offset, log
        self.register_buffer("window", torch.hann_window(N_FFT))
        self.register_buffer("fbank", mel_filterbank(N_FFT // 2 + 1, N_MELS, SR))

    def forward(self, wav):
        spec = torch.stft(wav, N_FFT, HOP, window=self.window, return_complex=True)
        power = spec.abs() ** 2  # (B, F, T)
        mel = torch.matmul(self.fbank, power)  # (B, M, T)
        if not self.log:
            return mel
        if self.offset is None:
            return torch.log(mel)  # the bug: digital silence is log(0) = -inf
        return torch.log(mel + self.offset)


class PCEN(nn.Module):
    """Trainable PCEN over a mel power spectrogram (B, M, T)."""

    def __init__(self, eps: float = 1e-6, raw_delta: bool = False):
        super().__init__()
        self.mel = LogMel(log=False)
        self.eps, self.raw_delta = eps, raw_delta
        self.log_s = nn.Parameter(torch.full((N_MELS, 1), math.log(0.04)))
        self.log_alpha = nn.Parameter(torch.full((N_MELS, 1), math.log(0.98)))
        self.log_r = nn.Parameter(torch.full((N_MELS, 1), math.log(0.5)))
        # raw_delta: delta learned as is, initialised from a config that meant log(delta)
        self.delta = nn.Parameter(torch.full((N_MELS, 1), -0.7 if raw_delta else math.log(2.0)))

    def forward(self, wav):
        e = self.mel(wav)
        s, alpha, r = self.log_s.exp(), self.log_alpha.exp(), self.log_r.exp()
        delta = self.delta if self.raw_delta else self.delta.exp()
        m = [e[..., 0]]
        for t in range(1, e.shape[-1]):  # the IIR smoother, M[t] = (1 - s) M[t-1] + s E[t]
            m.append((1 - s[:, 0]) * m[-1] + s[:, 0] * e[..., t])
        smooth = torch.stack(m, -1)
        agc = e / (self.eps + smooth) ** alpha
        return (agc + delta) ** r - delta ** r


def spec_augment(x, time_width: int = 4, freq_width: int = 3):
    """SpecAugment (Park et al.): one time and one frequency mask per clip, set to 0."""
    b, m, t = x.shape
    t0 = torch.randint(0, t - time_width, (b, 1, 1), device=x.device)
    f0 = torch.randint(0, m - freq_width, (b, 1, 1), device=x.device)
    ti = torch.arange(t, device=x.device)[None, None]
    fi = torch.arange(m, device=x.device)[None, :, None]
    keep = ~(((ti >= t0) & (ti < t0 + time_width)) | ((fi >= f0) & (fi < f0 + freq_width)))
    return x * keep


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.avg_pool2d(F.relu(self.bn(self.conv(x))), (2, 1))  # pool frequency only


class Detector(nn.Module):
    """A PANNs/BirdNET-style sound event detector: frame probabilities and a clip score."""

    def __init__(self, frontend: nn.Module, pooling: str = "attention",
                 standardise: bool = False, vad_db: float = -60.0):
        super().__init__()
        self.frontend, self.pooling, self.standardise = frontend, pooling, standardise
        self.vad_db = vad_db
        self.blocks = nn.Sequential(ConvBlock(1, 8), ConvBlock(8, 16))
        self.frame_head = nn.Linear(16 * (N_MELS // 4), N_CLASSES)
        self.att_head = nn.Linear(16 * (N_MELS // 4), N_CLASSES)

    def forward(self, wav):
        x = self.frontend(wav)  # (B, M, T)
        if self.standardise:  # per-recording normalisation (no eps: the bug)
            x = (x - x.mean((1, 2), keepdim=True)) / x.std((1, 2), keepdim=True)
        if self.training:
            x = spec_augment(x)
        h = self.blocks(x[:, None])  # (B, 16, M / 4, T)
        h = h.flatten(1, 2).transpose(1, 2)  # (B, T, D)
        frame = torch.sigmoid(self.frame_head(h))  # strong labels' frame probabilities
        # energy-based VAD: frames under vad_db relative to full scale do not vote
        frames = wav.unfold(-1, N_FFT, HOP)
        energy_db = 10 * torch.log10(frames.pow(2).mean(-1) + 1e-10)
        active = F.pad(energy_db > self.vad_db, (1, 1))[:, :frame.shape[1], None]
        if self.pooling == "linear_softmax":
            y = frame * active
            clip = (y ** 2).sum(1) / y.sum(1)  # linear-softmax pooling (Wang et al. 2019)
        else:
            scores = self.att_head(h).masked_fill(~active, float("-inf"))
            clip = (torch.softmax(scores, 1) * frame).sum(1).clamp(1e-7, 1 - 1e-7)
        return clip, frame


def focal_loss(clip, target, gamma: float = 2.0):
    """Binary focal loss (Lin et al.) on clip probabilities, the mixup's soft labels."""
    pt = target * clip + (1 - target) * (1 - clip)
    return (-(1 - pt) ** gamma * torch.log(pt)).mean()


class WeightedBCE(nn.Module):
    """BCE on clip logits with each class's positives weighted by neg/pos over the training
    set's labels, as DCASE baselines balance rare species."""

    def __init__(self, train_labels: torch.Tensor):
        super().__init__()
        pos = train_labels.sum(0)
        self.register_buffer("pos_weight", (len(train_labels) - pos) / pos)

    def forward(self, clip, target):
        logit = torch.logit(clip)
        return F.binary_cross_entropy_with_logits(logit, target, pos_weight=self.pos_weight)


def make_logmel():
    torch.manual_seed(0)
    return Detector(LogMel(), pooling="attention")


def make_logmel_no_offset():
    torch.manual_seed(0)
    return Detector(LogMel(offset=None), pooling="attention")


def make_standardised():
    torch.manual_seed(0)
    return Detector(LogMel(), pooling="attention", standardise=True)


def make_pcen():
    torch.manual_seed(0)
    return Detector(PCEN(), pooling="attention")


def make_pcen_eps0():
    torch.manual_seed(0)
    return Detector(PCEN(eps=0.0), pooling="attention")


def make_pcen_raw_delta():
    torch.manual_seed(0)
    return Detector(PCEN(raw_delta=True), pooling="attention")


def make_linear_softmax():
    torch.manual_seed(0)
    return Detector(LogMel(), pooling="linear_softmax")


# ---------------------------------------------------------------------------------------------
# data

def clip_batch(g: torch.Generator, n: int = 8, silent: int | None = None,
               pcm: int | None = None):
    """Noisy clips with tone calls of up to three species, zero-padded to SAMPLES; weak
    (clip) labels. The clip ``silent`` is digital silence: a recorder's dead channel; the
    clip ``pcm`` was read as raw 16-bit PCM (a loader's ``dtype="int16"``), not scaled to
    [-1, 1]."""
    t = torch.arange(SAMPLES) / SR
    wav = 0.01 * torch.randn(n, SAMPLES, generator=g)
    labels = (torch.rand(n, N_CLASSES, generator=g) < 0.5).float()
    for c, f in enumerate((600.0, 1500.0, 2800.0)):
        on = torch.rand(n, 1, generator=g) * 0.25
        call = ((t[None] > on) & (t[None] < on + 0.2)).float() * torch.sin(2 * math.pi * f * t)
        wav = wav + 0.3 * labels[:, c:c + 1] * call
    length = torch.randint(SAMPLES // 2, SAMPLES + 1, (n, 1), generator=g)
    wav = wav * (torch.arange(SAMPLES)[None] < length)  # zero padding after each recording
    if silent is not None:
        wav[silent] = 0.0
        labels[silent] = 0.0
    if pcm is not None:
        wav[pcm] = (wav[pcm] * 32768).round().clamp(-32768, 32767)
    return wav, labels


def make_linear_softmax_prior(prior: float = 1e-60):
    """RetinaNet's prior init of the frame head, ``bias = -log((1 - pi) / pi)``, with the
    prior set from a rare species' frame rate written in float64 (pi ~ 1e-60): every frame
    probability starts as sigmoid(-138), 0 in float32."""
    model = make_linear_softmax()
    with torch.no_grad():
        model.frame_head.bias.fill_(-math.log((1 - prior) / prior))
    return model
