"""The eps a hint proposes for an update whose eps its weights' dtype rounds to 0, tested first.

Such an update (Adam's 1e-8 in float16 weights) gets the hint "... or set eps=1e-4", float16's
smallest normal's power of ten. An optimizer that scales its eps by a state of its own adds less
than that: Prodigy's and D-Adaptation's denominator is ``sqrt(v) + d * eps``, with ``d``
starting at ``d0 = 1e-6``, so ``1e-4 * 1e-6`` is 0 in float16 as well and the update still
divides 0 by 0 (their ``v`` holds ``d**2 * g**2``, which float16 rounds to 0 too). Where the
bundle re-runs the update (a guard bundle, a rewind window), that eps is re-run before it is
proposed, and a value that does not help is replaced by what it showed.
"""

from __future__ import annotations

from typing import Any

from .load import Step
from .optim import eps_lost, safe_eps
from .whatif import run_tries


def checked_eps(step: Step, report: dict[str, Any]) -> None:
    """Re-run the update with the eps the hint proposes; if it still makes a non-finite
    value, the hint keeps its float32 advice only and says why the eps does not help."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    params = o.get("params") or []
    if report.get("cause") != "optimizer" or not report.get("reproduced") or not params:
        return
    groups = (step.meta.get("optimizer") or {}).get("param_groups", [])
    own = [g for g in groups if set(g.get("params") or ()) & set(params)]
    lost = eps_lost(step, own, params)
    tail = lost and f", or set eps={safe_eps(lost[1])}"
    if not tail or tail not in hint:
        return
    label = tail.removeprefix(", or set ")
    done = [t for t in report.get("what_if") or [] if t.get("try") == label]
    if not done:
        done = run_tries(step, report, [label])
    if not done or done[0].get("finite") is not False:
        return
    made = (done[0].get("origin") or {}).get("kind") or "a non-finite value"
    report["hint"] = hint.replace(tail, (
        f"; {label} does not help (re-run with it, the update still made {made}): the "
        "update adds less than its eps where it divides (Prodigy's and D-Adaptation's "
        "sqrt(v) + d * eps, with d from d0=1e-6), which the weights' dtype rounds to 0 too"))
