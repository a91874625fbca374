"""A forward event whose first NaN an op of the forward's own derivative made (forces
``-dE/dpos`` by ``autograd.grad(create_graph=True)``) of an infinity a forward op made and the
forward then dropped: a smooth cutoff ``torch.where(x < 1, exp(-x**2 / (1 - x**2)), 0)`` at a
pair just past its edge, which a Verlet list's skin keeps. The forward's values are finite;
the derivative runs through both branches of the where and multiplies the infinity by the
dropped branch's 0 gradient. The op's own advice (rescale, float64) is for a value that was
meant to be used; the fix is a safe input before the op, inside the where."""

from __future__ import annotations

__all__ = ["dropped_branch_hint"]


def dropped_branch_hint(hint: str | None, hit, end, run=None, o=None) -> str | None:
    """``hint`` of the forward origin ``hit`` (an :class:`~replay.ops.OpHit`) whose infinity
    a later op ``end`` running in a backward node turned into the first NaN; unchanged where
    the model's output in ``run`` holds that infinity (call ``o``'s micro-batch): nothing
    dropped it (a float16 energy that overflowed, whose forces' backward then made NaN)."""
    if hint is None or hit is None or end is None or hit is end or hit.node is not None \
            or end.node is None or hit.made not in ("+inf", "-inf") or end.made != "nan" \
            or (run is not None and o is not None and _in_output(run, o.micro_batch, hit.made)):
        return hint
    said = hint.split(": ", 1)[0]  # (what happened, without the advice for a used value)
    return (f"{said}; if the forward dropped that {hit.made} after {hit.op} (torch.where, "
            "masked_fill), the derivative it takes itself (autograd.grad with "
            "create_graph=True: forces -dE/dpos) still runs through both branches and "
            f"multiplies it by the dropped entries' 0 gradient ({end.node.name()}'s {end.op} "
            f"made the NaN): make those entries' input safe before {hit.op} (x = "
            "torch.where(x < 1, x, 0) before the op, the double where), not its output")


def _in_output(run, mb: int, made: str) -> bool:
    """The root call of micro-batch ``mb`` returned an output whose max (+inf) or min (-inf)
    is ``made``."""
    at = 1 if made == "+inf" else 0
    return any(c.module == "" and c.micro_batch == mb and not c.in_backward
               and any(pair[at] == made.lstrip("+") for pair in c.minmax) for c in run.calls)
