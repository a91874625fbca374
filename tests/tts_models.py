"""Text-to-speech training as FastSpeech2 repositories write it, for ``test_tts``: phoneme
embeddings through a transformer encoder with a key padding mask, a variance adaptor that
predicts log durations, pitch and energy, a length regulator that ``repeat_interleave``s the
encoder states by the target durations, a mel decoder, and a loss module with masked L1/MSE
terms normalised by the number of valid tokens and frames. Batches are variable-length
utterances padded by a ``collate_fn``; pitch is normalised per utterance over its voiced frames.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

N_PHONES, N_MELS, D = 20, 8, 16


class VariancePredictor(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x, mask):
        h = torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        return self.out(self.norm(h)).squeeze(-1).masked_fill(mask, 0.0)


def length_regulate(x, durations):
    """Each token's state repeated by its duration, padded to the longest utterance."""
    out = [torch.repeat_interleave(h, d, dim=0) for h, d in zip(x, durations)]
    return pad_sequence(out, batch_first=True)


class FastSpeech2(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.embed = nn.Embedding(N_PHONES, d, padding_idx=0)
        self.encoder = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.duration = VariancePredictor(d)
        self.pitch = VariancePredictor(d)
        self.energy = VariancePredictor(d)
        self.pitch_embed = nn.Linear(1, d)
        self.decoder = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.mel = nn.Linear(d, N_MELS)

    def forward(self, phones, phone_lens, durations, pitch):
        src_pad = torch.arange(phones.shape[1]) >= phone_lens[:, None]
        x = self.encoder(self.embed(phones), src_key_padding_mask=src_pad)
        log_d = self.duration(x, src_pad)
        p = self.pitch(x, src_pad)
        e = self.energy(x, src_pad)
        x = x + self.pitch_embed(pitch.unsqueeze(-1))  # teacher forcing: the target pitch
        x = length_regulate(x, durations)
        mel_lens = durations.sum(1)
        mel_pad = torch.arange(x.shape[1]) >= mel_lens[:, None]
        x = self.decoder(x, src_key_padding_mask=mel_pad)
        mel_out = self.mel(x).masked_fill(mel_pad.unsqueeze(-1), 0.0)
        return mel_out, log_d, p, e, src_pad, mel_pad


def make_fastspeech2() -> nn.Module:
    torch.manual_seed(0)
    return FastSpeech2()


class FastSpeech2Loss(nn.Module):
    """Masked mel L1 over the valid frames, MSE on log durations, pitch and energy over the
    valid tokens. ``log1p`` is what the recipes use: ``plain_log`` is the bug of taking
    ``log(d)``, -inf for a phone the aligner gave 0 frames."""

    def __init__(self, plain_log: bool = False, frame_rmse: bool = False, parts: bool = False):
        super().__init__()
        self.plain_log, self.frame_rmse, self.parts = plain_log, frame_rmse, parts

    def forward(self, outputs, mel, durations, pitch, energy):
        mel_out, log_d, p, e, src_pad, mel_pad = outputs
        valid, frames = ~src_pad, ~mel_pad
        n_tok, n_fr = valid.sum(), frames.sum() * mel.shape[-1]
        if self.frame_rmse:  # per-frame RMSE; sqrt'(0) is inf where both are 0 (padding)
            mel_loss = (((mel_out - mel) ** 2).mean(-1).sqrt() * frames).sum() / frames.sum()
        else:
            mel_loss = ((mel_out - mel).abs() * frames.unsqueeze(-1)).sum() / n_fr
        d = durations.float()
        log_target = torch.log(d) if self.plain_log else torch.log(d + 1)
        dur_loss = (((log_d - log_target) ** 2) * valid).sum() / n_tok
        pitch_loss = (((p - pitch) ** 2) * valid).sum() / n_tok
        energy_loss = (((e - energy) ** 2) * valid).sum() / n_tok
        total = mel_loss + dur_loss + pitch_loss + energy_loss
        if self.parts:  # (total, the terms to log) as most recipes return it
            return total, {"mel": mel_loss.detach(), "duration": dur_loss.detach()}
        return total


def utterance(g: torch.Generator, *, zero_dur: bool = False, unvoiced: bool = False,
              failed: bool = False):
    """One aligned utterance: phones, per-phone durations, raw F0 (0 where unvoiced), energy
    and a mel whose length is the sum of the durations."""
    n = int(torch.randint(4, 9, (1,), generator=g))
    phones = torch.randint(1, N_PHONES, (n,), generator=g)
    dur = torch.randint(1, 5, (n,), generator=g)
    if zero_dur:
        dur[0] = 0  # a leading silence the aligner gave no frames
    if failed:
        dur[:] = 0  # the aligner failed on this utterance and gave every phone 0 frames
    f0 = 100 + 50 * torch.rand(n, generator=g)
    f0[torch.rand(n, generator=g) < 0.3] = 0.0
    if unvoiced:
        f0[1:] = 0.0  # a mostly whispered utterance: one voiced phone
    energy = torch.rand(n, generator=g)
    mel = torch.randn(int(dur.sum()), N_MELS, generator=g)
    return phones, dur, f0, energy, mel


def normalise_pitch(f0):
    """Per-utterance z-score over the voiced phones (F0 > 0); unvoiced ones stay 0."""
    voiced = f0 > 0
    mean = f0[voiced].mean()
    std = f0[voiced].std()  # the bug: unbiased std of one voiced phone is NaN (0 / 0)
    return torch.where(voiced, (f0 - mean) / (std + 1e-5), torch.zeros_like(f0))


def collate(items):
    phones, dur, f0, energy, mel = zip(*items)
    return (pad_sequence(phones, batch_first=True), torch.tensor([len(p) for p in phones]),
            pad_sequence(dur, batch_first=True),
            pad_sequence([normalise_pitch(f) for f in f0], batch_first=True),
            pad_sequence(energy, batch_first=True), pad_sequence(mel, batch_first=True))


def dataset(n: int = 24, *, seed: int = 0, zero_dur=(), unvoiced=(), failed=()):
    g = torch.Generator().manual_seed(seed)
    return [utterance(g, zero_dur=i in zero_dur, unvoiced=i in unvoiced,
                       failed=i in failed) for i in range(n)]


class LocationSensitiveAttention(nn.Module):
    """Tacotron2's attention: additive energies from the query, the memory and a convolution
    over the cumulative attention weights; padded text positions are masked with -inf."""

    def __init__(self, d: int = D, a: int = 8):
        super().__init__()
        self.query = nn.Linear(d, a, bias=False)
        self.memory = nn.Linear(d, a, bias=False)
        self.location = nn.Conv1d(2, a, 5, padding=2, bias=False)
        self.v = nn.Linear(a, 1, bias=False)

    def forward(self, query, memory, keys, weights_cat, pad):
        loc = self.location(weights_cat).transpose(1, 2)
        energies = self.v(torch.tanh(self.query(query)[:, None] + keys + loc)).squeeze(-1)
        energies = energies.masked_fill(pad, float("-inf"))
        weights = torch.softmax(energies, dim=1)
        return (weights[:, :, None] * memory).sum(1), weights


class Tacotron2(nn.Module):
    """Teacher-forced decoder with a reduction factor ``R``: each step emits R frames and a
    stop logit, fed the last frame of the previous group."""

    R = 2

    def __init__(self, d: int = D):
        super().__init__()
        self.embed = nn.Embedding(N_PHONES, d, padding_idx=0)
        self.encoder = nn.GRU(d, d // 2, batch_first=True, bidirectional=True)
        self.prenet = nn.Sequential(nn.Linear(N_MELS, d), nn.ReLU())
        self.cell = nn.LSTMCell(2 * d, d)
        self.attention = LocationSensitiveAttention(d)
        self.frames = nn.Linear(2 * d, N_MELS * self.R)
        self.stop = nn.Linear(2 * d, 1)

    def forward(self, text, text_lens, mel):
        pad = torch.arange(text.shape[1]) >= text_lens[:, None]
        memory, _ = self.encoder(self.embed(text))
        keys = self.attention.memory(memory)
        b, t = text.shape
        h = c = memory.new_zeros(b, memory.shape[-1])
        ctx = memory.new_zeros(b, memory.shape[-1])
        w, w_cum = memory.new_zeros(b, t), memory.new_zeros(b, t)
        prev = mel.new_zeros(b, N_MELS)
        outs, stops, aligns = [], [], []
        for i in range(mel.shape[1] // self.R):
            h, c = self.cell(torch.cat([self.prenet(prev), ctx], 1), (h, c))
            ctx, w = self.attention(h, memory, keys, torch.stack([w, w_cum], 1), pad)
            w_cum = w_cum + w
            outs.append(self.frames(torch.cat([h, ctx], 1)))
            stops.append(self.stop(torch.cat([h, ctx], 1)))
            aligns.append(w)
            prev = mel[:, (i + 1) * self.R - 1]  # teacher forcing
        mel_out = torch.stack(outs, 1).reshape(b, -1, N_MELS)
        return mel_out, torch.cat(stops, 1), torch.stack(aligns, 1)


def make_tacotron2() -> nn.Module:
    torch.manual_seed(0)
    return Tacotron2()


class Tacotron2Loss(nn.Module):
    """Masked mel MSE over the valid frames, stop-token BCE with ``pos_weight`` (one stop
    frame per utterance against many non-stop ones) and the guided attention loss."""

    def __init__(self, pos_weight: float = 5.0, g: float = 0.2):
        super().__init__()
        self.bce = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(pos_weight), reduction="none")
        self.g = g

    def forward(self, outputs, mel, mel_lens, text_lens):
        mel_out, stop, align = outputs
        r = Tacotron2.R
        frames = (torch.arange(mel.shape[1]) < mel_lens[:, None]).unsqueeze(-1)
        mel_loss = (((mel_out - mel) ** 2) * frames).sum() / (frames.sum() * mel.shape[-1])
        steps = (mel_lens + r - 1) // r
        valid = torch.arange(stop.shape[1]) < steps[:, None]
        target = (torch.arange(stop.shape[1]) == steps[:, None] - 1).float()
        stop_loss = (self.bce(stop, target) * valid).sum() / valid.sum()
        n = torch.arange(align.shape[2])[None, None] / text_lens[:, None, None]
        t = torch.arange(align.shape[1])[None, :, None] / steps[:, None, None]
        guide = 1 - torch.exp(-((n - t) ** 2) / (2 * self.g**2))
        mask = valid[:, :, None] & (torch.arange(align.shape[2]) < text_lens[:, None])[:, None]
        guided = (align * guide * mask).sum() / mask.sum()
        return mel_loss + stop_loss + guided


def tacotron_batch(step: int, *, empty: int | None = None, size: int = 4):
    """``(text, text_lens, mel, mel_lens)`` with mels padded to a multiple of ``R``; text
    ``empty`` is the transcript a cleaner emptied (digits only, no number expansion)."""
    g = torch.Generator().manual_seed(1000 + step)
    text_lens = torch.randint(3, 8, (size,), generator=g)
    if empty is not None:
        text_lens[empty] = 0
    text = torch.randint(1, N_PHONES, (size, int(text_lens.max())), generator=g)
    text = text * (torch.arange(text.shape[1]) < text_lens[:, None])
    mel_lens = torch.randint(6, 13, (size,), generator=g)
    t = int(mel_lens.max())
    t += -t % Tacotron2.R
    mel = torch.randn(size, t, N_MELS, generator=g) * (torch.arange(t)[:, None] < mel_lens[:, None, None])
    return text, text_lens, mel, mel_lens
