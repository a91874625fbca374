"""An update that overflowed the half-precision type its weights and state are kept in.

An optimizer keeps its state in its weights' dtype. Kept in float16, a quotient it computes can
pass 65504 with nothing wrong in the learning rate: ADOPT's ``g / max(sqrt(v), eps)`` is
``g * 1e6`` wherever ``v`` was 0 at its first step (a layer behind a zero-initialised
projection), and that state then overflows, whatever rate multiplies it later. The generic
"check the learning rate" hint sends the user to the rate; the fix is float32 weights and
state (autocast for the half compute), which ``--try dtype=float32`` re-runs.
"""

from __future__ import annotations

import torch

from .load import Step

_HALF = (torch.float16, torch.bfloat16)
TRY = "--try dtype=float32 tests it"  # (in the hint: what --try auto proposes for it)


def half_overflow_why(step: Step, made: str | None, params: list[str]) -> str | None:
    """The hint's reason for an update that made an infinity in weights kept in float16 or
    bfloat16; None for a NaN (an eps's 0/0 has its own) or wider weights."""
    w = step.tensors.get(f"weights/{params[0]}") if params else None
    if made not in ("+inf", "-inf") or w is None or w.dtype not in _HALF:
        return None
    dtype = str(w.dtype).removeprefix("torch.")
    return (f"the update's arithmetic passed {dtype}'s largest value "
            f"{torch.finfo(w.dtype).max:.4g}, the dtype of the weights and of the optimizer "
            "state it computes in (a quotient by a small second moment or eps, as ADOPT's "
            "g / max(sqrt(v), eps) where v was 0 at its first step): keep the weights and "
            f"optimizer state in float32 (autocast for {dtype} compute; {TRY})")
