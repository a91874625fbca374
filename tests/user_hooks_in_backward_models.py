"""Models, hooks and data of ``test_user_hooks_in_backward.py``: training code that uses
PyTorch's hook machinery itself, as its practitioners write it.

- the 'optimizer step in backward' tutorial: one optimizer per parameter, stepped from
  ``register_post_accumulate_grad_hook`` with the gradient freed right after (``optim_in_backward``);
- tensor hooks a training script puts on the parameters: clamping (``clamp_grads``) and
  adaptive gradient clipping per output unit, NFNets' AGC (``agc_hooks``);
- the user's own forward pre-hook that normalises the model's input with dataset statistics
  (``normalise_inputs``) and forward hooks that add feature noise or capture activations for an
  activation penalty (``FeatureNoise``, ``ActivationPenalty``);
- ``torch.nn.utils.prune`` and the old hook-based ``torch.nn.utils.spectral_norm``;
- hooks added and removed mid-training (the handles kept and ``remove()``d).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

D_IN, HIDDEN, N_CLASSES, N_CAT = 12, 32, 4, 10


class TabularNet(nn.Module):
    """A tabular classifier: numeric features and one categorical column (an embedding)."""

    def __init__(self):
        super().__init__()
        self.cat_emb = nn.Embedding(N_CAT, 4)
        self.fc1 = nn.Linear(D_IN + 4, HIDDEN)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x, cat):
        h = self.act(self.fc1(torch.cat([x, self.cat_emb(cat)], dim=1)))
        return self.head(self.act(self.fc2(h)))


def make_tabular() -> TabularNet:
    torch.manual_seed(0)
    return TabularNet()


def make_sn_tabular() -> TabularNet:
    """The classifier with its head under the old hook-based ``spectral_norm`` (weight_orig,
    u and v; the weight recomputed by a forward pre-hook), the head zero-initialised first (a
    common trick for residual-free heads): sigma of a zero matrix is 0, weight_orig / sigma."""
    model = make_tabular()
    nn.init.zeros_(model.head.weight)  # the bug: spectral_norm divides by sigma = 0
    nn.utils.spectral_norm(model.head)
    return model


def tabular_data(n: int = 256, seed: int = 0, nan_row: int | None = None,
                 constant_col: int | None = None, scale: float = 3.0,
                 unlabelled_row: int | None = None):
    """``(x, cat, y)``: features, a categorical code in ``[0, N_CAT - 2]`` (the last code
    never occurs in this split) and labels; ``nan_row``: a record with a missing feature read
    as NaN; ``constant_col``: a column one value in every record (a sensor stuck); ``scale``:
    the features' spread (raw units, not standardised, at 100); ``unlabelled_row``: a record
    whose label is -1 (unlabelled, ignored by the loss)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g) * scale + 1
    cat = torch.randint(0, N_CAT - 1, (n,), generator=g)
    y = (x[:, 0] + x[:, 1] > 2).long() + 2 * (cat % 2)
    if constant_col is not None:
        x[:, constant_col] = 7.0
    if unlabelled_row is not None:
        y[unlabelled_row] = -1
    if nan_row is not None:
        x[nan_row, 3] = float("nan")  # the bug: a missing value read as NaN
    return x, cat, y


def loader(data, batch_size: int = 32) -> DataLoader:
    return DataLoader(TensorDataset(*data), batch_size=batch_size, shuffle=False)


# ----------------------------------------------------------------------------------------------
# the optimizer step in backward (the PyTorch tutorial)

def optim_in_backward(model: nn.Module, make_opt) -> dict:
    """One optimizer per parameter, stepped as its gradient is accumulated; the gradient freed
    right after, so the whole model's gradients never exist at once."""
    optimizers = {p: make_opt([p]) for p in model.parameters()}

    def step_hook(p):
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    handles = [p.register_post_accumulate_grad_hook(step_hook) for p in model.parameters()]
    return {"optimizers": optimizers, "handles": handles}


# ----------------------------------------------------------------------------------------------
# tensor hooks on the parameters, registered by the training script

def clamp_grads(model: nn.Module, clip: float = 1.0) -> list:
    """The forum's gradient clipping: every parameter's gradient clamped elementwise."""
    return [p.register_hook(lambda g: g.clamp(-clip, clip)) for p in model.parameters()]


def normalise_grad_rows(model: nn.Module) -> list:
    """Per-unit gradient normalisation, a hook on every weight matrix and the embedding: each
    row of the gradient scaled to norm 1 (the training script registers them)."""
    return [p.register_hook(lambda g: g / g.norm(dim=1, keepdim=True))  # the bug: no eps
            for p in model.parameters() if p.dim() > 1]


def unit_grad_input(module, grad_input, grad_output):
    """A full backward hook normalising the gradient each sample sends back through the layer
    (per-sample gradient normalisation), registered by the training script."""
    g = grad_input[0]
    return (g / g.norm(dim=1, keepdim=True),)  # the bug: no eps; an ignored record's is 0


# ----------------------------------------------------------------------------------------------
# forward (pre-)hooks of the user's

def normalise_inputs(model: nn.Module, x: torch.Tensor) -> object:
    """A forward pre-hook standardising the numeric features with the training set's
    statistics (``(x - mean) / std``), registered on the model after it was built."""
    mean, std = x.mean(0), x.std(0)  # the bug: no eps; a constant column's std is 0

    def pre_hook(module, args):
        feats, cat = args
        return (feats - mean) / std, cat

    return model.register_forward_pre_hook(pre_hook)


class FeatureNoise:
    """A forward hook adding Gaussian noise to a layer's output while training (a feature-noise
    regulariser), scaled by the batch's own spread of each feature."""

    def __init__(self, sigma: float = 0.1):
        self.sigma = sigma

    def __call__(self, module, args, out):
        if not module.training:
            return None
        return out + self.sigma * out.std(0, keepdim=True) * torch.randn_like(out)


class ActivationPenalty:
    """A forward hook capturing a layer's activations for an activation (L2) penalty, AR as
    AWD-LSTM writes it: the loop adds ``alpha * penalty`` to the loss."""

    def __init__(self, module: nn.Module):
        self.value = None
        self.handle = module.register_forward_hook(self)

    def __call__(self, module, args, out):
        # the bug under float16 autocast: the squares' sum overflows 65504 (no .float())
        self.value = out.pow(2).sum(1).mean()

    def remove(self):
        self.handle.remove()


class PenalisedLoss(nn.Module):
    """Cross entropy plus ``alpha`` times the activation penalty a hook captured in the forward
    (a loss wrapper holding the hook's capture)."""

    def __init__(self, penalty: ActivationPenalty, alpha: float = 1e-4):
        super().__init__()
        self.penalty, self.alpha = penalty, alpha
        self.ce = nn.CrossEntropyLoss()

    def forward(self, out, y):
        return self.ce(out.float(), y) + self.alpha * self.penalty.value.float()


def make_penalised() -> dict:
    """The classifier with an activation penalty hooked on ``fc2`` and the loss adding it, as
    the factory returns them for the replay."""
    model = make_tabular()
    return {"model": model, "loss_fn": PenalisedLoss(ActivationPenalty(model.fc2))}


def make_noisy_tabular() -> TabularNet:
    """The classifier with the feature-noise hook on ``fc1`` registered where it is built."""
    model = make_tabular()
    model.fc1.register_forward_hook(FeatureNoise(0.1))
    return model


def make_standardised_tabular() -> TabularNet:
    """The classifier with the input-standardising pre-hook registered where it is built, with
    the statistics of the training split (a stuck sensor's column 5 among them)."""
    model = make_tabular()
    normalise_inputs(model, tabular_data(constant_col=5)[0])
    return model


class NormPenalisedLoss(nn.Module):
    """Cross entropy plus a small penalty on each sample's logit norm (a logit-norm
    regulariser): ``sqrt`` of the squared sum, whose derivative is infinite at 0."""

    def __init__(self, alpha: float = 0.01):
        super().__init__()
        self.alpha = alpha

    def forward(self, out, y):
        norm = out.pow(2).sum(1).sqrt()  # the bug: no eps; logits all 0 -> 0 * inf in backward
        return nn.functional.cross_entropy(out, y) + self.alpha * norm.mean()
