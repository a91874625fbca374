"""Learning rules without end-to-end backprop, as research code writes them, for
``test_local_learning``.

- ``FFNet``: Hinton's Forward-Forward MLP (mpezeshki/pytorch_forward_forward's layout): each
  layer's input normalised by its length ``x / (x.norm(dim=1, keepdim=True) + eps)``, a ReLU,
  goodness the mean of squared activations, the loss ``softplus(-(g_pos - theta))`` and
  ``softplus(g_neg - theta)`` per layer, ``detach`` between layers, one Adam over all layers.
  Negative data: the image with a wrong label embedded in its first pixels. ``make_ff_amp``:
  raw pixels into the first layer and Hinton's summed goodness, for float16 autocast.
- ``PCNet``: a predictive coding network (Whittington & Bogacz; Millidge's pypc): latents
  initialised by a feed-forward sweep, relaxed in ``forward`` by ``n_iter`` gradient steps on
  the local energy ``sum ||x_l - W_l f(x_{l-1})||^2 / 2`` with the output clamped to the
  target, then the weights learn from the local errors (the loss is the relaxed energy, each
  layer's prediction seeing detached latents).
- ``TPNet``: target propagation (Lee et al.) through the top tanh layer's analytic inverse
  ``W2^+ (atanh(t) - b2)``, each layer learning from its own detached target.
- ``HebbNet``: a Hebbian/Oja feature layer updated in ``torch.no_grad()`` in place after a
  backprop-trained linear readout's step (Krotov & Hopfield's two-stage recipe, online).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# Forward-Forward


class FFLayer(nn.Linear):
    def __init__(self, n_in: int, n_out: int, eps: float | None, norm: bool = True):
        super().__init__(n_in, n_out)
        self.eps, self.norm = eps, norm

    def forward(self, x):
        if not self.norm:  # (the first layer of some FF code takes the pixels as they are)
            pass
        elif self.eps is None:
            x = x / x.norm(dim=1, keepdim=True)  # the bug: a row of zeros is 0/0
        else:
            x = x / (x.norm(dim=1, keepdim=True) + self.eps)
        return F.relu(super().forward(x))


class FFNet(nn.Module):
    """Goodness of the positive and negative batches per layer: ``(layers, B)`` each."""

    def __init__(self, dims=(20, 32, 32), eps: float | None = 1e-4, raw_first: bool = False,
                 summed: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(FFLayer(a, b, eps, norm=not (raw_first and i == 0))
                                    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])))
        self.summed = summed  # goodness as Hinton's sum of squares, not their mean

    def forward(self, x_pos, x_neg):
        g_pos, g_neg = [], []
        h_pos, h_neg = x_pos, x_neg
        for layer in self.layers:
            h_pos, h_neg = layer(h_pos), layer(h_neg)
            g_pos.append(h_pos.pow(2).sum(1) if self.summed else h_pos.pow(2).mean(1))
            g_neg.append(h_neg.pow(2).sum(1) if self.summed else h_neg.pow(2).mean(1))
            h_pos, h_neg = h_pos.detach(), h_neg.detach()  # no backprop between layers
        return torch.stack(g_pos), torch.stack(g_neg)


def ff_loss(g_pos, g_neg, threshold: float = 2.0):
    """Hinton's per-layer logistic loss on goodness minus a threshold, summed over layers."""
    return (F.softplus(-(g_pos - threshold)) + F.softplus(g_neg - threshold)).mean(1).sum()


def make_ff() -> FFNet:
    torch.manual_seed(0)
    return FFNet(eps=None)


def make_ff_eps() -> FFNet:
    torch.manual_seed(0)
    return FFNet(eps=1e-4)


def make_ff_amp() -> FFNet:
    """Raw pixels into the first layer, goodness summed over 64 units (threshold 64), trained
    under float16 autocast."""
    torch.manual_seed(0)
    return FFNet(dims=(20, 64, 64), raw_first=True, summed=True)


def ff_batch(g: torch.Generator, blank: int | None = None, n: int = 16, classes: int = 4):
    """Positive data: the label one-hot in the first ``classes`` pixels of the image; negative:
    a random wrong label. ``blank``: an all-black image whose label pixels the loader lost too
    (a padded record), so both of its rows are zeros."""
    x = torch.rand(n, 20, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    wrong = (y + torch.randint(1, classes, (n,), generator=g)) % classes
    x_pos, x_neg = x.clone(), x.clone()
    x_pos[:, :classes] = F.one_hot(y, classes).float()
    x_neg[:, :classes] = F.one_hot(wrong, classes).float()
    if blank is not None:
        x_pos[blank] = 0.0
        x_neg[blank] = 0.0
    return x_pos, x_neg


def ff_batch_unscaled(g: torch.Generator, row: int | None = None, n: int = 16):
    """:func:`ff_batch` with one record's pixels left in [0, 255] (a loader path that skipped
    ToTensor's division by 255)."""
    x_pos, x_neg = ff_batch(g, None, n)
    if row is not None:
        x_pos[row, 4:] *= 255
        x_neg[row, 4:] *= 255
    return x_pos, x_neg


# ---------------------------------------------------------------------------------------------
# predictive coding


class PCNet(nn.Module):
    """x0 (input, clamped) -> x1 -> x2 (output, clamped to the target in training)."""

    def __init__(self, dims=(8, 24, 4), n_iter: int = 20, x_lr: float = 0.1):
        super().__init__()
        self.preds = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.n_iter, self.x_lr = n_iter, x_lr

    def energy(self, xs):
        return sum(0.5 * (xs[i + 1] - p(torch.tanh(xs[i]))).pow(2).sum()
                   for i, p in enumerate(self.preds))

    def forward(self, x, target):
        with torch.no_grad():  # feed-forward sweep initialises the latents
            xs = [x]
            for p in self.preds:
                xs.append(p(torch.tanh(xs[-1])))
        xs[-1] = target
        hidden = [h.clone().requires_grad_(True) for h in xs[1:-1]]
        for _ in range(self.n_iter):  # relax the latents on the local energy
            e = self.energy([x, *hidden, target])
            grads = torch.autograd.grad(e, hidden)
            hidden = [(h - self.x_lr * g).detach().requires_grad_(True)
                      for h, g in zip(hidden, grads)]
        xs = [x, *(h.detach() for h in hidden), target]
        # local errors at the relaxed latents: each weight learns from its own layer's error
        return torch.stack([(xs[i + 1] - p(torch.tanh(xs[i]))).pow(2).sum(1)
                            for i, p in enumerate(self.preds)], 1)


def pc_loss(errors):
    return 0.5 * errors.sum(1).mean()


def make_pc() -> PCNet:
    torch.manual_seed(0)
    return PCNet()


def make_pc_fast() -> PCNet:
    """The inference rate raised to converge in fewer iterations: past 2 / the energy's
    curvature the relaxation diverges."""
    torch.manual_seed(0)
    return PCNet(x_lr=3.0, n_iter=100)


def pc_batch(g: torch.Generator, n: int = 16):
    x = torch.randn(n, 8, generator=g)
    target = torch.tanh(x[:, :4] * 1.5)
    return x, target


# ---------------------------------------------------------------------------------------------
# Hebbian features, backprop readout


class HebbNet(nn.Module):
    def __init__(self, n_in: int = 12, n_feat: int = 16, classes: int = 3):
        super().__init__()
        self.hebb = nn.Linear(n_in, n_feat, bias=False)
        self.hebb.weight.requires_grad_(False)  # learned by the local rule only
        self.readout = nn.Linear(n_feat, classes)

    def forward(self, x):
        h = F.relu(self.hebb(x))
        return self.readout(h), h


def hebbian_update(net: HebbNet, x, h, lr: float, oja: bool):
    """In place, outside autograd: Oja's rule ``dW = lr * (h x - h^2 W)`` keeps each row's norm
    near 1; the plain Hebbian rule ``dW = lr * h x`` grows it without bound."""
    with torch.no_grad():
        w = net.hebb.weight
        dw = h.t() @ x / len(x)
        if oja:
            dw -= (h * h).mean(0)[:, None] * w
        w.add_(lr * dw)


def make_hebb() -> HebbNet:
    torch.manual_seed(0)
    return HebbNet()


def hebb_batch(g: torch.Generator, n: int = 16):
    x = torch.randn(n, 12, generator=g) + 1.0
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


# ---------------------------------------------------------------------------------------------
# target propagation through an invertible tanh layer


class TPNet(nn.Module):
    """Two tanh layers trained by target propagation (Lee et al.'s TP with the top layer's
    analytic inverse): the output's target is a step from the output toward the label, the
    hidden layer's target that target pulled back through ``W2^+ (atanh(t) - b2)``, and each
    layer learns from its own squared error against its detached target."""

    def __init__(self, n_in: int = 10, hidden: int = 12, n_out: int = 4, beta: float = 0.5):
        super().__init__()
        self.l1, self.l2 = nn.Linear(n_in, hidden), nn.Linear(hidden, n_out)
        self.beta = beta

    def forward(self, x, y):
        h1 = torch.tanh(self.l1(x))
        out = torch.tanh(self.l2(h1.detach()))  # no backprop between layers
        with torch.no_grad():
            t2 = out + self.beta * (y - out)
            t1 = (torch.atanh(t2) - self.l2.bias) @ torch.linalg.pinv(self.l2.weight).T
            t1 = t1.clamp(-0.99, 0.99)
        return torch.stack([(out - t2).pow(2).sum(1), (h1 - t1).pow(2).sum(1)], 1)


def make_tp() -> TPNet:
    torch.manual_seed(0)
    return TPNet()


def make_tp_full() -> TPNet:
    """The target step taken all the way to the label (beta = 1)."""
    torch.manual_seed(0)
    return TPNet(beta=1.0)


def tp_batch(g: torch.Generator, n: int = 16):
    """Labels as tanh targets: +-0.9 for the class and the rest."""
    x = torch.randn(n, 10, generator=g)
    y = torch.full((n, 4), -0.9)
    y[torch.arange(n), x[:, :4].argmax(1)] = 0.9
    return x, y


def tp_batch_saturated(g: torch.Generator, row: int = 6, n: int = 16):
    """One record's labels written as +-1, tanh's asymptotes (a label file from a softmax
    pipeline mixed in): atanh of a target at 1 is infinite."""
    x, y = tp_batch(g, n)
    y[row] = y[row].sign()
    return x, y
