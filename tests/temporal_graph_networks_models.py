"""Temporal graph networks for link prediction on event streams, written as TGN (Rossi et al.,
twitter-research/tgn), TGAT and JODIE write them in torch, for ``test_temporal_graph_networks``.

- ``TimeEncode``: TGAT's functional time encoding ``cos(w * dt + b)`` with learnable
  frequencies initialised to ``1 / 10 ** linspace(0, 9, d)``.
- ``TGN``: a per-node memory (a buffer, detached between batches) updated by a ``GRUCell``
  from messages ``[s_src, s_dst, phi(dt), e]``; ``dt`` since each node's last update is
  normalised by JODIE's running mean/std of time gaps (buffers updated every batch); node
  embeddings by graph attention over the most recent ``k`` temporal neighbours (padded, with a
  mask: ``-inf`` scores for padding), each neighbour a key of its memory, edge feature and
  time encoding; a link predictor MLP over ``[z_src, z_dst]``. ``forward(src, dst, neg, t,
  e, nbr_ids, nbr_t, nbr_e, nbr_mask)`` takes the batch's events with their randomly sampled
  negative destinations and the neighbours of the ``3B`` nodes ``cat([src, dst, neg])`` the
  loop's neighbour finder sampled; it returns the positive and negative logits.
- ``NeighborFinder`` and ``event_stream``: the loop's side: a stream of consecutive events,
  each node's most recent ``k`` neighbours before a batch, padded with node 0 and a mask.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

NODES, MEM, TIME, EDGE, K, B = 40, 16, 8, 4, 4, 12


class TimeEncode(nn.Module):
    """TGAT's ``cos(w dt + b)``, frequencies ``1 / 10 ** linspace(0, 9)`` learned."""

    def __init__(self, dim: int = TIME):
        super().__init__()
        self.w = nn.Linear(1, dim)
        with torch.no_grad():
            self.w.weight.copy_(torch.from_numpy(1 / 10 ** np.linspace(0, 9, dim)).float()[:, None])
            self.w.bias.zero_()

    def forward(self, dt):
        return torch.cos(self.w(dt.unsqueeze(-1)))


class TemporalAttention(nn.Module):
    """TGAT's attention of a node (its memory and phi(0)) over its temporal neighbours (their
    memory, edge feature and phi(t - t_j)); padding scores are ``-inf``. ``fix_empty``: TGN's
    own guard: a node with no neighbours yet unmasks its first (padding) slot, and its
    attention output is zeroed after; ``zero_after``: TGAT's half of it, the output zeroed
    after only (the softmax's NaN row kept out of the forward, not out of its backward)."""

    def __init__(self, heads: int = 2, fix_empty: bool = True, zero_after: bool = False):
        super().__init__()
        self.heads, self.fix_empty, self.zero_after = heads, fix_empty, zero_after
        q_dim, kv_dim = MEM + TIME, MEM + EDGE + TIME
        self.q, self.k, self.v = nn.Linear(q_dim, MEM), nn.Linear(kv_dim, MEM), nn.Linear(kv_dim, MEM)
        self.out = nn.Linear(MEM + MEM, MEM)

    def forward(self, h, t_enc0, nbr_h, nbr_e, nbr_t_enc, mask):
        n, k = mask.shape
        empty = ~mask.any(1, keepdim=True)
        if self.fix_empty:
            mask = mask.clone()
            mask[empty.squeeze(1), 0] = True
        d = MEM // self.heads
        q = self.q(torch.cat([h, t_enc0], -1)).view(n, 1, self.heads, d).transpose(1, 2)
        kv = torch.cat([nbr_h, nbr_e, nbr_t_enc], -1)
        key = self.k(kv).view(n, k, self.heads, d).transpose(1, 2)
        val = self.v(kv).view(n, k, self.heads, d).transpose(1, 2)
        scores = q @ key.transpose(-1, -2) / d ** 0.5
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        attn = scores.softmax(-1)  # a node with no neighbours: a row of -inf only
        ctx = (attn @ val).transpose(1, 2).reshape(n, MEM)
        if self.fix_empty or self.zero_after:
            ctx = ctx.masked_fill(empty, 0.0)
        return self.out(torch.cat([ctx, h], -1))


class MultiHeadTemporalAttention(nn.Module):
    """TGN's own ``TemporalAttentionLayer``: ``nn.MultiheadAttention`` of the node's
    ``[h, phi(0)]`` over its neighbours' ``[h_j, e_j, phi(t - t_j)]`` with a
    ``key_padding_mask`` (True: padding), then a merger MLP. ``need_weights`` as TGN calls it
    (the default, True: the weights are returned, computed by an explicit softmax); False
    takes the fused kernel."""

    def __init__(self, heads: int = 2, need_weights: bool = True):
        super().__init__()
        self.need_weights = need_weights
        self.mha = nn.MultiheadAttention(MEM + TIME, heads, kdim=MEM + EDGE + TIME,
                                         vdim=MEM + EDGE + TIME, batch_first=True)
        self.merger = nn.Sequential(nn.Linear(2 * MEM + TIME, MEM), nn.ReLU(), nn.Linear(MEM, MEM))

    def forward(self, h, t_enc0, nbr_h, nbr_e, nbr_t_enc, mask):
        query = torch.cat([h, t_enc0], -1).unsqueeze(1)
        key = torch.cat([nbr_h, nbr_e, nbr_t_enc], -1)
        out, _ = self.mha(query, key, key, key_padding_mask=~mask, need_weights=self.need_weights)
        return self.merger(torch.cat([out.squeeze(1), h], -1))


class TGN(nn.Module):
    """TGN-attn: GRU memory, JODIE's time-gap normalisation, one graph attention layer, an
    MLP link predictor."""

    def __init__(self, fix_empty: bool = True, std_eps: float = 1e-6, dt_norm: bool = True,
                 zero_after: bool = False, mha: bool | None = None):
        super().__init__()
        self.time = TimeEncode()
        self.memory_updater = nn.GRUCell(2 * MEM + TIME + EDGE, MEM)
        self.embedding = TemporalAttention(fix_empty=fix_empty, zero_after=zero_after) \
            if mha is None else MultiHeadTemporalAttention(need_weights=mha)
        self.predictor = nn.Sequential(nn.Linear(2 * MEM, MEM), nn.ReLU(), nn.Linear(MEM, 1))
        self.register_buffer("memory", torch.zeros(NODES, MEM))
        self.register_buffer("last_update", torch.zeros(NODES))
        self.register_buffer("dt_mean", torch.zeros(()))
        self.register_buffer("dt_var", torch.ones(()))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.std_eps, self.dt_norm = std_eps, dt_norm

    def normalise(self, dt):
        """JODIE's time-gap scaling by the running mean/std of the gaps seen so far (the
        first batch's own statistics start them)."""
        if self.training:
            with torch.no_grad():
                first = self.seen == 0
                m = 0.0 if first else 0.9
                self.dt_mean.copy_(m * self.dt_mean + (1 - m) * dt.mean())
                self.dt_var.copy_(m * self.dt_var + (1 - m) * dt.var(unbiased=False))
                self.seen += 1
        return (dt - self.dt_mean) / (self.dt_var.sqrt() + self.std_eps)

    def update_memory(self, src, dst, t, e):
        """Each event's message to both ends, the GRU's new memory of its nodes."""
        mem = self.memory
        dt = torch.cat([t - self.last_update[src], t - self.last_update[dst]])
        phi = self.time(self.normalise(dt) if self.dt_norm else dt)
        msg = torch.cat([torch.cat([mem[src], mem[dst]], -1), torch.cat([mem[dst], mem[src]], -1)])
        msg = torch.cat([msg, phi, torch.cat([e, e])], -1)
        nodes = torch.cat([src, dst])
        new = self.memory_updater(msg, mem[nodes])
        memory = mem.index_put((nodes,), new)  # differentiable for this batch's embeddings
        with torch.no_grad():  # detached between batches, as TGN's memory is
            self.memory.copy_(memory)
            self.last_update[nodes] = torch.cat([t, t])
        return memory

    def forward(self, src, dst, neg, t, e, nbr_ids, nbr_t, nbr_e, nbr_mask):
        memory = self.update_memory(src, dst, t, e)
        nodes, ts = torch.cat([src, dst, neg]), torch.cat([t, t, t])
        h, nbr_h = memory[nodes], memory[nbr_ids]
        t0 = self.time(torch.zeros_like(ts))
        nbr_phi = self.time(ts[:, None] - nbr_t)
        z = self.embedding(h, t0, nbr_h, nbr_e, nbr_phi, nbr_mask)
        z_src, z_dst, z_neg = z.split(src.shape[0])
        pos = self.predictor(torch.cat([z_src, z_dst], -1)).squeeze(-1)
        neg_logit = self.predictor(torch.cat([z_src, z_neg], -1)).squeeze(-1)
        return pos, neg_logit


def make_tgn():
    torch.manual_seed(0)
    return TGN()


def make_tgn_unguarded():
    """TGAT's attention without TGN's guard for nodes with no neighbours yet."""
    torch.manual_seed(0)
    return TGN(fix_empty=False)


def make_tgn_zero_after():
    """TGAT's attention whose output is zeroed for nodes with no neighbours, the mask kept."""
    torch.manual_seed(0)
    return TGN(fix_empty=False, zero_after=True)


def make_tgn_mha():
    """TGN's attention layer, nn.MultiheadAttention called with its default need_weights=True,
    without the guard for nodes with no neighbours."""
    torch.manual_seed(0)
    return TGN(mha=True)


def make_tgn_mha_fused():
    """The same, need_weights=False: the fused attention's softmax of a fully masked row."""
    torch.manual_seed(0)
    return TGN(mha=False)


def make_tgn_no_eps():
    """JODIE's normalisation by the running std without an eps."""
    torch.manual_seed(0)
    return TGN(std_eps=0.0)


def make_tgn_raw_time():
    """Raw time gaps into the time encoding (TGN's own default), no normalisation."""
    torch.manual_seed(0)
    return TGN(dt_norm=False)


def link_loss(pos, neg):
    """TGN's loss: BCE of the positive events against 1, the sampled negatives against 0."""
    return (F.binary_cross_entropy_with_logits(pos, torch.ones_like(pos))
            + F.binary_cross_entropy_with_logits(neg, torch.zeros_like(neg)))


def prob_link_loss(pos, neg):
    """TGN's reference loss as the repository writes it: BCE of probabilities, the sigmoid
    taken by hand, the log of the positives' and of the negatives' complements."""
    p_pos, p_neg = torch.sigmoid(pos), torch.sigmoid(neg)
    return -(torch.log(p_pos).mean() + torch.log(1 - p_neg).mean())


class NeighborFinder:
    """TGN's most-recent neighbour finder: every node's past interactions, newest last; the
    ``k`` most recent before ``t``, padded with node 0, time 0, zero features and a False mask."""

    def __init__(self, k: int = K):
        self.k = k
        self.adj: dict[int, list[tuple[int, float, torch.Tensor]]] = {}

    def sample(self, nodes, t):
        n = nodes.shape[0]
        ids, ts = torch.zeros(n, self.k, dtype=torch.long), torch.zeros(n, self.k)
        feats, mask = torch.zeros(n, self.k, EDGE), torch.zeros(n, self.k, dtype=torch.bool)
        for i, (v, tv) in enumerate(zip(nodes.tolist(), t.tolist())):
            past = [x for x in self.adj.get(v, []) if x[1] < tv][-self.k:]
            for j, (u, tu, f) in enumerate(past):
                ids[i, j], ts[i, j], feats[i, j], mask[i, j] = u, tu, f, True
        return ids, ts, feats, mask

    def insert(self, src, dst, t, e):
        for s, d, tv, f in zip(src.tolist(), dst.tolist(), t.tolist(), e):
            self.adj.setdefault(s, []).append((d, tv, f))
            self.adj.setdefault(d, []).append((s, tv, f))


def event_stream(g: torch.Generator, steps: int, start: float = 0.0, same_time: bool = False,
                 new_node: int | None = None, new_as_dst: bool = False,
                 amount: tuple[int, int] | None = None):
    """``steps`` batches of ``B`` consecutive events among nodes ``1..NODES-2`` (node 0 is the
    padding id, ``NODES - 1`` a user who first shows up in the last batch's event
    ``new_node`` as a source (a destination: ``new_as_dst``), and sampled as nobody's neighbour before), times in seconds
    from ``start``; ``same_time``: the first batch is one bulk import, all at one timestamp."""
    t = start
    for step in range(steps):
        src = torch.randint(1, NODES - 1, (B,), generator=g)
        dst = torch.randint(1, NODES - 1, (B,), generator=g)
        dst = torch.where(dst == src, dst % (NODES - 2) + 1, dst)
        neg = torch.randint(1, NODES - 1, (B,), generator=g)
        gaps = torch.rand(B, generator=g) * 60
        ts = t + torch.cumsum(gaps, 0)
        if same_time and step == 0:
            ts = torch.full((B,), t + 60.0)
        t = float(ts[-1])
        if new_node is not None and step == steps - 1:
            (dst if new_as_dst else src)[new_node] = NODES - 1
        e = torch.randn(B, EDGE, generator=g)
        if amount is not None and step == amount[0]:
            e[amount[1], 0] = 2.5e6  # a transaction amount in cents, not standardised
        yield src, dst, neg, ts, e
