"""Graph transformers written by hand, as Graphormer and GraphGPS write them in torch, for
``test_graph_transformers``.

- Dense batched graphs: node features ``x`` (B, N, F), adjacency ``adj`` (B, N, N) and a node
  mask (B, N), padded to the batch's largest node count (``collate``).
- ``GraphTransformer``: Graphormer's degree (centrality) embedding, a shortest-path-distance
  attention bias per head (unreachable pairs get the sentinel ``MAX_DIST``), key-padding masks
  of ``-inf``, GraphGPS's random-walk structural encoding (diagonals of powers of ``D^-1 A``)
  and a GCN message-passing branch (``D^-1/2 A D^-1/2``) mixed with global attention, a
  virtual node, and the graph-level readout by masked mean; options: Graphormer's own
  attention with unreachable pairs biased ``-inf`` (``make_gt_unreachable``), SAN's Laplacian
  eigenvector PE from ``torch.linalg.eigh`` of learned edge weights with random sign flips
  (``make_gt_lap``), degree guards on padding only or none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_DIST = 8


def shortest_paths(adj: torch.Tensor) -> torch.Tensor:
    """Hop distances by repeated boolean matmul (Floyd-style BFS), ``MAX_DIST`` if unreachable."""
    n = adj.shape[-1]
    dist = torch.full(adj.shape, MAX_DIST, dtype=torch.long)
    reach = torch.eye(n, dtype=torch.bool).expand_as(adj).clone()
    dist[reach] = 0
    step = adj > 0
    frontier = reach
    for d in range(1, MAX_DIST):
        frontier = (frontier.float() @ step.float()) > 0
        new = frontier & ~reach
        dist[new] = d
        reach = reach | new
    return dist


def random_graph(g: torch.Generator, n: int, feat: int = 8, isolated: bool = False):
    """A ring plus random chords; ``isolated`` cuts node 0 off (a molecule's lone ion)."""
    adj = torch.zeros(n, n)
    idx = torch.arange(n)
    adj[idx, (idx + 1) % n] = 1
    chords = torch.randint(0, n, (n // 2, 2), generator=g)
    adj[chords[:, 0], chords[:, 1]] = 1
    adj = ((adj + adj.T) > 0).float()
    adj.fill_diagonal_(0)
    if isolated:
        adj[0, :] = 0
        adj[:, 0] = 0
    return torch.randn(n, feat, generator=g), adj


def collate(graphs, targets):
    """Pads a list of (x, adj) to the largest node count: (x, adj, mask, spd, y)."""
    n = max(x.shape[0] for x, _ in graphs) if graphs else 1
    b, feat = len(graphs), graphs[0][0].shape[1]
    x, adj = torch.zeros(b, n, feat), torch.zeros(b, n, n)
    mask = torch.zeros(b, n, dtype=torch.bool)
    for i, (xi, ai) in enumerate(graphs):
        k = xi.shape[0]
        x[i, :k], adj[i, :k, :k], mask[i, :k] = xi, ai, True
    return x, adj, mask, shortest_paths(adj), torch.stack(targets)


class GraphLayer(nn.Module):
    """One GraphGPS layer: GCN message passing plus Graphormer-biased global attention."""

    def __init__(self, dim: int, heads: int, unreachable_inf: bool = False):
        super().__init__()
        self.heads, self.unreachable_inf = heads, unreachable_inf
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.spd_bias = nn.Embedding(MAX_DIST + 1, heads)
        self.gcn = nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def graphormer_attention(self, h, bias, mask):
        """Graphormer's own attention: scores plus the SPD bias, key padding, softmax."""
        b, n, d = h.shape
        q, k, v = F.linear(h, self.attn.in_proj_weight, self.attn.in_proj_bias).chunk(3, -1)
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + bias
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        out = torch.softmax(scores, -1) @ v
        return self.attn.out_proj(out.transpose(1, 2).reshape(b, n, d))

    def forward(self, h, a_norm, spd, mask):
        b, n, _ = h.shape
        bias = self.spd_bias(spd).permute(0, 3, 1, 2)  # (B, heads, N, N)
        if self.unreachable_inf:  # the bug: a padded node reaches nothing, its row all -inf
            bias = bias.masked_fill((spd == MAX_DIST)[:, None], float("-inf"))
            att = self.graphormer_attention(h, bias, mask)
        else:
            bias = bias.masked_fill(~mask[:, None, None, :], float("-inf"))
            bias = bias.reshape(b * self.heads, n, n)
            att, _ = self.attn(h, h, h, attn_mask=bias, need_weights=False)
        local = self.gcn(a_norm @ h)
        h = self.norm1(h + att + local)
        return self.norm2(h + self.ffn(h))


class GraphTransformer(nn.Module):
    """Degree embedding + RWSE + virtual node, two GPS layers, masked-mean readout."""

    def __init__(self, feat: int = 8, dim: int = 32, heads: int = 4, walk: int = 4,
                 guard_degree: bool | str = False, guard_empty: bool = False, lap_pe: int = 0,
                 unreachable_inf: bool = False):
        super().__init__()
        self.lap_pe, self.lap_pe_unguarded = lap_pe, False
        if lap_pe:
            self.edge_gate = nn.Linear(feat, 1)  # learned edge weights (graph structure learning)
            self.lap = nn.Linear(lap_pe, dim)
        self.walk, self.guard_degree, self.guard_empty = walk, guard_degree, guard_empty
        self.embed = nn.Linear(feat, dim)
        self.degree = nn.Embedding(16, dim)
        self.rwse = nn.Linear(walk, dim)
        self.virtual = nn.Parameter(torch.zeros(dim))
        self.layers = nn.ModuleList(GraphLayer(dim, heads, unreachable_inf) for _ in range(2))
        self.head = nn.Linear(dim, 1)

    def encodings(self, adj, mask):
        """GraphGPS's RWSE: diag((D^-1 A)^k), k = 1..walk, and the GCN's D^-1/2 A D^-1/2."""
        deg = adj.sum(-1)
        if self.guard_degree == "padding":  # padded nodes get degree 1, a real lone node 0
            deg = deg.masked_fill(~mask, 1.0)
        if self.guard_degree is True:  # PyG's gcn_norm: an isolated node's 1/deg is set to 0
            inv = torch.where(deg > 0, 1.0 / deg.clamp(min=1), torch.zeros_like(deg))
        else:
            inv = 1.0 / deg  # the bug: deg 0 for an isolated node
        walk = inv[..., None] * adj
        inv_sqrt = inv.sqrt()
        a_norm = inv_sqrt[..., None] * adj * inv_sqrt[..., None, :]
        p, diags = walk, []
        for _ in range(self.walk):
            diags.append(torch.diagonal(p, dim1=-2, dim2=-1))
            p = p @ walk
        return torch.stack(diags, -1), a_norm, deg

    def laplacian_pe(self, x, adj):
        """SAN/GraphGPS's LapPE: eigenvectors of I - D^-1/2 W D^-1/2 with learned edge weights
        W, a random sign flip per eigenvector while training."""
        gate = torch.sigmoid(self.edge_gate(x))
        w = adj * gate * gate.transpose(-1, -2)
        deg = w.sum(-1)
        if self.lap_pe_unguarded:  # the bug: a padded or isolated node's deg^-1/2 is inf
            inv_sqrt = deg.rsqrt()
        else:
            inv_sqrt = torch.where(deg > 0, deg.clamp(min=1e-6).rsqrt(), torch.zeros_like(deg))
        eye = torch.eye(adj.shape[-1]).expand_as(adj)
        lap = eye - inv_sqrt[..., None] * w * inv_sqrt[..., None, :]
        _, vecs = torch.linalg.eigh(lap)
        pe = vecs[..., : self.lap_pe]
        if self.training:
            pe = pe * (torch.randint(0, 2, (pe.shape[0], 1, self.lap_pe)) * 2 - 1)
        return self.lap(pe)

    def forward(self, x, adj, mask, spd):
        rw, a_norm, deg = self.encodings(adj, mask)
        h = self.embed(x) + self.degree(deg.long().clamp(max=15)) + self.rwse(rw)
        if self.lap_pe:
            h = h + self.laplacian_pe(x, adj)
        h = h + self.virtual  # the virtual node's state broadcast to every node
        for layer in self.layers:
            h = layer(h, a_norm, spd, mask)
        m = mask[..., None].to(h.dtype)
        count = m.sum(1)
        if self.guard_empty:
            count = count.clamp(min=1)
        pooled = (h * m).sum(1) / count  # masked mean over real nodes
        return self.head(pooled).squeeze(-1)


def make_gt() -> GraphTransformer:
    torch.manual_seed(0)
    return GraphTransformer()


def make_gt_guarded() -> GraphTransformer:
    torch.manual_seed(0)
    return GraphTransformer(guard_degree=True, guard_empty=True)


def make_gt_guard_degree() -> GraphTransformer:
    torch.manual_seed(0)
    return GraphTransformer(guard_degree=True)


def make_gt_lap() -> GraphTransformer:
    torch.manual_seed(0)
    return GraphTransformer(guard_degree=True, guard_empty=True, lap_pe=3)


def make_gt_unreachable() -> GraphTransformer:
    torch.manual_seed(0)
    return GraphTransformer(guard_degree=True, guard_empty=True, unreachable_inf=True)


def make_gt_pad_degree() -> GraphTransformer:
    torch.manual_seed(0)
    return GraphTransformer(guard_degree="padding", guard_empty=True)


def make_gt_lap_unguarded() -> GraphTransformer:
    model = make_gt_lap()
    model.lap_pe_unguarded = True
    return model
