"""Contrastive retrieval and self-supervised objectives as their repositories write them.

A dense retriever's text encoder (DPR/Tevatron style: token embeddings, a transformer layer with
dropout, masked mean pooling, a projection) trained with GradCache (Gao et al., luyug/GradCache):
the whole batch embedded under ``torch.no_grad()`` chunk by chunk with each chunk's RNG state
kept (``RandContext``), the contrastive loss on detached reps, its gradient cached, and each
chunk re-run with grad and backpropagated with its slice of that gradient. The losses: InfoNCE
with in-batch negatives and a CLIP-style learned ``logit_scale``, SigLIP's sigmoid loss with a
learned bias, Barlow Twins and VICReg; and sentence-transformers' CachedMultipleNegativesRanking
Loss, whose chunks are re-run inside the loss's backward hook.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, PAD, DIM, SEQ = 50, 0, 16, 8


class TextEncoder(nn.Module):
    """One encoder for queries and passages (DPR's shared-weights variant)."""

    def __init__(self, eps_pool: bool = True, project: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.layer = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.1, batch_first=True)
        # (sentence-transformers' default stack has no Dense layer after the pooling)
        self.proj = nn.Linear(DIM, DIM) if project else nn.Identity()
        self.eps_pool = eps_pool

    def forward(self, input_ids, attention_mask):
        h = self.layer(self.embed(input_ids))
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        # sentence-transformers' mean pooling clamps the token count at 1e-9
        count = m.sum(1).clamp(min=1e-9) if self.eps_pool else m.sum(1)
        pooled = (h * m).sum(1) / count
        return self.proj(pooled)


class InfoNCE(nn.Module):
    """In-batch negatives, CLIP's learned temperature ``logit_scale`` (open_clip clamps its
    exp at 100; ``clamp=False`` is the version without it)."""

    def __init__(self, init: float = math.log(1 / 0.07), clamp: bool = True,
                 normalize=F.normalize):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(init))
        self.clamp = clamp
        self.normalize = normalize

    def forward(self, q_reps, p_reps):
        q = self.normalize(q_reps, dim=-1)
        p = self.normalize(p_reps, dim=-1)
        scale = self.logit_scale.exp()
        if self.clamp:
            scale = scale.clamp(max=100)
        scores = scale * q @ p.T
        # GradCache's contrastive_loss: passages per query after the positive are hard negatives
        target = torch.arange(q.size(0)) * (p.size(0) // q.size(0))
        return F.cross_entropy(scores, target)


def l2_normalize(x, dim: int = -1, eps: float = 1e-8):
    """F.normalize written by hand, the eps clamped after the sqrt."""
    return x / torch.sqrt((x * x).sum(dim, keepdim=True)).clamp(min=eps)


class DedupInfoNCE(nn.Module):
    """In-batch negatives with duplicates masked out: a passage that is the positive of another
    query in the batch is no negative (``-inf`` score). ``keep_own=False`` forgets to keep a
    query's own positive out of that mask (``same & ~eye``)."""

    def __init__(self, temperature: float = 0.05, keep_own: bool = True):
        super().__init__()
        self.temperature, self.keep_own = temperature, keep_own

    def forward(self, q_reps, p_reps, doc_ids):
        scores = F.normalize(q_reps, dim=-1) @ F.normalize(p_reps, dim=-1).T / self.temperature
        same = doc_ids[:, None] == doc_ids[None, :]
        if self.keep_own:
            same &= ~torch.eye(len(doc_ids), dtype=torch.bool)
        scores = scores.masked_fill(same, float("-inf"))
        return F.cross_entropy(scores, torch.arange(len(doc_ids)))


class SigLipLoss(nn.Module):
    """SigLIP: every pair a binary problem, learned temperature and bias (init 10, -10)."""

    def __init__(self, log_sigmoid: bool = True):
        super().__init__()
        self.t_prime = nn.Parameter(torch.tensor(math.log(10.0)))
        self.b = nn.Parameter(torch.tensor(-10.0))
        self.log_sigmoid = log_sigmoid

    def forward(self, img, txt):
        img, txt = F.normalize(img, dim=-1), F.normalize(txt, dim=-1)
        logits = img @ txt.T * self.t_prime.exp() + self.b
        labels = 2 * torch.eye(img.size(0)) - 1
        if self.log_sigmoid:
            return -F.logsigmoid(labels * logits).sum() / img.size(0)
        return -torch.log(torch.sigmoid(labels * logits)).sum() / img.size(0)


class RandContext:
    """GradCache's: the CPU RNG state as a chunk's no-grad forward found it, restored for its
    re-run with grad so that dropout draws the same masks."""

    def __init__(self):
        self.fwd_cpu_state = torch.get_rng_state()

    def __enter__(self):
        self._fork = torch.random.fork_rng(devices=[])
        self._fork.__enter__()
        torch.set_rng_state(self.fwd_cpu_state)

    def __exit__(self, *exc):
        self._fork.__exit__(*exc)
        self._fork = None


class GradCache:
    """luyug/GradCache's ``cache_step`` for one shared encoder: ``models=[enc, enc]``."""

    def __init__(self, model, chunk_size: int, loss_fn, surrogate: str = "dot"):
        self.model, self.chunk_size, self.loss_fn = model, chunk_size, loss_fn
        self.surrogate = surrogate

    def split(self, batch):
        return [dict(zip(batch, t)) for t in zip(*(v.split(self.chunk_size) for v in
                                                   batch.values()))]

    def forward_no_grad(self, chunks):
        reps, states = [], []
        with torch.no_grad():
            for x in chunks:
                states.append(RandContext())
                reps.append(self.model(**x))
        return torch.cat(reps), states

    def build_cache(self, *reps):
        reps = [r.detach().requires_grad_() for r in reps]
        loss = self.loss_fn(*reps)
        loss.backward()
        return [r.grad for r in reps], loss.detach()

    def forward_backward(self, chunks, cached, states):
        for x, gradient, state in zip(chunks, cached.split(self.chunk_size), states):
            with state:
                reps = self.model(**x)
            if self.surrogate == "dot":
                torch.dot(reps.flatten(), gradient.flatten()).backward()
            else:
                reps.backward(gradient=gradient)

    def cache_step(self, *batches):
        chunked = [self.split(b) for b in batches]
        reps, states = zip(*(self.forward_no_grad(c) for c in chunked))
        cache, loss = self.build_cache(*reps)
        for chunks, c, s in zip(chunked, cache, states):
            self.forward_backward(chunks, c, s)
        return loss


class TwinEncoder(nn.Module):
    """Barlow Twins' / VICReg's backbone and expander for two views of a tabular record."""

    def __init__(self, d_in: int = 10, hidden: int = 32, d_out: int = 16, relu_out=False):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden),
                                      nn.ReLU())
        layers = [nn.Linear(hidden, hidden, bias=False), nn.BatchNorm1d(hidden),
                  nn.ReLU(inplace=True), nn.Linear(hidden, d_out, bias=False)]
        if relu_out:
            layers.append(nn.ReLU())
        self.projector = nn.Sequential(*layers)

    def forward(self, y1, y2):
        return self.projector(self.backbone(y1)), self.projector(self.backbone(y2))


def off_diagonal(x):
    n, m = x.shape
    assert n == m
    return x.flatten()[:-1].view(n - 1, n + 1)[:, 1:].flatten()


class BarlowTwinsLoss(nn.Module):
    """The paper's pseudo-code: each feature standardised by its batch mean and std."""

    def __init__(self, lambd: float = 0.0051):
        super().__init__()
        self.lambd = lambd

    def forward(self, z1, z2):
        z1 = (z1 - z1.mean(0)) / z1.std(0)
        z2 = (z2 - z2.mean(0)) / z2.std(0)
        c = z1.T @ z2 / z1.size(0)
        on_diag = torch.diagonal(c).add(-1).pow(2).sum()
        off_diag = off_diagonal(c).pow(2).sum()
        return on_diag + self.lambd * off_diag


class VICRegLoss(nn.Module):
    """facebookresearch/vicreg's loss; ``eps=0`` drops its 1e-4 from ``sqrt(var + eps)``."""

    def __init__(self, eps: float = 1e-4, sim=25.0, std=25.0, cov=1.0):
        super().__init__()
        self.eps, self.sim, self.std, self.cov = eps, sim, std, cov

    def forward(self, x, y):
        n, d = x.shape
        repr_loss = F.mse_loss(x, y)
        x = x - x.mean(dim=0)
        y = y - y.mean(dim=0)
        std_x = torch.sqrt(x.var(dim=0) + self.eps)
        std_y = torch.sqrt(y.var(dim=0) + self.eps)
        std_loss = torch.mean(F.relu(1 - std_x)) / 2 + torch.mean(F.relu(1 - std_y)) / 2
        cov_x = (x.T @ x) / (n - 1)
        cov_y = (y.T @ y) / (n - 1)
        cov_loss = off_diagonal(cov_x).pow(2).sum().div(d) + off_diagonal(cov_y).pow(2).sum().div(d)
        return self.sim * repr_loss + self.std * std_loss + self.cov * cov_loss


def make_encoder(eps_pool: bool = True, project: bool = True) -> TextEncoder:
    torch.manual_seed(0)
    return TextEncoder(eps_pool, project)


def make_twins(relu_out: bool = False) -> TwinEncoder:
    torch.manual_seed(0)
    return TwinEncoder(relu_out=relu_out)


def _backward_hook(grad_output, sentence_features, loss_obj):
    """sentence-transformers' CachedMultipleNegativesRankingLoss: inside the loss's backward,
    each mini-batch re-run with grad under its RNG state and backpropagated with the cache."""
    with torch.enable_grad():
        for sentence_feature, grad, random_states in zip(sentence_features, loss_obj.cache,
                                                         loss_obj.random_states):
            for (reps_mb, _), grad_mb in zip(
                    loss_obj.embed_minibatch_iter(sentence_feature, with_grad=True,
                                                  copy_random_state=False,
                                                  random_states=random_states), grad):
                surrogate = torch.dot(reps_mb.flatten(), grad_mb.flatten()) * grad_output
                surrogate.backward()


class CachedMNRL(nn.Module):
    """CachedMultipleNegativesRankingLoss (GradCache inside a loss module holding the model):
    the forward embeds without grad, computes the loss with its backward on detached reps,
    and returns it detached with a hook that runs the re-runs when the loop calls backward."""

    def __init__(self, model, scale: float = 20.0, mini_batch_size: int = 4,
                 normalize=F.normalize):
        super().__init__()
        self.model, self.scale, self.mini_batch_size = model, scale, mini_batch_size
        self.normalize = normalize
        self.cross_entropy_loss = nn.CrossEntropyLoss()
        self.cache, self.random_states = None, None

    def embed_minibatch(self, sentence_feature, begin, end, with_grad, copy_random_state,
                        random_state=None):
        grad_context = torch.enable_grad if with_grad else torch.no_grad
        with random_state or _Null(), grad_context():
            random_state = RandContext() if copy_random_state else None
            reps = self.model(**{k: v[begin:end] for k, v in sentence_feature.items()})
        return reps, random_state

    def embed_minibatch_iter(self, sentence_feature, with_grad, copy_random_state,
                             random_states=None):
        n = len(sentence_feature["input_ids"])
        for i, b in enumerate(range(0, n, self.mini_batch_size)):
            yield self.embed_minibatch(sentence_feature, b, b + self.mini_batch_size, with_grad,
                                       copy_random_state,
                                       None if random_states is None else random_states[i])

    def calculate_loss_and_cache_gradients(self, reps):
        embeddings_a = torch.cat(reps[0])
        embeddings_b = torch.cat([torch.cat(r) for r in reps[1:]])
        scores = self.normalize(embeddings_a, dim=-1) @ self.normalize(embeddings_b, dim=-1).T
        labels = torch.arange(len(embeddings_a))
        loss = self.cross_entropy_loss(scores * self.scale, labels)
        loss.backward()
        self.cache = [[r.grad for r in rs] for rs in reps]
        return loss.detach().requires_grad_()

    def forward(self, sentence_features, labels=None):
        reps, self.random_states = [], []
        for sentence_feature in sentence_features:
            reps_mbs, random_state_mbs = [], []
            for reps_mb, random_state in self.embed_minibatch_iter(
                    sentence_feature, with_grad=False, copy_random_state=True):
                reps_mbs.append(reps_mb.detach().requires_grad_())
                random_state_mbs.append(random_state)
            reps.append(reps_mbs)
            self.random_states.append(random_state_mbs)
        loss = self.calculate_loss_and_cache_gradients(reps)
        loss.register_hook(lambda g: _backward_hook(g, sentence_features, self))
        return loss


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None
