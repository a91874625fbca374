"""A forward event whose first NaN an op of the forward's own derivative made (forces
``-dE/dpos`` by ``autograd.grad(create_graph=True)``) of an infinity a forward op made and the
forward then dropped: a smooth cutoff ``torch.where(x < 1, exp(-x**2 / (1 - x**2)), 0)`` at a
pair just past its edge, which a Verlet list's skin keeps. The forward's values are finite;
the derivative runs through both branches of the where and multiplies the infinity by the
dropped branch's 0 gradient. The op's own advice (rescale, float64) is for a value that was
meant to be used; the fix is a safe input before the op, inside the where. The same of a NaN
the forward made and dropped within the module call that returned finite values: a Bessel
basis "made safe" at r = 0 by its limit, ``torch.where(r > 0, sin(w r) / r, w)``, whose 0/0
the forces' backward still runs (a 0/0 again in DivBackward0)."""

from __future__ import annotations

__all__ = ["dropped_branch_hint"]


def dropped_branch_hint(hint: str | None, hit, end, run=None, o=None,
                        differentiated: bool = False) -> str | None:
    """``hint`` of the forward origin ``hit`` (an :class:`~replay.ops.OpHit`) whose infinity
    a later op ``end`` running in a backward node turned into the first NaN; unchanged where
    the model's output in ``run`` holds that infinity (call ``o``'s micro-batch): nothing
    dropped it (a float16 energy that overflowed, whose forces' backward then made NaN). A
    NaN ``hit`` made inside call ``o`` that returned finite outputs was dropped there too,
    where a backward node ran after it (``differentiated``)."""
    if hint is None or hit is None or hit.node is not None:
        return hint
    if hit.made == "nan" and differentiated and not hit.intentional and o is not None \
            and o.outputs_finite and not o.in_backward:
        return _said(hint, hit, f"the forward dropped that NaN before '{o.module}' returned "
                     "(its outputs are finite: torch.where, masked_fill), but the derivative "
                     "it takes itself", f"{hit.op}'s derivative, NaN there too, by the dropped "
                     "entries' 0 gradient")
    if end is None or hit is end or end.node is None or hit.made not in ("+inf", "-inf") \
            or end.made != "nan" \
            or (run is not None and o is not None and _in_output(run, o.micro_batch, hit.made)):
        return hint
    return _said(hint, hit, f"if the forward dropped that {hit.made} after {hit.op} "
                 "(torch.where, masked_fill), the derivative it takes itself",
                 "it by the dropped entries' 0 gradient "
                 f"({end.node.name()}'s {end.op} made the NaN)")


def _said(hint: str, hit, dropped: str, what: str) -> str:
    said = hint.split(": ", 1)[0]  # (what happened, without the advice for a used value)
    return (f"{said}; {dropped} (autograd.grad with create_graph=True: forces -dE/dpos) "
            f"still runs through both branches and multiplies {what}: make those entries' "
            f"input safe before {hit.op} (x = torch.where(x < 1, x, 0) before the op, the double where), not its output")


def _in_output(run, mb: int, made: str) -> bool:
    """The root call of micro-batch ``mb`` returned an output whose max (+inf) or min (-inf)
    is ``made``."""
    at = 1 if made == "+inf" else 0
    return any(c.module == "" and c.micro_batch == mb and not c.in_backward
               and any(pair[at] == made.lstrip("+") for pair in c.minmax) for c in run.calls)
