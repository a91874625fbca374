"""MAML's sine-regression network (Finn et al. 2017): the inner loop adapts its parameters with
``torch.func.functional_call``, so a step's later forwards run with weights the model does not
hold. Few-shot classifiers over N-way K-shot episodes: a prototype head (Snell et al.) adapted
by MAML's second-order inner loop (Proto-MAML)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call


class SineNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                                 nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def make_model() -> SineNet:
    torch.manual_seed(0)
    return SineNet()


def task(g: torch.Generator):
    amp, phase = torch.rand(1, generator=g) * 4.9 + 0.1, torch.rand(1, generator=g) * 3.14
    x = torch.rand(20, 1, generator=g) * 10 - 5
    y = amp * torch.sin(x + phase)
    return x[:10], y[:10], x[10:], y[10:]


def meta_step(model, crit, opt, tasks, inner_lr: float) -> None:
    """One outer update over ``tasks``: one inner SGD step on each support set (a second-order
    graph), the query losses averaged."""
    opt.zero_grad()
    total = 0.0
    for xs, ys, xq, yq in tasks:
        params = dict(model.named_parameters())
        loss = crit(functional_call(model, params, (xs,)), ys)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        adapted = {n: p - inner_lr * g for (n, p), g in zip(params.items(), grads)}
        total = total + crit(functional_call(model, adapted, (xq,)), yq)
    (total / len(tasks)).backward()
    opt.step()


class ProtoHead(nn.Module):
    """An encoder that classifies ``xq`` by the Euclidean distance of its embeddings to the
    class prototypes (means) of the support set ``(xs, ys)``: ``model(xs, ys, xq)`` -> logits."""

    def __init__(self, n_way: int = 5, dist: str = "norm"):
        super().__init__()
        self.n_way, self.dist = n_way, dist
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, xs, ys, xq):
        zs, zq = self.encoder(xs), self.encoder(xq)
        onehot = F.one_hot(ys, self.n_way).float()
        protos = onehot.T @ zs / onehot.sum(0)[:, None]
        diff = zq[:, None] - protos[None]
        if self.dist == "sqrt":  # the bug: sqrt's derivative at 0 is inf (* 0: NaN)
            return -(diff ** 2).sum(-1).sqrt()
        return -diff.norm(dim=-1)  # the bug: not squared


def make_proto_head(dist: str = "norm") -> ProtoHead:
    torch.manual_seed(0)
    return ProtoHead(dist=dist)


def episode(g: torch.Generator, shots: list[int], queries: int = 3):
    """An N-way episode over Gaussian classes around random centres: ``shots[c]`` support and
    ``queries`` query samples of class ``c``, sorted by class."""
    centres = torch.randn(len(shots), 16, generator=g) * 2
    ys = torch.cat([torch.full((k,), c) for c, k in enumerate(shots)])
    yq = torch.arange(len(shots)).repeat_interleave(queries)
    xs = centres[ys] + torch.randn(len(ys), 16, generator=g)
    xq = centres[yq] + torch.randn(len(yq), 16, generator=g)
    return xs, ys, xq, yq


def proto_maml_step(model, crit, opt, ep, inner_lr: float) -> None:
    """Proto-MAML: one second-order inner step on the support set classified against its own
    prototypes, then the query loss with the adapted weights."""
    xs, ys, xq, yq = ep
    opt.zero_grad()
    params = dict(model.named_parameters())
    loss = crit(functional_call(model, params, (xs, ys, xs)), ys)
    grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
    adapted = {n: p - inner_lr * g for (n, p), g in zip(params.items(), grads)}
    crit(functional_call(model, adapted, (xs, ys, xq)), yq).backward()
    opt.step()


def reptile_step(model, crit, meta_opt, task_xy, inner_steps: int = 5, inner_lr: float = 0.02):
    """Reptile (Nichol et al. 2018) as reptile-pytorch writes it: SGD on a copy of the model
    (the fast weights), then the meta-gradient ``p - fast_p`` into ``p.grad`` and the meta
    optimizer's step. The recorded model runs no forward."""
    xs, ys = task_xy
    fast = copy.deepcopy(model)
    inner = torch.optim.SGD(fast.parameters(), lr=inner_lr)
    for _ in range(inner_steps):
        inner.zero_grad()
        crit(fast(xs), ys).backward()
        inner.step()
    meta_opt.zero_grad()
    for p, q in zip(model.parameters(), fast.parameters()):
        p.grad = p.detach() - q.detach()
    meta_opt.step()


class TaskEncoder(nn.Module):
    """torchmeta's PrototypicalNetwork: a meta-batch of tasks ``(B, n, F)`` embedded sample by
    sample, ``(B, n, D)``."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, inputs):
        return self.encoder(inputs.view(-1, inputs.shape[-1])).view(*inputs.shape[:2], -1)


def make_task_encoder() -> TaskEncoder:
    torch.manual_seed(0)
    return TaskEncoder()


def prototypical_loss(train_emb, train_targets, test_emb, test_targets, num_classes: int = 5):
    """torchmeta's get_prototypes and prototypical_loss, without its clamp of the class counts
    to 1 (a class with no support sample: 0/0)."""
    with torch.no_grad():
        ones = torch.ones_like(train_targets, dtype=train_emb.dtype)
        counts = ones.new_zeros((train_targets.size(0), num_classes))
        counts.scatter_add_(1, train_targets, ones)
    protos = train_emb.new_zeros((train_emb.size(0), num_classes, train_emb.size(-1)))
    index = train_targets.unsqueeze(-1).expand_as(train_emb)
    protos = protos.scatter_add(1, index, train_emb) / counts.unsqueeze(-1)
    sq = torch.sum((protos.unsqueeze(2) - test_emb.unsqueeze(1)) ** 2, dim=-1)
    return F.cross_entropy(-sq, test_targets)


def task_batch(g: torch.Generator, tasks: int = 4, n_way: int = 5, shots: int = 1,
               queries: int = 3):
    """torchmeta's BatchMetaDataLoader batch: ``{"train": (x, y), "test": (x, y)}``, each
    ``(tasks, n, ...)``, classes around random centres per task."""
    centres = torch.randn(tasks, n_way, 16, generator=g) * 2
    out = {}
    for split, k in (("train", shots), ("test", queries)):
        y = torch.arange(n_way).repeat_interleave(k).repeat(tasks, 1)
        x = torch.gather(centres, 1, y.unsqueeze(-1).expand(-1, -1, 16))
        out[split] = (x + torch.randn(x.shape, generator=g), y)
    return out


class MatchingNet(nn.Module):
    """Vinyals et al.'s matching network without full context embeddings: ``model(xs, ys, xq)``
    attends over the support set by the cosine similarity of the embeddings, written out
    (no eps), and returns the query's class probabilities."""

    def __init__(self, n_way: int = 5):
        super().__init__()
        self.n_way = n_way
        self.encoder = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(),
                                     nn.Linear(32, 16, bias=False), nn.ReLU())

    def forward(self, xs, ys, xq):
        s, q = self.encoder(xs), self.encoder(xq)
        cos = (q @ s.T) / (q.norm(dim=1, keepdim=True) * s.norm(dim=1))  # the bug: 0/0
        return torch.softmax(10 * cos, dim=1) @ F.one_hot(ys, self.n_way).float()


def make_matching_net() -> MatchingNet:
    torch.manual_seed(0)
    return MatchingNet()


def matching_loss(probs, yq):
    return F.nll_loss(torch.log(probs + 1e-8), yq)


class MetaSGDNet(nn.Module):
    """Li et al.'s Meta-SGD on the sine task: a learned learning rate per weight element, kept
    as its log (``log_lr``) so that it stays positive."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 1))
        self.log_lr = nn.ParameterDict({"net_" + n.replace(".", "_"):
                                        nn.Parameter(torch.full_like(p, -4.0))
                                        for n, p in self.net.named_parameters()})

    def forward(self, x):
        return self.net(x)


def make_meta_sgd() -> MetaSGDNet:
    torch.manual_seed(0)
    return MetaSGDNet()


def meta_sgd_step(model, crit, opt, task_xy) -> None:
    """One Meta-SGD step: p - exp(log_lr) * g on the support set, the query loss after."""
    xs, ys, xq, yq = task_xy
    opt.zero_grad()
    params = {n: p for n, p in model.named_parameters() if n.startswith("net.")}
    loss = crit(functional_call(model, params, (xs,)), ys)
    grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
    adapted = {n: p - model.log_lr[n.replace(".", "_")].exp() * g
               for (n, p), g in zip(params.items(), grads)}
    crit(functional_call(model, adapted, (xq,)), yq).backward()
    opt.step()
