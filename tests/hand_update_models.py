"""PyTorch's word-language-model example as it trains: an LSTM language model updated by hand
(``p.data.add_(p.grad, alpha=-lr)``, no optimizer), its hidden state carried between batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NTOKEN, NINP, NHID, NLAYERS = 50, 16, 32, 2


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(NTOKEN, NINP)
        self.rnn = nn.LSTM(NINP, NHID, NLAYERS, dropout=0.2)
        self.decoder = nn.Linear(NHID, NTOKEN)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, NTOKEN)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        w = next(self.parameters())
        return (w.new_zeros(NLAYERS, bsz, NHID), w.new_zeros(NLAYERS, bsz, NHID))


def make_lm() -> nn.Module:
    torch.manual_seed(0)
    return RNNModel()


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)
