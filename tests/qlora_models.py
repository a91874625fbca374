"""QLoRA as torchao/torchtune build it: a frozen ``nn.Linear`` weight quantized to int8 with a
per-row absmax scale, held in a wrapper tensor subclass (``_make_wrapper_subclass``) whose
``__torch_dispatch__`` dequantizes it for every op but ``t`` and ``detach``; low-rank adapters
(``lora_a``, ``lora_b``) trained on top. ``make_qdora`` adds DoRA's weight decomposition:
the merged weight's rows normalised by their norm (a row of 0: a scale of 0, 0 / 0)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_map

aten = torch.ops.aten


class Int8Weight(torch.Tensor):
    @staticmethod
    def __new__(cls, qdata, scale, transposed=False):
        shape = qdata.shape[::-1] if transposed else qdata.shape
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=scale.dtype)

    def __init__(self, qdata, scale, transposed=False):
        self.qdata, self.scale, self.transposed = qdata, scale, transposed

    def __tensor_flatten__(self):
        return ["qdata", "scale"], self.transposed

    @staticmethod
    def __tensor_unflatten__(inner, transposed, outer_size, outer_stride):
        return Int8Weight(inner["qdata"], inner["scale"], transposed)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> Int8Weight:
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        return cls(torch.round(w / scale).to(torch.int8), scale)

    def dequantize(self) -> torch.Tensor:
        w = self.qdata.to(self.scale.dtype) * self.scale
        return w.t() if self.transposed else w

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.t.default:
            return Int8Weight(args[0].qdata, args[0].scale, not args[0].transposed)
        if func is aten.detach.default:
            return Int8Weight(args[0].qdata, args[0].scale, args[0].transposed)
        args, kwargs = tree_map(lambda t: t.dequantize() if isinstance(t, Int8Weight) else t,
                                (args, kwargs or {}))
        return func(*args, **kwargs)  # (mm, addmm, linear, add: on the dequantized weight)


class QLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 2, alpha: float = 4.0, dora: bool = False):
        super().__init__()
        self.weight = nn.Parameter(Int8Weight.from_float(base.weight.detach()),
                                   requires_grad=False)
        self.bias = nn.Parameter(base.bias.detach().clone(), requires_grad=False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)
        self.scaling = alpha / rank
        self.magnitude = nn.Parameter(base.weight.detach().norm(dim=1)) if dora else None

    def forward(self, x):
        if self.magnitude is None:
            return F.linear(x, self.weight, self.bias) \
                + self.lora_b(self.lora_a(x)) * self.scaling
        merged = self.weight + self.lora_b.weight @ self.lora_a.weight * self.scaling
        direction = merged / merged.norm(dim=1, keepdim=True)  # (no eps: DoRA's own)
        return F.linear(x, direction * self.magnitude[:, None], self.bias)


class Net(nn.Module):
    def __init__(self, dora: bool = False):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.proj = QLoRALinear(nn.Linear(8, 8), dora=dora)
        self.head = nn.Linear(8, 1)
        for p in (*self.embed.parameters(), *self.head.parameters()):
            p.requires_grad_(False)  # (the base model frozen: only the adapters train)

    def forward(self, x):
        return self.head(torch.relu(self.proj(torch.tanh(self.embed(x))))).squeeze(-1)


def make_qlora():
    return Net()


def make_qdora():
    return Net(dora=True)
