"""Models whose own code checks for non-finite values where they are made and raises, as
people write it: an attention block that raises on NaN weights, a head that asserts its
log-scale is finite, a fixed-step integrator that gives up on a step size that underflowed,
and a block whose matmul has the wrong shape (an error that is no numeric check)."""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        w = scores.softmax(-1)
        if torch.isnan(w).any():
            raise ValueError("NaN in attention weights")
        return w @ x


class LogScaleHead(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.fc = nn.Linear(d, 2)

    def forward(self, h):
        mu, var = self.fc(h).unbind(-1)
        log_var = torch.log(var)
        assert torch.isfinite(log_var).all()
        return mu + 0.0 * log_var


class Euler(nn.Module):
    """Shrinks its step while the update is large; raises when the step underflows."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.f = nn.Linear(d, d)

    def forward(self, h):
        dt = torch.tensor(0.1)
        for _ in range(8):
            dh = self.f(h)
            while dh.abs().max() * dt > 1.0:
                dt = dt / 10
                if dt < 1e-6:
                    raise RuntimeError(f"underflow in dt {dt.item()}")
            h = h + dt * dh
        return h


class Net(nn.Module):
    def __init__(self, head: str = "attention", d: int = 8):
        super().__init__()
        self.head = head
        self.attn = Attention(d)
        self.scale = LogScaleHead(d)
        self.flow = Euler(d)
        self.out = nn.Linear(d, 1)

    def forward(self, x, mask):
        h = self.attn(x, mask).mean(1)
        if self.head == "log_scale":
            return self.scale(h)[:, None]
        if self.head == "euler":
            h = self.flow(h)
        if self.head == "shapes":
            h = h @ torch.ones(3, 3)  # (8 features against 3: a plain bug, no NaN)
        return self.out(h)


def make_model(head: str = "attention"):
    torch.manual_seed(0)
    return Net(head)


def make_log_scale():
    return make_model("log_scale")


def make_euler():
    return make_model("euler")


def make_shapes():
    return make_model("shapes")


def batch(step: int, masked_at: int | None = None, big_at: int | None = None):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 5, 8, generator=g), torch.randn(4, 1, generator=g)
    mask = torch.ones(4, 5, dtype=torch.bool)
    if step == masked_at:
        mask[2] = False  # an empty sequence: every key of row 2 masked
    if step == big_at:
        x[1] *= 1e8  # a record in another unit: the integrator's updates explode
    return x, mask, y


def check_grad(g):
    """A gradient check as a tensor hook, registered in the forward."""
    if not torch.isfinite(g).all():
        raise RuntimeError("non-finite gradient in the embedding")
    return g


class Distances(nn.Module):
    """Embeds without bias and scores each record by its embedding's length (written as the
    sqrt of a sum of squares): a record of zeros is a length of 0, whose gradient is 0/0."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 4, bias=False)
        self.out = nn.Linear(1, 1)

    def forward(self, x, mask=None):
        h = self.embed(x)
        if h.requires_grad:
            h.register_hook(check_grad)
        return self.out(torch.sqrt((h ** 2).sum(-1, keepdim=True)))


def make_distances():
    torch.manual_seed(0)
    return Distances()


def flat_batch(step: int, blank_at: int | None = None):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    if step == blank_at:
        x[3] = 0.0
    return x, None, y


class Policy(nn.Module):
    """Samples its action from softmax(logits / temperature) with ``torch.multinomial``, which
    refuses probabilities holding inf or NaN (its own check, in PyTorch's kernel)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, obs, temperature):
        probs = torch.softmax(self.fc(obs) / temperature, -1)
        action = torch.multinomial(probs, 1)
        return probs.gather(1, action).log()


def make_policy():
    torch.manual_seed(0)
    return Policy()


class Reparam(nn.Module):
    """Samples z ~ N(mu, sqrt(var)) with ``torch.normal``, var a raw linear output (the bug:
    no softplus), which refuses a NaN std in words of its own ('normal expects all elements
    of std >= 0.0')."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x, mask=None):
        mu, var = self.fc(x).unbind(-1)
        z = torch.normal(mu, torch.sqrt(var))
        return z[:, None]


def make_reparam():
    torch.manual_seed(0)
    return Reparam()
