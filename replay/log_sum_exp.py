"""An exp that overflowed inside a hand-written log-sum-exp: ``log(exp(x).sum())``.

The entropic risk of deep hedging, ``log(mean(exp(-a * pnl))) / a``, a free energy, a soft-min
written from their definitions: the exp overflows for a large exponent although the result,
about ``max(x)``, is small. Or each exp is finite and their sum overflows: a CRF's forward
algorithm written as ``log(sum(exp(alpha + trans + emit)))``, whose log-space ``alpha`` grows
with the sequence's length, so the sums grow call after call over the time steps, which is no
diverging iteration (:data:`MARK` in the hint tells the loop's notes to keep quiet). The general overflow advice (clamp the exponent, lower the learning
rate) would change the objective; the fix is ``torch.logsumexp``, which never forms ``exp(x)``.
:class:`LogSumExp` watches the ops (fed by :class:`~replay.lineage.Lineage`) for a log taken of
a sum or mean of an exp's output; :func:`with_log_sum_exp` then says so in the hint.
"""

from __future__ import annotations

import torch

from .memo import TensorSet
from .upstream import without_diverging

_EXPS = {"exp", "exp2"}
_SUMS = {"sum", "mean", "nansum", "nanmean"}
_LOGS = {"log", "log2", "log10"}
MARK = "a hand-written log-sum-exp"  # (in the hint once it says so)


class LogSumExp:
    """Whether a log took a sum or mean of an exp's output (``found``: the reduction), and
    whether such a reduction of finite exps overflowed (``overflowed``: the reduction)."""

    def __init__(self):
        self._exps, self._sums = TensorSet(), TensorSet()
        self.found: str | None = None
        self.overflowed: str | None = None
        self._reduced = ""

    def track(self, name: str, args, out) -> None:
        if self.found is not None and self.overflowed is not None or not args \
                or not isinstance(x := args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        if name in _EXPS:
            self._exps.add(out)
        elif name in _SUMS and x in self._exps:
            self._sums.add(out)
            self._reduced = name
            if self.overflowed is None and out.is_floating_point() \
                    and bool(torch.isfinite(x).all()) and not bool(torch.isfinite(out).all()):
                self.overflowed = name
        elif name in _LOGS and x in self._sums and self.found is None:
            self.found = self._reduced


def with_log_sum_exp(hint: str | None, cause: str | None, hit,
                     watch: LogSumExp | None) -> str | None:
    """``hint``, for an exp's overflow that a log of its sum or mean took, or for that sum's
    or mean's own overflow of finite exps, with the fix (and without the advice for a
    diverging iteration: a forward algorithm's sums grow with the sequence's length)."""
    if hint is None or watch is None or watch.found is None or cause != "overflow" \
            or hit is None:
        return hint
    op = hit.op.removeprefix("aten.")
    if op in _EXPS:
        reduced, what = watch.found, "of these exps"
    elif op in _SUMS and watch.overflowed == op:
        reduced, what = op, f"of exps, each finite, that this {op} overflowed"
        hint = without_diverging(hint)
    else:
        return hint
    minus = " - log(n)" if reduced in ("mean", "nanmean") else ""
    return (f"{hint}; but here the log takes the {reduced} {what}: {MARK} (an entropic risk, "
            f"a free energy, a soft-min, a CRF's forward algorithm), whose result is "
            f"finite: compute it as torch.logsumexp(x, dim){minus}, which never forms exp(x), "
            "rather than clamping the exponent")
