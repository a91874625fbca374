"""A NaN that a composite torch function's own code writes as a constant.

Beneath the dispatcher, ``torch.logdet(A)`` is ``slogdet`` followed by
``where(sign == -1, nan, logabsdet)``: the aten op that makes its NaN from finite inputs is a
``scalar_tensor(nan)``, which says nothing of why (and is made at every call, whatever the
sign). :class:`Composites` recognises such a constant by the aten op that the function runs
before it (``_linalg_slogdet``), and the op finder names the function instead, with its own
input as the evidence (the matrix whose determinant is negative), when the function's result
is non-finite. (A torch function mode would see every composite call, but its Python frame
would sit between the user's line and torch: torch's warnings would come from it.)
"""

from __future__ import annotations

import math

import torch

from .compat import tree_leaves
from .hits import Evidence, OpHit
from .source import user_source

# aten op -> the composite function that runs it, then writes NaN where its result is
# undefined (a negative determinant's log), at most ``_WITHIN`` ops later
_BEFORE_NAN = {"_linalg_slogdet": torch.logdet}
_WITHIN = 4


class Composites:
    """The last aten op of :data:`_BEFORE_NAN` seen (its function, input and position)."""

    def __init__(self):
        self.last: tuple | None = None

    def see(self, name: str, args, seq: int) -> None:
        if name in _BEFORE_NAN and args and isinstance(args[0], torch.Tensor):
            self.last = (_BEFORE_NAN[name], args[0], seq)

    def nan_constant(self, ins: list, leaves: list, seq: int):
        """``(function, input)`` when an op that took no floating input made NaN from a NaN
        given as a number, right after such an op; else None."""
        if self.last is None or ins or seq - self.last[2] > _WITHIN or not any(
                isinstance(a, float) and math.isnan(a) for a in leaves):
            return None
        return self.last[:2]


def composite_hit(f, func, given: torch.Tensor, occurrence: int) -> OpHit | None:
    """The op finder ``f``'s hit for ``func(given)``, named by the function, or None when its
    result is finite (the constant was not taken). Run inside a dispatch handler: no mode
    sees these calls."""
    x = given.detach()
    with torch.no_grad():
        try:
            out, out64 = func(x), func(x.double())
        except Exception:  # it refuses the input alone: no hit, the constant stays unnamed
            return None
    out = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    if bool(torch.isfinite(out).all()):
        return None
    bad = ~torch.isfinite(out)
    local = out64[bad] if out64.shape == out.shape else None
    ev = Evidence(dtype=out.dtype, bad=bad, inputs=[x.double()], input_dtypes=[x.dtype],
                  elementwise=[False], exp_made=[False], local64=local, others=[])
    # (no ``param``: a parameter's advice is for its values, a determinant is the matrix's)
    return OpHit(f"aten.{func.__name__}", "nan", user_source(), float(x.min()),
                 float(x.max()), False, occurrence, True, evidence=ev,
                 rows=f.batch_rows([out]), within=f.where)
