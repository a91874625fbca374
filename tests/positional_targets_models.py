"""Models that compute their own loss from targets passed to ``forward`` the way plain
PyTorch code passes them, for ``test_positional_targets``: ``loss = model(x, y)``;
nanoGPT's ``logits, loss = model(idx, targets)``; ``model(batch)`` with the loader's
``(x, y)`` pair or a dict with ``"y_true"``; torchvision's detection call
``model(images, targets)``, one target dict per image. Each normalises a record without an
eps (an all-zero record is 0/0); the language model's loss ignores targets of -1."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D, C, V = 8, 3, 10  # features, classes, vocabulary


class PairClassifier(nn.Module):
    """``loss = model(x, y)``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 16)
        self.head = nn.Linear(16, C)

    def forward(self, x, y):
        x = x / x.norm(dim=-1, keepdim=True)  # the bug: no eps, 0/0 for an all-zero record
        return F.cross_entropy(self.head(torch.tanh(self.proj(x))), y)


class BatchClassifier(PairClassifier):
    """``loss = model(batch)``: the loader's ``(x, y)``, or ``{"x": ..., "y_true": ...}``."""

    def forward(self, batch):
        x, y = (batch["x"], batch["y_true"]) if isinstance(batch, dict) else batch
        return super().forward(x, y)


class TinyGPT(nn.Module):
    """nanoGPT's signature: ``forward(idx, targets=None)`` returning ``(logits, loss)``."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.lm_head = nn.Linear(D, V)

    def forward(self, idx, targets=None):
        logits = self.lm_head(torch.tanh(self.wte(idx)))
        loss = None if targets is None else F.cross_entropy(
            logits.view(-1, V), targets.view(-1), ignore_index=-1)
        return logits, loss


class Detector(nn.Module):
    """torchvision's detection API: ``model(images, targets)``, a list of images and one dict
    of ``boxes`` and ``labels`` per image; returns a dict of losses."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Conv2d(3, 4, 3, padding=1)
        self.cls = nn.Linear(4, C)
        self.box = nn.Linear(4, 4)

    def forward(self, images, targets):
        cls, box = [], []
        for img, t in zip(images, targets):
            img = img / img.norm()  # the bug: no eps, 0/0 for a blank image
            f = self.backbone(img[None]).mean(dim=(2, 3))
            n = len(t["labels"])
            cls.append(F.cross_entropy(self.cls(f).expand(n, -1), t["labels"]))
            box.append(F.l1_loss(self.box(f).expand(n, -1), t["boxes"]))
        return {"loss_classifier": torch.stack(cls).mean(), "loss_box_reg": torch.stack(box).mean()}


class BagClassifier(nn.Module):
    """A text classifier over an ``EmbeddingBag`` taking its labels positionally."""

    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 8, mode="sum")
        self.head = nn.Linear(8, 2)

    def forward(self, text, offsets, per_sample_weights, labels):
        logits = self.head(self.emb(text, offsets, per_sample_weights=per_sample_weights))
        return F.cross_entropy(logits, labels)


def _seeded(cls):
    def make():
        torch.manual_seed(0)
        return cls()
    return make


make_pair, make_batch, make_gpt = _seeded(PairClassifier), _seeded(BatchClassifier), _seeded(TinyGPT)
make_detector, make_bags = _seeded(Detector), _seeded(BagClassifier)


def rows(seed: int, n: int = 4, zero=None, labels=None):
    """``n`` random records and class labels; record ``zero`` all zeros, ``labels`` by hand."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, D, generator=g), torch.randint(0, C, (n,), generator=g)
    if zero is not None:
        x[zero] = 0.0
    return x, (y if labels is None else torch.tensor(labels))


def tokens(seed: int, ignored: bool = False):
    """A (4, 5) batch of token ids and next-token targets; every target -1 if ``ignored``."""
    g = torch.Generator().manual_seed(seed)
    idx, targets = torch.randint(0, V, (4, 5), generator=g), torch.randint(0, V, (4, 5), generator=g)
    return idx, targets.fill_(-1) if ignored else targets


def detections(seed: int, blank=None):
    """Four 3x8x8 images with 1-3 boxes each; image ``blank`` all zeros."""
    g = torch.Generator().manual_seed(seed)
    images = [torch.randn(3, 8, 8, generator=g) for _ in range(4)]
    if blank is not None:
        images[blank] = torch.zeros(3, 8, 8)
    targets = [{"boxes": torch.rand(k, 4, generator=g),
                "labels": torch.randint(0, C, (k,), generator=g)} for k in (1, 2, 3, 2)]
    return images, targets
