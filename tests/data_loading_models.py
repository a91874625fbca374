"""Input pipelines as users write them, for ``test_data_loading`` (at module level so that
``nanreplay`` rebuilds the models from the bundle, ``data_loading_models:make_seq``):
map-style datasets returning dicts (a variable-length sequence with its length, record id
and sample weight), namedtuples and dataclasses; a ``collate_fn`` that pads to the batch's
longest sequence and builds the 0/1 mask; a bucketing ``BatchSampler`` (batches of about as
many tokens, so of varying size); ``WeightedRandomSampler``; an ``IterableDataset`` sharded by
``get_worker_info``; ``worker_init_fn`` seeding numpy and ``random`` per worker; on-the-fly
augmentation (random crops, standardisation by the image's own std, mixup with a Beta draw);
and the models they feed: a masked-mean sequence classifier, a small CNN that standardises
each image itself, an MLP over raw tabular columns. ``corrupt`` plants the bad records real
datasets hold (a NaN/Inf feature, an empty sequence, a constant image, a value in the wrong
unit, a weight of 0)."""

from __future__ import annotations

import random
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    WeightedRandomSampler,
    get_worker_info,
)

F_IN, H, CLASSES = 6, 16, 3
SIDE, CROP = 10, 8
N_REC = 48


def seed_worker(worker_id: int) -> None:
    """The PyTorch docs' recipe: numpy and ``random`` seeded from the worker's torch seed."""
    seed = torch.initial_seed() % 2 ** 32
    np.random.seed(seed)
    random.seed(seed)


# --- sequences: dict records, padding collate, length buckets --------------------------------

class Records(Dataset):
    """Variable-length sequences of ``F_IN`` features; ``corrupt[i]`` plants a bad record:
    ``"nan"`` (a feature the parser read as NaN), ``"empty"`` (a sequence of no step),
    ``"zero_weight"`` (a record excluded from the loss by weight 0)."""

    def __init__(self, n: int = N_REC, corrupt: dict | None = None, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(2, 9, (n,), generator=g).tolist()
        self.seqs = [torch.randn(t, F_IN, generator=g) for t in self.lengths]
        self.labels = torch.randint(0, CLASSES, (n,), generator=g).tolist()
        self.weights = [1.0] * n
        for i, kind in (corrupt or {}).items():
            if kind == "nan":
                self.seqs[i][1, 2] = float("nan")
            elif kind == "empty":
                self.seqs[i] = torch.zeros(0, F_IN)
                self.lengths[i] = 0
            elif kind == "one_step":  # an utterance of a single frame
                self.seqs[i] = self.seqs[i][:1]
                self.lengths[i] = 1
            elif kind == "zero_weight":
                self.weights[i] = 0.0

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return {"x": self.seqs[i], "label": self.labels[i], "id": i,
                "weight": self.weights[i], "path": f"shard-{i // 16}/rec-{i:04d}.pt"}


def pad_collate(items):
    """Pads to the batch's longest sequence (at least one step), with the 0/1 mask, lengths,
    record ids, sample weights and the files read (a list of strings) beside the features."""
    longest = max(1, max(len(it["x"]) for it in items))
    x = torch.zeros(len(items), longest, F_IN)
    mask = torch.zeros(len(items), longest)
    for r, it in enumerate(items):
        x[r, :len(it["x"])] = it["x"]
        mask[r, :len(it["x"])] = 1.0
    return {"x": x, "mask": mask, "length": mask.sum(1).long(),
            "id": torch.tensor([it["id"] for it in items]),
            "weight": torch.tensor([it["weight"] for it in items]),
            "path": [it["path"] for it in items],
            "label": torch.tensor([it["label"] for it in items])}


class BucketBatchSampler(Sampler):
    """Batches of records of similar length, about ``tokens`` steps each (so their sizes vary),
    in an order shuffled by ``seed``; the last, short one kept."""

    def __init__(self, lengths, tokens: int = 40, seed: int = 0):
        self.lengths, self.tokens, self.seed = lengths, tokens, seed

    def _batches(self):
        order = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))
        batches, cur = [], []
        for i in order:
            if cur and (len(cur) + 1) * max(1, self.lengths[i]) > self.tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        batches.append(cur)
        g = torch.Generator().manual_seed(self.seed)
        return [batches[k] for k in torch.randperm(len(batches), generator=g).tolist()]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


def bucket_loader(data: Records, workers: int = 2) -> DataLoader:
    return DataLoader(data, batch_sampler=BucketBatchSampler(data.lengths),
                      collate_fn=pad_collate, num_workers=workers,
                      persistent_workers=workers > 0, worker_init_fn=seed_worker)


def weighted_loader(data: Records, batch: int = 8, workers: int = 2) -> DataLoader:
    """Class-balanced sampling (inverse class frequency) with a seeded generator."""
    counts = torch.bincount(torch.tensor(data.labels), minlength=CLASSES).float()
    w = (1.0 / counts)[torch.tensor(data.labels)]
    sampler = WeightedRandomSampler(w, len(data), generator=torch.Generator().manual_seed(3))
    return DataLoader(data, batch_size=batch, sampler=sampler, collate_fn=pad_collate,
                      num_workers=workers, persistent_workers=workers > 0,
                      worker_init_fn=seed_worker)


def ordered_loader(data: Records, batch: int = 8, workers: int = 2) -> DataLoader:
    """In dataset order, the last batch short (``drop_last=False``)."""
    return DataLoader(data, batch_size=batch, shuffle=False, collate_fn=pad_collate,
                      num_workers=workers, persistent_workers=workers > 0,
                      worker_init_fn=seed_worker)


class SeqClassifier(nn.Module):
    """Per-step MLP, the mean over the real steps (sum over the mask / its count), a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(F_IN, H)
        self.pool = MaskedMean()
        self.head = nn.Linear(H, CLASSES)

    def forward(self, x, mask):
        return self.head(self.pool(torch.tanh(self.embed(x)), mask))


class MaskedMean(nn.Module):
    def forward(self, h, mask):
        return (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)  # 0/0: no step


class BatchSeqClassifier(SeqClassifier):
    """The same, given the collated dict whole (``model(batch)``), as many trainers pass it."""

    def forward(self, batch):
        return super().forward(batch["x"], batch["mask"])


def make_batch_seq() -> nn.Module:
    torch.manual_seed(0)
    return BatchSeqClassifier()


def make_seq() -> nn.Module:
    torch.manual_seed(0)
    return SeqClassifier()


class WeightedCE(nn.Module):
    """Cross-entropy per sample, averaged with the dataset's sample weights (normalised by
    their sum, as a weighted mean is)."""

    def forward(self, logits, label, weight):
        per = F.cross_entropy(logits, label, reduction="none")
        return (per * weight).sum() / weight.sum()  # 0/0 when every weight is 0


# --- images: namedtuple records, per-image standardisation, crops, mixup ---------------------

Sample = namedtuple("Sample", "image label index")


class Images(Dataset):
    """``SIDE x SIDE`` single-channel images, randomly cropped to ``CROP`` (numpy's RNG, seeded
    per worker); ``standardise``: each crop divided by its own std in the pipeline.
    ``corrupt[i]``: ``"constant"`` (a blank frame: every pixel one value), ``"nan"``."""

    def __init__(self, n: int = 32, corrupt: dict | None = None, standardise: bool = False,
                 seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 1, SIDE, SIDE, generator=g) * 255
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)
        self.standardise = standardise
        for i, kind in (corrupt or {}).items():
            if kind == "constant":
                self.images[i] = 128.0
            elif kind == "flat":  # a saturated frame: sensor noise of a thousandth of a level
                self.images[i] = 128.0 + torch.rand(1, SIDE, SIDE, generator=g) * 1e-3
            elif kind == "nan":
                self.images[i, 0, 3, 4] = float("nan")

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        top, left = np.random.randint(0, SIDE - CROP + 1, size=2)
        img = self.images[i, :, top:top + CROP, left:left + CROP].clone()
        if self.standardise:
            img = (img - img.mean()) / img.std()  # per-image standardisation, no eps
        return Sample(img, self.labels[i], i)


def image_loader(data: Images, batch: int = 8, workers: int = 2) -> DataLoader:
    return DataLoader(data, batch_size=batch, shuffle=False, num_workers=workers,
                      persistent_workers=workers > 0, worker_init_fn=seed_worker)


class InstanceStd(nn.Module):
    """Standardises each channel of each sample by its own mean and std (the square root of
    its variance, as a hand-written instance norm computes it), eps added outside the root."""

    def forward(self, h):
        flat = h.flatten(2)
        mean = flat.mean(2, keepdim=True)
        std = ((flat - mean) ** 2).mean(2, keepdim=True).sqrt()
        return ((flat - mean) / (std + 1e-5)).view_as(h)


class SmallCNN(nn.Module):
    """A stem convolution (no padding), an instance standardisation, a head."""

    def __init__(self, standardise: bool = True):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3)
        self.norm = InstanceStd() if standardise else nn.Identity()
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x):
        h = torch.relu(self.norm(self.stem(x)))
        return self.head(h.mean((2, 3)))


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN()


def make_plain_cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN(standardise=False)


def soft_cross_entropy(logits, target):
    """Cross-entropy against mixed (soft) targets, as mixup and cutmix use."""
    return -(target * F.log_softmax(logits, 1)).sum(1).mean()


def mixup(x, y, alpha: float = 0.4):
    """Mixup: a Beta(alpha, alpha) weight, each image mixed with a shuffled partner."""
    lam = float(torch.distributions.Beta(alpha, alpha).sample())
    perm = torch.randperm(x.size(0))
    t = F.one_hot(y, CLASSES).float()
    return lam * x + (1 - lam) * x[perm], lam * t + (1 - lam) * t[perm], perm


# --- tabular: a sharded IterableDataset of raw columns, dataclass batches --------------------

@dataclass
class Rows:
    features: torch.Tensor
    target: torch.Tensor
    row_id: torch.Tensor


class CsvStream(IterableDataset):
    """Rows streamed from ``n`` records, each worker reading every ``num_workers``-th one
    (sharded by ``get_worker_info``). Columns in their raw units (counts in the hundreds);
    ``bad[i] = value`` writes one column of record ``i`` (a price in cents, ``inf``)."""

    def __init__(self, n: int = 64, bad: dict | None = None, seed: int = 2):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, F_IN, generator=g) * 300
        self.y = self.x @ torch.linspace(-0.01, 0.01, F_IN) + torch.randn(n, generator=g) * 0.1
        for i, value in (bad or {}).items():
            self.x[i, 4] = value

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, len(self.x), step):
            yield self.x[i], self.y[i], i


def rows_collate(items):
    x, y, i = zip(*items)
    return Rows(torch.stack(x), torch.stack(y), torch.tensor(i))


def stream_loader(data: CsvStream, batch: int = 8, workers: int = 2) -> DataLoader:
    return DataLoader(data, batch_size=batch, collate_fn=rows_collate, num_workers=workers,
                      persistent_workers=workers > 0, worker_init_fn=seed_worker)


class TabularMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(F_IN, H)
        self.fc2 = nn.Linear(H, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).squeeze(-1)


class RowsMSE(nn.Module):
    """A loss given the collated batch whole (``criterion(pred, batch)``), reading its target."""

    def forward(self, pred, batch: Rows):
        return F.mse_loss(pred.float(), batch.target)


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return TabularMLP()


class BatchStandardised(nn.Module):
    """An MLP that standardises its input over the batch (each column by the batch's mean and
    std), as a loop without a fitted scaler does."""

    def __init__(self):
        super().__init__()
        self.scale = BatchScale()
        self.mlp = TabularMLP()

    def forward(self, x):
        return self.mlp(self.scale(x))


class BatchScale(nn.Module):
    def forward(self, x):
        return (x - x.mean(0)) / (x.std(0) + 1e-6)


def make_batch_standardised() -> nn.Module:
    torch.manual_seed(0)
    return BatchStandardised()


def class_weights(labels, classes: int = CLASSES) -> torch.Tensor:
    """Inverse class frequency over the training labels, normalised to sum to 1."""
    w = 1.0 / torch.bincount(labels, minlength=classes).float()
    return w / w.sum()


class UtteranceCMVN(nn.Module):
    """Per-utterance mean and variance normalisation over its valid frames (the unbiased
    variance: the squared deviations summed over the mask, divided by the count less one)."""

    def forward(self, x, mask):
        m = mask.unsqueeze(-1)
        n = m.sum(1, keepdim=True)
        mean = (x * m).sum(1, keepdim=True) / n
        var = (((x - mean) * m) ** 2).sum(1, keepdim=True) / (n - 1)
        return (x - mean) / (var + 1e-5).sqrt() * m


class CMVNClassifier(SeqClassifier):
    def __init__(self):
        super().__init__()
        self.cmvn = UtteranceCMVN()

    def forward(self, x, mask):
        return super().forward(self.cmvn(x, mask), mask)


def make_cmvn() -> nn.Module:
    torch.manual_seed(0)
    return CMVNClassifier()
