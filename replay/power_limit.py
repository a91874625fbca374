"""A power transform at its exponent's 0: Box-Cox's ``(y ** lam - 1) / lam`` with ``lam = 0``.

Box-Cox of precipitation or discharge, Tukey's ladder of powers, a generalised logarithm: the
family's member at ``lam = 0`` is ``log(y)``, its limit, which the formula written out cannot
compute (``y ** 0 - 1`` is 0, divided by the 0 exponent: 0/0 in every element). The generic
advice for a division by a Python number of 0 (a setting annealed to 0: keep it away from 0)
misses it: 0 is a valid setting, the branch for it is missing. :class:`PowerAtZero` watches the
ops (fed by :class:`~replay.lineage.Lineage`) for ``pow(x, 0)``, then ``- 1``, then a division
by the number 0; :func:`with_power_limit` then gives that hint.
"""

from __future__ import annotations

import torch

from .memo import TensorSet

_POWS = {"pow", "float_power"}
_SHIFTS = {"sub", "rsub", "add"}  # x ** 0 - 1 (rsub: 1 - x ** 0, add: x ** 0 + (-1))
_DIVS = {"div", "true_divide", "divide"}
_CARRY = {"view", "reshape", "_unsafe_view", "select", "slice", "squeeze", "unsqueeze",
          "clone", "expand", "index"}


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class PowerAtZero:
    """Whether a division by the number 0 took ``x ** 0 - 1`` (``found``: its exponent, 0)."""

    def __init__(self):
        self._pow = TensorSet()  # x ** 0 (and views of it)
        self._shifted = TensorSet()  # x ** 0 - 1 (and views of it)
        self.found = False

    def track(self, name: str, args, out) -> None:
        if self.found or not args or not isinstance(out, torch.Tensor):
            return
        x, rest = args[0], [_number(a) for a in args[1:]]
        if name in _POWS and isinstance(x, torch.Tensor) and rest[:1] == [0.0]:
            self._pow.add(out)
        elif name in _CARRY and isinstance(x, torch.Tensor):
            for marks in (self._pow, self._shifted):
                if x in marks:
                    marks.add(out)
        elif name in _SHIFTS and isinstance(x, torch.Tensor) and x in self._pow \
                and rest[:1] == ([-1.0] if name == "add" else [1.0]):
            self._shifted.add(out)
        elif name in _DIVS and isinstance(x, torch.Tensor) and x in self._shifted \
                and rest[:1] == [0.0]:
            self.found = True


def with_power_limit(hint: str | None, cause: str | None, hit,
                     watch: PowerAtZero | None) -> str | None:
    """``hint``, for a division by the number 0 of ``x ** 0 - 1``, replaced by the limit's."""
    if hint is None or watch is None or not watch.found or cause != "invalid" or hit is None \
            or hit.op.removeprefix("aten.") not in _DIVS:
        return hint
    return (f"{hit.op} of 0 by the number 0 (0/0): it divided x ** 0 - 1 by the same exponent "
            "0, a power transform at lam = 0 (Box-Cox's (y ** lam - 1) / lam, Tukey's ladder "
            "of powers, a generalised log), whose value there is the limit log(y), which the "
            "formula written out cannot compute: 0 is a valid setting, so branch on it, "
            "torch.log(y) if lam == 0 else (y ** lam - 1) / lam (as scipy.stats.boxcox does), "
            "rather than keeping lam away from 0")
