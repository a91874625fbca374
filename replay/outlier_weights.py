"""A forward overflow whose scale is a parameter's, not the data's: one element (or a few) of a
weight tensor out of scale with the rest of it, by a factor of 2**20 or more over the tensor's
median magnitude, 2**64 or more (beyond any init, a mask's -1e9 fill or a training's drift),
and large enough to be the overflowed op's scale. A flipped exponent bit in a
checkpoint (a storage or transfer fault: bit 30 of a float32 multiplies a value by 2**128), a
partial write or a tensor from another run put such a value into a model that otherwise trains
as before; a learning rate or update cannot make one element 2**20 times its neighbours in one
step (a run the ring shows growing its weights over several steps is left to the diverging
hint). The overflow's generic advice (rescale the op's inputs, compute in float64) points away
from it: the hint names the parameter, the element and its value, and at the first step the
recorder saw (no update ran under it) says the weights came in so, with the state_dict loaded
before: the checkpoint to check.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .load import Step
from .param_writes import first_recorded
from .precursors import history

__all__ = ["outlier_weight_hint"]

_RATIO = 2.0 ** 20  # an element this many times its tensor's median magnitude is an outlier
_HUGE = 2.0 ** 64  # and this large: no init, mask fill (-1e9) or training makes one
_FEW = 0.01  # at most this share of the tensor's elements (at least 1)
_REACH = 1e3  # the outlier times this reaches the op's scale: the op's values came of it


def _outliers(t: torch.Tensor) -> tuple[int, list[int], float, float] | None:
    """(count, first flat indices, largest magnitude, median magnitude) of ``t``'s out-of-scale
    elements; None when it has none, or too many to be a fault of a few values."""
    a = t.detach().float().abs().flatten()
    if a.numel() < 8 or not bool(torch.isfinite(a).all()):
        return None
    med = float(a.median())
    if med <= 0:
        return None
    far = ((a >= _RATIO * med) & (a >= _HUGE)).nonzero().flatten()
    if far.numel() == 0 or far.numel() > max(1, int(_FEW * a.numel())):
        return None
    return far.numel(), far[:4].tolist(), float(a[far].max()), med


def _index(shape: torch.Size, flat: int) -> str:
    at = [int(k) for k in torch.unravel_index(torch.tensor(flat), shape)]
    return str(tuple(at)) if len(at) > 1 else str(at[0])


def outlier_weight_hint(report: dict[str, Any], step: Step) -> None:
    """Replace a forward overflow's advice when a parameter holds an element far out of its
    tensor's scale, at the op's scale (see the module)."""
    o = report.get("origin") or {}
    span = o.get("input_range") or []
    if report.get("cause") != "overflow" or o.get("phase") != "forward" or len(span) != 2:
        return
    top = max(abs(float(v)) for v in span)
    if not math.isfinite(top) or top <= 0:
        return
    found = []
    for key, t in step.tensors.items():
        if key.startswith("weights/") and isinstance(t, torch.Tensor) and t.is_floating_point():
            if (out := _outliers(t)) is not None and out[2] * _REACH >= top:
                found.append((out[2], key.removeprefix("weights/"), t.shape, out))
    if not found or (not first_recorded(step) and _weights_grew(step)):
        return  # (weights the run itself grew, a diverging SGD's: the diverging hint's)
    _, name, shape, (n, at, big, med) = max(found, key=lambda f: f[0])
    where = ", ".join(_index(shape, i) for i in at) + (", ..." if n > len(at) else "")
    said = (f"{name} holds {n} element{'s' if n > 1 else ''} out of scale with the rest of it "
            f"(up to {big:.3g} at {where}, its median magnitude {med:.3g}), and the overflow is "
            "of that scale: not the data's nor a type's limit to widen")
    if first_recorded(step):
        said += (", and it was so at the first step the recorder saw, before any update ran "
                 "under it: the weights came in so, with the state_dict loaded before (a "
                 "corrupted checkpoint: a flipped exponent bit multiplies a float32 value by "
                 "up to 2**128, a partial or interrupted write, another run's tensor). Check "
                 "the checkpoint (each tensor's abs().max() against its median) and resume "
                 "from an earlier, intact one")
    else:
        said += (": a write of the loop outside the optimizer put it there (a checkpoint or "
                 "state_dict loaded mid-run, an in-place edit), since no update makes one "
                 "element 2**20 times its neighbours in a step. Check what wrote it (each "
                 "tensor's abs().max() against its median before loading it)")
    report["hint"] = said


def _weights_grew(step: Step) -> bool:
    """The weights' norm, as the ring recorded it before the event, moved by more than 2x: the
    run grew them (a divergence), so an element out of scale may be its own doing."""
    hist = history(step.meta, step.tensors)
    at = hist.get("event_step")
    norms = [abs(v) for s, v in zip(hist["steps"], hist.get("weight_norm") or hist["param_norm"])
             if s is not None and at is not None and s < at and isinstance(v, (int, float))
             and math.isfinite(v) and v > 0]
    return len(norms) >= 2 and max(norms) > 2 * min(norms)
