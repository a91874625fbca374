"""A Hugging Face-style classifier for ``test_hf_trainer_accumulation``: it computes its own
loss from ``labels=`` and returns a ``SequenceClassifierOutput``, as transformers' models do,
with its rows L2-normalised without an eps (an all-zero record is 0/0); and its data, rows
of features with class labels, some planted."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D, C = 8, 3


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig()  # (the Trainer reads config.problem_type)
        self.proj = nn.Linear(D, 16)
        self.head = nn.Linear(16, C)

    def forward(self, x, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        x = x / x.norm(dim=-1, keepdim=True)  # the bug: no eps, 0/0 for an all-zero record
        logits = self.head(torch.tanh(self.proj(x)))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def make_scorer():
    """The factory ``nanreplay`` rebuilds the recorded model with."""
    torch.manual_seed(0)
    return Scorer()


class Rows(torch.utils.data.Dataset):
    """``n`` random records with a class label each; those in ``zero`` all zeros, and
    ``labels`` (index -> class) set by hand."""

    def __init__(self, n: int, seed: int = 0, zero=(), labels=None):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, D, generator=g)
        self.y = torch.randint(0, C, (n,), generator=g)
        self.x[list(zero)] = 0.0
        for i, c in (labels or {}).items():
            self.y[i] = c

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class BagClassifier(nn.Module):
    """A text classifier over an ``EmbeddingBag`` (flat token ids, each text's offset, a
    weight per token) computing its own loss from ``labels=``, as a Hugging Face head does."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.head = nn.Linear(8, 2)

    def forward(self, text, offsets, per_sample_weights=None, labels=None):
        logits = self.head(self.emb(text, offsets, per_sample_weights=per_sample_weights))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def make_bag_classifier():
    torch.manual_seed(0)
    return BagClassifier()
