"""Tabular and sequence records behind the loaders users build (``test_sampled_records``): a
dataset of dict records split by ``random_split`` and joined by ``ConcatDataset``, drawn by a
``WeightedRandomSampler`` that oversamples a rare class (with replacement: a record may come
twice in a batch) or shuffled by a seeded generator over two persistent workers; variable-length
sequences padded by a collate_fn that gives their lengths beside them."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

FEATURES, CLASSES, RARE = 6, 3, 2


class Table(Dataset):
    """``n`` records ``{"x", "y", "idx"}``; ``nan``: a record whose feature 2 was read as NaN;
    ``zero``: one whose feature 3, a positive amount, is 0."""

    def __init__(self, n: int = 40, nan: int | None = None, zero: int | None = None):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.x[:, 3] = self.x[:, 3].abs() + 0.5
        if zero is not None:
            self.x[zero, 3] = 0.0
        self.y = torch.randint(0, CLASSES - 1, (n,), generator=g)
        self.y[n // 2:n // 2 + 8] = RARE  # a rare class of 8 records
        if nan is not None:
            self.x[nan, 2] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "idx": i}


def oversampling_loader(data: Table) -> DataLoader:
    """The rare class drawn 10 times as often, with replacement (the sampler's default)."""
    w = torch.where(data.y == RARE, 10.0, 1.0)
    sampler = WeightedRandomSampler(w, len(data), generator=torch.Generator().manual_seed(0))
    return DataLoader(data, batch_size=8, sampler=sampler)


class BatchNet(nn.Module):
    """An MLP given the collated dict whole, with dropout (draws from the global RNG)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 16)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(16, CLASSES)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(batch["x"]))))


def list_collate(items):
    """The records' feature vectors left as a list (the model stacks them), labels stacked."""
    return [i["x"] for i in items], torch.stack([i["y"] for i in items])


class Ratio(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 2:3] / x[:, 3:4]  # the bug: feature 3 may be 0


class ListNet(nn.Module):
    """Given the list of records; a ratio of two features beside them."""

    def __init__(self):
        super().__init__()
        self.ratio = Ratio()
        self.fc = nn.Linear(FEATURES + 1, CLASSES)

    def forward(self, records: list[torch.Tensor]) -> torch.Tensor:
        x = torch.stack(records)
        return self.fc(torch.cat([x, self.ratio(x)], 1))


class RecordsNet(BatchNet):
    """Given the loader's list of record dicts (``collate_fn=list``) whole."""

    def forward(self, records: list[dict]) -> torch.Tensor:
        return super().forward({"x": torch.stack([r["x"] for r in records])})


class Clips(Dataset):
    """``n`` sequences of 2 to 6 frames of 2 features; ``empty``: a record cut to no frame."""

    def __init__(self, n: int = 27, empty: int | None = None):
        g = torch.Generator().manual_seed(2)
        self.seqs = [torch.randn(int(torch.randint(2, 7, (1,), generator=g)), 2, generator=g)
                     for _ in range(n)]
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        if empty is not None:
            self.seqs[empty] = torch.zeros(0, 2)

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int):
        return self.seqs[i], self.y[i]


def pad_collate(items):
    seqs, ys = zip(*items)
    lengths = torch.tensor([len(s) for s in seqs])
    return pad_sequence(list(seqs), batch_first=True), lengths, torch.stack(ys)


class MeanPool(nn.Module):
    def forward(self, h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        keep = torch.arange(h.shape[1])[None, :] < lengths[:, None]
        return (h * keep[..., None]).sum(1) / lengths[:, None]  # 0/0: a record of no frame


class ClipNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.frame = nn.Linear(2, 8)
        self.pool = MeanPool()
        self.head = nn.Linear(8, CLASSES)

    def forward(self, seqs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.tanh(self.frame(seqs)), lengths))
