"""Sound event localisation and detection (SELD) as DCASE baselines write it, for
``test_sound_localization``.

A clip is 4-microphone audio ``(4, N)``; the model computes its own features in ``forward``:
an STFT per channel, log-mel spectrograms (power times a mel filterbank buffer, then ``log``)
and GCC-PHAT between the 6 microphone pairs (the cross-spectrum divided by its magnitude,
then the inverse FFT, the centre lags kept and mel-sized). A CRNN (conv blocks, a pool over
frequency, a GRU) outputs ACCDOA: per frame a 3-vector whose norm is the activity and whose
direction is the DOA. The loss is MSE on ACCDOA plus an angular-distance term, ``acos`` of the
cosine between the unit predicted and unit target vectors, weighted by the activity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

MICS = 4
N_FFT = 64
HOP = 32
SAMPLES = 320          # 11 frames
N_MELS = 16
LAGS = N_MELS
PAIRS = [(i, j) for i in range(MICS) for j in range(i + 1, MICS)]


def mel_filterbank(n_freq: int = N_FFT // 2 + 1, n_mels: int = N_MELS) -> torch.Tensor:
    """Triangular filters on a mel scale, ``(n_freq, n_mels)``."""
    def mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)
    top = mel(8000.0)
    pts = [700.0 * (10 ** (top * k / (n_mels + 1) / 2595.0) - 1.0) for k in range(n_mels + 2)]
    freqs = torch.linspace(0, 8000.0, n_freq)
    fb = torch.zeros(n_freq, n_mels)
    for m in range(n_mels):
        lo, c, hi = pts[m], pts[m + 1], pts[m + 2]
        up = (freqs - lo) / (c - lo)
        down = (hi - freqs) / (hi - c)
        fb[:, m] = torch.clamp(torch.minimum(up, down), min=0.0)
    fb[0, 0] = fb[0, 0] + 1e-2   # DC into the first band so no band is empty
    return fb


class SELDFeatures(nn.Module):
    """Log-mel spectrograms of every channel and GCC-PHAT of every pair: ``(B, 10, T, 16)``."""

    def __init__(self, eps: float = 1e-8, log_eps: float = 1e-10):
        super().__init__()
        self.eps = eps
        self.log_eps = log_eps
        self.register_buffer("window", torch.hann_window(N_FFT))
        self.register_buffer("melW", mel_filterbank())

    def forward(self, audio):
        b, c, n = audio.shape
        spec = torch.stft(audio.reshape(b * c, n), N_FFT, HOP, window=self.window,
                          center=False, return_complex=True)
        spec = spec.reshape(b, c, spec.shape[-2], spec.shape[-1]).transpose(-1, -2)  # B,C,T,F
        power = spec.real ** 2 + spec.imag ** 2
        mel = torch.matmul(power, self.melW)
        logmel = torch.log(mel + self.log_eps)
        gcc = []
        for i, j in PAIRS:
            R = spec[:, i] * torch.conj(spec[:, j])
            R = R / (R.abs() + self.eps)                    # PHAT weighting
            cc = torch.fft.irfft(R, n=N_FFT)
            gcc.append(torch.cat([cc[..., -LAGS // 2:], cc[..., :LAGS // 2]], -1))
        return torch.cat([logmel, torch.stack(gcc, 1)], 1)


class CRNN(nn.Module):
    """SELDnet-style CRNN on the features, ACCDOA output ``(B, T, 3)`` (one class)."""

    def __init__(self, eps: float = 1e-8, log_eps: float = 1e-10):
        super().__init__()
        self.features = SELDFeatures(eps, log_eps)
        self.conv = nn.Sequential(
            nn.Conv2d(MICS + len(PAIRS), 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.MaxPool2d((1, 4)),
            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.MaxPool2d((1, 4)))
        self.gru = nn.GRU(16, 16, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(32, 3)

    def forward(self, audio):
        x = self.conv(self.features(audio))          # B, 16, T, 1
        x = x.mean(-1).transpose(1, 2)                # B, T, 16
        x, _ = self.gru(x)
        return torch.tanh(self.fc(x))


def make_crnn():
    torch.manual_seed(0)
    return CRNN()


def make_crnn_phat_no_eps():
    """GCC-PHAT as many repos write it: ``R / R.abs()``."""
    torch.manual_seed(0)
    return CRNN(eps=0.0)


def make_crnn_log_no_eps():
    """Log-mel as ``torch.log(mel)`` with no floor."""
    torch.manual_seed(0)
    return CRNN(log_eps=0.0)


class ACCDOALoss(nn.Module):
    """MSE on ACCDOA plus the angular distance between unit vectors, weighted by activity."""

    def __init__(self, eps: float = 1e-8, w_angle: float = 0.1):
        super().__init__()
        self.eps = eps
        self.w_angle = w_angle

    def forward(self, pred, target):
        mse = F.mse_loss(pred, target)
        active = target.norm(dim=-1)                                      # B, T
        p = pred / (pred.norm(dim=-1, keepdim=True) + self.eps)
        t = target / (target.norm(dim=-1, keepdim=True) + self.eps)
        cos = (p * t).sum(-1).clamp(-1.0, 1.0)
        ang = torch.acos(cos)
        return mse + self.w_angle * (ang * active).sum() / active.sum().clamp_min(1.0)


class ClipDataset(torch.utils.data.Dataset):
    """Clips of one source at an azimuth, delayed per microphone (a square array), plus noise.

    ``silent``: a clip of digital silence (every channel 0, the source inactive);
    ``nan_mic``: one microphone of that clip NaN from a bad recording; ``dead_mic``: one
    channel of that clip all 0 (a disconnected capsule); ``loud``: that clip 3000x louder
    (an unnormalised recording); ``no_event``: that clip holds noise but no event (its ACCDOA
    target all 0)."""

    def __init__(self, n: int = 32, silent=None, nan_mic=None, dead_mic=None, loud=None,
                 no_event=None, amp: float = 0.5):
        g = torch.Generator().manual_seed(1)
        self.audio, self.target = [], []
        T = (SAMPLES - N_FFT) // HOP + 1
        for k in range(n):
            az = float(torch.rand((), generator=g) * 2 * math.pi - math.pi)
            src = torch.randn(SAMPLES + 8, generator=g) * amp
            chans = []
            for m in range(MICS):
                mic_az = m * math.pi / 2
                d = int(round(3 + 3 * math.cos(az - mic_az)))
                chans.append(src[d:d + SAMPLES])
            x = torch.stack(chans) + 0.01 * torch.randn(MICS, SAMPLES, generator=g)
            tgt = torch.tensor([math.cos(az), math.sin(az), 0.0]).expand(T, 3).clone()
            if k == silent:
                x = torch.zeros_like(x)
                tgt = torch.zeros_like(tgt)
            if k == nan_mic:
                x[2] = float("nan")
            if k == dead_mic:
                x[1] = 0.0
            if k == loud:
                x = x * 3000.0
            if k == no_event:
                x = 0.01 * torch.randn(MICS, SAMPLES, generator=g)
                tgt = torch.zeros_like(tgt)
            self.audio.append(x)
            self.target.append(tgt)

    def __len__(self):
        return len(self.audio)

    def __getitem__(self, i):
        return self.audio[i], self.target[i]


def make_crnn_amp():
    """The log-mel floor float16 keeps (1e-4, above its smallest normal), for float16 autocast."""
    torch.manual_seed(0)
    return CRNN(log_eps=1e-4)


class MaskedDOALoss(nn.Module):
    """SELDnet's DOA regression masked by the reference activity (DCASE 2019's baseline
    multiplies the DOA output by the SED label), plus the ACCDOA norm of the masked output
    against the activity, its norm written as ``sqrt`` of the sum of squares."""

    def forward(self, pred, target):
        active = (target.norm(dim=-1) > 0).float()                        # B, T
        masked = pred * active.unsqueeze(-1)
        norm = torch.sqrt((masked ** 2).sum(-1))
        return F.mse_loss(masked, target) + ((norm - active) ** 2).mean()
