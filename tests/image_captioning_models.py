"""Image captioning written the way Show-Attend-Tell and self-critical sequence training (SCST)
code writes it: the factories, losses and data of ``test_image_captioning.py``.

- ``images`` / ``captions``: RGB images in [0, 1] and captions ``<bos> w1 .. wn <eos> <pad>..``
  (the word of a caption is drawn from words its image's colour selects, so there is
  something to learn), served by a ``DataLoader`` of ``(image, caption)`` pairs.
- ``Encoder``: a small CNN (no biases: convolutions before a norm) whose last, unactivated
  feature map is the annotation grid ``(B, P, D)``;
  ``l2norm`` normalises each annotation vector by hand (``f / sqrt(sum f^2)``, clamped).
- ``ShowAttendTell``: an LSTM decoder with soft attention over the grid (scaled dot-product
  scores; ``manual_softmax`` writes the softmax as ``exp(e) / sum exp(e)``), the gating
  scalar ``beta``, teacher-forced ``forward(images, tokens, caption_mask)`` returning the
  logits and the attention weights (masked past each caption's end); ``sample``: captions
  drawn token by token (or greedy), ``beam_search`` for evaluation.
- ``CaptionLoss``: label-smoothed cross-entropy ignoring ``<pad>`` plus the doubly stochastic
  attention regulariser ``lambda * sum_p (1 - sum_t alpha_tp)^2``.
- ``SCSTLoss``: the self-critical loss: a CIDEr-like reward of each sampled caption against its
  reference (1- and 2-gram tf-idf vectors, log-IDF from the training corpus' document
  frequencies), the mean of the image's other samples as the baseline, the length-normalised
  log-probability of the sampled tokens, an entropy bonus at the sampling temperature.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, PAD, BOS, EOS, MAXLEN, D, SIZE = 16, 0, 1, 2, 8, 16, 16


def images(n: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images in [0, 1] and the colour class (0, 1, 2) that dominates each."""
    g = torch.Generator().manual_seed(seed)
    cls = torch.randint(0, 3, (n,), generator=g)
    x = 0.3 * torch.rand(n, 3, SIZE, SIZE, generator=g)
    x[torch.arange(n), cls] += 0.6
    return x, cls


def captions(cls: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``<bos> words <eos> <pad>...`` of 2..MAXLEN-2 words drawn from the class's words."""
    g = torch.Generator().manual_seed(seed + 1)
    n = len(cls)
    out = torch.full((n, MAXLEN), PAD, dtype=torch.long)
    out[:, 0] = BOS
    lengths = torch.randint(2, MAXLEN - 1, (n,), generator=g)
    for i in range(n):
        k = int(lengths[i])
        words = 3 + 4 * int(cls[i]) + torch.randint(0, 4, (k,), generator=g)
        out[i, 1:k + 1] = words
        out[i, k + 1] = EOS
    return out


def document_frequency(caps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How many training captions hold each 1-gram ``(V,)`` and 2-gram ``(V * V,)``."""
    uni, bi = ngram_counts(caps)
    return (uni > 0).float().sum(0), (bi > 0).float().sum(0)


def ngram_counts(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Term frequencies of each caption's words (not <bos>/<eos>/<pad>): ``(B, V)``, ``(B, V*V)``."""
    word = tokens >= 3
    uni = F.one_hot(tokens, VOCAB).float().mul(word[..., None]).sum(1)
    pair = word[:, :-1] & word[:, 1:]
    idx = tokens[:, :-1] * VOCAB + tokens[:, 1:]
    bi = F.one_hot(idx, VOCAB * VOCAB).float().mul(pair[..., None]).sum(1)
    return uni, bi


class Encoder(nn.Module):
    def __init__(self, l2norm: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, D, 3, stride=2, padding=1, bias=False)
        self.conv2 = nn.Conv2d(D, D, 3, stride=2, padding=1, bias=False)
        self.l2norm = l2norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.conv2(F.relu(self.conv1(x)))                    # unactivated, as patch features
        f = f.flatten(2).transpose(1, 2)                          # (B, P, D) annotations
        if self.l2norm:
            f = f / torch.sqrt((f ** 2).sum(-1, keepdim=True)).clamp_min(1e-6)
        return f


class Attention(nn.Module):
    def __init__(self, manual_softmax: bool = False):
        super().__init__()
        self.key = nn.Linear(D, D)
        self.query = nn.Linear(D, D)
        self.manual_softmax = manual_softmax

    def forward(self, feats: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = (self.key(feats) @ self.query(h)[..., None]).squeeze(-1) / math.sqrt(D)
        if self.manual_softmax:
            alpha = torch.exp(e) / torch.exp(e).sum(-1, keepdim=True)
        else:
            alpha = e.softmax(-1)
        return (alpha[..., None] * feats).sum(1), alpha


class ShowAttendTell(nn.Module):
    def __init__(self, l2norm: bool = False, manual_softmax: bool = False):
        super().__init__()
        self.encoder = Encoder(l2norm)
        self.embed = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.attend = Attention(manual_softmax)
        self.init_h = nn.Linear(D, D)
        self.init_c = nn.Linear(D, D)
        self.f_beta = nn.Linear(D, D)
        self.cell = nn.LSTMCell(2 * D, D)
        self.out = nn.Linear(D, VOCAB)

    def start(self, feats):
        mean = feats.mean(1)
        return torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))

    def step(self, feats, word, state):
        h, c = state
        context, alpha = self.attend(feats, h)
        context = torch.sigmoid(self.f_beta(h)) * context
        h, c = self.cell(torch.cat([self.embed(word), context], -1), (h, c))
        return self.out(h), alpha, (h, c)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, caption_mask: torch.Tensor):
        """Teacher forcing: logits for tokens[:, 1:] from tokens[:, :-1]; alphas masked."""
        feats = self.encoder(x)
        state = self.start(feats)
        logits, alphas = [], []
        for t in range(tokens.size(1) - 1):
            lg, alpha, state = self.step(feats, tokens[:, t], state)
            logits.append(lg)
            alphas.append(alpha * caption_mask[:, t + 1, None])
        return torch.stack(logits, 1), torch.stack(alphas, 1)

    @torch.no_grad()
    def sample(self, x: torch.Tensor, greedy: bool = False, temperature: float = 1.0,
               generator=None) -> torch.Tensor:
        """Captions ``(B, MAXLEN)`` drawn token by token, <pad> after each <eos>."""
        feats = self.encoder(x)
        state = self.start(feats)
        out = torch.full((len(x), MAXLEN), PAD, dtype=torch.long)
        out[:, 0] = BOS
        done = torch.zeros(len(x), dtype=torch.bool)
        for t in range(1, MAXLEN):
            lg, _, state = self.step(feats, out[:, t - 1], state)
            lg[:, PAD] = float("-inf")                             # never sample <pad>
            if greedy:
                word = lg.argmax(-1)
            else:
                word = torch.multinomial((lg / temperature).softmax(-1), 1,
                                         generator=generator).squeeze(1)
            word = torch.where(done, PAD, EOS if t == MAXLEN - 1 else word)
            out[:, t] = torch.where(done, PAD, word)
            done |= word == EOS
        return out

    @torch.no_grad()
    def beam_search(self, x: torch.Tensor, beam: int = 3) -> torch.Tensor:
        """The highest log-probability caption of each image (length-normalised)."""
        best = []
        for i in range(len(x)):
            feats = self.encoder(x[i:i + 1])
            beams = [([BOS], 0.0, self.start(feats))]
            finished = []
            for _ in range(MAXLEN - 1):
                grown = []
                for words, score, state in beams:
                    lg, _, st = self.step(feats, torch.tensor([words[-1]]), state)
                    top = lg.log_softmax(-1)[0].topk(beam)
                    grown += [(words + [int(w)], score + float(s), st)
                              for s, w in zip(top.values, top.indices)]
                grown.sort(key=lambda b: -b[1] / len(b[0]))
                beams = []
                for b in grown[:beam]:
                    (finished if b[0][-1] == EOS else beams).append(b)
                if not beams:
                    break
            pick = max(finished + beams, key=lambda b: b[1] / len(b[0]))[0]
            best.append(pick + [PAD] * (MAXLEN - len(pick)))
        return torch.tensor(best)


def make_model() -> ShowAttendTell:
    torch.manual_seed(0)
    return ShowAttendTell()


def make_l2norm_model() -> ShowAttendTell:
    torch.manual_seed(0)
    return ShowAttendTell(l2norm=True)


def make_manual_softmax_model() -> ShowAttendTell:
    torch.manual_seed(0)
    return ShowAttendTell(manual_softmax=True)


class CaptionLoss(nn.Module):
    """Label-smoothed cross-entropy (ignoring <pad>) + the doubly stochastic regulariser."""

    def __init__(self, smoothing: float = 0.1, alpha_c: float = 1.0):
        super().__init__()
        self.smoothing, self.alpha_c = smoothing, alpha_c

    def forward(self, logits, alphas, tokens):
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1),
                             ignore_index=PAD, label_smoothing=self.smoothing)
        coverage = (1.0 - alphas.sum(1)) ** 2
        return ce + self.alpha_c * coverage.mean()


class SCSTLoss(nn.Module):
    """Self-critical loss over K samples per image (rows i*K .. i*K+K-1)."""

    def __init__(self, df_uni, df_bi, n_docs: int, k: int = 4, entropy: float = 0.01,
                 temperature: float = 1.0, df_floor: float = 1.0, count_eos: bool = True):
        super().__init__()
        self.register_buffer("df_uni", df_uni)
        self.register_buffer("df_bi", df_bi)
        self.n_docs, self.k, self.entropy = n_docs, k, entropy
        self.temperature, self.df_floor, self.count_eos = temperature, df_floor, count_eos

    def cider(self, sampled, refs):
        score = 0.0
        for cand, ref, df in zip(ngram_counts(sampled), ngram_counts(refs),
                                 (self.df_uni, self.df_bi)):
            idf = math.log(self.n_docs) - torch.log(df.clamp_min(self.df_floor))
            c, r = cand * idf, ref * idf
            score = score + (c * r).sum(1) / (c.norm(dim=1) * r.norm(dim=1) + 1e-9)
        return 10.0 * score / 2

    def forward(self, logits, sampled, refs):
        reward = self.cider(sampled, refs).detach().view(-1, self.k)
        baseline = (reward.sum(1, keepdim=True) - reward) / (self.k - 1)
        advantage = (reward - baseline).reshape(-1)
        logp = logits.log_softmax(-1).gather(-1, sampled[:, 1:, None]).squeeze(-1)
        keep = sampled[:, 1:] != PAD
        if not self.count_eos:
            keep = keep & (sampled[:, 1:] != EOS)
        keep = keep.float()
        seq_logp = (logp * keep).sum(1) / keep.sum(1)
        p = (logits / self.temperature).softmax(-1)
        ent = (-(p * torch.log(p)).sum(-1) * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return -(advantage * seq_logp).mean() - self.entropy * ent.mean()
