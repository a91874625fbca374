"""Multi-task loss balancing as tabular / recommendation multi-task code writes it, for
``test_multitask_weighting``.

- ``SharedBottom``: an MLP trunk with two regression heads and a classification head;
  ``forward(x, task_mask)`` takes the batch's task mask (which task each record is labelled
  for) and returns a dict of task outputs (the regression heads ReLU-activated, as
  non-negative targets are).
- ``MaskedTaskLoss``: each task's loss over its labelled records only (the mask multiplied
  into the per-record loss, divided by the mask's count), weighted by the weights passed in
  (DWA's, GradNorm's) or by Kendall's learned log-variances (``KendallLoss``:
  ``exp(-s) * L + s``).
- DWA (Liu et al. 2019): the weights from the ratio of each task's last two epoch losses,
  softmax with temperature; GradNorm with its gradient norms written by hand.
- the data: a ``TensorDataset`` of features, two targets, a class, and the task mask; a
  missing regression target stored as 0 (or as NaN, as a pandas export writes it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N_IN, N_CLS, N_TASKS = 10, 4, 3


class SharedBottom(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(N_IN, width), nn.ReLU(),
                                   nn.Linear(width, width), nn.ReLU())
        self.reg_a = nn.Sequential(nn.Linear(width, 1), nn.ReLU())
        self.reg_b = nn.Sequential(nn.Linear(width, 1), nn.ReLU())
        self.cls = nn.Linear(width, N_CLS)

    def last_shared(self) -> nn.Parameter:
        return self.trunk[2].weight

    def forward(self, x, task_mask):
        h = self.trunk(x)
        # records without a class label get no class logits' gradient (their rows detached)
        logits = self.cls(h)
        logits = torch.where(task_mask[:, 2:3], logits, logits.detach())
        return {"a": self.reg_a(h).squeeze(1), "b": self.reg_b(h).squeeze(1), "cls": logits}


def make_model() -> SharedBottom:
    torch.manual_seed(0)
    return SharedBottom()


def masked_mean(per_record, m):
    return (per_record * m).sum() / m.sum()  # the bug: a task no record is labelled for: 0/0


def masked_mean_guarded(per_record, m):
    return (per_record * m).sum() / m.sum().clamp_min(1)


def task_losses(out, ya, yb, ycls, mask, mean=masked_mean):
    m = mask.float()
    return torch.stack([mean((out["a"] - ya) ** 2, m[:, 0]),
                        mean((out["b"] - yb) ** 2, m[:, 1]),
                        mean(F.cross_entropy(out["cls"], ycls, reduction="none"), m[:, 2])])


class MaskedTaskLoss(nn.Module):
    """The task losses weighted by the weights the loop passes (DWA's); the recorder's
    loss_fn."""

    def __init__(self, mean=masked_mean):
        super().__init__()
        self.mean = mean

    def forward(self, out, ya, yb, ycls, mask, weights):
        return (weights * task_losses(out, ya, yb, ycls, mask, self.mean)).sum()


class KendallLoss(nn.Module):
    """Kendall et al.'s homoscedastic uncertainty weighting: ``exp(-s_t) * L_t + s_t``."""

    def __init__(self):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(N_TASKS))

    def forward(self, out, ya, yb, ycls, mask):
        losses = task_losses(out, ya, yb, ycls, mask, masked_mean_guarded)
        return (torch.exp(-self.log_vars) * losses + self.log_vars).sum()


def dwa_weights(history: list[torch.Tensor], temperature: float = 2.0) -> torch.Tensor:
    """DWA: ``K softmax(r / T)`` with ``r_t = L_t(e-1) / L_t(e-2)``, the epoch mean losses."""
    if len(history) < 2:
        return torch.ones(N_TASKS)
    ratio = history[-1] / history[-2]  # the bug: a task whose loss was 0 an epoch: x/0
    return N_TASKS * torch.softmax(ratio / temperature, 0)


def hand_norm(g):
    return (g * g).sum().sqrt()  # the bug: sqrt's derivative at a norm of 0 is inf (0 * inf)


def gradnorm_grad(model, losses, initial, alpha: float = 1.5, norm=hand_norm):
    """GradNorm's task-weight gradient: per-task gradient norms at the last shared layer by
    autograd.grad with create_graph, the relative inverse training rates ``L_t / L_0``."""
    w, shared = model.task_weights, model.last_shared()
    norms = torch.stack([norm(torch.autograd.grad(w[i] * losses[i], shared, retain_graph=True,
                                                  create_graph=True)[0])
                         for i in range(N_TASKS)])
    ratio = losses.detach() / initial
    target = (norms.mean() * (ratio / ratio.mean()) ** alpha).detach()
    return torch.autograd.grad((norms - target).abs().sum(), w)[0]


class GradNormModel(SharedBottom):
    def __init__(self):
        super().__init__()
        self.task_weights = nn.Parameter(torch.ones(N_TASKS))


def make_gradnorm() -> GradNormModel:
    torch.manual_seed(0)
    return GradNormModel()


def dataset(n: int = 64, nan_missing: bool = False, seed: int = 0):
    """Features, two non-negative targets, a class, the task mask (75% labelled per task)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, N_IN, generator=g)
    ya = x[:, :3].abs().sum(1)
    yb = x[:, 3:6].pow(2).sum(1).sqrt()
    ycls = torch.randint(0, N_CLS, (n,), generator=g)
    mask = torch.rand(n, N_TASKS, generator=g) < 0.75
    fill = float("nan") if nan_missing else 0.0
    ya = ya.masked_fill(~mask[:, 0], fill)
    yb = yb.masked_fill(~mask[:, 1], fill)
    return x, ya, yb, ycls, mask


def loader(plant=None, **kw):
    """Batches of 8 in order; ``plant(data)`` edits the whole data set's tensors in place."""
    data = dataset(**kw)
    if plant is not None:
        plant(*data)
    return DataLoader(TensorDataset(*data), batch_size=8, shuffle=False)


FACTORY = "multitask_weighting_models:"


def recorder(model, opt, out_dir, make, **kw):
    from recorder import FlightRecorder
    return FlightRecorder(model, opt, out_dir=out_dir, factory=FACTORY + make, **kw)


def train_dwa(out_dir, epochs=3, plant=None, mean=masked_mean, record=True, **kw):
    """DWA weights from the last two epochs' mean task losses, Adam, clipping."""
    model = make_model()
    crit = MaskedTaskLoss(mean)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rec = recorder(model, opt, out_dir, "make_model", loss_fn=crit).attach() if record else None
    loss_fn = rec.loss_fn if rec is not None else crit
    history: list[torch.Tensor] = []
    try:
        for _ in range(epochs):
            weights, total, n = dwa_weights(history), torch.zeros(N_TASKS), 0
            for x, ya, yb, ycls, mask in loader(plant, **kw):
                opt.zero_grad()
                out = model(x, mask)
                loss_fn(out, ya, yb, ycls, mask, weights).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                with torch.no_grad():
                    total += task_losses(out, ya, yb, ycls, mask, masked_mean_guarded)
                n += 1
            history.append(total / n)
    finally:
        if rec is not None:
            rec.detach()
    return model


def train_kendall(out_dir, epochs=2, plant=None, lr_s=0.0, record=True):
    """Uncertainty weighting: the log-variances in the loss module, trained by their own
    (larger) learning rate in the same SGD."""
    model = make_model()
    crit = KendallLoss()
    opt = torch.optim.SGD([{"params": model.parameters()},
                           {"params": crit.parameters(), "lr": lr_s}], lr=1e-2, momentum=0.9)
    rec = recorder(model, opt, out_dir, "make_model", loss_fn=crit).attach() if record else None
    loss_fn = rec.loss_fn if rec is not None else crit
    try:
        for _ in range(epochs):
            for x, ya, yb, ycls, mask in loader(plant):
                opt.zero_grad()
                loss_fn(model(x, mask), ya, yb, ycls, mask).backward()
                opt.step()
    finally:
        if rec is not None:
            rec.detach()
    return model


def train_gradnorm(out_dir, epochs=1, plant=None, plant_model=None, norm=hand_norm, record=True):
    """GradNorm: the weighted loss's backward, the task weights' gradient written by hand,
    Adam, the weights renormalised to sum to the number of tasks after each step."""
    model = make_gradnorm()
    if plant_model is not None:
        plant_model(model)
    opt = torch.optim.Adam([
        {"params": [p for n, p in model.named_parameters() if n != "task_weights"]},
        {"params": [model.task_weights], "lr": 0.025}], lr=1e-3)
    rec = recorder(model, opt, out_dir, "make_gradnorm").attach() if record else None
    initial = None
    try:
        for _ in range(epochs):
            for x, ya, yb, ycls, mask in loader(plant):
                opt.zero_grad()
                losses = task_losses(model(x, mask), ya, yb, ycls, mask, masked_mean_guarded)
                if initial is None:
                    initial = losses.detach()
                (model.task_weights * losses).sum().backward(retain_graph=True)
                model.task_weights.grad = gradnorm_grad(model, losses, initial, norm=norm)
                opt.step()
                with torch.no_grad():
                    model.task_weights.mul_(N_TASKS / model.task_weights.sum())
    finally:
        if rec is not None:
            rec.detach()
    return model


def project_conflicts(grads: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """PCGrad written by hand over the rows of ``grads`` (tasks x shared parameters)."""
    out = grads.clone()
    for i in range(len(grads)):
        for j in range(len(grads)):
            if i != j:
                dot = torch.dot(out[i], grads[j])
                # the bug (eps=0): a task whose shared gradient is exactly 0 gives 0 * 0/0
                out[i] = out[i] - dot.clamp(max=0) / (grads[j].dot(grads[j]) + eps) * grads[j]
    return out.sum(0)


def train_pcgrad(out_dir, epochs=1, eps=0.0, record=True, dead_b=False):
    """PCGrad over the trunk, the heads' gradients from the summed loss, written into
    ``p.grad``; SGD. ``dead_b``: the ``b`` head's bias starts far below 0 (a dead ReLU head)."""
    model = make_model()
    if dead_b:
        with torch.no_grad():
            model.reg_b[0].bias.fill_(-10.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    shared = list(model.trunk.parameters())
    heads = [p for n, p in model.named_parameters() if not n.startswith("trunk")]
    rec = recorder(model, opt, out_dir, "make_model").attach() if record else None
    try:
        for _ in range(epochs):
            for x, ya, yb, ycls, mask in loader():
                losses = task_losses(model(x, mask), ya, yb, ycls, mask, masked_mean_guarded)
                grads = torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
                    loss, shared, retain_graph=True)]) for loss in losses])
                opt.zero_grad()
                merged, i = project_conflicts(grads, eps), 0
                for p in shared:
                    p.grad = merged[i:i + p.numel()].view_as(p).clone()
                    i += p.numel()
                for p, g in zip(heads, torch.autograd.grad(losses.sum(), heads)):
                    p.grad = g
                opt.step()
    finally:
        if rec is not None:
            rec.detach()
    return model
