"""Small parameters holding a negative value that went into a matrix a Cholesky refused.

A variance component, a kernel's amplitude or a noise variance learned as a raw number (GCTA's
REML ``V = s_g K + s_e I``, a GP's ``s_f K + s_n I``, a Kalman filter's diagonal ``Q``) has
nothing keeping it above 0: an SGD step larger than the value takes it below 0, and the
covariance built from it is indefinite at the next forward. :mod:`replay.indefinite`'s advice
(a Hessian's negative curvature, Levenberg-Marquardt) is the wrong one there: the parameter is
out of its domain, which a positive parameterisation (its log, softplus) keeps it inside.
:class:`NegativeScales` follows those parameters (at most ``SMALL`` values each, one negative)
through the ops of a re-run, by storage, as :class:`replay.learned.Learned` follows the
model's state: only through ops that keep the value itself (a log-scale a model takes ``exp``
of is negative by design).
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import tree_leaves
from .domains import g
from .storages import storage_of

SMALL = 16  # a scale parameter: a scalar or a short diagonal, not a weight matrix
# ops that carry a parameter's own value, sign and all, into their result (a scale times a
# kernel, plus a noise times the identity, on a diagonal); not exp or softplus of a log-scale,
# whose negative value is its domain
_CARRY = {"mul", "add", "div", "view", "_unsafe_view", "reshape", "expand", "unsqueeze",
          "squeeze", "clone", "_to_copy", "alias", "detach", "diag_embed", "diag", "select",
          "slice", "t", "transpose", "contiguous", "lift_fresh", "cat", "stack", "repeat"}


class NegativeScales:
    """The model's small parameters negative somewhere as the re-run began, and the storages
    of every tensor an op made from one (the names of those it was made from)."""

    def __init__(self, model: torch.nn.Module):
        self._of: dict[int, set[str]] = {}
        self.values: dict[str, float] = {}
        for name, p in model.named_parameters():
            if p.is_floating_point() and 0 < p.numel() <= SMALL and not p.is_meta \
                    and bool((p < 0).any()) and (s := storage_of(p)) is not None:
                self._of[s] = {name}
                self.values[name] = float(p.detach().min())

    def track(self, name: str, args: Any, out: Any) -> None:
        """After op ``name`` ran: mark ``out`` with the negative parameters it carries (see
        ``_CARRY``; ``div``: its numerator's)."""
        if not self._of or name not in _CARRY:
            return
        names: set[str] = set()
        for t in tree_leaves(args[:1] if name == "div" else args):
            if isinstance(t, torch.Tensor):
                names |= self._of.get(storage_of(t), set())
        if names:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and (s := storage_of(t)) is not None:
                    self._of.setdefault(s, set()).update(names)

    def of(self, t: torch.Tensor | None) -> dict[str, float]:
        """The negative parameters ``t`` was made from, with their most negative value."""
        names = self._of.get(storage_of(t), set()) if t is not None else set()
        return {n: self.values[n] for n in sorted(names)}


def negative_scales_hint(indefinite: str, params: dict[str, float], model=None) -> str:
    """The hint of an indefinite matrix (its :func:`~replay.indefinite.indefinite_hint`'s
    first clause kept) made from the negative parameters ``params``; with ``model``, the
    bound a constraint of theirs declares but no transform enforces, said too."""
    said = ", ".join(f"{n} = {g(v)}" for n, v in params.items())
    head = indefinite.split(", not singular", 1)[0]
    return (f"{head}, built from parameter(s) {said}, below 0: a variance or scale parameter (a "
            "variance component, a kernel amplitude, a noise variance) learned as a raw value, "
            "which an optimizer step larger than it took past 0, so no jitter mends the matrix: "
            "parameterise it to stay positive (s = exp(log_s), softplus(raw) + eps) or clamp it "
            "after each step (with torch.no_grad(): s.clamp_(min=eps)), and lower the learning "
            "rate if it jumped" + _unenforced(model, params))


def _unenforced(model, params: dict[str, float]) -> str:
    """What a parameter's declared but unenforced lower bound says: a GPyTorch constraint
    built with ``transform=None`` (BoTorch's noise ``GreaterThan(1e-4, transform=None)``),
    which only an optimizer given the bounds keeps (``fit_gpytorch_mll``'s L-BFGS-B), not a
    torch optimizer's step."""
    if model is None:
        return ""
    for name in params:
        owner, _, short = name.rpartition(".")
        try:
            constraint = getattr(model.get_submodule(owner), f"{short}_constraint", None)
        except AttributeError:
            continue
        if constraint is None or getattr(constraint, "enforced", True) \
                or not isinstance(low := getattr(constraint, "lower_bound", None), torch.Tensor):
            continue
        return (f". Its constraint {owner}.{short}_constraint ({type(constraint).__name__}, "
                f"lower bound {g(float(low.min()))}) has no transform, so it is only a bound "
                "that an optimizer must be given (BoTorch's fit_gpytorch_mll passes it to "
                "scipy's L-BFGS-B), which a torch optimizer's step ignores: fit with "
                "fit_gpytorch_mll, clamp the raw value to the bound after each step, or "
                "register a constraint with a transform (softplus) in its place")
    return ""
