"""Optimizer state the update made non-finite while the weights stayed finite.

Adam's second moment squares each gradient: a gradient of 1e36 (a LoRA ``alpha / r`` of 1e36,
an unscaled loss) is finite, its square is +inf in float32, and ``exp_avg_sq`` holds +inf from
then on. The update ``m / sqrt(inf)`` is 0: the weights stay finite and never move again, the
loss flattens, and no check of weights, gradients or loss ever fails. Its one trace is the
step's gradient norm, whose float32 sum of squares overflowed too, which alone is no event
(huge but finite gradients are). So at such a step only (slow path: the alarm's false alarm),
the update that follows is asked to check the state it wrote (one extra host read), and a
non-finite entry there is an ``optimizer`` event naming the parameters and state keys.
"""

from __future__ import annotations

import torch

from .finite import tensors_kind
from .inner_optim import SEP, full_state
from .shards import local


def non_finite_state(optimizer, names: dict[int, str]) -> tuple[dict[str, list[str]], str]:
    """(parameter name -> the keys of its optimizer state holding NaN/Inf, the worst kind
    they hold); floating tensors only, not a step count."""
    bad: dict[str, list[str]] = {}
    found = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name, state = names.get(id(p)), full_state(optimizer, p)  # (a wrapper's inner's)
            keys = [k for k, v in state.items()
                    if name is not None and k.rpartition(SEP)[2] != "step"
                    and isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
                    and not bool(torch.isfinite(local(v)).all())]
            if keys:
                bad[name] = keys
                found += [local(state[k]) for k in keys]
    return bad, tensors_kind(found) or "inf"


def state_detail(bad: dict[str, list[str]]) -> str:
    name, keys = next(iter(bad.items()))
    return (f"optimizer.step() made its state {', '.join(keys)} of {name} non-finite"
            + (f" (and of {len(bad) - 1} more parameter(s))" if len(bad) > 1 else "")
            + " while the weights stayed finite")
