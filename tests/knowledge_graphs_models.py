"""Knowledge-graph embedding models as their public repositories write them, for
``test_knowledge_graphs.py``:

- ``TransE``: mklimasz/TransE-PyTorch (entities renormalised in place by ``.data.div_`` of
  their L1 norm at the start of ``forward``, the last row kept out "to avoid nan for OOV
  vector"), sparse embeddings trained by SparseAdam.
- ``RotatE``: DeepGraphLearning/KnowledgeGraphEmbedding (phases ``relation / (range / pi)``,
  cos/sin, the distance ``torch.stack([re, im]).norm(dim=0)``, ``gamma - sum``), trained with
  its self-adversarial ``logsigmoid`` loss, here over negatives filtered against the known
  triples (scores of false negatives set to ``-inf`` before the softmax).
- ``ComplEx``: facebookresearch/kbc (real and imaginary halves in one embedding, 1-N scoring
  against every entity, reciprocal relations, the factors ``sqrt(re^2 + im^2)`` its N3
  regulariser takes ``|x|^3`` of), with LibKGE-style dropout on the looked-up embeddings.
- ``DistMult``: the 1-N scorer of ConvE's repository (TimDettmers/ConvE: ``sigmoid`` of the
  scores, label smoothing) with its binary cross entropy written out by hand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_ENT, N_REL, DIM, BATCH, NEG = 24, 4, 8, 8, 4


def triples(g: torch.Generator, n: int = BATCH, low: int = 1) -> torch.Tensor:
    """``n`` (head, relation, tail) rows; entity ids from ``low`` (0 may be a padding id)."""
    return torch.stack([torch.randint(low, N_ENT, (n,), generator=g),
                        torch.randint(0, N_REL, (n,), generator=g),
                        torch.randint(low, N_ENT, (n,), generator=g)], 1)


class CorruptedTriples(torch.utils.data.Dataset):
    """Positive triples and ``NEG`` corrupted tails each, drawn in the dataset (so in the
    DataLoader's workers): the tails a uniform sampler picks, as TransE-PyTorch's does."""

    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.pos = triples(g, n)
        self.neg = torch.randint(1, N_ENT, (n, NEG), generator=g)

    def __len__(self):
        return len(self.pos)

    def __getitem__(self, i):
        return self.pos[i], self.neg[i]


# --- TransE (mklimasz/TransE-PyTorch) -------------------------------------------------------


class TransE(nn.Module):
    """``in_forward=False``: the renormalisation is the loop's, after each update (the TransE
    paper's Algorithm 1, ``e <- e / ||e||`` per iteration, as ports write it by hand)."""

    def __init__(self, pad: int = N_ENT - 1, sparse: bool = True, norm: int = 1,
                 in_forward: bool = True):
        super().__init__()
        self.norm, self.in_forward = norm, in_forward
        # the out-of-vocabulary entity is a zero row (padding_idx); the repository keeps the
        # last row for it, a port that reads ids from a vocabulary with "<pad>" first puts it at 0
        self.entities_emb = nn.Embedding(N_ENT, DIM, padding_idx=pad, sparse=sparse)
        self.relations_emb = nn.Embedding(N_REL, DIM, sparse=sparse)
        bound = 6 / DIM ** 0.5
        nn.init.uniform_(self.entities_emb.weight, -bound, bound)
        nn.init.uniform_(self.relations_emb.weight, -bound, bound)
        with torch.no_grad():
            self.entities_emb.weight[pad] = 0
            self.relations_emb.weight.div_(self.relations_emb.weight.norm(p=1, dim=1,
                                                                          keepdim=True))

    def forward(self, positive_triplets, negative_triplets):
        if self.in_forward:
            # -1 to avoid nan for OOV vector
            w = self.entities_emb.weight.data[:-1, :]
            w.div_(w.norm(p=1, dim=1, keepdim=True))
        return self._distance(positive_triplets), self._distance(negative_triplets)

    def _distance(self, triplets):
        heads, relations, tails = triplets[..., 0], triplets[..., 1], triplets[..., 2]
        return (self.entities_emb(heads) + self.relations_emb(relations)
                - self.entities_emb(tails)).norm(p=self.norm, dim=-1)


def make_transe(pad: int = N_ENT - 1, in_forward: bool = True) -> TransE:
    torch.manual_seed(0)
    return TransE(pad, sparse=in_forward, in_forward=in_forward)


@torch.no_grad()
def renormalise(emb: nn.Embedding) -> None:
    """The loop's projection of every entity back onto the unit sphere, after the update."""
    w = emb.weight
    w.data = w / w.norm(p=2, dim=1, keepdim=True)


def with_tails(pos: torch.Tensor, neg_tails: torch.Tensor) -> torch.Tensor:
    """``[B, k, 3]`` corrupted triples: each positive with its ``k`` sampled tails."""
    neg = pos[:, None, :].repeat(1, neg_tails.shape[1], 1)
    neg[..., 2] = neg_tails
    return neg


class MarginRankingLoss(nn.Module):
    """TransE-PyTorch's loss: ``nn.MarginRankingLoss(margin, reduction="none")`` of the
    positive and negative distances with target -1, averaged."""

    def __init__(self, margin: float = 1.0):
        super().__init__()
        self.criterion = nn.MarginRankingLoss(margin=margin, reduction="none")

    def forward(self, out):
        pos, neg = out
        target = torch.full_like(neg, -1.0)
        return self.criterion(pos[:, None].expand_as(neg), neg, target).mean()


# --- RotatE (DeepGraphLearning/KnowledgeGraphEmbedding) -------------------------------------


class RotatE(nn.Module):
    def __init__(self, gamma: float = 6.0, epsilon: float = 2.0):
        super().__init__()
        self.gamma = nn.Parameter(torch.Tensor([gamma]), requires_grad=False)
        self.embedding_range = nn.Parameter(torch.Tensor([(gamma + epsilon) / DIM]),
                                            requires_grad=False)
        r = self.embedding_range.item()
        self.entity_embedding = nn.Parameter(torch.zeros(N_ENT, 2 * DIM).uniform_(-r, r))
        self.relation_embedding = nn.Parameter(torch.zeros(N_REL, DIM).uniform_(-r, r))

    def forward(self, sample, negative_tails, filtered=None):
        """``filtered``: in evaluation, the candidate tails that form known triples, scored
        -inf so that they rank last (LibKGE's filtered ranking)."""
        head = self.entity_embedding[sample[:, 0]].unsqueeze(1)
        relation = self.relation_embedding[sample[:, 1]].unsqueeze(1)
        tail = self.entity_embedding[sample[:, 2]].unsqueeze(1)
        negative = self.entity_embedding[negative_tails]
        negative_score = self.score(head, relation, negative)
        if filtered is not None:
            negative_score = negative_score.masked_fill(filtered, float("-inf"))
        return self.score(head, relation, tail)[:, 0], negative_score

    def score(self, head, relation, tail):
        pi = 3.14159265358979323846
        re_head, im_head = torch.chunk(head, 2, dim=2)
        re_tail, im_tail = torch.chunk(tail, 2, dim=2)
        phase_relation = relation / (self.embedding_range.item() / pi)
        re_relation, im_relation = torch.cos(phase_relation), torch.sin(phase_relation)
        re_score = re_head * re_relation - im_head * im_relation - re_tail
        im_score = re_head * im_relation + im_head * re_relation - im_tail
        score = torch.stack([re_score, im_score], dim=0).norm(dim=0)
        return self.gamma.item() - score.sum(dim=2)


def make_rotate() -> RotatE:
    torch.manual_seed(0)
    return RotatE()


def self_adversarial_loss(out, false_negative, temperature: float = 1.0):
    """RotatE's ``train_step`` loss, its negatives filtered: a sampled tail that forms a known
    triple is a false negative, its score set to -inf so the softmax gives it no weight."""
    positive_score, negative_score = out
    negative_score = negative_score.masked_fill(false_negative, float("-inf"))
    negative_score = (F.softmax(negative_score * temperature, dim=1).detach()
                      * F.logsigmoid(-negative_score)).sum(dim=1)
    positive_score = F.logsigmoid(positive_score)
    return (-positive_score.mean() - negative_score.mean()) / 2


# --- ComplEx (facebookresearch/kbc) ---------------------------------------------------------


class ComplEx(nn.Module):
    def __init__(self, init_size: float = 1e-3, dropout: float = 0.0):
        super().__init__()
        self.rank = DIM
        # reciprocal relations: (t, r + N_REL, h) is the inverse of (h, r, t)
        self.embeddings = nn.ModuleList([nn.Embedding(s, 2 * DIM, sparse=True)
                                         for s in (N_ENT, 2 * N_REL)])
        self.embeddings[0].weight.data *= init_size
        self.embeddings[1].weight.data *= init_size
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        lhs = self.dropout(self.embeddings[0](x[:, 0]))
        rel = self.embeddings[1](x[:, 1])
        rhs = self.dropout(self.embeddings[0](x[:, 2]))
        lhs = lhs[:, :self.rank], lhs[:, self.rank:]
        rel = rel[:, :self.rank], rel[:, self.rank:]
        rhs = rhs[:, :self.rank], rhs[:, self.rank:]
        to_score = self.embeddings[0].weight
        to_score = to_score[:, :self.rank], to_score[:, self.rank:]
        return (
            (lhs[0] * rel[0] - lhs[1] * rel[1]) @ to_score[0].transpose(0, 1)
            + (lhs[0] * rel[1] + lhs[1] * rel[0]) @ to_score[1].transpose(0, 1)
        ), (
            torch.sqrt(lhs[0] ** 2 + lhs[1] ** 2),
            torch.sqrt(rel[0] ** 2 + rel[1] ** 2),
            torch.sqrt(rhs[0] ** 2 + rhs[1] ** 2),
        )


def make_complex(dropout: float = 0.0) -> ComplEx:
    torch.manual_seed(0)
    return ComplEx(dropout=dropout)


class N3Loss(nn.Module):
    """kbc's ``KBCOptimizer.epoch``: cross entropy of the 1-N scores against the true tails
    plus N3 (``weight * sum(|f|^3) / batch``)."""

    def __init__(self, weight: float = 5e-2):
        super().__init__()
        self.weight = weight

    def forward(self, out, truth):
        predictions, factors = out
        norm = 0
        for f in factors:
            norm += self.weight * torch.sum(torch.abs(f) ** 3)
        return F.cross_entropy(predictions, truth) + norm / f.shape[0]


def reciprocal(x: torch.Tensor) -> torch.Tensor:
    """kbc's training set: every triple and its inverse (t, r + N_REL, h)."""
    inv = torch.stack([x[:, 2], x[:, 1] + N_REL, x[:, 0]], 1)
    return torch.cat([x, inv])


# --- DistMult, 1-N with label smoothing (TimDettmers/ConvE) ---------------------------------


class DistMult(nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.emb_e = nn.Embedding(N_ENT, DIM, padding_idx=0)
        self.emb_rel = nn.Embedding(N_REL, DIM, padding_idx=0)
        nn.init.xavier_normal_(self.emb_e.weight.data)
        nn.init.xavier_normal_(self.emb_rel.weight.data)
        self.emb_e.weight.data *= scale
        self.inp_drop = nn.Dropout(0.2)

    def forward(self, e1, rel):
        e1_embedded = self.inp_drop(self.emb_e(e1).squeeze(1))
        rel_embedded = self.inp_drop(self.emb_rel(rel).squeeze(1))
        pred = torch.mm(e1_embedded * rel_embedded, self.emb_e.weight.transpose(1, 0))
        return torch.sigmoid(pred)


def make_distmult(scale: float = 1.0) -> DistMult:
    torch.manual_seed(0)
    return DistMult(scale)


def smoothed(e2_multi: torch.Tensor, label_smoothing: float = 0.1) -> torch.Tensor:
    """ConvE's label smoothing of the 1-N targets."""
    return (1.0 - label_smoothing) * e2_multi + (1.0 / e2_multi.size(1))


def bce_by_hand(pred, target):
    """Binary cross entropy written out, as ports of ConvE's 1-N loss do."""
    return -(target * torch.log(pred) + (1 - target) * torch.log(1 - pred)).mean()


def filtered_mrr(model: RotatE, test: torch.Tensor, known: torch.Tensor) -> float:
    """Filtered tail ranking: every entity scored as the tail, the other known true tails of
    (h, r) at -inf (the model's ``filtered``), the rank of the true tail among the rest."""
    model.eval()
    with torch.no_grad():
        every = torch.arange(N_ENT).expand(len(test), N_ENT)
        true_score, scores = model(test, every, known & ~F.one_hot(test[:, 2], N_ENT).bool())
        rank = (scores > true_score[:, None]).sum(1) + 1
    model.train()
    return (1.0 / rank.float()).mean().item()
