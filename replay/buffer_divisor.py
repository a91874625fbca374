"""A forward division whose divisor the model's code made of one of its buffers alone (a
B-spline's Cox-de Boor recursion over its knots, ``(x - g[:-2]) / (g[1:-1] - g[:-2])``, after
a grid update put knots at quantiles of tied values): the divisor is 0 where the entries it
subtracts are equal, for every sample alike. The generic advice (an eps at the divisor, skip
the rows) hides the repeated entries; the fix is where the buffer is written, or the
formula's value at that 0.
"""

from __future__ import annotations

import torch

from .domains import describe

__all__ = ["buffer_divisor_hint"]

SHOWN = 8  # rows named in the hint (then "..." and how many)


def buffer_divisor_hint(hint: str | None, model: torch.nn.Module, finder, hit) -> str | None:
    """The hint naming the buffer the blamed division's divisor was made of, and its rows
    holding equal entries, when the op (``hit``, blamed from finite inputs) divided by 0
    there; else None (``hint`` stays)."""
    name, ev = finder.names.hit_divisor_buffer, hit and hit.evidence
    if hint is None or name is None or hit is not finder.first or ev is None \
            or len(ev.inputs) < 2 or not bool((ev.inputs[1] == 0).any()):
        return None
    what = describe(hit.op.removeprefix("aten."), ev)[0]
    return (f"{what}: the divisor was made of the model's buffers alone (the buffer {name}: "
            "its entries and their differences, no sample's record, nothing learned), 0 where "
            f"the entries it subtracts are equal{_ties(model, name)}. Every sample divides by "
            "it alike, so no record is to blame and an eps in the data does not help: keep its "
            "entries apart where the code writes them (a mesh's duplicated nodes make an edge "
            "of length 0; knots placed at quantiles of tied values repeat: mix in a uniform "
            "grid, drop or nudge repeated knots) or give the formula its value where the "
            "divisor is 0 (a B-spline's Cox-de Boor recursion takes 0/0 as 0: divide by "
            "torch.where(d == 0, 1, d) and zero those terms)")


def _ties(model: torch.nn.Module, name: str) -> str:
    """``"; its rows i, j hold equal entries"`` for the buffer as the re-run left it."""
    buf = dict(model.named_buffers()).get(name)
    if buf is None or not buf.is_floating_point() or buf.dim() == 0 or buf.shape[-1] < 2:
        return ""
    rows = buf.detach().reshape(-1, buf.shape[-1]).sort(-1).values.diff(dim=-1).eq(0).any(-1)
    ids = rows.nonzero().flatten().tolist()
    if not ids:
        return ""
    shown = ", ".join(map(str, ids[:SHOWN])) + (f", ... ({len(ids)} in all)"
                                                if len(ids) > SHOWN else "")
    many = len(ids) > 1
    return (f" (as the step left it, row{'s' if many else ''} {shown} of it "
            f"hold{'' if many else 's'} equal entries)")
