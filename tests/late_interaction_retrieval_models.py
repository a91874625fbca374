"""Neural retrieval with late interaction and dual encoders, as ColBERT, DPR / sentence-
transformers and SPLADE write it in torch, for ``test_late_interaction_retrieval``.

A tiny BERT (token + position embeddings, one ``nn.TransformerEncoderLayer`` with a key
padding mask) encodes word-level token ids: 0 ``[PAD]``, 1 ``[CLS]``, 2 ``[SEP]``, 3 ``[MASK]``,
4 ``[Q]``, 5 ``[D]``, 6..11 punctuation (ColBERT's skiplist), 12.. words. A batch is ``B``
queries and ``2B`` passages: each query's positive, then one BM25 hard negative per query;
query ``i``'s label is passage ``i`` (in-batch negatives plus hard negatives).

- ``ColBERT``: queries padded with ``[MASK]`` to ``QLEN`` (query augmentation, attended to);
  a bias-free linear projection, ``F.normalize``; passage tokens outside the content mask
  (padding, markers, punctuation) zeroed and, in MaxSim, filled with ``-inf`` before the max
  over passage tokens; the max summed over query tokens. ``colbert_loss``: cross-entropy of
  the scores over a temperature.
- ``DenseRetriever``: DPR's two encoders (query and passage), sentence-transformers' mean
  pooling over content tokens (``sum / clamp(count, 1e-9)``), L2-normalised by hand
  (``x / x.norm()``: the bug; ``eps=True`` uses ``F.normalize``).
- ``distill_loss``: a cross-encoder teacher's scores (given with the batch) distilled into the
  student's score distribution by KL, written out by hand (``p * (log p - log q)``: the bug
  when the teacher's softmax underflows to an exact 0) or with ``F.kl_div``.
- ``Splade``: the MLM head's ``log(1 + relu(logits))`` max-pooled over tokens into term
  weights, dot-product scores, the FLOPS regulariser (sum of squared mean weights), under
  bfloat16 autocast; ``make_splade_mlm``: BERT's vocabulary and a pretrained MLM head's
  logit scale, whose dense term weights overflow the scores' matmul under float16 autocast.
- ``kl_distill_loss``: the teacher's log-distribution given to ``F.kl_div`` with
  ``log_target=True``, -inf where it scored no passage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PAD, CLS, SEP, MASK, QTOK, DTOK = 0, 1, 2, 3, 4, 5
SKIPLIST = list(range(6, 12))  # punctuation
VOCAB, HIDDEN, DIM = 64, 32, 16
QLEN, DLEN = 8, 12


class TinyBert(nn.Module):
    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, max_len: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, hidden)
        self.layer = nn.TransformerEncoderLayer(hidden, 2, 2 * hidden, dropout=0.0,
                                                batch_first=True)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, ids, attention_mask):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.norm(self.layer(x, src_key_padding_mask=~attention_mask))


def content_mask(ids, skip):
    """Tokens that carry content: no padding, no marker, no punctuation (ColBERT's skiplist)."""
    return (ids > DTOK) & ~torch.isin(ids, skip)


class ColBERT(nn.Module):
    def __init__(self, additive: bool = False):
        super().__init__()
        self.additive = additive
        self.bert = TinyBert()
        self.linear = nn.Linear(HIDDEN, DIM, bias=False)
        self.register_buffer("skip", torch.tensor(SKIPLIST), persistent=False)

    def query(self, q_ids):
        q = self.linear(self.bert(q_ids, q_ids != PAD))  # [MASK]s are attended to
        return F.normalize(q, p=2, dim=2)

    def doc(self, d_ids):
        mask = content_mask(d_ids, self.skip)
        d = self.linear(self.bert(d_ids, d_ids != PAD)) * mask[..., None]
        return F.normalize(d, p=2, dim=2), mask

    def forward(self, q_ids, d_ids):
        q, (d, mask) = self.query(q_ids), self.doc(d_ids)
        sim = torch.einsum("qih,djh->qdij", q, d)  # every query token with every passage token
        if self.additive:  # the bug: an additive mask of -inf is 0 * -inf = nan where kept
            sim = sim + (1.0 - mask.float())[None, :, None, :] * float("-inf")
        else:
            sim = sim.masked_fill(~mask[None, :, None, :], float("-inf"))
        return sim.max(-1).values.sum(-1)  # MaxSim: (queries, passages)


def colbert_loss(scores, labels, temperature: float = 1.0):
    return F.cross_entropy(scores / temperature, labels)


class DenseRetriever(nn.Module):
    def __init__(self, eps: bool | str = False):
        super().__init__()
        self.q_encoder, self.d_encoder = TinyBert(), TinyBert()
        self.register_buffer("skip", torch.tensor(SKIPLIST), persistent=False)
        self.eps = eps

    def embed(self, encoder, ids):
        h = encoder(ids, ids != PAD)
        mask = content_mask(ids, self.skip)[..., None].float()
        pooled = (h * mask).sum(1) / torch.clamp(mask.sum(1), min=1e-9)
        if self.eps == "outside":  # the bug: finite forward, sqrt's slope at 0 in backward
            return pooled / (pooled.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6)
        if self.eps:
            return F.normalize(pooled, p=2, dim=-1)
        return pooled / pooled.norm(dim=-1, keepdim=True)  # the bug: 0/0 for a blank passage

    def forward(self, q_ids, d_ids):
        q, d = self.embed(self.q_encoder, q_ids), self.embed(self.d_encoder, d_ids)
        return q @ d.T


def contrastive_loss(scores, labels, temperature: float = 0.05):
    return F.cross_entropy(scores / temperature, labels)


def distill_loss(scores, labels, teacher_scores, teacher_temperature: float = 0.05,
                 stable: bool = False):
    """Cross-entropy to the labels plus KL(teacher || student) over each query's passages;
    the teacher's distribution sharpened by its temperature."""
    log_q = F.log_softmax(scores, dim=-1)
    p = torch.softmax(teacher_scores / teacher_temperature, dim=-1)
    if stable:
        kl = F.kl_div(log_q, p, reduction="batchmean")
    else:
        kl = (p * (p.log() - log_q)).sum(-1).mean()  # the bug: 0 * -inf where p underflows
    return F.nll_loss(log_q, labels) + kl


def kl_distill_loss(scores, labels, teacher_scores, teacher_temperature: float = 0.05):
    """The teacher's distribution handed to ``F.kl_div`` in log space (``log_target=True``):
    a passage the teacher did not score is -inf there, and kl_div's ``exp(t) * (t - s)`` is
    ``0 * -inf`` for it."""
    log_q = F.log_softmax(scores, dim=-1)
    log_p = F.log_softmax(teacher_scores / teacher_temperature, dim=-1)
    kl = F.kl_div(log_q, log_p, reduction="batchmean", log_target=True)
    return F.nll_loss(log_q, labels) + kl


def stable_distill_loss(scores, labels, teacher_scores):
    return distill_loss(scores, labels, teacher_scores, stable=True)


class Splade(nn.Module):
    def __init__(self, vocab: int = VOCAB):
        super().__init__()
        self.bert = TinyBert()
        self.transform = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN))
        self.decoder = nn.Linear(HIDDEN, vocab)  # the MLM head's vocabulary logits

    def encode(self, ids):
        am = ids != PAD
        logits = self.decoder(self.transform(self.bert(ids, am)))
        w = torch.log(1 + torch.relu(logits)) * am[..., None]
        return w.max(1).values  # (batch, vocab) term weights

    def forward(self, q_ids, d_ids):
        q, d = self.encode(q_ids), self.encode(d_ids)
        return q @ d.T, q, d


def splade_loss(scores, q, d, labels, lambda_q: float = 3e-4, lambda_d: float = 1e-4):
    flops = lambda_q * (q.mean(0) ** 2).sum() + lambda_d * (d.mean(0) ** 2).sum()
    return F.cross_entropy(scores.float(), labels) + flops


def make_colbert() -> ColBERT:
    torch.manual_seed(0)
    return ColBERT()


def make_colbert_additive() -> ColBERT:
    torch.manual_seed(0)
    return ColBERT(additive=True)


def make_dense() -> DenseRetriever:
    torch.manual_seed(0)
    return DenseRetriever()


def make_dense_eps_outside() -> DenseRetriever:
    torch.manual_seed(0)
    return DenseRetriever(eps="outside")


def make_dense_eps() -> DenseRetriever:
    torch.manual_seed(0)
    return DenseRetriever(eps=True)


def make_splade() -> Splade:
    torch.manual_seed(0)
    return Splade()


def make_splade_mlm() -> Splade:
    """BERT's vocabulary (30522 terms) and an MLM head's logits of a pretrained scale (about
    8 at the start of fine-tuning): every term weight about log(9), dense, as SPLADE starts
    before the FLOPS regulariser sparsifies it."""
    torch.manual_seed(0)
    model = Splade(vocab=30522)
    with torch.no_grad():
        model.decoder.bias.fill_(8.0)
    return model


def batch(g: torch.Generator, n: int = 4, blank: int | None = None, blank_kind: str = "punct",
          teacher_scale: float = 1.0, unscored: tuple[int, int] | None = None):
    """(query ids, passage ids, labels, teacher scores) of ``n`` queries: query ``i``'s
    positive shares its words, its hard negative shares half of them. ``blank``: passage row
    whose text is blank after cleaning (``"punct"``: only punctuation left, ``"empty"``: only
    ``[CLS] [D] [SEP]``). The teacher's scores: a cross-encoder's logits, ``teacher_scale``
    times their usual spread; ``unscored``: a (query, passage) pair it did not score, -inf."""
    words = torch.randint(12, VOCAB, (n, QLEN - 3), generator=g)
    q = torch.full((n, QLEN), MASK)
    q[:, 0], q[:, 1], q[:, 2:QLEN - 1] = CLS, QTOK, words
    q[:, QLEN - 1] = SEP
    d = torch.full((2 * n, DLEN), PAD)
    d[:, 0], d[:, 1] = CLS, DTOK
    lens = torch.randint(5, DLEN - 2, (2 * n,), generator=g)
    for j in range(2 * n):
        body = torch.randint(12, VOCAB, (int(lens[j]),), generator=g)
        k = (QLEN - 3) if j < n else (QLEN - 3) // 2
        body[:k] = words[j % n, :k]
        if blank == j:
            body = (torch.tensor(SKIPLIST[:3]) if blank_kind == "punct"
                    else body[:0])
        d[j, 2:2 + len(body)] = body
        d[j, 2 + len(body)] = SEP
    teacher = 0.3 * torch.randn(n, 2 * n, generator=g)
    teacher[torch.arange(n), torch.arange(n)] += 1.5
    teacher = teacher * teacher_scale
    if unscored is not None:  # a (query, passage) pair the cross-encoder did not score
        teacher[unscored] = float("-inf")
    return q, d, torch.arange(n), teacher
