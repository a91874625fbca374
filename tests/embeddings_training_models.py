"""Word embeddings and large-vocabulary output layers, written the way their well-known public
repositories write them, with the factories of ``test_embeddings_training.py``:

- ``SGNS``: skip-gram with negative sampling as theeluwin/pytorch-sgns writes it (``model.py``:
  noise words drawn inside ``forward`` by ``torch.multinomial`` over unigram counts ** 0.75,
  the loss ``bmm(...).sigmoid().log()``);
- ``GloVe``: the weighted least squares of Pennington et al. as kefirski/pytorch_GloVe and
  noaRricky/pytorch-glove write it (``(x / x_max) ** alpha`` clamped at 1, ``log(X_ij)``);
- ``SampledSoftmax``: sampled softmax with the log-Q correction as rdspring1/PyTorch_GBW_LM's
  ``SampledSoftmax`` writes it (true and sampled logits minus ``log(q)``, cross entropy with
  the true class at 0), the sampling distribution a buffer of unigram frequencies;
- ``HierarchicalSoftmax``: word2vec's hierarchical softmax over a Huffman tree as
  weberrr/pytorch_word2vec writes it (a product of sigmoids along the path, then its log);
- ``FastText``: fastText's subword bag (facebookresearch/fastText's ``get_sentence_vector``
  averaged by hand: an ``nn.EmbeddingBag(mode="sum")`` divided by each bag's length);
- ``AdaptiveLM``: a large-vocabulary head ``nn.AdaptiveLogSoftmaxWithLoss`` with cutoffs over a
  sparse ``nn.Embedding`` (PyTorch's word_language_model with the adaptive softmax of
  Grave et al.).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, WINDOW, NEGS, BATCH = 60, 16, 2, 5, 8
MAX_CODE_LENGTH = 40  # word2vec.c's longest Huffman code


def unigram_counts(seed: int = 0) -> torch.Tensor:
    """Zipf-like counts of a small synthetic corpus; the last ten tokens never occur (0)."""
    g = torch.Generator().manual_seed(seed)
    counts = (1000.0 / torch.arange(1, VOCAB + 1)).floor() + torch.randint(0, 3, (VOCAB,),
                                                                          generator=g)
    counts[-10:] = 0
    return counts


class SGNS(nn.Module):
    """theeluwin/pytorch-sgns: ``SGNS(embedding, vocab_size, n_negs, weights)``."""

    def __init__(self, weights: torch.Tensor, n_negs: int = NEGS):
        super().__init__()
        self.ivectors = nn.Embedding(VOCAB, DIM, sparse=True)
        self.ovectors = nn.Embedding(VOCAB, DIM, sparse=True)
        nn.init.uniform_(self.ivectors.weight, -0.5 / DIM, 0.5 / DIM)
        nn.init.uniform_(self.ovectors.weight, -0.5 / DIM, 0.5 / DIM)
        wf = weights.pow(0.75)
        self.register_buffer("weights", wf / wf.sum())
        self.n_negs = n_negs

    def forward(self, iword, owords):
        batch_size, context_size = owords.shape
        nwords = torch.multinomial(self.weights, batch_size * context_size * self.n_negs,
                                   replacement=True).view(batch_size, -1)
        ivectors = self.ivectors(iword).unsqueeze(2)
        ovectors = self.ovectors(owords)
        nvectors = self.ovectors(nwords).neg()
        oloss = torch.bmm(ovectors, ivectors).squeeze(-1).sigmoid().log().mean(1)
        nloss = torch.bmm(nvectors, ivectors).squeeze(-1).sigmoid().log().view(
            -1, context_size, self.n_negs).sum(2).mean(1)
        return -(oloss + nloss).mean()


class GloVe(nn.Module):
    """kefirski/pytorch_GloVe: focal and context vectors and biases; ``forward`` takes the
    co-occurrence counts of the batch's pairs and returns the weighted squared error."""

    def __init__(self, x_max: float = 100.0, alpha: float = 0.75):
        super().__init__()
        self.wi, self.wj = nn.Embedding(VOCAB, DIM), nn.Embedding(VOCAB, DIM)
        self.bi, self.bj = nn.Embedding(VOCAB, 1), nn.Embedding(VOCAB, 1)
        for e in (self.wi, self.wj):
            nn.init.uniform_(e.weight, -0.5 / DIM, 0.5 / DIM)
        for e in (self.bi, self.bj):
            nn.init.zeros_(e.weight)
        self.x_max, self.alpha = x_max, alpha

    def forward(self, i, j, x):
        weighting = (x / self.x_max).clamp(max=1.0) ** self.alpha
        pred = (self.wi(i) * self.wj(j)).sum(1) + self.bi(i).squeeze(1) + self.bj(j).squeeze(1)
        return weighting * (pred - torch.log(x)) ** 2


class SampledSoftmax(nn.Module):
    """rdspring1/PyTorch_GBW_LM: an LSTM's hidden state scored against the true word and the
    sampled ones, each logit corrected by the log of its sampling probability."""

    def __init__(self, counts: torch.Tensor, remove_accidental_hits: bool = False):
        super().__init__()
        self.remove_accidental_hits = remove_accidental_hits
        self.embed = nn.Embedding(VOCAB, DIM)
        self.rnn = nn.LSTM(DIM, DIM, batch_first=True)
        self.params = nn.Linear(DIM, VOCAB)
        self.register_buffer("q", counts / counts.sum())

    def forward(self, ids, targets, sampled):
        h = self.rnn(self.embed(ids))[0][:, -1]
        true_w, true_b = self.params.weight[targets], self.params.bias[targets]
        true_logits = (h * true_w).sum(1) + true_b - torch.log(self.q[targets])
        sample_logits = h @ self.params.weight[sampled].t() + self.params.bias[sampled]
        sample_logits = sample_logits - torch.log(self.q[sampled])
        if self.remove_accidental_hits:  # a sampled word that is the row's true word
            hits = sampled[None, :] == targets[:, None]
            sample_logits = sample_logits.masked_fill(hits, float("-inf"))
        return torch.cat([true_logits[:, None], sample_logits], 1)


class NCE(nn.Module):
    """Stonesjtu/Pytorch-NCE's ``NCELoss`` over a bag-of-context encoder: the model's
    unnormalised probability ``exp(score - norm_term)`` of the target and of ``k`` noise words
    drawn from the unigram distribution, each told from noise by ``p / (p + k q)``."""

    def __init__(self, counts: torch.Tensor, k: int = NEGS, norm_term: float = 9.0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.out = nn.Embedding(VOCAB, DIM)
        self.bias = nn.Parameter(torch.zeros(VOCAB))
        self.register_buffer("noise", counts / counts.sum())
        self.k, self.norm_term = k, norm_term

    def forward(self, context, target):
        h = self.embed(context).mean(1)
        noise = torch.multinomial(self.noise, len(target) * self.k, replacement=True).view(
            len(target), self.k)
        words = torch.cat([target[:, None], noise], 1)
        score = (self.out(words) * h[:, None]).sum(-1) + self.bias[words]
        p_model = torch.exp(score - self.norm_term)
        p_noise = self.k * self.noise[words]
        p_true = torch.cat([p_model[:, :1] / (p_model[:, :1] + p_noise[:, :1]),
                            p_noise[:, 1:] / (p_model[:, 1:] + p_noise[:, 1:])], 1)
        return -torch.log(p_true).sum(1).mean()


class HierarchicalSoftmax(nn.Module):
    """weberrr/pytorch_word2vec: a word's probability is the product of the sigmoids of its
    Huffman path's inner nodes (``codes`` in {-1, +1}, 0 past the path's end)."""

    def __init__(self):
        super().__init__()
        self.u = nn.Embedding(VOCAB, DIM)
        self.nodes = nn.Embedding(VOCAB - 1, DIM)  # a binary tree's inner nodes
        nn.init.uniform_(self.u.weight, -0.5 / DIM, 0.5 / DIM)
        nn.init.zeros_(self.nodes.weight)

    def forward(self, center, points, codes):
        h = self.u(center).unsqueeze(1)
        score = (h * self.nodes(points)).sum(-1)
        p = torch.where(codes != 0, torch.sigmoid(codes * score), torch.ones_like(score))
        return -torch.log(torch.prod(p, dim=1)).mean()


class FastText(nn.Module):
    """A fastText classifier over subword bags: each sentence's subword vectors summed by an
    ``nn.EmbeddingBag`` and averaged by its bag's length, then a linear classifier."""

    def __init__(self, buckets: int = 200, classes: int = 4, mode: str = "sum"):
        super().__init__()
        self.bag = nn.EmbeddingBag(buckets, DIM, mode=mode, sparse=mode == "mean")
        self.fc = nn.Linear(DIM, classes)

    def forward(self, subwords, offsets, weights=None):
        if self.bag.mode == "mean":  # (an empty bag's mean is a row of 0s)
            return self.fc(self.bag(subwords, offsets))
        ends = torch.cat([offsets[1:], offsets.new_tensor([subwords.numel()])])
        lengths = (ends - offsets).float()
        if weights is not None:  # tf-idf weighted bags: normalised by their total weight
            return self.fc(self.bag(subwords, offsets, per_sample_weights=weights))
        return self.fc(self.bag(subwords, offsets) / lengths[:, None])


class AdaptiveLM(nn.Module):
    """A bag-of-context word predictor with PyTorch's adaptive softmax head (cutoffs over a
    vocabulary sorted by frequency) and a sparse input embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, sparse=True)
        self.head = nn.AdaptiveLogSoftmaxWithLoss(DIM, VOCAB, cutoffs=[10, 30], div_value=2.0)

    def forward(self, context, target):
        return self.head(self.embed(context).mean(1), target).loss


def make_sgns() -> nn.Module:
    torch.manual_seed(0)
    return SGNS(unigram_counts())


def make_glove() -> nn.Module:
    torch.manual_seed(0)
    return GloVe()


def make_sampled_softmax() -> nn.Module:
    torch.manual_seed(0)
    return SampledSoftmax(unigram_counts())


def make_sampled_softmax_without_hits() -> nn.Module:
    torch.manual_seed(0)
    return SampledSoftmax(unigram_counts(), remove_accidental_hits=True)


def make_nce() -> nn.Module:
    torch.manual_seed(0)
    return NCE(unigram_counts())


def make_hs() -> nn.Module:
    torch.manual_seed(0)
    return HierarchicalSoftmax()


def make_hs_half() -> nn.Module:
    return make_hs().half()


def huffman_paths(words: torch.Tensor, lengths: torch.Tensor, seed: int):
    """(inner nodes, codes) of the words' paths, padded to ``MAX_CODE_LENGTH``: the paths of
    a large vocabulary's tree, whose rare words sit deep (the lengths given)."""
    g = torch.Generator().manual_seed(seed)
    n = len(words)
    points = torch.randint(0, VOCAB - 1, (n, MAX_CODE_LENGTH), generator=g)
    codes = torch.randint(0, 2, (n, MAX_CODE_LENGTH), generator=g) * 2 - 1
    codes[torch.arange(MAX_CODE_LENGTH)[None, :] >= lengths[:, None]] = 0
    return points, codes


def make_fasttext() -> nn.Module:
    torch.manual_seed(0)
    return FastText()


def make_fasttext_mean() -> nn.Module:
    torch.manual_seed(0)
    return FastText(mode="mean")


def make_adaptive() -> nn.Module:
    torch.manual_seed(0)
    return AdaptiveLM()


class SkipGramPairs(torch.utils.data.Dataset):
    """(center, context window) pairs of a synthetic corpus drawn from the unigram counts."""

    def __init__(self, n: int = 256, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        counts = unigram_counts()
        corpus = torch.multinomial(counts / counts.sum(), n + 2 * WINDOW, replacement=True,
                                   generator=g)
        self.center = corpus[WINDOW:-WINDOW]
        self.context = torch.stack([corpus[k:k + n] for k in range(2 * WINDOW + 1)
                                    if k != WINDOW], 1)

    def __len__(self):
        return len(self.center)

    def __getitem__(self, k):
        return self.center[k], self.context[k]


def cross_entropy_true_first(logits):
    """The sampled softmax's loss: the true class is column 0 of every row."""
    return F.cross_entropy(logits, logits.new_zeros(len(logits), dtype=torch.long))
