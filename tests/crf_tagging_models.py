"""Sequence labelling with a CRF layer as NER / POS-tagging code writes it: a BiLSTM or a tiny
``transformers`` BertModel encoder (built from a config) under pytorch-crf's ``torchcrf.CRF``
(``-crf(emissions, tags, mask=mask, reduction=...)``, ``crf.decode``), word-piece alignment with
label -100 for the subwords, and hand-written CRFs: the forward algorithm with ``logsumexp``,
a naive ``log(sum(exp))`` one, a probability-space (scaled-HMM style) one, Viterbi decoding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from torchcrf import CRF

TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
VOCAB = 60
PAD = 0


class Sentences(Dataset):
    """Synthetic BIO-tagged sentences: entity words are drawn from their tag's own id range.
    ``empty``: indices of empty sentences (a blank line read as a sentence); ``long``: indices
    of sentences of ``long_len`` words (a whole paragraph with no sentence split)."""

    def __init__(self, n: int = 64, seed: int = 0, empty: tuple[int, ...] = (),
                 long: tuple[int, ...] = (), long_len: int = 90):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            length = 0 if i in empty else long_len if i in long else \
                int(torch.randint(4, 12, (1,), generator=g))
            tags = []
            while len(tags) < length:
                r = int(torch.randint(0, 6, (1,), generator=g))
                if r in (1, 3) and len(tags) < length - 1:
                    tags += [r, r + 1]
                else:
                    tags.append(0)
            tags = torch.tensor(tags[:length], dtype=torch.long)
            words = 1 + tags * 10 + torch.randint(0, 10, (length,), generator=g)
            self.items.append((words, tags))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(items):
    """Pads words with PAD and tags with O; the mask marks the real words."""
    n = max(max(len(w) for w, _ in items), 1)
    words = torch.full((len(items), n), PAD, dtype=torch.long)
    tags = torch.zeros((len(items), n), dtype=torch.long)
    for i, (w, t) in enumerate(items):
        words[i, :len(w)] = w
        tags[i, :len(t)] = t
    return words, tags, words != PAD


class HandCRF(nn.Module):
    """A linear-chain CRF written by hand (pytorch-crf's layout, batch first).
    ``normalizer``: ``logsumexp`` (the forward algorithm in log space), ``naive``
    (``log(sum(exp(...)))``) or ``prob`` (alpha kept as probabilities, logged at the end)."""

    def __init__(self, num_tags: int = len(TAGS), normalizer: str = "logsumexp"):
        super().__init__()
        self.normalizer = normalizer
        self.transitions = nn.Parameter(torch.randn(num_tags, num_tags) * 0.1)
        self.start = nn.Parameter(torch.randn(num_tags) * 0.1)
        self.end = nn.Parameter(torch.randn(num_tags) * 0.1)

    def forward(self, emissions, tags, mask):  # per-sentence log-likelihood (B,)
        return self.gold_score(emissions, tags, mask) - self.log_partition(emissions, mask)

    def gold_score(self, em, tags, mask):
        b, (trans, start, end) = torch.arange(em.size(0)), self.scores()
        score = start[tags[:, 0]] + em[b, 0, tags[:, 0]]
        for t in range(1, em.size(1)):
            step = trans[tags[:, t - 1], tags[:, t]] + em[b, t, tags[:, t]]
            score = score + torch.where(mask[:, t], step, 0.0)
        last = (mask.sum(1) - 1).clamp(min=0)
        return score + end[tags[b, last]]

    def scores(self):
        """Transition, start and end scores: log-probabilities for the probability-space CRF
        (an HMM-style locally normalised chain), free scores otherwise."""
        if self.normalizer == "prob":
            return self.transitions.log_softmax(-1), self.start.log_softmax(-1), self.end * 0
        return self.transitions, self.start, self.end

    def log_partition(self, em, mask):
        if self.normalizer == "prob":
            return self.prob_partition(em, mask)
        alpha = self.start + em[:, 0]
        for t in range(1, em.size(1)):
            nxt = alpha.unsqueeze(2) + self.transitions + em[:, t].unsqueeze(1)
            if self.normalizer == "naive":
                nxt = torch.log(torch.sum(torch.exp(nxt), dim=1))
            else:
                nxt = torch.logsumexp(nxt, dim=1)
            alpha = torch.where(mask[:, t].unsqueeze(1), nxt, alpha)
        alpha = alpha + self.end
        if self.normalizer == "naive":
            return torch.log(torch.exp(alpha).sum(1))
        return torch.logsumexp(alpha, 1)

    def prob_partition(self, em, mask):
        """The forward algorithm on probabilities: alpha_t = (alpha_{t-1} @ exp(T)) * exp(e_t)."""
        trans, start, end = (s.exp() for s in self.scores())
        emit = em.exp()
        alpha = start * emit[:, 0]
        for t in range(1, em.size(1)):
            nxt = (alpha @ trans) * emit[:, t]
            alpha = torch.where(mask[:, t].unsqueeze(1), nxt, alpha)
        return torch.log((alpha * end).sum(1))

    @torch.no_grad()
    def viterbi(self, em, mask):
        score, back = self.start + em[:, 0], []
        for t in range(1, em.size(1)):
            best, idx = (score.unsqueeze(2) + self.transitions).max(1)
            score = torch.where(mask[:, t].unsqueeze(1), best + em[:, t], score)
            back.append(torch.where(mask[:, t].unsqueeze(1), idx, torch.arange(em.size(2))))
        path = [(score + self.end).argmax(1)]
        for idx in reversed(back):
            path.append(idx.gather(1, path[-1].unsqueeze(1)).squeeze(1))
        return torch.stack(path[::-1], 1)


class BiLSTMCRF(nn.Module):
    """Embedding -> BiLSTM -> emissions -> CRF; ``forward`` returns each sentence's
    log-likelihood (B,) when given tags, the Viterbi paths otherwise.
    ``crf``: ``torchcrf`` (pytorch-crf) or a ``HandCRF`` normalizer name;
    ``pad_emissions``: the emissions of padding filled with -inf ("padding can take no tag")."""

    def __init__(self, crf: str = "torchcrf", pad_emissions: bool = False,
                 log_softmax: bool = False, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.lstm = nn.LSTM(d, d, batch_first=True, bidirectional=True)
        self.proj = nn.Linear(2 * d, len(TAGS))
        self.crf = CRF(len(TAGS), batch_first=True) if crf == "torchcrf" else HandCRF(normalizer=crf)
        self.pad_emissions = pad_emissions
        self.log_softmax = log_softmax

    def emissions(self, words, mask):
        em = self.proj(self.lstm(self.embed(words))[0])
        if self.log_softmax:  # an HMM-style locally normalised scorer: log p(tag | word)
            em = F.log_softmax(em, -1)
        if self.pad_emissions:
            em = em.masked_fill(~mask.unsqueeze(-1), float("-inf"))
        return em

    def forward(self, words, mask, tags=None):
        em = self.emissions(words, mask)
        if tags is None:
            if isinstance(self.crf, CRF):
                return self.crf.decode(em, mask=mask)
            return self.crf.viterbi(em, mask)
        if isinstance(self.crf, CRF):
            return self.crf(em, tags, mask=mask, reduction="none")
        return self.crf(em, tags, mask)


def make_tagger(**kw) -> nn.Module:
    torch.manual_seed(0)
    return BiLSTMCRF(**kw)


def crf_nll(llh, mask):
    """pytorch-crf's ``reduction='mean'``: the negative log-likelihood averaged over sentences."""
    return -llh.mean()


def per_token_nll(llh, mask):
    """The NLL of each sentence divided by its length, averaged: short and long sentences
    weigh alike."""
    return -(llh / mask.sum(1)).mean()


# ---------------------------------------------------------------------------------------------
# a tiny BERT encoder with word-piece alignment


def wordpieces(words):
    """A toy WordPiece tokenizer: word ids above 30 split into two pieces. Returns input ids
    ([CLS] ... [SEP]), the index of each word's first piece, and the word mask."""
    ids, first = [1], []
    for w in words.tolist():
        first.append(len(ids))
        ids += [w + 3, (w % 7) + 3 + VOCAB] if w > 30 else [w + 3]
    return ids + [2], first


def bert_collate(items):
    """Word pieces padded, labels aligned to the first piece (-100 on [CLS], [SEP], later
    pieces and padding) as ``tokenize_and_align_labels`` does, and the word-level indices."""
    enc = [wordpieces(w) for w, _ in items]
    n = max(len(i) for i, _ in enc)
    m = max(len(w) for w, _ in items)
    input_ids = torch.zeros((len(items), n), dtype=torch.long)
    labels = torch.full((len(items), n), -100, dtype=torch.long)
    first = torch.zeros((len(items), m), dtype=torch.long)
    for k, ((ids, f), (_, tags)) in enumerate(zip(enc, items)):
        input_ids[k, :len(ids)] = torch.tensor(ids)
        labels[k, f] = tags
        first[k, :len(f)] = torch.tensor(f)
    return input_ids, input_ids != 0, labels, first


class BertCRF(nn.Module):
    """BertModel -> dropout -> emissions of each word's first piece -> pytorch-crf."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=VOCAB + 20, hidden_size=16, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=32,
                         max_position_embeddings=128, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        self.bert = BertModel(cfg, add_pooling_layer=False)
        self.classifier = nn.Linear(16, len(TAGS))
        self.crf = CRF(len(TAGS), batch_first=True)

    def forward(self, input_ids, attention_mask, labels, first):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        em = self.classifier(hidden)
        word_em = em.gather(1, first.unsqueeze(-1).expand(-1, -1, em.size(-1)))
        word_tags = labels.gather(1, first)
        mask = word_tags != -100
        return -self.crf(word_em, word_tags.clamp(min=0), mask=mask, reduction="mean")


def make_bert_crf() -> nn.Module:
    torch.manual_seed(0)
    return BertCRF()


def bio_allowed() -> torch.Tensor:
    """(from, to) transitions BIO allows: I-X only after B-X or I-X."""
    allowed = torch.ones(len(TAGS), len(TAGS), dtype=torch.bool)
    for j, to in enumerate(TAGS):
        if to.startswith("I-"):
            for i, frm in enumerate(TAGS):
                allowed[i, j] = frm[2:] == to[2:]
    return allowed


def forbid_bio(crf: CRF, value: float) -> None:
    """BIO constraints written into pytorch-crf's trained scores, as NER repos do after
    building the model: illegal transitions and I- starts set to ``value``."""
    with torch.no_grad():
        crf.transitions[~bio_allowed()] = value
        crf.start_transitions[[i for i, t in enumerate(TAGS) if t.startswith("I-")]] = value
