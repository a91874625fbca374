"""Models whose own code edits the autograd graph: gradient hooks registered in a forward,
custom autograd Functions, penalties that differentiate the model (create_graph=True)."""

from __future__ import annotations

import torch
from torch import nn

D_IN, HIDDEN, N_CLASSES = 10, 32, 3


class GradNormalised(nn.Module):
    """A hidden layer whose incoming gradient a tensor hook normalises per sample (a gradient
    normalisation trick): a row whose gradient is all 0 (a padded label the loss ignores)
    is 0 / 0."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if h.requires_grad:
            h.register_hook(lambda g: g / g.norm(dim=1, keepdim=True))  # BUG: no eps
        return self.fc2(h)


def make_grad_normalised() -> GradNormalised:
    torch.manual_seed(0)
    return GradNormalised()


def batch(step: int, n: int = 16):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, D_IN, generator=g), torch.randint(0, N_CLASSES, (n,), generator=g)


class RowNormalisedBag(nn.Module):
    """A bag-of-words classifier whose embedding gradient a hook, registered as the model is
    built, normalises per row: a token no sample of the batch holds has an all-0 row, 0 / 0."""

    def __init__(self, vocab: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, N_CLASSES)
        self.emb.weight.register_hook(lambda g: g / g.norm(dim=1, keepdim=True))  # BUG: no eps

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def make_row_normalised_bag() -> RowNormalisedBag:
    torch.manual_seed(0)
    return RowNormalisedBag()


def token_batch(step: int, vocab: int = 8, n: int = 16):
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, vocab, (n, 12), generator=g),
            torch.randint(0, N_CLASSES, (n,), generator=g))


def make_regressor() -> nn.Module:
    """Without biases: a zero (padded) input row gives a zero output row."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN, bias=False), nn.ReLU(),
                         nn.Linear(HIDDEN, 4, bias=False))


class DistanceLoss(nn.Module):
    """The mean Euclidean distance to the target: sqrt's derivative is infinite at a residual
    of exactly 0 (a padded row whose target is 0 too)."""

    def forward(self, pred, y):
        return torch.sqrt(((pred - y) ** 2).sum(-1)).mean()  # BUG: no eps under the sqrt


def _unit_grad_input(module, grad_input, grad_output):
    g = grad_input[0]
    return (g / g.norm(dim=1, keepdim=True),)  # BUG: no eps


class BackwardHooked(nn.Module):
    """The activation's gradient normalised per sample by a module backward hook registered
    as the model is built (register_full_backward_hook)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(HIDDEN, N_CLASSES)
        self.act.register_full_backward_hook(_unit_grad_input)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def make_backward_hooked() -> BackwardHooked:
    torch.manual_seed(0)
    return BackwardHooked()


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, N_CLASSES))
