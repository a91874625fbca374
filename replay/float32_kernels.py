"""Ops whose kernels compute in float32 only, run so inside the float64 re-run.

Quantization-aware training's fake quantization (``fake_quantize_per_channel_affine``, the
fused observer ``_fused_moving_avg_obs_fq_helper`` of ``FusedMovingAvgObsFakeQuantize``, the
learnable LSQ ops) refuses a float64 ``scale`` or input ('expected scalar type Float but found
Double'), so a QAT model raised in the float64 re-run and no cause was told. Its result is a
grid of int levels times a float32 scale, what training computes, so the op runs on float32
copies of its float64 arguments and its outputs, and the arguments it writes (the observer's
running min/max, scale), are widened back.
"""

from __future__ import annotations

import torch

from .compat import tree_map, writes_arguments

__all__ = ["float32_only", "run_in_float32"]


def float32_only(func) -> bool:
    """Whether the aten op ``func`` is one of torch's fake-quantization kernels."""
    name = func.overloadpacket.__name__
    return "fake_quant" in name or "obs_fq" in name


def run_in_float32(func, args, kwargs, run):
    """``run(func, args, kwargs)`` with float64 tensors narrowed to float32; the arguments it
    wrote copied back into the float64 originals, and floating outputs widened to float64."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def narrow(v):
        if isinstance(v, torch.Tensor) and v.dtype == torch.float64:
            pairs.append((v, n := v.to(torch.float32)))
            return n
        return v

    n_args, n_kwargs = tree_map(narrow, (tuple(args), dict(kwargs or {})))
    out = run(func, n_args, n_kwargs)
    if writes_arguments(func):
        for wide, small in pairs:
            wide.copy_(small)
    return tree_map(lambda v: v.to(torch.float64) if isinstance(v, torch.Tensor)
                    and v.dtype == torch.float32 else v, out)
