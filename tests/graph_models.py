"""Graph networks written with plain PyTorch, as GNN projects write them without an extension
library: a GCN over a batch of graphs concatenated node by node, with PyG's ``batch`` vector
assigning each node row to its graph, and a global mean pooling (``test_graph_batches.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GCNConv(nn.Module):
    """Kipf & Welling's propagation, symmetric normalisation over the edges given (self loops
    included by the data)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=False)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x, edge_index):
        x = self.lin(x)
        row, col = edge_index
        deg = torch.zeros(x.size(0), device=x.device).index_add_(
            0, col, torch.ones(col.numel(), device=x.device))
        dinv = deg.pow(-0.5)
        w = (dinv[row] * dinv[col]).unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, col, x[row] * w) + self.bias


class MeanPool(nn.Module):
    """Each graph's mean node embedding (torch_geometric's ``global_mean_pool``)."""

    def forward(self, x, batch, num_graphs: int):
        total = torch.zeros(num_graphs, x.size(1), device=x.device).index_add_(0, batch, x)
        count = torch.bincount(batch, minlength=num_graphs).unsqueeze(-1)
        return total / count  # the bug: a graph with no node is 0/0


def max_pool(x, batch, num_graphs: int):
    """Each graph's largest node embedding, torch_scatter's way: a scatter max from -inf."""
    start = torch.full((num_graphs, x.size(1)), float("-inf"), device=x.device)
    return start.scatter_reduce(0, batch[:, None].expand_as(x), x, "amax", include_self=True)


class GraphClassifier(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 32, classes: int = 3, pool: str = "mean"):
        super().__init__()
        self.conv1 = GCNConv(d_in, hidden)
        self.conv2 = GCNConv(hidden, hidden)
        self.pool = MeanPool() if pool == "mean" else None
        self.pooling = pool
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, edge_index, batch, num_graphs: int):
        x = F.relu(self.conv1(x, edge_index))
        x = F.relu(self.conv2(x, edge_index))
        if self.pool is not None:
            pooled = self.pool(x, batch, num_graphs)
        elif self.pooling == "max":
            pooled = max_pool(x, batch, num_graphs)
        else:  # a mean per graph over its run of node rows
            lengths = torch.bincount(batch, minlength=num_graphs)
            pooled = torch.segment_reduce(x, "mean", lengths=lengths, axis=0)
        return self.head(pooled)


def graph_classifier(pool: str = "mean") -> nn.Module:
    torch.manual_seed(0)
    return GraphClassifier(pool=pool)


def molecule(g: torch.Generator, n: int) -> torch.Tensor:
    """The edges of a ring of ``n`` atoms with random chords, both ways, and self loops."""
    if n == 0:
        return torch.zeros(2, 0, dtype=torch.long)
    src = torch.arange(n)
    dst = (src + 1) % n
    chords = torch.randint(0, n, (2, n), generator=g)
    return torch.cat([torch.stack([src, dst]), torch.stack([dst, src]), chords, chords.flip(0),
                      torch.stack([src, src])], 1)


def collate(graphs):
    """PyG's ``Batch.from_data_list``: nodes and edges concatenated, edge indices shifted, and
    the ``batch`` vector."""
    xs, edges, batch, ys, offset = [], [], [], [], 0
    for i, (x, edge_index, y) in enumerate(graphs):
        xs.append(x)
        edges.append(edge_index + offset)
        batch.append(torch.full((x.size(0),), i))
        ys.append(y)
        offset += x.size(0)
    return torch.cat(xs), torch.cat(edges, 1), torch.cat(batch), torch.stack(ys)


class GATLayer(nn.Module):
    """Graph attention with the edge softmax written out (exp, sum per node with
    ``index_add_``, divide): no max subtracted first."""

    def __init__(self, d_in: int, d_out: int, heads: int):
        super().__init__()
        self.heads, self.d_out = heads, d_out
        self.lin = nn.Linear(d_in, heads * d_out, bias=False)
        self.att_src = nn.Parameter(torch.randn(1, heads, d_out) * 0.1)
        self.att_dst = nn.Parameter(torch.randn(1, heads, d_out) * 0.1)

    def forward(self, x, edge_index):
        src, dst = edge_index
        h = self.lin(x).view(-1, self.heads, self.d_out)
        score = (h * self.att_src).sum(-1)[src] + (h * self.att_dst).sum(-1)[dst]
        ex = F.leaky_relu(score, 0.2).exp()
        denom = torch.zeros(x.size(0), self.heads).index_add_(0, dst, ex)
        alpha = (ex / denom[dst]).unsqueeze(-1)
        return torch.zeros_like(h).index_add_(0, dst, h[src] * alpha).flatten(1)


class NodeGAT(nn.Module):
    """Full-batch node classification (a citation graph): every node a sample."""

    def __init__(self, d_in: int = 16, classes: int = 4):
        super().__init__()
        self.gat1 = GATLayer(d_in, 8, heads=4)
        self.gat2 = GATLayer(32, classes, heads=1)

    def forward(self, x, edge_index):
        return self.gat2(F.elu(self.gat1(x, edge_index)), edge_index)


def node_gat() -> nn.Module:
    torch.manual_seed(0)
    return NodeGAT()


def normalized_adjacency(edge_index: torch.Tensor, n: int, clamp: bool = True) -> torch.Tensor:
    """D^-1/2 A D^-1/2 as a sparse COO matrix, built by the data code (Kipf's pygcn);
    ``clamp=False`` is the version without ``deg.clamp(min=1)``: a node no edge reaches has
    degree 0, and 0 ** -0.5 is inf."""
    row, col = edge_index
    deg = torch.zeros(n).index_add_(0, col, torch.ones(col.numel()))
    dinv = (deg.clamp(min=1) if clamp else deg).pow(-0.5)
    return torch.sparse_coo_tensor(torch.stack([col, row]), dinv[row] * dinv[col], (n, n))


class GraphConvolution(nn.Module):
    """pygcn's layer on a sparse adjacency, its output rows scaled to unit length
    (GraphSAGE's normalisation, written out)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x, adj):
        h = torch.sparse.mm(adj, self.lin(x))
        return h / h.norm(dim=1, keepdim=True)  # a node no edge reaches: 0 / 0


class SparseGCN(nn.Module):
    def __init__(self, d_in: int = 16, classes: int = 4):
        super().__init__()
        self.gc1 = GraphConvolution(d_in, 32)
        self.out = nn.Linear(32, classes)

    def forward(self, x, adj):
        return self.out(torch.sparse.mm(adj, F.relu(self.gc1(x, adj))))


def sparse_gcn() -> nn.Module:
    torch.manual_seed(0)
    return SparseGCN()


class DenseGCN(nn.Module):
    """A GCN on a small graph's dense ``(N, N)`` adjacency (with self loops), normalised in
    the forward as D^-1/2 A D^-1/2 with a diagonal matrix: a node cut out of the graph has
    degree 0, and 0 ** -0.5 times the zeros of its row and column is NaN."""

    def __init__(self, d_in: int = 8, classes: int = 3):
        super().__init__()
        self.l1 = nn.Linear(d_in, 32)
        self.l2 = nn.Linear(32, classes)

    def forward(self, x, adj):
        dinv = torch.diag(adj.sum(1).pow(-0.5))
        a = dinv @ adj @ dinv
        return a @ self.l2(F.relu(a @ self.l1(x)))


def dense_gcn() -> nn.Module:
    torch.manual_seed(0)
    return DenseGCN()
