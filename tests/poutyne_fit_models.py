"""Supervised training as Poutyne 1.19 users write it: a ``poutyne.Model(network, optimizer,
loss_function, batch_metrics=[...])`` fit with ``fit_generator`` on ``DataLoader``s (a tuple
``x`` unpacked into ``network(*x)``: token ids beside their padding mask), ``fit`` on arrays,
Poutyne's callbacks (``ClipNorm``, ``ReduceLROnPlateau``, ``ModelCheckpoint``) and
``batches_per_step`` accumulation; the flight recorder attached by
``recorder.poutyne.FlightRecorderCallback``.

The data generators plant what such training meets: a missing value left as NaN in a CSV
column, a sequence that is all padding after tokenisation (a masked mean over no token), house
prices typed in dollars among prices in thousands under a log-cosh loss, a feature in raw units
beside standardised ones before a Keras-style ``Softmax`` head whose probabilities the loss takes
the log of, a hand-written L2 normalisation of zero (padding) embeddings, an Adam with
``eps=0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from poutyne import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_FEATURES = 6
N_CLASSES = 3
VOCAB = 20
SEQ = 7


# ---------------------------------------------------------------- data

def tabular(n: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardised features and class labels."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, N_FEATURES, generator=g)
    score = X[:, 0] - 0.5 * X[:, 1] + 0.3 * X[:, 2]
    y = torch.bucketize(score, torch.tensor([-0.5, 0.5]))
    return X, y


def with_missing(X: torch.Tensor, rows: list[int], col: int = 3) -> torch.Tensor:
    """A missing value left as NaN (``pd.read_csv`` of an empty cell, ``.values``)."""
    X = X.clone()
    X[rows, col] = float("nan")
    return X


def raw_units(X: torch.Tensor, col: int = 5, scale: float = 2000.0) -> torch.Tensor:
    """One column in raw units (square feet) beside standardised ones: no scaler fitted on it."""
    X = X.clone()
    X[:, col] = X[:, col].abs() * scale + 500.0
    return X


def prices(n: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and house prices in $100k (1.5 .. 4.5), as a float target column."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, N_FEATURES, generator=g)
    y = 3.0 + 0.5 * X[:, :3].sum(1, keepdim=True)
    return X, y


def in_dollars(y: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Records whose price was typed in dollars, not $100k (a merge of two exports)."""
    y = y.clone()
    y[rows] = y[rows] * 1e5
    return y


def sentences(n: int = 48, seed: int = 2, empty: tuple[int, ...] = ()) -> tuple:
    """Token ids (0 is padding) with their mask and a label; a sequence of length 0 for each
    row in ``empty`` (a text whose every token the tokenizer dropped as out of vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, SEQ + 1, (n,), generator=g)
    lengths[list(empty)] = 0
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    mask = torch.arange(SEQ)[None, :] < lengths[:, None]
    ids = ids * mask
    y = (ids % 2).sum(1) % 2
    return ids, mask.float(), y


def tensor_loader(*tensors: torch.Tensor, batch_size: int = 16) -> DataLoader:
    return DataLoader(TensorDataset(*tensors), batch_size=batch_size, shuffle=False)


class PairLoader:
    """Yields ``((ids, mask), y)``: Poutyne unpacks a tuple ``x`` into ``network(*x)``."""

    def __init__(self, ids, mask, y, batch_size: int = 16):
        self.loader = tensor_loader(ids, mask, y, batch_size=batch_size)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for ids, mask, y in self.loader:
            yield (ids, mask), y


# ---------------------------------------------------------------- networks

class MLP(nn.Module):
    """A tabular classifier; ``softmax=True`` ends it with ``nn.Softmax`` as a Keras model."""

    def __init__(self, softmax: bool = False, out: int = N_CLASSES):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(N_FEATURES, 16), nn.ReLU())
        self.head = nn.Linear(16, out)
        self.probs = nn.Softmax(dim=-1) if softmax else nn.Identity()

    def forward(self, x):
        return self.probs(self.head(self.body(x)))


class MeanPoolText(nn.Module):
    """Bag-of-embeddings text classifier: a masked mean over the tokens, optionally of
    L2-normalised embeddings (normalised by hand, as a cosine classifier's input)."""

    def __init__(self, normalise: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.pool = MaskedMean()
        self.normalise = normalise
        self.head = nn.Linear(8, 2)

    def forward(self, ids, mask):
        e = self.embed(ids) * mask.unsqueeze(-1)  # padding positions zeroed
        if self.normalise:
            norm = e.pow(2).sum(-1, keepdim=True).sqrt()  # the bug: sqrt of 0 at the padding
            e = e / norm.clamp_min(1e-6)
        return self.head(self.pool(e, mask))


class MaskedMean(nn.Module):
    def forward(self, e, mask):
        m = mask.unsqueeze(-1)
        return (e * m).sum(1) / m.sum(1)  # the bug: no clamp, 0/0 for a sequence of no token


def make_mlp() -> nn.Module:
    return MLP()


def make_softmax_mlp() -> nn.Module:
    return MLP(softmax=True)


def make_regressor() -> nn.Module:
    return MLP(out=1)


def make_text() -> nn.Module:
    return MeanPoolText()


def make_normalised_text() -> nn.Module:
    return MeanPoolText(normalise=True)


# ---------------------------------------------------------------- losses

class LogCoshLoss(nn.Module):
    """A smooth L1 of regression practice (Keras' ``log_cosh``), written as its formula."""

    def forward(self, y_pred, y_true):
        return torch.log(torch.cosh(y_pred - y_true)).mean()  # the bug: cosh overflows past 89


def nll_of_probs(y_pred, y_true):
    """Keras' ``categorical_crossentropy`` on a ``Softmax`` output: the log of probabilities."""
    return F.nll_loss(torch.log(y_pred), y_true)


# ---------------------------------------------------------------- callbacks

class StrictClipNorm(Callback):
    """Poutyne's ``ClipNorm`` with ``error_if_nonfinite=True``: a non-finite gradient norm
    raises in ``on_backward_end``, before ``optimizer.step()``."""

    def __init__(self, parameters, max_norm: float):
        super().__init__()
        self.parameters = list(parameters)
        self.max_norm = max_norm

    def on_backward_end(self, batch_number: int) -> None:
        nn.utils.clip_grad_norm_(self.parameters, self.max_norm, error_if_nonfinite=True)


# ---------------------------------------------------------------- metric learning

class ArcFaceNet(nn.Module):
    """An additive angular margin head (ArcFace) over a small residual encoder; the labels come
    into ``forward`` beside the features (``x = (features, labels)``), as the margin needs them.
    The encoder's branch starts at 0 (its last layer zero-initialised, as ReZero / Fixup do), so
    at the start a record's embedding is its features, exactly. The class centres start at the
    embeddings of one training record per class (a common warm start of prototypes)."""

    def __init__(self, s: float = 8.0, m: float = 0.3):
        super().__init__()
        self.branch = nn.Sequential(nn.Linear(N_FEATURES, 16), nn.Tanh(),
                                    nn.Linear(16, N_FEATURES))
        nn.init.zeros_(self.branch[-1].weight)
        nn.init.zeros_(self.branch[-1].bias)
        self.centres = nn.Parameter(torch.randn(N_CLASSES, N_FEATURES))
        self.s, self.m = s, m

    def embed(self, x):
        return x + self.branch(x)

    def forward(self, x, labels):
        cos = F.normalize(self.embed(x)) @ F.normalize(self.centres).T
        theta = torch.acos(cos)  # the bug: no clamp, cos rounds past 1 for an aligned record
        margin = F.one_hot(labels, N_CLASSES).bool()
        return self.s * torch.where(margin, torch.cos(theta + self.m), cos)


# Records entered with two fields only, the others imputed at the column mean (0 once
# standardised): row -> ((column, value), (column, value)). Each pair is a Pythagorean triple's
# legs (a, b) over a power of 2, so the record's norm (c over it) is exact in any float type
# and order of summation, and its unit vector is (a / c, b / c) rounded once. The cosine of
# such a record with a centre warm-started on it (its copy) is then the sum of two rounded
# squares, with or without FMA: for the triples with c = 137, 289, 457, 541 it is 1.0 in
# float32 in every case (below 1 in float64: acos's derivative is finite there), for 533 it
# is 1.0000001 in float32 (1.0 in float64), on every CPU.
SPARSE_RECORDS = {
    0: ((0, -88 / 64), (1, 105 / 64)),  # 137: 1.0
    1: ((1, 341 / 256), (4, 420 / 256)),  # 541: 1.0
    3: ((2, 161 / 128), (3, 240 / 128)),  # 289: 1.0
    5: ((4, 168 / 256), (5, -425 / 256)),  # 457: 1.0
    7: ((0, 308 / 256), (3, 435 / 256)),  # 533: 1.0000001
}


def with_sparse_records(X: torch.Tensor) -> torch.Tensor:
    """``X`` with the rows of ``SPARSE_RECORDS`` replaced by those records (labels kept)."""
    X = X.clone()
    for row, fields in SPARSE_RECORDS.items():
        X[row] = 0.0
        for col, value in fields:
            X[row, col] = value
    return X


def make_arcface(warm_rows: tuple[int, ...] = (0, 3, 5)) -> nn.Module:
    torch.manual_seed(0)
    net = ArcFaceNet()
    X, _ = tabular()
    with torch.no_grad():
        net.centres.copy_(net.embed(with_sparse_records(X)[list(warm_rows)]))
    return net
