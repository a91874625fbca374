"""Training written with ``torch.func``, as its tutorials and research code write it; the
factories and data of ``test_torch_func_training.py``.

- ``Ensemble``: PyTorch's model-ensembling tutorial: ``stack_module_state`` of M members, a
  copy of one member on the meta device as the stateless base, ``vmap(functional_call)`` over
  the stacked weights (held as the module's parameters, trained by a torch optimizer); each
  member a heteroscedastic regressor (mean and ``exp(log_var)``, a deep ensemble's head);
  ``gaussian_nll`` the loss written by hand; ``Scorer`` members of a binary classifier
  ensemble (in bfloat16 with ``bf16=True``), ``EnsembleBCE`` a user's BCE on probabilities.
- ``Classifier`` with ``dp_sgd_step``: DP-SGD by hand: per-sample gradients and losses by
  ``vmap(grad_and_value(...))`` of a ``functional_call``, each clipped to norm C, summed and
  noised; ``SoftmaxNLL`` a user's cross-entropy (``-log(softmax(z))`` picked at the label).
- ``JacobianReg``: a loss wrapper holding the model: task loss plus the Jacobian's Frobenius
  norm per sample, ``vmap(jacrev(model))`` (Hoffman et al., "Robust learning with Jacobian
  regularization"), the norm as ``sqrt(sum J**2)``.
- ``ScoreNet`` with ``sliced_score_loss``: sliced score matching (Song et al. 2019): the
  Hutchinson estimate ``v^T (ds/dx) v`` by ``torch.func.jvp``, plus ``0.5 * ||s||**2``.
- ``maml_step``: MAML with ``torch.func.grad`` for the inner loop and ``functional_call`` on
  the adapted parameter dict for the query loss (second order: the outer backward goes
  through the inner gradient).
- ``SineNet`` with ``sine_tasks``: Finn et al.'s sinusoid regression for ``maml_step``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, grad_and_value, jacrev, jvp, stack_module_state, vmap
from torch.utils.data import DataLoader, TensorDataset

# ---------------------------------------------------------------------------------------------
# ensembles: stack_module_state + vmap(functional_call)


class Member(nn.Module):
    """One ensemble member: features -> (mean, variance)."""

    def __init__(self, d: int = 6, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, hidden), nn.Tanh())
        self.mean = nn.Linear(hidden, 1)
        self.log_var = nn.Linear(d, 1)  # the noise level read off the raw features

    def forward(self, x):
        h = self.body(x)
        var = torch.exp(self.log_var(x))
        return torch.cat([self.mean(h), var], dim=-1)


class Ensemble(nn.Module):
    """M members' weights stacked (``stack_module_state``) and run at once by vmap."""

    def __init__(self, members: list[nn.Module]):
        super().__init__()
        params, buffers = stack_module_state(members)
        self.names = list(params)
        self.stacked = nn.ParameterList([nn.Parameter(params[n]) for n in self.names])
        self.base = copy.deepcopy(members[0]).to("meta")

    def forward(self, x):
        def one(params, xb):
            return functional_call(self.base, params, (xb,))

        params = dict(zip(self.names, self.stacked))
        return vmap(one, in_dims=(0, None))(params, x)  # (M, B, 2)


def make_ensemble(members: int = 4, d: int = 6):
    torch.manual_seed(0)
    return Ensemble([Member(d) for _ in range(members)])


def gaussian_nll(out, y):
    """The deep-ensemble loss by hand, averaged over members and samples."""
    mean, var = out[..., 0], out[..., 1]
    return (0.5 * torch.log(var) + 0.5 * (y - mean) ** 2 / var).mean()


def regression_loader(n: int = 64, d: int = 6, batch: int = 16, nan_row: int | None = None,
                      scaled_row: int | None = None) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g)
    y = x[:, 0] - 0.5 * x[:, 1] + 0.1 * torch.randn(n, generator=g)
    if nan_row is not None:
        x[nan_row, 2] = float("nan")  # a sensor's missing reading left as NaN
    if scaled_row is not None:
        x[scaled_row] *= 2e3  # one record in other units (mm for m), never standardised
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


class Scorer(nn.Module):
    """A member of a classifier ensemble: features -> a logit."""

    def __init__(self, d: int = 6, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def make_scorer_ensemble(members: int = 3, bf16: bool = False):
    """``bf16``: weights and activations in bfloat16 (pure-bf16 training)."""
    torch.manual_seed(0)
    model = Ensemble([Scorer() for _ in range(members)])
    return model.to(torch.bfloat16) if bf16 else model


class EnsembleBCE(nn.Module):
    """A user's binary cross-entropy on the members' probabilities, averaged over members."""

    def forward(self, logits, y):
        p = torch.sigmoid(logits)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def binary_loader(n: int = 48, batch: int = 16, sure_row: int | None = None) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).float()
    if sure_row is not None:
        x[sure_row, 0] = 60.0 * (2 * y[sure_row] - 1)  # an easy record, far on its side
    return DataLoader(TensorDataset(x, y), batch_size=batch)


# ---------------------------------------------------------------------------------------------
# DP-SGD by hand: vmap(grad_and_value(functional_call))


class Classifier(nn.Module):
    def __init__(self, d: int = 8, classes: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, classes))

    def forward(self, x):
        return self.net(x)


def make_classifier():
    torch.manual_seed(0)
    return Classifier()


class SoftmaxNLL(nn.Module):
    """A user's cross-entropy: the softmax's probability of the label, then its log."""

    def forward(self, logits, y):
        p = torch.softmax(logits, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return -torch.log(p).mean()


def dp_sgd_step(model, opt, loss_fn, x, y, max_norm: float = 1.0, noise: float = 0.5,
                gen: torch.Generator | None = None):
    """One DP-SGD step: the logged loss from a plain forward, the update from the clipped,
    noised per-sample gradients."""
    loss = loss_fn(model(x), y)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def per_sample(p, xi, yi):
        return loss_fn(functional_call(model, p, (xi[None],)), yi[None])

    grads, _ = vmap(grad_and_value(per_sample), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
    factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    opt.zero_grad()
    for name, p in model.named_parameters():
        clipped = (grads[name] * factor.view(-1, *[1] * (grads[name].dim() - 1))).sum(0)
        p.grad = (clipped + noise * max_norm * torch.randn(p.shape, generator=gen)) / len(x)
    opt.step()
    return loss


def class_loader(n: int = 48, batch: int = 16, far_row: int | None = None) -> DataLoader:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 8, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    if far_row is not None:
        x[far_row] = 1e4 * x[far_row].sign()  # an outlier far beyond the training range
    return DataLoader(TensorDataset(x, y), batch_size=batch)


# ---------------------------------------------------------------------------------------------
# Jacobian regularisation: a loss wrapper holding the model, vmap(jacrev(model))


class ReLUNet(nn.Module):
    def __init__(self, d: int = 5, hidden: int = 12, out: int = 3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, out)

    def forward(self, x, mask):
        return self.fc2(torch.relu(self.fc1(x * mask)))  # missing features masked out


def make_relunet():
    torch.manual_seed(0)
    return ReLUNet()


class JacobianReg(nn.Module):
    """Cross-entropy plus ``lam`` times the mean Frobenius norm of the per-sample Jacobian."""

    def __init__(self, model: nn.Module, lam: float = 0.01):
        super().__init__()
        self.model, self.lam = model, lam

    def forward(self, logits, y, x, mask):
        jac = vmap(jacrev(lambda xi, mi: self.model(xi[None], mi[None])[0]))(x, mask)
        frob = torch.sqrt((jac ** 2).sum(dim=(1, 2)))
        return F.cross_entropy(logits, y) + self.lam * frob.mean()


def jacobian_batches(steps: int = 4, blank_at: int | None = None, blank_row: int = 3):
    """(x, mask of observed features, label); the mask of ``blank_row`` at step ``blank_at``
    all 0: a record with no feature observed."""
    g = torch.Generator().manual_seed(3)
    for s in range(steps):
        x = torch.randn(8, 5, generator=g)
        mask = (torch.rand(8, 5, generator=g) < 0.8).float()
        if s == blank_at:
            mask[blank_row] = 0.0
        yield x, mask, torch.randint(0, 3, (8,), generator=g)


# ---------------------------------------------------------------------------------------------
# sliced score matching: the Hutchinson term by jvp


class ScoreNet(nn.Module):
    def __init__(self, d: int = 4, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.Softplus(), nn.Linear(hidden, hidden),
                                 nn.Softplus(), nn.Linear(hidden, d))

    def forward(self, x):
        return self.net(x)


def make_scorenet():
    torch.manual_seed(0)
    return ScoreNet()


def sliced_score_loss(model, x, v):
    """``E[v^T (ds/dx) v + 0.5 (v^T s)**2]`` (the variance-reduced SSM-VR uses ``||s||**2``)."""
    s = model(x)  # the plain forward (recorded: a forward only under jvp is not)
    _, jv = jvp(model, (x,), (v,))
    return ((v * jv).sum(-1) + 0.5 * (s ** 2).sum(-1)).mean()


# ---------------------------------------------------------------------------------------------
# MAML by torch.func


class Normed(nn.Module):
    """Features divided by their norm (a cosine classifier's input), then a linear head."""

    def __init__(self, d: int = 6, ways: int = 3):
        super().__init__()
        self.embed = nn.Linear(d, 16)
        self.head = nn.Linear(16, ways)

    def forward(self, x):
        x = x / x.norm(dim=-1, keepdim=True)
        return self.head(torch.relu(self.embed(x)))


def make_normed():
    torch.manual_seed(0)
    return Normed()


def maml_step(model, opt, xs, ys, xq, yq, inner_lr: float = 0.4, inner_steps: int = 1,
              loss_fn=F.cross_entropy):
    params = dict(model.named_parameters())

    def inner_loss(p, x, y, loss_fn):
        return loss_fn(functional_call(model, p, (x,)), y)

    adapted = params
    for _ in range(inner_steps):
        g = grad(inner_loss)(adapted, xs, ys, loss_fn)
        adapted = {k: w - inner_lr * g[k] for k, w in adapted.items()}
    opt.zero_grad()
    loss = loss_fn(functional_call(model, adapted, (xq,)), yq)
    loss.backward()
    opt.step()
    return loss


def tasks(steps: int = 4, blank_query_at: int | None = None, blank_row: int = 2):
    g = torch.Generator().manual_seed(4)
    for s in range(steps):
        centres = torch.randn(3, 6, generator=g) * 2
        ys, yq = torch.arange(3).repeat(2), torch.arange(3).repeat(3)
        xs = centres[ys] + 0.3 * torch.randn(6, 6, generator=g)
        xq = centres[yq] + 0.3 * torch.randn(9, 6, generator=g)
        if s == blank_query_at:
            xq[blank_row] = 0.0  # an empty record: all its features 0
        yield xs, ys, xq, yq


# ---------------------------------------------------------------------------------------------
# a Hessian-vector-product sharpness penalty


class SineNet(nn.Module):
    """The MAML sinusoid regressor (Finn et al. 2017): 1 -> 40 -> 40 -> 1."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(),
                                 nn.Linear(40, 1))

    def forward(self, x):
        return self.net(x)


def make_sinenet():
    torch.manual_seed(0)
    return SineNet()


def sine_tasks(steps: int = 4, loud_at: int | None = None, gain: float = 1e4):
    """Sinusoid tasks, amplitude in [0.1, 5]; the task at ``loud_at`` recorded with a gain
    (a sensor's raw counts for volts)."""
    g = torch.Generator().manual_seed(6)
    for s in range(steps):
        amp = 0.1 + 4.9 * torch.rand(1, generator=g)
        phase = torch.pi * torch.rand(1, generator=g)
        if s == loud_at:
            amp = amp * gain
        xs, xq = torch.rand(10, 1, generator=g) * 10 - 5, torch.rand(10, 1, generator=g) * 10 - 5
        yield xs, amp * torch.sin(xs + phase), xq, amp * torch.sin(xq + phase)


class CosineNet(nn.Module):
    """Baseline++'s cosine classifier on a tanh embedding: ``s * cos(h, w_c)``, each side
    divided by its norm plus an eps (finite at 0 in the forward)."""

    def __init__(self, d: int = 6, ways: int = 3, scale: float = 10.0):
        super().__init__()
        self.embed = nn.Linear(d, 16, bias=False)
        self.weight = nn.Parameter(torch.randn(ways, 16))
        self.scale = scale

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        h = h / (h.norm(dim=-1, keepdim=True) + 1e-6)
        w = self.weight / (self.weight.norm(dim=-1, keepdim=True) + 1e-6)
        return self.scale * h @ w.T


def make_cosinenet():
    torch.manual_seed(0)
    return CosineNet()


def blank_support_tasks(steps: int = 4, blank_at: int | None = None, blank_row: int = 4):
    """``tasks`` with support record ``blank_row`` of step ``blank_at`` all zeros."""
    for s, (xs, ys, xq, yq) in enumerate(tasks(steps)):
        if s == blank_at:
            xs[blank_row] = 0.0
        yield xs, ys, xq, yq
