"""PyTorch's word_language_model example, RNN_RELU variant: one ``nn.Dropout`` applied twice in
forward (after the encoder and after the RNN), the hidden state carried across batches."""

from __future__ import annotations

import torch
from torch import nn

NTOKEN, NHID = 50, 16


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(NTOKEN, 8)
        self.rnn = nn.RNN(8, NHID, 1, nonlinearity="relu")
        self.decoder = nn.Linear(NHID, NTOKEN)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        return nn.functional.log_softmax(self.decoder(output).view(-1, NTOKEN), dim=1), hidden


def make_model() -> RNNModel:
    torch.manual_seed(0)
    return RNNModel()
