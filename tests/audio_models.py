"""Speech models as ASR repositories write them, for the end-to-end tests of
``test_audio_models``: a log-mel front end inside the model, a per-utterance feature
normalisation over the valid frames (from the waveform lengths), a strided convolution with
BatchNorm, self-attention with a key padding mask, and CTC log-probabilities ``(B, T, V)``
that the loop transposes to ``(T, B, V)`` for ``nn.CTCLoss``.
"""

from __future__ import annotations

import torch
from torch import nn

HOP = 64
N_FFT = 128
VOCAB = 12


class LogMel(nn.Module):
    def __init__(self, n_mels: int = 16):
        super().__init__()
        self.register_buffer("window", torch.hann_window(N_FFT))
        self.register_buffer("fb", torch.rand(N_FFT // 2 + 1, n_mels))

    def forward(self, wav):
        spec = torch.stft(wav, N_FFT, HOP, window=self.window, return_complex=True)
        return torch.log(spec.abs().pow(2).transpose(1, 2) @ self.fb + 1e-6)  # (B, T, M)


class TinyASR(nn.Module):
    def __init__(self, n_mels: int = 16, d: int = 24):
        super().__init__()
        self.frontend = LogMel(n_mels)
        self.conv = nn.Conv1d(n_mels, d, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm1d(d)  # mixes the samples: one NaN row spreads to all
        self.att = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, wav, wav_lens):
        feats = self.frontend(wav)
        frames = wav_lens // HOP  # the valid frames of each clip (0 for an empty one)
        valid = (torch.arange(feats.shape[1]) < frames[:, None]).unsqueeze(-1)
        n = valid.sum(1, keepdim=True)
        mean = (feats * valid).sum(1, keepdim=True) / n  # the bug: 0/0 for an empty clip
        var = (((feats - mean) * valid) ** 2).sum(1, keepdim=True) / n
        feats = (feats - mean) * torch.rsqrt(var + 1e-5) * valid
        x = torch.relu(self.bn(self.conv(feats.transpose(1, 2)))).transpose(1, 2)
        out_lens = (frames + 1) // 2
        pad = torch.arange(x.shape[1]) >= out_lens[:, None]
        a, _ = self.att(x, x, x, key_padding_mask=pad, need_weights=False)
        return self.head(x + a).log_softmax(-1), out_lens


def make_tiny_asr() -> nn.Module:
    return TinyASR()


def batch(step: int, *, empty: int | None = None, size: int = 6, length: int = 1024):
    """``(wav, wav_lens, targets, target_lens)``; sample ``empty`` is a clip of length 0."""
    g = torch.Generator().manual_seed(step)
    lens = torch.randint(length // 2, length + 1, (size,), generator=g)
    lens[0] = length
    wav = torch.randn(size, length, generator=g) * 0.1
    wav[torch.arange(length) >= lens[:, None]] = 0.0
    if empty is not None:
        lens[empty] = 0
        wav[empty] = 0.0
    targets = torch.randint(1, VOCAB, (size, 4), generator=g)
    return wav, lens, targets, torch.randint(1, 5, (size,), generator=g)


class PeakNormKWS(nn.Module):
    """Keyword spotting whose forward peak-normalises the waveform in place (no eps: a silent
    clip is 0/0), then a log-mel CNN."""

    def __init__(self, n_mels: int = 16, classes: int = 5):
        super().__init__()
        self.frontend = LogMel(n_mels)
        self.cnn = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(8, classes)

    def forward(self, wav):
        wav.div_(wav.abs().amax(-1, keepdim=True))  # the bug: 0/0 for a silent clip
        return self.fc(self.cnn(self.frontend(wav).unsqueeze(1)).flatten(1))


def make_peak_norm_kws() -> nn.Module:
    return PeakNormKWS()
