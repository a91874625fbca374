"""Models that hold TorchScript modules, as older training code does: a scripted residual block
(``torch.jit.script``), a traced feature layer (``torch.jit.trace``), and a scripted function
called from an eager module. PyTorch registers no hooks on a ScriptModule."""

from __future__ import annotations

import torch
from torch import nn


@torch.jit.script
def fused_gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / 1.41421356))


class Block(nn.Module):
    def __init__(self, width: int = 16, naive_lse: bool = False):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.naive_lse = naive_lse

    def forward(self, x):
        h = self.fc(x)
        if self.naive_lse:  # the bug: log-softmax written out, exp overflows on a large row
            h = h - torch.log(torch.exp(h).sum(-1, keepdim=True))
        return self.norm(x + fused_gelu(h))


class Scaled(nn.Module):
    """An eager head whose ``scale`` the planted bug makes divide by zero."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.fc = nn.Linear(width, 1)

    def forward(self, x, scale):
        return self.fc(x) / scale


class Net(nn.Module):
    def __init__(self, naive_lse: bool = False, width: int = 16):
        super().__init__()
        self.stem = torch.jit.trace(nn.Linear(8, width), torch.zeros(2, 8))
        self.block = torch.jit.script(Block(width, naive_lse))
        self.mid = Block(width)
        self.head = Scaled(width)

    def forward(self, x, scale):
        h = self.stem(x)
        h = self.block(h)
        return self.head(self.mid(h), scale)


def make_model():
    torch.manual_seed(0)
    return Net()


def make_overflow_model():
    torch.manual_seed(0)
    return Net(naive_lse=True)


def batch(step: int, n: int = 16, big_at: int | None = None):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)
    if step == big_at:
        x[5] = 300.0  # row 5's activations in the hundreds: exp overflows float32
    return x, y


@torch.jit.script
def log_target_mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss scripted as a function (no hooks, no Python frames): the model predicts the log
    of a positive target."""
    return ((pred - torch.log(y)) ** 2).mean()


class MaskedMeanPool(nn.Module):
    """Scripted as fairseq and torchaudio ship such pieces: the mean over a sample's valid
    positions, whose count is 0 for a sample with none."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        count = mask.sum(1, keepdim=True)
        return (x * mask.unsqueeze(-1)).sum(1) / count


class Encoder(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.proj = nn.Linear(4, width)
        self.pool = torch.jit.script(MaskedMeanPool())

    def forward(self, x, mask):
        return self.pool(torch.relu(self.proj(x)), mask)


class PoolNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = Encoder()
        self.head = nn.Linear(8, 1)

    def forward(self, x, mask):
        return self.head(self.enc(x, mask))


def make_pool_model():
    torch.manual_seed(0)
    return PoolNet()


def token_batch(step: int, n: int = 6, empty: tuple[int, int] | None = None):
    """Tokens (n, 5, 4), their 0/1 mask, targets; ``empty`` = (step, row): that row's mask
    all 0 at that step."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(n, 5, 4, generator=g), torch.randn(n, 1, generator=g)
    mask = (torch.rand(n, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    if empty is not None and step == empty[0]:
        mask[empty[1]] = 0.0
    return x, mask, y


class RowNorm(nn.Module):
    """The length of each row, a sqrt of a sum of squares: its gradient at a zero row is
    1/(2*0) times 0, NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x * x).sum(-1, keepdim=True))


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = torch.jit.script(RowNorm())
        self.head = nn.Linear(1, 1)

    def forward(self, x):
        present = (x != 0).any(-1, keepdim=True)  # a record of zeros: its features 0 too
        return self.head(self.norm(self.fc(x) * present))


def make_norm_model():
    torch.manual_seed(0)
    return NormNet()
