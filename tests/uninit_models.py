"""Models for tests/test_uninitialised_memory.py, importable by the replay as factories: each
allocates a tensor with ``torch.empty`` (or ``new_empty``) and writes only part of it on some
batches, the way hand-written sequence code does."""

from __future__ import annotations

import torch
from torch import nn


class RaggedRNN(nn.Module):
    """A hand-written RNN unrolled over a padded batch into a preallocated ``torch.empty``
    output; a sequence shorter than the batch's longest leaves its tail steps unwritten, which
    the mean over time then reads."""

    def __init__(self, d_in: int = 3, hidden: int = 8, n_out: int = 2):
        super().__init__()
        self.cell = nn.Linear(d_in + hidden, hidden)
        self.head = nn.Linear(hidden, n_out)

    def forward(self, x, lengths):
        b, t_max, _ = x.shape
        h = x.new_zeros(b, self.cell.out_features)
        outs = torch.empty(b, t_max, self.cell.out_features)  # the bug: tail steps unwritten
        for t in range(t_max):
            live = lengths > t
            h_new = torch.tanh(self.cell(torch.cat([x[:, t], h], -1)))
            h = torch.where(live[:, None], h_new, h)
            outs[live, t] = h_new[live]
        return self.head(outs.mean(1))


def make_ragged_rnn() -> RaggedRNN:
    return RaggedRNN()


class PackedPool(nn.Module):
    """Sequences concatenated into one flat tensor with their lengths, padded inside the
    model into ``new_empty`` and pooled by a 0/1 mask multiplied in: NaN * 0 is NaN, so the
    padding's unwritten entries reach the mean."""

    def __init__(self, d_in: int = 4, n_out: int = 3):
        super().__init__()
        self.proj = nn.Linear(d_in, d_in)
        self.head = nn.Linear(d_in, n_out)

    def forward(self, flat, lengths):
        z = torch.relu(self.proj(flat))
        b, width = len(lengths), int(lengths.max())
        padded = z.new_empty(b, width, z.shape[-1])  # the bug: padding positions unwritten
        for i, chunk in enumerate(torch.split(z, lengths.tolist())):
            padded[i, :len(chunk)] = chunk
        mask = (torch.arange(width)[None] < lengths[:, None]).float()
        pooled = (padded * mask[..., None]).sum(1) / lengths[:, None]
        return self.head(pooled)


def make_packed_pool() -> PackedPool:
    return PackedPool()


class ScratchThenLog(nn.Module):
    """A ``torch.empty`` scratch fully written every step (harmless), and a log of a learned
    value that goes negative: the NaN is the log's, not the allocation's."""

    def __init__(self, d_in: int = 4):
        super().__init__()
        self.lin = nn.Linear(d_in, d_in)
        self.head = nn.Linear(d_in, 2)

    def forward(self, x):
        scratch = torch.empty(x.shape[0], x.shape[1])
        for j in range(x.shape[1]):
            scratch[:, j] = x[:, j] * 2
        z = self.lin(scratch)
        return self.head(torch.log(scratch[:, :1] + 10.0) + z)


def make_scratch_then_log() -> ScratchThenLog:
    return ScratchThenLog()


class ClassWeightedLoss(nn.Module):
    """Per-record class weights written class by class into ``torch.empty``: a class the
    branches miss (label 0) keeps its record's weight unwritten."""

    def forward(self, logits, y):
        ce = nn.functional.cross_entropy(logits, y, reduction="none")
        w = torch.empty(len(y))
        w[y == 1] = 2.0
        w[y == 2] = 0.5
        return (w * ce).mean()


class Bilinear(nn.Module):
    """A weight made with ``torch.empty`` and never initialised (no ``reset_parameters``)."""

    def __init__(self, d_in: int = 4):
        super().__init__()
        self.w = nn.Parameter(torch.empty(d_in, d_in))
        self.head = nn.Linear(d_in, 2)

    def forward(self, x):
        return self.head(x @ self.w)


def make_bilinear() -> Bilinear:
    return Bilinear()


class Centred(nn.Module):
    """A scratch buffer ``torch.empty(max_batch, h)`` filled per step as far as the batch
    reaches, its mean over every row taken: a first batch smaller than ``max_batch`` leaves
    rows never written."""

    def __init__(self, d_in: int = 4, hidden: int = 8, max_batch: int = 8):
        super().__init__()
        self.lin = nn.Linear(d_in, hidden)
        self.head = nn.Linear(hidden, 2)
        self.register_buffer("scratch", torch.empty(max_batch, hidden), persistent=False)

    def forward(self, x):
        h = torch.relu(self.lin(x))
        self.scratch[:len(x)] = h.detach()
        return self.head(h - self.scratch.mean(0))


def make_centred() -> Centred:
    return Centred()
