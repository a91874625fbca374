"""A small classifier and a Shampoo written the way repos write it (``L += G G^T``,
``R += G^T G``, plain SGD until ``start_preconditioning_step``, then ``L^-1 G R^-1`` through
Cholesky), for ``test_optimizer_linalg.py``; importable by the replay as a factory."""

from __future__ import annotations

import torch
from torch import nn

START = 3  # the preconditioner's first use is the update of step START (steps count from 0)


class CholeskyShampoo(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, eps=0.0, start_preconditioning_step=START):
        super().__init__(params, dict(lr=lr, eps=eps, start=start_preconditioning_step))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st, grad = self.state[p], p.grad
                if p.ndim < 2:
                    p.add_(grad, alpha=-g["lr"])
                    continue
                if not st:
                    st["step"] = 0
                    st["L"] = g["eps"] * torch.eye(p.shape[0])
                    st["R"] = g["eps"] * torch.eye(p.shape[1])
                st["step"] += 1
                st["L"].add_(grad @ grad.T)
                st["R"].add_(grad.T @ grad)
                if st["step"] <= g["start"]:
                    p.add_(grad, alpha=-g["lr"])
                    continue
                li = torch.cholesky_inverse(torch.linalg.cholesky(st["L"]))
                ri = torch.cholesky_inverse(torch.linalg.cholesky(st["R"]))
                p.add_(li @ grad @ ri, alpha=-g["lr"])


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def make_shampoo():
    """The model and the undamped Shampoo (eps=0) of the test loops, for the replay."""
    return {"model": make_model(), "optimizer": lambda params: CholeskyShampoo(params)}


def make_damped_shampoo():
    return {"model": make_model(),
            "optimizer": lambda params: CholeskyShampoo(params, eps=1e-3)}


HUGE_ROW = 4  # the corrupt record's row


def batches(n: int = 6, dead: int | None = None, huge_at: int | None = None,
            huge_row: int = HUGE_ROW, scale: float = 1e22):
    """``n`` batches of 16 records; ``dead``: a feature that is 0 in every record;
    ``huge_at``: the batch whose record ``huge_row`` is scaled by ``scale`` (a corrupt one)."""
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        x = torch.randn(16, 6, generator=g)
        y = torch.randint(0, 3, (16,), generator=g)
        if dead is not None:
            x[:, dead] = 0.0
        if huge_at == i:
            x[huge_row] *= scale
        yield x, y
