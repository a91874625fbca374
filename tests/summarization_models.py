"""Sequence-to-sequence summarization written the way its repositories write it.

- ``Seq2SeqTransformer``: PyTorch's "Language translation with nn.Transformer" tutorial
  (batch-first): shared embedding scaled by sqrt(d_model), sinusoidal positions,
  ``nn.Transformer`` with ``generate_square_subsequent_mask`` and the three key padding
  masks, a generator trained with ``CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)``.
- ``CopyTransformer``: the same, plus a copy attention (OpenNMT's copy generator, See et al.'s
  p_gen on a Transformer): the final distribution ``p_gen * p_vocab + (1 - p_gen) * attn``
  scattered over the extended vocabulary with ``scatter_add``.
- ``ConstrainedSeq2Seq``: generation restricted to the article's words, the other logits
  masked to -inf after the generator.
- ``PointerGenerator``: See et al. (2017) as atulkum/pointer_summarizer ports it: a BiLSTM
  encoder, an LSTM decoder stepped one token at a time with Bahdanau attention and a coverage
  feature, scheduled sampling (the previous argmax fed back with probability ``ss_prob``), the
  loss ``-log(gold_prob) + cov_wt * sum(min(attn, coverage))``.

The data are a synthetic copy task: articles of word ids, some beyond the vocabulary (OOV words
the pointer copies through the extended vocabulary), and summaries picked from their article.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

PAD, UNK, BOS, EOS = 0, 1, 2, 3
VOCAB, WORDS = 40, 56          # word ids >= VOCAB are OOV: UNK in src, copied by the pointer
D_MODEL, HID = 32, 24


# ---------------------------------------------------------------------------------------------
# data: a dataset of (article, summary) word lists and the padding collate_fns


def corpus(n: int, seed: int = 0, empty_article=(), empty_summary=()) -> list:
    g = torch.Generator().manual_seed(seed)
    data = []
    for i in range(n):
        art = torch.randint(4, WORDS, (int(torch.randint(5, 12, (1,), generator=g)),),
                            generator=g).tolist()
        keep = torch.randperm(len(art), generator=g)[: max(2, len(art) // 3)].sort().values
        summ = [art[j] for j in keep.tolist()]
        data.append(([] if i in empty_article else art, [] if i in empty_summary else summ))
    return data


def pad(seqs: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(seqs), max(1, max(map(len, seqs)))), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def to_vocab(words):
    return [w if w < VOCAB else UNK for w in words]


def collate_seq2seq(examples, max_tgt: int = 6):
    """src, tgt_in = [BOS] + summary, tgt_out = summary + [EOS]; a summary truncated to
    ``max_tgt`` keeps no EOS (the model learns to run on), an empty one gives no tokens."""
    src, tgt_in, tgt_out = [], [], []
    for art, summ in examples:
        src.append(to_vocab(art))
        s = to_vocab(summ)
        out = (s + [EOS])[:max_tgt] if s else []
        tgt_in.append([BOS] + out[:-1])
        tgt_out.append(out)
    return pad(src), pad(tgt_in), pad(tgt_out)


def collate_pointer(examples, max_dec: int = 6, batch_oovs_for_targets: bool = False,
                    unknown: int = UNK):
    """See et al.'s batcher: per article its OOV list, the article in the extended vocabulary,
    the target's OOVs mapped into that list (else UNK). ``batch_oovs_for_targets`` is the
    planted bug: targets mapped through the batch's merged OOV list instead of their own
    article's, so a summary word gets a slot its article's attention never fills. As in
    ``collate_seq2seq``, an empty summary gives no target token. ``unknown=PAD`` is the other
    planted bug, ``word2id.get(w, 0)`` with 0 the padding id: the article's OOV words are
    padding to the attention's mask, so no copy mass reaches their slots."""
    batch_oovs = sorted({w for art, _ in examples for w in art if w >= VOCAB})
    src, src_ext, tgt_in, tgt_out, n_oov = [], [], [], [], 0
    for art, summ in examples:
        oovs = sorted({w for w in art if w >= VOCAB})
        n_oov = max(n_oov, len(oovs))
        src.append([w if w < VOCAB else unknown for w in art])
        src_ext.append([w if w < VOCAB else VOCAB + oovs.index(w) for w in art])
        table = batch_oovs if batch_oovs_for_targets else oovs
        ext = [w if w < VOCAB else VOCAB + table.index(w) if w in table else UNK for w in summ]
        tgt_in.append([BOS] + to_vocab(summ)[: max_dec - 1])
        tgt_out.append((ext + [EOS])[:max_dec] if summ else [])
    n_oov = len(batch_oovs) if batch_oovs_for_targets else n_oov
    lens = torch.tensor([len(a) for a, _ in examples])
    return pad(src), pad(src_ext), lens, pad(tgt_in), pad(tgt_out), n_oov


# ---------------------------------------------------------------------------------------------
# the Transformer models


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout: float, maxlen: int = 64):
        super().__init__()
        den = torch.exp(-torch.arange(0, d_model, 2) * math.log(10000) / d_model)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pe = torch.zeros((maxlen, d_model))
        pe[:, 0::2] = torch.sin(pos * den)
        pe[:, 1::2] = torch.cos(pos * den)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pos_embedding", pe.unsqueeze(0))

    def forward(self, emb):
        return self.dropout(emb + self.pos_embedding[:, : emb.size(1)])


class Seq2SeqTransformer(nn.Module):
    def __init__(self, layers: int = 1, dropout: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL, padding_idx=PAD)
        self.pos = PositionalEncoding(D_MODEL, dropout)
        self.transformer = nn.Transformer(D_MODEL, 2, layers, layers, 64, dropout,
                                          batch_first=True)
        self.generator = nn.Linear(D_MODEL, VOCAB)

    def embed(self, ids):
        return self.pos(self.emb(ids) * math.sqrt(D_MODEL))

    def decode(self, src, tgt_in):
        src_pad, tgt_pad = src == PAD, tgt_in == PAD
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1))
        memory = self.transformer.encoder(self.embed(src), src_key_padding_mask=src_pad)
        h = self.transformer.decoder(self.embed(tgt_in), memory, tgt_mask=tgt_mask,
                                     tgt_is_causal=True, tgt_key_padding_mask=tgt_pad,
                                     memory_key_padding_mask=src_pad)
        return h, memory, src_pad

    def forward(self, src, tgt_in):
        return self.generator(self.decode(src, tgt_in)[0])


class Seq2SeqLoss(nn.Module):
    """Label-smoothed cross-entropy over the non-pad target tokens."""

    def __init__(self, smoothing: float = 0.1):
        super().__init__()
        self.ce = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=smoothing)

    def forward(self, logits, tgt_out):
        return self.ce(logits.reshape(-1, logits.size(-1)), tgt_out.reshape(-1))


class CopyTransformer(Seq2SeqTransformer):
    """A copy attention over the memory gives the pointer distribution (its weights, so
    ``need_weights`` stays on), p_gen mixes it with the vocabulary distribution."""

    def __init__(self, layers: int = 1, dropout: float = 0.1):
        super().__init__(layers, dropout)
        self.copy_attn = nn.MultiheadAttention(D_MODEL, 1, batch_first=True)
        self.p_gen = nn.Linear(2 * D_MODEL, 1)

    def forward(self, src, src_ext, tgt_in, n_oov: int):
        h, memory, src_pad = self.decode(src, tgt_in)
        ctx, attn = self.copy_attn(h, memory, memory, key_padding_mask=src_pad)
        p_vocab = F.softmax(self.generator(h), dim=-1)
        p_gen = torch.sigmoid(self.p_gen(torch.cat([h, ctx], -1)))
        final = p_gen * p_vocab
        if n_oov > 0:
            final = torch.cat([final, final.new_zeros(*final.shape[:2], n_oov)], -1)
        index = src_ext.unsqueeze(1).expand(-1, h.size(1), -1)
        return final.scatter_add(2, index, (1 - p_gen) * attn)


def copy_nll(final, tgt_out):
    """The pointer's NLL with OpenNMT's eps, averaged over the non-pad target tokens."""
    gold = final.gather(2, tgt_out.unsqueeze(2)).squeeze(2)
    mask = (tgt_out != PAD).float()
    return (-torch.log(gold + 1e-12) * mask).sum() / mask.sum()


def smoothed_copy_nll(final, tgt_out, epsilon: float = 0.1):
    """fairseq's label_smoothed_nll_loss on the log of the copy distribution: the smoothing
    term sums log p over the whole extended vocabulary."""
    lprobs = torch.log(final)
    target = tgt_out.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    pad_mask = target.eq(PAD)
    nll_loss.masked_fill_(pad_mask, 0.0)
    smooth_loss.masked_fill_(pad_mask, 0.0)
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss.sum() + eps_i * smooth_loss.sum()
    return loss / (~pad_mask).sum()


# ---------------------------------------------------------------------------------------------
# See et al.'s pointer-generator with coverage


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.decode_proj = nn.Linear(2 * HID, 2 * HID)
        self.W_c = nn.Linear(1, 2 * HID, bias=False)
        self.v = nn.Linear(2 * HID, 1, bias=False)

    def forward(self, s_t_hat, enc_out, enc_feature, enc_padding_mask, coverage):
        b, t_k, n = enc_out.shape
        dec_fea = self.decode_proj(s_t_hat).unsqueeze(1).expand(b, t_k, n)
        att_features = enc_feature + dec_fea + self.W_c(coverage.unsqueeze(2))
        scores = self.v(torch.tanh(att_features)).squeeze(2)
        attn_dist_ = F.softmax(scores, dim=1) * enc_padding_mask
        normalization_factor = attn_dist_.sum(1, keepdim=True)
        attn_dist = attn_dist_ / normalization_factor
        c_t = torch.bmm(attn_dist.unsqueeze(1), enc_out).squeeze(1)
        return c_t, attn_dist, coverage + attn_dist


class PointerGenerator(nn.Module):
    def __init__(self, p_gen_bias: float = 0.0):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HID, padding_idx=PAD)
        self.encoder = nn.LSTM(HID, HID, batch_first=True, bidirectional=True)
        self.W_h = nn.Linear(2 * HID, 2 * HID, bias=False)
        self.reduce_h = nn.Linear(2 * HID, HID)
        self.reduce_c = nn.Linear(2 * HID, HID)
        self.x_context = nn.Linear(2 * HID + HID, HID)
        self.decoder = nn.LSTMCell(HID, HID)
        self.attention = Attention()
        self.p_gen_linear = nn.Linear(2 * HID + 2 * HID + HID, 1)
        nn.init.constant_(self.p_gen_linear.bias, p_gen_bias)
        self.out1 = nn.Linear(3 * HID, HID)
        self.out2 = nn.Linear(HID, VOCAB)

    def encode(self, src, lens):
        packed = pack_padded_sequence(self.embedding(src), lens, batch_first=True,
                                      enforce_sorted=False)
        out, (h, c) = self.encoder(packed)
        enc_out, _ = pad_packed_sequence(out, batch_first=True, total_length=src.size(1))
        h = F.relu(self.reduce_h(torch.cat([h[0], h[1]], -1)))
        c = F.relu(self.reduce_c(torch.cat([c[0], c[1]], -1)))
        return enc_out, self.W_h(enc_out), (h, c)

    def step(self, y, state, c_t, enc, coverage, src_ext, n_oov):
        enc_out, enc_feature, mask = enc
        x = self.x_context(torch.cat([c_t, self.embedding(y)], 1))
        h, c = self.decoder(x, state)
        s_t_hat = torch.cat([h, c], 1)
        c_t, attn, next_cov = self.attention(s_t_hat, enc_out, enc_feature, mask, coverage)
        p_gen = torch.sigmoid(self.p_gen_linear(torch.cat([c_t, s_t_hat, x], 1)))
        vocab_dist = F.softmax(self.out2(self.out1(torch.cat([h, c_t], 1))), dim=1)
        final = p_gen * vocab_dist
        if n_oov > 0:
            final = torch.cat([final, final.new_zeros(final.size(0), n_oov)], 1)
        final = final.scatter_add(1, src_ext, (1 - p_gen) * attn)
        return final, (h, c), c_t, attn, next_cov

    def forward(self, src, src_ext, lens, tgt_in, n_oov: int, ss_prob: float = 0.0):
        enc_out, enc_feature, state = self.encode(src, lens)
        enc = (enc_out, enc_feature, (src != PAD).float())
        c_t = enc_out.new_zeros(src.size(0), 2 * HID)
        coverage = enc_out.new_zeros(src.shape)
        finals, attns, covs = [], [], []
        y = tgt_in[:, 0]
        for t in range(tgt_in.size(1)):
            if t > 0:       # scheduled sampling: feed back the argmax with probability ss_prob
                pred = finals[-1].argmax(1).detach()
                pred = pred.masked_fill(pred >= VOCAB, UNK)
                y = torch.where(torch.rand(pred.shape) < ss_prob, pred, tgt_in[:, t])
            covs.append(coverage)
            final, state, c_t, attn, coverage = self.step(y, state, c_t, enc, coverage,
                                                          src_ext, n_oov)
            finals.append(final)
            attns.append(attn)
        return torch.stack(finals, 1), torch.stack(attns, 1), torch.stack(covs, 1)


def pointer_loss(out, tgt_out, cov_wt: float = 1.0):
    """See et al.'s loss: ``-log(gold_probs)`` (their code has no eps) plus the coverage loss,
    masked to the target's tokens and averaged per summary, then over the batch."""
    finals, attns, covs = out
    gold_probs = finals.gather(2, tgt_out.unsqueeze(2)).squeeze(2)
    step_loss = -torch.log(gold_probs)
    step_coverage_loss = torch.sum(torch.min(attns, covs), 2)
    dec_mask = (tgt_out != PAD).float()
    step_loss = (step_loss + cov_wt * step_coverage_loss) * dec_mask
    return (step_loss.sum(1) / dec_mask.sum(1)).mean()


# ---------------------------------------------------------------------------------------------
# factories


def make_seq2seq() -> Seq2SeqTransformer:
    torch.manual_seed(0)
    return Seq2SeqTransformer()


def make_copy() -> CopyTransformer:
    torch.manual_seed(0)
    return CopyTransformer()


def make_pointer() -> PointerGenerator:
    torch.manual_seed(0)
    return PointerGenerator()


def make_pointer_saturated() -> PointerGenerator:
    torch.manual_seed(0)
    return PointerGenerator(p_gen_bias=20.0)


def noam(optimizer, warmup: int = 4):
    """Warmup then inverse-sqrt decay (Vaswani et al.'s schedule)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: D_MODEL ** -0.5 * min((s + 1) ** -0.5, (s + 1) * warmup ** -1.5))


def copy_nll_of_log(final, tgt_out):
    """The NLL over the log of the whole copy distribution, picked by ``nll_loss``: the loss
    is finite (no target is an unfilled slot), the log's backward at those slots is 0 * inf."""
    lprobs = torch.log(final)  # every slot, filled or not
    return F.nll_loss(lprobs.reshape(-1, lprobs.size(-1)), tgt_out.reshape(-1),
                      ignore_index=PAD)


class ConstrainedSeq2Seq(Seq2SeqTransformer):
    """Generation restricted to the article's words and the special tokens (a copy-only
    summarizer): the other logits are masked to -inf."""

    def forward(self, src, tgt_in):
        logits = self.generator(self.decode(src, tgt_in)[0])
        allowed = torch.zeros(src.size(0), VOCAB, dtype=torch.bool)
        allowed[:, :4] = True
        allowed.scatter_(1, src, True)
        return logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))


def make_constrained() -> ConstrainedSeq2Seq:
    torch.manual_seed(0)
    return ConstrainedSeq2Seq()
