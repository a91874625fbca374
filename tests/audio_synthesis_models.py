"""Neural audio synthesis written as DDSP, HiFi-GAN and WaveNet's reference code writes it, for
``test_audio_synthesis``.

- ``DDSP``: Engel et al.'s autoencoder without z (ddsp_pytorch's layout): f0 and loudness per
  frame through MLPs and a GRU, harmonic amplitudes and noise band magnitudes by
  ``exp_sigmoid`` (``2 sigmoid(x)^ln 10 + 1e-7``), harmonics above Nyquist removed and the
  harmonic distribution normalised (or, ``make_ddsp_softmax``, a softmax over the harmonics
  below Nyquist, those above masked with -inf), the frames upsampled to the audio rate, the phase a
  cumulative sum of ``2 pi f0 / sr``, filtered noise by a frequency-domain FIR (``irfft`` of
  the band magnitudes, a Hann window, ``rfft`` convolution); ``SpectralLoss``: the multi-scale
  spectral loss, ``|S|`` and ``log |S|`` of ``torch.stft`` at several FFT sizes.
- ``Generator`` / ``Discriminator``: HiFi-GAN V3 in miniature: transposed-conv upsampling with
  residual dilated blocks under ``weight_norm``, a period and a scale discriminator (the scale
  one under ``spectral_norm``); least-squares adversarial, feature-matching and 45x mel-L1
  losses, the mel of ``log(clamp(mel, 1e-5))``.
- ``WaveNet``: causal dilated convolutions with gated activations and a 256-way softmax over
  mu-law companded samples (teacher forcing, the input one sample behind its target).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SR = 8000  # a tiny sample rate keeps every test on CPU in seconds
HOP = 64  # audio samples per conditioning frame
FRAMES = 16
N_HARM, N_BANDS = 16, 17

# ---------------------------------------------------------------------------------------------
# DDSP


def exp_sigmoid(x, floor: float = 1e-7):
    """DDSP's amplitude nonlinearity: positive, at most 2, gradient well-behaved near 0."""
    return 2.0 * torch.sigmoid(x) ** math.log(10.0) + floor


def mlp(n_in: int, hidden: int, layers: int = 2) -> nn.Sequential:
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(n_in if i == 0 else hidden, hidden), nn.LayerNorm(hidden),
                 nn.LeakyReLU()]
    return nn.Sequential(*mods)


def remove_above_nyquist(amplitudes, pitch, sr: int, floor: float):
    """ddsp_pytorch's mask of the harmonics at or above Nyquist (``+ 1e-4`` keeps a frame whose
    every harmonic is above it from summing to 0)."""
    k = torch.arange(1, amplitudes.shape[-1] + 1, device=pitch.device)
    return amplitudes * ((pitch * k < sr / 2).float() + floor)


def upsample(x, factor: int):
    """(B, frames, C) to (B, frames * factor, C), linear as ddsp's ``upsample_with_windows``."""
    x = F.interpolate(x.transpose(1, 2), scale_factor=factor, mode="linear",
                      align_corners=False)
    return x.transpose(1, 2)


def harmonic_synth(pitch, amplitudes, sr: int):
    """Additive synthesis at the audio rate: phase = cumsum(2 pi f0 / sr)."""
    omega = torch.cumsum(2 * math.pi * pitch / sr, dim=1)
    k = torch.arange(1, amplitudes.shape[-1] + 1, device=pitch.device)
    return (torch.sin(omega * k) * amplitudes).sum(-1, keepdim=True)


def amp_to_impulse_response(amp, target_size: int):
    """Band magnitudes to a zero-phase, Hann-windowed, causal FIR (ddsp_pytorch's core)."""
    amp = torch.stack([amp, torch.zeros_like(amp)], -1)
    amp = torch.view_as_complex(amp)
    amp = torch.fft.irfft(amp)
    filter_size = amp.shape[-1]
    amp = torch.roll(amp, filter_size // 2, -1)
    win = torch.hann_window(filter_size, dtype=amp.dtype, device=amp.device)
    amp = amp * win
    amp = F.pad(amp, (0, int(target_size) - int(filter_size)))
    return torch.roll(amp, -filter_size // 2, -1)


def fft_convolve(signal, kernel):
    signal = F.pad(signal, (0, signal.shape[-1]))
    kernel = F.pad(kernel, (kernel.shape[-1], 0))
    output = torch.fft.irfft(torch.fft.rfft(signal) * torch.fft.rfft(kernel))
    return output[..., output.shape[-1] // 2:]


class DDSP(nn.Module):
    """f0 (Hz) and loudness (normalised dB) per frame to audio, (B, frames) -> (B, frames*HOP)."""

    def __init__(self, hidden: int = 32, nyquist_floor: float = 1e-4, softmax: bool = False):
        super().__init__()
        self.in_mlps = nn.ModuleList([mlp(1, hidden), mlp(1, hidden)])
        self.gru = nn.GRU(2 * hidden, hidden, batch_first=True)
        self.out_mlp = mlp(hidden + 2, hidden)
        self.proj = nn.ModuleList([nn.Linear(hidden, N_HARM + 1), nn.Linear(hidden, N_BANDS)])
        self.nyquist_floor, self.softmax = nyquist_floor, softmax
        self.register_buffer("cache_gru", torch.zeros(1, 1, hidden))

    def forward(self, pitch, loudness):
        pitch, loudness = pitch.unsqueeze(-1), loudness.unsqueeze(-1)
        hidden = torch.cat([self.in_mlps[0](pitch / 1000), self.in_mlps[1](loudness)], -1)
        hidden = torch.cat([self.gru(hidden)[0], pitch / 1000, loudness], -1)
        hidden = self.out_mlp(hidden)

        param = self.proj[0](hidden)
        if self.softmax:  # the distribution as a softmax over the harmonics below Nyquist
            total_amp = exp_sigmoid(param[..., :1])
            k = torch.arange(1, N_HARM + 1, device=pitch.device)
            logits = param[..., 1:].masked_fill(pitch * k >= SR / 2, float("-inf"))
            amplitudes = torch.softmax(logits, -1) * total_amp
        else:
            param = exp_sigmoid(param)
            total_amp, amplitudes = param[..., :1], param[..., 1:]
            amplitudes = remove_above_nyquist(amplitudes, pitch, SR, self.nyquist_floor)
            amplitudes = amplitudes / amplitudes.sum(-1, keepdim=True)
            amplitudes = amplitudes * total_amp

        amplitudes = upsample(amplitudes, HOP)
        pitch = upsample(pitch, HOP)
        harmonic = harmonic_synth(pitch, amplitudes, SR)

        param = exp_sigmoid(self.proj[1](hidden) - 5)
        impulse = amp_to_impulse_response(param, HOP)
        noise = torch.rand(impulse.shape[0], impulse.shape[1], HOP, device=impulse.device) * 2 - 1
        noise = fft_convolve(noise, impulse).contiguous()
        noise = noise.reshape(noise.shape[0], -1, 1)
        return (harmonic + noise).squeeze(-1)


def make_ddsp() -> nn.Module:
    torch.manual_seed(0)
    return DDSP()


def make_ddsp_no_nyquist_floor() -> nn.Module:
    """A port of the Nyquist mask as a plain 0/1 mask (the bug: no ``+ 1e-4``)."""
    torch.manual_seed(0)
    return DDSP(nyquist_floor=0.0)


class Loudness(nn.Module):
    """Frame loudness in dB from the audio, normalised (DDSP's compute_loudness, without the
    A-weighting): 10 log10 of each frame's mean power."""

    def __init__(self, eps: float = 1e-10):
        super().__init__()
        self.eps = eps

    def forward(self, audio):
        frames = audio.reshape(audio.shape[0], -1, HOP)
        power = frames.pow(2).mean(-1)
        if self.eps == 0:  # the bug: the dB of a frame of digital silence is -inf
            db = 10 * torch.log10(power)
        else:
            db = 10 * torch.log10(power + self.eps)
        return (db + 20) / 20


class DDSPAutoencoder(nn.Module):
    """DDSP as it trains on audio: the loudness computed from the audio in forward, f0 given
    (a pitch tracker's, precomputed)."""

    def __init__(self, eps: float = 1e-10):
        super().__init__()
        self.loudness, self.ddsp = Loudness(eps), DDSP()

    def forward(self, pitch, audio):
        return self.ddsp(pitch, self.loudness(audio))


def make_autoencoder() -> nn.Module:
    torch.manual_seed(0)
    return DDSPAutoencoder()


def make_autoencoder_no_eps() -> nn.Module:
    torch.manual_seed(0)
    return DDSPAutoencoder(eps=0.0)


def make_ddsp_softmax() -> nn.Module:
    torch.manual_seed(0)
    return DDSP(softmax=True)


class SpectralLoss(nn.Module):
    """DDSP's multi-scale spectral loss: L1 of |S| plus L1 of log |S| at each FFT size."""

    def __init__(self, scales=(256, 128, 64), overlap: float = 0.75, plain_log: bool = False):
        super().__init__()
        self.scales, self.overlap, self.plain_log = scales, overlap, plain_log

    def forward(self, signal, target):
        loss = signal.new_zeros(())
        for n_fft in self.scales:
            hop = int(n_fft * (1 - self.overlap))
            win = torch.hann_window(n_fft, device=signal.device)
            s = torch.stft(signal, n_fft, hop, window=win, center=True, return_complex=True).abs()
            t = torch.stft(target, n_fft, hop, window=win, center=True, return_complex=True).abs()
            loss = loss + (s - t).abs().mean()
            if self.plain_log:  # the bug: log |S| of a silent frame is -inf
                loss = loss + (torch.log(s) - torch.log(t)).abs().mean()
            else:
                loss = loss + (torch.log(s + 1e-7) - torch.log(t + 1e-7)).abs().mean()
        return loss


def tone(g: torch.Generator, n: int):
    """A batch of n sung notes with vibrato: f0 per frame (Hz), loudness per frame (normalised
    dB) and the audio (B, FRAMES*HOP) of a harmonic tone at that f0."""
    base = 110 * 2 ** (torch.randint(0, 24, (n, 1), generator=g) / 12)
    vib = 1 + 0.01 * torch.sin(torch.linspace(0, 6, FRAMES))[None]
    f0 = base * vib
    amp = 0.1 + 0.4 * torch.rand(n, 1, generator=g)
    f0_audio = F.interpolate(f0[:, None], scale_factor=HOP, mode="linear")[:, 0]
    phase = torch.cumsum(2 * math.pi * f0_audio / SR, 1)
    audio = amp * (torch.sin(phase) + 0.3 * torch.sin(2 * phase))
    audio = audio + 0.003 * torch.randn(audio.shape, generator=g)
    db = 20 * torch.log10(amp.expand(-1, FRAMES) + 1e-5)
    return f0, (db + 20) / 20, audio


def ddsp_batch(g: torch.Generator, n: int = 8, *, glitch: int | None = None,
               padded: int | None = None, unvoiced: int | None = None):
    """(pitch, loudness, audio). ``glitch``: the pitch tracker jumped above Nyquist for the
    middle frames of that record (an unvoiced hiss tracked as a 4.2 kHz pitch); ``padded``: that
    clip is short, and the collate pads its audio with digital silence after 3 frames;
    ``unvoiced``: that record's f0 is librosa.pyin's, NaN in its unvoiced frames."""
    f0, loud, audio = tone(g, n)
    if glitch is not None:
        f0[glitch, 6:10] = 4200.0
    if padded is not None:
        audio[padded, 3 * HOP:] = 0.0
        loud[padded, 3:] = (20 * math.log10(1e-5) + 20) / 20
        f0[padded, 3:] = 0.0
    if unvoiced is not None:
        f0[unvoiced, 12:] = float("nan")
    return f0, loud, audio


# ---------------------------------------------------------------------------------------------
# HiFi-GAN


def init_weights(m, std: float = 0.01):
    if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)):
        m.weight.data.normal_(0.0, std)


class ResBlock(nn.Module):
    """HiFi-GAN's ResBlock2: leaky ReLU, dilated conv, residual, each conv under weight_norm."""

    def __init__(self, ch: int, k: int = 3, dilation=(1, 3)):
        super().__init__()
        self.convs = nn.ModuleList([
            nn.utils.parametrizations.weight_norm(
                nn.Conv1d(ch, ch, k, 1, dilation=d, padding=d * (k - 1) // 2))
            for d in dilation])
        self.convs.apply(init_weights)

    def forward(self, x):
        for c in self.convs:
            x = c(F.leaky_relu(x, 0.1)) + x
        return x


class Generator(nn.Module):
    """Mel (B, n_mels, frames) to audio (B, 1, frames * 16): two x4 transposed convs."""

    def __init__(self, n_mels: int = 16, ch: int = 32, zero_post: bool = False,
                 legacy: bool = False):
        super().__init__()
        # (legacy: the hook-based torch.nn.utils.weight_norm HiFi-GAN's own code imports)
        wn = nn.utils.weight_norm if legacy else nn.utils.parametrizations.weight_norm
        self.conv_pre = wn(nn.Conv1d(n_mels, ch, 7, 1, padding=3))
        self.ups = nn.ModuleList([wn(nn.ConvTranspose1d(ch // 2 ** i, ch // 2 ** (i + 1), 8, 4,
                                                        padding=2)) for i in range(2)])
        self.ups.apply(init_weights)
        self.resblocks = nn.ModuleList([ResBlock(ch // 2 ** (i + 1)) for i in range(2)])
        post = nn.Conv1d(ch // 4, 1, 7, 1, padding=3)
        if zero_post:  # "start from silence": the last conv zero-initialised
            nn.init.zeros_(post.weight)
            nn.init.zeros_(post.bias)
        self.conv_post = wn(post)

    def forward(self, mel, lengths=None):
        x = self.conv_pre(mel)
        for up, block in zip(self.ups, self.resblocks):
            x = block(up(F.leaky_relu(x, 0.1)))
        y = torch.tanh(self.conv_post(F.leaky_relu(x)))
        if lengths is not None:  # silence past each clip's end, as its padded target
            y = y * (torch.arange(y.shape[-1]) < lengths[:, None, None])
        return y


def make_generator() -> nn.Module:
    torch.manual_seed(0)
    return Generator()


def make_generator_zero_post() -> nn.Module:
    torch.manual_seed(0)
    return Generator(zero_post=True)


def make_generator_zero_post_legacy() -> nn.Module:
    torch.manual_seed(0)
    return Generator(zero_post=True, legacy=True)


class PeriodDisc(nn.Module):
    def __init__(self, period: int, ch: int = 8):
        super().__init__()
        self.period = period
        wn = nn.utils.parametrizations.weight_norm
        self.convs = nn.ModuleList([wn(nn.Conv2d(1, ch, (5, 1), (3, 1), padding=(2, 0))),
                                    wn(nn.Conv2d(ch, ch, (5, 1), (3, 1), padding=(2, 0)))])
        self.post = wn(nn.Conv2d(ch, 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, x):
        b, c, t = x.shape
        if t % self.period:
            x = F.pad(x, (0, self.period - t % self.period), "reflect")
        x = x.view(b, c, -1, self.period)
        fmap = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
            fmap.append(x)
        x = self.post(x)
        fmap.append(x)
        return x.flatten(1), fmap


class ScaleDisc(nn.Module):
    def __init__(self, ch: int = 8, zero_post: bool = False):
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.convs = nn.ModuleList([sn(nn.Conv1d(1, ch, 15, 1, padding=7)),
                                    sn(nn.Conv1d(ch, ch, 41, 4, groups=4, padding=20))])
        post = nn.Conv1d(ch, 1, 3, 1, padding=1)
        if zero_post:  # the bug: a zero-initialised head under spectral_norm is 0 / sigma = 0/0
            nn.init.zeros_(post.weight)
        self.post = sn(post)

    def forward(self, x):
        fmap = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
            fmap.append(x)
        x = self.post(x)
        fmap.append(x)
        return x.flatten(1), fmap


def make_discriminator_zero_post() -> nn.Module:
    torch.manual_seed(1)
    return Discriminator(zero_post=True)


class Discriminator(nn.Module):
    def __init__(self, zero_post: bool = False):
        super().__init__()
        self.discs = nn.ModuleList([PeriodDisc(2), PeriodDisc(3), ScaleDisc(zero_post=zero_post)])

    def forward(self, y, y_hat):
        outs = [(d(y), d(y_hat)) for d in self.discs]
        return ([r[0] for r, _ in outs], [g[0] for _, g in outs],
                [r[1] for r, _ in outs], [g[1] for _, g in outs])


def mel_basis(n_mels: int = 16, n_fft: int = 64, sr: int = SR) -> torch.Tensor:
    """A triangular mel filterbank (n_mels, n_fft // 2 + 1), librosa's Slaney shape."""
    def hz_to_mel(f):
        return 2595 * math.log10(1 + f / 700)
    edges = torch.tensor([700 * (10 ** (m / 2595) - 1) for m in
                          torch.linspace(hz_to_mel(0), hz_to_mel(sr / 2), n_mels + 2).tolist()])
    freqs = torch.linspace(0, sr / 2, n_fft // 2 + 1)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    return torch.clamp(torch.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), min=0)


MEL = mel_basis()


def mel_spectrogram(y, n_fft: int = 64, hop: int = 16, eps: float = 1e-9):
    """HiFi-GAN's meldataset.mel_spectrogram: reflect pad, |stft|, mel, log(clamp)."""
    y = F.pad(y.unsqueeze(1), ((n_fft - hop) // 2, (n_fft - hop) // 2), mode="reflect")
    spec = torch.stft(y.squeeze(1), n_fft, hop, window=torch.hann_window(n_fft), center=False,
                      return_complex=True)
    if eps == 0:  # the bug: sqrt's gradient at a frame of exact silence is 1/0
        spec = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2))
    else:
        spec = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + eps)
    return torch.log(torch.clamp(MEL @ spec, min=1e-5))


def log_mel_no_floor(y, n_fft: int = 64, hop: int = 16):
    """A data pipeline's own log-mel (torchaudio's MelSpectrogram, then log): the bug, no
    floor, so a frame of exact silence is log(0) = -inf."""
    y = F.pad(y.unsqueeze(1), ((n_fft - hop) // 2, (n_fft - hop) // 2), mode="reflect")
    spec = torch.stft(y.squeeze(1), n_fft, hop, window=torch.hann_window(n_fft), center=False,
                      return_complex=True)
    return torch.log(MEL @ spec.abs())


def feature_loss(fmap_r, fmap_g):
    loss = 0
    for dr, dg in zip(fmap_r, fmap_g):
        for rl, gl in zip(dr, dg):
            loss = loss + torch.mean(torch.abs(rl - gl))
    return loss * 2


def discriminator_loss(real_outputs, gen_outputs):
    loss = 0
    for dr, dg in zip(real_outputs, gen_outputs):
        loss = loss + torch.mean((1 - dr) ** 2) + torch.mean(dg ** 2)
    return loss


def generator_loss(gen_outputs):
    return sum(torch.mean((1 - dg) ** 2) for dg in gen_outputs)


class GeneratorLoss(nn.Module):
    """The generator's objective as one module around the discriminator (as ESPnet's and
    Coqui's GAN vocoder recipes wrap it): least squares + feature matching + 45 x mel L1."""

    def __init__(self, disc: nn.Module, mel_eps: float = 1e-9):
        super().__init__()
        self.disc, self.mel_eps = disc, mel_eps

    def forward(self, y_g_hat, y):
        y_g_hat_mel = mel_spectrogram(y_g_hat.squeeze(1), eps=self.mel_eps)
        loss_mel = F.l1_loss(mel_spectrogram(y.squeeze(1)), y_g_hat_mel) * 45
        _, fake, fmap_r, fmap_g = self.disc(y, y_g_hat)
        return generator_loss(fake) + feature_loss(fmap_r, fmap_g) + loss_mel


class Notes(torch.utils.data.Dataset):
    """Short notes, (audio,) each; ``short`` are the indices of clips 48 samples long."""

    def __init__(self, n: int = 12, length: int = 128, short=(), seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        t = torch.arange(length) / SR
        f0 = 200 + 400 * torch.rand(n, 1, generator=g)
        noise = 0.01 * torch.randn(n, length, generator=g)
        self.clips = list(0.5 * torch.sin(2 * math.pi * f0 * t) + noise)
        for i in short:
            self.clips[i] = self.clips[i][:48]

    def __len__(self):
        return len(self.clips)

    def __getitem__(self, i):
        return self.clips[i]


def collate(clips, floor: bool = True):
    """(mel, audio, lengths): the clips padded with silence to the longest, their log-mels."""
    lengths = torch.tensor([len(c) for c in clips])
    audio = torch.zeros(len(clips), int(lengths.max()))
    for i, c in enumerate(clips):
        audio[i, :len(c)] = c
    return (mel_spectrogram if floor else log_mel_no_floor)(audio), audio, lengths


# ---------------------------------------------------------------------------------------------
# WaveNet


def mu_law_encode(x, mu: int = 255):
    """torchaudio's mu_law_encoding: [-1, 1] to the 256 classes."""
    x_mu = torch.sign(x) * torch.log1p(mu * torch.abs(x)) / math.log1p(mu)
    return ((x_mu + 1) / 2 * mu + 0.5).to(torch.int64)


class WaveNet(nn.Module):
    def __init__(self, ch: int = 16, skip: int = 32, dilations=(1, 2, 4, 8, 1, 2, 4, 8)):
        super().__init__()
        self.embed = nn.Embedding(256, ch)
        self.dilations = dilations
        self.filters = nn.ModuleList([nn.Conv1d(ch, ch, 2, dilation=d) for d in dilations])
        self.gates = nn.ModuleList([nn.Conv1d(ch, ch, 2, dilation=d) for d in dilations])
        self.res = nn.ModuleList([nn.Conv1d(ch, ch, 1) for _ in dilations])
        self.skips = nn.ModuleList([nn.Conv1d(ch, skip, 1) for _ in dilations])
        self.head = nn.Sequential(nn.ReLU(), nn.Conv1d(skip, skip, 1), nn.ReLU(),
                                  nn.Conv1d(skip, 256, 1))

    def forward(self, classes):
        x = self.embed(classes).transpose(1, 2)
        out = 0
        for d, f, g, r, s in zip(self.dilations, self.filters, self.gates, self.res, self.skips):
            xp = F.pad(x, (d, 0))  # causal
            z = torch.tanh(f(xp)) * torch.sigmoid(g(xp))
            out = out + s(z)
            x = x + r(z)
        return self.head(out)  # (B, 256, T) logits


def make_wavenet() -> nn.Module:
    torch.manual_seed(0)
    return WaveNet()


def wavenet_batch(g: torch.Generator, n: int = 4, length: int = 256):
    """(inputs, targets) of mu-law classes, the input one sample behind its target."""
    _, _, audio = tone(g, n)
    classes = mu_law_encode(audio[:, :length + 1].clamp(-1, 1))
    return classes[:, :-1], classes[:, 1:]
