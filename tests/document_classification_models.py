"""Long-document classification written the way its repositories write it.

- ``HAN``: Yang et al. (2016)'s hierarchical attention network as the PyTorch ports write it
  (sgrvinod/a-PyTorch-Tutorial-to-Text-Classification, EdGENetworks/attention-networks):
  documents padded to ``MAX_SENT`` sentences of ``MAX_WORDS`` words, a word-level BiGRU run
  over each sentence with ``pack_padded_sequence``, additive attention with a context vector
  (``masked_fill(-inf)`` of the padding before the softmax), a sentence-level BiGRU over each
  document's sentences and a second attention; pretrained embeddings with a frozen padding
  row. ``skip_empty=True`` runs the word level over the non-empty sentences only and scatters
  them back (the ports' ``sentences[valid]``); ``False`` is the planted bug: the padding
  sentences of a short document go through the word attention with every word masked.
- ``LAAT``: Vu et al. (2020)'s label-wise attention for ICD coding: ``softmax(U tanh(W H))``
  over the document's sentences for each code, one logit per code from its own document vector.
- ``MeanPoolHAN``: a sentence is the mean of its word vectors (the fastText-style baseline),
  the mean written ``torch.where(n > 0, sum / n, 0)``.

Losses: ``BCEWithLogitsLoss`` with ``pos_weight`` from the training split's label frequencies
(``(N - n_pos) / n_pos``), a hand-written soft macro-F1 (``1 - mean(2tp / (2tp + fp + fn))``).

The data are synthetic clinical notes: sentences of word ids, codes assigned when one of their
trigger words appears in the note.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

PAD, UNK = 0, 1
VOCAB, EMB, HID, ATT = 60, 16, 12, 16
MAX_SENT, MAX_WORDS = 5, 7
N_CODES = 12
FIRST_TRIGGER = 40           # word FIRST_TRIGGER + c assigns code c
NEVER_CODED = (5,)           # codes a training split never assigns (rare ICD codes)
RARE = VOCAB - 1             # an OOV word of the pretrained vectors, no known n-gram


# ---------------------------------------------------------------------------------------------
# data: notes as lists of sentences, the fixed-size padding collate_fn, label statistics


def corpus(n: int, seed: int = 0, short=(), rare_word=(), never_coded=(),
           min_sent: int = 2, empty=()) -> list:
    """``n`` notes of min_sent..MAX_SENT sentences (``short``: notes of one sentence), each sentence
    3..MAX_WORDS words; ``rare_word``: notes holding the word ``RARE``; codes in
    ``never_coded`` are never assigned (their trigger words never appear)."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for i in range(n):
        n_sent = 1 if i in short else int(torch.randint(min_sent, MAX_SENT + 1, (1,), generator=g))
        sents = []
        for _ in range(n_sent):
            k = int(torch.randint(3, MAX_WORDS + 1, (1,), generator=g))
            sents.append(torch.randint(2, FIRST_TRIGGER, (k,), generator=g).tolist())
        codes = torch.randperm(N_CODES, generator=g)[:2].tolist()
        codes = [c for c in codes if c not in never_coded]
        for c in codes:
            s = sents[int(torch.randint(len(sents), (1,), generator=g))]
            s[int(torch.randint(len(s), (1,), generator=g))] = FIRST_TRIGGER + c
        if i in rare_word:
            sents[0][0] = RARE
        data.append(([] if i in empty else sents, codes))
    return data


def collate(examples):
    """(docs (B, MAX_SENT, MAX_WORDS), words per sentence (B, MAX_SENT), sentences per note (B,),
    multi-hot codes (B, N_CODES)): every note padded to MAX_SENT whole sentences."""
    b = len(examples)
    docs = torch.full((b, MAX_SENT, MAX_WORDS), PAD, dtype=torch.long)
    words = torch.zeros(b, MAX_SENT, dtype=torch.long)
    y = torch.zeros(b, N_CODES)
    for i, (sents, codes) in enumerate(examples):
        for j, s in enumerate(sents[:MAX_SENT]):
            s = s[:MAX_WORDS]
            docs[i, j, : len(s)] = torch.tensor(s)
            words[i, j] = len(s)
        y[i, codes] = 1.0
    return docs, words, (words > 0).sum(1), y


def pos_weight(data) -> torch.Tensor:
    """``(N - n_pos) / n_pos`` per code over the training split (BCEWithLogitsLoss' docs)."""
    counts = torch.zeros(N_CODES)
    for _, codes in data:
        counts[codes] += 1
    return (len(data) - counts) / counts


def code_prior(data, floor: float = 1e-9) -> torch.Tensor:
    """Each code's frequency in the training split, floored for the codes it never assigns."""
    counts = torch.zeros(N_CODES)
    for _, codes in data:
        counts[codes] += 1
    return (counts / len(data)).clamp_min(floor)


def pretrained_vectors(seed: int = 0, rare_ngrams=(3, 7)) -> torch.Tensor:
    """word2vec-style vectors for the vocabulary; the OOV word ``RARE`` gets the mean of its
    known character n-grams' vectors (fastText's trick): ``rare_ngrams=()``, none known."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(VOCAB, EMB, generator=g) * 0.5
    ngrams = torch.randn(20, EMB, generator=g) * 0.5
    known = {RARE: list(rare_ngrams)}   # the n-grams of RARE found in the n-gram table
    for w, idx in known.items():
        table[w] = ngrams[torch.tensor(idx, dtype=torch.long)].mean(0)
    table[PAD] = 0.0
    return table


# ---------------------------------------------------------------------------------------------
# the models


class AdditiveAttention(nn.Module):
    """u = tanh(W h + b), score = u . u_w, softmax over the unmasked positions."""

    def __init__(self, dim: int, att: int = ATT):
        super().__init__()
        self.proj = nn.Linear(dim, att)
        self.context = nn.Linear(att, 1, bias=False)

    def forward(self, h, mask):
        scores = self.context(torch.tanh(self.proj(h))).squeeze(-1)
        scores = scores.masked_fill(~mask, float("-inf"))
        alpha = F.softmax(scores, dim=-1)
        return (alpha.unsqueeze(-1) * h).sum(1), alpha


def embedding(vectors=None) -> nn.Embedding:
    emb = nn.Embedding.from_pretrained(pretrained_vectors() if vectors is None else vectors,
                                       freeze=False, padding_idx=PAD)
    return emb


class HAN(nn.Module):
    def __init__(self, skip_empty: bool = True, attention=AdditiveAttention,
                 n_codes: int = N_CODES, prior: torch.Tensor | None = None, vectors=None):
        super().__init__()
        self.skip_empty = skip_empty
        self.emb = embedding(vectors)
        self.word_rnn = nn.GRU(EMB, HID, batch_first=True, bidirectional=True)
        self.word_attn = attention(2 * HID)
        self.sent_rnn = nn.GRU(2 * HID, HID, batch_first=True, bidirectional=True)
        self.sent_attn = AdditiveAttention(2 * HID)
        self.out = nn.Linear(2 * HID, n_codes)
        self.init_prior(self.out, prior)

    @staticmethod
    def init_prior(layer, prior):
        """The output bias at the codes' prior log-odds (rare codes: the imbalance)."""
        if prior is not None:
            with torch.no_grad():
                layer.bias.copy_(torch.logit(prior))

    def encode_words(self, docs, words):
        b, s, w = docs.shape
        flat, lens = docs.reshape(b * s, w), words.reshape(b * s)
        keep = lens > 0 if self.skip_empty else torch.ones_like(lens, dtype=torch.bool)
        x = self.emb(flat[keep])
        packed = pack_padded_sequence(x, lens[keep].clamp(min=1).cpu(), batch_first=True,
                                      enforce_sorted=False)
        h, _ = pad_packed_sequence(self.word_rnn(packed)[0], batch_first=True, total_length=w)
        v, _ = self.word_attn(h, flat[keep] != PAD)
        sent = v.new_zeros(b * s, v.size(-1))
        sent[keep] = v
        return sent.reshape(b, s, -1)

    def encode_sentences(self, docs, words, n_sent):
        sents = self.encode_words(docs, words)
        packed = pack_padded_sequence(sents, n_sent.clamp(min=1).cpu(), batch_first=True,
                                      enforce_sorted=False)
        h, _ = pad_packed_sequence(self.sent_rnn(packed)[0], batch_first=True,
                                   total_length=docs.size(1))
        return h, words > 0

    def forward(self, docs, words, n_sent):
        h, mask = self.encode_sentences(docs, words, n_sent)
        doc, _ = self.sent_attn(h, mask)
        return self.out(doc)


class LAAT(HAN):
    """Label-wise attention over the sentence states: one attention and one logit per code."""

    def __init__(self, n_codes: int = N_CODES, att: int = ATT, **kw):
        super().__init__(n_codes=n_codes, **kw)
        self.W = nn.Linear(2 * HID, att, bias=False)
        self.U = nn.Linear(att, n_codes, bias=False)
        self.final = nn.Linear(2 * HID, n_codes)
        self.init_prior(self.final, kw.get("prior"))

    def forward(self, docs, words, n_sent):
        h, mask = self.encode_sentences(docs, words, n_sent)
        scores = self.U(torch.tanh(self.W(h))).transpose(1, 2)          # (B, codes, S)
        a = F.softmax(scores.masked_fill(~mask.unsqueeze(1), float("-inf")), dim=-1)
        v = a @ h                                                        # (B, codes, 2H)
        return (self.final.weight * v).sum(-1) + self.final.bias


class MeanPoolHAN(HAN):
    """Sentences as the mean of their word vectors, the sentence level as in HAN."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.word_proj = nn.Linear(EMB, 2 * HID)

    def encode_words(self, docs, words):
        x = torch.tanh(self.word_proj(self.emb(docs)))                   # (B, S, W, 2H)
        n = words.unsqueeze(-1).float()
        return torch.where(n > 0, x.sum(2) / n, torch.zeros_like(x[:, :, 0]))


def make_han():
    return HAN()


def make_han_unguarded():
    return HAN(skip_empty=False)


def make_laat():
    return LAAT()


def make_han_prior():
    """HAN with its output bias at the training split's code priors (floored: codes the
    split never assigns get log-odds of 1e-9)."""
    return HAN(prior=code_prior(corpus(16, never_coded=NEVER_CODED)))


def make_mean_pool():
    return MeanPoolHAN()


def make_han_fasttext():
    return HAN(vectors=pretrained_vectors(rare_ngrams=()))


# ---------------------------------------------------------------------------------------------
# losses


class WeightedBCE(nn.Module):
    """BCEWithLogitsLoss with the training split's pos_weight as a buffer."""

    def __init__(self, weights: torch.Tensor):
        super().__init__()
        self.bce = nn.BCEWithLogitsLoss(pos_weight=weights)

    def forward(self, logits, y):
        return self.bce(logits, y)


def soft_macro_f1(logits, y):
    """1 - the batch's soft macro-F1: probabilities in place of hard predictions."""
    p = torch.sigmoid(logits)
    tp = (p * y).sum(0)
    fp = (p * (1 - y)).sum(0)
    fn = ((1 - p) * y).sum(0)
    f1 = 2 * tp / (2 * tp + fp + fn)
    return 1 - f1.mean()


def logistic_loss(logits, y):
    """The log-loss written out, softplus as ``log(1 + exp(.))``, averaged over every entry."""
    loss = y * torch.log(1 + torch.exp(-logits)) + (1 - y) * torch.log(1 + torch.exp(logits))
    return loss.mean()
