"""Prodigy (konstmish/prodigy's ``prodigyopt/prodigy.py``) as repos rewrite it to save its host
reads: ``d_numerator`` and ``d_denom`` summed as 0-d tensors, ``d`` read once per step, and
the ``if d_denom == 0: return`` early exit dropped with the loop of ``.item()`` calls it sat
after. Trained on ``modern_optimizers_models``' modded-nanogpt MLP, for
``test_zero_rate_updates.py``."""

from __future__ import annotations

import math

import modern_optimizers_models as M
import torch


class TensorSumProdigy(torch.optim.Optimizer):
    def __init__(self, params, lr=1.0, betas=(0.9, 0.999), eps=1e-8, d0=1e-6):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, d=d0, d0=d0, d_max=d0,
                                      d_numerator=0.0))

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        beta1, beta2 = group['betas']
        beta3 = math.sqrt(beta2)
        d, d_max = group['d'], group['d_max']
        dlr = d * max(g['lr'] for g in self.param_groups)
        d_numerator = torch.tensor(group['d_numerator'] * beta3)
        d_denom = torch.tensor(0.0)
        for g in self.param_groups:
            for p in (p for p in g['params'] if p.grad is not None):
                st, grad = self.state[p], p.grad
                if not st:
                    st['s'] = torch.zeros_like(p.flatten())
                    st['p0'] = p.flatten().clone()
                    st['exp_avg'] = torch.zeros_like(p)
                    st['exp_avg_sq'] = torch.zeros_like(p)
                d_numerator += (d / g['d0']) * dlr * torch.dot(grad.flatten(),
                                                               st['p0'] - p.flatten())
                st['exp_avg'].mul_(beta1).add_(grad, alpha=d * (1 - beta1))
                st['exp_avg_sq'].mul_(beta2).addcmul_(grad, grad, value=d * d * (1 - beta2))
                st['s'].mul_(beta3).add_(grad.flatten(), alpha=(d / g['d0']) * dlr)
                d_denom += st['s'].abs().sum()
        d_hat = (d_numerator / d_denom).item()  # one host read for the step
        d = max(d_hat, d)
        d_max = max(d_max, d_hat)
        for g in self.param_groups:
            g.update(d_numerator=d_numerator.item(), d=d, d_max=d_max)
            for p in (p for p in g['params'] if p.grad is not None):
                st = self.state[p]
                denom = st['exp_avg_sq'].sqrt().add_(d * g['eps'])
                p.addcdiv_(st['exp_avg'], denom, value=-dlr)


def make_prodigy():
    return {"model": M.make_model(), "optimizer": lambda groups: TensorSumProdigy(groups)}
