"""Small models built on torch.nn layers the other tests barely use (tests/test_rare_layers.py),
importable as the replay's factories: ``nn.Unfold``/``nn.Fold``, ``nn.EmbeddingBag`` with
``per_sample_weights``, ``nn.RNN(nonlinearity="relu")`` over packed sequences, ``nn.LSTM(proj_size=)``,
``nn.LocalResponseNorm``, ``nn.Bilinear``. Lines a planted bug reaches are marked ``# BUG <name>``
so the tests find them by text.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

VOCAB, C = 20, 3  # bag-of-words vocabulary, classes
PATCH, STRIDE = 3, 2  # the autoencoder's overlapping patches


class PatchAutoencoder(nn.Module):
    """Overlapping ``PATCH``x``PATCH`` patches (stride ``STRIDE``) of a ``(B, 1, H, W)`` image,
    each coded and decoded by a linear bottleneck, folded back and averaged over the patches
    covering each pixel: the overlap count is ``fold(unfold(ones))``."""

    def __init__(self):
        super().__init__()
        self.code = nn.Linear(PATCH * PATCH, 4)
        self.decode = nn.Linear(4, PATCH * PATCH)

    def forward(self, x):
        size = x.shape[-2:]
        unfold = nn.Unfold(PATCH, stride=STRIDE)
        fold = nn.Fold(size, PATCH, stride=STRIDE)
        patches = unfold(x).transpose(1, 2)  # (B, L, PATCH*PATCH)
        recon = self.decode(torch.relu(self.code(patches))).transpose(1, 2)
        counts = fold(unfold(torch.ones_like(x)))
        return fold(recon) / counts  # BUG uncovered: a pixel no patch covers is 0 / 0


def make_patch_autoencoder():
    return PatchAutoencoder()


class BagOfWords(nn.Module):
    """A tf-idf weighted mean of word vectors per document (``EmbeddingBag`` summing the
    weighted rows, divided by the document's total weight), then a linear classifier."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 8, mode="sum")
        self.head = nn.Linear(8, C)

    def forward(self, ids, offsets, weights):
        summed = self.bag(ids, offsets, per_sample_weights=weights)
        lengths = torch.diff(offsets, append=offsets.new_tensor([ids.numel()]))
        doc = torch.repeat_interleave(torch.arange(len(offsets)), lengths)
        total = torch.zeros(len(offsets)).index_add_(0, doc, weights)
        return self.head(summed / total[:, None])  # BUG empty_doc: an empty bag is 0 / 0


def make_bag_of_words():
    return BagOfWords()


class BagMax(nn.Module):
    """``EmbeddingBag(mode="max")`` over documents, some of them empty bags (torch gives
    those 0): ``(ids, offsets)`` -> logits."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 8, mode="max")
        self.head = nn.Linear(8, C)

    def forward(self, ids, offsets, weights):
        return self.head(self.bag(ids, offsets))


def make_bag_max():
    return BagMax()


class IRNN(nn.Module):
    """Le et al.'s IRNN: a ReLU RNN whose recurrent weights start as a scaled identity, over
    packed variable-length sequences; the last real step's state classifies."""

    def __init__(self, gain: float = 1.5):
        super().__init__()
        self.rnn = nn.RNN(2, 8, nonlinearity="relu", batch_first=True)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(gain * torch.eye(8))  # BUG long_sequence: gain > 1
            self.rnn.bias_hh_l0.zero_()
        self.head = nn.Linear(8, C)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, h = self.rnn(packed)
        return self.head(h[-1])


def make_irnn():
    return IRNN()


class CharLSTM(nn.Module):
    """A character model with a projected LSTM (``proj_size``): ids ``(B, T)`` -> next-character
    logits ``(B, T, VOCAB)``; a side channel of per-character features is added to the
    embeddings."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.lstm = nn.LSTM(8, 16, proj_size=4, batch_first=True)
        self.head = nn.Linear(4, VOCAB)

    def forward(self, ids, feats):
        out, _ = self.lstm(self.emb(ids) + feats)
        return self.head(out)


def make_char_lstm():
    return CharLSTM()


class AlexNetLike(nn.Module):
    """Conv, ReLU, AlexNet's cross-channel ``LocalResponseNorm``, pooled to a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.lrn = nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2.0)
        self.head = nn.Linear(8, C)

    def forward(self, x):
        z = self.lrn(torch.relu(self.conv(x)))
        return self.head(z.mean((2, 3)))


def make_alexnet_like():
    return AlexNetLike()


class PairScorer(nn.Module):
    """A siamese encoder and a bilinear similarity of the pair's cosine-normalised codes:
    ``(B, 2, 6)`` -> ``(B,)``."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU())
        self.sim = nn.Bilinear(8, 8, 1)

    def forward(self, pair):
        a, b = self.enc(pair[:, 0]), self.enc(pair[:, 1])
        a = a / a.norm(dim=-1, keepdim=True)  # BUG dead_code: an all-zero code is 0 / 0
        b = F.normalize(b, dim=-1)
        return self.sim(a, b).squeeze(-1)


def make_pair_scorer():
    return PairScorer()


class BagByLength(nn.Module):
    """A mean of word vectors per document written by hand: ``EmbeddingBag(mode="sum")``
    divided by the bag's length, read off the offsets."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 8, mode="sum")
        self.head = nn.Linear(8, C)

    def forward(self, ids, offsets, weights):
        lengths = torch.diff(offsets, append=offsets.new_tensor([ids.numel()]))
        return self.head(self.bag(ids, offsets) / lengths[:, None])  # BUG empty_len


def make_bag_by_length():
    return BagByLength()
