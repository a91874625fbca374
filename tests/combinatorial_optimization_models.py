"""Neural combinatorial optimisation written as POMO (Kwon et al.) and the Attention Model
(Kool et al.) write it, for ``test_combinatorial_optimization``.

- ``POMO``: a transformer encoder over node coordinates (CVRP: a depot embedding and the
  customers' ``(x, y, demand)``), a pointer decoder whose query is the last node's embedding
  (plus the remaining load in CVRP), multi-head attention over the nodes under the rollout's
  ``ninf_mask`` (given to the decoder's ``forward``), the single-head score clipped
  ``C * tanh(u)``, the mask added, softmax; one rollout from each start node (POMO's
  multi-start), the next node drawn with ``multinomial`` (or ``argmax`` when greedy). The
  forward returns each rollout's tour length and the sum of its log-probabilities.
- CVRP's masks as POMO's ``CVRPEnv`` builds them: visited customers, customers whose demand
  exceeds the remaining load (with its round-off epsilon), the depot right after it was
  visited, the depot opened again for finished rollouts.
- Losses: POMO's shared baseline (advantage = length - mean over the instance's rollouts),
  optionally normalised by their standard deviation, with an entropy bonus as Sym-NCO-style
  trainers add one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

EMBED, HEADS, CLIP = 32, 4, 10.0


class Encoder(nn.Module):
    def __init__(self, node_dim: int, depot: bool, layers: int = 2):
        super().__init__()
        self.embed = nn.Linear(node_dim, EMBED)
        self.embed_depot = nn.Linear(2, EMBED) if depot else None
        layer = nn.TransformerEncoderLayer(EMBED, HEADS, 64, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, nodes, depot=None):
        h = self.embed(nodes)
        if self.embed_depot is not None:
            h = torch.cat([self.embed_depot(depot)[:, None], h], 1)
        return self.layers(h)


class Decoder(nn.Module):
    """POMO's decoder: multi-head attention of the query over the nodes, then the single-head
    score, clipped by tanh, masked, softmaxed."""

    def __init__(self, context: int):
        super().__init__()
        self.Wq_last = nn.Linear(EMBED + context, EMBED, bias=False)
        self.Wq_first = nn.Linear(EMBED, EMBED, bias=False)
        self.Wk = nn.Linear(EMBED, EMBED, bias=False)
        self.Wv = nn.Linear(EMBED, EMBED, bias=False)
        self.combine = nn.Linear(EMBED, EMBED)
        self.k = self.v = self.single_head_key = self.q_first = None

    def set_kv(self, enc):
        b, n, _ = enc.shape
        self.k = self.Wk(enc).reshape(b, n, HEADS, -1).transpose(1, 2)
        self.v = self.Wv(enc).reshape(b, n, HEADS, -1).transpose(1, 2)
        self.single_head_key = enc.transpose(1, 2)

    def set_q1(self, first_emb):
        self.q_first = self.Wq_first(first_emb)

    def forward(self, last_emb, ninf_mask, context=None):
        b, p, _ = last_emb.shape
        x = last_emb if context is None else torch.cat([last_emb, context[:, :, None]], 2)
        q = self.Wq_last(x)
        if self.q_first is not None:
            q = q + self.q_first
        q = q.reshape(b, p, HEADS, -1).transpose(1, 2)
        score = q @ self.k.transpose(2, 3) / math.sqrt(q.size(-1)) + ninf_mask[:, None]
        out = (score.softmax(-1) @ self.v).transpose(1, 2).reshape(b, p, EMBED)
        score = self.combine(out) @ self.single_head_key / math.sqrt(EMBED)
        score = CLIP * torch.tanh(score) + ninf_mask
        return F.softmax(score, dim=2)


def gather_nodes(enc, idx):
    """The embeddings of node ``idx[b, p]`` of each rollout: (B, P, EMBED)."""
    return enc.gather(1, idx[:, :, None].expand(-1, -1, enc.size(2)))


def tour_length(coords, tours):
    """The closed tour's length: coords (B, N, 2), tours (B, P, T) -> (B, P)."""
    b, p, t = tours.shape
    pts = coords[:, None].expand(b, p, -1, 2).gather(2, tours[..., None].expand(b, p, t, 2))
    return (pts - pts.roll(-1, dims=2)).norm(dim=3).sum(2)


def draw(probs, greedy: bool):
    """POMO's draw: multinomial from the global RNG (re-drawn while a 0-probability node came
    out), argmax when greedy."""
    b, p, n = probs.shape
    if greedy:
        return probs.argmax(2)
    while True:
        with torch.no_grad():
            sel = probs.reshape(b * p, n).multinomial(1).reshape(b, p)
        if (probs.gather(2, sel[..., None]) != 0).all():
            return sel


class POMOTSP(nn.Module):
    def __init__(self, greedy: bool = False, entropy: bool = False):
        super().__init__()
        self.encoder, self.decoder = Encoder(2, depot=False), Decoder(0)
        self.greedy, self.entropy = greedy, entropy

    def forward(self, problems):
        b, n, _ = problems.shape
        enc = self.encoder(problems)
        self.decoder.set_kv(enc)
        bi = torch.arange(b)[:, None].expand(b, n)
        pi = torch.arange(n)[None].expand(b, n)
        sel = pi.clone()  # POMO: rollout p starts at node p
        self.decoder.set_q1(gather_nodes(enc, sel))
        mask = torch.zeros(b, n, n)
        mask[bi, pi, sel] = float("-inf")
        tours, logp, ent = [sel], torch.zeros(b, n), torch.zeros(b, n)
        for _ in range(n - 1):
            probs = self.decoder(gather_nodes(enc, sel), mask)
            if self.entropy:  # the bug: 0 * log 0 at every node the mask closed
                ent = ent - (probs * probs.log()).sum(2)
            sel = draw(probs, self.greedy)
            logp = logp + probs.gather(2, sel[..., None]).squeeze(2).log()
            mask = mask.clone()
            mask[bi, pi, sel] = float("-inf")
            tours.append(sel)
        length = tour_length(problems, torch.stack(tours, 2))
        return (length, logp, ent) if self.entropy else (length, logp)


class POMOCVRP(nn.Module):
    """POMO for CVRP: node 0 the depot, capacity 1 (demands divided by the capacity)."""

    def __init__(self, greedy: bool = False, max_steps: int = 24):
        super().__init__()
        self.encoder, self.decoder = Encoder(3, depot=True), Decoder(1)
        self.greedy, self.max_steps = greedy, max_steps

    def forward(self, depot, loc, demand):
        b, n = demand.shape
        enc = self.encoder(torch.cat([loc, demand[..., None]], 2), depot)
        self.decoder.set_kv(enc)
        self.decoder.q_first = None
        demands = F.pad(demand, (1, 0))[:, None].expand(b, n, n + 1)
        bi = torch.arange(b)[:, None].expand(b, n)
        pi = torch.arange(n)[None].expand(b, n)
        load = torch.ones(b, n)
        visited = torch.zeros(b, n, n + 1)
        sel = (pi + 1).clone()  # POMO: rollout p first serves customer p + 1
        visited[bi, pi, sel] = float("-inf")
        load = load - demands.gather(2, sel[..., None]).squeeze(2)
        tours, logp = [torch.zeros_like(sel), sel], torch.zeros(b, n)
        finished = torch.zeros(b, n, dtype=torch.bool)
        for _ in range(self.max_steps):
            mask = visited.clone()
            at_depot = sel == 0
            mask[:, :, 0][~at_depot] = 0  # the depot is closed only right after a visit
            mask[load[..., None] + 1e-5 < demands] = float("-inf")
            finished = finished | (visited[:, :, 1:] == float("-inf")).all(2)
            mask[:, :, 0][finished] = 0
            probs = self.decoder(gather_nodes(enc, sel), mask, load)
            sel = draw(probs, self.greedy)
            logp = logp + probs.gather(2, sel[..., None]).squeeze(2).log() * ~finished
            load = torch.where(sel == 0, torch.ones_like(load),
                               load - demands.gather(2, sel[..., None]).squeeze(2))
            visited = visited.clone()
            visited[bi, pi, sel] = float("-inf")
            visited[:, :, 0] = 0
            tours.append(sel)
            if bool(finished.all()):
                break
        coords = torch.cat([depot[:, None], loc], 1)
        return tour_length(coords, torch.stack(tours, 2)), logp


def make_tsp() -> POMOTSP:
    torch.manual_seed(0)
    return POMOTSP()


def make_tsp_entropy() -> POMOTSP:
    torch.manual_seed(0)
    return POMOTSP(entropy=True)


def make_cvrp() -> POMOCVRP:
    torch.manual_seed(0)
    return POMOCVRP()


def make_cvrp_greedy() -> POMOCVRP:
    torch.manual_seed(0)
    return POMOCVRP(greedy=True)


def pomo_loss(length, logp, normalize: bool = False):
    """POMO's shared baseline: each rollout against the mean of its instance's rollouts."""
    adv = length - length.mean(1, keepdim=True)
    if normalize:  # the bug: an instance whose rollouts all tie has std 0
        adv = adv / adv.std(1, keepdim=True)
    return (adv.detach() * logp).mean()


def pomo_entropy_loss(length, logp, ent, beta: float = 0.01):
    return pomo_loss(length, logp) - beta * ent.mean()


def tsp_batch(g: torch.Generator, n_inst: int = 6, nodes: int = 8, stacked: int | None = None):
    """Uniform TSP instances; ``stacked``: an instance whose nodes all lie on one point (a
    generator that rounded the coordinates of a tiny instance)."""
    x = torch.rand(n_inst, nodes, 2, generator=g)
    if stacked is not None:
        x[stacked] = 0.5
    return x


def cvrp_batch(g: torch.Generator, n_inst: int = 6, nodes: int = 6, raw: int | None = None,
               capacity: float = 30.0):
    """CVRP instances with integer demands 1..9 divided by the capacity (as many instances as
    customers, as CVRP20 trained in batches of 20 has); ``raw``: an instance whose demands came
    in undivided (a demand of 3 is 3 vehicle loads)."""
    depot = torch.rand(n_inst, 2, generator=g)
    loc = torch.rand(n_inst, nodes, 2, generator=g)
    demand = torch.randint(1, 10, (n_inst, nodes), generator=g).float()
    scale = torch.full((n_inst, 1), capacity)
    if raw is not None:
        scale[raw] = 1.0
    return depot, loc, demand / scale


class PointerNet(nn.Module):
    """Vinyals et al.'s pointer network trained on solver tours by teacher forcing: an LSTM
    encoder over the cities, an LSTM decoder fed the last city's embedding, additive attention
    ``v^T tanh(W1 e_j + W2 d_i)`` as the pointer, visited cities masked with -inf."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.embed = nn.Linear(2, hidden)
        self.encoder = nn.LSTM(hidden, hidden, batch_first=True)
        self.decoder = nn.LSTMCell(hidden, hidden)
        self.W1 = nn.Linear(hidden, hidden, bias=False)
        self.W2 = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, 1, bias=False)
        self.start = nn.Parameter(torch.zeros(hidden))

    def forward(self, cities, tour):
        b, n, _ = cities.shape
        emb = self.embed(cities)
        enc, (h, c) = self.encoder(emb)
        h, c, x = h[0], c[0], self.start.expand(b, -1)
        keys = self.W1(enc)
        mask = torch.zeros(b, n, dtype=torch.bool)
        rows, out = torch.arange(b), []
        for i in range(tour.size(1)):
            h, c = self.decoder(x, (h, c))
            u = self.v(torch.tanh(keys + self.W2(h)[:, None])).squeeze(2)
            out.append(u.masked_fill(mask, float("-inf")).log_softmax(1))
            nxt = tour[:, i]  # teacher forcing: the solver's next city
            mask = mask.clone()
            mask[rows, nxt] = True
            x = emb[rows, nxt]
        return torch.stack(out, 1)


def make_pointer() -> PointerNet:
    torch.manual_seed(0)
    return PointerNet()


def pointer_loss(log_p, tour):
    return F.nll_loss(log_p.flatten(0, 1), tour.flatten())


def solver_tours(g: torch.Generator, n_inst: int = 6, nodes: int = 8,
                 closed: int | None = None):
    """Cities and their tours as a solver writes them (a permutation); ``closed``: an
    instance whose tour came in closed, its start city repeated at the end (Concorde's output
    read as a cycle) and its last city cut to keep the length."""
    cities = torch.rand(n_inst, nodes, 2, generator=g)
    tours = torch.stack([torch.randperm(nodes, generator=g) for _ in range(n_inst)])
    if closed is not None:
        tours[closed, -1] = tours[closed, 0]
    return cities, tours
