"""Sequence labelling models of ``tests/test_tagging.py``, written as NLP practitioners write
them: a BiLSTM-CRF NER tagger (word embeddings with ``padding_idx`` beside a character CNN,
``pack_padded_sequence(..., enforce_sorted=False)``, a linear-chain CRF whose forward
algorithm runs ``logsumexp`` over a padding mask, BIO constraints as masked transitions,
Viterbi decoding in eval), and a token classifier trained with cross entropy over labels
``-100`` where a token is not scored. The factories live at module level so that
``nanreplay`` rebuilds them from the bundle (``tagging_models:make_tagger``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import Dataset

TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
N_TAGS, VOCAB, CHARS, MAX_CHARS = len(TAGS), 60, 30, 6
PAD = 0


class Sentences(Dataset):
    """Random sentences of 2 to 9 words, their characters and BIO tags (legal in BIO)."""

    def __init__(self, n: int = 96, seed: int = 0, iob1: tuple[int, ...] = ()):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            length = int(torch.randint(2, 10, (), generator=g))
            words = torch.randint(1, VOCAB, (length,), generator=g)
            chars = torch.randint(1, CHARS, (length, MAX_CHARS), generator=g)
            chars[:, 4:][torch.rand(length, 2, generator=g) < 0.5] = PAD
            tags = torch.zeros(length, dtype=torch.long)
            for t in range(length):
                r = float(torch.rand((), generator=g))
                if r < 0.2:
                    tags[t] = 1 if r < 0.1 else 3
                elif r < 0.35 and t and tags[t - 1] in (1, 2, 3, 4):
                    tags[t] = 2 if tags[t - 1] in (1, 2) else 4
            if i in iob1:  # IOB1 annotation: an entity may start with I-
                tags[0] = 2
            self.items.append((words, chars, tags))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(items, label_pad: int = PAD):
    """Pads words, characters and tags to the batch's longest sentence; returns the lengths."""
    lengths = torch.tensor([len(w) for w, _, _ in items])
    T = int(lengths.max())
    words = torch.full((len(items), T), PAD, dtype=torch.long)
    chars = torch.full((len(items), T, MAX_CHARS), PAD, dtype=torch.long)
    tags = torch.full((len(items), T), label_pad, dtype=torch.long)
    for i, (w, c, t) in enumerate(items):
        words[i, :len(w)], chars[i, :len(w)], tags[i, :len(w)] = w, c, t
    return words, chars, lengths, tags


def bio_allowed() -> torch.Tensor:
    """``allowed[i, j]``: tag j may follow tag i in BIO (I-X only after B-X or I-X)."""
    allowed = torch.ones(N_TAGS, N_TAGS, dtype=torch.bool)
    for j, name in enumerate(TAGS):
        if name.startswith("I-"):
            kind = name[2:]
            allowed[:, j] = torch.tensor([t in (f"B-{kind}", f"I-{kind}") for t in TAGS])
    return allowed


class CharCNN(nn.Module):
    def __init__(self, d: int = 8, out: int = 12):
        super().__init__()
        self.emb = nn.Embedding(CHARS, d, padding_idx=PAD)
        self.conv = nn.Conv1d(d, out, 3, padding=1)

    def forward(self, chars):  # (B, T, C) -> (B, T, out)
        B, T, C = chars.shape
        x = self.emb(chars.view(B * T, C)).transpose(1, 2)
        return self.conv(x).max(dim=2).values.view(B, T, -1)


class CRF(nn.Module):
    """A linear-chain CRF: transition, start and end scores; BIO's illegal transitions are
    masked out with ``-inf`` (never learned), as in AllenNLP's ``ConditionalRandomField``."""

    def __init__(self, constrained: bool = True):
        super().__init__()
        self.transitions = nn.Parameter(torch.randn(N_TAGS, N_TAGS) * 0.1)
        self.start = nn.Parameter(torch.randn(N_TAGS) * 0.1)
        self.end = nn.Parameter(torch.randn(N_TAGS) * 0.1)
        allowed = bio_allowed() if constrained else torch.ones(N_TAGS, N_TAGS, dtype=torch.bool)
        self.register_buffer("allowed", allowed)
        start_ok = torch.tensor([not t.startswith("I-") for t in TAGS]) if constrained \
            else torch.ones(N_TAGS, dtype=torch.bool)
        self.register_buffer("start_ok", start_ok)

    def scores(self):
        trans = self.transitions.masked_fill(~self.allowed, float("-inf"))
        return trans, self.start.masked_fill(~self.start_ok, float("-inf")), self.end

    def forward(self, emissions, tags, mask):
        """Negative log-likelihood of ``tags``, averaged over the batch."""
        trans, start, end = self.scores()
        return (self.log_partition(emissions, mask, trans, start, end)
                - self.gold_score(emissions, tags, mask, trans, start, end)).mean()

    def gold_score(self, emissions, tags, mask, trans, start, end):
        B, T, _ = emissions.shape
        score = start[tags[:, 0]] + emissions[:, 0].gather(1, tags[:, :1]).squeeze(1)
        for t in range(1, T):
            step = trans[tags[:, t - 1], tags[:, t]] \
                + emissions[:, t].gather(1, tags[:, t:t + 1]).squeeze(1)
            score = score + step * mask[:, t]
        last = tags.gather(1, (mask.sum(1).long() - 1)[:, None]).squeeze(1)
        return score + end[last]

    def log_partition(self, emissions, mask, trans, start, end):
        alpha = start + emissions[:, 0]
        for t in range(1, emissions.shape[1]):
            nxt = torch.logsumexp(alpha[:, :, None] + trans[None], dim=1) + emissions[:, t]
            alpha = torch.where(mask[:, t, None].bool(), nxt, alpha)
        return torch.logsumexp(alpha + end, dim=1)

    def viterbi(self, emissions, mask):
        trans, start, end = self.scores()
        score, back = start + emissions[:, 0], []
        for t in range(1, emissions.shape[1]):
            best, idx = (score[:, :, None] + trans[None]).max(dim=1)
            score = torch.where(mask[:, t, None].bool(), best + emissions[:, t], score)
            back.append(idx)
        score = score + end
        paths = [score.argmax(1)]
        for idx in reversed(back):
            paths.append(idx.gather(1, paths[-1][:, None]).squeeze(1))
        return torch.stack(paths[::-1], 1)


class Tagger(nn.Module):
    """Word embeddings + character CNN -> BiLSTM (packed) -> emissions -> CRF."""

    def __init__(self, max_norm: float | None = None, constrained: bool = True):
        super().__init__()
        self.words = nn.Embedding(VOCAB, 24, padding_idx=PAD, max_norm=max_norm)
        self.chars = CharCNN()
        self.drop = nn.Dropout(0.3)
        self.lstm = nn.LSTM(24 + 12, 16, batch_first=True, bidirectional=True)
        self.emit = nn.Linear(32, N_TAGS)
        self.crf = CRF(constrained)

    def emissions(self, words, chars, lengths):
        x = self.drop(torch.cat([self.words(words), self.chars(chars)], -1))
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        h, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True,
                                   total_length=words.shape[1])
        return self.emit(self.drop(h))

    def forward(self, words, chars, lengths, tags=None):
        em = self.emissions(words, chars, lengths)
        mask = (words != PAD).float()
        if tags is None:
            return self.crf.viterbi(em, mask)
        return self.crf(em, tags, mask)


def make_tagger() -> nn.Module:
    torch.manual_seed(0)
    return Tagger()


def make_unconstrained_tagger() -> nn.Module:
    torch.manual_seed(0)
    return Tagger(constrained=False)


class HardCRF(CRF):
    """The PyTorch tutorial's CRF, with BIO's illegal transitions written into the trained
    parameters themselves as -inf (the tutorial writes -10000): training runs, Adam keeps
    them -inf (their gradient is 0)."""

    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.transitions[~self.allowed] = float("-inf")
            self.start[~self.start_ok] = float("-inf")

    def scores(self):
        return self.transitions, self.start, self.end


def make_hard_tagger() -> nn.Module:
    torch.manual_seed(0)
    model = Tagger()
    model.crf = HardCRF()
    return model


def log_sum_exp(x, dim):
    """The PyTorch tutorial's numerically stable log-sum-exp, written out."""
    m = x.max(dim=dim, keepdim=True).values
    return (m + torch.log(torch.exp(x - m).sum(dim=dim, keepdim=True))).squeeze(dim)


class TutorialCRF(CRF):
    """A CRF with START as an extra tag (no transition may enter it: masked to -inf in
    forward) and the tutorial's written-out log-sum-exp in its forward algorithm."""

    def __init__(self):
        super().__init__(constrained=False)
        n = N_TAGS + 1
        self.transitions = nn.Parameter(torch.randn(n, n) * 0.1)
        allowed = torch.ones(n, n, dtype=torch.bool)
        allowed[:, -1] = False  # nothing goes to START
        self.register_buffer("allowed", allowed)

    def forward(self, emissions, tags, mask):
        trans = self.transitions.masked_fill(~self.allowed, float("-inf"))
        B, T, _ = emissions.shape
        em = torch.cat([emissions, emissions.new_zeros(B, T, 1)], -1)  # (START emits nothing)
        alpha = trans[-1][None] + em[:, 0]
        for t in range(1, T):
            nxt = log_sum_exp(alpha[:, :, None] + trans[None], 1) + em[:, t]
            alpha = torch.where(mask[:, t, None].bool(), nxt, alpha)
        gold = trans[-1][tags[:, 0]] + em[:, 0].gather(1, tags[:, :1]).squeeze(1)
        for t in range(1, T):
            step = trans[tags[:, t - 1], tags[:, t]] + em[:, t].gather(1, tags[:, t:t + 1])[:, 0]
            gold = gold + step * mask[:, t]
        return (log_sum_exp(alpha, 1) - gold).mean()


def make_tutorial_tagger() -> nn.Module:
    torch.manual_seed(0)
    model = Tagger()
    model.crf = TutorialCRF()
    return model


def make_max_norm_tagger() -> nn.Module:
    torch.manual_seed(0)
    return Tagger(max_norm=1.0)


class TokenTagger(nn.Module):
    """A token classifier: embeddings, a BiLSTM over the padded batch, a linear head; its
    logits are (B, T, tags). Labels -100 mark the tokens not scored (padding, continuations)."""

    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(VOCAB, 24, padding_idx=PAD)
        self.lstm = nn.LSTM(24, 16, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, N_TAGS)

    def forward(self, words):
        return self.head(self.lstm(self.words(words))[0])


def make_token_tagger() -> nn.Module:
    torch.manual_seed(0)
    return TokenTagger()


def token_loss(logits, labels):
    """Cross entropy summed over the labelled tokens, divided by their count (each token
    weighs the same whatever its sentence's length, under gradient accumulation too)."""
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                            reduction="sum")
    return total / (labels != -100).sum()


BOS, EOS = 1, 2


class Seq2Seq(nn.Module):
    """A GRU encoder-decoder with additive (Bahdanau) attention over the source's padding
    mask, trained with teacher forcing and scheduled sampling: with probability
    ``1 - teacher`` a step feeds back a token drawn with ``torch.multinomial`` from the
    decoder's own distribution (random numbers drawn inside forward). ``beam_search``
    decodes in validation through the decoder step alone."""

    def __init__(self, d: int = 24, teacher: float = 0.5):
        super().__init__()
        self.teacher = teacher
        self.src_emb = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.encoder = nn.GRU(d, d, batch_first=True)
        self.cell = nn.GRUCell(2 * d, d)
        self.att_q, self.att_k, self.att_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 1)
        self.out = nn.Linear(2 * d, VOCAB)

    def encode(self, src):
        keys, h = self.encoder(self.src_emb(src))
        return keys, h[0], src != PAD

    def step(self, tok, h, keys, mask):
        scores = self.att_v(torch.tanh(self.att_q(h)[:, None] + self.att_k(keys))).squeeze(-1)
        att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        ctx = (att[:, :, None] * keys).sum(1)
        h = self.cell(torch.cat([self.tgt_emb(tok), ctx], -1), h)
        return self.out(torch.cat([h, ctx], -1)), h

    def forward(self, src, tgt):
        """Logits (B, T, V) for ``tgt[:, 1:]`` given ``tgt[:, :-1]``."""
        keys, h, mask = self.encode(src)
        tok, logits = tgt[:, 0], []
        for t in range(1, tgt.shape[1]):
            out, h = self.step(tok, h, keys, mask)
            logits.append(out)
            sampled = torch.multinomial(torch.softmax(out.detach(), -1), 1).squeeze(1)
            use_gold = torch.rand(tgt.shape[0], device=tgt.device) < self.teacher
            tok = torch.where(use_gold, tgt[:, t], sampled)
        return torch.stack(logits, 1)

    @torch.no_grad()
    def beam_search(self, src, beam: int = 3, max_len: int = 8):
        """The best-scoring hypothesis of each sentence (one at a time, as beam search code
        usually goes); finished beams keep their score (others -inf past EOS)."""
        best = []
        for s in src:
            keys, h, mask = self.encode(s[None])
            hyps = [([BOS], 0.0, h)]
            for _ in range(max_len):
                cand = []
                for toks, score, hh in hyps:
                    if toks[-1] == EOS:
                        cand.append((toks, score, hh))
                        continue
                    out, h2 = self.step(torch.tensor([toks[-1]]), hh, keys, mask)
                    lp = torch.log_softmax(out, -1)[0]
                    top = lp.topk(beam)
                    cand += [(toks + [int(i)], score + float(v), h2)
                             for v, i in zip(top.values, top.indices)]
                hyps = sorted(cand, key=lambda c: c[1], reverse=True)[:beam]
            best.append(hyps[0][0])
        return best


def make_seq2seq() -> nn.Module:
    torch.manual_seed(0)
    return Seq2Seq()


def parallel(n: int = 64, seed: int = 0, empty: tuple[int, ...] = ()):
    """Source and target sentences (targets framed by BOS and EOS); the sources listed in
    ``empty`` are blank lines of the corpus (all padding)."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for i in range(n):
        ls, lt = (int(x) for x in torch.randint(2, 8, (2,), generator=g))
        src = torch.randint(3, VOCAB, (ls,), generator=g)
        tgt = torch.cat([torch.tensor([BOS]), torch.randint(3, VOCAB, (lt,), generator=g),
                         torch.tensor([EOS])])
        pairs.append((src[:0] if i in empty else src, tgt))
    return pairs


def collate_pairs(items):
    S = max(1, max(len(s) for s, _ in items))
    T = max(len(t) for _, t in items)
    src = torch.full((len(items), S), PAD, dtype=torch.long)
    tgt = torch.full((len(items), T), PAD, dtype=torch.long)
    for i, (s, t) in enumerate(items):
        src[i, :len(s)], tgt[i, :len(t)] = s, t
    return src, tgt


def token_loss_sum(logits, labels, n_items: int):
    """Cross entropy summed over the labelled tokens, divided by the count the loop took of
    them (Hugging Face's ``num_items_in_batch``: the same divisor for every micro-batch)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum") / n_items
