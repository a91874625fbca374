"""Low-precision training written by hand, the way the public FP8 / 8-bit code writes it:

- ``Float8Linear``: per-tensor scaling with delayed scaling from an amax history, as
  Transformer Engine's ``DelayedScaling`` recipe and torchao's ``float8`` (``Float8Linear``,
  ``amax_to_scale``, ``to_fp8_saturated``) compute it: ``scale = fp8_max / amax``, the tensor
  times the scale cast to ``torch.float8_e4m3fn`` and back, divided by the scale.
- ``DynamicLossScaler``: fairseq's / Megatron's hand-written dynamic loss scaler (``scale *= 2``
  every ``scale_window`` good steps, halved and the step skipped on overflow).
- ``AdamFp8State``: torchao's ``optim`` low-bit Adam (``OptimStateFp8``): both moments kept
  block-wise in float8, ``scale = absmax / fp8_max`` per block of 32, as bitsandbytes' blockwise
  quantisation of 8-bit states does.
- ``kahan_step`` / ``stochastic_round``: bfloat16 weights updated from float32 master copies
  with Kahan compensation and stochastic rounding (torchao's ``_AdamW(bf16_stochastic_round)``,
  optimi's Kahan summation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
E5M2_MAX = torch.finfo(torch.float8_e5m2).max
D_IN, HIDDEN, N_CLASSES, HISTORY = 16, 32, 4, 4


def fp8_cast(x: torch.Tensor, scale: torch.Tensor, dtype, saturate: bool = True) -> torch.Tensor:
    """Quantise-dequantise ``x`` through ``dtype`` with a straight-through gradient."""
    fmax = torch.finfo(dtype).max
    with torch.no_grad():
        y = x * scale
        if saturate:
            y = y.clamp(-fmax, fmax)
        q = y.to(dtype).to(x.dtype) / scale
    return x + (q - x).detach()


class CastToFloat8(nn.Module):
    """The cast as a module of its own that returns the float8 codes (Transformer Engine's
    ``Float8Tensor`` carries codes and scale out of the cast into the GEMM)."""

    def __init__(self, dtype=torch.float8_e4m3fn):
        super().__init__()
        self.dtype = dtype

    def forward(self, x, scale):
        fmax = torch.finfo(self.dtype).max
        return (x.detach() * scale).clamp(-fmax, fmax).to(self.dtype)


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose input and weight pass through float8 with delayed scaling: the scale
    of each comes from the largest amax of the last ``HISTORY`` steps."""

    def __init__(self, d_in, d_out, act_dtype=torch.float8_e4m3fn, eps: float = 0.0,
                 saturate: bool = True, cast_module: bool = False):
        super().__init__(d_in, d_out)
        self.act_dtype, self.eps, self.saturate = act_dtype, eps, saturate
        self.cast_x = CastToFloat8(act_dtype) if cast_module else None
        self.register_buffer("amax_history_x", torch.zeros(HISTORY))
        self.register_buffer("amax_history_w", torch.zeros(HISTORY))

    def scale_of(self, t: torch.Tensor, history: torch.Tensor, fmax: float) -> torch.Tensor:
        """The scale from the amax of earlier steps (delayed scaling); this step's amax is
        recorded after (on the first step, with no history yet, it is used at once)."""
        with torch.no_grad():
            cur = t.abs().max()
            if self.training and not history.any():
                history[0] = cur
            amax = history.max()
            if self.eps:
                amax = torch.clamp(amax, min=self.eps)
            scale = fmax / amax  # amax_to_scale
            if self.training:
                history.copy_(torch.roll(history, 1))
                history[0] = cur
            return scale

    def forward(self, x):
        fmax = torch.finfo(self.act_dtype).max
        sx = self.scale_of(x, self.amax_history_x, fmax)
        sw = self.scale_of(self.weight, self.amax_history_w, E4M3_MAX)
        if self.cast_x is not None:
            codes = self.cast_x(x, sx)
            x8 = x + (codes.to(x.dtype) / sx - x).detach()
        else:
            x8 = fp8_cast(x, sx, self.act_dtype, self.saturate)
        w8 = fp8_cast(self.weight, sw, torch.float8_e4m3fn)
        return F.linear(x8, w8, self.bias)


class Fp8Mlp(nn.Module):
    """A residual MLP classifier; ``zero_init`` starts the residual branch's output projection at
    zero (GPT-2 / DiT "zero-init the last layer of each block")."""

    def __init__(self, zero_init: bool = False, **fp8):
        super().__init__()
        self.inp = Float8Linear(D_IN, HIDDEN, **fp8)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc = Float8Linear(HIDDEN, 2 * HIDDEN, **fp8)
        self.proj = Float8Linear(2 * HIDDEN, HIDDEN, **fp8)
        self.head = nn.Linear(HIDDEN, N_CLASSES)
        if zero_init:
            nn.init.zeros_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)

    def forward(self, x, mask=None):
        h = self.inp(x)
        h = h + self.proj(F.gelu(self.fc(self.norm(h))))
        if mask is not None:
            h = h * mask[:, None]
        return self.head(h)


def make_zero_init() -> nn.Module:
    torch.manual_seed(0)
    return Fp8Mlp(zero_init=True)


def make_zero_init_fixed() -> nn.Module:
    torch.manual_seed(0)
    return Fp8Mlp(zero_init=True, eps=1e-12)


def make_cast_modules() -> nn.Module:
    torch.manual_seed(0)
    return Fp8Mlp(eps=1e-12, cast_module=True)


def make_e5m2_unsaturated() -> nn.Module:
    torch.manual_seed(0)
    return Fp8Mlp(act_dtype=torch.float8_e5m2, saturate=False, eps=1e-12)


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return Fp8Mlp(eps=1e-12)


VOCAB, SEQ = 64, 6


class TokenClassifier(nn.Module):
    """Bag-of-tokens classifier: embeddings mean-pooled under a padding mask, then FP8 layers
    (bitsandbytes' 8-bit optimizers are used for exactly such embedding tables)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
        self.fc = Float8Linear(HIDDEN, HIDDEN, eps=1e-12)
        self.head = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, ids, mask):
        e = self.embed(ids) * mask[..., None]
        pooled = e.sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
        return self.head(F.gelu(self.fc(pooled)))


def make_token_classifier() -> nn.Module:
    torch.manual_seed(0)
    return TokenClassifier()


class DynamicLossScaler:
    """fairseq's ``DynamicLossScaler``: double every ``scale_window`` steps without overflow,
    halve on overflow; ``max_scale`` None means no cap."""

    def __init__(self, init_scale=2.0 ** 15, scale_window=1, max_scale=None):
        self.loss_scale, self.scale_window, self.max_scale = init_scale, scale_window, max_scale
        self.good = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.loss_scale /= 2
            self.good = 0
            return
        self.good += 1
        if self.good % self.scale_window == 0:
            self.loss_scale *= 2
            if self.max_scale is not None:
                self.loss_scale = min(self.loss_scale, self.max_scale)


class AdamFp8State(torch.optim.Optimizer):
    """Adam whose moments are stored block-wise in float8 (torchao ``OptimStateFp8``)."""

    BLOCK = 32

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, clip=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.clip = clip

    def quantize(self, x):
        """Block-wise: each block of ``BLOCK`` divided by its absmax / fp8_max, cast to float8
        (a parameter that does not split into blocks keeps float32 states, as torchao keeps
        small ones)."""
        if x.numel() % self.BLOCK:
            return x.clone(), None
        blocks = x.reshape(-1, self.BLOCK)
        scale = blocks.abs().amax(-1, keepdim=True)
        if self.clip:
            scale = scale.clip(self.clip)
        scale = scale / E4M3_MAX
        return (blocks / scale).to(torch.float8_e4m3fn), scale

    @staticmethod
    def dequantize(codes, scale, shape):
        if scale is None:
            return codes
        return (codes.float() * scale).reshape(shape)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = st["v"] = (torch.zeros_like(p), None)
                st["step"] += 1
                m = self.dequantize(*st["m"], p.shape).lerp(p.grad, 1 - b1)
                v = self.dequantize(*st["v"], p.shape).mul(b2).addcmul(p.grad, p.grad,
                                                                      value=1 - b2)
                st["m"], st["v"] = self.quantize(m), self.quantize(v)
                m_hat = m / (1 - b1 ** st["step"])
                v_hat = v / (1 - b2 ** st["step"])
                p.add_(m_hat / (v_hat.sqrt() + group["eps"]), alpha=-group["lr"])


class Bf16Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, N_CLASSES)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def make_bf16_mlp() -> nn.Module:
    torch.manual_seed(0)
    return Bf16Mlp().to(torch.bfloat16)


def stochastic_round(x: torch.Tensor, generator=None) -> torch.Tensor:
    """float32 -> bfloat16 with stochastic rounding: random low 16 bits added, then truncated."""
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).bfloat16()


@torch.no_grad()
def kahan_step(params, masters, comps, lr: float, generator=None) -> None:
    """SGD on the float32 masters with Kahan compensation, written back stochastically rounded."""
    for p, w, c in zip(params, masters, comps):
        y = -lr * p.grad.float() - c
        t = w + y
        c.copy_((t - w) - y)
        w.copy_(t)
        p.copy_(stochastic_round(w, generator))
        p.grad = None


def make_token_classifier_fp8_adam() -> dict:
    """The model and its optimizer, so the replay can re-run the update."""
    return {"model": make_token_classifier(),
            "optimizer": lambda params: AdamFp8State(params, lr=1e-3)}
