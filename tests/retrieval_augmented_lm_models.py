"""Retrieval-augmented language models as kNN-LM (Khandelwal et al.), RETRO and REALM / Atlas
code writes them: a tiny causal transformer LM whose next-token distribution is interpolated
with a kNN distribution over a datastore of (key, next-token) pairs (distances by
``-2 q.k + |k|^2 + |q|^2``, ``softmax(-d / T)``, ``scatter_add`` of the neighbours'
probabilities into the vocabulary), and a retriever trained by marginal likelihood over a
padded set of retrieved chunks (``logsumexp`` of ``log p(doc | q) + log p(y | doc, q)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, CTX, STORE, K = 24, 32, 8, 64, 4


class TinyLM(nn.Module):
    """A causal transformer LM; ``hidden`` returns the last layer's states (kNN-LM's keys)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(CTX, DIM) * 0.02)
        layer = nn.TransformerEncoderLayer(DIM, 4, 64, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.embed(ids) + self.pos[:t]
        return self.norm(self.blocks(h, mask=causal, is_causal=True))


class KNNLM(nn.Module):
    """kNN-LM: ``log(lam * p_knn + (1 - lam) * p_lm)`` at every position. The datastore
    (``keys``, ``vals``) is a buffer filled from the LM's own hidden states (``build``);
    ``sqrt_dist`` takes the L2 distance rather than its square (faiss IndexFlatL2 returns the
    square; hand-written code often takes the root); ``diff_dist`` sums the squared differences
    ``(q - k)^2`` instead of expanding them (exactly 0 for a query equal to its key)."""

    def __init__(self, lam: float = 0.25, temp: float = 1.0, sqrt_dist: bool = False,
                 logsumexp: bool = False, diff_dist: bool = False):
        super().__init__()
        self.lm = TinyLM()
        self.lam, self.temp, self.sqrt_dist, self.logsumexp = lam, temp, sqrt_dist, logsumexp
        self.diff_dist = diff_dist
        self.register_buffer("keys", torch.zeros(STORE, DIM))
        self.register_buffer("vals", torch.zeros(STORE, dtype=torch.long))

    @torch.no_grad()
    def build(self, ids: torch.Tensor) -> None:
        """Keys: the hidden state before each position; values: the token that followed."""
        h = self.lm.hidden(ids[:, :-1]).reshape(-1, DIM)
        self.keys.copy_(h[:STORE])
        self.vals.copy_(ids[:, 1:].reshape(-1)[:STORE])

    def knn_logprobs(self, q: torch.Tensor) -> torch.Tensor:
        if self.diff_dist:  # squared L2 to every key, >= 0 and 0 only where q == k
            d = (q[..., None, :] - self.keys).pow(2).sum(-1)
        else:  # squared L2 to every key; its rounding depends on the CPU's kernels
            d = (q.pow(2).sum(-1, keepdim=True) - 2 * q @ self.keys.t()
                 + self.keys.pow(2).sum(-1))
        top, idx = d.topk(K, dim=-1, largest=False)  # faiss IndexFlatL2's search
        if self.sqrt_dist:
            top = top.sqrt()  # a query equal to its key: |q|^2 - 2 q.k + |k|^2 rounds below 0
        w = F.softmax(-top / self.temp, dim=-1)
        p = torch.zeros(*q.shape[:-1], VOCAB).scatter_add(-1, self.vals[idx], w)
        return p

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.lm.hidden(ids)
        lm_logp = F.log_softmax(self.lm.head(h), dim=-1)
        p_knn = self.knn_logprobs(h.detach())  # the datastore is not trained through
        if self.logsumexp:
            stacked = torch.stack([p_knn.log() + torch.log(torch.tensor(self.lam)),
                                   lm_logp + torch.log(torch.tensor(1 - self.lam))])
            return torch.logsumexp(stacked, dim=0)
        return torch.log(self.lam * p_knn + (1 - self.lam) * lm_logp.exp())


def make_knnlm() -> nn.Module:
    torch.manual_seed(0)
    return KNNLM()


def make_knnlm_only() -> nn.Module:
    """``lam = 1``: the kNN distribution alone (an ablation's setting)."""
    torch.manual_seed(0)
    return KNNLM(lam=1.0)


def make_knnlm_sqrt() -> nn.Module:
    torch.manual_seed(0)
    return KNNLM(sqrt_dist=True)


def make_knnlm_lse() -> nn.Module:
    torch.manual_seed(0)
    return KNNLM(logsumexp=True)


def make_knnlm_lse_only() -> nn.Module:
    """``lam = 1`` with the logsumexp form: ``log(1 - lam)`` is -inf, meant to drop the LM."""
    torch.manual_seed(0)
    return KNNLM(lam=1.0, logsumexp=True)


def make_knnlm_cold() -> nn.Module:
    """kNN temperature 0 (a config's ``knn_temp: 0`` meant as "hard nearest neighbour"), with
    the distances summed from ``(q - k)^2``: a query equal to its key is exactly 0 on every CPU
    (the expanded ``|q|^2 - 2 q.k + |k|^2`` is 0, or +-3.8e-06, depending on the kernels)."""
    torch.manual_seed(0)
    return KNNLM(temp=0.0, diff_dist=True)


def lm_loss(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token NLL of the interpolated log-probabilities."""
    return F.nll_loss(logp[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class Retriever(nn.Module):
    """REALM / Atlas: a query encoder and a document encoder (mean-pooled embeddings), a reader
    scoring the target given each retrieved chunk; the loss is the marginal likelihood over the
    chunks, ``chunk_mask`` padding a variable number of them (RETRO's missing neighbours)."""

    def __init__(self, guard_empty: bool = False):
        super().__init__()
        self.guard_empty = guard_empty
        self.q_enc = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM))
        self.d_enc = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM))
        self.reader = nn.Bilinear(DIM, DIM, VOCAB)

    def forward(self, q_ids, doc_ids, chunk_mask):
        q = self.q_enc(q_ids).mean(1)  # (B, D)
        d = self.d_enc(doc_ids).mean(2)  # (B, N, D)
        scores = torch.einsum("bd,bnd->bn", q, d) / DIM ** 0.5
        scores = scores.masked_fill(~chunk_mask, float("-inf"))
        log_p_doc = F.log_softmax(scores, dim=-1)  # (B, N): p(doc | q)
        if self.guard_empty:  # a query that retrieved nothing: no document, not NaN
            log_p_doc = torch.where(chunk_mask, log_p_doc, float("-inf"))
        reader = self.reader(q[:, None].expand_as(d).contiguous(), d)
        return log_p_doc, F.log_softmax(reader, dim=-1)  # (B, N, V): p(y | doc, q)


def make_retriever() -> nn.Module:
    torch.manual_seed(0)
    return Retriever()


def make_guarded_retriever() -> nn.Module:
    torch.manual_seed(0)
    return Retriever(guard_empty=True)


def marginal_nll(log_p_doc, log_p_y, target):
    """-log sum_doc p(doc | q) p(y | doc, q), over the retrieved chunks; a query with none
    (every term -inf) is left out of the mean."""
    ll = log_p_y.gather(-1, target[:, None, None].expand(-1, log_p_y.shape[1], 1))[..., 0]
    lse = torch.logsumexp(log_p_doc + ll, dim=-1)
    found = lse.isfinite()
    return -torch.where(found, lse, 0.0).sum() / found.sum().clamp_min(1)


NDOC = 16


class BankRetriever(nn.Module):
    """A dense retriever scoring queries against a bank of EMA-refreshed document embeddings
    (a buffer: REALM's stale index, a memory bank) with cosine similarity over every document;
    the bank starts at 0 and a document's row is written the first time a batch holds it."""

    def __init__(self, momentum: float = 0.9):
        super().__init__()
        self.q_enc = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM))
        self.d_enc = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM))
        self.momentum = momentum
        self.register_buffer("bank", torch.zeros(NDOC, DIM))

    def forward(self, q_ids, doc_ids):
        q = self.q_enc(q_ids).mean(1)
        d = self.d_enc(doc_ids).mean(1)  # the batch's positive documents
        q = q / q.norm(dim=-1, keepdim=True)
        bank = self.bank / self.bank.norm(dim=-1, keepdim=True)  # 0/0 for an unseen doc
        return q @ bank.t() / 0.05, d

    @torch.no_grad()
    def refresh(self, doc_idx, d):
        self.bank[doc_idx] = self.momentum * self.bank[doc_idx] + (1 - self.momentum) * d


def make_bank_retriever() -> nn.Module:
    torch.manual_seed(0)
    return BankRetriever()


def bank_loss(scores, d, doc_idx):
    return F.cross_entropy(scores, doc_idx)


class L2Retriever(nn.Module):
    """A Siamese dense retriever (one encoder for queries and documents) scoring by negative
    L2 distance, trained with in-batch negatives (document i is query i's positive)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM))

    def forward(self, q_ids, doc_ids):
        q, d = self.enc(q_ids).mean(1), self.enc(doc_ids).mean(1)
        dist = (q[:, None] - d[None]).pow(2).sum(-1).sqrt()  # (B, B); 0 for a query = its doc
        return -dist / 0.1


def make_l2_retriever() -> nn.Module:
    torch.manual_seed(0)
    return L2Retriever()


def in_batch_loss(scores):
    return F.cross_entropy(scores, torch.arange(len(scores)))
