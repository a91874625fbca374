"""Deep graph generation as GraphVAE / GraphRNN / GRAN code writes it, for
``test_graph_generation``. Graphs of 3 to ``NMAX`` nodes are BFS-ordered, padded into one
dense batch ``(B, NMAX, NMAX)`` by a ``collate_fn`` with a node mask ``(B, NMAX)``.

- ``GraphVAE``: a dense GCN encoder over ``D^-1/2 (A + I) D^-1/2`` (self-loops at real nodes
  only, so a padded node has degree 0; ``guard`` zeroes its ``deg^-1/2`` as PyG's gcn_norm
  does), a masked mean readout, ``mu`` and ``logvar`` from linear layers, the
  reparameterisation trick, an MLP decoder of the upper triangle's edge logits and a
  node-count head.
- ``GraphRNN``: the edge-level model over BFS adjacency vectors ``(B, NMAX, M)`` (each node's
  edges to its M predecessors), a GRU over nodes, a per-step MLP of edge logits.
- ``GraphVAELoss``: edge BCE over the upper triangle of real nodes, KL with an annealed
  ``beta``, the node-count NLL; optionally Simonovsky's graph matching (a Sinkhorn-normalised
  soft assignment of predicted to target nodes, ``exp(S / tau)``), a molecular valence
  penalty (each atom's expected degree past its maximum valence, as a per-graph L2 norm), and
  the node-count prior of the training set's size histogram.
- ``GraphRNNLoss``: the graph's likelihood as the product of its edge probabilities (the
  paper's formula), or its log-likelihood as a sum of BCE terms (``guard``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NMAX, FEAT, LATENT, M_PREV = 8, 4, 8, 4
MAX_VALENCE = 4.0  # carbon


# ---------------------------------------------------------------------------------------------
# Data: random graphs, BFS order, collate padding

def bfs_order(adj: torch.Tensor) -> list[int]:
    n, seen, order = adj.shape[0], {0}, [0]
    for u in order:
        for v in torch.nonzero(adj[u]).flatten().tolist():
            if v not in seen:
                seen.add(v)
                order.append(v)
    return order + [v for v in range(n) if v not in seen]


def random_graph(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A connected graph of ``n`` nodes (a random tree plus a few chords), BFS-ordered, with
    one-hot atom types as node features."""
    adj = torch.zeros(n, n)
    for v in range(1, n):
        u = int(torch.randint(0, v, (1,), generator=g))
        adj[u, v] = adj[v, u] = 1.0
    extra = (torch.rand(n, n, generator=g) < 0.15).float().triu(1)
    adj = ((adj + extra + extra.T) > 0).float()
    order = bfs_order(adj)
    adj = adj[order][:, order]
    x = F.one_hot(torch.randint(0, FEAT, (n,), generator=g), FEAT).float()
    return x, adj


def random_graphs(seed: int, count: int, lo: int = 3, hi: int = NMAX, bad: int | None = None,
                  kind: str = "") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` graphs of ``lo`` to ``hi`` nodes; graph ``bad`` is planted as ``kind``:
    ``"full"`` has ``NMAX`` nodes (no padding), ``"scale"`` has its features off the one-hot
    scale by 1e5 (a record whose atom features a converter wrote in other units);
    ``"charge"`` gives every graph a partial-charge feature (its last), NaN at one atom of
    graph ``bad``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        if kind == "full" and i == bad:
            n = NMAX
        x, adj = random_graph(g, n)
        if kind == "scale" and i == bad:
            x = x * 1e5
        if kind == "charge":  # a partial-charge feature, as RDKit's Gasteiger charges give
            x = torch.cat([x, torch.rand(n, 1, generator=g) - 0.5], 1)[:, 1:]
            if i == bad:
                x[n // 2, -1] = float("nan")  # Gasteiger's NaN for an atom it has no parameters for
        out.append((x, adj))
    return out


def collate(graphs, nmax: int = NMAX):
    """Pad ``[(x (n, F), adj (n, n))]`` into ``x (B, nmax, F)``, ``adj (B, nmax, nmax)``,
    ``mask (B, nmax)`` and ``n (B,)``, as a DataLoader's ``collate_fn``."""
    b = len(graphs)
    x, adj, mask = torch.zeros(b, nmax, FEAT), torch.zeros(b, nmax, nmax), torch.zeros(b, nmax)
    n = torch.zeros(b, dtype=torch.long)
    for i, (xi, ai) in enumerate(graphs):
        k = xi.shape[0]
        x[i, :k], adj[i, :k, :k], mask[i, :k], n[i] = xi, ai, 1.0, k
    return x, adj, mask, n


class GraphSet(torch.utils.data.Dataset):
    def __init__(self, graphs):
        self.graphs = graphs

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, i):
        return self.graphs[i]


def loader(graphs, batch_size: int = 6, nmax: int = NMAX):
    return torch.utils.data.DataLoader(GraphSet(graphs), batch_size=batch_size, shuffle=False,
                                       collate_fn=lambda gs: collate(gs, nmax))


def bfs_sequences(adj: torch.Tensor) -> torch.Tensor:
    """GraphRNN's input: for each node i, its edges to nodes i-1 ... i-M, ``(B, N, M)``."""
    b, n = adj.shape[:2]
    seq = torch.zeros(b, n, M_PREV)
    for i in range(1, n):
        for k in range(M_PREV):
            if i - 1 - k >= 0:
                seq[:, i, k] = adj[:, i, i - 1 - k]
    return seq


# ---------------------------------------------------------------------------------------------
# GraphVAE

def gcn_norm(adj: torch.Tensor, mask: torch.Tensor, guard: bool) -> torch.Tensor:
    a = adj + torch.diag_embed(mask)  # self-loops at real nodes only
    deg = a.sum(-1)
    d = deg.pow(-0.5)
    if guard:
        d = d.masked_fill(deg == 0, 0.0)
    return d[:, :, None] * a * d[:, None, :]  # padded nodes: inf * 0


class DenseGCN(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.lin = nn.Linear(cin, cout)

    def forward(self, x, a_hat):
        return torch.relu(a_hat @ self.lin(x))


class GraphVAE(nn.Module):
    def __init__(self, guard: bool = True, hidden: int = 16):
        super().__init__()
        self.guard = guard
        self.gc1, self.gc2 = DenseGCN(FEAT, hidden), DenseGCN(hidden, hidden)
        self.mu, self.logvar = nn.Linear(hidden, LATENT), nn.Linear(hidden, LATENT)
        self.dec = nn.Sequential(nn.Linear(LATENT, 32), nn.ReLU(), nn.Linear(32, NMAX * NMAX))
        self.count = nn.Linear(LATENT, NMAX + 1)
        self.node_dec = nn.Linear(LATENT, NMAX * FEAT)

    def forward(self, x, adj, mask):
        a_hat = gcn_norm(adj, mask, self.guard)
        h = self.gc2(self.gc1(x, a_hat), a_hat)
        h = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        logits = self.dec(z).view(-1, NMAX, NMAX)
        logits = (logits + logits.transpose(1, 2)) / 2
        nodes = self.node_dec(z).view(-1, NMAX, FEAT)
        return logits, mu, logvar, self.count(z), nodes


class GraphVAELoss(nn.Module):
    """The GraphVAE objective, written as the repositories write it."""

    def __init__(self, beta: float = 0.0, matching: bool = False, tau: float = 1.0,
                 valence: float = 0.0, size_hist: torch.Tensor | None = None,
                 stable_kl: bool = True, pad_self: bool = True):
        super().__init__()
        self.pad_self = pad_self
        self.beta, self.matching, self.tau, self.valence = beta, matching, tau, valence
        self.stable_kl = stable_kl
        self.register_buffer("size_hist", size_hist if size_hist is not None
                             else torch.ones(NMAX + 1))

    def sinkhorn(self, s: torch.Tensor, iters: int = 5) -> torch.Tensor:
        p = torch.exp(s / self.tau)  # no max subtracted: overflows for a small tau
        for _ in range(iters):
            p = p / p.sum(-1, keepdim=True)
            p = p / p.sum(-2, keepdim=True)
        return p

    def forward(self, out, adj, x, mask, n):
        logits, mu, logvar, count, nodes = out
        if self.matching:  # permute the target to the prediction's node order
            s = torch.einsum("bif,bjf->bij", torch.softmax(nodes, -1), x)
            s = s - (1 - mask[:, None, :]) * 1e4  # no real node matches a padded one
            if self.pad_self:  # a padded target node matches itself: its column is not empty
                s = s + torch.diag_embed(1 - mask) * 1e4
            perm = self.sinkhorn(s)
            adj = perm @ adj @ perm.transpose(1, 2)
        pair = (mask[:, :, None] * mask[:, None, :]).triu(1)
        bce = F.binary_cross_entropy_with_logits(logits, adj, reduction="none")
        rec = (bce * pair).sum((1, 2)) / pair.sum((1, 2)).clamp_min(1)
        if self.stable_kl:
            kl = -0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum(-1)
        else:  # KL of N(mu, sigma) from N(0, 1) through sigma = exp(logvar / 2)
            sigma = torch.exp(0.5 * logvar)
            kl = (-torch.log(sigma) + (sigma ** 2 + mu ** 2) / 2 - 0.5).sum(-1)
        loss = rec + self.beta * kl + F.cross_entropy(count, n, reduction="none")
        prior = self.size_hist / self.size_hist.sum()
        loss = loss - torch.log(prior[n])  # the training set's node-count distribution
        if self.valence:
            expected = torch.sigmoid(logits) * pair
            deg = expected.sum(-1) + expected.sum(-2)
            excess = (deg - MAX_VALENCE) * (deg > MAX_VALENCE)  # past the valence only
            loss = loss + self.valence * (excess ** 2).sum(-1).sqrt()  # sqrt at 0 in backward
        return loss.mean()


# ---------------------------------------------------------------------------------------------
# GraphRNN

class GraphRNN(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.embed = nn.Linear(M_PREV, hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.out = nn.Sequential(nn.Linear(hidden, 32), nn.ReLU(), nn.Linear(32, M_PREV))

    def forward(self, seq, mask):
        inp = torch.cat([torch.ones_like(seq[:, :1]), seq[:, :-1]], 1)  # SOS, then teacher forcing
        h, _ = self.rnn(torch.relu(self.embed(inp)))
        return self.out(h)  # logits of node i's edges to its M predecessors


class GraphRNNLoss(nn.Module):
    def __init__(self, guard: bool = True):
        super().__init__()
        self.guard = guard

    def forward(self, logits, seq, mask):
        valid = mask[:, :, None].expand_as(seq).clone()
        valid[:, 0] = 0
        if self.guard:
            nll = F.binary_cross_entropy_with_logits(logits, seq, reduction="none")
            return ((nll * valid).sum((1, 2))).mean()
        p = torch.sigmoid(logits)
        lik = torch.where(seq > 0, p, 1 - p)
        lik = torch.where(valid > 0, lik, torch.ones_like(lik))
        return -torch.log(lik.flatten(1).prod(-1)).mean()  # p(G) as the product of its edges


# ---------------------------------------------------------------------------------------------
# Factories

def make_vae():
    torch.manual_seed(0)
    return GraphVAE(guard=True)


def make_vae_unguarded():
    torch.manual_seed(0)
    return GraphVAE(guard=False)


def make_rnn():
    torch.manual_seed(0)
    return GraphRNN()
