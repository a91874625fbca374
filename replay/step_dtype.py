"""The floating type a re-run micro-batch computed in (its autocast type, else its
parameters'), for the causes' "too large for float16" and "compute it in float32"."""

from __future__ import annotations

import torch

from .load import autocast_dtype
from .rerun import Runner


def autocast(runner: Runner, micro_batch: int, phase: str) -> torch.dtype | None:
    """The autocast type the micro-batch's forward (or its loss) ran under, if any."""
    mbs = runner.step.micro_batches
    return autocast_dtype(mbs[micro_batch], phase == "loss") if micro_batch < len(mbs) \
        else None


def step_dtype(runner: Runner, micro_batch: int) -> torch.dtype:
    """The narrowest floating type the micro-batch computed in: its autocast type, else its
    parameters' (when the blamed op's own dtype is not at hand)."""
    mbs = runner.step.micro_batches
    cast = autocast_dtype(mbs[micro_batch]) if micro_batch < len(mbs) else None
    dtypes = [cast] if cast is not None else []
    dtypes += [p.dtype for p in runner.model.parameters() if p.is_floating_point()]
    return min(dtypes, key=lambda d: torch.finfo(d).bits, default=torch.float32)
