"""A NaN made before the first op that made a non-finite value of finite inputs.

The op finder blames that first op (``first``) over the op that turned infinities into NaN
(``first_nan``), as the infinity it made is where the NaN's chain starts. When ``first_nan``
ran earlier, of infinities the re-run was given (a loss's input that the model filled with
+inf on purpose, allowed by ``allow_inf``: an n-best list's padded hypotheses, whose
``softmax(-scores)`` over a row with none left is NaN), ``first`` ran later on other values:
fixing it leaves the NaN, so the earlier maker is the origin.
"""

from __future__ import annotations

from .hits import OpHit


def earlier_nan(first: OpHit | None, first_nan: OpHit | None) -> OpHit | None:
    """``first_nan`` when it ran, of non-finite inputs, before ``first``; else None. (A hit
    without its position, ``seq`` 0, is never later than the NaN: the finder keeps it.)"""
    if first is None or first_nan is None or first_nan.inputs_finite:
        return None
    return first_nan if first_nan.seq < first.seq else None
