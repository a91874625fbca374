"""A diverging run whose optimizer is LBFGS without a line search.

``torch.optim.LBFGS`` defaults to ``line_search_fn=None``: each inner iteration takes the
quasi-Newton direction at the full learning rate, however poor the curvature estimate from a
few steps is, so a GLM fitted the way statistics packages fit it (a Poisson point process, a
logistic regression, with ``lr=1``) overshoots into ``exp`` of a huge linear predictor. The
growth hint's remedy (lower the learning rate, clip the gradients) is the wrong knob there:
LBFGS clips nothing, and a strong-Wolfe line search is what bounds each step.
"""

from __future__ import annotations

import torch

ADVICE = ("torch.optim.LBFGS here runs without a line search (line_search_fn=None), so each "
          "of its inner iterations takes the quasi-Newton step at the full learning rate: "
          "pass line_search_fn=\"strong_wolfe\", which accepts a step only where the loss "
          "decreases enough (or lower lr, fewer max_iter)")


def no_line_search_advice(step) -> str | None:
    """:data:`ADVICE` when the rebuilt optimizer is LBFGS with no line search."""
    opt = getattr(step, "optimizer", None)
    if not isinstance(opt, torch.optim.LBFGS):
        return None
    return ADVICE if all(g.get("line_search_fn") is None for g in opt.param_groups) else None
