"""The advice for a log of a negative number.

``log(x)`` below 0 is often a quantity that should have stayed positive (a probability past 1
in ``log(1 - p)``, a variance cancelled below 0), where a clamp into the domain is the usual
fix. It is also the classic failure of an interior-point log barrier ``-mu * log(b - g(x))``
evaluated at an infeasible point (a start state or a control past its limit, an iterate a step
took outside): there a clamp hides the violation and gives the barrier no gradient to push
back, so the advice names what keeps the iterate feasible instead.
"""

from __future__ import annotations

CLAMP = ("clamp the op's input into its domain (x.clamp_min(eps) before log) or fix what "
         "drives it out")
ADVICE = CLAMP + ("; for a log barrier's slack, -mu * log(b - g(x)), a clamp hides the "
                  "infeasible point instead: start feasible, keep steps inside (fraction to the "
                  "boundary), or use a relaxed log barrier (quadratic below delta)")
