"""A NaN made before the first op that made a non-finite value of finite inputs.

The op finder blames that first op (``first``) over the op that turned infinities into NaN
(``first_nan``), as the infinity it made is where the NaN's chain starts. When ``first_nan``
ran earlier, of infinities the re-run was given (a loss's input that the model filled with
+inf on purpose, allowed by ``allow_inf``: an n-best list's padded hypotheses, whose
``softmax(-scores)`` over a row with none left is NaN), ``first`` ran later on other values:
fixing it leaves the NaN, so the earlier maker is the origin. Used for a loss's re-run,
whose result's kind is known.
"""

from __future__ import annotations

from .hits import OpHit


def earlier_nan(first: OpHit | None, first_nan: OpHit | None,
                made: str | None) -> OpHit | None:
    """``first_nan`` when it ran, of non-finite inputs, before ``first`` and the result the
    event checked (``made``) holds NaN; else None. A result without NaN shows the earlier NaN
    was dropped before it (RankNet's ``diff[pair]`` of padded pairs' ``-inf - -inf``), and a
    hit without its position (``seq`` 0) is never later: the finder's order stands."""
    if made != "nan" or first is None or first_nan is None or first_nan.inputs_finite:
        return None
    return first_nan if first_nan.seq < first.seq else None


def dropped_nan(hit: OpHit | None, first: OpHit | None, first_nan: OpHit | None,
                kind: str | None) -> bool:
    """Whether ``hit`` is a NaN made of infinities that the call dropped before its output,
    which holds infinities and no NaN (``kind``): a policy's ``log_softmax`` over a state with
    every action masked, kept out by ``torch.where(moved, lb, 0)``. It is not where that
    output's infinity came from."""
    return (hit is not None and hit is first_nan and first is None and hit.made == "nan"
            and not hit.inputs_finite and kind in ("+inf", "-inf"))
