"""Continual and federated learning as the well-known repositories write it (Avalanche,
ContinualAI's colab EWC, GEM/A-GEM, FedML/Flower-style single-process simulations): a
multi-head network whose forward takes the task id, EWC and Synaptic Intelligence penalties
kept beside the model, LwF distillation, A-GEM's gradient projection and FedNova-style
aggregation of client updates weighted by their sample counts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_IN, HIDDEN, CLASSES, TASKS = 12, 32, 3, 3


class TaskNet(nn.Module):
    """A shared body and one head per task (task-incremental learning): ``forward(x, task)``
    picks the head; the task id is an int (Avalanche's ``MultiHeadClassifier``) or a tensor of
    one id per row (a replay batch that mixes tasks)."""

    def __init__(self, tasks: int = TASKS):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(),
                                  nn.Linear(HIDDEN, HIDDEN), nn.ReLU())
        self.heads = nn.ModuleList(nn.Linear(HIDDEN, CLASSES) for _ in range(tasks))

    def forward(self, x, task):
        h = self.body(x)
        if isinstance(task, int):
            return self.heads[task](h)
        out = torch.stack([head(h) for head in self.heads], 1)  # [B, tasks, classes]
        return out[torch.arange(len(x)), task]


def make_tasknet(tasks: int = TASKS) -> TaskNet:
    torch.manual_seed(0)
    return TaskNet(tasks)


def task_batch(g: torch.Generator, task: int, n: int = 16):
    """Task ``task``'s data: its own input shift, labels from a fixed random rule."""
    x = torch.randn(n, D_IN, generator=g) + task
    y = (x[:, task] > task).long() + (x[:, task + 1] > task).long()
    return x, y


# ---------------------------------------------------------------------------------------------
# EWC (ContinualAI's colab / moskomule's ewc.pytorch)


class EWC:
    """Diagonal Fisher from squared gradients of the task's log-likelihood, each parameter's
    normalised by its max; the penalty ``lam/2 * sum F * (theta - theta*)^2``."""

    def __init__(self, model: nn.Module, batches, task: int):
        self.star = {n: p.detach().clone() for n, p in model.named_parameters()}
        fisher = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for x, y in batches:
            model.zero_grad()
            F.nll_loss(F.log_softmax(model(x, task), 1), y).backward()
            for n, p in model.named_parameters():
                if p.grad is not None:  # another task's head: no gradient, stays 0
                    fisher[n] += p.grad.detach() ** 2 / len(batches)
        model.zero_grad()
        # the bug: a parameter the task never used has F == 0 everywhere, so F / max is 0/0
        self.fisher = {n: f / f.max() for n, f in fisher.items()}

    def penalty(self, model: nn.Module, lam: float):
        loss = 0.0
        for n, p in model.named_parameters():
            loss = loss + (self.fisher[n] * (p - self.star[n]) ** 2).sum()
        return lam / 2 * loss


# ---------------------------------------------------------------------------------------------
# Synaptic Intelligence (Zenke et al.; Avalanche's SynapticIntelligencePlugin)


class SI:
    """The path integral ``omega += -g * delta_step`` each step, and at the task's end
    ``Omega += omega / (delta^2 + xi)`` with ``delta`` the task's total move."""

    def __init__(self, model: nn.Module, xi: float = 0.0):
        self.xi = xi
        self.start = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.prev = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.omega = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        self.big_omega = {n: torch.zeros_like(p) for n, p in model.named_parameters()}

    def before_step(self, model):
        self.grads = {n: p.grad.detach().clone() if p.grad is not None else None
                      for n, p in model.named_parameters()}

    def after_step(self, model):
        for n, p in model.named_parameters():
            if self.grads[n] is not None:
                self.omega[n] += -self.grads[n] * (p.detach() - self.prev[n])
            self.prev[n] = p.detach().clone()

    def consolidate(self, model):
        for n, p in model.named_parameters():
            delta = p.detach() - self.start[n]
            # the bug with xi = 0: a weight that did not move is 0 / 0
            self.big_omega[n] += self.omega[n] / (delta ** 2 + self.xi)
            self.omega[n].zero_()
            self.start[n] = p.detach().clone()

    def penalty(self, model, c: float):
        return c * sum((self.big_omega[n] * (p - self.start[n]) ** 2).sum()
                       for n, p in model.named_parameters())


# ---------------------------------------------------------------------------------------------
# LwF (Li & Hoiem; the distillation term as many repos write it by hand)


def lwf_loss(new_logits, y, old_logits, T: float = 2.0, alpha: float = 1.0):
    """Cross-entropy on the new task plus the old model's soft targets, ``T^2``-scaled."""
    ce = F.cross_entropy(new_logits, y)
    p_old = torch.softmax(old_logits / T, 1)
    log_p_new = torch.log(torch.softmax(new_logits / T, 1))  # the bug: log of a softmax
    kd = -(p_old * log_p_new).sum(1).mean() * T * T
    return ce + alpha * kd


# ---------------------------------------------------------------------------------------------
# A-GEM (Chaudhry et al.; facebookresearch/agem's projection)


def flat_grad(model):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def write_grad(model, g):
    i = 0
    for p in model.parameters():
        n = p.numel()
        p.grad = g[i:i + n].view_as(p).clone()
        i += n


def agem_project(g, g_ref):
    """Project ``g`` when it conflicts with the memory's gradient ``g_ref``."""
    dot = torch.dot(g, g_ref)
    if dot < 0:
        return g - dot / torch.dot(g_ref, g_ref) * g_ref
    return g


# ---------------------------------------------------------------------------------------------
# Federated: FedAvg / FedNova on one process


def fednova_aggregate(global_sd, client_sds, n_samples, local_steps):
    """FedNova (Wang et al. 2020): each client's update normalised by its local steps, then
    averaged with weights ``n_k / sum n``, rescaled by the effective number of steps."""
    total = sum(n_samples)
    p = [n / total for n in n_samples]
    tau_eff = sum(pk * tk for pk, tk in zip(p, local_steps))
    out = {}
    for k, w in global_sd.items():
        if not w.is_floating_point():
            out[k] = w
            continue
        # the bug: a client with 0 samples ran 0 local steps: (w - w_k) / 0 is 0/0
        d = sum(pk * (w - sd[k]) / tk for pk, sd, tk in zip(p, client_sds, local_steps))
        out[k] = w - tau_eff * d
    return out


def fedavg_aggregate(client_sds, n_samples):
    """FedAvg: the clients' state_dicts averaged with weights ``n_k / sum n``."""
    total = sum(n_samples)
    return {k: sum(sd[k] * (n / total) for sd, n in zip(client_sds, n_samples))
            for k in client_sds[0]}


def fedprox_term(model, global_params, mu: float):
    return mu / 2 * sum((p - g).norm(2) ** 2 for p, g in zip(model.parameters(), global_params))


def masked_ce(logits, y, active):
    """Class-incremental cross-entropy over the classes seen so far (iCaRL/ER-ACE style):
    logits of classes not yet seen masked to -inf. A replayed row whose label is masked has
    probability 0: an infinite loss."""
    return F.cross_entropy(logits.masked_fill(~active, float("-inf")), y)


class ClassIncNet(nn.Module):
    """One growing head over every class of every task (class-incremental learning)."""

    def __init__(self, classes: int = 2 * CLASSES):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU())
        self.head = nn.Linear(HIDDEN, classes)

    def forward(self, x):
        return self.head(self.body(x))


def make_classinc(classes: int = 2 * CLASSES) -> ClassIncNet:
    torch.manual_seed(0)
    return ClassIncNet(classes)


class FedProxLoss(nn.Module):
    """Cross-entropy plus FedProx's proximal term to the round's global weights, which the
    loss holds as buffers (set each round) and compares with the model's parameters, the
    model given as an argument."""

    def __init__(self, mu: float = 0.01):
        super().__init__()
        self.mu = mu
        self.ce = nn.CrossEntropyLoss()

    def set_global(self, model: nn.Module):
        for i, p in enumerate(model.parameters()):
            self.register_buffer(f"global_{i}", p.detach().clone())

    def forward(self, out, y, model):
        prox = sum(((p - getattr(self, f"global_{i}")) ** 2).sum()
                   for i, p in enumerate(model.parameters()))
        return self.ce(out, y) + self.mu / 2 * prox


class EWCLoss(nn.Module):
    """EWC as a loss module (Avalanche's plugin state held by the criterion): the Fisher and
    the consolidated weights as buffers, the model given as an argument to compare with."""

    def __init__(self, lam: float = 100.0):
        super().__init__()
        self.lam = lam
        self.ce = nn.CrossEntropyLoss()
        self.names: list[str] = []

    def consolidate(self, model: nn.Module, batches, task: int):
        ewc = EWC(model, batches, task)
        self.names = [n.replace(".", "_") for n, _ in model.named_parameters()]
        for (n, _), key in zip(model.named_parameters(), self.names):
            self.register_buffer(f"fisher_{key}", ewc.fisher[n])
            self.register_buffer(f"star_{key}", ewc.star[n])

    def forward(self, out, y, model):
        loss = self.ce(out, y)
        for p, key in zip(model.parameters(), self.names):
            f, star = getattr(self, f"fisher_{key}"), getattr(self, f"star_{key}")
            loss = loss + self.lam / 2 * (f * (p - star) ** 2).sum()
        return loss


class LwFLoss(nn.Module):
    """LwF as a loss module holding the frozen previous model (Avalanche's LwF plugin keeps
    ``prev_model``): cross-entropy on the new task's head plus the distillation of the old
    head's logits, ``T^2``-scaled, with the previous model run on the same input."""

    def __init__(self, prev: nn.Module | None = None, T: float = 2.0, alpha: float = 1.0):
        super().__init__()
        self.prev = prev
        self.T, self.alpha = T, alpha

    def forward(self, new_logits, old_head_logits, y, x):
        with torch.no_grad():
            target = self.prev(x, 0)
        return lwf_loss(new_logits, y, target, self.T, 0.0) + self.alpha * lwf_loss(
            old_head_logits, y, target, self.T) - F.cross_entropy(old_head_logits, y)


class TwoHeadView(nn.Module):
    """The multi-head net returning (new head's logits, old head's logits) for LwF."""

    def __init__(self):
        super().__init__()
        self.net = TaskNet(2)

    def forward(self, x):
        h = self.net.body(x)
        return self.net.heads[1](h), self.net.heads[0](h)


def make_two_head() -> TwoHeadView:
    torch.manual_seed(0)
    return TwoHeadView()


class Standardise(nn.Module):
    """Each record standardised over its features (wearable-sensor federated benchmarks):
    no eps, so a record whose readings are all equal (a sensor stuck) is 0/0. With ``dim=0``,
    each feature over the batch instead (a hand-written batch norm): a batch of one is 0/0."""

    def __init__(self, dim: int = 1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return (x - x.mean(self.dim, keepdim=True)) / x.std(self.dim, keepdim=True)


class SensorNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Standardise()
        self.net = TaskNet(1)

    def forward(self, x):
        return self.net(self.norm(x), 0)


def make_sensor_net() -> SensorNet:
    torch.manual_seed(0)
    return SensorNet()


def penalised_ce(out, y, penalty):
    """Cross-entropy plus a penalty the loop computed from the weights (``si.penalty(model)``,
    ``ewc.penalty(model)``) and handed in."""
    return F.cross_entropy(out, y) + penalty


class AvalancheMultiTask(nn.Module):
    """Avalanche's ``MultiTaskModule`` forward: the batch split by its task labels, each part
    through its task's head, the outputs put back in place (``out[task_mask] = out_task``).
    Each head standardises its features over its part of the batch first (no eps)."""

    def __init__(self, tasks: int = TASKS):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh())
        self.heads = nn.ModuleList(nn.Sequential(Standardise(0), nn.Linear(HIDDEN, CLASSES))
                                   for _ in range(tasks))

    def forward(self, x, task_labels):
        h = self.body(x)
        out = torch.zeros(len(x), CLASSES)
        for task in torch.unique(task_labels):
            task_mask = task_labels == task
            out[task_mask] = self.heads[int(task)](h[task_mask])
        return out


def make_avalanche(tasks: int = TASKS) -> AvalancheMultiTask:
    torch.manual_seed(0)
    return AvalancheMultiTask(tasks)
