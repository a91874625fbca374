"""Learned cardinality estimation as the MSCN code (Kipf et al. 2019, ``learnedcardinalities``)
writes it, for ``test_cardinality_estimation`` (at module level so that ``nanreplay`` rebuilds
the model from the bundle, ``cardinality_estimation_models:make_mscn``): a query as three
zero-padded sets (tables with their sample bitmaps, joins, predicates), each set's elements
through an MLP, mean-pooled by the set's 0/1 mask (sum over the mask divided by the mask's
count), the three pooled vectors to a sigmoid output that predicts the min-max normalised
log-cardinality; the q-error loss on the unnormalised ``exp`` of that prediction, a log-space
variant without the sigmoid (``exp`` of an unbounded output); a plan-tree model (Bao's tree
convolution over a plan's nodes, the optimizer's estimated rows ``log``'d in forward, dynamic
max pooling over the real nodes); and TensorDatasets read by a DataLoader."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_TABLES, N_COLS, N_OPS = 4, 6, 3
BITMAP = 8  # sampled rows per table: the sample bitmap of the table's predicates
T_MAX, J_MAX, P_MAX = 3, 2, 4  # padded set sizes
F_T = N_TABLES + BITMAP  # table one-hot + sample bitmap
F_J = N_TABLES * (N_TABLES - 1) // 2  # join one-hot
F_P = N_COLS + N_OPS + 1  # column one-hot, operator one-hot, normalised literal
H = 16
B = 16


class SetConv(nn.Module):
    """One set's MLP, then the masked mean over its elements (MSCN's ``hid * mask``, summed,
    divided by ``mask.sum(1)``)."""

    def __init__(self, d_in: int):
        super().__init__()
        self.mlp1 = nn.Linear(d_in, H)
        self.mlp2 = nn.Linear(H, H)

    def forward(self, x, mask):
        hid = torch.relu(self.mlp2(torch.relu(self.mlp1(x))))
        hid = hid * mask
        return hid.sum(1) / mask.sum(1)  # the set's elements averaged (0/0 for an empty set)


class MSCN(nn.Module):
    """Multi-set convolutional network: the three pooled sets concatenated, an MLP, a sigmoid
    (the normalised log-cardinality) or, ``log_space``, the log-cardinality itself."""

    def __init__(self, log_space: bool = False):
        super().__init__()
        self.tables = SetConv(F_T)
        self.joins = SetConv(F_J)
        self.preds = SetConv(F_P)
        self.out1 = nn.Linear(3 * H, H)
        self.out2 = nn.Linear(H, 1)
        self.log_space = log_space

    def forward(self, tables, joins, preds, t_mask, j_mask, p_mask):
        hid = torch.cat([self.tables(tables, t_mask), self.joins(joins, j_mask),
                         self.preds(preds, p_mask)], 1)
        out = self.out2(torch.relu(self.out1(hid))).squeeze(-1)
        return out if self.log_space else torch.sigmoid(out)


def make_mscn() -> MSCN:
    torch.manual_seed(0)
    return MSCN()


def make_log_mscn() -> MSCN:
    """The log-space variant, its output bias started at the training set's mean
    log-cardinality (a common warm start: the first q-errors are near 1)."""
    torch.manual_seed(0)
    model = MSCN(log_space=True)
    with torch.no_grad():
        model.out2.bias.fill_(MEAN_LOG_CARD)
    return model


MEAN_LOG_CARD = 11.0


class QError(nn.Module):
    """MSCN's loss: the mean q-error ``max(est / true, true / est)`` of the unnormalised
    estimate ``exp(pred * (max - min) + min)`` against the true cardinality; ``log_space``:
    ``exp(pred)``. ``lo`` and ``hi`` are the training set's min and max log-cardinality."""

    def __init__(self, lo: float, hi: float, log_space: bool = False):
        super().__init__()
        self.lo, self.hi, self.log_space = lo, hi, log_space

    def forward(self, pred, card):
        log_est = pred if self.log_space else pred * (self.hi - self.lo) + self.lo
        est = torch.exp(log_est)
        return torch.maximum(est / card, card / est).mean()


class MaskedQError(QError):
    """The q-error with the queries of an empty result (true cardinality 0) left out through
    ``torch.where``: finite in forward, but their gradient is 0 times the inf of ``est / 0``."""

    def forward(self, pred, card):
        est = torch.exp(pred * (self.hi - self.lo) + self.lo)
        q = torch.maximum(est / card, card / est)
        keep = card > 0
        return torch.where(keep, q, torch.zeros_like(q)).sum() / keep.sum()


class NormalisedMSE(nn.Module):
    """The regression form: MSE between the prediction and the label min-max normalised in the
    loss, ``(log(card) - lo) / (hi - lo)``."""

    def __init__(self, lo: float, hi: float):
        super().__init__()
        self.lo, self.hi = lo, hi

    def forward(self, pred, card):
        target = (torch.log(card) - self.lo) / (self.hi - self.lo)
        return ((pred - target) ** 2).mean()


N_NODE_TYPES, NODES = 5, 7  # scan, hash join, nested loop, sort, aggregate; nodes per plan


class TreeConv(nn.Module):
    """Bao's / Neo's tree convolution: each node's filter over itself and its two children
    (index 0 is the null node, all zeros), gathered from the node table."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.self_, self.left, self.right = (nn.Linear(d_in, d_out) for _ in range(3))

    def forward(self, x, children):
        idx = children.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1])  # (B, N, 2, F)
        kids = torch.gather(x.unsqueeze(2).expand(-1, -1, 2, -1), 1, idx)
        return torch.relu(self.self_(x) + self.left(kids[:, :, 0]) + self.right(kids[:, :, 1]))


class PlanTreeNet(nn.Module):
    """A plan-tree cardinality model: each node's operator one-hot and the optimizer's own
    estimated rows (``log`` in forward, as the plan's EXPLAIN gives them), two tree
    convolutions, dynamic max pooling over the plan's real nodes, the log-cardinality."""

    def __init__(self):
        super().__init__()
        self.conv1 = TreeConv(N_NODE_TYPES + 1, H)
        self.conv2 = TreeConv(H, H)
        self.head = nn.Linear(H, 1)

    def forward(self, ops, est_rows, children, node_mask):
        x = torch.cat([ops, torch.log(est_rows).unsqueeze(-1) / 10], -1) * node_mask
        h = self.conv2(self.conv1(x, children), children)
        h = h.masked_fill(node_mask == 0, float("-inf")).amax(1)
        return self.head(h).squeeze(-1) + MEAN_LOG_CARD


def make_tree() -> PlanTreeNet:
    torch.manual_seed(0)
    return PlanTreeNet()


def plans(n: int, seed: int = 1) -> TensorDataset:
    """``n`` plans of 3 to 6 nodes (node 0 the null node), a left-deep join tree: operator
    one-hots, estimated rows 1 to 1e6 (1 at the null node), children indices, a node mask,
    and the true cardinality near the root's estimate."""
    g = torch.Generator().manual_seed(seed)
    size = torch.randint(3, NODES, (n,), generator=g)
    node_mask = ((torch.arange(NODES) >= 1) & (torch.arange(NODES) <= size[:, None])).float()
    ops = torch.eye(N_NODE_TYPES)[torch.randint(0, N_NODE_TYPES, (n, NODES), generator=g)]
    ops = ops * node_mask.unsqueeze(-1)
    est = torch.exp(torch.rand(n, NODES, generator=g) * 13.8).round().clamp_min(1)
    est = torch.where(node_mask > 0, est, torch.ones_like(est))
    node = torch.arange(NODES)
    left = torch.where(node + 1 <= size[:, None], node + 1, 0)  # a left-deep chain
    children = torch.stack([left, torch.zeros_like(left)], -1) * node_mask.long().unsqueeze(-1)
    card = (est[:, 1] * torch.exp(0.5 * torch.randn(n, generator=g))).round().clamp_min(1)
    return TensorDataset(ops, est, children, node_mask.unsqueeze(-1), card)


def queries(n: int, seed: int = 0) -> TensorDataset:
    """``n`` synthetic queries: 1 to 3 tables (sample bitmaps drawn), a join per extra table,
    1 to 4 range predicates; the true cardinality a smooth function of them, 10 to 1e7."""
    g = torch.Generator().manual_seed(seed)
    n_t = torch.randint(1, T_MAX + 1, (n,), generator=g)
    n_p = torch.randint(1, P_MAX + 1, (n,), generator=g)
    t_mask = (torch.arange(T_MAX) < n_t[:, None]).float().unsqueeze(-1)
    # a single-table query still has one join slot: MSCN's encoder writes an empty join there
    j_mask = (torch.arange(J_MAX) < (n_t[:, None] - 1).clamp_min(1)).float().unsqueeze(-1)
    p_mask = (torch.arange(P_MAX) < n_p[:, None]).float().unsqueeze(-1)
    tables = torch.cat([torch.eye(N_TABLES)[torch.randint(0, N_TABLES, (n, T_MAX), generator=g)],
                        (torch.rand(n, T_MAX, BITMAP, generator=g) < 0.5).float()], -1)
    joins = torch.eye(F_J)[torch.randint(0, F_J, (n, J_MAX), generator=g)]
    preds = torch.cat([torch.eye(N_COLS)[torch.randint(0, N_COLS, (n, P_MAX), generator=g)],
                       torch.eye(N_OPS)[torch.randint(0, N_OPS, (n, P_MAX), generator=g)],
                       torch.rand(n, P_MAX, 1, generator=g)], -1)
    tables, joins, preds = tables * t_mask, joins * j_mask, preds * p_mask
    sel = (tables[..., N_TABLES:] * t_mask).sum((1, 2)) / (t_mask.sum((1, 2)) * BITMAP)
    log_card = 2.3 + 4.0 * n_t + 3.0 * sel + 0.3 * torch.randn(n, generator=g)
    card = log_card.exp().round()
    return TensorDataset(tables, joins, preds, t_mask, j_mask, p_mask, card)


def label_range(card: torch.Tensor) -> tuple[float, float]:
    """The training set's min and max log-cardinality (MSCN's ``normalize_labels``)."""
    logs = card.log()
    return float(logs.min()), float(logs.max())


def loader(data: TensorDataset, batch: int = B) -> DataLoader:
    return DataLoader(data, batch_size=batch, shuffle=False)


LOG_1E7 = math.log(1e7)
