"""Optimizer state kept quantised block-wise (8-bit or float8 codes and a scale per block:
bitsandbytes' blockwise 8-bit states, torchao's ``OptimStateFp8``) that already held NaN codes
before the update. Quantising a block divides it by its absmax (times the type's largest);
a block of zeros (an embedding row no batch used, whose gradient and moments stay 0) has
absmax 0, and 0/0 is NaN in every code of it. The update that wrote them checked only the
weights, which stayed finite (its own moments were not yet quantised), so the next update
dequantises the NaN. Told by the NaN codes lying exactly in the blocks whose scale is 0."""

from __future__ import annotations

import torch

from recorder.inner_optim import state_items

ZERO_SCALE = (
    "its state {key} of {param} is kept quantised (codes and a scale per block) and already "
    "held NaN before this update, in exactly the {n} block(s) whose scale is 0: quantising a "
    "block of zeros (rows no batch reached, whose gradients and moments stay 0) divides 0 by "
    "its absmax 0, in the earlier update that stored it, which left the weights finite. Clip "
    "the absmax before dividing (absmax.clip(1e-12), as torchao's low-bit optimizers do) or "
    "keep codes of 0 where it is 0")


def zero_scale_why(model, opt) -> str | None:
    """The hint's reason when a tuple or list state holds NaN codes exactly where another of
    its tensors (the scales) is 0, else None."""
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in state_items(opt):
        for k, v in st.items():
            if isinstance(v, (tuple, list)) and (n := _zero_blocks(v)):
                return ZERO_SCALE.format(key=k, param=names.get(id(p), "?"), n=n)
    return None


def _zero_blocks(seq) -> int:
    """How many blocks (rows of the codes) are NaN, when they are exactly those whose scale
    is 0; 0 otherwise."""
    ts = [t for t in seq if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for codes in ts:
        bad = torch.isnan(codes.float())
        if not bad.any() or codes.dim() < 1:
            continue
        for scale in ts:
            if scale is codes or scale.dim() != codes.dim() or scale.shape[0] != codes.shape[0]:
                continue
            rows = bad.reshape(codes.shape[0], -1).any(1)
            zero = (scale == 0).reshape(scale.shape[0], -1).all(1)
            if torch.equal(rows, zero):
                return int(rows.sum())
    return 0
