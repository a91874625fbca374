"""Models whose report named the wrong samples (found by fuzz runs).

``TinyLM``: a Hugging Face-style causal LM that computes its own
cross-entropy loss from ``labels`` (-100: ignored).
"""

import torch
import torch.nn.functional as F
from torch import nn


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
