"""Non-finite values a pointwise op made from finite ones while other elements it was given
were already non-finite: attention scores that a ``-inf`` mask already holds divided by a
temperature of 0, an ``exp`` that overflows beside a NaN the data was allowed to hold. The op
finder's whole-tensor test (every input finite) passes such an op by, and the blame went to
the op that later made NaN of both (a softmax said to be of a fully masked row). Only
pointwise ops have positions to compare; every other op keeps the whole-tensor test."""

from __future__ import annotations

import torch

from recorder.finite import ends, pair_kind

POINTWISE = torch.Tag.pointwise


def fresh_positions(func, ins: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor | None:
    """Where the pointwise op ``func``'s output ``out`` is non-finite while every input
    ``ins`` (as it was given, broadcast to ``out``) is finite: the values it made itself.
    None when it made none there, or it is no pointwise op, or an input does not broadcast."""
    if POINTWISE not in func.tags or not out.is_floating_point():
        return None
    with torch.no_grad():
        made = ~torch.isfinite(out.detach())
        for t in ins:
            try:
                made &= torch.isfinite(torch.broadcast_to(t.detach(), out.shape))
            except RuntimeError:
                return None
        return made if bool(made.any()) else None


def made_there(out: torch.Tensor, made: torch.Tensor) -> str:
    """The kind of the values ``out`` holds at ``made``: NaN before +Inf before -Inf."""
    a, b = ends(out.detach()[made]).tolist()
    return pair_kind(a, b)


def inputs_there(ins: list[torch.Tensor], made: torch.Tensor, shape
                 ) -> tuple[float | None, float | None]:
    """The least and greatest value the inputs held at ``made`` (all finite there)."""
    with torch.no_grad():
        lo_hi = torch.stack([ends(torch.broadcast_to(t.detach(), shape)[made].float())
                             for t in ins]) if ins else None
    if lo_hi is None:
        return None, None
    return float(lo_hi[:, 0].min()), float(lo_hi[:, 1].max())
