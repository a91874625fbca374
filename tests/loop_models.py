"""Models of the less common training loops in ``test_optimizer_loops.py`` (progressive
unfreezing, ...), importable by the replay as factories (``loop_models:make_...``)."""

from __future__ import annotations

import torch
from torch import nn


class SqrtNormEncoder(nn.Module):
    """Features scaled to unit length by a hand-written norm without an eps inside the sqrt:
    finite forward for a blank record (0 / (0 + eps)), but sqrt's derivative at 0 is infinite
    and the backward makes NaN."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32, bias=False)

    def forward(self, x):
        h = self.proj(x)
        return h / (h.pow(2).sum(1, keepdim=True).sqrt() + 1e-6)


class FineTuned(nn.Module):
    """A pretrained encoder under a new classifier head."""

    def __init__(self):
        super().__init__()
        self.encoder = SqrtNormEncoder()
        self.classifier = nn.Linear(32, 4)

    def forward(self, x):
        return self.classifier(self.encoder(x))


def make_fine_tuned() -> FineTuned:
    return FineTuned()


def fine_tune_batch(step: int, blank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 16, generator=g)
    if blank is not None:
        x[blank] = 0.0  # a blank record
    return x, torch.randint(0, 4, (16,), generator=g)


class Backboned(nn.Module):
    """An MLP backbone under a classifier head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        return self.head(self.backbone(x))


def make_backboned() -> Backboned:
    return Backboned()


class MeanAndScale(nn.Module):
    """A heteroscedastic regression: a mean and an unconstrained scale (no softplus)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.mu = nn.Linear(32, 1)
        self.sigma = nn.Linear(32, 1)

    def forward(self, x):
        h = self.body(x)
        return self.mu(h), self.sigma(h)


def make_mean_and_scale() -> MeanAndScale:
    torch.manual_seed(0)
    model = MeanAndScale()
    with torch.no_grad():
        model.sigma.bias.fill_(2.0)
    return model


def gaussian_nll(out, y):
    mu, sigma = out
    return (torch.log(sigma) + 0.5 * ((y - mu) / sigma) ** 2).mean()


class BagOfTokens(nn.Module):
    """Mean of token embeddings, then a linear classifier."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.out = nn.Linear(16, 50)

    def forward(self, tok):
        return self.out(self.emb(tok).mean(1))


def make_bag_of_tokens() -> BagOfTokens:
    return BagOfTokens()


class Tagger(nn.Module):
    """Token embeddings, a GRU, a tag per token."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.out = nn.Linear(32, 5)

    def forward(self, tok):
        h, _ = self.rnn(self.emb(tok))
        return self.out(h)


def make_tagger() -> Tagger:
    return Tagger()


class TiedEncoder(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, 24)
        self.rnn = nn.GRU(24, 24, batch_first=True)

    def forward(self, tok):
        return self.rnn(self.emb(tok))[1]


class TiedDecoder(nn.Module):
    """Reuses the encoder's embedding module, and ties its output projection to it; its
    log-probabilities are log(softmax), which underflows to log(0)."""

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.rnn = nn.GRU(24, 24, batch_first=True)
        self.proj = nn.Linear(24, emb.num_embeddings, bias=False)
        self.proj.weight = emb.weight
        self.emb = emb

    def forward(self, tok, h):
        out, _ = self.rnn(self.emb(tok), h)
        return torch.log(torch.softmax(self.proj(out) * 8.0, -1))


class TiedAutoencoder(nn.Module):
    def __init__(self, vocab: int = 40):
        super().__init__()
        self.encoder = TiedEncoder(vocab)
        self.decoder = TiedDecoder(self.encoder.emb)

    def forward(self, tok):
        return self.decoder(tok, self.encoder(tok))


def make_tied_autoencoder() -> TiedAutoencoder:
    return TiedAutoencoder()


class OrthoRNN(nn.Module):
    """An RNN whose recurrence is kept orthogonal (``parametrizations.orthogonal``), unrolled
    by hand from a float32 zero state; feature 3 is a count, log-scaled."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 32)
        self.rec = nn.utils.parametrizations.orthogonal(nn.Linear(32, 32, bias=False))
        self.out = nn.Linear(32, 2)

    def forward(self, x):
        feats = torch.cat([x[..., :3], torch.log(x[..., 3:])], -1)
        h = torch.zeros(x.shape[0], 32, dtype=torch.float32)  # (a dtype spelt out)
        for t in range(x.shape[1]):
            h = torch.tanh(self.inp(feats[:, t]) + self.rec(h))
        return self.out(h)


def make_ortho_rnn() -> OrthoRNN:
    return OrthoRNN()


def make_dp_mlp() -> nn.Module:
    """A small regressor without biases (a blank record's gradient is exactly 0), trained with
    per-sample gradients (DP-SGD by hand, ``test_optimizer_loops.py``)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 1, bias=False))


class MultiHead(nn.Module):
    """A continual-learning classifier: a shared body and one head per task seen so far, the
    heads' logits summed; a task's head is appended when the task comes."""

    def __init__(self, n_heads: int = 1):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.heads = nn.ModuleList(nn.Linear(32, 3) for _ in range(n_heads))

    def forward(self, x):
        h = self.body(x)
        return torch.stack([head(h) for head in self.heads], 1).sum(1)


def make_multi_head(n_heads: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return MultiHead(n_heads)


class RowStandardise(nn.Module):
    def forward(self, x):
        return (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)  # the bug: no eps


def make_dropout_standardised() -> nn.Module:
    """Input dropout, then each row standardised (0/0 for a constant row), then an MLP."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Dropout(0.2), RowStandardise(), nn.Linear(12, 32),
                         nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
