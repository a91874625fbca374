"""Deep learning on FMCW radar, written as automotive radar and micro-Doppler activity papers
write it (RADDet, CARRADA, RadHAR): raw ADC cubes ``(antennas, chirps, samples)`` windowed and
turned into range-Doppler maps with ``torch.fft``, magnitude in dB as ``20 log10 |x|``, per-frame
min-max normalisation, a CA-CFAR-style normaliser dividing the power by its local mean (average
pooling), a learned per-antenna complex calibration followed by the phase difference of
neighbouring antennas through ``atan2`` (angle of arrival), and a small CNN over the maps and an
LSTM over the Doppler axis (a micro-Doppler signature), trained with a hand-written focal loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ANT, CHIRPS, SAMPLES = 4, 16, 32   # RX antennas, chirps per frame, ADC samples per chirp
RBINS = SAMPLES // 2               # range bins kept (real ADC: positive frequencies)
CLASSES = 4                        # walk, run, fall, sit (micro-Doppler activities)
NEAR = 3                           # near-range bins zeroed (TX/RX leakage suppression)


def adc_batch(g: torch.Generator, n: int, labels: torch.Tensor, scale: float = 4.0):
    """Real ADC cubes ``(n, ANT, CHIRPS, SAMPLES)``: one moving target whose range and Doppler
    depend on the class (beat frequency and chirp-to-chirp phase), a phase ramp across the
    antennas (its angle), and receiver noise; 12-bit ADC counts (``scale`` noise counts)."""
    t = torch.arange(SAMPLES, dtype=torch.float32)
    c = torch.arange(CHIRPS, dtype=torch.float32)[:, None]
    a = torch.arange(ANT, dtype=torch.float32)[:, None, None]
    rng = 4.0 + 2.5 * labels.float() + torch.rand(n, generator=g)
    dop = -0.3 + 0.2 * labels.float() + 0.05 * torch.rand(n, generator=g)
    ang = torch.rand(n, generator=g) * 2 - 1
    out = []
    for i in range(n):
        phase = (2 * torch.pi * (rng[i] * t / SAMPLES + dop[i] * c)
                 + torch.pi * ang[i] * a)
        out.append(40.0 * torch.cos(phase))
    cube = torch.stack(out) + scale * torch.randn(n, ANT, CHIRPS, SAMPLES, generator=g)
    return cube.round()


class RangeDoppler(nn.Module):
    """Hann windows on fast and slow time, range FFT (positive bins), Doppler FFT, shift."""

    def __init__(self):
        super().__init__()
        self.register_buffer("win_s", torch.hann_window(SAMPLES, periodic=False))
        self.register_buffer("win_c", torch.hann_window(CHIRPS, periodic=False))

    def forward(self, adc):
        x = adc * self.win_s * self.win_c[:, None]
        x = torch.fft.fft(x, dim=-1)[..., :RBINS]
        return torch.fft.fftshift(torch.fft.fft(x, dim=-2), dim=-2)   # (B, A, C, R) complex


class ToDB(nn.Module):
    """``20 log10 |x|`` of the antenna-summed map; ``floor`` on the magnitude as the fix."""

    def __init__(self, floor: float = 0.0):
        super().__init__()
        self.floor = floor

    def forward(self, x):
        mag = x.abs().mean(dim=1)
        if self.floor:
            mag = mag.clamp_min(self.floor)
        return 20 * torch.log10(mag)


class MinMax(nn.Module):
    """Per-frame min-max normalisation to [0, 1]; ``eps`` in the divisor."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        lo = x.amin(dim=(-2, -1), keepdim=True)
        hi = x.amax(dim=(-2, -1), keepdim=True)
        return (x - lo) / (hi - lo + self.eps)


class CNN(nn.Module):
    def __init__(self, cin: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d((4, 4))

    def forward(self, x):
        x = F.relu(self.conv1(x))
        return self.pool(F.relu(self.conv2(x))).flatten(1)


class RDClassifier(nn.Module):
    """ADC cube -> range-Doppler map in dB -> per-frame min-max -> CNN -> class logits."""

    def __init__(self, floor: float = 0.0, eps: float = 1e-6):
        super().__init__()
        self.rd = RangeDoppler()
        self.db = ToDB(floor)
        self.norm = MinMax(eps)
        self.cnn = CNN()
        self.head = nn.Linear(8 * 16, CLASSES)

    def forward(self, adc):
        return self.head(self.cnn(self.norm(self.db(self.rd(adc)))[:, None]))


def make_rd() -> nn.Module:
    torch.manual_seed(0)
    return RDClassifier()


def make_rd_floor() -> nn.Module:
    torch.manual_seed(0)
    return RDClassifier(floor=1e-3)


def make_rd_floor_bare() -> nn.Module:
    """The floored dB map under a min-max written without its eps."""
    torch.manual_seed(0)
    return RDClassifier(floor=1e-3, eps=0.0)


# -- CA-CFAR-style normalisation ---------------------------------------------------------------

class CFARNorm(nn.Module):
    """Each cell's power over the mean power of its neighbourhood (the local noise estimate,
    average pooling); ``eps`` in the divisor as the fix."""

    def __init__(self, k: int = 5, eps: float = 0.0):
        super().__init__()
        self.k, self.eps = k, eps

    def forward(self, p):
        noise = F.avg_pool2d(p, self.k, stride=1, padding=self.k // 2,
                             count_include_pad=False)
        return p / (noise + self.eps)


class CFARClassifier(nn.Module):
    """Power map with the near-range bins zeroed (leakage suppression), CFAR-normalised, in
    dB with a floor, min-max, CNN."""

    def __init__(self, eps: float = 0.0):
        super().__init__()
        self.rd = RangeDoppler()
        self.cfar = CFARNorm(eps=eps)
        self.norm = MinMax()
        self.cnn = CNN()
        self.head = nn.Linear(8 * 16, CLASSES)

    def forward(self, adc):
        x = self.rd(adc)
        p = (x.real ** 2 + x.imag ** 2).mean(dim=1, keepdim=True)
        p = torch.cat([torch.zeros_like(p[..., :NEAR]), p[..., NEAR:]], dim=-1)
        snr = 10 * torch.log10(self.cfar(p).clamp_min(1e-6))
        return self.head(self.cnn(self.norm(snr)))


def make_cfar() -> nn.Module:
    torch.manual_seed(0)
    return CFARClassifier()


def make_cfar_eps() -> nn.Module:
    torch.manual_seed(0)
    return CFARClassifier(eps=1e-6)


# -- linear magnitude features under float16 autocast -------------------------------------------

class MagHead(nn.Module):
    """Linear-magnitude range profile (Doppler-max) into an MLP; ``log`` compresses it in the
    fixed version."""

    def __init__(self, log: bool = False):
        super().__init__()
        self.rd = RangeDoppler()
        self.log = log
        self.fc = nn.Linear(RBINS, 32)
        self.out = nn.Linear(32, CLASSES)

    def forward(self, adc):
        prof = self.rd(adc).abs().mean(dim=1).amax(dim=1)      # (B, R) magnitude
        if self.log:
            prof = torch.log1p(prof)
        return self.out(F.relu(self.fc(prof)))


def make_mag() -> nn.Module:
    torch.manual_seed(0)
    return MagHead()


# -- angle of arrival: complex calibration and atan2 phase differences ----------------------------

class PhaseDiff(nn.Module):
    """Learned per-antenna complex calibration (``w_a`` applied to each antenna's map), then the
    phase of neighbouring antennas' product ``x_{a+1} conj(x_a)`` with ``atan2(im, re)`` and each
    calibrated antenna's magnitude with ``hypot(re, im)``; ``stable`` takes the magnitude as
    ``torch.complex(re, im).abs()`` (the fix: its gradient at 0 is 0)."""

    def __init__(self, stable: bool = False):
        super().__init__()
        self.w_re = nn.Parameter(torch.ones(ANT, 1, 1))
        self.w_im = nn.Parameter(torch.zeros(ANT, 1, 1))
        self.stable = stable

    def forward(self, x):
        re = x.real * self.w_re - x.imag * self.w_im
        im = x.real * self.w_im + x.imag * self.w_re
        pre = re[:, 1:] * re[:, :-1] + im[:, 1:] * im[:, :-1]
        pim = im[:, 1:] * re[:, :-1] - re[:, 1:] * im[:, :-1]
        phase = torch.atan2(pim, pre) / torch.pi                   # (B, A-1, C, R)
        if self.stable:
            mag = torch.complex(re, im).abs()
        else:
            mag = torch.hypot(re, im)
        return phase, mag


class AngleNet(nn.Module):
    """Range-Doppler cube -> calibrated antenna phase differences (angle features) stacked with
    the calibrated magnitude in dB (floored), min-max normalised -> CNN -> logits. Zero-padded
    antennas (a 3-RX sensor in a 4-RX batch) are exact zeros."""

    def __init__(self, stable: bool = False):
        super().__init__()
        self.rd = RangeDoppler()
        self.angle = PhaseDiff(stable)
        self.norm = MinMax()
        self.cnn = CNN(ANT)
        self.head = nn.Linear(8 * 16, CLASSES)

    def forward(self, adc):
        phase, mag = self.angle(self.rd(adc))
        db = 20 * torch.log10(mag.mean(dim=1).clamp_min(1e-3))
        feats = torch.cat([phase, self.norm(db)[:, None]], dim=1)
        return self.head(self.cnn(feats))


def make_angle() -> nn.Module:
    torch.manual_seed(0)
    return AngleNet()


def make_angle_stable() -> nn.Module:
    torch.manual_seed(0)
    return AngleNet(stable=True)


# -- micro-Doppler LSTM ---------------------------------------------------------------------------

class MicroDoppler(nn.Module):
    """Spectrogram (Doppler x range-summed magnitude in dB, floored) fed as a sequence over the
    chirps to an LSTM; the last hidden state classifies the activity."""

    def __init__(self):
        super().__init__()
        self.rd = RangeDoppler()
        self.db = ToDB(1e-3)
        self.norm = MinMax()
        self.lstm = nn.LSTM(RBINS, 32, batch_first=True)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, adc):
        spec = self.norm(self.db(self.rd(adc)))            # (B, C, R)
        out, _ = self.lstm(spec)
        return self.head(out[:, -1])


def make_lstm() -> nn.Module:
    torch.manual_seed(0)
    return MicroDoppler()


class FocalLoss(nn.Module):
    """Multi-class focal loss ``-alpha (1 - p_t)^gamma log p_t`` (Lin et al.); ``stable`` takes
    ``log p_t`` from ``log_softmax``, the written-out version from ``log(softmax)``."""

    def __init__(self, gamma: float = 2.0, alpha: float = 0.25, stable: bool = True):
        super().__init__()
        self.gamma, self.alpha, self.stable = gamma, alpha, stable

    def forward(self, logits, target):
        if self.stable:
            logp = F.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
        else:
            logp = torch.log(F.softmax(logits, dim=-1).gather(1, target[:, None])[:, 0])
        pt = logp.exp()
        return (-self.alpha * (1 - pt) ** self.gamma * logp).mean()


# -- digital beamforming under float16 autocast ------------------------------------------------

BEAMS = 4


class Beamformer(nn.Module):
    """A learned beamformer over real/imag-stacked antennas (``nn.Linear`` per range-Doppler
    cell) and each beam's power in dB, ``10 log10(re^2 + im^2)``; ``wide`` squares in float32
    (the fix), the plain version in the autocast dtype the linear returned."""

    def __init__(self, wide: bool = False):
        super().__init__()
        self.w = nn.Linear(2 * ANT, 2 * BEAMS, bias=False)
        self.wide = wide

    def forward(self, x):
        z = torch.cat([x.real, x.imag], dim=1).permute(0, 2, 3, 1)    # (B, C, R, 2A)
        y = self.w(z)
        if self.wide:
            y = y.float()
        power = y[..., :BEAMS] ** 2 + y[..., BEAMS:] ** 2
        return 10 * torch.log10(power).permute(0, 3, 1, 2)          # (B, beams, C, R)


class BeamNet(nn.Module):
    """ADC counts scaled to [-1, 1] (12 bit), range-Doppler with ``norm="forward"`` FFTs (the
    spectrum's unit is the ADC's full scale), beams in dB, min-max, CNN."""

    def __init__(self, wide: bool = False):
        super().__init__()
        self.register_buffer("win_s", torch.hann_window(SAMPLES))
        self.beam = Beamformer(wide)
        self.norm = MinMax()
        self.cnn = CNN(BEAMS)
        self.head = nn.Linear(8 * 16, CLASSES)

    def forward(self, adc):
        x = adc / 2048 * self.win_s
        x = torch.fft.fft(x, dim=-1, norm="forward")[..., :RBINS]
        x = torch.fft.fftshift(torch.fft.fft(x, dim=-2, norm="forward"), dim=-2)
        return self.head(self.cnn(self.norm(self.beam(x).float())))


def make_beam() -> nn.Module:
    torch.manual_seed(0)
    return BeamNet()


def make_beam_wide() -> nn.Module:
    torch.manual_seed(0)
    return BeamNet(wide=True)


# -- angle of arrival from the strongest cell's phase difference ---------------------------------

class AoANet(nn.Module):
    """Per antenna pair, the phase difference at the strongest range-Doppler cell, turned into
    an angle with ``asin(dphi / pi)`` (half-wavelength spacing), classified by a linear layer;
    ``edge`` clamps the sine inside (-1, 1) as the fix."""

    def __init__(self, edge: float = 0.0):
        super().__init__()
        self.rd = RangeDoppler()
        self.angle = PhaseDiff(stable=True)
        self.fc = nn.Linear(ANT - 1, CLASSES)
        self.edge = edge

    def forward(self, adc):
        phase, mag = self.angle(self.rd(adc))                       # phase in units of pi
        cell = (mag[:, 1:] * mag[:, :-1]).flatten(2).argmax(-1)
        sine = phase.flatten(2).gather(2, cell[..., None])[..., 0]
        if self.edge:
            sine = sine.clamp(-1 + self.edge, 1 - self.edge)
        return self.fc(torch.asin(sine))


def make_aoa() -> nn.Module:
    torch.manual_seed(0)
    return AoANet()


def make_aoa_clamped() -> nn.Module:
    torch.manual_seed(0)
    return AoANet(edge=1e-6)


def endfire(x: torch.Tensor, row: int) -> None:
    """Sample ``row`` becomes a simulated target at endfire: neighbouring antennas exactly in
    antiphase (a phase step of pi), no noise."""
    t = torch.arange(SAMPLES, dtype=torch.float32)
    c = torch.arange(CHIRPS, dtype=torch.float32)[:, None]
    base = 40.0 * torch.cos(2 * torch.pi * (6.0 * t / SAMPLES + 0.1 * c))
    x[row] = torch.stack([base * (-1) ** a for a in range(ANT)])
