"""A tiny transformer with a sparse mixture-of-experts layer written the way open-source MoE code
writes it in plain PyTorch (Mixtral's top-k over a softmax with renormalisation, DeepSeek-V3's
sigmoid scores, Switch's capacity with token dropping, GShard's -inf mask of the first choice,
the load-balancing aux loss and the router z-loss): tokens flattened ``(B, T, D) -> (B * T, D)``,
dispatched with ``torch.where(idx == e)`` and combined with ``index_add_``. The factories of
``test_moe.py``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, EXPERTS, TOP_K, LENGTH, BATCH = 16, 16, 4, 2, 6, 4


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    def __init__(self, scores="softmax", capacity_factor=None, expert_mean=False):
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.scores, self.capacity_factor, self.expert_mean = scores, capacity_factor, expert_mean

    def route(self, logits):
        if self.scores == "sigmoid":  # DeepSeek-V3
            probs = torch.sigmoid(logits)
            weights, idx = torch.topk(probs, TOP_K, dim=-1)
        else:  # GShard's top-2: the first choice masked with -inf for the second
            probs = logits.softmax(-1)
            first = probs.argmax(-1, keepdim=True)
            second = logits.scatter(-1, first, float("-inf")).argmax(-1, keepdim=True)
            idx = torch.cat([first, second], -1)
            weights = probs.gather(-1, idx)
        weights = weights / weights.sum(-1, keepdim=True)
        return probs, weights, idx

    def keep(self, idx):
        """Switch's capacity: the tokens past an expert's capacity get weight 0."""
        n = idx.shape[0]
        capacity = math.ceil(self.capacity_factor * n * TOP_K / EXPERTS)
        onehot = F.one_hot(idx.reshape(-1), EXPERTS)
        position = (onehot.cumsum(0) - 1) * onehot
        return (position.sum(-1) < capacity).reshape(idx.shape)

    def forward(self, x):
        b, t, d = x.shape
        h = x.reshape(b * t, d)
        logits = self.router(h)
        probs, weights, idx = self.route(logits)
        if self.capacity_factor is not None:
            weights = weights * self.keep(idx)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(idx == e)
            y = expert(h[token]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        share = F.one_hot(idx[:, 0], EXPERTS).float().mean(0)
        if self.expert_mean:  # P_i as the mean router probability of the tokens sent to i
            mean_prob = torch.stack([probs[idx[:, 0] == e, e].mean() for e in range(EXPERTS)])
        else:
            mean_prob = probs.mean(0)
        aux = EXPERTS * (share * mean_prob).sum()
        z_loss = torch.logsumexp(logits, -1).pow(2).mean()
        return out.reshape(b, t, d), aux + 1e-3 * z_loss


class TinyMoELM(nn.Module):
    def __init__(self, **moe):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.moe = MoE(**moe)
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, feats):
        h = self.embed(ids) + feats
        y, aux = self.moe(h)
        h = self.norm(h + y)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h + a), aux


def make_moe():
    torch.manual_seed(0)
    return TinyMoELM()


def make_moe_capacity():
    torch.manual_seed(0)
    return TinyMoELM(capacity_factor=1.0)


def make_moe_sigmoid():
    torch.manual_seed(0)
    return TinyMoELM(scores="sigmoid")


def make_moe_expert_mean():
    torch.manual_seed(0)
    return TinyMoELM(expert_mean=True)


def batch(g: torch.Generator):
    ids = torch.randint(VOCAB, (BATCH, LENGTH), generator=g)
    feats = 0.1 * torch.randn(BATCH, LENGTH, WIDTH, generator=g)
    return ids, feats


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


@torch.no_grad()
def routing(model: TinyMoELM, ids, feats):
    """The experts each token goes to ``(B * T, k)`` and whether capacity kept it, as the next
    forward routes them (no gradient, no random draw: training is unchanged)."""
    moe = model.moe
    logits = moe.router((model.embed(ids) + feats).reshape(-1, WIDTH))
    idx = moe.route(logits)[2]
    keep = moe.keep(idx) if moe.capacity_factor is not None else torch.ones_like(idx).bool()
    return idx, keep


def uniform_batch(ids, feats):
    """A batch of one token repeated (a padded batch): every token to the same experts."""
    ids.fill_(5)
    feats.zero_()
