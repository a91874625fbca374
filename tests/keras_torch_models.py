"""Keras 3 models on the PyTorch backend, trained by ``model.fit`` (the Keras optimizer, not
torch.optim), with the failures Keras users meet planted; a plain torch loop beside them."""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from keras import layers, ops  # noqa: E402
from torch import nn  # noqa: E402

FEATURES = 8


def data(n=64, seed=0, scale=1.0):
    """A regression set: ``y`` a smooth function of ``x``."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, FEATURES)) * scale).astype("float32")
    y = (np.tanh(x[:, :1] / scale) + 0.1 * rng.standard_normal((n, 1))).astype("float32")
    return x, y


def log_error(y_true, y_pred):
    """A user's log-scale error of positive targets, the prediction not kept above 0."""
    return ops.mean(ops.square(ops.log(y_pred) - ops.log(y_true)), axis=-1)


def mlp(loss="mse", optimizer="adam", dtype=None, width=16):
    """``keras.Sequential`` regressor, compiled."""
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        layers.Dense(width, activation="relu", name="hidden", dtype=dtype),
        layers.Dense(1, name="head", dtype=dtype)], name="mlp")
    model.compile(optimizer=optimizer, loss=loss)
    return model


def make_mlp():
    """The factory: the compiled model with its compiled loss to re-run."""
    model = mlp()
    return {"model": model, "loss_fn": model.compute_loss}


def make_log_mlp():
    model = mlp(loss=log_error)
    return {"model": model, "loss_fn": model.compute_loss}


def make_fp16_mlp():
    model = mlp(dtype="mixed_float16")
    return {"model": model, "loss_fn": model.compute_loss}


class PoissonRate(keras.Model):
    """A subclassed count model: the rate is ``exp`` of an unbounded linear score."""

    def __init__(self):
        super().__init__(name="poisson")
        self.encoder = layers.Dense(16, activation="relu", name="encoder")
        self.score = layers.Dense(1, name="score")

    def call(self, x):
        return ops.exp(self.score(self.encoder(x)))


def make_poisson():
    model = PoissonRate()
    model(np.zeros((1, FEATURES), "float32"))  # builds the layers (no build() of its own)
    model.compile(optimizer="adam", loss="mse")
    return {"model": model, "loss_fn": model.compute_loss}


class RootFeatures(keras.Model):
    """A subclassed model adding the length of its tanh features as one more feature: a blank
    record (all zeros, Keras's zero-initialised bias) has features all 0, whose length
    ``sqrt(sum(h**2))`` is 0 in the forward and whose gradient is inf * 0 = NaN."""

    def __init__(self):
        super().__init__(name="root_features")
        self.encoder = layers.Dense(16, activation="tanh", name="encoder")
        self.head = layers.Dense(1, name="head")

    def call(self, x):
        h = self.encoder(x)
        length = ops.sqrt(ops.sum(ops.square(h), axis=-1, keepdims=True))
        return self.head(ops.concatenate([h, length], axis=-1))


def make_root():
    model = RootFeatures()
    model(np.zeros((1, FEATURES), "float32"))  # builds the layers (no build() of its own)
    model.compile(optimizer="adam", loss="mse")
    return {"model": model, "loss_fn": model.compute_loss}


class TorchMLP(nn.Module):
    """The same regressor in plain torch, for a hand-written loop."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(FEATURES, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(x)))


def make_torch_mlp():
    torch.manual_seed(0)
    return TorchMLP()


def make_sgd_mlp(learning_rate=1e25):
    """The regressor under Keras's SGD with a learning rate typed with the wrong exponent."""
    model = mlp(optimizer=keras.optimizers.SGD(learning_rate=learning_rate))
    return {"model": model, "loss_fn": model.compute_loss}


VOCAB, LENGTH = 50, 6


class MaskedMean(layers.Layer):
    """Mean over a sequence's real tokens (``mask`` True), without guarding a sequence that has
    none: 0/0."""

    def call(self, h, mask):
        m = ops.expand_dims(ops.cast(mask, h.dtype), -1)
        return ops.sum(h * m, axis=1) / ops.sum(m, axis=1)


class TokenRegressor(keras.Model):
    """Embedding, self-attention over the real tokens, LayerNormalization, masked mean pooling,
    trained by an overridden ``train_step`` (the Keras guide's PyTorch one, with gradient
    clipping) on a torch ``DataLoader``."""

    def __init__(self):
        super().__init__(name="tokens")
        self.embed = layers.Embedding(VOCAB, 16, name="embed")
        self.attn = layers.MultiHeadAttention(2, 8, name="attn")
        self.norm = layers.LayerNormalization(name="norm")
        self.pool = MaskedMean(name="pool")
        self.head = layers.Dense(1, name="head")

    def call(self, tokens):
        mask = tokens != 0
        h = self.embed(tokens)
        pair = ops.logical_and(ops.expand_dims(mask, 1), ops.expand_dims(mask, 2))
        h = self.norm(h + self.attn(h, h, attention_mask=pair))
        return self.head(self.pool(h, mask))

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)
        weights = self.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in weights], weights)
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def make_tokens():
    model = TokenRegressor()
    model(np.ones((1, LENGTH), "int64"))
    model.compile(optimizer="adam", loss="mse")
    return {"model": model, "loss_fn": model.compute_loss}


def token_loader(n=64, blank=None, batch_size=16):
    """Padded token sequences (0 pads) and a target; row ``blank`` all padding."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
    x[torch.arange(LENGTH) >= lengths[:, None]] = 0
    if blank is not None:
        x[blank] = 0
    y = (x.float().mean(1, keepdim=True) / VOCAB)
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)


def bernoulli_nll(y_true, y_pred):
    """A user's binary cross-entropy on logits, written out: ``1 - sigmoid`` rounds to 0."""
    p = ops.sigmoid(y_pred)
    return -ops.mean(y_true * ops.log(p) + (1.0 - y_true) * ops.log(1.0 - p), axis=-1)


def make_bernoulli_mlp():
    model = mlp(loss=bernoulli_nll)
    return {"model": model, "loss_fn": model.compute_loss}
