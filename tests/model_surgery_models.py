"""Training loops that change the model or its optimizer while they train, as the well-known
code writes them: ``torch.nn.utils.prune`` global magnitude pruning mid-run (the lottery-ticket
repos, ``prune.global_unstructured`` then ``prune.remove``), lottery-ticket rewinding (the
surviving weights reset in place to an early copy), RigL / SET dynamic sparse training (drop
the smallest weights and regrow as many connections under ``no_grad`` every k steps, the
regrown entries' Adam moments zeroed: rigl-reproducibility's ``SparsityScheduler``), re-init
of dead ReLU units in place, and freezing / unfreezing a pretrained body with a new head's
parameter group (``optimizer.add_param_group``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

D_IN, HIDDEN, CLASSES = 16, 32, 4


class MLP(nn.Module):
    """A LeNet-300-100-style MLP (the lottery-ticket papers' fully connected net, smaller)."""

    def __init__(self, d_in: int = D_IN, hidden: int = HIDDEN, classes: int = CLASSES):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))
        return self.fc3(h)


def make_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()


def batches(n: int, seed: int = 0, size: int = 16):
    """``n`` batches of a fixed random rule (4 classes from two coordinates' signs)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(size, D_IN, generator=g)
        y = (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()
        yield x, y


def prunable(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(m, "weight") for m in model.modules() if isinstance(m, nn.Linear)]


def global_magnitude_prune(model: nn.Module, amount: float) -> None:
    """The lottery-ticket repos' global pruning: the smallest ``amount`` of all Linear weights
    (``weight`` becomes ``weight_orig`` times the buffer ``weight_mask``, by a pre-hook)."""
    prune.global_unstructured(prunable(model), pruning_method=prune.L1Unstructured,
                              amount=amount)


def make_permanent(model: nn.Module) -> None:
    for m, name in prunable(model):
        if prune.is_pruned(m):
            prune.remove(m, name)


def rewind(model: nn.Module, early: dict[str, torch.Tensor]) -> None:
    """Lottery-ticket rewinding: every ``weight_orig`` and bias set back in place to its value
    at the rewind step (the mask stays: the pruned entries remain 0 in the forward)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(early[name.replace("_orig", "")])


# ---------------------------------------------------------------------------------------------
# RigL / SET: drop and regrow connections in place


def rigl_update(layer: nn.Linear, mask: torch.Tensor, optimizer, fraction: float) -> None:
    """Drop the ``fraction`` smallest active weights of ``layer`` and regrow as many inactive
    connections where the dense gradient is largest (RigL). The regrown entries start from
    their row's mean surviving magnitude (the bug: a row with none left is 0/0), and their
    Adam moments are zeroed."""
    with torch.no_grad():
        w, grad = layer.weight, layer.weight.grad
        active = int(mask.sum())
        k = int(fraction * active)
        score_drop = torch.where(mask.bool(), w.abs(), torch.full_like(w, float("inf")))
        drop = torch.topk(score_drop.flatten(), k, largest=False).indices
        mask.view(-1)[drop] = 0
        score_grow = torch.where(mask.bool(), torch.full_like(w, -float("inf")), grad.abs())
        grow = torch.topk(score_grow.flatten(), k).indices
        mask.view(-1)[grow] = 1
        grown = torch.zeros_like(mask, dtype=torch.bool)
        grown.view(-1)[grow] = True
        # each regrown entry: its row's mean surviving magnitude, signed by its gradient
        kept = (mask.bool() & ~grown).float()
        scale = (w.abs() * kept).sum(1, keepdim=True) / kept.sum(1, keepdim=True)
        w[grown] = (-grad.sign() * scale.expand_as(w))[grown]
        w.mul_(mask)
        state = optimizer.state[w]
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key][grown] = 0


# ---------------------------------------------------------------------------------------------
# Dead ReLU units re-initialised in place


def reinit_dead(layer: nn.Linear, nxt: nn.Linear, acts: torch.Tensor) -> int:
    """Units of ``layer`` whose ReLU output was 0 on the whole batch get new incoming weights
    drawn with the std of the live units' weights, their outgoing weights zeroed (as the
    "ReDo" recipe and continual-backprop's re-init write it). Returns how many."""
    with torch.no_grad():
        dead = (acts <= 0).all(0)
        live = ~dead
        std = layer.weight[live].std(0)
        n = int(dead.sum())
        if n:
            layer.weight[dead] = torch.randn(n, layer.in_features) * std
            layer.bias[dead] = 0
            nxt.weight[:, dead] = 0
    return n


def rigl_update_pruned(layer: nn.Linear, optimizer, fraction: float) -> None:
    """:func:`rigl_update` on a layer pruned with ``torch.nn.utils.prune``: the mask is its
    ``weight_mask`` buffer, the trained tensor its ``weight_orig``."""
    orig, mask = layer.weight_orig, layer.weight_mask
    with torch.no_grad():
        w, grad = orig, orig.grad
        active = int(mask.sum())
        k = int(fraction * active)
        score_drop = torch.where(mask.bool(), w.abs(), torch.full_like(w, float("inf")))
        drop = torch.topk(score_drop.flatten(), k, largest=False).indices
        mask.view(-1)[drop] = 0
        score_grow = torch.where(mask.bool(), torch.full_like(w, -float("inf")), w.abs() + grad.abs())
        grow = torch.topk(score_grow.flatten(), k).indices
        mask.view(-1)[grow] = 1
        grown = torch.zeros_like(mask, dtype=torch.bool)
        grown.view(-1)[grow] = True
        kept = (mask.bool() & ~grown).float()
        scale = (w.abs() * kept).sum(1, keepdim=True) / kept.sum(1, keepdim=True)
        w[grown] = (-grad.sign() * scale.expand_as(w))[grown]
        state = optimizer.state[w]
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key][grown] = 0


class ParamNet(nn.Module):
    """An MLP with ``parametrizations.weight_norm`` on its first layer and an orthogonal
    (``parametrizations.orthogonal``) square hidden layer, as a factory builds it."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.utils.parametrizations.weight_norm(nn.Linear(D_IN, HIDDEN))
        self.rec = nn.utils.parametrizations.orthogonal(nn.Linear(HIDDEN, HIDDEN, bias=False))
        self.fc3 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.rec(h))
        return self.fc3(h)


def make_paramnet() -> ParamNet:
    torch.manual_seed(0)
    return ParamNet()


class CosineHead(nn.Module):
    """A cosine classifier (few-shot / imprinting heads): logits are the scaled cosine of
    the feature and each class's weight row, the row normalised by hand."""

    def __init__(self, d: int, classes: int, scale: float = 10.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, d) * 0.1)
        self.scale = scale

    def forward(self, h):
        w = self.weight / self.weight.norm(dim=1, keepdim=True)  # the bug: a pruned row is 0/0
        return self.scale * F.normalize(h, dim=1) @ w.t()


class CosineNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN))
        self.head = CosineHead(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(self.body(x))


def make_cosine_net() -> CosineNet:
    torch.manual_seed(0)
    return CosineNet()


def net2wider(model: MLP, new_width: int, g: torch.Generator, fixed: bool = True) -> None:
    """Net2WiderNet (Chen et al. 2016) on ``fc2``: new units copy random old ones, and each
    old unit's outgoing weights are divided by how many units now carry it, so the widened
    net computes the same function. ``fixed=False`` counts only the copies (forgetting the
    unit itself): a unit never copied has count 0."""
    old = model.fc2.out_features
    idx = torch.cat([torch.arange(old), torch.randint(0, old, (new_width - old,), generator=g)])
    counts = torch.bincount(idx if fixed else idx[old:], minlength=old).float()
    wide, nxt = nn.Linear(model.fc2.in_features, new_width), nn.Linear(new_width, CLASSES)
    with torch.no_grad():
        wide.weight.copy_(model.fc2.weight[idx])
        wide.bias.copy_(model.fc2.bias[idx])
        nxt.weight.copy_(model.fc3.weight[:, idx] / counts[idx])
        nxt.bias.copy_(model.fc3.bias)
    model.fc2, model.fc3 = wide, nxt


class Regressor(nn.Module):
    """A pretrained body (LeakyReLU MLP) and a regression head: the body is frozen first,
    then unfrozen into a parameter group of its own (gradual unfreezing, ULMFiT-style)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.LeakyReLU(0.1),
                                  nn.Linear(HIDDEN, HIDDEN), nn.LeakyReLU(0.1))
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


def make_regressor() -> Regressor:
    torch.manual_seed(0)
    return Regressor()


def regression_batches(n: int, seed: int = 0, size: int = 16):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(size, D_IN, generator=g)
        yield x, x[:, :4].sum(1) * 3.0
