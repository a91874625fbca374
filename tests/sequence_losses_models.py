"""Sequence losses written by hand, the way ASR repositories write them: a CTC forward
algorithm over the extended label sequence in log space (vadimkantorov/ctc, the
``ctc_alignment`` of ESPnet's ``ctc_segmentation`` notes), a transducer loss over the (T, U)
lattice (torchaudio's python reference ``compute_alpha`` in its rnnt tests, k2's
``rnnt_loss_simple`` with ``rnnt_type="modified"``: one symbol per frame), ESPnet's
``LabelSmoothingLoss`` and its ``0.3 * ctc + 0.7 * att`` hybrid, MWER over an n-best list
(``espnet2/asr/...`` / Shannon's "Optimizing expected word error rate"), and word-level
knowledge distillation from a teacher's soft labels (fairseq's ``--kd`` losses).
The factories and losses of ``test_sequence_losses.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, FEAT, HID, BLANK, PAD = 8, 6, 16, 0, -1
NEG_INF = float("-inf")


class Encoder(nn.Module):
    """A 2-layer LSTM over padded frames, projected to the vocabulary."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(FEAT, HID, batch_first=True)
        self.proj = nn.Linear(HID, VOCAB)

    def forward(self, feats, feat_lens):
        h, _ = self.lstm(feats)
        return self.proj(h).log_softmax(-1), feat_lens


def make_ctc_model() -> nn.Module:
    torch.manual_seed(0)
    return Encoder()


def ctc_by_hand(log_probs, targets, in_lens, tgt_lens, neg=NEG_INF):
    """vadimkantorov/ctc's alpha recursion over the extended labels (blank, y1, blank, ...)."""
    b, t_max, _ = log_probs.shape
    s_max = 2 * targets.shape[1] + 1
    ext = torch.full((b, s_max), BLANK, dtype=torch.long)
    ext[:, 1::2] = targets.clamp_min(0)
    lp = log_probs.gather(2, ext[:, None, :].expand(b, t_max, s_max))
    same = torch.zeros(b, s_max, dtype=torch.bool)
    same[:, 3::2] = ext[:, 3::2] == ext[:, 1:-2:2]
    alpha = torch.full((b, s_max), neg)
    alpha = torch.cat([lp[:, 0, :2], alpha[:, 2:]], 1)
    history = [alpha]
    for t in range(1, t_max):
        a1 = torch.cat([alpha[:, :1].new_full((b, 1), neg), alpha[:, :-1]], 1)
        a2 = torch.cat([alpha[:, :2].new_full((b, 2), neg), alpha[:, :-2]], 1)
        a2 = torch.where(same, alpha.new_full((), neg), a2)
        alpha = torch.logaddexp(torch.logaddexp(alpha, a1), a2) + lp[:, t]
        history.append(alpha)
    alphas = torch.stack(history, 1)
    last = alphas[torch.arange(b), in_lens - 1]
    end = 2 * tgt_lens
    ll = torch.logaddexp(last.gather(1, end[:, None]), last.gather(1, (end - 1)[:, None]))
    return -(ll.squeeze(1) / tgt_lens).mean()


def ctc_loss(out, targets, tgt_lens):
    log_probs, in_lens = out
    return ctc_by_hand(log_probs, targets, in_lens, tgt_lens)


def ctc_loss_floor(out, targets, tgt_lens):
    log_probs, in_lens = out
    return ctc_by_hand(log_probs, targets, in_lens, tgt_lens, neg=-1e30)


class Transducer(nn.Module):
    """Encoder, an embedding+LSTM prediction network and an additive joiner (torchaudio's
    ``RNNT`` / icefall's ``Transducer`` layout), log-softmax over the joint (B, T, U+1, V)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.LSTM(FEAT, HID, batch_first=True)
        self.embed = nn.Embedding(VOCAB, HID)
        self.pred = nn.LSTM(HID, HID, batch_first=True)
        self.joiner = nn.Linear(HID, VOCAB)

    def forward(self, feats, feat_lens, ys):
        e, _ = self.enc(feats)
        sos = torch.cat([ys.new_full((ys.shape[0], 1), BLANK), ys.clamp_min(0)], 1)
        p, _ = self.pred(self.embed(sos))
        joint = torch.tanh(e[:, :, None] + p[:, None])
        return self.joiner(joint).log_softmax(-1), feat_lens


def make_transducer() -> nn.Module:
    torch.manual_seed(0)
    return Transducer()


def rnnt_modified(out, ys, y_lens):
    """k2's ``rnnt_type="modified"`` recursion: a label consumes a frame, as does a blank."""
    logp, t_lens = out
    b, t_max, u1, _ = logp.shape
    blank = logp[..., BLANK]
    lab = logp[:, :, :-1].gather(3, ys.clamp_min(0)[:, None, :, None].expand(b, t_max, u1 - 1, 1))
    lab = lab.squeeze(3)
    alpha = torch.cat([logp.new_zeros(b, 1), logp.new_full((b, u1 - 1), NEG_INF)], 1)
    history = [alpha]
    for t in range(t_max):
        stay = alpha + blank[:, t]
        move = torch.cat([alpha.new_full((b, 1), NEG_INF), alpha[:, :-1] + lab[:, t]], 1)
        alpha = torch.logaddexp(stay, move)
        history.append(alpha)
    alphas = torch.stack(history, 1)
    ll = alphas[torch.arange(b), t_lens, y_lens]
    return -(ll / y_lens).mean()


class AttentionDecoder(nn.Module):
    """Encoder + a GRU decoder teacher-forced on the labels, CTC head beside (ESPnet hybrid)."""

    def __init__(self):
        super().__init__()
        self.enc = Encoder()
        self.embed = nn.Embedding(VOCAB, HID)
        self.dec = nn.GRU(HID, HID, batch_first=True)
        self.out = nn.Linear(HID, VOCAB)

    def forward(self, feats, feat_lens, ys_in):
        ctc_lp, lens = self.enc(feats, feat_lens)
        h, _ = self.dec(self.embed(ys_in.clamp_min(0)))
        return ctc_lp, lens, self.out(h)


def make_hybrid() -> nn.Module:
    torch.manual_seed(0)
    return AttentionDecoder()


def label_smoothing(logits, target, smoothing=0.1):
    """ESPnet's ``LabelSmoothingLoss`` (KL to the smoothed distribution, ignore_id rows out,
    ``normalize_length=True``: divided by the number of tokens)."""
    x = logits.reshape(-1, VOCAB)
    target = target.reshape(-1)
    true_dist = torch.full_like(x, smoothing / (VOCAB - 1))
    ignore = target == PAD
    total = len(target) - ignore.sum().item()
    target = target.masked_fill(ignore, 0)
    true_dist = true_dist.scatter(1, target[:, None], 1 - smoothing)
    kl = F.kl_div(torch.log_softmax(x, dim=1), true_dist, reduction="none")
    return kl.masked_fill(ignore[:, None], 0).sum() / total


def hybrid_loss(out, targets, tgt_lens, ys_out, ctc_weight=0.3):
    ctc_lp, lens, att = out
    ctc = ctc_by_hand(ctc_lp, targets, lens, tgt_lens, neg=-1e30)
    return ctc_weight * ctc + (1 - ctc_weight) * label_smoothing(att, ys_out)


class NBestScorer(nn.Module):
    """Scores each hypothesis of an n-best list (B, N, L) by its summed token log-probability."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HID)
        self.rnn = nn.GRU(HID, HID, batch_first=True)
        self.out = nn.Linear(HID, VOCAB)

    def forward(self, hyps, hyp_mask):
        b, n, length = hyps.shape
        flat = hyps.reshape(b * n, length).clamp_min(0)
        h, _ = self.rnn(self.embed(flat))
        lp = self.out(h).log_softmax(-1).gather(2, flat[..., None]).squeeze(2)
        nll = -(lp.sum(1)).reshape(b, n)
        return nll.masked_fill(~hyp_mask, float("inf"))


def make_nbest_scorer() -> nn.Module:
    torch.manual_seed(0)
    return NBestScorer()


def mwer_loss(scores, errors):
    """MWER: the n-best's posterior softmax(-score) times its word errors minus their mean."""
    post = torch.softmax(-scores, dim=-1)
    finite = torch.isfinite(scores)
    mean_err = (errors * finite).sum(-1, keepdim=True) / finite.sum(-1, keepdim=True)
    return (post * (errors - mean_err)).sum(-1).mean()


def kd_loss(out, teacher_logits, tgt_lens, temperature=1.0):
    """Word-level KD written as fairseq's users write it: sum p_t (log p_t - log p_s)."""
    log_probs, _ = out
    p_t = torch.softmax(teacher_logits / temperature, -1)
    kl = (p_t * (p_t.log() - log_probs)).sum(-1)
    return kl.mean()


def utterance(g, frames: int, labels: int):
    return torch.randn(frames, FEAT, generator=g), torch.randint(1, VOCAB, (labels,), generator=g)


def collate(items):
    """Pad frames with 0 and labels with PAD; lengths from the items, as a collate_fn does."""
    feats = nn.utils.rnn.pad_sequence([f for f, _ in items], batch_first=True)
    ys = nn.utils.rnn.pad_sequence([y for _, y in items], batch_first=True, padding_value=PAD)
    feat_lens = torch.tensor([len(f) for f, _ in items])
    y_lens = torch.tensor([len(y) for _, y in items])
    return feats, feat_lens, ys, y_lens


def batch(step: int, short: dict[int, int] | None = None, n: int = 4):
    """An utterance per row: 6 frames and 2-3 labels; ``short`` gives rows fewer frames."""
    g = torch.Generator().manual_seed(100 + step)
    short = short or {}
    return collate([utterance(g, short.get(i, 6), 2 + i % 2) for i in range(n)])


def noam(d_model: int, warmup: int):
    """ESPnet's ``NoamLR`` factor (step counted from 1)."""
    return lambda s: d_model ** -0.5 * min((s + 1) ** -0.5, (s + 1) * warmup ** -1.5)


def nbest_batch(step: int, emptied: int | None = None, n: int = 4, beams: int = 3):
    """An n-best list per utterance (B, N, L), its validity mask and each hypothesis' word
    errors; ``emptied``: a row whose every hypothesis was pruned (a beam that found none)."""
    g = torch.Generator().manual_seed(200 + step)
    hyps = torch.randint(1, VOCAB, (n, beams, 5), generator=g)
    mask = torch.ones(n, beams, dtype=torch.bool)
    mask[:, -1] = torch.rand(n, generator=g) > 0.5  # some beams kept fewer hypotheses
    if emptied is not None:
        mask[emptied] = False
    errors = torch.randint(0, 4, (n, beams), generator=g).float()
    return hyps, mask, errors
