"""Models and loops of the rewind tests (``test_rewind.py``): planted bugs whose cause lies
steps before the event. The factories are what the bundles name (``rewind_models:make_...``),
replayed from this directory."""

from __future__ import annotations

import torch
from torch import nn

D_IN, HIDDEN, N_CLASSES, BATCH = 8, 32, 4, 16


def batch(step: int, n: int = BATCH):
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(n, D_IN, generator=g), torch.randint(0, N_CLASSES, (n,), generator=g)


def regression_batch(step: int, n: int = BATCH):
    """Standard normal features and a noisy linear target: E[x x^T] = I, so the MSE's Hessian
    is 2I and SGD with lr > 1 diverges (each step multiplies the error by about |1 - 2 lr|)."""
    g = torch.Generator().manual_seed(4000 + step)
    x = torch.randn(n, D_IN, generator=g)
    return x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)


class Classifier(nn.Module):
    """An MLP with dropout (the replay must draw the same masks, step after step)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.head(self.body(x))


def make_classifier() -> nn.Module:
    return Classifier()


def make_regressor() -> nn.Module:
    return nn.Linear(D_IN, 1)


class Fusion(nn.Module):
    """A main input and an auxiliary one that joins later (a second modality, a sensor that
    comes online): ``forward(x, aux=None)``."""

    def __init__(self):
        super().__init__()
        self.main = nn.Linear(D_IN, N_CLASSES)
        self.aux = nn.Linear(4, N_CLASSES)

    def forward(self, x, aux=None):
        out = self.main(x)
        return out if aux is None else out + self.aux(aux)


def make_fusion() -> nn.Module:
    return Fusion()


def make_normed_classifier() -> nn.Module:
    """An MLP with BatchNorm: its running statistics are written in place by every training
    forward."""
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, N_CLASSES))


def dead_feature_batch(step: int):
    """Feature 3 is always 0 (a column the pipeline zeroed): the gradient of the first layer's
    weights in that column is exactly 0 at every step."""
    x, y = batch(step)
    x[:, 3] = 0.0
    return x, y


def aux_batch(step: int):
    """Auxiliary features from step 5 on; its channel 2 is a dead sensor (always 0), so that
    column of ``aux.weight`` always gets a gradient of exactly 0."""
    x, y = batch(step)
    if step < 5:
        return (x,), {}, y
    g = torch.Generator().manual_seed(5000 + step)
    aux = torch.randn(BATCH, 4, generator=g)
    aux[:, 2] = 0.0
    return (x,), {"aux": aux}, y


def drifting_batch(step: int):
    """A feature scale that doubles every step (a sensor whose units drift): float16 matmuls
    overflow long before float32 would."""
    x, y = batch(step)
    return x * 2.0 ** step, y


class Forecaster(nn.Module):
    """An nn.LSTM over a sequence and a linear head on its last state."""

    def __init__(self):
        super().__init__()
        self.enc = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h, _ = self.enc(x)
        return self.head(h[:, -1])


def make_forecaster() -> nn.Module:
    return Forecaster()


class GaussianNLL(nn.Module):
    """The negative log-likelihood of a predicted mean and log-variance, without a clamp on
    the log-variance: exp(-logvar) overflows once training drives it far below 0."""

    def forward(self, out, y):
        mu, logvar = out[:, :1], out[:, 1:]
        return 0.5 * (logvar + (y - mu) ** 2 * torch.exp(-logvar)).mean()


def make_hetero_regressor() -> nn.Module:
    """A regressor of a mean and a log-variance (heteroscedastic), for ``GaussianNLL``."""
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, HIDDEN),
                         nn.SiLU(), nn.Linear(HIDDEN, 2))


class SelfLossClassifier(nn.Module):
    """Computes its loss when given targets and returns it beside the logits, as Hugging Face
    and nanoGPT models do: the loss is computed from another output."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, N_CLASSES))

    def forward(self, x, targets=None):
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, targets) if targets is not None else None
        return logits, loss


def make_self_loss_classifier() -> nn.Module:
    return SelfLossClassifier()


def make_tagger() -> nn.Module:
    """A per-token classifier of ``(B, T, D_IN)`` sequences (its loop flattens the logits and
    the tags for the loss)."""
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, N_CLASSES))


def make_price_regressor() -> nn.Module:
    """A tabular MLP regressor without normalisation (20 features, 10 targets)."""
    return nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


class TextCNN(nn.Module):
    """Token embeddings, a 1-d convolution, max-pooling over time and a linear head."""

    def __init__(self, vocab: int = 500, dim: int = 32, n_classes: int = 5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, 64, 3, padding=1)
        self.head = nn.Linear(64, n_classes)

    def forward(self, tokens):
        h = torch.relu(self.conv(self.emb(tokens).transpose(1, 2))).amax(dim=2)
        return self.head(h)


def make_half_text_cnn() -> nn.Module:
    """The TextCNN trained in float16 throughout (``model.half()``, no autocast)."""
    return TextCNN().half()


def make_gelu_regressor() -> nn.Module:
    """An MLP regressor with GELU and a LayerNorm (16 features, 1 target)."""
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64),
                         nn.GELU(), nn.Linear(64, 1))


class TemperatureHead(nn.Module):
    """Logits divided by a temperature the training loop anneals (a plain float attribute, as
    Gumbel-softmax and distillation code keep it), set on the module between steps."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, N_CLASSES)
        self.temperature = 1.0

    def forward(self, h):
        return self.proj(h) / self.temperature


class AnnealedClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU())
        self.head = TemperatureHead()

    def forward(self, x):
        return self.head(self.body(x))


def make_annealed_classifier() -> nn.Module:
    return AnnealedClassifier()
