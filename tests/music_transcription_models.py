"""Piano transcription as Onsets and Frames (Hawthorne et al. 2018) and its PyTorch ports
(jongwook/onsets-and-frames, bytedance's piano_transcription) write it, for
``test_music_transcription``.

- ``LogMel``: the front end inside the model: ``torch.stft`` (``center=False``, Hann window),
  the power spectrum through a triangular HTK mel filterbank built in ``__init__`` (optionally
  area-normalised, each filter divided by its sum, as librosa's ``norm=1``), then
  ``log(mel + eps)`` or torchaudio's ``AmplitudeToDB``: ``10 log10(clamp(mel, amin))``.
- ``OnsetsAndFrames``: an acoustic conv stack per head, a BiLSTM over frames for the onset head
  and for the frame head (fed the onset head's detached probabilities), a velocity head; clips
  padded to the longest in the batch, each clip's valid frames ``(len - n_fft) // hop + 1``
  (``lengths`` given to ``forward``), its log-mel standardised over its own valid frames.
- ``transcription_loss``: BCE on onsets and frames over valid frames, the velocity MSE masked
  by the onsets and normalised by each clip's number of onsets.
- ``ClipDataset``/``collate``: synthetic piano clips (decaying harmonics per note), 88-key
  onset/frame/velocity rolls, pitch-shift augmentation (the notes moved by whole semitones and
  their roll rolled with them), padded to the longest clip by the DataLoader's collate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

SR, N_FFT, HOP, N_MELS, KEYS, MIN_MIDI = 8000, 256, 128, 40, 88, 21


def hz_to_mel(f):
    return 2595.0 * math.log10(1.0 + f / 700.0)


def mel_filterbank(n_mels: int, n_fft: int, sr: int, fmin: float, fmax: float,
                   area_norm: bool) -> torch.Tensor:
    """(n_mels, n_fft // 2 + 1) triangular filters equally spaced in HTK mel."""
    mels = torch.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2, dtype=torch.float64)
    hz = 700.0 * (10 ** (mels / 2595.0) - 1.0)
    bins = torch.linspace(0, sr / 2, n_fft // 2 + 1, dtype=torch.float64)
    lower = (bins[None] - hz[:-2, None]) / (hz[1:-1, None] - hz[:-2, None])
    upper = (hz[2:, None] - bins[None]) / (hz[2:, None] - hz[1:-1, None])
    fb = torch.clamp(torch.minimum(lower, upper), min=0.0)
    if area_norm:  # each filter sums to 1; a filter above Nyquist covers no bin: 0/0
        fb = fb / fb.sum(1, keepdim=True)
    return fb.float()


class LogMel(nn.Module):
    def __init__(self, fmax: float = SR / 2, area_norm: bool = False, eps: float = 1e-6,
                 db: bool = False, amin: float = 1e-10, learned: bool = False,
                 top_db: float | None = None):
        super().__init__()
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)
        fb = mel_filterbank(N_MELS, N_FFT, SR, 30.0, fmax, area_norm)
        if learned:  # a trainable filterbank initialised at mel, on magnitudes (LEAF-like)
            self.fb = nn.Parameter(fb)
        else:
            self.register_buffer("fb", fb)
        self.eps, self.db, self.amin, self.learned = eps, db, amin, learned
        self.top_db = top_db

    def forward(self, audio):  # (B, N) -> (B, T, n_mels)
        spec = torch.stft(audio, N_FFT, HOP, window=self.window, center=False,
                          return_complex=True)
        mel = torch.matmul(self.fb, spec.abs() ** 2)
        if self.learned:
            mel = mel.sqrt()  # magnitudes: sqrt's slope at 0 is +inf
        if self.db:  # torchaudio's AmplitudeToDB(stype="power", top_db)
            x_db = 10.0 * torch.log10(torch.clamp(mel, min=self.amin))
            if self.top_db is not None:  # each clip floored top_db below its own peak
                x_db = torch.maximum(x_db, x_db.amax(dim=(1, 2), keepdim=True) - self.top_db)
            return x_db.transpose(1, 2)
        return torch.log(mel + self.eps).transpose(1, 2)


def frame_mask(lengths, n_frames: int):
    """(B, T) valid frames of each clip: a clip of ``len`` samples has (len - n_fft)//hop + 1."""
    valid = torch.div(lengths - N_FFT, HOP, rounding_mode="floor") + 1
    return (torch.arange(n_frames)[None] < valid[:, None]).float()


class ConvStack(nn.Module):
    """Onsets and Frames' acoustic model: conv-BN-ReLU over (time, mel), pool over mel, FC."""

    def __init__(self, out: int = 32, ch: int = 8):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU(),
            nn.Conv2d(ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU(),
            nn.MaxPool2d((1, 2)), nn.Dropout(0.25))
        self.fc = nn.Sequential(nn.Linear(ch * (N_MELS // 2), out), nn.Dropout(0.5))

    def forward(self, mel):  # (B, T, n_mels)
        x = self.cnn(mel.unsqueeze(1))
        return self.fc(x.transpose(1, 2).flatten(-2))


class BiLSTM(nn.Module):
    def __init__(self, inp: int, hidden: int = 16):
        super().__init__()
        self.rnn = nn.LSTM(inp, hidden, batch_first=True, bidirectional=True)

    def forward(self, x):
        return self.rnn(x)[0]


class OnsetsAndFrames(nn.Module):
    def __init__(self, frontend: LogMel | None = None, guard_empty: bool = True):
        super().__init__()
        self.frontend = frontend or LogMel()
        self.onset_stack = nn.Sequential(ConvStack(), BiLSTM(32), nn.Linear(32, KEYS))
        self.frame_stack = nn.Sequential(ConvStack(), nn.Linear(32, KEYS), nn.Sigmoid())
        self.combined_stack = nn.Sequential(BiLSTM(2 * KEYS), nn.Linear(32, KEYS))
        self.velocity_stack = nn.Sequential(ConvStack(), nn.Linear(32, KEYS))
        self.guard_empty = guard_empty

    def standardise(self, mel, mask):
        """Each clip's log-mel standardised over its own valid frames (padding excluded)."""
        m = mask[..., None]
        count = mask.sum(1)[:, None, None]
        if self.guard_empty:
            count = count.clamp_min(1)
        mean = (mel * m).sum(1, keepdim=True) / count  # the bug: 0/0 for a clip with no frame
        var = ((mel - mean) ** 2 * m).sum(1, keepdim=True) / count
        return (mel - mean) / (var.sqrt() + 1e-5) * m

    def forward(self, audio, lengths):
        mel = self.frontend(audio)
        mask = frame_mask(lengths, mel.shape[1])
        mel = self.standardise(mel, mask)
        onset_logits = self.onset_stack(mel)
        activation = self.frame_stack(mel)
        combined = torch.cat([torch.sigmoid(onset_logits).detach(), activation], -1)
        frame_logits = self.combined_stack(combined)
        velocity = self.velocity_stack(mel)
        return onset_logits, frame_logits, velocity, mask


def make_model() -> OnsetsAndFrames:
    torch.manual_seed(0)
    return OnsetsAndFrames()


def make_no_eps() -> OnsetsAndFrames:
    """``log(mel + eps)`` with eps = 0 (someone read "eps only changes the floor")."""
    torch.manual_seed(0)
    return OnsetsAndFrames(LogMel(eps=0.0))


def make_db_amin0() -> OnsetsAndFrames:
    """torchaudio's AmplitudeToDB written by hand with ``amin=0``."""
    torch.manual_seed(0)
    return OnsetsAndFrames(LogMel(db=True, amin=0.0))


def make_db_top() -> OnsetsAndFrames:
    """amin = 0 with top_db = 80: the floor below each clip's peak takes a padded frame's -inf
    back, but not a silent clip's (its peak is -inf too)."""
    torch.manual_seed(0)
    return OnsetsAndFrames(LogMel(db=True, amin=0.0, top_db=80.0))


def make_db() -> OnsetsAndFrames:
    torch.manual_seed(0)
    return OnsetsAndFrames(LogMel(db=True))


def make_unguarded() -> OnsetsAndFrames:
    """The per-clip standardisation without ``clamp_min(1)`` on the frame count."""
    torch.manual_seed(0)
    return OnsetsAndFrames(guard_empty=False)


def make_fmax_above_nyquist() -> OnsetsAndFrames:
    """fmax = 16 kHz (the 32 kHz recipe's value) on 8 kHz audio, area-normalised filters."""
    torch.manual_seed(0)
    return OnsetsAndFrames(LogMel(fmax=16000.0, area_norm=True))


def make_learned_fb() -> OnsetsAndFrames:
    torch.manual_seed(0)
    return OnsetsAndFrames(LogMel(learned=True))


def make_amp() -> OnsetsAndFrames:
    """librosa's amin 1e-10 as the eps, trained under fp16 autocast."""
    torch.manual_seed(0)
    return OnsetsAndFrames(LogMel(eps=1e-10))


class FrameTransformer(nn.Module):
    """MT3-like encoder over frames: the padded frames masked out of self-attention."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.frontend, self.proj = LogMel(), nn.Linear(N_MELS, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.onset_head, self.frame_head = nn.Linear(d, KEYS), nn.Linear(d, KEYS)
        self.velocity_head = nn.Linear(d, KEYS)

    def forward(self, audio, lengths):
        mel = self.frontend(audio)
        mask = frame_mask(lengths, mel.shape[1])
        x = self.encoder(self.proj(mel), src_key_padding_mask=mask == 0)
        return self.onset_head(x), self.frame_head(x), self.velocity_head(x), mask


def make_transformer() -> FrameTransformer:
    torch.manual_seed(0)
    return FrameTransformer()


def transcription_loss(onset_logits, frame_logits, velocity, mask, onsets, frames, velocities,
                       guard: bool = False):
    """BCE on onsets and frames over each batch's valid frames; velocity MSE where a note
    starts, per clip, divided by that clip's number of onsets."""
    m = mask[..., None].expand_as(onsets)
    onset_loss = (F.binary_cross_entropy_with_logits(onset_logits, onsets, reduction="none")
                  * m).sum() / m.sum()
    frame_loss = (F.binary_cross_entropy_with_logits(frame_logits, frames, reduction="none")
                  * m).sum() / m.sum()
    n_onsets = onsets.sum((1, 2))
    if guard:
        n_onsets = n_onsets.clamp_min(1)
    velocity_loss = (onsets * (torch.sigmoid(velocity) - velocities) ** 2).sum((1, 2)) \
        / n_onsets  # the bug: 0/0 for a clip without an onset
    return onset_loss + frame_loss + velocity_loss.mean()


def per_clip_loss(onset_logits, frame_logits, velocity, mask, onsets, frames, velocities):
    """Each clip's BCE averaged over its own valid frames, then over clips (every clip weighs
    the same, however long), the velocity term floored."""
    m = mask[..., None].expand_as(onsets)
    bce = F.binary_cross_entropy_with_logits(onset_logits, onsets, reduction="none") \
        + F.binary_cross_entropy_with_logits(frame_logits, frames, reduction="none")
    per_clip = (bce * m).sum((1, 2)) / m.sum((1, 2))  # the bug: 0/0 for a clip with no frame
    velocity_loss = (onsets * (torch.sigmoid(velocity) - velocities) ** 2).sum((1, 2)) \
        / onsets.sum((1, 2)).clamp_min(1)
    return (per_clip + velocity_loss).mean()


def balanced_loss(onset_logits, frame_logits, velocity, mask, onsets, frames, velocities):
    """Frame BCE weighted per key by the batch's negatives over positives (a key is on in
    ~1% of frames), the rest as ``guarded_loss``."""
    m = mask[..., None].expand_as(frames)
    pos = (frames * m).sum((0, 1))
    pos_weight = (m.sum((0, 1)) - pos) / pos  # the bug: +inf for a key no clip plays
    frame_loss = (F.binary_cross_entropy_with_logits(frame_logits, frames, reduction="none",
                                                     pos_weight=pos_weight) * m).sum() / m.sum()
    return frame_loss + transcription_loss(onset_logits, frame_logits, velocity, mask, onsets,
                                           frames, velocities, guard=True)


def guarded_loss(*args):
    return transcription_loss(*args, guard=True)


@torch.no_grad()
def decode_notes(onset_logits, frame_logits, threshold: float = 0.5):
    """Note-level decoding for evaluation: (clip, key, onset frame, offset frame) of each note
    whose onset fires, held while its frame stays on."""
    onsets = torch.sigmoid(onset_logits) > threshold
    frames = torch.sigmoid(frame_logits) > threshold
    starts = onsets & ~F.pad(onsets[:, :-1], (0, 0, 1, 0))
    notes = []
    for b, t, k in starts.nonzero().tolist():
        end = t + 1
        while end < frames.shape[1] and (frames[b, end, k] or onsets[b, end, k]):
            end += 1
        notes.append((b, k, t, end))
    return notes


class ClipDataset(torch.utils.data.Dataset):
    """Synthetic piano clips. ``silent``: a clip of digital silence (an empty excerpt cut from
    the lead-in of a recording); ``short``: a clip shorter than the STFT window (a trailing
    fragment the slicer kept); ``crop``: every clip cropped to that many frames (Onsets and
    Frames trains on fixed-length crops; validation pads whole pieces)."""

    def __init__(self, n: int, seed: int, silent: int | None = None,
                 short: int | None = None, shift: int = 2, crop: int | None = None):
        self.n, self.seed, self.silent, self.short, self.shift = n, seed, silent, short, shift
        self.crop = crop

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1000 + i)
        length = N_FFT + HOP * int(torch.randint(10, 16, (), generator=g))
        if self.crop is not None:
            length = N_FFT + HOP * (self.crop - 1)
        if i == self.short:
            length = N_FFT // 2
        t = torch.arange(length) / SR
        n_frames = max((length - N_FFT) // HOP + 1, 0)
        onsets, frames, vel = (torch.zeros(n_frames, KEYS) for _ in range(3))
        audio = 1e-3 * torch.randn(length, generator=g)
        shift = int(torch.randint(-self.shift, self.shift + 1, (), generator=g))
        for _ in range(0 if i in (self.silent, self.short) else 3):
            key = int(torch.randint(20, 60, (), generator=g)) + shift  # pitch-shift augmentation
            start = int(torch.randint(0, max(n_frames - 4, 1), (), generator=g))
            stop, v = start + 4, float(torch.rand((), generator=g)) * 0.8 + 0.2
            f0 = 440.0 * 2 ** ((key + MIN_MIDI - 69) / 12)
            on = (t >= start * HOP / SR) & (t < stop * HOP / SR)
            tone = sum(torch.sin(2 * math.pi * h * f0 * t) / h for h in (1, 2, 3) if h * f0 < SR / 2)
            audio = audio + v * on * torch.exp(-3 * (t - start * HOP / SR).clamp_min(0)) * tone
            onsets[start, key], frames[start:stop, key], vel[start, key] = 1.0, 1.0, v
        if i == self.silent:
            audio = torch.zeros(length)
        return audio, onsets, frames, vel


def collate(items):
    """Pad every clip (and its rolls) to the longest in the batch; the lengths say where each
    ends."""
    audio, onsets, frames, vel = zip(*items)
    lengths = torch.tensor([len(a) for a in audio])
    longest = int(lengths.max())
    T = (longest - N_FFT) // HOP + 1
    pad = torch.stack([F.pad(a, (0, longest - len(a))) for a in audio])

    def rolls(rs):
        return torch.stack([F.pad(r, (0, 0, 0, T - len(r))) for r in rs])

    return pad, lengths, rolls(onsets), rolls(frames), rolls(vel)
