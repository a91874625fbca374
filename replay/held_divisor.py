"""A division whose divisor is one of the model's or the loss's buffers as the code keeps it
(ReMixMatch's distribution alignment, ``p * p_target / self.p_model``, its running mean of the
class probabilities, or of the pseudo-label histogram, 0 for a class no row predicted): every
sample divides by the same 0, so the generic advice (an eps in the data, skip the rows, a
feature constant over the batch) points away from the fix, which is where the buffer starts
and how it is updated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from recorder.target import LOSS_PREFIX

__all__ = ["held_divisor_hint", "loss_buffers"]

SHOWN = 8  # entries named in the hint


def loss_buffers(loss) -> list[tuple[str, torch.Tensor]]:
    """The loss module's buffers, named ``<loss>.NAME`` as its parameters are."""
    if not isinstance(loss, torch.nn.Module):
        return []
    return list(loss.named_buffers(prefix=LOSS_PREFIX[:-1]))


def held_divisor_hint(hint: str | None, cause: str, finder, hit,
                      buffers: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The hint naming the buffer the blamed division (``hit``) divided by as is, and its
    entries at 0, when it is one of ``buffers`` (name, tensor); else None."""
    name = finder.names.hit_divisor_held
    ev = hit and hit.evidence
    if hint is None or cause != "invalid" or name is None or hit is not finder.first \
            or ev is None or len(ev.inputs) < 2:
        return None
    buf = dict(buffers).get(name)
    if buf is None or not bool((buf == 0).any()):
        return None
    zero = (buf.detach() == 0).flatten().nonzero().flatten().tolist()
    at = ", ".join(map(str, zero[:SHOWN])) + (f", ... ({len(zero)} in all)"
                                              if len(zero) > SHOWN else "")
    what = "0 by 0 (0/0)" if bool(((ev.inputs[0] == 0) & (ev.inputs[1] == 0)).any()) \
        else "x by 0 (x/0)"
    short = name.rpartition(".")[2]
    return (f"{hit.op} of {what}: the divisor is the buffer {name} as the code keeps it, 0 at "
            f"entr{'ies' if len(zero) > 1 else 'y'} {at} of its {buf.numel()}; every sample "
            "divides by the same entries, so no record is to blame and an eps in the data does "
            "not help. A running statistic kept in a buffer (a running mean of the class "
            "probabilities, a count or histogram per class) that is 0 there started at 0 or "
            "was never updated there: start it above 0 (uniform, not zeros), update it with "
            f"the batch before dividing, or divide by self.{short}.clamp_min(eps)")
