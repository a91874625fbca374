"""Where a batch holds its samples (``recorder.samples``): the batch size from the sizes a
step's tensors share, dim 1 for models that take sequences first, none for a weight."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from recorder.samples import Samples, infer, seq_first


@pytest.mark.parametrize("model, expected", [
    (nn.Sequential(nn.Linear(4, 4)), False),
    (nn.LSTM(4, 8), True),
    (nn.LSTM(4, 8, batch_first=True), False),
    (nn.GRU(4, 8), True),
    (nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2), 1, enable_nested_tensor=False),
     True),
    (nn.TransformerEncoderLayer(8, 2, batch_first=True), False),
    (nn.MultiheadAttention(8, 2), True),
    (None, False),
])
def test_models_that_take_sequences_first(model, expected):
    assert seq_first(model) is expected


@pytest.mark.parametrize("inputs, others, first, size", [
    ([(32, 3, 28, 28)], [(32,)], False, 32),  # images and labels
    ([(8, 16)], [(8, 16)], False, 8),  # a batch-first regression: tie, dim 0
    ([(7, 5, 4)], [(5,), (5, 3)], True, 5),  # nn.LSTM's layout, targets and logits agree
    ([(7, 5, 4)], [(5,)], False, 5),  # the same, told by the targets alone
    ([(12, 4)], [(48,)], True, 4),  # a sequence-first LM, flattened targets: tie, dim 1
    ([(12, 4)], [(48,)], False, 12),  # ...the same ids in a batch-first model: dim 0
    ([(1, 6)], [(1,)], False, 1),  # a batch of one
    ([(8, 12, 4), (12, 12)], [(8, 12, 1)], False, 8),  # a causal mask (T, T) beside (B, T, F)
    ([(8, 12, 4), (12, 12)], [(8, 12, 1), (8, 12, 1)], False, 8),  # ...and targets
    ([(10, 8, 4), (10, 10), (8, 10)], [(10, 8, 4)], True, 8),  # sequence-first, mask, padding
    # nn.Transformer's own layout, source and target of one length: ids, masks, padding masks
    ([(10, 8), (10, 8), (10, 10), (10, 10), (8, 10), (8, 10)], [(10, 8, 50), (80,)], True, 8),
    ([(64,), (16,)], [(16, 4), (16,)], False, 16),  # EmbeddingBag: 64 ids in 16 bags
    ([], [], False, 0),  # nothing to go by
])
def test_the_batch_size_is_the_size_most_tensors_share(inputs, others, first, size):
    s = infer([torch.zeros(x) for x in inputs], [torch.zeros(x) for x in others], first)
    assert (s.size, s.seq_first) == (size, first)


def test_samples_are_dim_1_of_a_sequence_first_tensor_and_none_of_a_weight():
    s = Samples(5, seq_first=True)
    x = torch.zeros(7, 5, 4)
    x[:, 3] = math.nan
    assert s.dim(x) == 1 and s.rows(x) == [3]
    logits = torch.zeros(5, 3)
    logits[1, 0] = math.inf
    assert s.dim(logits) == 0 and s.rows(logits) == [1]
    assert s.dim(torch.zeros(16, 4)) is None  # a weight: no dim of the batch's size
    assert s.rows(torch.full((16, 4), math.nan)) == []
    assert Samples(8).dim(torch.zeros(4, 8)) is None  # batch first: dim 0 or nothing
    assert Samples(8).rows(torch.full((4, 8), math.nan)) == []
    assert Samples(0).rows(torch.full((3, 2), math.nan)) == [0, 1, 2]  # unknown: dim 0
