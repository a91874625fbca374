"""Models whose report named the wrong samples (found by fuzz runs).

``Tagger``: a batch-first sequence classifier running a time-major ``nn.LSTM`` between two
transposes, with a hand-written ``autograd.Function`` after it (a gradient scaled per sample
by its weight's reciprocal, as a hand-written importance correction) whose backward divides
by a weight of 0. ``TinyLM``: a Hugging Face-style causal LM that computes its own
cross-entropy loss from ``labels`` (-100: ignored).
"""

import torch
import torch.nn.functional as F
from torch import nn


class ReweightGrad(torch.autograd.Function):
    """Identity forward; backward divides each sample's gradient by its weight."""

    @staticmethod
    def forward(ctx, h, weight):
        ctx.save_for_backward(weight)
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad / weight[:, None, None], None  # the bug: a weight of 0


class Tagger(nn.Module):
    def __init__(self, f=5, h=8, n_classes=6):
        super().__init__()
        self.stem = nn.Linear(f, h)
        self.rnn = nn.LSTM(h, h)  # time-major
        self.norm = nn.LayerNorm(h)
        self.head = nn.Linear(h, n_classes)

    def forward(self, x, weight):  # x: (B, T, F)
        h = self.rnn(torch.tanh(self.stem(x)).transpose(0, 1))[0].transpose(0, 1)
        h = ReweightGrad.apply(h, weight)
        return self.head(self.norm(h).mean(1))


def make_tagger():
    return Tagger()


class TinyLM(nn.Module):
    def __init__(self, vocab=20, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.body = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels=None):
        logits = self.lm_head(torch.tanh(self.body(self.embed(input_ids))))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        return out


def make_lm():
    return TinyLM()
