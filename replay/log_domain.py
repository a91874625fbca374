"""The advice for a log of a negative number.

``log(x)`` below 0 is often a quantity that should have stayed positive (a probability past 1
in ``log(1 - p)``, a variance cancelled below 0), where a clamp into the domain is the usual
fix. It is also the classic failure of an interior-point log barrier ``-mu * log(b - g(x))``
evaluated at an infeasible point (a start state or a control past its limit, an iterate a step
took outside): there a clamp hides the violation and gives the barrier no gradient to push
back, so the advice names what keeps the iterate feasible instead.
"""

from __future__ import annotations

ADVICE = ("clamp the op's input into its domain (x.clamp_min(eps) before log) or fix what "
          "drives it out; where it is a constraint's slack, a log barrier -mu * log(b - g(x)) "
          "taken at an infeasible point (a start state or control past its limit, a step that "
          "left the feasible set), a clamp would hide the violation and leave it no gradient: "
          "start feasible (project the initial state or controls inside), keep the steps "
          "inside (a fraction-to-the-boundary line search), or extend the barrier below a "
          "threshold (a relaxed log barrier, quadratic under delta)")
