"""The training tricks of timm's and DeiT's training scripts, written in plain PyTorch the way
timm writes them, on a tiny ViT, for ``test_training_tricks.py``:

- ``DropPath`` (stochastic depth) drawing its mask from the global RNG, the older timm /
  DeiT ``drop_path`` (``x.div(keep_prob) * random_tensor``), rates rising linearly per block
  (``torch.linspace(0, drop_path_rate, depth)``);
- ``LayerScale`` (``gamma = init_values * ones(dim)``, init 1e-6 in CaiT / DeiT III);
- ``Mixup`` (mixup of a batch with its flip, lambda from ``Beta(alpha, alpha)``) with
  ``mixup_target`` label smoothing and ``SoftTargetCrossEntropy``;
- ``ModelEmaV3`` (decay warmup, updated after ``optimizer.step()``);
- ``param_groups_layer_decay`` (layer-wise lr decay, no weight decay on norms, biases, gammas);
- ``adaptive_clip_grad`` (AGC: unit-wise norms, clipped by ``max(norm, eps)`` ratios);
- ``cosine_with_warmup`` through ``LambdaLR``.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

IMG, PATCH, DIM, DEPTH, CLASSES = 8, 4, 16, 3, 5


def drop_path(x, drop_prob: float = 0.0, training: bool = False):
    """DeiT's / older timm's drop_path: the scale by keep_prob before the mask."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)  # work with diff dim tensors, not just 2D
    random_tensor = keep_prob + torch.rand(shape, dtype=x.dtype, device=x.device)
    random_tensor.floor_()  # binarize
    output = x.div(keep_prob) * random_tensor
    return output


class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, drop_path: float, init_values: float | None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.drop_path1(self.ls1(self.attn(h, h, h, need_weights=False)[0]))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


class TinyViT(nn.Module):
    def __init__(self, drop_path_rate: float = 0.1, init_values: float | None = 1e-6,
                 zero_head: bool = False, depth: int = DEPTH):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, DIM, PATCH, PATCH)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, DIM))
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + (IMG // PATCH) ** 2, DIM) * .02)
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]  # stochastic depth decay rule
        self.blocks = nn.Sequential(*[Block(DIM, dpr[i], init_values) for i in range(depth)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=.02)
                nn.init.zeros_(m.bias)
        if zero_head:  # timm's head_init_scale=0 / zero_init_last: the head starts at 0
            nn.init.zeros_(self.head.weight)

    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def make_model() -> TinyViT:
    torch.manual_seed(0)
    return TinyViT().to(memory_format=torch.channels_last)


def make_deep_drop() -> TinyViT:
    """DeiT's --drop-path 1.0 (meant as 0.1): the last block's keep_prob is 0."""
    torch.manual_seed(0)
    return TinyViT(drop_path_rate=1.0).to(memory_format=torch.channels_last)


def make_zero_head() -> TinyViT:
    torch.manual_seed(0)
    return TinyViT(zero_head=True, init_values=None, drop_path_rate=0.0)


class Images(Dataset):
    """Random 3x8x8 images whose class is the brightest of 5 fixed patterns."""

    def __init__(self, n: int = 64, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, IMG, IMG, generator=g)
        pats = torch.randn(CLASSES, 3, IMG, IMG, generator=torch.Generator().manual_seed(7))
        self.y = torch.einsum("nchw,kchw->nk", self.x, pats).argmax(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def loader(n: int = 64, batch_size: int = 16) -> DataLoader:
    return DataLoader(Images(n), batch_size=batch_size, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(2))


# --- mixup / cutmix with label smoothing (timm.data.mixup) ---

def one_hot(x, num_classes, on_value=1., off_value=0.):
    x = x.long().view(-1, 1)
    return torch.full((x.size()[0], num_classes), off_value, device=x.device).scatter_(1, x, on_value)


def mixup_target(target, num_classes, lam=1., smoothing=0.0):
    off_value = smoothing / num_classes
    on_value = 1. - smoothing + off_value
    y1 = one_hot(target, num_classes, on_value=on_value, off_value=off_value)
    y2 = one_hot(target.flip(0), num_classes, on_value=on_value, off_value=off_value)
    return y1 * lam + y2 * (1. - lam)


def sample_beta(alpha, n, device=None):
    """Beta(alpha, alpha) on the device, by Johnk's algorithm (X = U^(1/a), Y = V^(1/a), kept
    where X + Y <= 1, lambda = X / (X + Y)): no host sync, the global RNG, fit for a graph."""
    inv = 1.0 / torch.as_tensor(alpha, dtype=torch.float32, device=device)
    lam = torch.full((n,), 0.5, device=device)
    todo = torch.ones(n, dtype=torch.bool, device=device)
    for _ in range(16):
        x = torch.rand(n, device=device).pow(inv)
        y = torch.rand(n, device=device).pow(inv)
        ok = todo & (x + y <= 1)
        lam = torch.where(ok, x / (x + y), lam)
        todo = todo & ~ok
    return lam


class Mixup:
    """timm's Mixup in 'elem' mode (one lambda per sample, mixed with the flipped batch), the
    lambdas drawn on the device (``sample_beta``); the targets smoothed by ``mixup_target``."""

    def __init__(self, mixup_alpha=0.8, label_smoothing=0.1, num_classes=CLASSES):
        self.mixup_alpha = mixup_alpha
        self.label_smoothing = label_smoothing
        self.num_classes = num_classes

    def __call__(self, x, target):
        lam = sample_beta(self.mixup_alpha, x.shape[0], x.device)
        x_orig = x.clone()  # need to keep an unmodified original for mixing source
        lam_x = lam.view(-1, 1, 1, 1)
        x = x * lam_x + x_orig.flip(0) * (1 - lam_x)
        target = mixup_target(target, self.num_classes, lam.unsqueeze(1), self.label_smoothing)
        return x, target


class SoftTargetCrossEntropy(nn.Module):
    def forward(self, x, target):
        loss = torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1)
        return loss.mean()


class DistillationLoss(nn.Module):
    """DeiT's losses.DistillationLoss ('soft'): the base loss plus a KL to the teacher's
    softened outputs, the teacher's logits computed by the loop and passed in."""

    def __init__(self, base, alpha=0.5, tau=1.0):
        super().__init__()
        self.base, self.alpha, self.tau = base, alpha, tau

    def forward(self, outputs, teacher_outputs, labels):
        base_loss = self.base(outputs, labels)
        T = self.tau
        kd = F.kl_div(F.log_softmax(outputs / T, dim=1), F.log_softmax(teacher_outputs / T, dim=1),
                      reduction="sum", log_target=True) * (T * T) / outputs.numel()
        return base_loss * (1 - self.alpha) + kd * self.alpha


# --- model EMA (timm.utils.model_ema.ModelEmaV3) ---

class ModelEmaV3(nn.Module):
    def __init__(self, model, decay=0.9999, min_decay=0.0, use_warmup=False,
                 warmup_gamma=1.0, warmup_power=2 / 3):
        super().__init__()
        import copy
        self.module = copy.deepcopy(model).eval()
        self.decay, self.min_decay = decay, min_decay
        self.use_warmup, self.warmup_gamma, self.warmup_power = use_warmup, warmup_gamma, warmup_power
        for p in self.module.parameters():
            p.requires_grad_(False)

    def get_decay(self, step=None):
        if step is None:
            return self.decay
        step = max(0, step - 1)
        if step <= 0:
            return 0.0
        if self.use_warmup:
            decay = 1 - (1 + step / self.warmup_gamma) ** -self.warmup_power
            decay = max(min(decay, self.decay), self.min_decay)
        else:
            decay = self.decay
        return decay

    @torch.no_grad()
    def update(self, model, step=None):
        decay = self.get_decay(step)
        ema_lerp_values = list(self.module.parameters())
        model_lerp_values = list(model.parameters())
        torch._foreach_lerp_(ema_lerp_values, model_lerp_values, weight=1. - decay)
        for ema_v, model_v in zip(self.module.buffers(), model.buffers()):
            ema_v.copy_(model_v)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


# --- layer-wise lr decay param groups (timm.optim._param_groups) ---

def _layer_id(name: str, num_layers: int) -> int:
    if name.startswith(("cls_token", "pos_embed", "patch_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return num_layers - 1


def param_groups_layer_decay(model, weight_decay=0.05, layer_decay=0.75):
    no_weight_decay_list = model.no_weight_decay()
    num_layers = len(model.blocks) + 2
    layer_scales = [layer_decay ** (num_layers - 1 - i) for i in range(num_layers)]
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim == 1 or name in no_weight_decay_list:
            g_decay, this_decay = "no_decay", 0.0
        else:
            g_decay, this_decay = "decay", weight_decay
        layer_id = _layer_id(name, num_layers)
        group_name = f"layer_{layer_id}_{g_decay}"
        if group_name not in groups:
            groups[group_name] = {"lr_scale": layer_scales[layer_id], "weight_decay": this_decay,
                                  "params": []}
        groups[group_name]["params"].append(param)
    return list(groups.values())


# --- adaptive gradient clipping (timm.utils.agc, NFNet's unitwise norms) ---

def unitwise_norm(x, norm_type=2.0):
    if x.ndim <= 1:
        return x.norm(norm_type)
    return x.norm(norm_type, dim=tuple(range(1, x.ndim)), keepdim=True)


def adaptive_clip_grad(parameters, clip_factor=0.01, eps=1e-3, norm_type=2.0):
    """NFNet's AGC as the paper writes it: G <- lambda * max(|W|, eps) / |G| * G where
    |G| > lambda * max(|W|, eps); the ratio's denominator max(|G|, eps) too."""
    for p in parameters:
        if p.grad is None:
            continue
        p_data, g_data = p.detach(), p.grad.detach()
        max_norm = unitwise_norm(p_data, norm_type).clamp(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(g_data, norm_type)
        trigger = grad_norm > max_norm
        clipped = g_data * (max_norm / grad_norm.clamp(min=eps))
        p.grad.detach().copy_(torch.where(trigger, clipped, g_data))


def clip_ratio_grad(parameters, clip_factor=0.01, eps=1e-3, norm_type=2.0):
    """The same AGC applied as one scale per unit, ``min(1, max_norm / max(|G|, eps))``."""
    for p in parameters:
        if p.grad is None:
            continue
        max_norm = unitwise_norm(p.detach(), norm_type).clamp(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(p.grad.detach(), norm_type)
        p.grad.detach().mul_((max_norm / grad_norm.clamp(min=eps)).clamp(max=1.0))


# --- cosine schedule with warmup (LambdaLR) ---

def cosine_with_warmup(opt, warmup_steps, total_steps):
    def lr_lambda(step):
        warm = min(step / warmup_steps, 1.0)
        return warm * 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


def warmup_steps_of(warmup_epochs, steps_per_epoch):
    """The warm-up length as the script computes it from the epoch count (numpy ints)."""
    return np.int64(warmup_epochs) * np.int64(steps_per_epoch)


# --- SAM / ASAM (davda54/sam) and Lookahead (timm.optim.lookahead) ---

class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)  # climb to the local maximum "w + e(w)"
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]  # get back to "w" from "w + e(w)"
        self.base_optimizer.step()  # do the actual "sharpness-aware" update
        if zero_grad:
            self.zero_grad()

    def step(self, closure=None):
        raise NotImplementedError("SAM requires first_step and second_step")

    def _grad_norm(self):
        shared_device = self.param_groups[0]["params"][0].device
        norm = torch.norm(torch.stack([
            ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2).to(shared_device)
            for group in self.param_groups for p in group["params"] if p.grad is not None]), p=2)
        return norm


class Lookahead(torch.optim.Optimizer):
    """timm's Lookahead wrapper: no Optimizer.__init__, the base optimizer's groups shared,
    the step-hook dicts torch's hooked step() reads set by hand."""

    def __init__(self, base_optimizer, alpha=0.5, k=6):
        defaults = dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self.base_optimizer = base_optimizer
        self.param_groups = self.base_optimizer.param_groups
        self.defaults = base_optimizer.defaults
        self.defaults.update(defaults)
        self.state = defaultdict(dict)
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        for name, default in defaults.items():
            for group in self.param_groups:
                group.setdefault(name, default)

    @torch.no_grad()
    def update_slow(self, group):
        for fast_p in group["params"]:
            if fast_p.grad is None:
                continue
            param_state = self.state[fast_p]
            if "slow_buffer" not in param_state:
                param_state["slow_buffer"] = torch.empty_like(fast_p.data)
                param_state["slow_buffer"].copy_(fast_p.data)
            slow = param_state["slow_buffer"]
            slow.add_(fast_p.data - slow, alpha=group["lookahead_alpha"])
            fast_p.data.copy_(slow)

    def step(self, closure=None):
        loss = self.base_optimizer.step(closure)
        for group in self.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss
