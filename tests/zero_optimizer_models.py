"""ZeRO-1 training on two ranks (tests/dist/zero_train.py, torchrun + gloo): a small bag-of-
tokens classifier under DDP whose Adam state ``ZeroRedundancyOptimizer`` shards across the ranks.

The model takes a padding mask beside the token ids (a masked mean over the real tokens), the
loss is a user-written weighted cross-entropy (``(per * w).sum() / w.sum()``, the weights coming
with the batch) inside a small loss wrapper, and the data comes from a ``DataLoader`` over a
``Dataset`` of tokens, masks, dense features, labels and weights.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB, DIM, FEATS, CLASSES, LENGTH = 12, 8, 4, 3, 5


class BagClassifier(nn.Module):
    """Token embeddings averaged over the mask, their norm and the dense features, an MLP."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(FEATS, DIM)
        self.head = nn.Sequential(nn.Linear(2 * DIM + 1, 16), nn.ReLU(),
                                  nn.Linear(16, CLASSES))

    def forward(self, tokens, mask, feats):
        e = self.emb(tokens) * mask.unsqueeze(-1)
        pooled = e.sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
        norm = pooled.pow(2).sum(-1, keepdim=True).sqrt()  # the bug: sqrt's gradient at 0
        return self.head(torch.cat([pooled, self.proj(feats), norm], dim=-1))


def make_model() -> nn.Module:
    return BagClassifier()


class WeightedCE(nn.Module):
    """Per-sample cross-entropy averaged with the batch's sample weights."""

    def forward(self, logits, target, weight):
        per = F.cross_entropy(logits, target, reduction="none")
        return (per * weight).sum() / weight.sum()  # the bug: 0/0 when every weight is 0


class Records(Dataset):
    """``n`` records of one rank: token ids below ``vocab`` only (the rows above are never
    looked up, their embedding gradient exactly 0), a padding mask, features, label, weight."""

    def __init__(self, n: int, seed: int, vocab: int = VOCAB // 2):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (n, LENGTH), generator=g)
        lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
        self.mask = (torch.arange(LENGTH) < lengths[:, None]).float()
        self.feats = torch.randn(n, FEATS, generator=g)
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)
        self.weights = torch.ones(n)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return (self.tokens[i], self.mask[i], self.feats[i], self.labels[i], self.weights[i])


def loader(records: Records, batch_size: int = 4) -> DataLoader:
    return DataLoader(records, batch_size=batch_size, shuffle=False)
