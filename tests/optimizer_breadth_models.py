"""Models and data of ``test_optimizer_breadth.py``: a bag-of-tokens classifier whose
embedding table has rows for tokens the data never holds (a vocabulary built on a larger
corpus), importable by the replay as a factory (``optimizer_breadth_models:make_model``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEEN, DIM, LENGTH, N_CLASSES = 16, 10, 8, 6, 3


class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, 16)
        self.head = nn.Linear(16, N_CLASSES)

    def forward(self, ids):
        return self.head(torch.tanh(self.hidden(self.embed(ids).mean(1))))


def make_model() -> BagClassifier:
    torch.manual_seed(0)
    return BagClassifier()


def loader(n: int = 128, batch_size: int = 16) -> DataLoader:
    """Token ids below ``SEEN`` only (rows SEEN..VOCAB-1 of the table never get a gradient),
    the class from which third of the seen ids dominates."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SEEN, (n, LENGTH), generator=g)
    y = (ids.float().mean(1) * N_CLASSES / SEEN).long().clamp_max(N_CLASSES - 1)
    return DataLoader(TensorDataset(ids, y), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(2))


# A line regressed by L1 onto a target far above every output it reaches: the gradient's sign
# is the same at every step (an Rprop step size that only grows), its magnitude 1 at most.
LINE_IN, LINE_TARGET = 4, 1e30


def make_line() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(LINE_IN, 1)


def line_batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(n, LINE_IN), torch.full((n, 1), LINE_TARGET)
