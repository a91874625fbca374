"""A forward division whose divisor the model's code made of one of its buffers alone (a
B-spline's Cox-de Boor recursion over its knots, ``(x - g[:-2]) / (g[1:-1] - g[:-2])``, after
a grid update put knots at quantiles of tied values): the divisor is 0 where the entries it
subtracts are equal, for every sample alike. The generic advice (an eps at the divisor, skip
the rows) hides the repeated entries; the fix is where the buffer is written, or the
formula's value at that 0. A divisor made of two buffers' difference (a min-max normaliser's
``(x - self.lo) / (self.hi - self.lo)``, fitted on the dataset) is 0 where the two are equal,
a dimension that never moves there (Diffusion Policy's locked gripper): the fix is the
normaliser's guard of a zero range, not an eps in the data nor statistics over more of it.
"""

from __future__ import annotations

import torch

from .domains import describe, g

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
    if (fitted := _range_hint(hit.op, ev, model, name)) is not None:
        return fitted
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


def _range_hint(op: str, ev, model: torch.nn.Module, name: str) -> str | None:
    """The hint for a divisor made of two buffers' difference (``self.hi - self.lo``: a
    min-max range fitted on the dataset), naming the entries where the two are equal; else
    None (one buffer's own entries: ``_ties``)."""
    bufs = dict(model.named_buffers())
    hi, _, lo = name.partition(" - ")
    a, b = bufs.get(hi), bufs.get(lo)
    if a is None or b is None or a.shape != b.shape:
        return None
    at = (a.detach() == b.detach()).nonzero()
    where = ", ".join(str(tuple(i)) if len(i) > 1 else str(i[0]) for i in at[:SHOWN].tolist()) \
        + (f", ... ({len(at)} in all)" if len(at) > SHOWN else "")
    what = "0 by 0 (0/0)" if bool(((ev.inputs[0] == 0) & (ev.inputs[1] == 0)).any()) \
        else "x by 0 (x/0)"
    entries = f" at entr{'ies' if len(at) > 1 else 'y'} {where}" if len(at) else ""
    return (f"{op} of {what}: the divisor is {name}, a range the model keeps in two buffers (a "
            f"min-max normaliser fitted on the dataset), 0{entries}, where the two are equal: "
            "a dimension that never moves in the data it was fitted on (a locked gripper, a "
            "joint or sensor held at one value, a constant feature). Every sample divides by "
            "the same entries, so no record is to blame, and statistics over more data or an "
            "eps in the data do not help: guard the range where it is used or fitted (below a "
            "range_eps give it a scale of 1 and map the dimension to a constant, as Diffusion "
            "Policy's LinearNormalizer does; scikit-learn's MinMaxScaler sets a zero range's "
            f"scale to 1) or drop that dimension{_rounded_range(a, at)}")


def _rounded_range(hi: torch.Tensor, at: torch.Tensor) -> str:
    """What a half-precision range of 0 may also be: a dimension that moved less than the
    buffers' type can tell apart at their values (a normaliser's buffers cast by ``.half()``
    after it was fitted); "" for float32 and wider."""
    if hi.dtype not in (torch.float16, torch.bfloat16) or not len(at):
        return ""
    v = hi.detach()[tuple(at[0].tolist())].abs()
    gap = float(torch.nextafter(v, torch.tensor(float("inf"), dtype=v.dtype)) - v)
    dt = str(hi.dtype).removeprefix("torch.")
    return (f". But the buffers are {dt}, whose spacing at {g(float(v))} is {g(gap)}: a "
            f"dimension whose range was below that where it was fitted (a gripper that "
            f"jitters by micrometres) rounds to max == min when they are held in {dt} "
            "(model.half() before or after the fit); keep the normaliser's buffers "
            "and its arithmetic in float32, and guard the range")
