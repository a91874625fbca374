"""Sentence-embedding training with sentence-transformers, written the way its users write it,
with the factories of ``test_sentence_embeddings.py``: a tiny randomly initialised BERT saved
locally (``transformers.BertConfig`` + a WordLevel tokenizer of the ``tokenizers`` library saved
as a ``PreTrainedTokenizerFast``), loaded by ``models.Transformer`` and pooled by
``models.Pooling(..., "mean")`` (or a hand-written masked mean, the model card's snippet without
its clamp), then ``models.Normalize()``; the losses are sentence-transformers' own
(``MultipleNegativesRankingLoss``, its cached GradCache form, ``CoSENTLoss``,
``CosineSimilarityLoss``, ``MatryoshkaLoss``) and four written by hand as users write them (an
InfoNCE with ``log(softmax)``, one with ``exp(sim / t) / sum``, a triplet margin over ``sqrt``
of the squared distance, an angle regression through ``acos`` of the cosine).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as models
from torch import nn
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # (the "Loading weights" bars of every load)

HIDDEN, LAYERS, HEADS, MAX_LEN = 32, 2, 2, 16
WORDS = ("the a cat dog sat on mat ran park bird sang tree car drove road sun shone sky "
         "fish swam sea man read book girl wrote letter boy kicked ball child ate apple "
         "woman sold house teacher gave lesson").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_dir(cls_sep: bool = True) -> str:
    """A tiny BERT (random weights, seed 0) and its tokenizer saved in a directory, built once
    per process the way a user makes a test model offline; ``cls_sep=False``: the tokenizer
    adds no [CLS]/[SEP], so an empty text is all padding (an attention mask of zeros)."""
    path = Path(tempfile.gettempdir()) / f"nanreplay-tiny-bert-{int(cls_sep)}"
    if (path / "model.safetensors").exists():
        return str(path)
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if cls_sep:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
            special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_max_length=MAX_LEN)
    config = BertConfig(vocab_size=len(vocab), hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
                        max_position_embeddings=MAX_LEN + 2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + "-", dir=path.parent))
    with torch.device("cpu"):  # (the replay calls a factory under torch.device("meta") first)
        torch.manual_seed(0)
        BertModel(config).save_pretrained(tmp)
    fast.save_pretrained(tmp)
    try:
        os.replace(tmp, path)  # whole, or not at all: another process may have written it
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


class MaskedMeanPooling(nn.Module):
    """The model card's ``mean_pooling`` as a sentence-transformers module, written without its
    ``torch.clamp(..., min=1e-9)``: the sum of the unmasked token embeddings over their count."""

    def __init__(self, dim: int = HIDDEN):
        super().__init__()
        self.dim = dim

    def forward(self, features: dict) -> dict:
        tokens = features["token_embeddings"]
        mask = features["attention_mask"].unsqueeze(-1).to(tokens.dtype)
        summed = (tokens * mask).sum(1)
        counts = mask.sum(1)
        features["sentence_embedding"] = summed / counts  # BUG: no clamp, 0/0 for a blank text
        return features

    def get_sentence_embedding_dimension(self) -> int:
        return self.dim


def make_model(normalize: bool = True) -> SentenceTransformer:
    """``models.Transformer`` + mean ``models.Pooling`` (+ ``models.Normalize``), on CPU."""
    word = models.Transformer(bert_dir(), max_seq_length=MAX_LEN)
    pool = models.Pooling(word.get_embedding_dimension(), "mean")
    mods = [word, pool] + ([models.Normalize()] if normalize else [])
    return SentenceTransformer(modules=mods, device="cpu")


def make_plain_model() -> SentenceTransformer:
    return make_model(normalize=False)


def make_hand_pooled_model() -> SentenceTransformer:
    """The BERT without [CLS]/[SEP] (a blank text is all padding), pooled by hand."""
    word = models.Transformer(bert_dir(cls_sep=False), max_seq_length=MAX_LEN)
    return SentenceTransformer(modules=[word, MaskedMeanPooling()], device="cpu")


def sentence(g: torch.Generator, n: int) -> str:
    idx = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
    return " ".join(WORDS[i] for i in idx)


def pairs(n: int, seed: int = 0) -> dict[str, list]:
    """(anchor, positive) pairs: the positive shares the anchor's first words; a score in [0, 1]
    the share of words in common."""
    g = torch.Generator().manual_seed(seed)
    anchors, positives, scores = [], [], []
    for _ in range(n):
        a = sentence(g, 6)
        keep = int(torch.randint(2, 6, (1,), generator=g))
        anchors.append(a)
        positives.append(" ".join(a.split()[:keep]) + " " + sentence(g, 6 - keep))
        scores.append(keep / 6)
    return {"anchor": anchors, "positive": positives, "score": scores}


def triplets(n: int, seed: int = 0) -> dict[str, list]:
    d = pairs(n, seed)
    g = torch.Generator().manual_seed(seed + 1)
    return {"anchor": d["anchor"], "positive": d["positive"],
            "negative": [sentence(g, 6) for _ in range(n)]}


def info_nce(a: torch.Tensor, p: torch.Tensor, scale: float) -> torch.Tensor:
    """An in-batch InfoNCE written by hand: the log of the softmax's diagonal."""
    scores = a @ p.T * scale
    probs = torch.softmax(scores, dim=1)
    return -torch.log(torch.diagonal(probs)).mean()  # BUG: log(softmax), not log_softmax


class HandTripletLoss(nn.Module):
    """A triplet margin loss over the Euclidean distance written as ``sqrt`` of the sum of
    squares (no eps), called on the features like sentence-transformers' losses."""

    def __init__(self, model: SentenceTransformer, margin: float = 1.0):
        super().__init__()
        self.model = model
        self.margin = margin

    def forward(self, sentence_features, labels=None) -> torch.Tensor:
        a, p, n = (self.model(f)["sentence_embedding"] for f in sentence_features)
        d_ap = torch.sqrt(((a - p) ** 2).sum(1))  # BUG: sqrt(0) has an infinite slope
        d_an = torch.sqrt(((a - n) ** 2).sum(1))
        return torch.relu(d_ap - d_an + self.margin).mean()


class InfoNCELoss(nn.Module):
    """:func:`info_nce` over (anchor, positive) features, dot-product scores times ``scale``."""

    def __init__(self, model: SentenceTransformer, scale: float = 20.0):
        super().__init__()
        self.model = model
        self.scale = scale

    def forward(self, sentence_features, labels=None) -> torch.Tensor:
        a, p = (self.model(f)["sentence_embedding"] for f in sentence_features)
        return info_nce(a, p, self.scale)


def info_nce_exp(a: torch.Tensor, p: torch.Tensor, temperature: float) -> torch.Tensor:
    """InfoNCE written as its formula: exp of the scores over the sum of their exps."""
    sim = a @ p.T / temperature
    e = torch.exp(sim)  # BUG: exp of scores up to 1 / temperature, no max subtracted
    return -torch.log(torch.diagonal(e) / e.sum(1)).mean()


class ExpInfoNCELoss(nn.Module):
    def __init__(self, model: SentenceTransformer, temperature: float = 0.05):
        super().__init__()
        self.model = model
        self.temperature = temperature

    def forward(self, sentence_features, labels=None) -> torch.Tensor:
        a, p = (self.model(f)["sentence_embedding"] for f in sentence_features)
        return info_nce_exp(a, p, self.temperature)


class AngularLoss(nn.Module):
    """A regression of the angle between the two embeddings onto the gold score (an AnglE-like
    objective written by hand): ``acos`` of their cosine, as the dot of unit vectors."""

    def __init__(self, model: SentenceTransformer):
        super().__init__()
        self.model = model

    def forward(self, sentence_features, labels) -> torch.Tensor:
        a, b = (self.model(f)["sentence_embedding"] for f in sentence_features)
        cos = (a * b).sum(-1)  # BUG: unit vectors' dot may round above 1
        angle = torch.acos(cos) / math.pi
        return ((1 - angle) - labels).pow(2).mean()


def make_half_model() -> SentenceTransformer:
    """The model loaded in float16 (``model_kwargs={"torch_dtype": torch.float16}``)."""
    word = models.Transformer(bert_dir(), max_seq_length=MAX_LEN,
                              model_kwargs={"dtype": torch.float16})
    pool = models.Pooling(word.get_embedding_dimension(), "mean")
    return SentenceTransformer(modules=[word, pool, models.Normalize()], device="cpu")
