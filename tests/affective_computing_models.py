"""Affective computing models for ``test_affective_computing``: a multimodal transformer for
emotion recognition from audio, face and text features (per-modality projections, cross-modal
attention with key padding masks, masked mean pooling), with a valence/arousal regression
head, a categorical emotion head and an evidential (Normal-Inverse-Gamma) uncertainty head;
utterances of their own lengths padded by a DataLoader's collate; the losses of the domain:
the concordance correlation coefficient per batch, a Pearson-correlation loss, a KL divergence
to per-annotator soft labels (label-distribution learning) and the evidential NLL."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

AUDIO, FACE, TEXT = 12, 10, 16
EMOTIONS = 5
ANNOTATORS = 4
D = 16


class CrossModal(nn.Module):
    """Queries of one modality attend over another's frames, padded frames masked out."""

    def __init__(self, d: int = D, heads: int = 2):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm = nn.LayerNorm(d)

    def forward(self, q, kv, kv_pad):
        out, _ = self.attn(q, kv, kv, key_padding_mask=kv_pad)
        return self.norm(q + out)


class MultimodalEmotion(nn.Module):
    """MulT-style fusion: audio queries attend over face and text; pooled over the audio
    frames that are not padding; three heads."""

    def __init__(self, speakers: int = 0):
        super().__init__()
        self.proj_a = nn.Linear(AUDIO, D)
        self.proj_f = nn.Linear(FACE, D)
        self.proj_t = nn.Linear(TEXT, D)
        self.a2f = CrossModal()
        self.a2t = CrossModal()
        self.speaker = nn.Embedding(speakers, D) if speakers else None
        self.fuse = nn.Sequential(nn.Linear(2 * D, D), nn.GELU())
        self.va = nn.Linear(D, 2)
        self.emo = nn.Linear(D, EMOTIONS)
        self.evidential = nn.Linear(D, 4)

    def forward(self, audio, face, text, a_pad, f_pad, t_pad, speaker=None):
        a = self.proj_a(audio)
        f = self.proj_f(face)
        t = self.proj_t(text)
        h = torch.cat([self.a2f(a, f, f_pad), self.a2t(a, t, t_pad)], -1)
        keep = (~a_pad).unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1)
        z = self.fuse(pooled)
        if self.speaker is not None:
            z = z + self.speaker(speaker)
        return torch.tanh(self.va(z)), self.emo(z), self.evidential(z)


def make_model():
    torch.manual_seed(0)
    return MultimodalEmotion()


def make_low_evidence_model():
    """The evidential head started at almost no virtual observations: nu's bias at -20, so
    that the prior's evidence nu = softplus(-20) = 2e-9 lets the data dominate."""
    model = make_model()
    with torch.no_grad():
        model.evidential.bias[1] = -20.0
    return model


def make_from_broken_checkpoint():
    """Fine-tuning from a text encoder checkpoint saved after its own run had diverged: one
    row of proj_t's weight is NaN."""
    model = make_model()
    with torch.no_grad():
        model.proj_t.weight[3] = float("nan")
    return model


def make_speaker_model():
    torch.manual_seed(0)
    return MultimodalEmotion(speakers=8)


# ---- data ----

def utterances(n: int = 17, seed: int = 0):
    """``n`` utterances: frames of audio (log-mel-like), face (action units) and text (word
    embeddings) of their own lengths, gold valence/arousal in [-1, 1], every annotator's vote
    over the emotions and a speaker id."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ta, tf, tt = (int(torch.randint(3, 7, (1,), generator=g)) for _ in range(3))
        votes = torch.zeros(EMOTIONS)
        for c in torch.randint(0, EMOTIONS, (ANNOTATORS,), generator=g):
            votes[c] += 1
        out.append({
            "audio": torch.randn(ta, AUDIO, generator=g),
            "face": torch.randn(tf, FACE, generator=g),
            "text": torch.randn(tt, TEXT, generator=g),
            "va": torch.rand(2, generator=g) * 2 - 1,
            "votes": votes,
            "speaker": i % 8,
        })
    return out


def pad(seqs):
    lengths = torch.tensor([len(s) for s in seqs])
    x = nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    return x, torch.arange(x.shape[1]) >= lengths.unsqueeze(1)  # True: padding


def collate(items):
    audio, a_pad = pad([u["audio"] for u in items])
    face, f_pad = pad([u["face"] for u in items])
    text, t_pad = pad([u["text"] for u in items])
    return {"audio": audio, "face": face, "text": text, "a_pad": a_pad, "f_pad": f_pad,
            "t_pad": t_pad, "va": torch.stack([u["va"] for u in items]),
            "votes": torch.stack([u["votes"] for u in items]),
            "speaker": torch.tensor([u["speaker"] for u in items])}


# ---- losses ----

def ccc(x, y):
    """Lin's concordance correlation coefficient over the batch, per column."""
    mx, my = x.mean(0), y.mean(0)
    vx, vy = x.var(0, unbiased=False), y.var(0, unbiased=False)
    cov = ((x - mx) * (y - my)).mean(0)
    return 2 * cov / (vx + vy + (mx - my) ** 2)


def ccc_loss(out, va, votes):
    return (1 - ccc(out[0].float(), va)).mean()


def pearson_loss(out, va, votes):
    """1 - Pearson's r per column, the eps where the code's author put it: after the roots."""
    x, y = out[0].float(), va
    xc, yc = x - x.mean(0), y - y.mean(0)
    vx, vy = (xc ** 2).mean(0), (yc ** 2).mean(0)
    r = (xc * yc).mean(0) / (torch.sqrt(vx) * torch.sqrt(vy) + 1e-8)
    return (1 - r).mean()


def pearson_loss_std(out, va, votes):
    """1 - Pearson's r per column from the batch's standard deviations, no eps."""
    x, y = out[0].float(), va
    cov = ((x - x.mean(0)) * (y - y.mean(0))).mean(0)
    r = cov / (x.std(0, unbiased=False) * y.std(0, unbiased=False))
    return (1 - r).mean()


def pearson_loss_moments(out, va, votes):
    """1 - Pearson's r per column from the raw moments, E[x^2] - E[x]^2 (one pass)."""
    x, y = out[0].float(), va
    sx = torch.sqrt((x ** 2).mean(0) - x.mean(0) ** 2)
    sy = torch.sqrt((y ** 2).mean(0) - y.mean(0) ** 2)
    r = ((x * y).mean(0) - x.mean(0) * y.mean(0)) / (sx * sy + 1e-8)
    return (1 - r).mean()


def make_collapsed_model():
    """A model whose valence/arousal head has collapsed to its bias (its weights shrunk to
    1e-6 by weight decay): nearly the same prediction for every utterance."""
    model = make_model()
    with torch.no_grad():
        model.va.weight.mul_(1e-5)
        model.va.bias.fill_(0.7)
    return model


def soft_labels(votes):
    """Label-distribution learning's target: each utterance's share of annotator votes."""
    return votes / votes.sum(-1, keepdim=True)


def kl_soft(logits, votes):
    """KL(p || q) to the annotators' distribution, written out by hand."""
    p = soft_labels(votes)
    logq = F.log_softmax(logits.float(), -1)
    return (p * (torch.log(p) - logq)).sum(-1).mean()


def kl_div_soft(logits, votes):
    """The same with ``F.kl_div`` (its target's 0 entries count 0)."""
    return F.kl_div(F.log_softmax(logits.float(), -1), soft_labels(votes), reduction="batchmean")


def kl_soft_safe(logits, votes):
    p = soft_labels(votes.clamp_min(0) + 1e-3)
    return F.kl_div(F.log_softmax(logits.float(), -1), p, reduction="batchmean")


def nig_nll(raw, y):
    """The evidential regression NLL (Amini et al.) of a Normal-Inverse-Gamma head."""
    gamma, nu, alpha, beta = raw.unbind(-1)
    nu = F.softplus(nu)
    alpha = F.softplus(alpha) + 1
    beta = F.softplus(beta)
    omega = 2 * beta * (1 + nu)
    return (0.5 * torch.log(math.pi / nu) - alpha * torch.log(omega)
            + (alpha + 0.5) * torch.log(nu * (y - gamma) ** 2 + omega)
            + torch.lgamma(alpha) - torch.lgamma(alpha + 0.5)).mean()


class MultiTaskLoss(nn.Module):
    """The loss wrapper: CCC on valence/arousal, KL to the soft labels, evidential NLL on
    arousal, weighted."""

    def __init__(self, kl=kl_soft_safe, w_kl: float = 0.5, w_ev: float = 0.1,
                 ev_float: bool = True):
        super().__init__()
        self.kl = kl
        self.w_kl, self.w_ev, self.ev_float = w_kl, w_ev, ev_float

    def forward(self, out, va, votes):
        va_hat, logits, raw = out
        return (ccc_loss(out, va, votes) + self.w_kl * self.kl(logits, votes)
                + self.w_ev * nig_nll(raw.float() if self.ev_float else raw, va[:, 1]))
