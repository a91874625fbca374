"""Federated learning and weight averaging by hand, as one-process simulations write them:
one model and one optimizer reused for every client in turn (FedLab's serial trainer: the
round's global weights loaded before each client's local steps), the server's weighted FedAvg
or FedNova of the clients' state_dicts, FedProx's proximal term in a loss given the model,
and TIES-merging of fine-tuned copies into one model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, CLASSES, BATCH = 16, 4, 8


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, CLASSES))


class Standardise(nn.Module):
    """Per-record standardisation, as tabular clients do on device (no eps: 0/0 on a record
    whose features are all equal)."""

    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


def make_std_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Standardise(), nn.Linear(FEATURES, 32), nn.ReLU(),
                         nn.Linear(32, CLASSES))


def client_data(sizes: list[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Non-IID shards: client k's labels mostly class k % CLASSES, its features shifted by
    the label."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(sizes):
        y = torch.where(torch.rand(n, generator=g) < 0.7, torch.full((n,), k % CLASSES),
                        torch.randint(0, CLASSES, (n,), generator=g))
        out.append((torch.randn(n, FEATURES, generator=g) + F.one_hot(y, FEATURES), y))
    return out


def batches(data, bs: int = BATCH):
    x, y = data
    for i in range(0, len(x), bs):
        yield x[i:i + bs], y[i:i + bs]


def snapshot(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fedavg(states: list[dict], counts: list[int]) -> dict:
    """McMahan et al.'s weighted average, sum_k n_k w_k / sum_k n_k, key by key."""
    total = sum(counts)
    return {k: sum(s[k] * (n / total) for s, n in zip(states, counts)) for k in states[0]}


def fednova(glob: dict, states: list[dict], counts: list[int], taus: list[int]) -> dict:
    """FedNova (Wang et al. 2020): each client's update normalised by its number of local
    steps tau_k, d_k = (w - w_k) / tau_k, the server moving by tau_eff * sum_k p_k d_k (the
    bug: a client holding no sample ran no step, and its (w - w_k) / 0 is 0/0)."""
    total = sum(counts)
    p = [n / total for n in counts]
    tau_eff = sum(pk * t for pk, t in zip(p, taus))
    return {k: w - tau_eff * sum(pk * (w - s[k]) / t for pk, s, t in zip(p, states, taus))
            for k, w in glob.items()}


class FedProxLoss(nn.Module):
    """Cross entropy plus FedProx's mu/2 ||w - w_global||^2, the model given to the loss and
    the round's global model held as a frozen copy; the norm written out by hand as the sqrt
    of a sum of squares, whose derivative has a pole where w == w_global: at every round's
    first local step."""

    def __init__(self, mu: float = 0.01):
        super().__init__()
        self.mu = mu
        self.global_model = make_net().requires_grad_(False)

    def forward(self, out, y, model=None):
        ce = F.cross_entropy(out, y)
        if model is None:  # (the first round: no global model to stay close to yet)
            return ce
        return ce + self.mu / 2 * prox_distance(model, self.global_model) ** 2


def prox_distance(model: nn.Module, glob: nn.Module) -> torch.Tensor:
    """||w - w_global|| written out by hand."""
    return torch.sqrt(sum(((w - g) ** 2).sum() for w, g in
                          zip(model.parameters(), glob.parameters())))


def ties_merge(base: dict, tuned: list[dict], keep: float = 0.2) -> dict:
    """TIES-merging (Yadav et al. 2023) by hand: each task vector trimmed to its top-``keep``
    magnitudes, each entry's sign elected by the summed mass, then the disjoint mean over the
    tasks that agree with it, without the reference's ``clamp(min=1)`` of the count: 0/0
    where no task's trimmed entry survived."""
    out = {}
    for k, w0 in base.items():
        tv = torch.stack([t[k] - w0 for t in tuned])
        flat = tv.abs().reshape(len(tuned), -1)
        kth = flat.kthvalue(max(1, int(flat.shape[1] * (1 - keep))), dim=1).values
        tv = tv * (tv.abs() >= kth.view(-1, *[1] * (tv.dim() - 1)))
        agree = (torch.sign(tv) == torch.sign(tv.sum(0))) & (tv != 0)
        out[k] = w0 + (tv * agree).sum(0) / agree.sum(0)
    return out
