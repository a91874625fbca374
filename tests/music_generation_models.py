"""Symbolic music generation written the way its repositories write it.

- ``MusicTransformerXL``: a decoder over REMI event tokens (bar, position, pitch, duration)
  with Music Transformer's relative attention (Huang et al. 2018: ``Q Er^T`` skewed into place
  by padding one column and reshaping, Transformer-XL's ``_rel_shift``), a causal mask with
  ``-inf`` beside the key padding mask, Transformer-XL segment memory (the previous segment's
  detached hidden states concatenated in front of the keys and values), a tempo conditioning
  input, a token head and a velocity head (``mu``, ``log sigma`` of a log-normal).
- ``MusicVAE``: Roberts et al. (2018): a BiLSTM encoder to ``mu``, ``logvar``, a conductor LSTM
  making one embedding per bar from ``z``, a bar decoder LSTM run with teacher forcing.

Losses: label-smoothed cross-entropy with the padding's ``ignore_index`` (``F.cross_entropy``
or written by hand as ``log(softmax)``), the velocity's log-normal negative log-likelihood at
note-on positions, MusicVAE's KL with free bits.

The data are synthetic pieces of different lengths: bars of (position, pitch, duration) events
with a MIDI velocity per note and a tempo in BPM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

PAD, BOS, EOS, BAR = 0, 1, 2, 3
POS0, N_POS = 4, 16
PITCH0, N_PITCH = POS0 + N_POS, 24
DUR0, N_DUR = PITCH0 + N_PITCH, 8
TEMPO0, N_TEMPO = DUR0 + N_DUR, 8            # tempo tokens: in the vocabulary, never emitted
VOCAB = TEMPO0 + N_TEMPO
D, HEADS, LAYERS, SEG = 16, 2, 2, 8
BAR_LEN = 13                                  # BAR + 4 notes of (position, pitch, duration)
N_BARS = 2


# ---------------------------------------------------------------------------------------------
# data: pieces as token lists with velocities and tempo, the padding collate_fn


def piece(g, n_bars: int, zero_velocity: bool = False) -> dict:
    tokens, vel = [BOS], [0.0]
    for b in range(n_bars):
        tokens.append(BAR)
        vel.append(0.0)
        for k in range(4):
            pitch = int(torch.randint(N_PITCH, (1,), generator=g))
            v = float(torch.randint(40, 110, (1,), generator=g))
            if zero_velocity and b == n_bars - 1 and k == 1:
                v = 0.0                        # a MIDI note-on of velocity 0: a note-off
            tokens += [POS0 + 4 * k, PITCH0 + pitch, DUR0 + int(torch.randint(N_DUR, (1,),
                                                                               generator=g))]
            vel += [0.0, v, 0.0]
    return {"tokens": tokens, "vel": vel,
            "tempo": float(torch.randint(70, 160, (1,), generator=g))}


def corpus(n: int, seed: int = 0, zero_velocity=(), empty=(), tempo_us=()) -> list:
    """``n`` pieces of 1..3 bars; ``zero_velocity``: pieces with a note-on of velocity 0;
    ``empty``: pieces the MIDI parser gave no event (only their BOS is dropped too: no token);
    ``tempo_us``: pieces whose tempo is MIDI's set_tempo value (microseconds per quarter)."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for i in range(n):
        p = piece(g, int(torch.randint(1, 4, (1,), generator=g)), i in zero_velocity)
        if i in empty:
            p["tokens"], p["vel"] = [], []
        if i in tempo_us:
            p["tempo"] = 60e6 / p["tempo"]
        data.append(p)
    return data


def collate(pieces):
    """Pad to a whole number of segments (+1 for the shifted targets)."""
    n = max(len(p["tokens"]) for p in pieces)
    n = max(SEG, math.ceil(max(n - 1, 1) / SEG) * SEG) + 1
    tok = torch.full((len(pieces), n), PAD)
    vel = torch.zeros(len(pieces), n)
    for i, p in enumerate(pieces):
        tok[i, :len(p["tokens"])] = torch.tensor(p["tokens"], dtype=torch.long)
        vel[i, :len(p["vel"])] = torch.tensor(p["vel"])
    tempo = torch.tensor([[p["tempo"]] for p in pieces])
    return tok, vel, tempo


MAX_LEN = 5 * SEG + 1


def collate_fixed(pieces):
    """Pad every batch to MAX_LEN tokens (the fixed-size padding of a config's max_seq_len)."""
    tok, vel, tempo = collate(pieces)
    return (F.pad(tok, (0, MAX_LEN - tok.shape[1]), value=PAD),
            F.pad(vel, (0, MAX_LEN - vel.shape[1])), tempo)


def segments(tok, vel):
    """Transformer-XL's segments: (inputs, targets, target velocities) of length SEG."""
    for s in range(0, tok.shape[1] - 1, SEG):
        yield tok[:, s:s + SEG], tok[:, s + 1:s + SEG + 1], vel[:, s + 1:s + SEG + 1]


def is_note(tokens):
    return (tokens >= PITCH0) & (tokens < PITCH0 + N_PITCH)


# ---------------------------------------------------------------------------------------------
# Music Transformer with relative attention and segment memory


def rel_shift(x):
    """Transformer-XL's skew of ``(B, H, Lq, Lk)`` relative logits into absolute positions."""
    b, h, lq, lk = x.shape
    x = F.pad(x, (1, 0))
    return x.view(b, h, lk + 1, lq)[:, :, 1:].view(b, h, lq, lk)


class RelativeAttention(nn.Module):
    def __init__(self, d=D, heads=HEADS, max_len=4 * SEG, keep_self=True):
        super().__init__()
        self.h, self.dh, self.keep_self = heads, d // heads, keep_self
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.Er = nn.Parameter(torch.randn(max_len, self.dh) * 0.02)

    def forward(self, x, mem, key_pad):
        b, lq, _ = x.shape
        cat = x if mem is None else torch.cat([mem, x], 1)
        lk = cat.shape[1]
        q = self.qkv(x)[..., :D].view(b, lq, self.h, self.dh).transpose(1, 2)
        k, v = self.qkv(cat)[..., D:].view(b, lk, 2, self.h, self.dh).permute(2, 0, 3, 1, 4)
        srel = rel_shift(q @ self.Er[-lk:].t())
        scores = (q @ k.transpose(-1, -2) + srel) / math.sqrt(self.dh)
        causal = torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1)
        masked = causal | key_pad[:, None, None, :]
        if self.keep_self:  # a padding query attends to itself: no row without a key
            masked = masked & (torch.arange(lk) != torch.arange(lq)[:, None] + lk - lq)
        scores = scores.masked_fill(masked, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(b, lq, D)
        return self.out(y)


class Block(nn.Module):
    def __init__(self, keep_self=True):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = RelativeAttention(keep_self=keep_self)
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x, mem, key_pad):
        x = x + self.attn(self.ln1(x), mem, key_pad)
        return x + self.ff(self.ln2(x))


class MusicTransformerXL(nn.Module):
    """``forward(tokens, tempo, mems, mem_pad) -> (logits, vel_mu, vel_log_sigma, new_mems,
    new_mem_pad)``; the loop detaches the returned memory and feeds it back next segment."""

    def __init__(self, prior_bias: bool = False, keep_self: bool = True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.tempo = nn.Linear(1, D)
        self.blocks = nn.ModuleList(Block(keep_self) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)
        self.vel = nn.Linear(D, 2)
        if prior_bias:      # the output bias at the log unigram frequency of the training set
            with torch.no_grad():
                self.head.bias.copy_(token_log_prior())

    def forward(self, tokens, tempo, mems, mem_pad):
        x = self.emb(tokens) * math.sqrt(D) + self.tempo(tempo)[:, None, :]
        pad = tokens == PAD
        key_pad = pad if mem_pad is None else torch.cat([mem_pad, pad], 1)
        new = []
        for i, blk in enumerate(self.blocks):
            new.append(x)
            x = blk(x, None if mems is None else mems[i], key_pad)
        h = self.ln(x)
        mu, log_sigma = self.vel(h).unbind(-1)
        return self.head(h), mu, log_sigma, new, pad


def token_log_prior():
    """log of each token's frequency in a corpus (1e-9 for a token it never holds)."""
    tok, _, _ = collate(corpus(32, seed=1))
    counts = torch.bincount(tok.flatten(), minlength=VOCAB).float()
    return torch.log(counts / counts.sum() + 1e-9)


def make_mt():
    torch.manual_seed(0)
    return MusicTransformerXL()


def make_mt_unguarded():
    """Padding masked at every query: a segment after a short piece ended has no key."""
    torch.manual_seed(0)
    return MusicTransformerXL(keep_self=False)


def make_mt_prior():
    torch.manual_seed(0)
    return MusicTransformerXL(prior_bias=True)


def make_mt_half():
    torch.manual_seed(0)
    return MusicTransformerXL().half()


# ---------------------------------------------------------------------------------------------
# losses


def lognormal_nll(vel, mu, log_sigma):
    """-log p(vel) of a log-normal: (log v - mu)^2 / 2 sigma^2 + log sigma + log v + c."""
    logv = torch.log(vel)
    return 0.5 * ((logv - mu) / log_sigma.exp()).pow(2) + log_sigma + logv


class MusicLoss(nn.Module):
    """Label-smoothed cross-entropy over the tokens (padding ignored) + the velocity's
    log-normal NLL at note-on positions (``where=True``: written with ``torch.where`` over every
    position, the NLL of the others' velocity 0 masked out in forward only)."""

    def __init__(self, smoothing=0.1, vel_weight=0.1, where=False, by_hand=False):
        super().__init__()
        self.smoothing, self.vel_weight, self.where, self.by_hand = (
            smoothing, vel_weight, where, by_hand)

    def token_loss(self, logits, target):
        if not self.by_hand:
            return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1),
                                   ignore_index=PAD, label_smoothing=self.smoothing)
        logp = torch.log(F.softmax(logits, dim=-1))
        keep = (target != PAD).to(logp.dtype)
        nll = -logp.gather(-1, target[..., None]).squeeze(-1)
        smooth = -logp.mean(-1)
        tok = (1 - self.smoothing) * nll + self.smoothing * smooth
        return (tok * keep).sum() / keep.sum()

    def forward(self, logits, mu, log_sigma, target, vel):
        note = is_note(target)
        if self.where:
            nll = torch.where(note, lognormal_nll(vel, mu.float(), log_sigma.float()), 0.0)
            v = nll.sum() / note.sum().clamp_min(1)
        else:
            v = lognormal_nll(vel[note], mu[note].float(), log_sigma[note].float()).mean()
        return self.token_loss(logits.float() if not self.by_hand else logits, target) \
            + self.vel_weight * v


# ---------------------------------------------------------------------------------------------
# MusicVAE: encoder, conductor, bar decoder


class MusicVAE(nn.Module):
    def __init__(self, z=8):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.enc = nn.LSTM(D, D, batch_first=True, bidirectional=True)
        self.to_mu, self.to_logvar = nn.Linear(2 * D, z), nn.Linear(2 * D, z)
        self.z_to_c = nn.Linear(z, D)
        self.conductor = nn.LSTM(D, D, batch_first=True)
        self.dec = nn.LSTM(2 * D, D, batch_first=True)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens):
        """tokens ``(B, N_BARS * BAR_LEN)``: teacher forcing over each bar."""
        b = tokens.shape[0]
        h, _ = self.enc(self.emb(tokens))
        mu, logvar = self.to_mu(h[:, -1]), self.to_logvar(h[:, -1])
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        c0 = torch.tanh(self.z_to_c(z))
        bars, _ = self.conductor(c0[:, None].expand(b, N_BARS, D).contiguous())
        inp = F.pad(tokens, (1, 0), value=BOS)[:, :-1].view(b, N_BARS, BAR_LEN)
        x = torch.cat([self.emb(inp), bars[:, :, None].expand(b, N_BARS, BAR_LEN, D)], -1)
        out, _ = self.dec(x.view(b * N_BARS, BAR_LEN, 2 * D))
        return self.head(out).view(b, N_BARS * BAR_LEN, VOCAB), mu, logvar


class VAELoss(nn.Module):
    """Reconstruction + beta * KL with free bits (``max(KL - free_bits, 0)`` per sample)."""

    def __init__(self, beta=0.2, free_bits=0.5):
        super().__init__()
        self.beta, self.free_bits = beta, free_bits

    def forward(self, logits, mu, logvar, target):
        rec = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=PAD)
        kl = 0.5 * (mu.pow(2) + logvar.exp() - 1 - logvar).sum(-1)
        return rec + self.beta * torch.clamp(kl - self.free_bits, min=0).mean()


def make_vae():
    torch.manual_seed(0)
    return MusicVAE()


def vae_batch(pieces):
    """Two-bar windows (the first two bars; shorter pieces padded)."""
    tok = torch.full((len(pieces), N_BARS * BAR_LEN), PAD)
    for i, p in enumerate(pieces):
        t = p["tokens"][1:1 + N_BARS * BAR_LEN]
        tok[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    return tok


# ---------------------------------------------------------------------------------------------
# learning rate


def inverse_sqrt(warmup: int):
    """Noam's schedule as a LambdaLR factor: linear warmup, then 1/sqrt(step)."""
    return lambda step: min((step + 1) / warmup, math.sqrt(warmup / (step + 1)))
