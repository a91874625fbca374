"""A backward origin at a quotient whose divisor needs no gradient and is 0 there, where that
divisor was looked up in a buffer of the model (a diffusion's ``x / alphas_cumprod[t].sqrt()``
at the last step of a schedule whose betas were not capped, the forward's infinity then
clipped away by ``clamp(-1, 1)``): the generic hint calls the divisor the batch's data (an
annotation's area, a count) and advises repairing records. The forward is re-run in the
origin's module with the op finder, whose first op on the origin's line names the table
(:mod:`replay.looked_up`), and the hint says so.
"""

from __future__ import annotations

from .forward import find_op_in_call
from .looked_up import looked_up_hint

__all__ = ["looked_up_divisor_hint"]


def looked_up_divisor_hint(runner, b, cause) -> str | None:
    """The hint for backward origin ``b`` (a quotient's node at a divisor of data, 0) when
    the forward's op on its line divided by a value looked up in a buffer; else None."""
    if cause.name != "invalid" or b.zero_divisor != "data" or b.module is None \
            or b.source is None or b.hook is not None:
        return None
    try:
        finder = find_op_in_call(runner, b.module, 0, b.micro_batch or 0)
    except Exception:  # (a module this re-run does not reach as the backward's did: no hint)
        return None
    hit = finder.first
    if hit is None or hit.source != b.source:
        return None
    said = looked_up_hint(cause.hint, runner.model.named_buffers(), finder, hit)
    if said is None:
        return None
    return (f"{b.node} made a non-finite gradient from finite incoming gradients: the "
            f"forward's {said}")
