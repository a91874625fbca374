"""Hand-written optimizers as popular repos write them (torch.optim.Optimizer subclasses), and
the factory that hands them to the replay (``custom_optimizers_models:make_sophia``)."""

from __future__ import annotations

import torch
import zf_models as ZF


class SophiaG(torch.optim.Optimizer):
    """Sophia-G as in Liu et al.'s repo: an EMA of the Gauss-Newton hessian diagonal (the
    loop calls update_hessian every k steps), update sign(m) * clip(|m| / (rho * h + eps), 1)."""

    def __init__(self, params, lr=1e-3, betas=(0.965, 0.99), rho=0.04, weight_decay=0.0,
                 eps=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, rho=rho, weight_decay=weight_decay,
                                      eps=eps))

    def _state(self, p):
        st = self.state[p]
        if "exp_avg" not in st:
            st["exp_avg"] = torch.zeros_like(p)
            st["hessian"] = torch.zeros_like(p)
        return st

    @torch.no_grad()
    def update_hessian(self):
        for g in self.param_groups:
            b2 = g["betas"][1]
            for p in (p for p in g["params"] if p.grad is not None):
                self._state(p)["hessian"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in (p for p in g["params"] if p.grad is not None):
                st = self._state(p)
                p.mul_(1 - g["lr"] * g["weight_decay"])
                st["exp_avg"].mul_(g["betas"][0]).add_(p.grad, alpha=1 - g["betas"][0])
                ratio = (st["exp_avg"].abs() / (g["rho"] * st["hessian"] + g["eps"])).clamp(None, 1)
                p.addcmul_(st["exp_avg"].sign(), ratio, value=-g["lr"])


def make_sophia():
    """The model and the optimizer of test_custom_optimizers.py's Sophia loop, for the replay."""
    return {"model": ZF.make_model(),
            "optimizer": lambda params: SophiaG(params, lr=1e-3)}
