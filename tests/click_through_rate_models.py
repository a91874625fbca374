"""Click-through-rate models as DeepCTR-Torch / FuxiCTR / torch-rechub write them, for
``test_click_through_rate`` (at module level so that ``nanreplay`` rebuilds them from the
bundle, ``click_through_rate_models:make_deepfm``): hashed categorical ids into embedding
tables, log1p'd and batch-normalised counts, DeepFM's factorisation machine, DCN-v2's cross
layers, DIN's target attention over a padded behaviour sequence, BCE with logits weighted for
negative downsampling, and a TensorDataset read by a DataLoader."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FIELDS = (40, 30, 20, 10)  # hash buckets per categorical field
N_NUM = 3  # count features (impressions, clicks, dwell seconds)
ITEMS, HIST = 50, 6  # item vocabulary (0 is padding) and behaviour-sequence length
D = 8
B = 16


def mlp(sizes) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DeepFM(nn.Module):
    """DeepFM (Guo et al. 2017): first-order weights, the FM's pairwise term over the field
    embeddings, and a DNN over their concatenation; the counts are log1p'd in forward, as
    DeepCTR's ``dense_features`` transform does, then batch-normalised."""

    def __init__(self, sparse: bool = False):
        super().__init__()
        self.offsets = torch.tensor((0, *FIELDS[:-1])).cumsum(0)  # one table, field offsets
        self.emb = nn.Embedding(sum(FIELDS), D, sparse=sparse)
        self.first = nn.Embedding(sum(FIELDS), 1, sparse=sparse)
        self.num_bn = nn.BatchNorm1d(N_NUM)
        self.num_emb = nn.Linear(N_NUM, D)
        self.dnn = mlp((D * (len(FIELDS) + 1), 32, 16, 1))

    def forward(self, cat, num):
        ids = cat + self.offsets
        dense = self.num_bn(torch.log1p(num))
        v = torch.cat([self.emb(ids), self.num_emb(dense).unsqueeze(1)], 1)  # (B, F + 1, D)
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1, keepdim=True)
        return (self.first(ids).sum(1) + fm + self.dnn(v.flatten(1))).squeeze(-1)


class CrossNetV2(nn.Module):
    """DCN-v2's cross network: ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``."""

    def __init__(self, dim: int, layers: int = 3):
        super().__init__()
        self.w = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x0):
        x = x0
        for lin in self.w:
            x = x0 * lin(x) + x
        return x


class DCNv2(nn.Module):
    """DCN-v2 (Wang et al. 2021), the stacked form: cross network then a DNN, with a learned
    calibration temperature on the logit."""

    def __init__(self, layers: int = 3):
        super().__init__()
        self.offsets = torch.tensor((0, *FIELDS[:-1])).cumsum(0)
        self.emb = nn.Embedding(sum(FIELDS), D)
        dim = D * len(FIELDS) + N_NUM
        self.cross = CrossNetV2(dim, layers)
        self.dnn = mlp((dim, 32, 1))
        self.log_temp = nn.Parameter(torch.zeros(()))

    def forward(self, cat, num):
        x0 = torch.cat([self.emb(cat + self.offsets).flatten(1), num], 1)
        return self.dnn(self.cross(x0)).squeeze(-1) / self.log_temp.exp()


class TargetAttention(nn.Module):
    """DIN's activation unit: an MLP over ``[q, k, q - k, q * k]`` scores each behaviour
    against the candidate; ``softmax=True`` normalises the scores over the valid positions
    with ``-inf`` padding (as many re-implementations do), ``"manual"`` divides the masked
    exp by its sum, ``"mean"`` averages the valid positions' embeddings, else DIN's own unnormalised ``scores * mask``."""

    def __init__(self, softmax: bool | str, nan_to_num: bool = False):
        super().__init__()
        self.softmax, self.nan_to_num = softmax, nan_to_num
        self.unit = nn.Sequential(nn.Linear(4 * D, 16), nn.Sigmoid(), nn.Linear(16, 1))

    def forward(self, q, keys, mask):
        q = q.unsqueeze(1).expand_as(keys)
        scores = self.unit(torch.cat([q, keys, q - keys, q * keys], -1)).squeeze(-1)
        if self.softmax == "mean":  # YouTube-DNN's average of the watched items, no attention
            return keys.sum(1) / mask.sum(-1, keepdim=True)
        if self.softmax == "manual":  # exp over the valid positions, divided by their sum
            e = torch.exp(scores - scores.amax(-1, keepdim=True)) * mask
            w = e / e.sum(-1, keepdim=True)
        elif self.softmax:
            w = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
            if self.nan_to_num:  # the forum's fix for an empty history: forward only
                w = torch.nan_to_num(w)
        else:
            w = scores * mask
        return (w.unsqueeze(-1) * keys).sum(1)


class DIN(nn.Module):
    """Deep Interest Network: the user's clicked items (0-padded, ``HIST`` long) attended by
    the candidate item, beside the context fields."""

    def __init__(self, softmax: bool | str = True, nan_to_num: bool = False):
        super().__init__()
        self.items = nn.Embedding(ITEMS, D, padding_idx=0)
        self.ctx = nn.Embedding(sum(FIELDS), D)
        self.offsets = torch.tensor((0, *FIELDS[:-1])).cumsum(0)
        self.att = TargetAttention(softmax, nan_to_num)
        self.dnn = mlp((D * (2 + len(FIELDS)), 32, 1))

    def forward(self, cat, item, hist):
        q, keys = self.items(item), self.items(hist)
        interest = self.att(q, keys, hist != 0)
        ctx = self.ctx(cat + self.offsets).flatten(1)
        return self.dnn(torch.cat([q, interest, ctx], 1)).squeeze(-1)


def make_deepfm() -> nn.Module:
    torch.manual_seed(0)
    return DeepFM()


def make_sparse_deepfm() -> nn.Module:
    torch.manual_seed(0)
    return DeepFM(sparse=True)


def make_dcn() -> nn.Module:
    torch.manual_seed(0)
    return DCNv2()


def make_din() -> nn.Module:
    torch.manual_seed(0)
    return DIN()


def make_din_nan_to_num() -> nn.Module:
    torch.manual_seed(0)
    return DIN(nan_to_num=True)


def make_din_manual() -> nn.Module:
    torch.manual_seed(0)
    return DIN(softmax="manual")


def make_din_mean() -> nn.Module:
    torch.manual_seed(0)
    return DIN(softmax="mean")


def make_din_unnormalised() -> nn.Module:
    torch.manual_seed(0)
    return DIN(softmax=False)


def weighted_bce(logits, clicks, weights):
    """BCE with logits over a negatively downsampled log: each kept negative counts
    ``1 / rate`` times, the loss normalised by the total weight."""
    bce = F.binary_cross_entropy_with_logits(logits, clicks, reduction="none")
    return (bce * weights).sum() / weights.sum()


def impressions(n: int, seed: int = 0) -> TensorDataset:
    """``n`` logged impressions: hashed field ids, counts, candidate item, 0-padded history
    (1..HIST clicks each), click label and the downsampling rate its row was kept at
    (positives 1, negatives 0.25)."""
    g = torch.Generator().manual_seed(seed)
    cat = torch.stack([torch.randint(0, f, (n,), generator=g) for f in FIELDS], 1)
    num = torch.randint(0, 500, (n, N_NUM), generator=g).float()
    item = torch.randint(1, ITEMS, (n,), generator=g)
    lens = torch.randint(1, HIST + 1, (n,), generator=g)
    hist = torch.randint(1, ITEMS, (n, HIST), generator=g)
    hist = hist.masked_fill(torch.arange(HIST) >= lens[:, None], 0)
    click = (torch.rand(n, generator=g) < 0.3).float()
    rate = torch.where(click > 0, 1.0, 0.25)
    return TensorDataset(cat, num, item, hist, click, rate)


def loader(data: TensorDataset, batch_size: int = B) -> DataLoader:
    return DataLoader(data, batch_size=batch_size, shuffle=False)
