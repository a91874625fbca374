"""A char-RNN as Karpathy's min-char-rnn successors write it: a batch-first ``nn.LSTM`` whose
``(h, c)`` is passed in and returned, carried from one truncated-BPTT chunk to the next."""

from __future__ import annotations

import torch
from torch import nn

V, HID = 12, 16


class CharLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.lstm = nn.LSTM(8, HID, num_layers=2, batch_first=True)
        self.head = nn.Linear(HID, V)

    def forward(self, x, hc):
        out, hc = self.lstm(self.emb(x), hc)
        return self.head(out), hc


def make_char_lstm() -> CharLSTM:
    torch.manual_seed(0)
    return CharLSTM()


class ChunkLoss(nn.Module):
    def forward(self, out, y):
        return nn.functional.cross_entropy(out[0].reshape(-1, V), y.reshape(-1))
