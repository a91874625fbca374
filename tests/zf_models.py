"""Models, data and parameter groups of ``test_optimizer_zoo.py``: a small tabular classifier
trained the way scripts that try the ``torch.optim`` zoo set it up (no weight decay on norms
and biases, a larger learning rate for the head), importable by the replay as a factory
(``zf_models:make_model``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, d_in: int = 12, hidden: int = 32, n_classes: int = 3):
        super().__init__()
        self.embed = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.act = nn.GELU()
        self.block = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x):
        h = self.act(self.norm(self.embed(x)))
        return self.head(h + self.act(self.block(h)))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def loader(n: int = 256, batch_size: int = 32, dead: int | None = None) -> DataLoader:
    """Standardised features and a class from a noisy linear rule; ``dead``: a feature that
    is 0 in every record (a one-hot column that never occurs)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 12, generator=g)
    y = (x[:, :3].argmax(1) + (torch.rand(n, generator=g) < 0.1).long()) % 3
    if dead is not None:
        x[:, dead] = 0.0
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(2))


def param_groups(model: nn.Module, weight_decay: float = 1e-2, head_lr: float | None = None,
                 lr: float = 1e-3) -> list[dict]:
    """The usual recipe: no weight decay on norms and biases; the head's own rate if given."""
    decay, no_decay, head = [], [], []
    for name, p in model.named_parameters():
        if head_lr is not None and name.startswith("head."):
            head.append(p)
        elif p.ndim < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if head:
        groups.append({"params": head, "lr": head_lr, "weight_decay": weight_decay})
    return groups
