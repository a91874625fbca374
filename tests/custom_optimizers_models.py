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


class HFAdafactor(torch.optim.Optimizer):
    """Hugging Face's Adafactor (transformers.optimization), factored branch only: row and
    column EMAs of g**2 + eps1, rsqrt of row / row.mean() times rsqrt of col, update clipped
    by its RMS, relative step size scaled by the parameter's RMS."""

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0,
                 decay_rate=-0.8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold,
                                      decay_rate=decay_rate, weight_decay=weight_decay))

    @staticmethod
    def _rms(t):
        return t.norm(2) / (t.numel() ** 0.5)

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in (p for p in g["params"] if p.grad is not None):
                grad, st = p.grad, self.state[p]
                if not st:
                    st["step"] = 0
                    if p.ndim >= 2:
                        st["row"] = torch.zeros(p.shape[:-1])
                        st["col"] = torch.zeros(p.shape[:-2] + p.shape[-1:])
                    else:
                        st["sq"] = torch.zeros_like(p)
                st["step"] += 1
                rel = min(1e-2, 1.0 / st["step"] ** 0.5)
                lr = max(g["eps"][1], self._rms(p)) * rel
                beta2 = 1.0 - st["step"] ** g["decay_rate"]
                sq = grad**2 + g["eps"][0]
                if p.ndim >= 2:
                    st["row"].mul_(beta2).add_(sq.mean(dim=-1), alpha=1 - beta2)
                    st["col"].mul_(beta2).add_(sq.mean(dim=-2), alpha=1 - beta2)
                    r = (st["row"] / st["row"].mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    update = r * st["col"].unsqueeze(-2).rsqrt() * grad
                else:
                    st["sq"].mul_(beta2).add_(sq, alpha=1 - beta2)
                    update = st["sq"].rsqrt() * grad
                update.div_((self._rms(update) / g["clip_threshold"]).clamp_(min=1.0))
                p.add_(update, alpha=-lr)


def make_adafactor():
    """The model and HFAdafactor(eps=(0, 1e-3)) of the Adafactor loop, for the replay."""
    return {"model": ZF.make_model(),
            "optimizer": lambda params: HFAdafactor(params, eps=(0.0, 1e-3))}


class Shampoo(torch.optim.Optimizer):
    """Shampoo as hand-written in repos: L += G G^T, R += G^T G (started at eps * I), update
    L^-1/4 G R^-1/4 by eigh, the eigenvalues raised to -1/4 as eigh returned them."""

    def __init__(self, params, lr=1e-2, eps=0.0, momentum=0.0):
        super().__init__(params, dict(lr=lr, eps=eps, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in (p for p in g["params"] if p.grad is not None):
                st, grad = self.state[p], p.grad
                if p.ndim < 2:
                    p.add_(grad, alpha=-g["lr"])
                    continue
                if not st:
                    st["L"] = g["eps"] * torch.eye(p.shape[0])
                    st["R"] = g["eps"] * torch.eye(p.shape[1])
                st["L"].add_(grad @ grad.T)
                st["R"].add_(grad.T @ grad)
                lam, q = torch.linalg.eigh(st["L"])
                li = q @ torch.diag(lam.pow(-0.25)) @ q.T
                lam, q = torch.linalg.eigh(st["R"])
                ri = q @ torch.diag(lam.pow(-0.25)) @ q.T
                p.add_(li @ grad @ ri, alpha=-g["lr"])


def make_shampoo():
    """The model and Shampoo(eps=0) of the Shampoo loop, for the replay."""
    return {"model": ZF.make_model(), "optimizer": lambda params: Shampoo(params)}
