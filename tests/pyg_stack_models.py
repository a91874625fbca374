"""Graph learning with PyTorch Geometric as its users write it: ``Data`` graphs joined into a
``Batch`` by ``torch_geometric.loader.DataLoader``, GCN/GAT/SAGE/GIN convolutions, a
``global_mean_pool`` readout over the batch vector for graph regression, and a node
classifier trained on a ``train_mask``. Each generator can plant one failure in one graph of
one step's batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_geometric.nn import (
    GATConv,
    GCNConv,
    GINConv,
    SAGEConv,
    global_add_pool,
    global_mean_pool,
)
from torch_geometric.utils import degree

D_IN, HIDDEN, GRAPHS, BATCH, EDGE_DIM = 6, 16, 16, 4, 3


# ---------------------------------------------------------------------------------------------
# Graph regression: a GNN over a Batch, read out per graph


class MeanAggConv(nn.Module):
    """A hand-written message passing: each node's mean neighbour message, the sum of its
    incoming messages divided by its in-degree."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x, edge_index):
        src, dst = edge_index
        msg = self.lin(x)[src]
        agg = torch.zeros(x.size(0), msg.size(1), dtype=msg.dtype).index_add_(0, dst, msg)
        deg = degree(dst, x.size(0), dtype=msg.dtype).unsqueeze(-1)
        return agg / deg  # the bug: a node with no incoming edge is 0/0


class GraphRegressor(nn.Module):
    """conv -> conv -> global pool -> head: molecule-style property regression."""

    def __init__(self, conv: str = "gcn", pool: str = "mean", d_in: int = D_IN,
                 hidden: int = HIDDEN, heads: int = 2):
        super().__init__()
        self.kind = conv
        if conv == "gcn":
            self.conv1, self.conv2 = GCNConv(d_in, hidden), GCNConv(hidden, hidden)
        elif conv == "gat":
            self.conv1 = GATConv(d_in, hidden // heads, heads=heads)
            self.conv2 = GATConv(hidden, hidden // heads, heads=heads)
        elif conv == "sage":
            self.conv1, self.conv2 = SAGEConv(d_in, hidden), SAGEConv(hidden, hidden)
        elif conv == "gin":
            self.conv1 = GINConv(nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(),
                                               nn.Linear(hidden, hidden)))
            self.conv2 = GINConv(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(),
                                               nn.Linear(hidden, hidden)))
        else:  # "mean_agg"
            self.conv1, self.conv2 = MeanAggConv(d_in, hidden), MeanAggConv(hidden, hidden)
        self.pool = pool
        self.head = nn.Linear(hidden, 1)
        assert pool in ("mean", "add", "mean_std", "manual"), pool

    def forward(self, data):
        x, edge_index, batch = data.x, data.edge_index, data.batch
        x = F.elu(self.conv1(x, edge_index))
        x = F.elu(self.conv2(x, edge_index))
        if self.pool == "mean":
            g = global_mean_pool(x, batch, size=data.num_graphs)
        elif self.pool == "add":
            g = global_add_pool(x, batch, size=data.num_graphs)
        elif self.pool == "mean_std":  # mean and std readout (PNA-style moments)
            mean = global_mean_pool(x, batch, size=data.num_graphs)
            var = global_mean_pool((x - mean[batch]) ** 2, batch, size=data.num_graphs)
            g = mean + var.sqrt()  # the bug: sqrt's gradient at a var of 0 (one node) is inf
        else:  # "manual": a hand-written mean over the batch vector
            total = torch.zeros(data.num_graphs, x.size(1)).index_add_(0, batch, x)
            count = torch.bincount(batch, minlength=data.num_graphs).unsqueeze(-1)
            g = total / count  # the bug: a graph with no node is 0/0
        return self.head(g).squeeze(-1)


def make_regressor(**kw) -> GraphRegressor:
    torch.manual_seed(0)
    return GraphRegressor(**kw)


class EdgeRegressor(nn.Module):
    """GAT with bond features (``edge_dim``), called as ``model(x, edge_index, edge_attr,
    batch)``."""

    def __init__(self, d_in: int = D_IN, hidden: int = HIDDEN, heads: int = 2):
        super().__init__()
        self.conv1 = GATConv(d_in, hidden // heads, heads=heads, edge_dim=EDGE_DIM)
        self.conv2 = GATConv(hidden, hidden // heads, heads=heads, edge_dim=EDGE_DIM)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x, edge_index, edge_attr, batch):
        x = F.elu(self.conv1(x, edge_index, edge_attr))
        x = F.elu(self.conv2(x, edge_index, edge_attr))
        return self.head(global_mean_pool(x, batch)).squeeze(-1)


def make_edge_regressor(**kw) -> EdgeRegressor:
    torch.manual_seed(0)
    return EdgeRegressor(**kw)


def _graph(g: torch.Generator, n: int, ring: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` nodes: a ring plus a few chords, both directions."""
    x = torch.randn(n, D_IN, generator=g)
    if not ring or n < 2:
        return x, torch.empty(2, 0, dtype=torch.long)
    i = torch.arange(n)
    src = torch.cat([i, (i + 1) % n])
    dst = torch.cat([(i + 1) % n, i])
    return x, torch.stack([src, dst])


def graphs(plant: str = "none", step: int = 2, bad: int = 1, scale: float = 1.0) -> list[Data]:
    """``GRAPHS`` small molecules-ish graphs, targets a smooth function of the features. Graph
    ``step * BATCH + bad`` (the ``bad``-th graph of batch ``step``) carries the planted fault:
    ``nan_x`` a NaN feature on its node 2 (a bad record), ``no_edges`` no edges at all,
    ``isolated`` its last node with no edge, ``empty`` no node, ``single`` one node,
    ``huge`` features of ``scale``, ``nan_edge`` a NaN bond feature on its second edge."""
    g, ge = torch.Generator().manual_seed(1), torch.Generator().manual_seed(3)
    out = []
    for k in range(GRAPHS):
        n = 4 + k % 3
        planted = k == step * BATCH + bad
        x, ei = _graph(g, n, ring=not (planted and plant == "no_edges"))
        if planted and plant == "nan_x":
            x[2, 3] = float("nan")
        if planted and plant == "isolated":  # the last node keeps no edge
            keep = (ei < n - 1).all(0)
            ei = ei[:, keep]
        if planted and plant in ("empty", "single"):
            keep = 0 if plant == "empty" else 1
            x, ei = x[:keep], ei[:, :0]
        if planted and plant == "huge":
            x = x * scale
        y = torch.tensor([float(x.sum()) / max(n, 1) if x.numel() else 0.0])
        edge_attr = torch.rand(ei.size(1), EDGE_DIM, generator=ge)  # bond features
        if planted and plant == "nan_edge":  # a bond whose length the parser could not read
            edge_attr[1, 0] = float("nan")
        out.append(Data(x=x, edge_index=ei, edge_attr=edge_attr, y=y))
    return out


def loader(plant: str = "none", step: int = 2, bad: int = 1, **kw) -> DataLoader:
    return DataLoader(graphs(plant, step, bad, **kw), batch_size=BATCH, shuffle=False)


# ---------------------------------------------------------------------------------------------
# Node classification on one graph with a train mask


class NodeClassifier(nn.Module):
    """Two GAT layers (Cora's recipe), called as ``model(x, edge_index)``."""

    def __init__(self, d_in: int = D_IN, hidden: int = 8, classes: int = 3, heads: int = 2):
        super().__init__()
        self.conv1 = GATConv(d_in, hidden, heads=heads)
        self.conv2 = GATConv(hidden * heads, classes, heads=1)

    def forward(self, x, edge_index):
        x = F.elu(self.conv1(x, edge_index))
        return self.conv2(x, edge_index)


def make_node_classifier(**kw) -> NodeClassifier:
    torch.manual_seed(0)
    return NodeClassifier(**kw)


def citation_graph(n: int = 30, classes: int = 3) -> Data:
    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(n, D_IN, generator=g) + y[:, None].float()
    src = torch.randint(0, n, (4 * n,), generator=g)
    dst = torch.randint(0, n, (4 * n,), generator=g)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[: n // 2] = True
    return Data(x=x, edge_index=torch.stack([src, dst]), y=y, train_mask=mask)


class MaskedNLL(nn.Module):
    """A loss wrapper: cross entropy over the nodes of ``mask``, divided by their count."""

    def forward(self, logits, y, mask):
        per_node = F.cross_entropy(logits, y, reduction="none")
        return (per_node * mask).sum() / mask.sum()  # the bug: an empty mask is 0/0
