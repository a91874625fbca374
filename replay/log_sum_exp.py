"""An exp that overflowed inside a hand-written log-sum-exp: ``log(exp(x).sum())``.

The entropic risk of deep hedging, ``log(mean(exp(-a * pnl))) / a``, a free energy, a soft-min
written from their definitions: the exp overflows for a large exponent although the result,
about ``max(x)``, is small. The general overflow advice (clamp the exponent, lower the learning
rate) would change the objective; the fix is ``torch.logsumexp``, which never forms ``exp(x)``.
:class:`LogSumExp` watches the ops (fed by :class:`~replay.lineage.Lineage`) for a log taken of
a sum or mean of an exp's output; :func:`with_log_sum_exp` then says so in the hint.
"""

from __future__ import annotations

import torch

from .memo import TensorSet

_EXPS = {"exp", "exp2"}
_SUMS = {"sum", "mean", "nansum", "nanmean"}
_LOGS = {"log", "log2", "log10"}


class LogSumExp:
    """Whether a log took a sum or mean of an exp's output (``found``: the reduction)."""

    def __init__(self):
        self._exps, self._sums = TensorSet(), TensorSet()
        self.found: str | None = None
        self._reduced = ""

    def track(self, name: str, args, out) -> None:
        if self.found is not None or not args or not isinstance(x := args[0], torch.Tensor) \
                or not isinstance(out, torch.Tensor):
            return
        if name in _EXPS:
            self._exps.add(out)
        elif name in _SUMS and x in self._exps:
            self._sums.add(out)
            self._reduced = name
        elif name in _LOGS and x in self._sums:
            self.found = self._reduced


def with_log_sum_exp(hint: str | None, cause: str | None, hit,
                     watch: LogSumExp | None) -> str | None:
    """``hint``, for an exp's overflow that a log of its sum or mean took, with the fix."""
    if hint is None or watch is None or watch.found is None or cause != "overflow" \
            or hit is None or hit.op.removeprefix("aten.") not in _EXPS:
        return hint
    minus = " - log(n)" if watch.found in ("mean", "nanmean") else ""
    return (f"{hint}; but here the log takes the {watch.found} of these exps: a hand-written "
            f"log-sum-exp (an entropic risk, a free energy, a soft-min), whose result is "
            f"finite: compute it as torch.logsumexp(x, dim){minus}, which never forms exp(x), "
            "rather than clamping the exponent")
