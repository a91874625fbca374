"""Models whose forward runs a higher-order op or a tensor subclass, as users write them:

- a frozen encoder with ``flex_attention`` (ALiBi as a ``score_mod`` over a per-head slope
  table, or Gemma-2's tanh soft-capping) under a causal ``create_block_mask``, and a trained
  head (flex_attention has no backward on CPU);
- ``torch.cond`` choosing, from a batch statistic, a standardisation without eps, or a centred
  square root (NaN in backward only);
- a standardisation run on activations viewed as a pass-through ``__torch_function__``
  subclass, and a parameter subclass made with ``Tensor._make_subclass`` carrying a scale;
  one on a wrapper subclass (``__torch_dispatch__``), which the replay's op finder cannot read.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

B, HEADS, SEQ, DIM = 4, 2, 8, 8


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class FlexAttention(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.mode = mode
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (i + 1) / HEADS)
                                                     for i in range(HEADS)]))

    def forward(self, x, block_mask):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        slopes, cap = self.slopes, 30.0

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        with warnings.catch_warnings():  # (eager flex_attention's advice to compile it)
            warnings.simplefilter("ignore")
            o = flex_attention(q, k, v, score_mod=alibi if self.mode == "alibi" else softcap,
                               block_mask=block_mask)
        return self.out(o.transpose(1, 2).reshape(b, s, d))


class FlexNet(nn.Module):
    def __init__(self, mode: str = "alibi"):
        super().__init__()
        self.emb = nn.Linear(4, DIM)
        self.attn = FlexAttention(mode)
        for p in [*self.emb.parameters(), *self.attn.parameters()]:
            p.requires_grad_(False)  # a frozen encoder
        self.head = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))

    def forward(self, x):
        mask = create_block_mask(causal, None, None, x.shape[1], x.shape[1], device="cpu")
        return self.head(self.attn(torch.relu(self.emb(x)), mask)).squeeze(-1)


def make_flex_alibi():
    return FlexNet("alibi")


def make_flex_alibi_inf_slope():
    model = FlexNet("alibi")
    model.attn.slopes.copy_(1.0 / torch.arange(HEADS, dtype=torch.float32))  # head 0: 1/0
    return model


def make_flex_softcap():
    return FlexNet("softcap")


class CondNorm(nn.Module):
    def forward(self, h):
        def standardise(h):
            return (h - h.mean(-1, keepdim=True)) / h.std(-1, keepdim=True)  # no eps: branch

        def passthrough(h):
            return h.clone()

        with warnings.catch_warnings():  # (dynamo's tracing of cond reads a non-leaf's .grad)
            warnings.simplefilter("ignore", UserWarning)
            return torch.cond(h.abs().amax() > 1e-3, standardise, passthrough, (h,))


class Masked(torch.Tensor):
    """Activations marked for masked ops: every op passes through the handler."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class SubclassNorm(nn.Module):
    def forward(self, h):
        h = h.as_subclass(Masked)
        return (h - h.mean(-1, keepdim=True)) / h.std(-1, keepdim=True)  # no eps: subclass


class Scaled(nn.Parameter):
    """A parameter carrying its scale, as quantisation and LoRA libraries make them."""

    def __new__(cls, data, scale=1.0):
        t = torch.Tensor._make_subclass(cls, data, True)
        t.scale = scale
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class ScaledLinear(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.weight = Scaled(torch.randn(o, i) / i ** 0.5, scale=0.5)
        self.bias = nn.Parameter(torch.zeros(o))

    def forward(self, x):
        return nn.functional.linear(x, self.weight * self.weight.scale, self.bias)


class NormNet(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.inp = nn.Linear(4, 16, bias=False)  # a record of zeros stays 0
        self.norm = norm
        self.mid = ScaledLinear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.norm(self.inp(x))))).squeeze(-1)


def make_cond_norm():
    return NormNet(CondNorm())


def make_subclass_norm():
    return NormNet(SubclassNorm())


class CondRoot(nn.Module):
    """A centred square root in a cond branch: finite forward, NaN gradient at each row's min
    (d sqrt(u)/du at u = 0), which only the backward makes."""

    def forward(self, h):
        def centred_root(h):
            return torch.sqrt(h - h.min(dim=1, keepdim=True).values)  # 0 at the row minimum

        def passthrough(h):
            return h.clone()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.cond(h.abs().amax() > 1e-3, centred_root, passthrough, (h,))


def make_cond_root():
    return NormNet(CondRoot())


class Wrapped(torch.Tensor):
    """A wrapper subclass (``_make_wrapper_subclass``) holding its data in ``elem``: every op
    runs on the unwrapped tensors, its results wrapped again."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype,
                                                   requires_grad=elem.requires_grad)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.elem if isinstance(t, Wrapped) else t

        out = func(*torch.utils._pytree.tree_map(unwrap, args),
                   **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        return torch.utils._pytree.tree_map(
            lambda t: Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


class WrappedNorm(nn.Module):
    def forward(self, h):
        w = Wrapped(h)
        return ((w - w.mean(-1, keepdim=True)) / w.std(-1, keepdim=True)).elem  # no eps


def make_wrapped_norm():
    return NormNet(WrappedNorm())
