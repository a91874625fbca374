"""Current optimizers written the way their repositories write them, the small model they train
and its data, for ``test_modern_optimizers.py``:

- ``AdamWScheduleFree``: facebookresearch/schedule_free's ``schedulefree/adamw_schedulefree.py``
  (the per-parameter path): ``train()`` / ``eval()`` rewrite the parameters in place outside
  ``step()``, between the y sequence (gradients are taken there) and the x average (evaluated).
- ``Lion``: lucidrains/lion-pytorch's ``lion_pytorch/lion_pytorch.py``: the sign update, and
  ``decoupled_weight_decay=True`` dividing the decay by the constructor's learning rate.
- ``Prodigy``: konstmish/prodigy's ``prodigyopt/prodigy.py`` (one device): the D estimate
  ``d_hat = d_coef * d_numerator / d_denom`` and its growth.
- ``Muon`` with ``zeropower_via_newtonschulz5``: KellerJordan/Muon's ``muon.py``
  (``SingleDeviceMuonWithAuxAdam``: Muon for the hidden 2-D weights, AdamW for the rest in
  its own parameter groups; Newton-Schulz in bfloat16 of ``X / (X.norm() + eps)``).
- ``ADOPT``: iShohei220/adopt's ``adopt.py`` (first version, no clipping): the second moment is
  only initialised at step 0, and the normalised gradient is ``g / max(sqrt(v), eps)``.

The model is modded-nanogpt's MLP block (relu squared, ``c_proj`` zero-initialised) on a tabular
input, the factories (``modern_optimizers_models:make_muon``) hand the replay the optimizer."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

D_IN, DIM, CLASSES = 12, 16, 3


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim, bias=False)
        self.c_proj = nn.Linear(4 * dim, dim, bias=False)
        self.c_proj.weight.detach().zero_()  # zero init suggested by @Grad62304977

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Net(nn.Module):
    def __init__(self, depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(D_IN, DIM)
        self.blocks = nn.ModuleList([MLP(DIM) for _ in range(depth)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(F.rms_norm(h, (h.size(-1),)))
        return self.head(self.norm(h))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def loader(n: int = 256, batch_size: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, D_IN, generator=g)
    y = (x[:, :3].argmax(1) + (torch.rand(n, generator=g) < 0.1).long()) % 3
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(2))


class AdamWScheduleFree(torch.optim.Optimizer):
    """schedule_free's AdamWScheduleFree, its per-parameter (foreach=False) path."""

    def __init__(self, params, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 warmup_steps=0, r=0.0, weight_lr_power=2.0):
        defaults = dict(lr=lr, betas=betas, eps=eps, r=r, k=0, warmup_steps=warmup_steps,
                        train_mode=True, weight_sum=0.0, lr_max=-1.0,
                        weight_lr_power=weight_lr_power, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def eval(self):
        for group in self.param_groups:
            beta1, _ = group['betas']
            if group['train_mode']:
                for p in group['params']:
                    state = self.state[p]
                    if 'z' in state:
                        # Set p.data to x
                        p.data.lerp_(end=state['z'], weight=1 - 1 / beta1)
                group['train_mode'] = False

    def train(self):
        for group in self.param_groups:
            beta1, _ = group['betas']
            if not group['train_mode']:
                for p in group['params']:
                    state = self.state[p]
                    if 'z' in state:
                        # Set p.data to y
                        p.data.lerp_(end=state['z'], weight=1 - beta1)
                group['train_mode'] = True

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            eps, decay, k = group['eps'], group['weight_decay'], group['k']
            beta1, beta2 = group['betas']
            warmup_steps = group['warmup_steps']
            sched = (k + 1) / warmup_steps if k < warmup_steps else 1.0
            bias_correction2 = 1 - beta2 ** (k + 1)
            lr = group['lr'] * sched * math.sqrt(bias_correction2)
            lr_max = group['lr_max'] = max(lr, group['lr_max'])
            weight = ((k + 1) ** group['r']) * (lr_max ** group['weight_lr_power'])
            weight_sum = group['weight_sum'] = group['weight_sum'] + weight
            try:
                ckp1 = weight / weight_sum
            except ZeroDivisionError:
                ckp1 = 0
            if not group['train_mode']:
                raise Exception("Not in train mode!")
            for p in (p for p in group['params'] if p.grad is not None):
                state = self.state[p]
                if 'z' not in state:
                    state['z'] = torch.clone(p.data)
                    state['exp_avg_sq'] = torch.zeros_like(p.data)
                y, grad, z, exp_avg_sq = p.data, p.grad.data, state['z'], state['exp_avg_sq']
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = exp_avg_sq.sqrt().add_(eps)
                grad_normalized = grad.div_(denom)
                if decay != 0:
                    grad_normalized.add_(y, alpha=decay)
                y.lerp_(end=z, weight=ckp1)
                y.add_(grad_normalized, alpha=lr * (beta1 * (1 - ckp1) - 1))
                z.sub_(grad_normalized, alpha=lr)
            group['k'] = k + 1


class Lion(torch.optim.Optimizer):
    """lucidrains' Lion (the plain PyTorch update_fn)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0,
                 decoupled_weight_decay=False):
        assert lr > 0.
        assert all([0. <= beta <= 1. for beta in betas])
        self._init_lr = lr
        self.decoupled_wd = decoupled_weight_decay
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in filter(lambda p: p.grad is not None, group['params']):
                grad, lr, wd, state = p.grad, group['lr'], group['weight_decay'], self.state[p]
                beta1, beta2 = group['betas']
                if self.decoupled_wd:
                    wd /= self._init_lr
                if len(state) == 0:
                    state['exp_avg'] = torch.zeros_like(p)
                exp_avg = state['exp_avg']
                # stepweight decay
                p.data.mul_(1. - lr * wd)
                # weight update
                update = exp_avg.clone().mul_(beta1).add(grad, alpha=1. - beta1).sign_()
                p.add_(update, alpha=-lr)
                # decay the momentum running average coefficient
                exp_avg.mul_(beta2).add_(grad, alpha=1. - beta2)


class Prodigy(torch.optim.Optimizer):
    """konstmish/prodigy's Prodigy on one device (no FSDP, slice_p=1)."""

    def __init__(self, params, lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8,
                 weight_decay=0, decouple=True, use_bias_correction=False,
                 safeguard_warmup=False, d0=1e-6, d_coef=1.0, growth_rate=float('inf')):
        defaults = dict(lr=lr, betas=betas, beta3=beta3, eps=eps, weight_decay=weight_decay,
                        d=d0, d0=d0, d_max=d0, d_numerator=0.0, d_coef=d_coef, k=0,
                        growth_rate=growth_rate, use_bias_correction=use_bias_correction,
                        decouple=decouple, safeguard_warmup=safeguard_warmup)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        beta1, beta2 = group['betas']
        beta3 = group['beta3'] if group['beta3'] is not None else math.sqrt(beta2)
        k, d, d_max, d_coef = group['k'], group['d'], group['d_max'], group['d_coef']
        lr = max(group['lr'] for group in self.param_groups)
        bias_correction = (((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1))
                           if group['use_bias_correction'] else 1)
        dlr = d * lr * bias_correction
        growth_rate = group['growth_rate']
        d_numerator = group['d_numerator'] * beta3
        d_denom = 0.0
        for group in self.param_groups:
            d0 = group['d0']
            for p in (p for p in group['params'] if p.grad is not None):
                grad, state = p.grad, self.state[p]
                if 'step' not in state:
                    state['step'] = 0
                    state['s'] = torch.zeros_like(p.flatten())
                    state['p0'] = p.flatten().clone()
                    state['exp_avg'] = torch.zeros_like(p)
                    state['exp_avg_sq'] = torch.zeros_like(p)
                exp_avg, exp_avg_sq, s = state['exp_avg'], state['exp_avg_sq'], state['s']
                if group['lr'] > 0.0:
                    # we use d / d0 instead of just d to avoid getting values that are too small
                    d_numerator += (d / d0) * dlr * torch.dot(grad.flatten(),
                                                              state['p0'] - p.flatten()).item()
                    exp_avg.mul_(beta1).add_(grad, alpha=d * (1 - beta1))
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=d * d * (1 - beta2))
                    if group['safeguard_warmup']:
                        s.mul_(beta3).add_(grad.flatten(), alpha=((d / d0) * d))
                    else:
                        s.mul_(beta3).add_(grad.flatten(), alpha=((d / d0) * dlr))
                    d_denom += s.abs().sum().item()
        # if we have not done any progres, return
        if d_denom == 0:
            return
        d_hat = d_coef * d_numerator / d_denom
        if d == group['d0']:
            d = max(d, d_hat)
        d_max = max(d_max, d_hat)
        d = min(d_max, d * growth_rate)
        for group in self.param_groups:
            group.update(d_numerator=d_numerator, d_denom=d_denom, d=d, d_max=d_max,
                         d_hat=d_hat)
            for p in (p for p in group['params'] if p.grad is not None):
                state = self.state[p]
                state['step'] += 1
                denom = state['exp_avg_sq'].sqrt().add_(d * group['eps'])
                if group['weight_decay'] != 0 and group['decouple']:
                    p.data.add_(p.data, alpha=-group['weight_decay'] * dlr)
                p.data.addcdiv_(state['exp_avg'], denom, value=-dlr)
            group['k'] = k + 1


def zeropower_via_newtonschulz5(G, steps: int, eps: float = 1e-7):
    """Newton-Schulz iteration to compute the zeroth power / orthogonalization of G."""
    assert G.ndim >= 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    # Ensure spectral norm is at most 1
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def muon_update(grad, momentum, beta=0.95, ns_steps=5, nesterov=True, eps=1e-7):
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    update = zeropower_via_newtonschulz5(update, steps=ns_steps, eps=eps)
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update


def adam_update(grad, buf1, buf2, step, betas, eps):
    buf1.lerp_(grad, 1 - betas[0])
    buf2.lerp_(grad.square(), 1 - betas[1])
    buf1c = buf1 / (1 - betas[0] ** step)
    buf2c = buf2 / (1 - betas[1] ** step)
    return buf1c / (buf2c.sqrt() + eps)


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Muon's SingleDeviceMuonWithAuxAdam: groups with use_muon=True get Muon, the rest Adam."""

    def __init__(self, param_groups, ns_eps=1e-7):
        for group in param_groups:
            if group["use_muon"]:
                group.setdefault("lr", 0.02)
                group.setdefault("momentum", 0.95)
                group.setdefault("weight_decay", 0)
            else:
                group.setdefault("lr", 3e-4)
                group.setdefault("betas", (0.9, 0.95))
                group.setdefault("eps", 1e-10)
                group.setdefault("weight_decay", 0)
        self.ns_eps = ns_eps
        super().__init__(param_groups, dict())

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # Force synchronization
                state = self.state[p]
                if group["use_muon"]:
                    if len(state) == 0:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    update = muon_update(p.grad, state["momentum_buffer"],
                                         beta=group["momentum"], eps=self.ns_eps)
                else:
                    if len(state) == 0:
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                        state["step"] = 0
                    state["step"] += 1
                    update = adam_update(p.grad, state["exp_avg"], state["exp_avg_sq"],
                                         state["step"], group["betas"], group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-group["lr"])


def muon_groups(model: Net, muon_lr: float = 0.02) -> list[dict]:
    """Muon's README recipe: hidden matrices to Muon; embed, head, gains and biases to Adam."""
    hidden = [p for p in model.blocks.parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    return [dict(params=hidden, use_muon=True, lr=muon_lr, weight_decay=0.01),
            dict(params=rest, use_muon=False, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01)]


class ADOPT(torch.optim.Optimizer):
    """iShohei220/adopt's first version (decoupled=False, no clipping), one tensor at a time."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.9999), eps=1e-6, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group['betas']
            for p in (p for p in group['params'] if p.grad is not None):
                grad, state = p.grad, self.state[p]
                if len(state) == 0:
                    state['step'] = torch.tensor(0.0)
                    state['exp_avg'] = torch.zeros_like(p)
                    state['exp_avg_sq'] = torch.zeros_like(p)
                if group['weight_decay'] != 0:
                    grad = grad.add(p, alpha=group['weight_decay'])
                exp_avg, exp_avg_sq = state['exp_avg'], state['exp_avg_sq']
                if state['step'] == 0:
                    exp_avg_sq.addcmul_(grad, grad.conj())
                    state['step'] += 1
                    continue
                denom = torch.clamp(exp_avg_sq.sqrt(), group['eps'])
                if state['step'] == 1:
                    exp_avg.addcdiv_(grad, denom)
                else:
                    exp_avg.mul_(beta1).addcdiv_(grad, denom, value=1 - beta1)
                p.add_(exp_avg, alpha=-group['lr'])
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
                state['step'] += 1


def make_schedule_free():
    return {"model": make_model(), "optimizer": lambda groups: AdamWScheduleFree(groups)}


def make_lion():
    return {"model": make_model(),
            "optimizer": lambda groups: Lion(groups, lr=1e-4, weight_decay=0.1,
                                             decoupled_weight_decay=True)}


def make_prodigy():
    return {"model": make_model(), "optimizer": lambda groups: Prodigy(groups)}


def make_muon():
    return {"model": make_model(), "optimizer": lambda groups: MuonWithAuxAdam(groups)}


def make_adopt():
    return {"model": make_model(), "optimizer": lambda groups: ADOPT(groups)}


def make_muon0():
    return {"model": make_model(),
            "optimizer": lambda groups: MuonWithAuxAdam(groups, ns_eps=0.0)}


def make_prodigy_half():
    return {"model": make_model().half(), "optimizer": lambda groups: Prodigy(groups)}


def make_adopt_half():
    return {"model": make_model().half(), "optimizer": lambda groups: ADOPT(groups)}


class ScheduleFreeWrapper:
    """schedule_free's wrap_schedulefree.ScheduleFreeWrapper (not a torch.optim.Optimizer):
    any base optimizer made schedule-free, its z swapped into the parameters around
    base.step()."""

    def __init__(self, base, weight_decay_at_y=0.0, momentum=0.9, weight_lr_power=2, r=0):
        self.base = base
        self.weight_decay_at_y = weight_decay_at_y
        self.weight_lr_power = weight_lr_power
        self.r = r
        self.momentum = momentum
        self.train_mode = False

    def zero_grad(self, set_to_none=True):
        return self.base.zero_grad(set_to_none)

    @property
    def param_groups(self):
        return self.base.param_groups

    @property
    def state(self):
        return self.base.state

    @torch.no_grad()
    def eval(self):
        if self.train_mode:
            for group in self.param_groups:
                for p in group['params']:
                    if 'z' in self.state[p]:
                        p.lerp_(end=self.state[p]['z'], weight=1 - 1 / self.momentum)
        self.train_mode = False

    @torch.no_grad()
    def train(self):
        if not self.train_mode:
            for group in self.param_groups:
                for p in group['params']:
                    if 'z' in self.state[p]:
                        p.lerp_(end=self.state[p]['z'], weight=1 - self.momentum)
        self.train_mode = True

    @staticmethod
    def swap(x, y):
        x.add_(y)
        torch.sub(x, y, out=y)
        x.sub_(y)

    @torch.no_grad()
    def step(self, closure=None):
        if not self.train_mode:
            raise Exception("Please insert .train() and .eval() calls for the optimizer.")
        for group in self.param_groups:
            lr = group['lr']
            for p in (p for p in group['params'] if p.grad is not None):
                state = self.state[p]
                if 'z' not in state:
                    state['z'] = torch.clone(p)
                z = state['z']
                if self.weight_decay_at_y != 0.0:
                    z.sub_(p, alpha=lr * self.weight_decay_at_y)
                    p.sub_(p, alpha=lr * self.weight_decay_at_y * (1 - self.momentum))
                p.lerp_(end=z, weight=1 - 1 / self.momentum)
                self.swap(z, p)
        self.base.step()
        for group in self.param_groups:
            k = group.get('k', 0)
            lr = group['lr'] * group.get('d', 1.0)
            lr_max = group['lr_max'] = max(lr, group.get('lr_max', 0))
            weight = ((k + 1) ** self.r) * (lr_max ** self.weight_lr_power)
            weight_sum = group['weight_sum'] = group.get('weight_sum', 0.0) + weight
            ckp1 = weight / weight_sum
            for p in (p for p in group['params'] if p.grad is not None):
                z = self.state[p]['z']
                self.swap(z, p)
                p.lerp_(end=z, weight=ckp1)
                p.lerp_(end=self.state[p]['z'], weight=1 - self.momentum)
            group['k'] = k + 1
